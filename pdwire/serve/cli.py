"""``pdwire serve prefill|decode``: one role of a PD deployment per process.

::

    pdwire serve prefill --engine-id prefill-a --tp 2 --bind 0.0.0.0:17000 --advertise 10.0.0.1 \\
        --backend mooncake --discovery etcd://10.0.0.5:2379/pdwire

Settings: :mod:`.config`; the clean stop on SIGTERM or SIGINT: docs/deployment.md. A second
SIGINT exits at once (a repeated SIGTERM does not: supervisors often signal twice).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import fields
from typing import Any

from pdwire.serve.config import MemorySettings, ServeConfig, ServeConfigError, build_config, load_file

# (flag, the setting it sets, type (None: a switch), help); the settings are ServeConfig's fields
_FLAGS: tuple[tuple[str, str, type | None, str | None], ...] = (
    ("--engine-id", "engine_id", str, "the engine these ranks belong to"),
    ("--tp", "tp", int, "the engine's TP size (default 1)"),
    ("--ranks", "ranks", str, "prefill: the TP ranks this process runs, e.g. 0,1 (default all)"),
    ("--backend", "backend", str, "transfer engine: nixl, mooncake, local (default nixl when it imports)"),
    ("--bind", "bind", str,
     "HOST[:PORT] the control sockets bind (rank r: PORT + r; 0: any; env PDWIRE_BIND)"),
    ("--advertise", "advertise", str,
     "HOST[:PORT] peers connect to (env PDWIRE_ADVERTISE; default: the bind host)"),
    ("--discovery", "discovery", str,
     "etcd://HOST:PORT[/PREFIX][?ttl=S] or static:FILE (env PDWIRE_DISCOVERY)"),
    ("--room-timeout", "room_timeout_s", float, "seconds a room may take (default 30)"),
    ("--transfer-timeout", "transfer_timeout_s", float, "seconds one transfer may take"),
    ("--handshake-timeout", "handshake_timeout_s", float, "decode: seconds per handshake"),
    ("--chunk-pages", "chunk_pages", int, "prefill: pages per chunked-prefill chunk"),
    ("--admin", "admin", str, "decode: UNIX socket path for status/run/stop commands (JSON)"),
    ("--requests", "requests", int, "decode: run this many requests once a prefill engine is connected"),
    ("--min-tokens", "min_tokens", int, None),
    ("--max-tokens", "max_tokens", int, None),
    ("--exit-after", "exit_after", None, "decode: stop after --requests"),
    ("--log-level", "log_level", str, "debug, info (default), warning, error"),
    ("--control-keys", "control_keys", str,
     "the control plane's key directory (`pdwire keys generate DIR`; env PDWIRE_CONTROL_KEYS)"),
    ("--insecure-control", "insecure_control", None,
     "run the control plane unauthenticated (no CURVE): any process reaching a port is a peer"),
)  # fmt: skip
_MEMORY_FLAGS = tuple(f.name for f in fields(MemorySettings))


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run one role (prefill or decode ranks) of a deployment: endpoints, discovery, clean stop",
        description=__doc__.split("::")[0].strip() if __doc__ else None,
    )
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--config", help="YAML file with any of the settings below (flags win)")
    for flag, dest, kind, text in _FLAGS:
        if kind is None:
            p.add_argument(flag, dest=dest, action="store_const", const=True, help=text)
        else:
            p.add_argument(flag, dest=dest, type=kind, help=text)
    p.add_argument(
        "--backend-option", action="append", default=[], metavar="NAME=VALUE",
        help="a backend option (repeatable; see --list-backend-options)",
    )  # fmt: skip
    p.add_argument("--list-backend-options", action="store_true", help="print the backend's options and exit")
    p.add_argument(
        "--prefill", action="append", metavar="ENGINE=tcp://H:P[,tcp://H:P]",
        help="decode without a registry: a prefill engine's control endpoints by TP rank (repeatable)",
    )  # fmt: skip
    m = p.add_argument_group("memory (a registered memory model; `pdwire serve` ships `demo`)")
    m.add_argument("--memory-model", dest="memory_model", help="the memory model to serve (default demo)")
    m.add_argument("--mla", dest="memory_mla", action="store_const", const=True, help="MLA model")
    m.add_argument("--kv-heads", "--heads", dest="memory_kv_heads", type=int, help="KV heads (divide by TP)")
    for name in _MEMORY_FLAGS:
        if name not in ("model", "mla", "kv_heads"):
            m.add_argument("--" + name.replace("_", "-"), dest=f"memory_{name}", type=int)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeConfig:
    return build_config(
        args.role,
        file=load_file(args.config) if args.config else None,
        flags={dest: getattr(args, dest) for _, dest, _, _ in _FLAGS} | {"prefill": args.prefill},
        backend_option_flags=args.backend_option,
        memory_flags={name: getattr(args, f"memory_{name}") for name in _MEMORY_FLAGS},
        environ=environ,
        file_name=args.config or "config file",
    )


def _setup_logging(cfg: ServeConfig) -> None:
    label = f"{cfg.role} {cfg.engine_id}"
    if cfg.role == "prefill" and cfg.ranks:
        label += f" ranks {','.join(map(str, cfg.ranks))}"
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper()),
        format=f"%(asctime)s.%(msecs)03d {label} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ServeConfigError as exc:
        print(f"pdwire serve {args.role}: {exc}", file=sys.stderr)
        return 2
    if args.list_backend_options:
        from pdwire.runtime.backends import default_backend
        from pdwire.runtime.backends.options import describe

        name = cfg.backend or default_backend()
        print(f"options of backend {name!r}:\n{describe(name)}")
        return 0
    _setup_logging(cfg)
    log = logging.getLogger("pdwire.serve")
    from pdwire import wire
    from pdwire.discovery import DiscoveryError, open_discovery, parse_engine_flag

    try:
        static = [e for text in cfg.prefill for e in parse_engine_flag(wire.Role.PREFILL, text)]
        roles = (wire.Role.PREFILL,) if cfg.role == "decode" else ()
        discovery = open_discovery(cfg.discovery, roles=roles, static=static)
    except (DiscoveryError, ValueError) as exc:
        log.error("discovery: %s", exc)
        return 2
    if cfg.role == "decode" and not cfg.discovery and not static:
        log.warning("no --discovery and no --prefill list: no prefill engine will ever be found")
    from pdwire.runtime import engine as pd
    from pdwire.runtime.backends import BackendError

    try:
        if cfg.role == "prefill":
            from pdwire.serve.prefill import PrefillServer

            server: Any = PrefillServer(cfg, discovery)
        else:
            from pdwire.serve.decode import DecodeServer

            server = DecodeServer(cfg, discovery)
    except (pd.ConfigError, BackendError, ValueError, OSError) as exc:
        log.error("cannot start: %s: %s", type(exc).__name__, exc)
        discovery.close()
        return 2

    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if stopping and signum == signal.SIGINT:
            os._exit(130)  # a second Ctrl-C: at once
        if not stopping:
            log.info("%s: stopping (Ctrl-C again to exit at once)", signal.Signals(signum).name)
        stopping.append(signum)  # a repeated SIGTERM (a supervisor signalling the group) changes nothing
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status: int = server.serve()
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)  # skip engine atexit hooks that can hang on a torn-down peer

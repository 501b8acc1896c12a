"""``pdwire serve prefill|decode``: one role of a PD deployment per process.

::

    pdwire serve prefill --engine-id prefill-a --tp 2 --bind 0.0.0.0:17000 --advertise 10.0.0.1 \\
        --backend mooncake --discovery etcd://10.0.0.5:2379/pdwire
    pdwire serve decode --engine-id decode-a --tp 4 --advertise 10.0.0.2 \\
        --backend mooncake --discovery etcd://10.0.0.5:2379/pdwire --admin /run/pdwire/decode-a.sock

Settings come from ``--config FILE`` (YAML), the environment (``PDWIRE_DISCOVERY``,
``PDWIRE_BACKEND_OPTIONS``, ``PDWIRE_BIND``, ``PDWIRE_ADVERTISE``) and flags, flags winning
(:mod:`.config`). Logs go to stderr, one line per event. SIGTERM or SIGINT stops cleanly:
withdraw from discovery, abort live rooms, wait until no transfer is in flight and every
slot is released (bounded), close the backends (their shared-memory files with them); a
second SIGINT exits at once (a repeated SIGTERM does not: supervisors often signal twice).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from pdwire.serve.config import ServeConfig, ServeConfigError, build_config, load_file

_MEMORY_FLAGS = (
    "model",
    "layers",
    "kv_heads",
    "head_dim",
    "page_size",
    "mla",
    "pages",
    "slots",
    "swa_pages",
    "aux_items",
    "seed",
)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run one role (prefill or decode ranks) of a deployment: endpoints, discovery, clean stop",
        description=__doc__.split("::")[0].strip() if __doc__ else None,
    )
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--config", help="YAML file with any of the settings below (flags win)")
    p.add_argument("--engine-id", dest="engine_id", help="the engine these ranks belong to")
    p.add_argument("--tp", type=int, help="the engine's TP size (default 1)")
    p.add_argument("--ranks", help="prefill: the TP ranks this process runs, e.g. 0,1 (default all)")
    p.add_argument("--backend", help="transfer engine: nixl, mooncake, local (default nixl when it imports)")
    p.add_argument(
        "--backend-option", action="append", default=[], metavar="NAME=VALUE",
        help="a backend option (repeatable; see --list-backend-options)",
    )  # fmt: skip
    p.add_argument("--list-backend-options", action="store_true", help="print the backend's options and exit")
    p.add_argument(
        "--bind", help="HOST[:PORT] the control sockets bind (rank r: PORT + r; 0: any; env PDWIRE_BIND)"
    )
    p.add_argument(
        "--advertise", help="HOST[:PORT] peers connect to (env PDWIRE_ADVERTISE; default: the bind host)"
    )
    p.add_argument(
        "--discovery", help="etcd://HOST:PORT[/PREFIX][?ttl=S] or static:FILE (env PDWIRE_DISCOVERY)"
    )
    p.add_argument(
        "--prefill", action="append", metavar="ENGINE=tcp://H:P[,tcp://H:P]",
        help="decode without a registry: a prefill engine's control endpoints by TP rank (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--room-timeout", dest="room_timeout_s", type=float, help="seconds a room may take (default 30)"
    )
    p.add_argument(
        "--transfer-timeout", dest="transfer_timeout_s", type=float, help="seconds one transfer may take"
    )
    p.add_argument(
        "--handshake-timeout", dest="handshake_timeout_s", type=float, help="decode: seconds per handshake"
    )
    p.add_argument(
        "--chunk-pages", dest="chunk_pages", type=int, help="prefill: pages per chunked-prefill chunk"
    )
    p.add_argument("--admin", help="decode: UNIX socket path for status/run/stop commands (JSON)")
    p.add_argument(
        "--requests", type=int, help="decode: run this many requests once a prefill engine is connected"
    )
    p.add_argument("--min-tokens", dest="min_tokens", type=int)
    p.add_argument("--max-tokens", dest="max_tokens", type=int)
    p.add_argument(
        "--exit-after",
        dest="exit_after",
        action="store_const",
        const=True,
        help="decode: stop after --requests",
    )
    p.add_argument("--log-level", dest="log_level", help="debug, info (default), warning, error")
    p.add_argument(
        "--control-keys",
        dest="control_keys",
        help="the control plane's key directory (`pdwire keys generate DIR`; env PDWIRE_CONTROL_KEYS)",
    )
    p.add_argument(
        "--insecure-control",
        dest="insecure_control",
        action="store_const",
        const=True,
        help="run the control plane unauthenticated (no CURVE): any process reaching a port is a peer",
    )
    m = p.add_argument_group("memory (a registered memory model; `pdwire serve` ships `demo`)")
    for name in _MEMORY_FLAGS:
        flag = "--" + name.replace("_", "-")
        if name == "model":
            m.add_argument(
                "--memory-model", dest="memory_model", help="the memory model to serve (default demo)"
            )
        elif name == "mla":
            m.add_argument(flag, dest=f"memory_{name}", action="store_const", const=True, help="MLA model")
        elif name == "kv_heads":
            m.add_argument(flag, "--heads", dest=f"memory_{name}", type=int, help="KV heads (divide by TP)")
        else:
            m.add_argument(flag, dest=f"memory_{name}", type=int)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeConfig:
    flags = {
        k: getattr(args, k)
        for k in (
            "engine_id", "tp", "ranks", "backend", "bind", "advertise", "discovery", "prefill",
            "room_timeout_s", "transfer_timeout_s", "handshake_timeout_s", "chunk_pages", "admin",
            "requests", "min_tokens", "max_tokens", "exit_after", "log_level",
            "control_keys", "insecure_control",
        )
    }  # fmt: skip
    file = load_file(args.config) if args.config else None
    memory = {name: getattr(args, f"memory_{name}") for name in _MEMORY_FLAGS}
    return build_config(
        args.role,
        file=file,
        flags=flags,
        backend_option_flags=args.backend_option,
        memory_flags=memory,
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

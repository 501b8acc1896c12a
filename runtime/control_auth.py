"""The control plane's keys: who a rank is on its ZMQ sockets and whom it lets in (ZeroMQ CURVE).

:class:`ControlAuth` is a value: this rank's CURVE keypair, the client keys a prefill rank
accepts and the key a decode rank expects its prefill ranks to hold. Keys are Z85 text (40
characters, ZeroMQ's own form). The workers apply it to their sockets at the edge
(:mod:`pdwire.runtime.workers.control_auth`): a prefill ROUTER is a CURVE server whose ZAP
handler admits exactly ``authorized``; a decode DEALER is a CURVE client of ``server_key``.

A key directory (``pdwire keys generate DIR``) holds one deployment keypair, ``control.key``
(public) and ``control.key_secret`` (both halves, mode 0600), in ZeroMQ's certificate format.
Every rank of the deployment is given the directory: its ranks present that key, accept it,
and expect it of their prefill ranks. Further public keys dropped into the directory
(``*.key``) are accepted as well (another deployment's decode ranks, a key being rotated in);
a ``server.key`` names the prefill ranks' key when they hold another keypair than this one.

Per-rank keys (optional): an ``identities`` file in the directory binds decode identities to
their own public keys, one line each, ``decode ENGINE_ID RANK KEY`` (``RANK`` an engine-wide
rank, or ``*`` for every rank of the engine; ``#`` starts a comment line). A prefill rank then
refuses a registration naming a bound identity from any other key, and a registration from a
bound key naming any identity it is not bound to (:meth:`ControlAuth.identity_refusal`); bound
keys are admitted at the socket. ``pdwire keys bind DIR ENGINE_ID RANK RANKDIR`` makes a rank's
own key directory and adds its line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from pdwire.runtime.config import ConfigError

KEY_NAME = "control"  # control.key / control.key_secret in a key directory
SERVER_KEY_FILE = "server.key"
IDENTITIES_FILE = "identities"  # per-rank keys: decode identity -> its public key
BOUND_ROLES = ("decode",)  # prefill ranks are CURVE servers: decode ranks name their key (server.key)

ENV_KEYS = "PDWIRE_CONTROL_KEYS"
"""A key directory every worker of this process uses when its config names no keys."""
ENV_INSECURE = "PDWIRE_INSECURE_CONTROL"
"""``1``: workers whose config names no keys run an unauthenticated control plane (tests, a
laptop). Without it and without keys a worker refuses to start."""


class KeyFileError(ConfigError):
    """A key or key directory that cannot be used; names the file or field."""


def check_key(key: object, what: str) -> bytes:
    """A Z85 CURVE key (40 characters; bytes or text) as bytes, or :class:`KeyFileError`."""
    if isinstance(key, str):
        key = key.encode("ascii", "replace")
    if not isinstance(key, bytes) or len(key) != 40:
        raise KeyFileError(f"{what} must be a 40-character Z85 CURVE key, got {key!r:.60}")
    try:
        raw = zmq.utils.z85.decode(key)
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"{what} is not Z85 text: {exc}") from None
    if len(raw) != 32:
        raise KeyFileError(f"{what} does not decode to 32 bytes")
    return key


@dataclass(frozen=True)
class ControlAuth:
    """This rank's CURVE keypair and whom it trusts. ``authorized`` (prefill: the client keys it
    admits) and ``server_key`` (decode: the key its prefill ranks must hold) default to this
    rank's own public key: one deployment keypair shared by every rank."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    authorized: frozenset[bytes] = frozenset()
    server_key: bytes | None = None
    # per-rank keys: (engine id, engine-wide rank or None for every rank) -> the keys it may use
    bindings: Mapping[tuple[str, int | None], frozenset[bytes]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", check_key(self.public_key, "ControlAuth.public_key"))
        object.__setattr__(self, "secret_key", check_key(self.secret_key, "ControlAuth.secret_key"))
        if zmq.curve_public(self.secret_key) != self.public_key:
            raise KeyFileError("ControlAuth.secret_key does not belong to ControlAuth.public_key")
        keys = frozenset(check_key(k, "ControlAuth.authorized") for k in self.authorized)
        object.__setattr__(self, "authorized", keys or frozenset({self.public_key}))
        server = self.public_key if self.server_key is None else self.server_key
        object.__setattr__(self, "server_key", check_key(server, "ControlAuth.server_key"))
        bindings = {
            who: frozenset(check_key(k, f"ControlAuth.bindings[{who}]") for k in keys)
            for who, keys in self.bindings.items()
        }
        object.__setattr__(self, "bindings", bindings)
        bound = frozenset().union(*bindings.values()) if bindings else frozenset()
        object.__setattr__(self, "authorized", self.authorized | bound)  # bound keys get in

    def admits(self, key: bytes) -> bool:
        return key in self.authorized

    def identity_refusal(self, engine_id: str, rank: int, key: bytes | None) -> str | None:
        """Why the decode rank (``engine_id``, ``rank``) may not register with CURVE key ``key``
        (Z85; None: no authentication) under :attr:`bindings`; None when it may. A bound
        identity only with one of its keys; a bound key only for the identities it is bound to.
        Identities and keys no binding names are left to the admitted keys alone."""
        if not self.bindings:
            return None
        none: frozenset[bytes] = frozenset()
        own = self.bindings.get((engine_id, rank), none) | self.bindings.get((engine_id, None), none)
        if own:
            if key in own:
                return None
            shown = "no CURVE key" if key is None else f"CURVE key {key.decode('ascii', 'replace')}"
            return (
                f"decode {engine_id}/{rank} is bound to its own key in the key directory's "
                f"{IDENTITIES_FILE}; this connection authenticated with {shown}"
            )
        claims = sorted(f"{e}/{'*' if r is None else r}" for (e, r), ks in self.bindings.items() if key in ks)
        if claims:
            return (
                f"CURVE key {key.decode('ascii', 'replace') if key else ''} is bound to {', '.join(claims)} "
                f"in the key directory's {IDENTITIES_FILE}, not to decode {engine_id}/{rank}"
            )
        return None

    @classmethod
    def generate(cls) -> ControlAuth:
        """A fresh keypair, trusting itself only (tests, a one-off demo cluster)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> ControlAuth:
        """The keys of a key directory (see the module notes)."""
        root = Path(path)
        secret_file = root / f"{KEY_NAME}.key_secret"
        if not secret_file.is_file():
            raise KeyFileError(
                f"{root}: no {secret_file.name} (create one with `pdwire keys generate {root}`)"
            )
        mode = secret_file.stat().st_mode & 0o077
        if mode:
            raise KeyFileError(f"{secret_file} is readable by others (mode {oct(mode)}); chmod 600 it")
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise KeyFileError(f"{secret_file}: {exc}") from None
        if secret is None:
            raise KeyFileError(f"{secret_file} holds no secret key")
        authorized = {public}
        for cert in sorted(root.glob("*.key")):
            if cert.name == SERVER_KEY_FILE:
                continue
            try:
                authorized.add(zmq.auth.load_certificate(cert)[0])
            except (OSError, ValueError) as exc:
                raise KeyFileError(f"{cert}: {exc}") from None
        server: bytes | None = None
        if (root / SERVER_KEY_FILE).is_file():
            server = zmq.auth.load_certificate(root / SERVER_KEY_FILE)[0]
        bindings = read_identities(root / IDENTITIES_FILE)
        return cls(public, secret, frozenset(authorized), server, bindings)


def read_identities(path: Path) -> dict[tuple[str, int | None], frozenset[bytes]]:
    """The bindings of an ``identities`` file (see the module notes); none when it is absent.
    A malformed line is a :class:`KeyFileError` naming the file, the line and what is wrong."""
    if not path.is_file():
        return {}
    out: dict[tuple[str, int | None], set[bytes]] = {}
    for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{path}:{n}"
        if len(words) != 4:
            raise KeyFileError(f"{where}: want `decode ENGINE_ID RANK KEY`, got {len(words)} fields")
        role, engine, rank_text, key = words
        if role not in BOUND_ROLES:
            raise KeyFileError(
                f"{where}: role {role!r}: only {', '.join(BOUND_ROLES)} ranks are bound to keys "
                f"(prefill ranks are CURVE servers; decode ranks name their key in {SERVER_KEY_FILE})"
            )
        if rank_text == "*":
            rank: int | None = None
        elif rank_text.isdigit():
            rank = int(rank_text)
        else:
            raise KeyFileError(f"{where}: rank {rank_text!r} is not an engine-wide rank or *")
        out.setdefault((engine, rank), set()).add(check_key(key, where))
    return {who: frozenset(keys) for who, keys in out.items()}


def generate_directory(path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a new deployment keypair into ``path`` (created, mode 0700); the secret file is mode
    0600. Refuses to overwrite an existing keypair unless ``force``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret_file = root / f"{KEY_NAME}.key_secret"
    if secret_file.exists() and not force:
        raise KeyFileError(f"{secret_file} exists; pass --force to replace the deployment's key")
    public_file, secret_path = zmq.auth.create_certificates(root, KEY_NAME)
    os.chmod(secret_path, 0o600)
    return Path(public_file)


# --------------------------------------------------------------------------- `pdwire keys`


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("keys", help="create or show the control plane's CURVE keys")
    sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    g = sub.add_parser("generate", help="write a new deployment keypair into DIR (give DIR to every rank)")
    g.add_argument("dir")
    g.add_argument("--force", action="store_true", help="replace an existing keypair")
    g.set_defaults(func=_generate)
    s = sub.add_parser("show", help="check DIR and print the keys it makes a rank use (public halves)")
    s.add_argument("dir")
    s.set_defaults(func=_show)
    b = sub.add_parser(
        "bind",
        help="give one decode rank its own key: write its key directory RANK_DIR, bind it in DIR/identities",
    )
    b.add_argument("dir", help="the deployment's key directory (prefill ranks read its identities)")
    b.add_argument("engine_id")
    b.add_argument("rank", help="the engine-wide rank, or * for every rank of the engine")
    b.add_argument("rank_dir", help="the new key directory to give that rank")
    b.set_defaults(func=_bind)


def _generate(args: argparse.Namespace) -> int:
    try:
        public = generate_directory(args.dir, force=args.force)
    except KeyFileError as exc:
        print(f"pdwire keys: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {public} and {public}_secret; give {args.dir} to every rank ({ENV_KEYS}={args.dir})")
    return 0


def _show(args: argparse.Namespace) -> int:
    try:
        auth = ControlAuth.from_directory(args.dir)
    except KeyFileError as exc:
        print(f"pdwire keys: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {auth.public_key.decode()}")
    print(f"server key: {auth.server_key.decode() if auth.server_key else ''}")
    for key in sorted(auth.authorized):
        print(f"authorized: {key.decode()}")
    for (engine, rank), keys in sorted(auth.bindings.items(), key=lambda kv: (kv[0][0], kv[0][1] or -1)):
        for key in sorted(keys):
            print(f"bound: decode {engine} {'*' if rank is None else rank} {key.decode()}")
    return 0


def bind_rank(
    root: str | os.PathLike[str], engine_id: str, rank: str, rank_dir: str | os.PathLike[str]
) -> bytes:
    """A new keypair for one decode rank in ``rank_dir`` (expecting the prefill ranks' key of
    ``root``), bound to (``engine_id``, ``rank``) by a line appended to ``root``'s identities
    file; returns its public key. Checks the line before writing anything."""
    deployment = ControlAuth.from_directory(root)
    if not engine_id or any(c.isspace() for c in engine_id) or engine_id.startswith("#"):
        raise KeyFileError(f"engine id {engine_id!r}: a bound engine id has no spaces and no leading #")
    if rank != "*" and not rank.isdigit():
        raise KeyFileError(f"rank {rank!r} is not an engine-wide rank or *")
    generate_directory(rank_dir)
    assert deployment.server_key is not None
    server_cert = Path(rank_dir) / SERVER_KEY_FILE
    server_cert.write_text(f'curve\n    public-key = "{deployment.server_key.decode()}"\n', "utf-8")
    public = ControlAuth.from_directory(rank_dir).public_key
    with open(Path(root) / IDENTITIES_FILE, "a", encoding="utf-8") as f:
        f.write(f"decode {engine_id} {rank} {public.decode()}\n")
    return public


def _bind(args: argparse.Namespace) -> int:
    try:
        public = bind_rank(args.dir, args.engine_id, args.rank, args.rank_dir)
    except KeyFileError as exc:
        print(f"pdwire keys: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.rank_dir} (key {public.decode()}); decode {args.engine_id} {args.rank} is bound to it "
        f"in {Path(args.dir) / IDENTITIES_FILE}: give {args.rank_dir} to that rank only"
    )
    return 0

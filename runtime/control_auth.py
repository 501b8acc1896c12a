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
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from pdwire.runtime.config import ConfigError

KEY_NAME = "control"  # control.key / control.key_secret in a key directory
SERVER_KEY_FILE = "server.key"

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", check_key(self.public_key, "ControlAuth.public_key"))
        object.__setattr__(self, "secret_key", check_key(self.secret_key, "ControlAuth.secret_key"))
        if zmq.curve_public(self.secret_key) != self.public_key:
            raise KeyFileError("ControlAuth.secret_key does not belong to ControlAuth.public_key")
        keys = frozenset(check_key(k, "ControlAuth.authorized") for k in self.authorized)
        object.__setattr__(self, "authorized", keys or frozenset({self.public_key}))
        server = self.public_key if self.server_key is None else self.server_key
        object.__setattr__(self, "server_key", check_key(server, "ControlAuth.server_key"))

    def admits(self, key: bytes) -> bool:
        return key in self.authorized

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
        return cls(public, secret, frozenset(authorized), server)


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
    return 0

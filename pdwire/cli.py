"""The `pdwire` console command.

Each sub-command lives in the module that owns it and exposes
``register(subparsers) -> None``; the parser it adds sets ``func`` (taking the parsed
namespace, returning an exit code). Only the module of the command being run is
imported, so `pdwire codegen` never pays for torch or a transfer engine, and the
top-level help lists the commands from the table below without importing any of them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

# command name -> (module that registers it, one-line summary for the top-level help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("pdwire.demo.cli", "move a hybrid model's KV and state between processes, checked"),
    "serve": ("pdwire.serve_command", "run one role (prefill or decode ranks) of a PD deployment"),
    "keys": ("pdwire.runtime.control_auth", "create the control plane's CURVE keys (`keys generate DIR`)"),
    "ctl": ("pdwire.serve.admin", "send status/run/stop to a decode server's admin socket"),
    "codegen": ("pdwire.codegen.cli", "generate the wire codecs from the YAML schemas (--check: verify)"),
    "schema": ("pdwire.codegen.diff_cli", "schema tools: `schema diff OLD NEW` classifies every change"),
    "reference": ("pdwire.codegen.reference_cli", "print a summary of the wire reference"),
    "inspect": ("pdwire.protocols.inspect", "decode captured pdwire or SGLang control messages"),
}


# a module a command needs that a plain `pip install pdwire` lacks -> the extra that brings it
EXTRAS: dict[str, str] = {
    "torch": "demo",
    "nixl": "engines",
    "mooncake": "engines",
    "etcd3gw": "etcd",
    "vllm": "vllm",
    "sglang": "sglang",
}
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """One line naming the extra that brings the module ``exc`` is about (None: not one of ours)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    first = f" (the CPU build first: {CPU_TORCH})" if extra in ("demo", "engines", "vllm", "sglang") else ""
    return f"needs {top}, which is not installed: pip install 'pdwire[{extra}]'{first}"


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print pdwire's version and wire versions")

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from pdwire import __version__, wire

        versions = ", ".join(f"{a}.{b}" for a, b in wire.VERSIONS)
        print(f"pdwire {__version__} (wire protocol versions {versions}; Python {sys.version.split()[0]})")
        parser.exit(0)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command`` fully registered; the others only listed by name."""
    parser = argparse.ArgumentParser(
        prog="pdwire", description="Versioned PD-disaggregation control protocol and transfer runtime."
    )
    parser.add_argument("--version", action=_Version)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        if name == command:
            importlib.import_module(module_name).register(subparsers)
        else:
            subparsers.add_parser(name, help=summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args_list if not a.startswith("-")), None)
    command = first if first in COMMANDS else None
    try:
        parser = build_parser(command)
        args = parser.parse_args(args_list)
        func = getattr(args, "func", None)
        if func is None:
            parser.print_help()
            return 2
        return int(func(args))
    except ModuleNotFoundError as exc:
        line = missing_extra(exc)
        if line is None:
            raise
        print(f"pdwire {command or ''}: {line}".replace("  ", " "), file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of our output went away (`pdwire reference | head`): not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 0

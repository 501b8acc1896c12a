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

# command name -> (module that registers it, one-line summary for the top-level help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("pdwire.runtime.demo", "move a hybrid model's KV and state between processes, byte-verified"),
    "codegen": ("pdwire.codegen.cli", "generate the wire codecs from the YAML schemas (--check: verify)"),
    "schema": ("pdwire.codegen.diff_cli", "schema tools: `schema diff OLD NEW` classifies every change"),
    "reference": ("pdwire.codegen.reference_cli", "print a summary of the wire reference"),
    "inspect": ("pdwire.wire_inspect", "decode a captured SGLang PD control message"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command`` fully registered; the others only listed by name."""
    parser = argparse.ArgumentParser(
        prog="pdwire", description="Versioned PD-disaggregation control protocol and transfer runtime."
    )
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
    parser = build_parser(first if first in COMMANDS else None)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except BrokenPipeError:
        # the reader of our output went away (`pdwire reference | head`): not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 0

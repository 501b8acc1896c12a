"""The `pdwire` console command.

Each sub-command lives in the module that owns it and exposes
``register(subparsers) -> None``; the parser it adds sets ``func`` (taking the parsed
namespace, returning an exit code). Modules are imported only when their command runs
or when help is printed, so `pdwire codegen` never pays for torch or a transfer engine.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# command name -> module that registers it
COMMANDS: dict[str, str] = {
    "codegen": "pdwire.codegen.cli",
    "schema": "pdwire.codegen.diff_cli",
    "reference": "pdwire.codegen.reference_cli",
    "inspect": "pdwire.wire_inspect",
    "demo": "pdwire.runtime.demo",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdwire", description="Versioned PD-disaggregation control protocol and transfer runtime."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # command not built in this checkout
            raise
        module.register(subparsers)
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
    return int(func(args))

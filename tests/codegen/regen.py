"""Rewrite the golden outputs of every generator fixture case: ``python -m tests.codegen.regen``."""

from __future__ import annotations

import shutil

from tests.codegen.cases import CASES, HERE, render_case


def main() -> None:
    for case in CASES:
        out = HERE / case / "expected"
        shutil.rmtree(out, ignore_errors=True)
        for rel, text in render_case(case).items():
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()

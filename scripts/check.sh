#!/usr/bin/env bash
# Every check CI runs, in order of cost. Called by `./dev test` after set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PDWIRE_VENV:-.venv}"
export PATH="$PWD/$VENV/bin:$PATH"

echo "== generated/ is current"
pdwire codegen --check

echo "== schema compatibility against the previous commit"
if git rev-parse --verify -q HEAD~1 >/dev/null 2>&1; then
    pdwire schema diff HEAD~1 schema
else
    echo "(no previous commit)"
fi

echo "== ruff"
ruff check .
echo "== mypy"
bash scripts/mypy.sh

echo "== pytest"
exec python -m pytest "$@"

#!/usr/bin/env bash
# mypy over the whole pdwire namespace. The repository keeps codegen/, generated/,
# runtime/ and schema/ at top level and maps them into `pdwire.*` at install time, which
# mypy cannot follow; so we check a throw-away tree of symlinks laid out like the
# installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
venv="${PDWIRE_VENV:-.venv}"
case "$venv" in /*) ;; *) venv="$root/$venv" ;; esac
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/pdwire"
for entry in pdwire/*; do
    ln -s "$root/$entry" "$tree/pdwire/$(basename "$entry")"
done
ln -s "$root/codegen" "$tree/pdwire/codegen"
ln -s "$root/generated" "$tree/pdwire/wire"
ln -s "$root/runtime" "$tree/pdwire/runtime"
ln -s "$root/schema" "$tree/pdwire/schema"
cd "$tree"
exec "$venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p pdwire

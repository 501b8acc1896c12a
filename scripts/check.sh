#!/usr/bin/env bash
# Every check CI runs, in order of cost. Called by `./dev test` after set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PDWIRE_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # PDWIRE_VENV may be absolute or relative
export PATH="$VENV/bin:$PATH"
export PDWIRE_VENV="$VENV"  # scripts/mypy.sh runs from another folder

echo "== generated/ is current"
pdwire codegen --check

echo "== schema compatibility against the newest release and the merge base with main"
# schema/releases.toml records each release's commit, so a clone without tags is checked too;
# a release or base this clone lacks fails the step instead of skipping it
pdwire schema gate

echo "== ruff"
ruff check .
ruff format --check --exclude "*.md" .  # Python only: docs keep their hand-wrapped examples
echo "== mypy"
bash scripts/mypy.sh

# tests/vllm/engines runs real vLLM engines from vLLM's own venv (./dev setup_vllm),
# tests/sglang/backend SGLang 0.5.23's real classes from SGLang's (./dev setup_sglang); the main
# venv collects neither (tests/conftest.py). Arguments naming one of those folders (or a file in
# one) run in its venv, others here.
VLLM_VENV="${PDWIRE_VLLM_VENV:-.venv-vllm}"
SGLANG_VENV="${PDWIRE_SGLANG_VENV:-.venv-sglang}"
suites=("tests/vllm/engines:$VLLM_VENV:real vLLM engines" "tests/sglang/backend:$SGLANG_VENV:SGLang 0.5.23")
# Options (-x, -k EXPR, ...) go to every run; test paths pick the venv they run in.
opts=() main_paths=()
declare -A picked=()
prev_takes_value=0
for arg in "$@"; do
    if [ $prev_takes_value = 1 ] || [[ "$arg" == -* ]]; then
        opts+=("$arg")
        case "$arg" in -k|-m|-p|-o|--deselect|--ignore) prev_takes_value=1 ;; *) prev_takes_value=0 ;; esac
        continue
    fi
    matched=0
    for suite in "${suites[@]}"; do
        dir="${suite%%:*}"
        case "$arg" in "$dir"*) picked[$dir]+="$arg"$'\n'; matched=1 ;; esac
    done
    [ $matched = 1 ] || main_paths+=("$arg")
done
any_paths=$(( ${#main_paths[@]} + ${#picked[@]} ))
if [ $any_paths -eq 0 ] || [ ${#main_paths[@]} -gt 0 ]; then
    echo "== pytest"
    python -m pytest "${opts[@]}" "${main_paths[@]}"
fi
for suite in "${suites[@]}"; do
    dir="${suite%%:*}" rest="${suite#*:}"
    venv="${rest%%:*}" what="${rest#*:}"
    paths=()
    if [ $any_paths -eq 0 ]; then
        paths=("$dir")
    elif [ -n "${picked[$dir]:-}" ]; then
        mapfile -t paths < <(printf %s "${picked[$dir]}")
    fi
    [ ${#paths[@]} -gt 0 ] || continue
    echo "== pytest: $what ($venv)"
    "$venv/bin/python" -m pytest "${opts[@]}" "${paths[@]}"
done

#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs a task.
#   bash dev.sh demo     run the demo on the embedded default model
#   bash dev.sh test     run the test suite
#   bash dev.sh bench    run the benchmarks (slow; see benchmarks/README.md)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
STAMP=".venv/.kvboost-setup-$(cat pyproject.toml constraints.txt dev.sh | cksum | cut -d' ' -f1)"

setup() {
    if [ -f "$STAMP" ]; then return; fi
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    # The CPU build of torch first, so nothing pulls a multi-GB CUDA build.
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev,langchain,langchain-tests,llama-index]"
    touch "$STAMP"
}

task=${1:-demo}
shift || true
setup
case "$task" in
    setup) ;;
    demo)  .venv/bin/python -m kvboost_engine.demo "$@" ;;
    test)  .venv/bin/python -m pytest -q "$@" ;;
    bench) .venv/bin/python -m benchmarks "$@" ;;
    *) echo "usage: bash dev.sh [setup|demo|test|bench]" >&2; exit 2 ;;
esac

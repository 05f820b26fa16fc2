#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs a task.
#   bash dev.sh demo     run the demo on the embedded default model
#   bash dev.sh test     run the test suite (notebooks/ included)
#   bash dev.sh bench    run the side-by-side benchmark (python -m benchmarks; --quick for a smoke test,
#                        --readme to rewrite README.md's results from the run)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
HASH=$(cat pyproject.toml constraints.txt dev.sh | cksum | cut -d' ' -f1)
STAMP=".venv/.kvboost-setup-$HASH"

setup() {
    if [ -f "$STAMP" ]; then return; fi
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    # The CPU build of torch first, so nothing pulls a multi-GB CUDA build.
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev,langchain,langchain-tests,llama-index,hf]"
    touch "$STAMP"
}

setup_bench() {
    if [ ! -f ".venv/.kvboost-bench-$HASH" ]; then
        .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[bench]"
        touch ".venv/.kvboost-bench-$HASH"
    fi
}

task=${1:-demo}
shift || true
setup
case "$task" in
    setup) ;;
    demo)  .venv/bin/python -m kvboost_tools.demo "$@" ;;
    test)  .venv/bin/python -m pytest -q "$@" ;;
    bench) setup_bench; .venv/bin/python -m benchmarks "$@" ;;
    *) echo "usage: bash dev.sh [setup|demo|test|bench]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# CI, after the suite: (1) the user install path: build the wheel, check its contents, install it
# into fresh venvs with only [langchain] / only [llama-index], run .ci/wheel_smoke.py in each;
# (2) a smoke subset on the oldest supported transformers (the main run covers the newest).
# Usage: bash .ci/install_checks.sh [wheel|oldest|all]   (default all; timings printed per step)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OLDEST_TRANSFORMERS=${OLDEST_TRANSFORMERS:-4.56.2}
if [ -n "${KVBOOST_CI_WORK:-}" ]; then
    WORK=$KVBOOST_CI_WORK
else                    # a temporary folder of its own (3.8 GB of venvs): removed on exit, pass or fail
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
fi
what=${1:-all}
step() { echo "== $1 ($(date -u +%H:%M:%S))"; }
timed() { local t=$SECONDS; "$@"; echo "   took $((SECONDS - t)) s"; }

fresh_venv() {   # fresh_venv DIR: a venv with the CPU torch (first, so nothing pulls a CUDA build)
    rm -rf "$1"; "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install --quiet --upgrade pip
    "$1/bin/python" -m pip install --quiet "torch==2.13.0"
}

build_wheel() {
    step "build the wheel"
    rm -rf "$WORK/dist"
    timed .venv/bin/python -m pip wheel --quiet --no-deps . -w "$WORK/dist"
    WHEEL=$(ls "$WORK"/dist/kvboost_integrations-*.whl)
    # Only our three packages (plus the wheel's metadata).
    "$PYTHON" - "$WHEEL" <<'PY'
import sys, zipfile
tops = {name.split("/")[0] for name in zipfile.ZipFile(sys.argv[1]).namelist()}
packages = {t for t in tops if not t.endswith(".dist-info")}
assert packages == {"kvboost_engine", "kvboost_integrations", "kvboost_tools"}, sorted(tops)
print("   wheel holds", sorted(packages))
PY
}

wheel_extra() {  # wheel_extra EXTRA
    local venv="$WORK/venv-$1"
    step "fresh venv with only [$1]"
    timed fresh_venv "$venv"
    timed "$venv/bin/python" -m pip install --quiet -c constraints.txt "$WHEEL[$1]"
    step "smoke: $1"
    (cd "$WORK" && timed "$venv/bin/python" "$ROOT/.ci/wheel_smoke.py" "$1")
}

oldest() {
    local venv="$WORK/venv-transformers-$OLDEST_TRANSFORMERS"
    step "fresh venv with transformers $OLDEST_TRANSFORMERS (the oldest supported)"
    timed fresh_venv "$venv"
    grep -v -E '^(transformers|tokenizers|huggingface_hub|sentence-transformers)==' constraints.txt > "$WORK/constraints-oldest.txt"
    timed "$venv/bin/python" -m pip install --quiet -c "$WORK/constraints-oldest.txt" \
        "transformers==$OLDEST_TRANSFORMERS" "huggingface_hub<1" -e ".[dev]"
    step "smoke subset on transformers $OLDEST_TRANSFORMERS"
    # --timeout: transformers 4.x converts the default model's GGUF several times slower than 5.x. The tiny
    # GGUF test files' tokenizer does not load in 4.x: of test_gguf_rope.py, the tests without one
    timed "$venv/bin/python" -m pytest -q -p no:cacheprovider --timeout 2400 tests/test_architectures.py tests/test_rope.py \
        tests/test_prompt.py tests/test_fetch.py \
        "tests/test_gguf_rope.py::test_apply_puts_the_scaling_into_a_config" \
        "tests/test_gguf_rope.py::test_llama3_settings_solve_the_converters_divisors" \
        "tests/test_gguf_rope.py::test_longrope_factors_become_phi3s_settings" \
        "tests/test_engine_exact.py::test_greedy_output_matches_transformers_generate" \
        "tests/test_engine_exact.py::test_partial_chunk_reuse_is_token_exact"
}

start=$SECONDS
if [ "$what" = all ] || [ "$what" = wheel ]; then
    build_wheel
    wheel_extra langchain
    wheel_extra llama-index
fi
if [ "$what" = all ] || [ "$what" = oldest ]; then
    oldest
fi
echo "== install checks done in $(( (SECONDS - start) / 60 )) min"

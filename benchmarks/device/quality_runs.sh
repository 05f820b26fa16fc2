#!/usr/bin/env bash
# Quality runs of the default model on a CUDA machine, all at once: the moved-document regimes
# (issue 14: accuracy and paired SE per configuration, 4 regimes) and the schema conformance run
# (issue 18: 200 schemas under JsonSchema). Accuracy and validity do not depend on the device;
# TTFT figures from this run are GPU figures and say nothing about the CPU.
#
# Needs: PYTHONPATH holding gguf, llguidance and jsonschema (the device tool carries them as
# wheels, see /work/.library/device/README.md), and the default model's GGUF at $GGUF (sha256
# checked). Each run stops starting new questions/schemas after its deadline and says how many
# it did. Results: $OUT/regimes_<regime>.json, $OUT/schemas_gpu.json, $OUT/logs.txt.
#
#   GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf OUT=/tmp/out bash benchmarks/device/quality_runs.sh [minutes]
set -u
minutes=${1:-5}
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
echo "$sha  $GGUF" | sha256sum -c || exit 3
export KVBOOST_DEFAULT_GGUF=$GGUF KVBOOST_BENCH_DEVICE=${KVBOOST_BENCH_DEVICE:-cuda} PYTHONUNBUFFERED=1
export KVBOOST_HOME=${KVBOOST_HOME:-/tmp/kvboost-home}
python3 -c "from kvboost_engine.loading import default_model_dir; print(default_model_dir())" || exit 4
logs=$(mktemp -d)
configs=exact,cache-order,none,blend-0.15,head-16,attention-0.15
for regime in alone groups earlier shared; do
    python3 -m benchmarks.research.moved_regimes --regime "$regime" --questions 200 --configs "$configs" \
        --deadline-min "$minutes" --out "$OUT/regimes_$regime.json" >"$logs/regimes_$regime.log" 2>&1 &
done
python3 -m benchmarks.micro.schemas --schemas 200 --speed-schemas 0 --deadline-min "$minutes" \
    --out "$OUT/schemas_gpu.json" >"$logs/schemas.log" 2>&1 &
wait
for f in "$logs"/*.log; do echo "== $(basename "$f")"; grep -v -i warn "$f" | tail -n 30; done >"$OUT/logs.txt"
nvidia-smi --query-gpu=name,memory.used --format=csv >>"$OUT/logs.txt" 2>&1

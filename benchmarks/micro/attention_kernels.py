"""The native step's attention kernels alone, against the FMA floor of the same CPU (#29).

A harness that includes native/decode.cpp is compiled per runnable instruction-set variant (the
library's own flags, as native/build.py builds it) and times one attention task of the default
model's shape (head_dim 64, 3 query heads per KV head, float32 KV, 256 keys: one KEY_BLOCK):
  shared       attend_shared: 8 rows over the same 256 keys (8 concurrent chats over one prompt)
  one_row_x8   attend_heads 8 times, one row each (8 sequences with nothing shared; no KV asked ahead)
  scores       shared_scores alone (8 rows)
  softmax      block_softmax of the 24 row-heads
  values       shared_values alone (8 rows, as many at a time as attend_shared takes them)
each with the block's KV hot (one block, in L2) and cold (blocks cycled through 256 MB: each read
from DRAM, as in a step). Per task: ns per row-key (one row over one key of its KV head, all 3
query heads), and the FMA floor: the task's vector FMAs (3 heads x head_dim / VW for the scores,
as many for the values) at the FMA throughput measured in the same binary (independent chains).
floor_ratio = time / floor: how far the kernel is from its arithmetic alone.

A note, not a README figure source: it says where a step's attention time goes, for kernel work.
A kernel change that gains here must still be measured on the step (benchmarks.micro.native_steps,
native_context, batching): the cold case here streams contiguous blocks, and the step's memory
behaves otherwise. AVX2's value sums spill their 24 accumulators (16 registers); summed in passes of
4 vectors of columns they went from 1.9x to 1.4x their floor here (every task 8-13 % faster, hot
and cold; logits bit for bit the same), yet a one-row AVX2 step at a 4k context took 12.4-12.7 ms
against 9.8-10.5 (its value loads stalled on memory, perf), and the default int4 model's serial
decode lost 7-21 % (161-181 against 195-210 tok/s, 5 pairs of processes). Asking for each row's
later passes' lines in the first left the step as slow; passes of one head over whole rows were
slower here already. None was kept. What was kept: attend_shared's rows read a block's value rows
pass after pass (in cache after the first), and there AVX2 sums them in key tiles (shared_values'
REREAD: each accumulator loaded and stored once per 3 keys, the same FMAs in the same order), which
made 8 chats over one prompt decode 4 % faster on the step; one row keeps the spilling loop (key
tiles made its attention 7-47 % slower on the step, though its values took 39 % less time here).
Run alone on a quiet machine (about a minute per variant, most of it compiling decode.cpp):
  python -m benchmarks.micro.attention_kernels [--isa avx512,avx2] [--out benchmarks/results/attention_kernels.json]
Smoke: python -m benchmarks.micro.attention_kernels --smoke
"""
from __future__ import annotations

import sys

from .._common import cpu_model, save_result
from . import native_harness

HARNESS = r"""
#include "@SOURCE@"
#include <cstdio>
#include <cstdlib>
#include <time.h>
#define NI __attribute__((noinline))
// Each kernel behind a call of its own, as the library calls it: inlined into main, the compiler kept
// shared_values' accumulators in memory (a store per FMA) and doubled its time.
constexpr int R = 8, H = 3, HD = 64, D = HD / VW, S = KEY_BLOCK;
NI void run_shared(const float* const* q, const float* kb, const float* vb, const int64_t* slots,
                   const int64_t* const* own, const int* n, float* sc, float* kt, float* ps, float* const* out,
                   float* const* ml, const QCodes* qc) {
  attend_shared<KV_F32, D, H>(q, R, HD, kb, vb, slots, S, own, n, HD, 0.125f, sc, kt, ps, out, ml, qc, nullptr, nullptr);
}
NI void run_one(const float* q, const float* kb, const float* vb, const int64_t* slots, float* sc, float* const* out,
                float* const* ml, const QCodes& qc) {
  attend_heads<KV_F32, D, H>(q, HD, kb, vb, slots, HD, S, 0.125f, sc, out, ml, false, qc);
}
NI void run_scores(const float* const* q, const float* kb, const float* vb, const int64_t* slots, float* sc,
                   float* kt, float* ps, const QCodes* qc) {
  shared_scores<KV_F32, D, H>(q, R, HD, kb, vb, slots, HD, 0, S, 0.125f, sc, kt, ps, qc);
}
NI void run_softmax(float* sc, float* const* ml) {
  for (int rh = 0; rh < R * H; ++rh) block_softmax(sc + rh * KEY_BLOCK, S, ml[rh]);
}
constexpr int RV = shared_value_rows<D, H>();   // as attend_shared takes them
NI void run_values(const float* vb, const int64_t* slots, const int64_t* const* own, const int* n, const float* sc,
                   float* const* out) {
  for (int r = 0; r + RV <= R; r += RV)
    shared_values<KV_F32, D, H, RV, true>(vb, slots, S, own + r, n + r, HD, sc + r * H * KEY_BLOCK, out + r * H);
}
// Vector FMAs a second: 12 independent chains (each FMA's inputs kept opaque, so none is merged)
NI double fma_rate(long iters) {
  vf a[12], m = vset1(0.999999f), c = vset1(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = vset1(1.f + i);
  timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) a[i] = opaque(vfma(a[i], m, c));
  clock_gettime(CLOCK_MONOTONIC, &t1);
  float sink = 0.f;
  for (int i = 0; i < 12; ++i) sink += vsum(a[i]);
  if (sink == 12345.f) std::puts("");
  return 12.0 * iters / ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
}
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 2000;
  const int cold_blocks = argc > 2 ? atoi(argv[2]) : 2000;
  std::vector<float> kv(static_cast<size_t>(cold_blocks) * S * HD * 2);
  srand(1);
  for (auto& x : kv) x = rand() / static_cast<float>(RAND_MAX) - 0.5f;
  std::vector<int64_t> slots(S);
  for (int i = 0; i < S; ++i) slots[i] = i;
  std::vector<float> q(R * H * HD);
  for (auto& x : q) x = rand() / static_cast<float>(RAND_MAX) - 0.5f;
  const float* qp[R];
  for (int r = 0; r < R; ++r) qp[r] = q.data() + r * H * HD;
  std::vector<float> sc(R * H * KEY_BLOCK), kt(D * VW * VW), ps(R * H * VW * VW), outb(R * H * HD), mlb(R * H * 2);
  float* out[R * H];
  float* ml[R * H];
  for (int i = 0; i < R * H; ++i) { out[i] = outb.data() + i * HD; ml[i] = mlb.data() + i * 2; }
  const int64_t* own[R];
  int n[R];
  for (int r = 0; r < R; ++r) { own[r] = slots.data(); n[r] = S; }
  QCodes qc[R] = {};
  run_shared(qp, kv.data(), kv.data() + S * HD, slots.data(), own, n, sc.data(), kt.data(), ps.data(), out, ml, qc);
  const double rate = fma_rate(50000000L / VW);
  std::printf("{\"fma_per_s\": %.4g, \"vw\": %d, \"tasks\": [", rate, VW);
  const char* names[] = {"shared", "one_row_x8", "scores", "softmax", "values"};
  const double fmas[] = {2.0 * H * D, 2.0 * H * D, 1.0 * H * D, 0.0, 1.0 * H * D};   // a row-key's vector FMAs
  for (int mode = 0; mode < 5; ++mode)
    for (int cold = 0; cold < 2; ++cold) {
      const int blocks = cold ? cold_blocks : 1;
      double best = 1e9;
      for (int rep = 0; rep < 5; ++rep) {
        const double t0 = now();
        for (int it = 0; it < iters; ++it) {
          const float* kb = kv.data() + static_cast<size_t>(it % blocks) * S * HD * 2;
          const float* vb = kb + S * HD;
          if (mode == 0) run_shared(qp, kb, vb, slots.data(), own, n, sc.data(), kt.data(), ps.data(), out, ml, qc);
          else if (mode == 1) for (int r = 0; r < R; ++r) run_one(qp[r], kb, vb, slots.data(), sc.data(), out + r * H, ml + r * H, qc[0]);
          else if (mode == 2) run_scores(qp, kb, vb, slots.data(), sc.data(), kt.data(), ps.data(), qc);
          else if (mode == 3) run_softmax(sc.data(), ml);
          else run_values(vb, slots.data(), own, n, sc.data(), out);
        }
        best = std::min(best, (now() - t0) / iters);
      }
      const double per = best * 1e9 / (R * S);                  // ns per row-key
      const double floor = fmas[mode] / rate * 1e9;
      std::printf("%s{\"task\": \"%s\", \"kv\": \"%s\", \"us_per_task\": %.2f, \"ns_per_row_key\": %.3f, "
                  "\"fma_floor_ns_per_row_key\": %.3f, \"floor_ratio\": %.2f}",
                  mode + cold ? ", " : "", names[mode], cold ? "cold" : "hot", best * 1e6, per, floor,
                  floor > 0 ? per / floor : 0.0);
    }
  std::printf("], \"checksum\": %.6f}\n", outb[5] + sc[3]);
}
"""


def main(argv=None) -> None:
    args = native_harness.arguments(__doc__.splitlines()[0], argv)
    isas = native_harness.variants(args.isa)
    iters, cold_blocks = (20, 16) if args.smoke else (2000, 2000)

    def report(isa: str, got: dict) -> None:
        print(f"{isa}: {got['fma_per_s'] / 1e9:.2f} G vector FMAs/s (VW {got['vw']})")
        for t in got["tasks"]:
            print(f"  {t['task']:<11} {t['kv']:<4} {t['us_per_task']:8.2f} us/task  {t['ns_per_row_key']:7.3f} "
                  f"ns/row-key  floor {t['fma_floor_ns_per_row_key']:6.3f}  x{t['floor_ratio']:.2f}")

    result: dict = {"shape": "head_dim 64, 3 query heads per KV head, float32 KV, 256 keys, 8 rows",
                    "cpu_model": cpu_model(), "variants_run": isas,
                    "variants": native_harness.run_variants("attention", HARNESS, isas, [iters, cold_blocks], report)}
    if not args.smoke:
        print("wrote", save_result(result, args.out, "attention_kernels"))


if __name__ == "__main__":
    main(sys.argv[1:])

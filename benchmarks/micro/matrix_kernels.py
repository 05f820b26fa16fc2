"""The native step's quantized matrix products alone, against the integer multiply floor of the same CPU (#29).

A harness that includes native/decode.cpp is compiled per runnable instruction-set variant (the
library's own flags, as native/build.py builds it) and times `gemm`, the product every native step
runs, on one thread, over one matrix of the default model's MLP down shape (576 rows x 1,536
columns, packed as weights="int4" packs it):
  int4   4-bit codes, bf16 scale and bf16 zero per block of 32 (the decoder layers)
  int8   8-bit codes, bf16 scale, no zero (the head's layout)
times M = 1 and M = 8 rows of activations (a serial step, and 8 sequences' step), with the weights
  hot        one matrix, in L2
  cold_4k    512 copies cycled (from DRAM, as in a step), in 4 KB pages (how the model maps its
             packed file)
  cold_huge  the same in transparent huge pages (MADV_HUGEPAGE; only where the kernel's THP setting
             allows it: `thp` in the result)
Per case: microseconds per product, the weight bytes read per second, and the floor: the
product's u8 x s8 multiply-adds at the rate of the variant's integer dot instruction measured in
the same binary (AVX-512 and AVX-VNNI: vpdpbusd; AVX2: vpmaddubsw), 12 independent chains.
floor_ratio = time / floor. Then, on the same binary:
  rounds     12 rounds with the weights in cache, each timing the floor, int4 at 8 rows, int8 at 8 rows
             and int4 at 1 row; rounds_range gives [least, most] of each, and of int4 at 8 rows against
             its round's floor (a machine of two speeds shows as a spread far wider than a round's noise)
  sweep      int4 at 1 row over the first k matrices of one set of 1,024, cycled (a set of 4.4 MB to
             566 MB): the read rate one thread gets by working-set size, which falls where the
             last-level cache this process gets stops holding the set (the default model's int4 decode
             step reads 96.6 MB of weights: batching_report.step_read_bytes)

What it showed on Zen 4 (2026-12-05, alone, `benchmarks/results/matrix_kernels_zen4_dec5.json`):
one zmm vpdpbusd a cycle (235 G multiply-adds/s at 3.67 GHz; AVX2's vpmaddubsw the same rate).
AVX-512, int4, 8 rows: 1.46x the floor hot, which is the layout's own: per row and block of 32
columns, 8 vpdpbusd and 4 float operations (convert, scale, the two FMAs of the scales and the zero):
12 vector operations where the floor counts 8, 1.5x if they share the two pipes, as the time says. From memory 1.58x in 4 KB pages and 1.52x in huge pages (a
second run: 1.44x / 1.57x / 1.50x). One row is bound by the read: ~21 GB/s on one thread, x6-7.
AVX2 (forced, 16 registers, 4 rows a pass): int4 8 rows 2.55x hot, int8 5.2x (its 8-bit codes go
through vpmaddubsw as two nibbles). Huge pages at the engine level (the packed file read into
them instead of mapped; probes, then a load change made and reverted): default int4, 8 chats over
one prompt +4-5 % in the machine's faster phase, none in its slower one nor serially; the 1.7B
shape's decode at an empty context, in rounds alternating with llama-bench, 30.4 / 30.1 / 37.3
tok/s against 28.0 / 36.1 / 36.8 mapped (the machine's two speeds either way). So the packed
weights stay a mapping of their file (page cache shared between processes) and this stays a tool.

A note, not a README figure source: a kernel change that gains here must still be measured on the
step (benchmarks.micro.native_steps, batching). Run alone on a quiet machine (about two minutes a
variant: compiling decode.cpp, then filling and reading the sweep's 566 MB):
  python -m benchmarks.micro.matrix_kernels [--isa avx512,avx2] [--out benchmarks/results/matrix_kernels.json]
Smoke: python -m benchmarks.micro.matrix_kernels --smoke
"""
from __future__ import annotations

import sys
from pathlib import Path

from .._common import cpu_model, save_result
from . import native_harness

HARNESS = r"""
#include "@SOURCE@"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <sys/mman.h>
#include <time.h>
#define NI __attribute__((noinline))
constexpr int ROWS = 576, COLS = 1536;
static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
// Behind a call of its own, as the library calls it.
NI void run_gemm(const QMat& w, const Acts& a, int M, float* y) { gemm(w, a, M, y, ROWS, 0, ROWS / TILE); }
// Multiply-adds a second of the variant's integer dot instruction: 12 independent chains, each kept
// in a register and opaque to the compiler.
#if defined(KVB_ISA_AVX512)
#define DOT(x) x = _mm512_dpbusd_epi32(x, k, q);
#define OPAQUE6(a, b, c, d, e, f) asm("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d), "+v"(e), "+v"(f));
constexpr int MACS = 64;
#elif defined(KVB_ISA_AVXVNNI)
#define DOT(x) x = _mm256_dpbusd_avx_epi32(x, k, q);
#define OPAQUE6(a, b, c, d, e, f) asm("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d), "+x"(e), "+x"(f));
constexpr int MACS = 32;
#else
#define DOT(x) x = _mm256_maddubs_epi16(x, q);
#define OPAQUE6(a, b, c, d, e, f) asm("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d), "+x"(e), "+x"(f));
constexpr int MACS = 32;
#endif
NI double mac_rate(long iters) {
  const vi k = vi_set1(0x01010101), q = vi_set1(0x01020301);
  vi a0 = vi_set1(1), a1 = vi_set1(2), a2 = vi_set1(3), a3 = vi_set1(4), a4 = vi_set1(5), a5 = vi_set1(6);
  vi a6 = vi_set1(7), a7 = vi_set1(8), a8 = vi_set1(9), a9 = vi_set1(10), a10 = vi_set1(11), a11 = vi_set1(12);
  (void)k;
  const double t0 = now();
  for (long i = 0; i < iters; ++i) {
    DOT(a0) DOT(a1) DOT(a2) DOT(a3) DOT(a4) DOT(a5) DOT(a6) DOT(a7) DOT(a8) DOT(a9) DOT(a10) DOT(a11)
    OPAQUE6(a0, a1, a2, a3, a4, a5)
    OPAQUE6(a6, a7, a8, a9, a10, a11)
  }
  const double t = now() - t0;
  int32_t sink = 0, lanes[VW];
  for (vi x : {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11}) { std::memcpy(lanes, &x, sizeof lanes); sink += lanes[0]; }
  if (sink == 12345) std::puts("");
  return 12.0 * MACS * iters / t;
}
// `bytes` of anonymous memory, 2 MB aligned, asked for in huge pages where `huge`, then filled.
static uint8_t* region(size_t bytes, bool huge, unsigned seed) {
  const size_t align = 2u << 20;
  bytes = (bytes + align - 1) / align * align;
  uint8_t* p = static_cast<uint8_t*>(std::aligned_alloc(align, bytes));
  if (p == nullptr) { std::fprintf(stderr, "out of memory\n"); std::exit(1); }
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  srand(seed);
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(rand());
  return p;
}
struct Set { std::vector<QMat> mats; size_t bytes_each; void* parts[3]; };
// Seconds per product: the best of `reps` runs of `iters` products over the first k matrices of
// `mats`, cycled.
static double best_of(const std::vector<QMat>& mats, size_t k, const Acts& a, int M, float* y, int iters, int reps) {
  double best = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = now();
    for (int it = 0; it < iters; ++it) run_gemm(mats[it % k], a, M, y);
    best = std::min(best, (now() - t0) / iters);
  }
  return best;
}
static Set make(int bits, int copies, bool huge) {
  const size_t codes = static_cast<size_t>(ROWS) * COLS * bits / 8, scales = static_cast<size_t>(ROWS) * COLS / BLOCK;
  uint8_t* c = region(codes * copies, huge, 1);
  uint16_t* d = reinterpret_cast<uint16_t*>(region(scales * 2 * copies, huge, 2));
  uint16_t* m = reinterpret_cast<uint16_t*>(region(scales * 2 * copies, huge, 3));
  for (size_t i = 0; i < scales * copies; ++i) { d[i] = 0x3c00 + (d[i] & 0xff); m[i] = 0xbc00 + (m[i] & 0xff); }
  Set s{{}, codes + scales * 2 * (bits == 4 ? 2 : 1), {c, d, m}};
  for (int i = 0; i < copies; ++i)
    s.mats.push_back(QMat{c + codes * i, d + scales * i, bits == 4 ? m + scales * i : nullptr, nullptr, nullptr, nullptr, ROWS, COLS, bits,
                          S_BF16, bits == 4 ? S_BF16 : S_NONE, bits == 4 ? 8.f : 128.f});
  return s;
}
int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 400;
  const int cold_copies = argc > 2 ? atoi(argv[2]) : 512;
  const int rounds = argc > 3 ? atoi(argv[3]) : 12;
  const int sweep_copies = argc > 4 ? atoi(argv[4]) : 1024;
  const int max_rows = 8;
  std::vector<float> x(max_rows * COLS), dx(max_rows * COLS / BLOCK), sx(max_rows * COLS / BLOCK), y(max_rows * ROWS);
  std::vector<int8_t> xq(max_rows * COLS);
  srand(4);
  for (auto& v : x) v = rand() / static_cast<float>(RAND_MAX) - 0.5f;
  for (int r = 0; r < max_rows; ++r)
    quantize(x.data() + r * COLS, COLS, xq.data() + r * COLS, dx.data() + r * COLS / BLOCK, sx.data() + r * COLS / BLOCK, nullptr);
  const Acts a{x.data(), xq.data(), dx.data(), sx.data(), nullptr, nullptr, COLS, COLS, COLS / BLOCK};
  const double rate = mac_rate(20000000L / VW);
  std::printf("{\"macs_per_s\": %.4g, \"vw\": %d, \"cases\": [", rate, VW);
  const char* memories[] = {"hot", "cold_4k", "cold_huge"};
  bool first = true;
  for (int bits : {4, 8})
    for (int mem = 0; mem < 3; ++mem) {
      const Set set = make(bits, mem == 0 ? 1 : cold_copies, mem == 2);
      for (int M : {1, 8}) {
        for (const QMat& w : set.mats) run_gemm(w, a, M, y.data());
        const double best = best_of(set.mats, set.mats.size(), a, M, y.data(), iters, 5);
        const double floor = static_cast<double>(ROWS) * COLS * M / rate;
        std::printf("%s{\"bits\": %d, \"rows_m\": %d, \"weights\": \"%s\", \"us_per_product\": %.2f, "
                    "\"weight_gb_per_s\": %.2f, \"mac_floor_us\": %.2f, \"floor_ratio\": %.2f}",
                    first ? "" : ", ", bits, M, memories[mem], best * 1e6, set.bytes_each / best / 1e9, floor * 1e6,
                    best / floor);
        first = false;
      }
      for (void* p : set.parts) std::free(p);
    }
  std::printf("]");
  // The machine's speed round after round (weights in cache): the floor, then int4 and int8 at 8 rows
  // and int4 at 1 row, each the best of 3 runs of 300 products.
  {
    const Set s4 = make(4, 1, false), s8 = make(8, 1, false);
    std::printf(", \"rounds\": [");
    for (int r = 0; r < rounds; ++r) {
      const double floor_rate = mac_rate(4000000L / VW);
      double us[3];
      const Set* which[3] = {&s4, &s8, &s4};
      const int rows_of[3] = {8, 8, 1};
      for (int k = 0; k < 3; ++k) us[k] = 1e6 * best_of(which[k]->mats, 1, a, rows_of[k], y.data(), 300, 3);
      std::printf("%s{\"macs_per_s\": %.4g, \"int4_m8_us\": %.2f, \"int8_m8_us\": %.2f, \"int4_m1_us\": %.2f}",
                  r ? ", " : "", floor_rate, us[0], us[1], us[2]);
    }
    std::printf("]");
    for (const Set* s : {&s4, &s8}) for (void* p : s->parts) std::free(p);
  }
  // One row of int4 products over the first k matrices of one large set, cycled: the read rate by
  // working-set size (where the last-level cache this process gets stops holding the set).
  {
    const Set big = make(4, sweep_copies, false);
    std::printf(", \"sweep\": [");
    bool first_size = true;
    for (int k : {8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 512, 1024}) {
      if (k > sweep_copies) break;
      for (int i = 0; i < k; ++i) run_gemm(big.mats[i], a, 1, y.data());
      const double best = best_of(big.mats, k, a, 1, y.data(), std::max(k, 400), 3);
      std::printf("%s{\"set_mb\": %.1f, \"int4_m1_us\": %.2f, \"gb_per_s\": %.2f}", first_size ? "" : ", ",
                  big.bytes_each * k / 1e6, best * 1e6, big.bytes_each / best / 1e9);
      first_size = false;
    }
    std::printf("]");
    for (void* p : big.parts) std::free(p);
  }
  std::printf(", \"checksum\": %.6f}\n", y[5]);
}
"""


MACS_M8 = 576 * 1536 * 8       # the harness's ROWS x COLS times 8 rows of activations


def rounds_range(rounds: list[dict], macs_m8: int = MACS_M8) -> dict:
    """[least, most] over the rounds of the floor (G multiply-adds/s), of each product's microseconds,
    and of the int4 8-row product against that round's floor: a machine of two speeds shows as a
    spread much wider than one round's noise."""
    def span(values):
        return [round(min(values), 2), round(max(values), 2)]
    out = {"floor_g": span([r["macs_per_s"] / 1e9 for r in rounds])}
    for key in ("int4_m8_us", "int8_m8_us", "int4_m1_us"):
        out[key] = span([r[key] for r in rounds])
    out["int4_m8_floor_ratio"] = span([r["int4_m8_us"] * 1e-6 * r["macs_per_s"] / macs_m8 for r in rounds])
    return out


def thp_setting() -> str:
    """The kernel's transparent huge page setting ("always", "madvise", "never"; "" where unreadable)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def main(argv=None) -> None:
    args = native_harness.arguments(__doc__.splitlines()[0], argv)
    isas = native_harness.variants(args.isa)
    iters, cold_copies, rounds, sweep_copies = (10, 8, 2, 16) if args.smoke else (400, 512, 12, 1024)

    def report(isa: str, got: dict) -> None:
        print(f"{isa}: {got['macs_per_s'] / 1e9:.1f} G int8 multiply-adds/s (VW {got['vw']})")
        for c in got["cases"]:
            print(f"  int{c['bits']} M={c['rows_m']} {c['weights']:<9} {c['us_per_product']:7.2f} us  "
                  f"{c['weight_gb_per_s']:6.2f} GB/s  floor {c['mac_floor_us']:6.2f} us  x{c['floor_ratio']:.2f}")
        for i, r in enumerate(got["rounds"]):
            print(f"  round {i:2d}: floor {r['macs_per_s'] / 1e9:6.1f} G  int4 M=8 {r['int4_m8_us']:6.2f} us  "
                  f"int8 M=8 {r['int8_m8_us']:6.2f} us  int4 M=1 {r['int4_m1_us']:6.2f} us")
        got["rounds_range"] = rounds_range(got["rounds"])
        print(f"  rounds: {got['rounds_range']}")
        for c in got["sweep"]:
            print(f"  int4 M=1 over a {c['set_mb']:7.1f} MB set: {c['int4_m1_us']:6.2f} us  {c['gb_per_s']:6.2f} GB/s")

    result: dict = {"shape": "576 x 1536 (the default model's MLP down), one thread", "cpu_model": cpu_model(),
                    "thp": thp_setting(), "variants_run": isas,
                    "variants": native_harness.run_variants("matrix", HARNESS, isas, [iters, cold_copies, rounds, sweep_copies], report)}
    if not args.smoke:
        print("wrote", save_result(result, args.out, "matrix_kernels"))


if __name__ == "__main__":
    main(sys.argv[1:])

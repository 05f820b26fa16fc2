// One step of a Llama-family model (RMSNorm, rotary, grouped-query attention, SiLU or GELU MLP; Qwen3's
// and Gemma 3's q / k norms, Gemma 3's norms after attention and MLP and second rotary) over M
// rows on CPU (x86-64: AVX512-VNNI, AVX-VNNI or AVX2, one library per instruction set; see "ISA
// primitives"): a row is one token of a sequence over that sequence's KV, so a step
// is one decode token of M sequences or a prompt chunk of one (all rows' K and V are written before
// any row attends, each up to its own position). Every matrix product reads 4- or 8-bit weight
// codes once for all rows and multiplies them with each row's activation quantized to int8 per
// block of 32 (integer dot products), then scales each block: y[n] += d[n,b] * dx[b] * sum(code * xq) + m[n,b] * dx[b] * sum(xq),
// (6-bit codes hold 5-bit ones, GGUF Q5_0 / Q5_1 / Q5_K, scaled so, and Q6_K: a scale per 16 columns,
// y[n] += d[n,g] * dx[b] * sum over g of (code - 32) * xq),
// where a weight decodes to code * d + m (d bf16 / fp16 / fp32). m is stored (bf16 / fp16 / fp32) or
// derived from d: m = stored - zero * d, or -zero * d with nothing stored (Q4_0's m = -8 d): a
// matrix then reads 4 or 8 bits per weight and its d only (a tenth fewer bytes). Float32 weights
// (bits = 32, the model's own row-major matrices) are read as they are, with the float activations.
// Each row's arithmetic is the same whatever M and whatever rows share the step (batch-invariant).
// KV rows are float32, or float16 / bfloat16 (kv_type): read as floats, written rounded to nearest; or
// int8 with a float16 scale per block of 32 (after the row's codes): read as code * scale, written
// quantized as kv/element.py quantizes.
//
// Plain C ABI (loaded with ctypes; no PyTorch headers): the caller keeps every tensor alive and
// passes raw pointers. Written for kvboost (kvboost_engine/native/decoder.py gives the layouts).
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int TILE = 16;     // output rows per tile
constexpr int BLOCK = 32;    // input columns per block (one activation scale, one weight scale per row)
constexpr int KEY_BLOCK = 256;  // keys per attention task (a long context's keys split across threads)
constexpr int64_t MAX_POSITION = int64_t{1} << 31;   // a row's position is below this (int key blocks)
constexpr size_t PREFETCH = 8192;   // bytes of weight codes asked for ahead of the block in use, into
                                    // L2 (the hardware prefetcher alone left int4 products 20 % slower;
                                    // 2 KB into L1 before: the L2 hint 8 KB on made a Zen 4 1-row int4
                                    // step 10-13 % faster, the 1.7B AVX2 step 27 %, in paired probes)

enum ScaleType { S_BF16 = 0, S_F16 = 1, S_F32 = 2, S_NONE = 3, S_U8 = 4, S_I8 = 5 };   // element type of a matrix's d and m
    // (S_NONE: m not stored; S_U8: a K-quant's 6-bit sub-block scale or minimum as uint8, times its
    // float16 super-block scale in d2 / m2, one per 8 blocks: the product, exact in float32, is the
    // d or m a float32 scale would hold, read in 4.6 bits a weight instead of 6; S_I8: 6-bit codes' d,
    // Q6_K's int8 scale per 16 columns [tiles][blocks][2][16] times its float16 super-block scale in d2)
enum KvType { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };   // element type of the KV (kv_dtype)
constexpr int KV_I8_BLOCK = 32;   // values per float16 scale of an int8 KV row (kv/element.py)
constexpr int MAX_I8_HEAD_DIM = 1024;   // the widest head scored against int8 queries (i8_scores' scratch; wider: float queries)

struct QMat {                // weight [rows, cols] in tiles of 16 rows x blocks of 32 columns
  const uint8_t* codes;      // 4-bit: 256 bytes per (tile, block); 8-bit: 512; 6-bit: 384 (the low 4 bits as
                             // 4-bit codes, then two 64-byte planes of the high 2 bits: plane p, byte
                             // r * 4 + c holds column 4k + c of row r at bits 2s, 2s + 1 for k = 4p + s);
                             // 32: float rows [rows, cols]
  const void* d;             // d_type [tiles][blocks][16]: code scale
  const void* m;             // m_type [tiles][blocks][16] or null: with `zero`, the value of code 0 is m - zero * d
  const float* bias;         // [rows] or null
  const uint16_t* d2;        // S_U8 d and m, S_I8 d: float16 [tiles][blocks / 8][16], their super-block scales
                             // (else null)
  const uint16_t* m2;
  int rows, cols, bits;
  int d_type, m_type;        // ScaleType: d bf16 / fp16 / fp32, m bf16 / fp16 / fp32 / none
  float zero;                // the code whose value is m (0: m is code 0's value; a power of two where m is none)
};

struct Layer {
  const float* in_norm;
  const float* post_norm;           // before the MLP
  const float* q_norm;              // RMSNorm weights [head_dim] over each query / key head before the
  const float* k_norm;              // rotary (Qwen3, Gemma 3), or null
  const float* attn_norm;           // RMSNorm weights over the attention's output and the MLP's, each
  const float* mlp_norm;            // before its residual add (Gemma 3), or null
  int rope;                         // 0: the row's cos / sin; 1: its second pair (Gemma 3's global layers)
  std::vector<QMat> qkv, gate_up;   // q, k, v (or one matrix of them stacked); gate, up (or stacked)
  QMat o, down;
  int window;                // 0: full attention; else keys with pos - window < k <= pos
};

// ---- ISA primitives ------------------------------------------------------------------------------
// The kernels below are written once over these; build.py compiles one library per variant, chosen
// by a macro: KVB_ISA_AVX512 (AVX512F/BW/VL/DQ + VNNI, F16C), KVB_ISA_AVXVNNI (AVX2 + FMA + F16C +
// AVX-VNNI), KVB_ISA_AVX2 (AVX2 + FMA + F16C). API (VW = float lanes of a vector: 16 or 8):
//   vf                                a vector of VW floats
//   vzero() vset1(f) vload(p) vstore(p, v) vload_n(p, n) / vstore_n(p, v, n) (first n < VW lanes;
//   vload_n zeroes the rest) vkeep_n(v, n) (lanes >= n zeroed)
//   vadd vsub vmul vdiv vmax vmin vabs vfma(a, b, c) = a * b + c, vfnma(a, b, c) = c - a * b
//   vsum(v) vhmax(v)                  horizontal sum / max (the order is fixed per ISA)
//   vgt_mask(a, b)                    bit j set where a[j] > b[j] (ordered: never for a NaN)
//   vsum_lanes(p)                     VW vectors -> one: lane j = the sum of p[j]'s lanes (one fixed tree
//                                     for every j, whatever the other vectors hold)
//   vsum_across(p)                    the same tree over p[0 .. VW) lane by lane (vertical adds): equal to
//                                     vsum_lanes of the turned-over vectors, bit for bit
//   transpose(r)                      VW vectors of VW floats turned over in place (r[i][j] -> r[j][i])
//   opaque(v)                         v, hidden from the compiler's contraction of a product and a sum
//   REGISTERS                         vector registers (how many values a kernel can hold)
//   vexp(v)                           e^v (v <= 88; 0 below the float range)
//   load_scales<T>(p, i)              VW scales of ScaleType T from p + i, as floats
//   f16_scalar(h) bf16_scalar(h)      one scale; f16_bcast(h): a float16 in every lane
//   i8_to_f32(p) u8_to_f32(p)         VW int8 / uint8 values as floats
//   dot_block<BITS, R>(wp, half, xb, s)  vi s[r] (VW int32 lanes): the exact dot products of the
//                                     codes of one (tile, block) at wp, output rows half * VW .. + VW
//                                     (HALVES = TILE / VW per tile), with the 32 int8 activations of
//                                     each of R rows (xb[r]: 8 int32 words, 4 int8 each): lane i =
//                                     row half * VW + i of sum(code * x); vcvt(vi) -> vf
//   dot_block6<R, JOIN, X>(wp, half, xb, za, zb, sa, sb)  6-bit codes: dot_block's sums over columns
//                                     0-15 (sa, from za) and 16-31 (sb, from zb); JOIN: all 32 in sa;
//                                     X: wp holds the codes one byte each (expand_block6)
//   expand_block6(wp, out)            a (tile, block)'s 6-bit codes as bytes in the 8-bit layout
//   quantize(x, cols, xq, dx, sx, hs) int8 per block of 32 (the same numbers on every ISA)
//   I8_PARTS i8_keys i8_query i8_dot  int8 keys times int8 query codes, exact (i8_scores)
//   vi_set1 vload_dw vf_bits          int32 lanes; n dwords into a vector's bits; a float vector's bits
//   gather_dw(rows, off) f16_lo/hi    lane j: the dword at byte off of rows[j]; its float16 halves as floats
// Integer dot products are exact, so the quantized products give the same floats on every ISA;
// float reductions (float weights, attention dots, sums) follow the vector width.
#if defined(KVB_ISA_AVX512)
constexpr int VW = 16;
constexpr int REGISTERS = 32;     // vector registers
using vf = __m512;
using vi = __m512i;
constexpr const char* ISA_NAME = "avx512";
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float f) { return _mm512_set1_ps(f); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline __mmask16 lanes_n(int n) { return static_cast<__mmask16>((1u << n) - 1); }
inline vf vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps(lanes_n(n), p); }
inline void vstore_n(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, lanes_n(n), v); }
inline vf vkeep_n(vf v, int n) { return _mm512_maskz_mov_ps(lanes_n(n), v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
inline unsigned vgt_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }   // bit j: a[j] > b[j]
// lane j = the sum of p[j]'s lanes (j < 16), by one fixed tree, the same for every j
inline vf vsum_lanes(const vf* p) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
// v as it is, hidden from the compiler's contraction of a product and a sum into one FMA (a rounding
// less: not the numbers of the kernel this one must equal)
inline vf opaque(vf v) { asm("" : "+v"(v)); return v; }
// The same tree as vsum_lanes with the roles turned: lane j of p[l] is lane l of key j's vector, so
// lane j of the result is vsum_lanes' lane j for key j, bit for bit (vertical adds only)
// (vsum_quad of each group of 4 lanes, then vsum_groups of the 4 groups' sums)
inline vf vsum_quad(vf p0, vf p1, vf p2, vf p3) { return _mm512_add_ps(_mm512_add_ps(p0, p2), _mm512_add_ps(p1, p3)); }
inline vf vsum_groups(const vf* s) { return _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])); }
inline vf vsum_across(const vf* p) {
  vf s[4];
  for (int g = 0; g < 4; ++g) s[g] = vsum_quad(p[4 * g], p[4 * g + 1], p[4 * g + 2], p[4 * g + 3]);
  return vsum_groups(s);
}
// r[i] lane j -> r[j] lane i (a 16 x 16 block of floats turned over, in registers)
inline void transpose(vf* r) {
  vf t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {          // u[4i + k], 128-bit group g: rows 4i .. 4i + 3 of column 4g + k
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    const vf w0 = _mm512_shuffle_f32x4(u[k], u[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
    const vf w1 = _mm512_shuffle_f32x4(u[k], u[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    const vf w2 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(2, 0, 2, 0));
    const vf w3 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], _MM_SHUFFLE(3, 1, 3, 1));
    r[k] = _mm512_shuffle_f32x4(w0, w2, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + k] = _mm512_shuffle_f32x4(w0, w2, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + k] = _mm512_shuffle_f32x4(w1, w3, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + k] = _mm512_shuffle_f32x4(w1, w3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline vf vround(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2_mul(vf p, vf n) { return _mm512_scalef_ps(p, n); }     // p * 2^n (0 below the float range)

inline vf bf16_to_f32(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vf f16_to_f32(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf i8_to_f32(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline vf u8_to_f32(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
inline vf f16_bcast(uint16_t v) { return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(v))); }
inline float f16_scalar(uint16_t v) { return _mm512_cvtss_f32(f16_bcast(v)); }

// s[r] = sum(code * x) for the 16 rows of one (tile, block) and R rows of activations xb[r] (8 int32
// words: 4 int8 each). 4-bit: 8 columns per 64-byte chunk j (low nibbles 8j..8j+3, high 8j+4..8j+7);
// 8-bit: 4 columns 4j..4j+3.
template <int BITS, int R>
inline void dot_block(const uint8_t* wp, int /*half*/, const int32_t* const* xb, vi* s) {
  __m512i v[8];
  if constexpr (BITS == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      __m512i raw = _mm512_loadu_si512(wp + j * 64);
      v[2 * j] = _mm512_and_si512(raw, nibble);
      v[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    }
  } else {
    for (int j = 0; j < 8; ++j) v[j] = _mm512_loadu_si512(wp + j * 64);
  }
  // column chunk outer, rows inner: the R rows' chains advance side by side (row by row, each row's 8
  // dependent products came one after another: 1.7B-shape prefill 512 took 19 % longer)
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j)
    for (int r = 0; r < R; ++r) s[r] = _mm512_dpbusd_epi32(s[r], v[j], _mm512_set1_epi32(xb[r][j]));
}

// The 6-bit codes of one (tile, block) (QMat: the low 4 bits as 4-bit codes, then the 2 high bits'
// planes) as 8 chunks of 4 columns, as dot_block's 8-bit ones
inline void six_bit_chunks(const uint8_t* wp, __m512i* v) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    __m512i raw = _mm512_loadu_si512(wp + j * 64);
    v[2 * j] = _mm512_and_si512(raw, nibble);
    v[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
  }
  for (int k = 0; k < 8; ++k) {             // chunk k's high bits: plane k / 4, bits 2 (k % 4) -> bits 4, 5
    const int s = k % 4;
    __m512i hi = _mm512_and_si512(_mm512_loadu_si512(wp + 256 + (k / 4) * 64), _mm512_set1_epi8(static_cast<char>(3 << (2 * s))));
    if (s == 0) hi = _mm512_slli_epi16(hi, 4);        // (masked first: no bit crosses into the next byte)
    else if (s == 1) hi = _mm512_slli_epi16(hi, 2);
    else if (s == 3) hi = _mm512_srli_epi16(hi, 2);
    v[k] = _mm512_or_si512(v[k], hi);
  }
}

// sa[r], sb[r] = za[r] + sum(code * x) over columns 0-15, zb[r] + the sum over 16-31, of one (tile,
// block) of 6-bit codes (a scale per 16 columns): as dot_block. JOIN (one scale per 32 columns: 5-bit
// codes in the 6-bit layout): sa[r] = za[r] + the sum over all 32, sb unused.
template <int R, bool JOIN = false, bool X = false>
inline void dot_block6(const uint8_t* wp, int /*half*/, const int32_t* const* xb, const int32_t* za,
                       const int32_t* zb, vi* sa, vi* sb) {
  __m512i v[8];
  if constexpr (!X) six_bit_chunks(wp, v);
  auto chunk = [&](int j) {                  // X: loaded where it is used (no 8 chunks held beside 3 R sums)
    if constexpr (X) return _mm512_loadu_si512(wp + j * 64);
    else return v[j];
  };
  for (int r = 0; r < R; ++r) {
    sa[r] = _mm512_set1_epi32(za[r]);
    if constexpr (!JOIN) sb[r] = _mm512_set1_epi32(zb[r]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i c = chunk(j);
    for (int r = 0; r < R; ++r) sa[r] = _mm512_dpbusd_epi32(sa[r], c, _mm512_set1_epi32(xb[r][j]));
  }
  vi* second = JOIN ? sa : sb;
  for (int j = 4; j < 8; ++j) {
    const __m512i c = chunk(j);
    for (int r = 0; r < R; ++r) second[r] = _mm512_dpbusd_epi32(second[r], c, _mm512_set1_epi32(xb[r][j]));
  }
}

// One (tile, block) of 6-bit codes (384 bytes) -> its codes one byte each in the 8-bit layout (512 bytes)
inline void expand_block6(const uint8_t* wp, uint8_t* out) {
  __m512i v[8];
  six_bit_chunks(wp, v);
  for (int j = 0; j < 8; ++j) _mm512_storeu_si512(out + j * 64, v[j]);
}

// Activation x [cols] -> int8 codes per block of 32 (round to nearest), block scale dx, dx * sum(codes)
// (sx: or null), the sums of codes of each half block (hs [2 blocks]: or null).
void quantize(const float* x, int cols, int8_t* xq, float* dx, float* sx, int32_t* hs) {
  for (int b = 0; b < cols / BLOCK; ++b) {
    __m512 a0 = _mm512_loadu_ps(x + b * BLOCK), a1 = _mm512_loadu_ps(x + b * BLOCK + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(inv)));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * BLOCK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
    dx[b] = amax / 127.f;
    if (sx) sx[b] = dx[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    if (hs) {
      hs[2 * b] = _mm512_reduce_add_epi32(q0);
      hs[2 * b + 1] = _mm512_reduce_add_epi32(q1);
    }
  }
}


// int8 KV keys scored in integers (i8_scores): a turned-over vector t of key codes (lane j: key j's
// dword, 4 codes) kept as I8_PARTS vectors (i8_keys: the codes + 128, unsigned), a query dword (4 int8
// codes) as I8_PARTS words (i8_query), and i8_dot(acc, k, q) = acc + per lane the exact sum of the 4
// products (code + 128) * query code. vload_dw(p, n): n <= VW dwords at p into a vector's bits (the
// lanes past n zero).
constexpr int I8_PARTS = 1;
inline void i8_keys(vi t, vi* k) { k[0] = _mm512_xor_si512(t, _mm512_set1_epi8(-128)); }
inline void i8_query(int32_t w, int32_t* q) { q[0] = w; }
inline vi i8_dot(vi acc, const vi* k, const int32_t* q) { return _mm512_dpbusd_epi32(acc, k[0], _mm512_set1_epi32(q[0])); }
inline vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
inline vf vload_dw(const void* p, int n) { return n >= VW ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes_n(n), p); }
inline vi vf_bits(vf v) { return _mm512_castps_si512(v); }
// lane j: the dword at byte `offset` of rows[j] (j < VW); f16_lo / f16_hi: each lane's low / high 16 bits,
// a float16, as a float
inline vi gather_dw(const int8_t* const* rows, int offset) {
  const void* base = reinterpret_cast<const void*>(static_cast<intptr_t>(offset));
  const __m256i a = _mm512_i64gather_epi32(_mm512_loadu_si512(rows), base, 1);
  const __m256i b = _mm512_i64gather_epi32(_mm512_loadu_si512(rows + 8), base, 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}
inline vf f16_lo(vi v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
inline vf f16_hi(vi v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); }

#elif defined(KVB_ISA_AVXVNNI) || defined(KVB_ISA_AVX2)
constexpr int VW = 8;
constexpr int REGISTERS = 16;
using vf = __m256;
using vi = __m256i;
#if defined(KVB_ISA_AVXVNNI)
constexpr const char* ISA_NAME = "avxvnni";
#else
constexpr const char* ISA_NAME = "avx2";
#endif
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float f) { return _mm256_set1_ps(f); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline __m256i lanes_n(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline vf vload_n(const float* p, int n) { return _mm256_maskload_ps(p, lanes_n(n)); }
inline void vstore_n(float* p, vf v, int n) { _mm256_maskstore_ps(p, lanes_n(n), v); }
inline vf vkeep_n(vf v, int n) { return _mm256_and_ps(v, _mm256_castsi256_ps(lanes_n(n))); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// lane j = the sum of p[j]'s lanes (j < 8), by one fixed tree, the same for every j
inline vf vsum_lanes(const vf* p) {
  vf a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
inline vf opaque(vf v) { asm("" : "+x"(v)); return v; }    // see the AVX-512 one
inline unsigned vgt_mask(vf a, vf b) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ))); }
// The same tree as vsum_lanes with the roles turned (see the AVX-512 one)
inline vf vsum_quad(vf p0, vf p1, vf p2, vf p3) { return _mm256_add_ps(_mm256_add_ps(p0, p2), _mm256_add_ps(p1, p3)); }
inline vf vsum_groups(const vf* s) { return _mm256_add_ps(s[0], s[1]); }
inline vf vsum_across(const vf* p) {
  vf s[2];
  for (int g = 0; g < 2; ++g) s[g] = vsum_quad(p[4 * g], p[4 * g + 1], p[4 * g + 2], p[4 * g + 3]);
  return vsum_groups(s);
}
// r[i] lane j -> r[j] lane i (8 x 8, in registers)
inline void transpose(vf* r) {
  vf t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {          // u[4i + k], 128-bit half g: rows 4i .. 4i + 3 of column 4g + k
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}
inline vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
inline vf vround(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n: 2^n built in the exponent field (n >= -126), 0 below that
inline vf vpow2_mul(vf p, vf n) {
  const vf low = _mm256_cmp_ps(n, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
  __m256i e = _mm256_cvtps_epi32(vmin(vmax(n, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f)));
  vf two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  return _mm256_and_ps(vmul(p, two_n), low);
}

inline vf bf16_to_f32(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vf f16_to_f32(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf i8_to_f32(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline vf u8_to_f32(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline vf f16_bcast(uint16_t v) { return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(v))); }
inline float f16_scalar(uint16_t v) { return _mm_cvtss_f32(_mm_cvtph_ps(_mm_set1_epi16(static_cast<short>(v)))); }

// One half (rows half * 8 .. + 8) of a (tile, block): the 32 bytes at half * 32 of each 64-byte chunk
// j (4-bit: low nibbles columns 8j..8j+3, high 8j+4..8j+7; 8-bit: columns 4j..4j+3), times R rows of
// activations xb[r] (8 int32 words: 4 int8 each): s[r] = sum(code * x), exact. Without VNNI, u8 x s8
// pairs go through maddubs (int16, saturating): 4-bit codes are summed in int16 over the block
// (|sum| <= 8 * 2 * 15 * 128 < 32768); 8-bit codes (255 * 127 * 2 would saturate) as two nibbles.
template <int BITS, int R>
inline void dot_block(const uint8_t* wp, int half, const int32_t* const* xb, vi* s) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  wp += half * 32;
#if defined(KVB_ISA_AVXVNNI)
  __m256i v[8];
  for (int j = 0; j < 8; ++j) {
    if constexpr (BITS == 4) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + (j / 2) * 64));
      v[j] = j % 2 == 0 ? _mm256_and_si256(raw, nibble) : _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    } else {
      v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + j * 64));
    }
  }
  for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();   // chunks outer, as the AVX-512 one
  for (int j = 0; j < 8; ++j)
    for (int r = 0; r < R; ++r) s[r] = _mm256_dpbusd_avx_epi32(s[r], v[j], _mm256_set1_epi32(xb[r][j]));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    __m256i v[8];
    for (int j = 0; j < 4; ++j) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + j * 64));
      v[2 * j] = _mm256_and_si256(raw, nibble);
      v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    }
    for (int r = 0; r < R; ++r) {
      __m256i p = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(xb[r][0]));
      for (int j = 1; j < 8; ++j) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(v[j], _mm256_set1_epi32(xb[r][j])));
      s[r] = _mm256_madd_epi16(p, ones);
    }
  } else {
    __m256i lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + j * 64));
      __m256i cl = _mm256_and_si256(raw, nibble), ch = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
      for (int r = 0; r < R; ++r) {
        __m256i x = _mm256_set1_epi32(xb[r][j]);
        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(cl, x));
        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(ch, x));
      }
    }
    for (int r = 0; r < R; ++r)
      s[r] = _mm256_add_epi32(_mm256_madd_epi16(hi[r], _mm256_set1_epi16(16)), _mm256_madd_epi16(lo[r], ones));
  }
#endif
}

// The 6-bit codes of rows half * 8 .. + 8 of one (tile, block) as 8 chunks of 4 columns (see the
// AVX-512 one)
inline void six_bit_chunks(const uint8_t* wp, int half, __m256i* v) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  wp += half * 32;
  for (int j = 0; j < 4; ++j) {
    __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + j * 64));
    v[2 * j] = _mm256_and_si256(raw, nibble);
    v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  }
  for (int k = 0; k < 8; ++k) {
    const int s = k % 4;
    __m256i hi = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 256 + (k / 4) * 64)),
                                  _mm256_set1_epi8(static_cast<char>(3 << (2 * s))));
    if (s == 0) hi = _mm256_slli_epi16(hi, 4);
    else if (s == 1) hi = _mm256_slli_epi16(hi, 2);
    else if (s == 3) hi = _mm256_srli_epi16(hi, 2);
    v[k] = _mm256_or_si256(v[k], hi);
  }
}

// sa[r], sb[r] = za[r], zb[r] + sum(code * x) over columns 0-15, 16-31 (see the AVX-512 one). AVX2:
// two chunks' maddubs pairs added in int16 (|sum| <= 2 * 2 * 63 * 128 = 32256 < 32768), then widened.
template <int R, bool JOIN = false, bool X = false>
inline void dot_block6(const uint8_t* wp, int half, const int32_t* const* xb, const int32_t* za,
                       const int32_t* zb, vi* sa, vi* sb) {
  __m256i v[8];
  if constexpr (!X) six_bit_chunks(wp, half, v);
  auto chunk = [&](int j) {                  // X: loaded where it is used (see the AVX-512 one)
    if constexpr (X) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + half * 32 + j * 64));
    else return v[j];
  };
#if defined(KVB_ISA_AVXVNNI)
  for (int r = 0; r < R; ++r) {
    sa[r] = _mm256_set1_epi32(za[r]);
    if constexpr (!JOIN) sb[r] = _mm256_set1_epi32(zb[r]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m256i c = chunk(j);
    for (int r = 0; r < R; ++r) sa[r] = _mm256_dpbusd_avx_epi32(sa[r], c, _mm256_set1_epi32(xb[r][j]));
  }
  vi* second = JOIN ? sa : sb;
  for (int j = 4; j < 8; ++j) {
    const __m256i c = chunk(j);
    for (int r = 0; r < R; ++r) second[r] = _mm256_dpbusd_avx_epi32(second[r], c, _mm256_set1_epi32(xb[r][j]));
  }
#else
  const __m256i ones = _mm256_set1_epi16(1);
  // chunks j, j + 1 (c0, c1) times row r's activation words j, j + 1: int16 pair sums, then int32
  auto pair = [&](__m256i c0, __m256i c1, int r, int j) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_set1_epi32(xb[r][j])),
                                              _mm256_maddubs_epi16(c1, _mm256_set1_epi32(xb[r][j + 1]))), ones);
  };
  if constexpr (X) {                       // chunk pairs outer, rows inner: two chunks held, not eight
    for (int r = 0; r < R; ++r) {
      sa[r] = _mm256_set1_epi32(za[r]);
      if constexpr (!JOIN) sb[r] = _mm256_set1_epi32(zb[r]);
    }
    for (int j = 0; j < 8; j += 2) {
      const __m256i c0 = chunk(j), c1 = chunk(j + 1);
      vi* dst = JOIN || j < 4 ? sa : sb;
      for (int r = 0; r < R; ++r) dst[r] = _mm256_add_epi32(dst[r], pair(c0, c1, r, j));
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    sa[r] = _mm256_add_epi32(_mm256_add_epi32(_mm256_set1_epi32(za[r]), pair(v[0], v[1], r, 0)), pair(v[2], v[3], r, 2));
    if constexpr (JOIN) sa[r] = _mm256_add_epi32(_mm256_add_epi32(sa[r], pair(v[4], v[5], r, 4)), pair(v[6], v[7], r, 6));
    else sb[r] = _mm256_add_epi32(_mm256_add_epi32(_mm256_set1_epi32(zb[r]), pair(v[4], v[5], r, 4)), pair(v[6], v[7], r, 6));
  }
#endif
}

// One (tile, block) of 6-bit codes (384 bytes) -> its codes one byte each in the 8-bit layout (512 bytes)
inline void expand_block6(const uint8_t* wp, uint8_t* out) {
  for (int half = 0; half < 2; ++half) {
    __m256i v[8];
    six_bit_chunks(wp, half, v);
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 64 + half * 32), v[j]);
  }
}

// Activation x [cols] -> int8 codes per block of 32 (round to nearest), block scale dx, dx * sum(codes)
// (sx: or null), the sums of codes of each half block (hs [2 blocks]: or null).
void quantize(const float* x, int cols, int8_t* xq, float* dx, float* sx, int32_t* hs) {
  for (int b = 0; b < cols / BLOCK; ++b) {
    vf a[4];
    for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(x + b * BLOCK + 8 * i);
    float amax = vhmax(vmax(vmax(vabs(a[0]), vabs(a[1])), vmax(vabs(a[2]), vabs(a[3]))));
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(vmul(a[i], vset1(inv)));
    // saturating packs work within 128-bit lanes: 4-byte groups come out as q0a q1a q2a q3a q0b q1b q2b q3b
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * BLOCK), bytes);
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    dx[b] = amax / 127.f;
    if (sx) sx[b] = dx[b] * static_cast<float>(_mm_cvtsi128_si32(s4));
    if (hs) {
      for (int half = 0; half < 2; ++half) {
        __m256i h = _mm256_add_epi32(q[2 * half], q[2 * half + 1]);
        __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0x4E));
        h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0xB1));
        hs[2 * b + half] = _mm_cvtsi128_si32(h4);
      }
    }
  }
}


// int8 KV keys scored in integers: see the AVX-512 primitives. Without VNNI, (code + 128) of a dword's
// even and odd bytes as 16-bit words (k[0], k[1]) times the query's even and odd codes sign-extended
// (q[0], q[1]) through vpmaddwd: each product and pair sum exact in int32, as vpdpbusd's.
#if defined(KVB_ISA_AVXVNNI)
constexpr int I8_PARTS = 1;
inline void i8_keys(vi t, vi* k) { k[0] = _mm256_xor_si256(t, _mm256_set1_epi8(-128)); }
inline void i8_query(int32_t w, int32_t* q) { q[0] = w; }
inline vi i8_dot(vi acc, const vi* k, const int32_t* q) { return _mm256_dpbusd_avx_epi32(acc, k[0], _mm256_set1_epi32(q[0])); }
#else
constexpr int I8_PARTS = 2;
inline void i8_keys(vi t, vi* k) {
  const vi u = _mm256_xor_si256(t, _mm256_set1_epi8(-128));
  k[0] = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF));
  k[1] = _mm256_srli_epi16(u, 8);
}
inline void i8_query(int32_t w, int32_t* q) {
  int8_t b[4];
  std::memcpy(b, &w, sizeof b);
  auto word = [](int8_t lo, int8_t hi) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) | static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
  };
  q[0] = word(b[0], b[2]);
  q[1] = word(b[1], b[3]);
}
inline vi i8_dot(vi acc, const vi* k, const int32_t* q) {
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(k[0], _mm256_set1_epi32(q[0])),
                                                _mm256_madd_epi16(k[1], _mm256_set1_epi32(q[1]))));
}
#endif
inline vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
inline vf vload_dw(const void* p, int n) { return n >= VW ? _mm256_loadu_ps(static_cast<const float*>(p)) : vload_n(static_cast<const float*>(p), n); }
inline vi vf_bits(vf v) { return _mm256_castps_si256(v); }
inline vi gather_dw(const int8_t* const* rows, int offset) {     // see the AVX-512 one
  const int* base = reinterpret_cast<const int*>(static_cast<intptr_t>(offset));
  const __m128i a = _mm256_i64gather_epi32(base, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows)), 1);
  const __m128i b = _mm256_i64gather_epi32(base, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + 4)), 1);
  return _mm256_set_m128i(b, a);
}
inline vf f16_of_words(vi v) {   // lanes < 65536 -> float16 bits -> floats
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}
inline vf f16_lo(vi v) { return f16_of_words(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF))); }
inline vf f16_hi(vi v) { return f16_of_words(_mm256_srli_epi32(v, 16)); }

#else
#error "define KVB_ISA_AVX512, KVB_ISA_AVXVNNI or KVB_ISA_AVX2 (native/build.py does)"
#endif

constexpr int HALVES = TILE / VW;    // vectors per output tile

inline float bf16_scalar(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// VW scales from p + i, of element type T, as floats (S_U8: times the float16 super-block scales at
// p2 + i2, each product exact)
template <int T>
inline vf load_scales(const void* p, size_t i, const uint16_t* p2 = nullptr, size_t i2 = 0) {
  if constexpr (T == S_BF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(p) + i);
  } else if constexpr (T == S_F16) {
    return f16_to_f32(static_cast<const uint16_t*>(p) + i);
  } else if constexpr (T == S_U8) {
    return vmul(u8_to_f32(static_cast<const uint8_t*>(p) + i), f16_to_f32(p2 + i2));
  } else {
    return vload(static_cast<const float*>(p) + i);
  }
}

// e^x for VW floats (x <= 88): 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2 (ln 2 split in two
// for an exact r), e^r by its Taylor polynomial of degree 6 (relative error ~1e-7), then 2^n
// (0 below the float range).
inline vf vexp(vf x) {
  x = vmin(x, vset1(88.f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.f / 720);
  p = vfma(p, r, vset1(1.f / 120));
  p = vfma(p, r, vset1(1.f / 24));
  p = vfma(p, r, vset1(1.f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  return vpow2_mul(p, n);
}
// ---- end of ISA primitives -----------------------------------------------------------------------

inline float scale_at(const void* p, int type, size_t i) {
  if (type == S_NONE) return 0.f;
  if (type == S_BF16) return bf16_scalar(static_cast<const uint16_t*>(p)[i]);
  if (type == S_F16) return f16_scalar(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// Index of the super-block scale (S_U8, S_I8) of tile t, block b, row r
inline size_t super_at(const QMat& w, size_t t, int b, int r) {
  return (t * (w.cols / BLOCK / 8) + b / 8) * TILE + r;
}

// d of row r of tile t, block b (6-bit codes: of column c's half of it), and m, as floats (the step's
// own numbers)
inline float d_at(const QMat& w, size_t t, int b, int r, int c = 0) {
  const size_t i = (t * (w.cols / BLOCK) + b) * TILE + r;
  if (w.d_type == S_U8) return static_cast<float>(static_cast<const uint8_t*>(w.d)[i]) * f16_scalar(w.d2[super_at(w, t, b, r)]);
  if (w.d_type == S_I8) {
    const size_t g = ((t * (w.cols / BLOCK) + b) * 2 + c / 16) * TILE + r;
    return static_cast<float>(static_cast<const int8_t*>(w.d)[g]) * f16_scalar(w.d2[super_at(w, t, b, r)]);
  }
  return scale_at(w.d, w.d_type, i);
}
inline float m_at(const QMat& w, size_t t, int b, int r) {
  const size_t i = (t * (w.cols / BLOCK) + b) * TILE + r;
  if (w.m_type == S_U8) return static_cast<float>(static_cast<const uint8_t*>(w.m)[i]) * f16_scalar(w.m2[super_at(w, t, b, r)]);
  return scale_at(w.m, w.m_type, i);
}

// Activations of M rows, quantized per row (quantize): row r's codes at xq + r * xq_stride, its
// block scales and sums at dx / sx + r * s_stride, its half blocks' sums of codes at hs + 2 r * s_stride
// (for 6-bit weights); the float rows (for float weights) at x + r * x_stride.
struct Acts {
  const float* x;
  const int8_t* xq;
  const float* dx;
  const float* sx;
  const int32_t* hs;
  uint8_t* expanded;         // this thread's scratch for a tile of 6-bit codes expanded (expand_tile6), or null
  int x_stride, xq_stride, s_stride;
};

// Tile t of W times R rows of activations (rows r0 .. r0 + R): each block of the tile's weights is
// loaded (and its nibbles split) once for the R rows, while every row's arithmetic is exactly that of
// R = 1 (the same integer sums, the same order of float additions), so a row's numbers do not
// depend on the rows beside it. DT, MT: the element types of d and m; BITS: 4, 6 or 8 (6 with DT S_I8:
// Q6_K, a scale per 16 columns, MT S_NONE: code 32 is 0, its sums subtracted in integers; 6 with the
// other types: 5-bit codes, scaled per block as 4- and 8-bit ones).
template <int BITS>
constexpr size_t BLOCK_BYTES = BITS == 4 ? 256 : BITS == 6 ? 384 : 512;

template <int DT, int MT, int BITS, int R, bool X = false>
void tile_rows(const QMat& w, const Acts& a, int r0, float* y, int y_stride, int t, const uint8_t* xcodes = nullptr) {
  const int blocks = w.cols / BLOCK;
  constexpr size_t block_bytes = X ? BLOCK_BYTES<8> : BLOCK_BYTES<BITS>;
  const uint8_t* wp = X ? xcodes : w.codes + static_cast<size_t>(t) * blocks * block_bytes;
  const size_t tile_bytes = static_cast<size_t>(blocks) * block_bytes;
  const size_t sp = static_cast<size_t>(t) * blocks * TILE;
  const size_t sp2 = static_cast<size_t>(t) * (blocks / 8) * TILE;      // S_U8: the super-block scales
  const int32_t* xw[R];
  const float *dx[R], *sx[R];
  const int32_t* hs[R];
  for (int r = 0; r < R; ++r) {
    xw[r] = reinterpret_cast<const int32_t*>(a.xq + static_cast<size_t>(r0 + r) * a.xq_stride);
    dx[r] = a.dx + static_cast<size_t>(r0 + r) * a.s_stride;
    sx[r] = a.sx + static_cast<size_t>(r0 + r) * a.s_stride;
    hs[r] = DT == S_I8 ? a.hs + static_cast<size_t>(r0 + r) * 2 * a.s_stride : nullptr;
  }
  const vf zero = vset1(w.zero), neg_zero = vset1(-w.zero);
  for (int h = 0; h < HALVES; ++h) {         // one output vector (VW rows of the tile) at a time
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = vzero();
    const int32_t* xb[R];
    vi s[R];
    const uint8_t* wb = wp;
    for (int b = 0; b < blocks; ++b, wb += block_bytes) {
      // The codes PREFETCH bytes on (the next tile's near a tile's end); where a tile takes two passes
      // (8-float vectors), the second, over codes already in cache, asks for the next tile's, so the
      // memory reads go on through both passes (the 1.7B-shape AVX2 step 4-10 % faster in paired runs).
      if constexpr (!X) {                   // (X: expand_tile6 asked for them)
        const uint8_t* ahead = h == 0 ? wb + PREFETCH : wb + tile_bytes;
        for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T1);
      }
      for (int r = 0; r < R; ++r) xb[r] = xw[r] + b * (BLOCK / 4);
      const size_t i2 = sp2 + (b / 8) * TILE + h * VW;
      if constexpr (BITS == 6 && DT == S_I8) {
        // each half's sum of (code - 32) * xq in integers (started at -32 sum(xq)), then
        // (da * ta + db * tb) * dx
        vi sb[R];
        int32_t za[R], zb[R];
        const int32_t zero6 = static_cast<int32_t>(w.zero);          // 32
        for (int r = 0; r < R; ++r) {
          za[r] = -zero6 * hs[r][2 * b];
          zb[r] = -zero6 * hs[r][2 * b + 1];
        }
        dot_block6<R, false, X>(wb, h, xb, za, zb, s, sb);
        const int8_t* dp = static_cast<const int8_t*>(w.d) + (sp + static_cast<size_t>(b) * TILE) * 2 + h * VW;
        const vf super = f16_to_f32(w.d2 + i2);
        const vf da = vmul(i8_to_f32(dp), super), db = vmul(i8_to_f32(dp + TILE), super);
        for (int r = 0; r < R; ++r)
          acc[r] = vfma(vfma(vcvt(sb[r]), db, vmul(vcvt(s[r]), da)), vset1(dx[r][b]), acc[r]);
      } else {
        if constexpr (BITS == 6) {                     // 5-bit codes in the 6-bit layout: one scale per block
          const int32_t none[R] = {};
          dot_block6<R, true, X>(wb, h, xb, none, none, s, nullptr);
        } else {
          dot_block<BITS, R>(wb, h, xb, s);
        }
        const vf dv = load_scales<DT>(w.d, sp + b * TILE + h * VW, w.d2, i2);
        vf mv;                                   // code 0's value: m - zero * d (each product exact)
        if constexpr (MT == S_NONE) mv = vmul(dv, neg_zero);
        else mv = vfnma(dv, zero, load_scales<MT>(w.m, sp + b * TILE + h * VW, w.m2, i2));
        for (int r = 0; r < R; ++r) {
          acc[r] = vfma(vcvt(s[r]), vmul(dv, vset1(dx[r][b])), acc[r]);
          acc[r] = vfma(mv, vset1(sx[r][b]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if (w.bias) acc[r] = vadd(acc[r], vload(w.bias + t * TILE + h * VW));
      vstore(y + static_cast<size_t>(r0 + r) * y_stride + t * TILE + h * VW, acc[r]);
    }
  }
}

constexpr int ROW_BLOCK = 4;     // activation rows per pass over a weight tile (registers)
// with 32 vector registers, 8 rows per pass: the tile's codes split once for 8 rows (8-row int4 steps
// 7-9 % faster on a 2-core Zen 4 in paired runs, prompt chunks 1-4 %); each row's arithmetic as before
constexpr int ROW_BLOCK_WIDE = REGISTERS >= 32 ? 8 : ROW_BLOCK;

// With 16 vector registers (AVX2, AVX-VNNI), from EXPAND_ROWS rows of activations on (a prompt chunk),
// a tile of 6-bit codes is first expanded to one byte a code (expand_tile6), which each pass of
// ROW_BLOCK rows then loads chunk by chunk: the bits are split once, not once per pass, and a pass
// holds two chunks, not eight beside its sums (which spilled). The integer sums, hence every row's
// numbers, are the same either way. Paired probes (AVX2 forced on Zen 4, 1.7B shape, prefill 512):
// Q5_K_M 1.25x, Q4_K_M (its Q6_K matrices) 1.03x; 4 rows 0.82x, 8 rows 0.91x, 16 about even, 32
// 1.14x; AVX-VNNI forced on a Xeon: Q5_K_M 1.22x. With 32 registers (AVX-512) the codes stay as
// stored: expanded, the Q5_K_M prefill took 0.96x on Zen 4, 1.03x (noise) on the Xeon.
constexpr bool EXPANDS = REGISTERS < 32;
constexpr int EXPAND_ROWS = 4 * ROW_BLOCK;

// Bytes of a tile of W's 6-bit codes expanded by expand_tile6
inline size_t expanded_bytes(const QMat& w) { return static_cast<size_t>(w.cols / BLOCK) * BLOCK_BYTES<8>; }

// Tile t of 6-bit codes, one byte a code in the 8-bit layout, in this thread's scratch (expanded_bytes(w),
// allocated before the step: nothing is allocated inside the thread team)
inline const uint8_t* expand_tile6(const QMat& w, int t, uint8_t* scratch) {
  const int blocks = w.cols / BLOCK;
  const uint8_t* wp = w.codes + static_cast<size_t>(t) * blocks * BLOCK_BYTES<6>;
  for (int b = 0; b < blocks; ++b, wp += BLOCK_BYTES<6>) {
    for (size_t line = 0; line < BLOCK_BYTES<6>; line += 64) _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH + line), _MM_HINT_T1);
    expand_block6(wp, scratch + static_cast<size_t>(b) * BLOCK_BYTES<8>);
  }
  return scratch;
}

// Tile t of W times the M rows of `a`, ROW_BLOCK_WIDE rows a pass (X: the codes expanded at xc)
template <int DT, int MT, int BITS, bool X>
void tile_all_rows(const QMat& w, const Acts& a, int M, float* y, int y_stride, int t, const uint8_t* xc) {
  int r = 0;
  if constexpr (ROW_BLOCK_WIDE > ROW_BLOCK)
    for (; r + ROW_BLOCK_WIDE <= M; r += ROW_BLOCK_WIDE) tile_rows<DT, MT, BITS, ROW_BLOCK_WIDE, X>(w, a, r, y, y_stride, t, xc);
  for (; r + ROW_BLOCK <= M; r += ROW_BLOCK) tile_rows<DT, MT, BITS, ROW_BLOCK, X>(w, a, r, y, y_stride, t, xc);
  switch (M - r) {
    case 3: tile_rows<DT, MT, BITS, 3, X>(w, a, r, y, y_stride, t, xc); break;
    case 2: tile_rows<DT, MT, BITS, 2, X>(w, a, r, y, y_stride, t, xc); break;
    case 1: tile_rows<DT, MT, BITS, 1, X>(w, a, r, y, y_stride, t, xc); break;
    default: break;
  }
}

// Tiles t0 .. t1 of W times the M rows of `a` (quantized): y[r * y_stride + n].
template <int DT, int MT, int BITS>
void gemm_t(const QMat& w, const Acts& a, int M, float* y, int y_stride, int t0, int t1) {
  for (int t = t0; t < t1; ++t) {
    if constexpr (BITS == 6 && EXPANDS)
      if (M >= EXPAND_ROWS) {
        tile_all_rows<DT, MT, BITS, true>(w, a, M, y, y_stride, t, expand_tile6(w, t, a.expanded));
        continue;
      }
    tile_all_rows<DT, MT, BITS, false>(w, a, M, y, y_stride, t, nullptr);
  }
}

template <int DT, int MT>
void gemm_bits(const QMat& w, const Acts& a, int M, float* y, int y_stride, int t0, int t1) {
  if (w.bits == 4) gemm_t<DT, MT, 4>(w, a, M, y, y_stride, t0, t1);
  else if (w.bits == 6) gemm_t<DT, MT, 6>(w, a, M, y, y_stride, t0, t1);
  else gemm_t<DT, MT, 8>(w, a, M, y, y_stride, t0, t1);
}

void gemm(const QMat& w, const Acts& a, int M, float* y, int y_stride, int t0, int t1) {
#define KVB_M_TYPES(DT)                                                             \
    case DT * 4 + S_BF16: return gemm_bits<DT, S_BF16>(w, a, M, y, y_stride, t0, t1); \
    case DT * 4 + S_F16: return gemm_bits<DT, S_F16>(w, a, M, y, y_stride, t0, t1);   \
    case DT * 4 + S_F32: return gemm_bits<DT, S_F32>(w, a, M, y, y_stride, t0, t1);   \
    case DT * 4 + S_NONE: return gemm_bits<DT, S_NONE>(w, a, M, y, y_stride, t0, t1);
  if (w.d_type == S_U8 && w.m_type == S_U8) return gemm_bits<S_U8, S_U8>(w, a, M, y, y_stride, t0, t1);
  if (w.d_type == S_I8) return gemm_t<S_I8, S_NONE, 6>(w, a, M, y, y_stride, t0, t1);
  switch (w.d_type * 4 + w.m_type) {
    KVB_M_TYPES(S_BF16)
    KVB_M_TYPES(S_F16)
    KVB_M_TYPES(S_F32)
    default: break;                            // the loader checks the types
  }
#undef KVB_M_TYPES
}

// Weight rows n0 .. n0 + WR of a float32 W [rows, cols] (row-major) times activation rows
// r0 .. r0 + R: every (weight row, activation row) pair is one chain of FMAs over VW-column
// steps, its lanes added by vsum_lanes (VW pairs at a time; each pair's lanes by the same tree
// whatever the other pairs), then the remaining columns and the bias added, whatever WR and R.
template <int WR, int R>
void f32_block(const QMat& w, const Acts& a, int r0, int n0, float* y, int y_stride) {
  const float* base = reinterpret_cast<const float*>(w.codes) + static_cast<size_t>(n0) * w.cols;
  const int k = w.cols;
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.x + static_cast<size_t>(r0 + r) * a.x_stride;
  vf s[WR][R];
  for (int i = 0; i < WR; ++i)
    for (int r = 0; r < R; ++r) s[i][r] = vzero();
  // The next WR rows (contiguous after these) asked for into L2 as far in as these are read, WR lines
  // a step: the hardware prefetcher alone kept the 8-row float32 step at memory time plus compute
  // time (paired probes on Zen 4: 8 rows 0.61x the time, 1 row 0.87x; into L1 only 0.86x / 0.95x).
  const char* next = reinterpret_cast<const char*>(base + static_cast<size_t>(WR) * k);
  int c = 0;
  for (; c + VW <= k; c += VW) {
    for (int i = 0; i < WR; ++i) _mm_prefetch(next + (static_cast<size_t>(c) * WR + i * VW) * sizeof(float), _MM_HINT_T1);
    vf xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vload(x[r] + c);
    for (int i = 0; i < WR; ++i) {
      vf wv = vload(base + i * k + c);
      for (int r = 0; r < R; ++r) s[i][r] = vfma(wv, xv[r], s[i][r]);
    }
  }
  constexpr int P = WR * R, G = (P + VW - 1) / VW;
  float sums[G * VW];
  for (int g = 0; g < G; ++g) {
    vf p[VW];
    for (int j = 0; j < VW; ++j) p[j] = g * VW + j < P ? s[(g * VW + j) / R][(g * VW + j) % R] : vzero();
    vstore(sums + g * VW, vsum_lanes(p));
  }
  for (int i = 0; i < WR; ++i)
    for (int r = 0; r < R; ++r) {
      float t = sums[i * R + r];
      for (int cc = c; cc < k; ++cc) t += base[i * k + cc] * x[r][cc];
      y[static_cast<size_t>(r0 + r) * y_stride + n0 + i] = t + (w.bias ? w.bias[n0 + i] : 0.f);
    }
}

// Weight rows n .. n + WR against every activation row, ROW_BLOCK rows at a time (the weight rows
// stay in cache while the activation rows pass).
template <int WR>
void f32_weight_block(const QMat& w, const Acts& a, int M, float* y, int y_stride, int n) {
  int r = 0;
  for (; r + ROW_BLOCK <= M; r += ROW_BLOCK) f32_block<WR, ROW_BLOCK>(w, a, r, n, y, y_stride);
  switch (M - r) {
    case 3: f32_block<WR, 3>(w, a, r, n, y, y_stride); break;
    case 2: f32_block<WR, 2>(w, a, r, n, y, y_stride); break;
    case 1: f32_block<WR, 1>(w, a, r, n, y, y_stride); break;
    default: break;
  }
}

// Weight rows n0 .. n1 of a float32 W times the M float rows of `a`.
void gemm_f32(const QMat& w, const Acts& a, int M, float* y, int y_stride, int n0, int n1) {
  int n = n0;
  if (M == 1) {
    for (; n + 8 <= n1; n += 8) f32_weight_block<8>(w, a, M, y, y_stride, n);
  } else {
    for (; n + 4 <= n1; n += 4) f32_weight_block<4>(w, a, M, y, y_stride, n);
  }
  for (; n < n1; ++n) f32_weight_block<1>(w, a, M, y, y_stride, n);
}

// The code of row r, column c of a (tile, block) of a 4-, 6- or 8-bit W (wp: its 256, 384 or 512 bytes).
inline int code_at(const QMat& w, const uint8_t* wp, int r, int c) {
  if (w.bits == 4 || w.bits == 6) {
    const uint8_t byte = wp[(c / 8) * 64 + r * 4 + (c % 8) % 4];
    const int low = c % 8 < 4 ? (byte & 15) : (byte >> 4);
    if (w.bits == 4) return low;
    const int k = c / 4;                     // the high bits: plane k / 4, bits 2 (k % 4)
    return low | (((wp[256 + (k / 4) * 64 + r * 4 + c % 4] >> (2 * (k % 4))) & 3) << 4);
  }
  return wp[(c / 4) * 64 + r * 4 + c % 4];
}

inline size_t block_bytes_of(const QMat& w) { return w.bits == 4 ? 256 : w.bits == 6 ? 384 : 512; }

// Row r's 32 weights of block b of tile t (wp: that block's codes) as packed.py decodes them, into
// out: code * d + (m - zero * d); Q6_K (S_I8, a d per 16 columns) (code - zero) * d, gguf's own one
// rounding. d and m are read once per group of columns.
inline void block_weights(const QMat& w, const uint8_t* wp, size_t t, int b, int r, float* out) {
  if (w.d_type == S_I8) {
    for (int g = 0; g < BLOCK; g += 16) {
      const float d = d_at(w, t, b, r, g);
      for (int c = g; c < g + 16; ++c) out[c] = static_cast<float>(code_at(w, wp, r, c) - static_cast<int>(w.zero)) * d;
    }
    return;
  }
  const float d = d_at(w, t, b, r), m = m_at(w, t, b, r) - w.zero * d;
  for (int c = 0; c < BLOCK; ++c) out[c] = static_cast<float>(code_at(w, wp, r, c)) * d + m;
}

// Row n of W decoded to floats, dotted with float x (the exact recomputation of the best logits).
float exact_row(const QMat& w, int n, const float* x) {
  const int blocks = w.cols / BLOCK, t = n / TILE, r = n % TILE;
  const size_t block_bytes = block_bytes_of(w);
  double total = 0.0;
  for (int b = 0; b < blocks; ++b) {
    float weights[BLOCK];
    block_weights(w, w.codes + (static_cast<size_t>(t) * blocks + b) * block_bytes, t, b, r, weights);
    for (int c = 0; c < BLOCK; ++c) total += static_cast<double>(weights[c]) * x[b * BLOCK + c];
  }
  return static_cast<float>(total + (w.bias ? w.bias[n] : 0.f));
}

// Rows ids[0 .. M) of a 4-, 6- or 8-bit W decoded to floats into x [M, cols] (block_weights), as
// weights/packed.py's PackedEmbedding decodes them (the input embedding of a model whose packed head
// is its embedding table). With d in bf16 / fp16 (or S_U8: a 6-bit integer times a float16) the
// product code * d is exact in float32, so the one rounding is the sum's, contracted into an FMA or
// not (6-bit: the one rounding is the product's); the caller refuses float32 d.
void decode_rows_of(const QMat& w, const int64_t* ids, int M, float* x) {
  const int blocks = w.cols / BLOCK;
  const size_t block_bytes = block_bytes_of(w);
  for (int i = 0; i < M; ++i) {
    const int64_t n = ids[i];
    const int64_t t = n / TILE;
    const int r = static_cast<int>(n % TILE);
    float* out = x + static_cast<size_t>(i) * w.cols;
    for (int b = 0; b < blocks; ++b)
      block_weights(w, w.codes + (static_cast<size_t>(t) * blocks + b) * block_bytes, t, b, r, out + b * BLOCK);
  }
}

// out = weight * x / rms(x) (out may be x). The squares are summed in vectors (two running sums, then
// vsum: a scalar chain of one dependent add per element made a 576-wide norm 9x slower, 1,454
// against 165 TSC cycles).
void rms_norm(const float* x, const float* weight, int n, float eps, float* out) {
  vf s0 = vzero(), s1 = vzero();
  int i = 0;
  for (; i + 2 * VW <= n; i += 2 * VW) {
    const vf a = vload(x + i), b = vload(x + i + VW);
    s0 = vfma(a, a, s0);
    s1 = vfma(b, b, s1);
  }
  for (; i + VW <= n; i += VW) s0 = vfma(vload(x + i), vload(x + i), s0);
  float sum = vsum(vadd(s0, s1));
  for (; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.f / std::sqrt(sum / n + eps);
  const vf rv = vset1(r);
  for (i = 0; i + VW <= n; i += VW) vstore(out + i, vmul(vload(weight + i), vmul(vload(x + i), rv)));
  for (; i < n; ++i) out[i] = weight[i] * (x[i] * r);
}

void rotate(float* v, const float* cos, const float* sin, int dim) {
  const int half = dim / 2;
  for (int i = 0; i < half; ++i) {
    float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

inline float dot(const float* a, const float* b, int n) {
  vf acc = vzero();
  int i = 0;
  for (; i + VW <= n; i += VW) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// KV rows of element type KT (KvType): float32, or float16 / bfloat16 read as floats and written
// rounded to nearest even (as PyTorch's .to() rounds), NaN as PyTorch writes it; or int8 rows (dim
// codes, then dim / 32 float16 scales) read as code * scale (exact in float32) and written as
// kv/element.py's store() writes them.
template <int KT> struct KvElem { using type = uint16_t; };
template <> struct KvElem<KV_F32> { using type = float; };
template <> struct KvElem<KV_I8> { using type = int8_t; };

// bytes of one stored row of dim values
template <int KT>
constexpr int kv_row_bytes(int dim) { return KT == KV_I8 ? dim + dim / KV_I8_BLOCK * 2 : dim * (KT == KV_F32 ? 4 : 2); }

// the float16 scale of value i of an int8 row of dim values
inline uint16_t kv_i8_scale(const int8_t* row, int i, int dim) {
  uint16_t h;
  std::memcpy(&h, reinterpret_cast<const char*>(row + dim) + 2 * (i / KV_I8_BLOCK), sizeof h);
  return h;
}

// values VW c .. VW c + VW of a stored row of dim values, as floats
template <int KT>
inline vf kv_vec(const typename KvElem<KT>::type* row, int c, int dim) {
  if constexpr (KT == KV_F32) return vload(row + VW * c);
  else if constexpr (KT == KV_F16) return f16_to_f32(row + VW * c);
  else if constexpr (KT == KV_BF16) return bf16_to_f32(row + VW * c);
  else return vmul(i8_to_f32(row + VW * c), f16_bcast(kv_i8_scale(row, VW * c, dim)));
}

// value i of a stored row of dim values
template <int KT>
inline float kv_elem(const typename KvElem<KT>::type* row, int i, int dim) {
  if constexpr (KT == KV_F32) return row[i];
  else if constexpr (KT == KV_F16) return _cvtsh_ss(row[i]);
  else if constexpr (KT == KV_BF16) return bf16_scalar(row[i]);
  else return static_cast<float>(row[i]) * f16_scalar(kv_i8_scale(row, i, dim));
}

// an int8 row of dim values as floats (kv_vec's, vector by vector) into out
inline void dequant_i8(const int8_t* row, int dim, float* out) {
  for (int b = 0; b < dim / KV_I8_BLOCK; ++b) {
    const vf d = f16_bcast(kv_i8_scale(row, b * KV_I8_BLOCK, dim));
    for (int c = b * KV_I8_BLOCK; c < (b + 1) * KV_I8_BLOCK; c += VW) vstore(out + c, vmul(i8_to_f32(row + c), d));
  }
}

inline uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// n floats (one row) into the stored KV row at `at` (element offset into base), type kv_type. int8:
// per block of 32, d = fp16(max |x| / 127), code = round-half-even(x / d) clamped to +-127 (x / 1
// where d is 0), the scales after the n codes (kv/element.py's store(), the same numbers).
inline void kv_put(void* base, int kv_type, int64_t at, const float* src, int n) {
  if (kv_type == KV_F32) {
    std::memcpy(static_cast<float*>(base) + at, src, sizeof(float) * n);
  } else if (kv_type == KV_F16) {
    uint16_t* dst = static_cast<uint16_t*>(base) + at;
    for (int i = 0; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
  } else if (kv_type == KV_BF16) {
    uint16_t* dst = static_cast<uint16_t*>(base) + at;
    for (int i = 0; i < n; ++i) dst[i] = bf16_round(src[i]);
  } else {
    int8_t* dst = static_cast<int8_t*>(base) + at;
    for (int b = 0; b < n / KV_I8_BLOCK; ++b) {
      const float* x = src + b * KV_I8_BLOCK;
      float amax = 0.f;
      for (int i = 0; i < KV_I8_BLOCK; ++i) amax = std::max(amax, std::fabs(x[i]));
      const uint16_t d16 = _cvtss_sh(std::min(amax / 127.f, 65504.f), _MM_FROUND_TO_NEAREST_INT);
      const float d = _cvtsh_ss(d16), div = d > 0.f ? d : 1.f;
      for (int i = 0; i < KV_I8_BLOCK; ++i)
        dst[b * KV_I8_BLOCK + i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] / div))));
      std::memcpy(reinterpret_cast<char*>(dst + n) + 2 * b, &d16, sizeof d16);
    }
  }
}

// the dot product of a float query and a stored KV row of n values (vector by vector, then the tail)
template <int KT>
inline float kv_dot(const float* a, const typename KvElem<KT>::type* b, int n) {
  vf acc = vzero();
  int i = 0;
  for (; i + VW <= n; i += VW) acc = vfma(vload(a + i), kv_vec<KT>(b, i / VW, n), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * kv_elem<KT>(b, i, n);
  return s;
}

// SiLU(g) * u over n values
void silu_mul(const float* g, const float* u, int n, float* out) {
  int i = 0;
  for (; i + VW <= n; i += VW) {
    vf gv = vload(g + i);
    vf e = vexp(vsub(vzero(), gv));
    vstore(out + i, vmul(vdiv(gv, vadd(vset1(1.f), e)), vload(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

enum Act { ACT_SILU = 0, ACT_GELU_TANH = 1 };   // the MLP's activation (ModelArgs.act)

// GELU (tanh approximation, PyTorch's gelu_pytorch_tanh)(g) * u over n values:
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(t) = 1 - 2 / (e^(2t) + 1) (2t capped at 80,
// where tanh is 1 in float32)
void gelu_tanh_mul(const float* g, const float* u, int n, float* out) {
  constexpr float k = 0.7978845608028654f, c = 0.044715f;
  int i = 0;
  for (; i + VW <= n; i += VW) {
    const vf gv = vload(g + i);
    const vf t2 = vmin(vmul(vset1(2.f * k), vfma(vmul(vset1(c), gv), vmul(gv, gv), gv)), vset1(80.f));
    const vf th = vsub(vset1(1.f), vdiv(vset1(2.f), vadd(vexp(t2), vset1(1.f))));
    vstore(out + i, vmul(vmul(vmul(vset1(0.5f), gv), vadd(vset1(1.f), th)), vload(u + i)));
  }
  for (; i < n; ++i) out[i] = 0.5f * g[i] * (1.f + std::tanh(k * (g[i] + c * g[i] * g[i] * g[i]))) * u[i];
}

// Where shared_values' accumulators, with a row of values, do not fit the registers (AVX2's 16 at the
// default model's shape: 3 heads x 8 vectors), the compiler keeps them on the stack and loads, adds and
// stores each one for every key. REREAD (attend_shared: its rows take the block's values in passes of RV, so
// the value rows are in cache after the first) then takes the keys in tiles of T (values_tile): every
// accumulator loaded and stored once a tile, the tile's FMAs in key order between, so its sums are the
// same, bit for bit. Forced AVX2, default int4, waves alternating in one process: 8 chats over one
// prompt decode 4 % faster (the 1.7B shape 1.7 %). Over value rows read once (one row's attention) T rows
// read side by side were slower than the stack accumulators: a row's attention 7 % slower at T = 3,
// 47 % at T = 6 (its value loads wait on memory), so one row keeps them.
template <int D, int H, int RV>
constexpr bool values_spill() { return RV * H * D * (H * D <= 8 ? 2 : 1) + D > REGISTERS; }

// Keys k0 .. k0 + T (value rows at slots sl[0 .. T)) into rows r0 .. r0 + RR's accumulators acc (in
// memory: [parity][RV][H][D VW], parity 1 for odd keys where H D <= 8, else 0 only), in key order.
template <int KT, int D, int H, int RV, int T, int RR>
__attribute__((always_inline)) inline void values_tile(const typename KvElem<KT>::type* vbase, const int64_t* sl,
                                                       int64_t stride, const float* sc, int r0, int k0, float* acc) {
  using E = typename KvElem<KT>::type;
  constexpr bool two = H * D <= 8;
  constexpr int HD = H * D * VW, PAR = RV * HD;      // floats per row's accumulators, per parity
  const E* v[T];
  for (int t = 0; t < T; ++t) v[t] = vbase + sl[t] * stride;
  vf w[RR][H][T];
  for (int r = 0; r < RR; ++r)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) w[r][h][t] = vset1(sc[((r0 + r) * H + h) * KEY_BLOCK + k0 + t]);
  float* even = acc + (two ? (k0 & 1) * PAR : 0);          // the accumulators of keys k0, k0 + 2, ...
  float* odd = acc + (two ? ((k0 + 1) & 1) * PAR : 0);     // and of keys k0 + 1, k0 + 3, ...
  for (int c = 0; c < D; ++c) {
    vf vv[T];
    for (int t = 0; t < T; ++t) vv[t] = kv_vec<KT>(v[t], c, D * VW);
    for (int r = 0; r < RR; ++r)
      for (int h = 0; h < H; ++h) {
        const int at = (r0 + r) * HD + h * D * VW + c * VW;
        if constexpr (two) {
          vf a = vload(even + at), b = vload(odd + at);
          for (int t = 0; t < T; ++t) {
            if (t % 2 == 0) a = vfma(w[r][h][t], vv[t], a);
            else b = vfma(w[r][h][t], vv[t], b);
          }
          vstore(even + at, a);
          vstore(odd + at, b);
        } else {
          vf a = vload(acc + at);
          for (int t = 0; t < T; ++t) a = vfma(w[r][h][t], vv[t], a);
          vstore(acc + at, a);
        }
      }
  }
}

// The values of rows 0 .. RV of a task (their exp scores in sc, row r head h at (r H + h) KEY_BLOCK):
// the s keys they share (slots) with each value row read once for the RV rows and H heads, then each
// row's own keys s .. n[r] (own[r]). Each row's sums are those of the row alone (attend_heads: RV 1,
// s = n): the same accumulators (even and odd keys apart where H D <= 8) in the same key order.
// REREAD: the rows' value sums in key tiles where values_spill (above).
template <int KT, int D, int H, int RV, bool REREAD = false>
inline void shared_values(const typename KvElem<KT>::type* vbase, const int64_t* slots, int s,
                          const int64_t* const* own, const int* n, int64_t stride, const float* sc, float* const* out) {
  using E = typename KvElem<KT>::type;
  constexpr bool two = H * D <= 8;
  if constexpr (REREAD && values_spill<D, H, RV>()) {
    // keys a tile: as many as keep the tile's weights, its value vectors and an accumulator in registers
    // (3 at the default model's shape on AVX2); 4 where even and odd keys are apart (two accumulators)
    constexpr int T = two ? 4 : std::max(1, (REGISTERS - 3) / (RV * H + 1));
    constexpr int HD = H * D * VW, PAR = RV * HD;
    alignas(64) float acc[(two ? 2 : 1) * PAR] = {};
    int j = 0;
    for (; j + T <= s; j += T) values_tile<KT, D, H, RV, T, RV>(vbase, slots + j, stride, sc, 0, j, acc);
    for (; j < s; ++j) values_tile<KT, D, H, RV, 1, RV>(vbase, slots + j, stride, sc, 0, j, acc);
    for (int r = 0; r < RV; ++r) {            // row r's own keys, into its accumulators in key order
      int k = s;
      for (; k + T <= n[r]; k += T) values_tile<KT, D, H, RV, T, 1>(vbase, own[r] + k, stride, sc, r, k, acc);
      for (; k < n[r]; ++k) values_tile<KT, D, H, RV, 1, 1>(vbase, own[r] + k, stride, sc, r, k, acc);
    }
    for (int r = 0; r < RV; ++r)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < D; ++c) {
          const int at = r * HD + h * D * VW + c * VW;
          vstore(out[r * H + h] + VW * c, two ? vadd(vload(acc + at), vload(acc + PAR + at)) : vload(acc + at));
        }
    return;
  }
  vf a0[RV][H][D], a1[RV][H][D];
  for (int r = 0; r < RV; ++r)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < D; ++c) a0[r][h][c] = a1[r][h][c] = vzero();
  auto add_row = [&](int j, vf (&acc)[RV][H][D]) __attribute__((always_inline)) {
    const E* v = vbase + slots[j] * stride;
    vf vv[D];
    for (int c = 0; c < D; ++c) vv[c] = kv_vec<KT>(v, c, D * VW);
    for (int r = 0; r < RV; ++r)
      for (int h = 0; h < H; ++h) {
        const vf w = vset1(sc[(r * H + h) * KEY_BLOCK + j]);
        for (int c = 0; c < D; ++c) acc[r][h][c] = vfma(w, vv[c], acc[r][h][c]);
      }
  };
  int j = 0;
  if constexpr (two) {
    for (; j + 2 <= s; j += 2) {
      add_row(j, a0);
      add_row(j + 1, a1);
    }
  }
  for (; j < s; ++j) add_row(j, a0);
  for (int r = 0; r < RV; ++r) {              // row r's own keys, into its accumulators in key order
    auto add_own = [&](int k, vf (&acc)[RV][H][D]) __attribute__((always_inline)) {
      const E* v = vbase + own[r][k] * stride;
      vf vv[D];
      for (int c = 0; c < D; ++c) vv[c] = kv_vec<KT>(v, c, D * VW);
      for (int h = 0; h < H; ++h) {
        const vf w = vset1(sc[(r * H + h) * KEY_BLOCK + k]);
        for (int c = 0; c < D; ++c) acc[r][h][c] = vfma(w, vv[c], acc[r][h][c]);
      }
    };
    int k = s;
    if constexpr (two) {
      if ((k & 1) && k < n[r]) add_own(k++, a1);
      for (; k + 2 <= n[r]; k += 2) {
        add_own(k, a0);
        add_own(k + 1, a1);
      }
    }
    for (; k < n[r]; ++k) add_own(k, a0);
  }
  for (int r = 0; r < RV; ++r)
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < D; ++c) vstore(out[r * H + h] + VW * c, two ? vadd(a0[r][h][c], a1[r][h][c]) : a0[r][h][c]);
}

// The cache lines of `bytes` bytes at p asked for ahead of their use (HINT: _MM_HINT_T0 into L1, _T1 into L2).
// Always inlined: left as a call inside shared_scores' passes, it made them spill their key registers
// around it (the default model's 8-row int4 step 12 % slower in paired runs).
template <int HINT = _MM_HINT_T0>
__attribute__((always_inline)) inline void prefetch_bytes(const void* p, int bytes) {   // GCC's hints: an enum
  for (int b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, static_cast<decltype(_MM_HINT_T0)>(HINT));
}

// The cache lines of KV rows first .. end (each D vectors of values of type KT) asked for ahead of their
// use, into L1 or (HINT _MM_HINT_T1) L2. The kernels ask for value rows into L2: a block's values are
// summed only after all its scores, and 256 of them asked into L1 pushed out the keys and scratch in
// use (steps of 1 and 8 rows 1-2 % faster in paired runs, on the default model and the 1.7B shape).
template <int KT, int D, int HINT = _MM_HINT_T0, typename E>
inline void prefetch_rows(const E* base, const int64_t* slots, int64_t stride, int first, int end) {
  for (int j = first; j < end; ++j) prefetch_bytes<HINT>(base + slots[j] * stride, kv_row_bytes<KT>(D * VW));
}

constexpr int SHORT_RUN = 64;   // keys at most in a one-row block whose KV is asked for ahead on every CPU
                                // (Decoder::kv_ahead, attend_heads' ask): too short a run for the hardware
                                // prefetchers
constexpr int KEYS_AHEAD = 2 * 16;   // key rows asked for ahead of the scores in use (on an Intel Xeon the KV
                                     // of a long context streamed at well under the weights' rate without
                                     // it; where one-row attention asks: attend_heads' ask)

// One head's n scores of a block (sh) -> exp(score - top) in place; ml = top, their sum.
inline void block_softmax(float* sh, int n, float* ml) {
  vf tv = vset1(-INFINITY);
  int i = 0;
  for (; i + VW <= n; i += VW) tv = vmax(tv, vload(sh + i));
  float top = vhmax(tv);
  for (; i < n; ++i) top = std::max(top, sh[i]);
  tv = vset1(top);
  vf sum = vzero();
  for (i = 0; i + VW <= n; i += VW) {
    const vf e = vexp(vsub(vload(sh + i), tv));
    vstore(sh + i, e);
    sum = vadd(sum, e);
  }
  if (i < n) {
    const vf e = vexp(vsub(vload_n(sh + i, n - i), tv));
    vstore_n(sh + i, e, n - i);
    sum = vadd(sum, vkeep_n(e, n - i));
  }
  ml[0] = top;
  ml[1] = vsum(sum);
}

// ---- int8 KV: keys scored in integers ----------------------------------------------------------
// Over int8 KV, where the matrices take int8 activations anyway (Decoder::i8_queries: int4 or packed
// weights; float weights keep float queries and kv_vec's exact code * scale), each query head is
// quantized as the keys are stored: per block of 32 values, int8 codes (quantize(): round to nearest)
// with a float scale dq = max |q| / 127 (Decoder::quantize_queries). Its
// score with a key of codes k and float16 block scales dk is then, in float32,
//   acc = I_0 (dq_0 dk_0);  acc = fma(I_b, dq_b dk_b, acc) for blocks b = 1, 2, ...;  score = acc * scaling
// where I_b = sum over block b of query code * key code, an integer (exact in int32 and in float32). The
// integer sums may be taken in any order, so every kernel (a row alone, rows sharing keys, wide heads,
// any head size) and every instruction set gives each score bit for bit from the same float steps,
// while the products take one vpdpbusd per 4 codes x VW keys instead of a conversion and an FMA per
// value (llama.cpp scores its q8_0 KV the same way, over a query in q8_0).
struct QCodes {              // query heads h0, h0 + 1, ... of a row over int8 KV
  const int32_t* w;          // per head head_dim / 4 dwords of codes, each as I8_PARTS words (i8_query)
  const float* d;            // per head and block: dq
  const int32_t* s;          // per head and block: -128 * the sum of its codes (i8_keys' + 128 taken back)
};

// Scores (times `scaling`) of keys i0 .. n of a block of int8 rows (at kbase + slots[i] * stride) for R
// rows of H heads (row r's at qc[r]) into sc + (r H + h) KEY_BLOCK + i, as above. Each group of VW keys
// is turned over once (lanes: keys) for all R H heads; a last, partial group repeats its last key in
// lanes never stored.
inline void i8_scores(const QCodes* qc, int R, int H, int head_dim, const int8_t* kbase, const int64_t* slots,
                      int64_t stride, int i0, int n, float scaling, float* sc) {
  const int dw = head_dim / 4, nb = head_dim / KV_I8_BLOCK;
  vi kt[MAX_I8_HEAD_DIM / 4 * I8_PARTS];                  // [dw][I8_PARTS]: the group's keys turned over
  vf dk[MAX_I8_HEAD_DIM / KV_I8_BLOCK];                   // [nb]: each block's scales of the group's keys
  for (int i = i0; i < n; i += VW) {
    const int cnt = std::min(VW, n - i);
    const int8_t* k[VW];
    for (int j = 0; j < VW; ++j) k[j] = kbase + slots[i + std::min(j, cnt - 1)] * stride;
    for (int c0 = 0; c0 < dw; c0 += VW) {
      const int width = std::min(VW, dw - c0);
      vf t[VW];
      for (int j = 0; j < VW; ++j) t[j] = vload_dw(k[j] + 4 * c0, width);
      transpose(t);
      for (int c = 0; c < width; ++c) i8_keys(vf_bits(t[c]), &kt[static_cast<size_t>(c0 + c) * I8_PARTS]);
    }
    for (int b = 0; b < nb; b += 2) {          // the scales after the codes, two at a time (the last
      if (b + 1 < nb) {                        // alone: the dword ending with it)
        const vi two = gather_dw(k, head_dim + 2 * b);
        dk[b] = f16_lo(two);
        dk[b + 1] = f16_hi(two);
      } else {
        dk[b] = f16_hi(gather_dw(k, head_dim + 2 * b - 2));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int hh = 0; hh < H; ++hh) {
        const int32_t* qw = qc[r].w + static_cast<size_t>(hh) * dw * I8_PARTS;
        const float* dq = qc[r].d + hh * nb;
        const int32_t* corr = qc[r].s + hh * nb;
        vf acc = vzero();
        for (int b = 0; b < nb; ++b) {
          vi sum = vi_set1(corr[b]);
          for (int c = 8 * b; c < 8 * b + 8; ++c) sum = i8_dot(sum, &kt[static_cast<size_t>(c) * I8_PARTS], qw + c * I8_PARTS);
          const vf weight = vmul(vset1(dq[b]), dk[b]);
          acc = b == 0 ? vmul(vcvt(sum), weight) : vfma(vcvt(sum), weight, acc);
        }
        const vf s = vmul(acc, vset1(scaling));
        float* row = sc + (r * H + hh) * KEY_BLOCK + i;
        if (cnt == VW) vstore(row, s);
        else vstore_n(row, s, cnt);
      }
  }
}

// Heads h0 .. h0 + H of one row (queries q + h * head_dim, head_dim = D vectors) over keys 0 .. n
// of a block of their KV head (rows at kbase / vbase + slots[i] * stride): each key and value row
// is read from memory once for the H heads (it stays in L1 for the next head). Per head h: scores
// (times `scaling`) into sc + h * KEY_BLOCK, then the block's top and sum of exp(score - top) into
// ml[h][0..1], sum of exp(score - top) * value into out[h]. Each score: the query times the key row
// vector by vector (column order), its lanes added by vsum_lanes (over int8 KV: i8_scores, from the
// query's codes qc); values: a running sum per head in key order (two where H D <= 8: even and odd keys
// of the block, added at the end). The numbers of a head depend on its query and the block's keys only.
//
// ask: the key rows KEYS_AHEAD on and each group's value rows are asked for ahead of their use (prefetch
// only: the same numbers either way). Where it pays depends on the CPU and the run (Decoder::kv_ahead,
// SHORT_RUN): on an Intel Xeon it took a 1-row step at a 1k context from 6.3 to 4.8 ms; on an AMD Zen 4
// the requests made a block's KV stream slower than the hardware prefetchers alone (a harness of this
// kernel over 512 MB of KV, 2 threads, blocks of 256 keys, 3 heads: 12.4 against 9.0 us a block; 2 heads
// 11.2 against 7.6), while a run of 40 keys, too short for them, still gained (2.2 against 2.5 us; 64
// keys: even), and so did one head per KV head (10.6 against 12.3 us; the SmolLM2-1.7B shape's step) and
// int8 KV (the default int4 step of 1 row 5-11 % slower without them, paired; float16 KV 1-5 % faster).
template <int KT, int D, int H>
void attend_heads(const float* q, int head_dim, const typename KvElem<KT>::type* kbase,
                  const typename KvElem<KT>::type* vbase, const int64_t* slots,
                  int64_t stride, int n, float scaling, float* sc, float* const* out, float* const* ml, bool ask,
                  const QCodes& qc) {
  using E = typename KvElem<KT>::type;
  if (ask) prefetch_rows<KT, D>(kbase, slots, stride, 0, std::min(n, KEYS_AHEAD));
  for (int i = 0; i < n; i += VW) {
    const int cnt = std::min(VW, n - i);
    // the keys KEYS_AHEAD on, and this group's values (summed once the block's scores are done)
    if (ask) {
      prefetch_rows<KT, D>(kbase, slots, stride, std::min(n, i + KEYS_AHEAD), std::min(n, i + KEYS_AHEAD + VW));
      prefetch_rows<KT, D, _MM_HINT_T1>(vbase, slots, stride, i, i + cnt);
    }
    if constexpr (KT == KV_I8) {
      if (qc.w) {
        i8_scores(&qc, 1, H, head_dim, reinterpret_cast<const int8_t*>(kbase), slots, stride, i, i + cnt, scaling, sc);
        continue;
      }
    }
    // A last, partial group scores its last key again in the lanes past cnt (never stored): lane j
    // of vsum_lanes depends on p[j] only, so the kept lanes are those of a full group, and the
    // loop has no branch per key.
    // Each key row is loaded (and converted) once for the H heads: p[h][j] is head h's chain for key j.
    vf p[H][VW];
    for (int j = 0; j < VW; ++j) {
      const E* k = kbase + slots[i + std::min(j, cnt - 1)] * stride;
      vf kr[D];
      for (int c = 0; c < D; ++c) kr[c] = kv_vec<KT>(k, c, D * VW);
      for (int h = 0; h < H; ++h) {
        const float* qh = q + h * head_dim;
        vf s = vmul(vload(qh), kr[0]);
        for (int c = 1; c < D; ++c) s = vfma(vload(qh + VW * c), kr[c], s);
        p[h][j] = s;
      }
    }
    for (int h = 0; h < H; ++h) {
      const vf s = vmul(vsum_lanes(p[h]), vset1(scaling));
      if (cnt == VW) vstore(sc + h * KEY_BLOCK + i, s);
      else vstore_n(sc + h * KEY_BLOCK + i, s, cnt);
    }
  }
  for (int h = 0; h < H; ++h) block_softmax(sc + h * KEY_BLOCK, n, ml[h]);
  shared_values<KT, D, H, 1>(vbase, slots, n, &slots, &n, stride, sc, out);   // one row, all n keys in one run
}

// attend_heads for heads wider than attend_heads' registers hold (head_dim = D VW, D > 16 and a
// multiple of 4: Gemma's 256 on 8-float vectors), D at run time: per key, every head's score is one
// chain of FMAs over its query and the key row vector by vector, then vsum (keys taken in pairs);
// values: a running sum per head and vector of columns in key order, taken 2 heads x 4 vectors of
// columns at a time (registers) with the block's value rows read from cache once per pass. The
// numbers of a head depend on its query and the block's keys only. Wide heads never share a task
// (plan_for), so no other kernel need give the same numbers.
template <int KT, int H>
void attend_wide(const float* q, int head_dim, const typename KvElem<KT>::type* kbase,
                 const typename KvElem<KT>::type* vbase, const int64_t* slots,
                 int64_t stride, int n, float scaling, float* sc, float* const* out, float* const* ml,
                 const QCodes& qc) {
  using E = typename KvElem<KT>::type;
  const int D = head_dim / VW;
  const int row_bytes = kv_row_bytes<KT>(head_dim);
  constexpr int AHEAD = 4;                  // key rows asked for ahead (each D vectors: a KB or more)
  for (int j = 0; j < std::min(n, AHEAD); ++j) prefetch_bytes(kbase + slots[j] * stride, row_bytes);
  const bool int_scores = KT == KV_I8 && qc.w;
  if (int_scores) {
    for (int j = 0; j < n; ++j) prefetch_bytes<_MM_HINT_T1>(vbase + slots[j] * stride, row_bytes);
    i8_scores(&qc, 1, H, head_dim, reinterpret_cast<const int8_t*>(kbase), slots, stride, 0, n, scaling, sc);
  }
  // keys j and j + 1 (the second of a pair, or j again past n: never stored) in one pass over the
  // columns, each query vector loaded once for both
  for (int j = 0; !int_scores && j < n; j += 2) {
    const int j1 = std::min(j + 1, n - 1);
    for (int a = j + AHEAD; a < std::min(n, j + AHEAD + 2); ++a) prefetch_bytes(kbase + slots[a] * stride, row_bytes);
    for (int a = j; a <= j1; ++a)             // the value rows, into L2 for the passes below
      prefetch_bytes<_MM_HINT_T1>(vbase + slots[a] * stride, row_bytes);
    const E* k0 = kbase + slots[j] * stride;
    const E* k1 = kbase + slots[j1] * stride;
    vf s0[H], s1[H];
    for (int h = 0; h < H; ++h) s0[h] = s1[h] = vzero();
    for (int c = 0; c < D; ++c) {
      const vf x0 = kv_vec<KT>(k0, c, head_dim), x1 = kv_vec<KT>(k1, c, head_dim);
      for (int h = 0; h < H; ++h) {
        const vf qv = vload(q + h * head_dim + VW * c);
        s0[h] = vfma(qv, x0, s0[h]);
        s1[h] = vfma(qv, x1, s1[h]);
      }
    }
    for (int h = 0; h < H; ++h) {
      sc[h * KEY_BLOCK + j] = vsum(s0[h]) * scaling;
      if (j + 1 < n) sc[h * KEY_BLOCK + j + 1] = vsum(s1[h]) * scaling;
    }
  }
  for (int h = 0; h < H; ++h) block_softmax(sc + h * KEY_BLOCK, n, ml[h]);
  auto pass = [&](auto pair, int h0, int c0) __attribute__((always_inline)) {
    constexpr int P = decltype(pair)::value;   // heads in this pass (1 or 2)
    vf acc[P][4];
    for (int h = 0; h < P; ++h)
      for (int c = 0; c < 4; ++c) acc[h][c] = vzero();
    for (int j = 0; j < n; ++j) {
      const E* v = vbase + slots[j] * stride;
      vf vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = kv_vec<KT>(v, c0 + c, head_dim);
      for (int h = 0; h < P; ++h) {
        const vf w = vset1(sc[(h0 + h) * KEY_BLOCK + j]);
        for (int c = 0; c < 4; ++c) acc[h][c] = vfma(w, vv[c], acc[h][c]);
      }
    }
    for (int h = 0; h < P; ++h)
      for (int c = 0; c < 4; ++c) vstore(out[h0 + h] + VW * (c0 + c), acc[h][c]);
  };
  for (int c0 = 0; c0 < D; c0 += 4) {
    int h0 = 0;
    for (; h0 + 2 <= H; h0 += 2) pass(std::integral_constant<int, 2>{}, h0, c0);
    if (h0 < H) pass(std::integral_constant<int, 1>{}, h0, c0);
  }
}

// f(std::integral_constant<int, B>) for each B in order: a loop whose index is a constant in its body
template <int... B, typename F>
inline void each_of(std::integer_sequence<int, B...>, F&& f) { (f(std::integral_constant<int, B>{}), ...); }

constexpr int SHARED_ROWS = 8;    // rows at most in one task over a shared key block
constexpr int SHARED_MIN = 32;    // keys at least that rows of one task share

// Scores (times `scaling`) of keys i0 .. n of a block (rows at kbase + slots[i] * stride) for R rows
// and H heads (row r's queries at q[r] + h * head_dim) into sc + (r H + h) KEY_BLOCK + i. Each group
// of VW keys is read once and turned over (kt: lanes = keys), so a score is lane l's chain of FMAs over
// the query's columns l, l + VW, ... (ps: every row and head's, LB lanes' key columns held in
// registers), added across by vsum_across: the products, chains and tree of attend_heads for that
// key, bit for bit, whatever keys share its group (a group past n repeats its last key in lanes never
// kept). kt: [D VW] vectors of scratch, ps: [R H VW]. Over int8 KV: i8_scores (row r's query codes qc[r]).
template <int KT, int D, int H>
inline void shared_scores(const float* const* q, int R, int head_dim, const typename KvElem<KT>::type* kbase,
                          const typename KvElem<KT>::type* vbase, const int64_t* slots, int64_t stride, int i0,
                          int n, float scaling, float* sc, float* kt, float* ps, const QCodes* qc) {
  using E = typename KvElem<KT>::type;
  prefetch_rows<KT, D>(kbase, slots, stride, i0, std::min(n, i0 + KEYS_AHEAD));
  if (KT == KV_I8 && qc->w) {                 // in integers, every row and head of a group at once
    for (int i = i0; i < n; i += VW) {
      prefetch_rows<KT, D>(kbase, slots, stride, std::min(n, i + KEYS_AHEAD), std::min(n, i + KEYS_AHEAD + VW));
      prefetch_rows<KT, D, _MM_HINT_T1>(vbase, slots, stride, i, std::min(n, i + VW));
      i8_scores(qc, R, H, D * VW, reinterpret_cast<const int8_t*>(kbase), slots, stride, i, std::min(n, i + VW), scaling, sc);
    }
    return;
  }
  for (int i = i0; i < n; i += VW) {
    const int cnt = std::min(VW, n - i);
    // The rows to ask for during this group (the keys KEYS_AHEAD on into L1, this group's values into
    // L2, as prefetch_rows): where several rows share the group, spread over its passes and rows, so
    // memory works while they compute
    const char* pf[2 * VW];
    int npf = 0;
    for (int j = std::min(n, i + KEYS_AHEAD); j < std::min(n, i + KEYS_AHEAD + VW); ++j)
      pf[npf++] = reinterpret_cast<const char*>(kbase + slots[j] * stride);
    const int nk = npf;                        // pf[0 .. nk): key rows; then value rows
    for (int j = i; j < i + cnt; ++j) pf[npf++] = reinterpret_cast<const char*>(vbase + slots[j] * stride);
    constexpr int row_bytes = kv_row_bytes<KT>(D * VW);
    auto ask = [&](int a, int b) __attribute__((always_inline)) {
      for (int q = a; q < std::min(b, npf); ++q) {
        if (q < nk) prefetch_bytes(pf[q], row_bytes);
        else prefetch_bytes<_MM_HINT_T1>(pf[q], row_bytes);
      }
    };
    if (R == 1) ask(0, npf);
    const E* k[VW];
    for (int j = 0; j < VW; ++j) k[j] = kbase + slots[i + std::min(j, cnt - 1)] * stride;
    for (int c = 0; c < D; ++c) {            // kt[c VW + l] lane j: column c VW + l of key i + j
      vf t[VW];
      for (int j = 0; j < VW; ++j) t[j] = kv_vec<KT>(k[j], c, D * VW);
      transpose(t);
      for (int l = 0; l < VW; ++l) vstore(kt + (c * VW + l) * VW, t[l]);
    }
    // Pass b takes LB lanes' key columns into registers and adds their chains as vsum_across' tree
    // does, so less goes through ps: LB 4, lanes 4b .. 4b + 3 (a group: vsum_quad); LB 2, lanes
    // 4 (b / 2) + b % 2 and 2 on (a group's first adds); LB 1, lane b (each chain stored). b is a
    // constant in each pass, so every query element a pass reads is at a fixed offset from its row's
    // pointer (a loop over b spilled the LB D offsets and reloaded them for every row and head).
    constexpr int LB = D * 4 <= REGISTERS / 2 ? 4 : D * 2 <= REGISTERS / 2 ? 2 : 1;
    constexpr int PASSES = VW / LB;
    auto pass = [&](auto bc) __attribute__((always_inline)) {
      constexpr int b = decltype(bc)::value;
      constexpr int lane0 = LB == 4 ? 4 * b : LB == 2 ? 4 * (b / 2) + b % 2 : b;
      constexpr int STEP = LB == 4 ? 1 : 2;
      vf kr[LB][D];
      for (int l = 0; l < LB; ++l)
        for (int c = 0; c < D; ++c) kr[l][c] = vload(kt + (c * VW + lane0 + STEP * l) * VW);
      float* pso = ps + b * VW;
      const int per = (npf + PASSES * R - 1) / (PASSES * R);
      for (int r = 0; r < R; ++r) {
        if (R > 1) ask((b * R + r) * per, (b * R + r + 1) * per);
        const float* qr = q[r] + lane0;
        for (int h = 0; h < H; ++h) {
          const float* qh = qr + h * head_dim;
          vf ch[LB];
          for (int l = 0; l < LB; ++l) {
            vf s = vmul(vset1(qh[STEP * l]), kr[l][0]);
            for (int c = 1; c < D; ++c) s = vfma(vset1(qh[VW * c + STEP * l]), kr[l][c], s);
            ch[l] = opaque(s);                 // a bare product (D = 1) stays rounded
          }
          vf out;
          if constexpr (LB == 4) out = vsum_quad(ch[0], ch[1], ch[2], ch[3]);
          else if constexpr (LB == 2) out = vadd(ch[0], ch[1]);
          else out = ch[0];
          vstore(pso + ((r * H + h) * PASSES) * VW, out);
        }
      }
    };
    each_of(std::make_integer_sequence<int, PASSES>{}, pass);
    for (int rh = 0; rh < R * H; ++rh) {
      const float* pr = ps + rh * PASSES * VW;
      vf total;
      if constexpr (LB == 4) {
        vf g[VW / 4];
        for (int i = 0; i < VW / 4; ++i) g[i] = vload(pr + i * VW);
        total = vsum_groups(g);
      } else if constexpr (LB == 2) {
        vf g[VW / 4];
        for (int i = 0; i < VW / 4; ++i) g[i] = vadd(vload(pr + 2 * i * VW), vload(pr + (2 * i + 1) * VW));
        total = vsum_groups(g);
      } else {
        vf p[VW];
        for (int l = 0; l < VW; ++l) p[l] = vload(pr + l * VW);
        total = vsum_across(p);
      }
      const vf s = vmul(total, vset1(scaling));
      float* row = sc + rh * KEY_BLOCK + i;
      if (cnt == VW) vstore(row, s);
      else vstore_n(row, s, cnt);
    }
  }
}

// Rows whose value sums attend_shared takes in one pass (shared_values' RV): as many as keep their
// accumulators (H heads x D vectors, twice where H D <= 8) within 24 registers, 1 to 4.
template <int D, int H>
constexpr int shared_value_rows() { return std::max(1, std::min(4, 24 / (H * D * (H * D <= 8 ? 2 : 1)))); }

// attend_heads for R rows (2 .. SHARED_ROWS) of one block whose first s keys they all read (the same
// KV rows; slots), each row r then its own keys s .. n[r] (own[r]): row r's queries at q[r] + h * head_dim,
// its partials at out / ml[r * H + h], bit for bit those of attend_heads for that row alone, with the
// shared keys' loads, conversions and lane shuffles done once for the R H heads. sc: [R H KEY_BLOCK]
// scores; kt, ps: shared_scores' scratch; over int8 KV qc: each row's query codes, vrows / vat: scratch
// for the task's value rows as floats (attend_rows sizes it).
template <int KT, int D, int H>
void attend_shared(const float* const* q, int R, int head_dim, const typename KvElem<KT>::type* kbase,
                   const typename KvElem<KT>::type* vbase, const int64_t* slots, int s, const int64_t* const* own,
                   const int* n, int64_t stride, float scaling, float* sc, float* kt, float* ps, float* const* out,
                   float* const* ml, const QCodes* qc, float* vrows, int64_t* vat) {
  // Each row's own keys and values (a short run per sequence, past the prompt it shares) asked into L2
  // while the shared keys are scored: asked for only when their scores began, each row's run waited on
  // memory (in an 8-row decode step over a shared prompt, 8.0 K -> 2.3 K TSC cycles per task for the
  // rows' own keys; the step 0.6-1.1 % faster in paired runs; the 1.7B shape 0.2 %).
  for (int r = 0; r < R; ++r)
    if (n[r] > s) {
      prefetch_rows<KT, D, _MM_HINT_T1>(kbase, own[r], stride, s, n[r]);
      prefetch_rows<KT, D, _MM_HINT_T1>(vbase, own[r], stride, s, n[r]);
    }
  shared_scores<KT, D, H>(q, R, head_dim, kbase, vbase, slots, stride, 0, s, scaling, sc, kt, ps, qc);
  for (int r = 0; r < R; ++r)
    if (n[r] > s) shared_scores<KT, D, H>(q + r, 1, head_dim, kbase, vbase, own[r], stride, s, n[r], scaling,
                                          sc + r * H * KEY_BLOCK, kt, ps, qc + r);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) block_softmax(sc + (r * H + h) * KEY_BLOCK, n[r], ml[r * H + h]);
  constexpr int RV = shared_value_rows<D, H>();
  if constexpr (KT == KV_I8) {
    // Over int8 KV each value row the task reads is turned into floats once (code * scale: exact in
    // float32, kv_vec's numbers) into vrows, then summed as float32 rows (vat: each key's row there): the
    // passes of RV rows below would each convert the shared rows again.
    int used = 0;
    for (int j = 0; j < s; ++j, ++used) {
      dequant_i8(vbase + slots[j] * stride, D * VW, vrows + static_cast<size_t>(used) * D * VW);
      vat[j] = used;
    }
    const int64_t* own_at[SHARED_ROWS];
    for (int r = 0; r < R; ++r) {
      int64_t* at = vat + static_cast<size_t>(r + 1) * KEY_BLOCK;
      for (int k = s; k < n[r]; ++k, ++used) {
        dequant_i8(vbase + own[r][k] * stride, D * VW, vrows + static_cast<size_t>(used) * D * VW);
        at[k] = used;
      }
      own_at[r] = at;
    }
    int r = 0;
    for (; r + RV <= R; r += RV)
      shared_values<KV_F32, D, H, RV, true>(vrows, vat, s, own_at + r, n + r, D * VW, sc + r * H * KEY_BLOCK, out + r * H);
    for (; r < R; ++r)
      shared_values<KV_F32, D, H, 1, true>(vrows, vat, s, own_at + r, n + r, D * VW, sc + r * H * KEY_BLOCK, out + r * H);
    return;
  }
  int r = 0;
  for (; r + RV <= R; r += RV)
    shared_values<KT, D, H, RV, true>(vbase, slots, s, own + r, n + r, stride, sc + r * H * KEY_BLOCK, out + r * H);
  for (; r < R; ++r)
    shared_values<KT, D, H, 1, true>(vbase, slots, s, own + r, n + r, stride, sc + r * H * KEY_BLOCK, out + r * H);
}

// The stages of a step meet at a barrier of our own: libgomp's barrier sleeps on a futex after a
// short spin once a process has more OpenMP threads than cores (a second thread that ran PyTorch
// ops is enough), which made a step of ~300 barriers 50 % slower on a thread other than the main one.
// Ours spins, but only for a while: a spin with no end stalled whenever a thread of the team was
// descheduled (more runnable threads than cores: two engines decoding at once in one process ran
// 23x slower), since the waiters held the cores it needed to arrive. So a waiter spins (threads
// normally arrive within microseconds of each other), then yields its core (a wait of a few hundred
// microseconds costs no wake-up; a descheduled thread on this core runs), then sleeps on a futex.
class Barrier {
 public:
  // All `n` threads meet here.
  void wait(int n) {
    if (n == 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT32_MAX);
    } else {
      wait_past(gen);
    }
  }

 private:
  static constexpr auto SPIN_FOR = std::chrono::microseconds(50);       // then yield
  static constexpr auto SLEEP_AFTER = std::chrono::microseconds(1000);  // of spins and yields

  bool passed(int gen) const { return gen_.load(std::memory_order_acquire) != gen; }

  void wait_past(int gen) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    for (int i = 1; !passed(gen); ++i) {
      _mm_pause();
      if (i % 64 == 0 && clock::now() - start > SPIN_FOR) break;
    }
    while (!passed(gen) && clock::now() - start < SLEEP_AFTER) sched_yield();
    // seq_cst on sleepers_ and gen_ on both sides: either the releaser sees this sleeper and wakes
    // it, or this thread sees the new generation (and the kernel checks gen_ again as it sleeps).
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (gen_.load(std::memory_order_seq_cst) == gen) futex(FUTEX_WAIT_PRIVATE, gen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

  // FUTEX_WAIT returns at once when gen_ != value, on a wake, or spuriously (the caller loops).
  void futex(int op, int value) {
    syscall(SYS_futex, reinterpret_cast<int*>(&gen_), op, value, nullptr, nullptr, 0);
  }
  static_assert(sizeof(std::atomic<int>) == sizeof(int) && std::atomic<int>::is_always_lock_free,
                "the futex word is the atomic's own int");

  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
  std::atomic<int> sleepers_{0};    // threads in (or about to enter) FUTEX_WAIT
};

// Native steps running now in this process, over every decoder: the cores belong to the process,
// not to one decoder (the one piece of state the decoders share).
std::atomic<int>& steps_running() {
  static std::atomic<int> count{0};
  return count;
}

// Threads: a step is one OpenMP parallel region of the calling thread's own team (the libgomp
// PyTorch already loaded, so its ops and this step share one set of threads). A step that starts
// while other decoders' steps run takes its share of the team (size / steps running, at least 1):
// two engines decoding at once on 2 cores then run one thread each, with no barrier to wait at,
// instead of 4 threads on 2 cores meeting ~300 times a step. Every output row, tile and head is
// computed by one thread whatever the split, so the numbers do not depend on it.
class Team {
 public:
  explicit Team(int n) : n_(std::max(n, 1)) {}
  int size() const { return n_; }

  // job(thread id, threads) on every thread of the step's team
  void run(const std::function<void(int, int)>& job) {
    const int running = steps_running().fetch_add(1, std::memory_order_relaxed) + 1;
    const int threads = std::max(1, n_ / running);
#pragma omp parallel num_threads(threads)
    job(omp_get_thread_num(), omp_get_num_threads());
    steps_running().fetch_sub(1, std::memory_order_relaxed);
  }

  void barrier(int n) { barrier_.wait(n); }

 private:
  int n_;
  Barrier barrier_;
};

// One row of a step: the token at `pos` of a sequence, over that sequence's KV.
struct Row {
  void* kv;                  // [2, layers, kv_heads, slots, head_dim]-shaped with element strides st (4), kv_type
  const int64_t* st;
  const int64_t* slots;      // slots[p]: the slot of position p
  int64_t pos;
  const float* cos;          // rotary at pos [head_dim]
  const float* sin;
  int64_t want;              // 1: this row's logits are wanted (in order, in the step's logits [wanted][vocab])
  const float* cos2;         // the second rotary at pos (layers with rope 1), or the first again
  const float* sin2;
};

struct Decoder {
  int layers, hidden, heads, kv_heads, head_dim, inter, vocab, exact_top;
  int kv_type = KV_F32;       // KvType of every row's KV
  bool kv_ahead = true;       // one-row attention asks for KV rows ahead in every block (else only in short
                             // runs, for one query head per KV head and over int8 KV: attend_heads' ask)
  int activation = ACT_SILU; // the MLP's activation (Act)
  bool quantized = false;    // some matrix reads int8 activations
  bool i8_queries = false;   // int8 KV scored against int8 queries (i8_scores): over int8 KV where the
                             // matrices take int8 activations anyway, heads of up to MAX_I8_HEAD_DIM; float
                             // weights (and wider heads) keep float queries
  float eps, scaling;
  std::vector<Layer> stack;
  const float* final_norm;
  QMat head;
  Team team;
  std::mutex busy;
  // scratch, per row: x [hidden], h [hw], qkv [qkv_w], attn [q_rows], mlp [2 inter], act [inter],
  // xq [xq_w], dx / sx [s_w], hs [2 s_w] (where some matrix is Q6_K, a scale per 16 columns: half_sums)
  int hw = 0, qkv_w = 0, q_rows = 0, xq_w = 0, s_w = 0, capacity = 0;
  bool half_sums = false;
  std::vector<float> x, h, qkv, attn, mlp, act, dx, sx;
  std::vector<int32_t> hs;
  std::vector<int8_t> xq;
  std::vector<int32_t> q_words, q_corr;         // over int8 KV, per row: the query heads' codes (QCodes)
  std::vector<float> q_scale;
  std::vector<int8_t> q_codes;
  std::vector<std::vector<float>> scores;      // per thread [SHARED_ROWS 4 KEY_BLOCK]
  std::vector<std::vector<float>> turned;      // per thread: a group of keys turned over [16 VW VW], then
                                               // each row and head's lane sums [SHARED_ROWS 4 VW VW]
  std::vector<std::vector<float>> value_rows;  // per thread, over int8 KV: a shared task's value rows as
  std::vector<std::vector<int64_t>> value_at;  // floats, and where each key's is (attend_rows; sized by prepare)
  std::vector<std::vector<uint8_t>> expanded;  // per thread, with 6-bit matrices where EXPANDS: a tile's codes
                                               // expanded (expand_tile6)
  std::vector<std::vector<std::pair<float, int>>> tops;   // per thread: refine_top's heap [exact_top]
  std::vector<float> part_o, part_ml;          // per attention task: output [head_dim]; top, sum
  std::vector<int> wanted;                     // rows whose logits are wanted

  Decoder(int threads) : team(threads) {}

  // Scratch for M rows (capacity: the rows every buffer holds, raised once all of them are)
  void reserve(int M) {
    if (M <= capacity) return;
    wanted.reserve(M);
    x.resize(static_cast<size_t>(M) * hidden); h.resize(static_cast<size_t>(M) * hw);
    qkv.resize(static_cast<size_t>(M) * qkv_w); attn.resize(static_cast<size_t>(M) * q_rows);
    mlp.resize(static_cast<size_t>(M) * 2 * inter); act.resize(static_cast<size_t>(M) * inter);
    xq.resize(static_cast<size_t>(M) * xq_w);
    dx.resize(static_cast<size_t>(M) * s_w); sx.resize(static_cast<size_t>(M) * s_w);
    if (half_sums) hs.resize(static_cast<size_t>(M) * 2 * s_w);
    if (i8_queries) {
      q_words.resize(static_cast<size_t>(M) * (q_rows / 4) * I8_PARTS);
      q_scale.resize(static_cast<size_t>(M) * (q_rows / KV_I8_BLOCK));
      q_corr.resize(static_cast<size_t>(M) * (q_rows / KV_I8_BLOCK));
      q_codes.resize(static_cast<size_t>(M) * q_rows);
    }
    capacity = M;
  }

  // Row r's query heads (rotated, normed) in int8 for scoring int8 KV (i8_scores): quantize()'s codes per
  // block of 32 (each head a whole number of blocks: head_dim is a multiple of 32 over int8 KV) and scales,
  // each dword of codes as i8_query's words, and -128 times each block's sum of codes.
  void quantize_queries(int r) {
    static_assert(BLOCK == KV_I8_BLOCK, "a query block is a key block");
    const int blocks = q_rows / KV_I8_BLOCK;
    int8_t* codes = q_codes.data() + static_cast<size_t>(r) * q_rows;
    quantize(qkv.data() + static_cast<size_t>(r) * qkv_w, q_rows, codes, q_scale.data() + static_cast<size_t>(r) * blocks,
             nullptr, nullptr);
    int32_t* words = q_words.data() + static_cast<size_t>(r) * (q_rows / 4) * I8_PARTS;
    for (int c = 0; c < q_rows / 4; ++c) {
      int32_t w;
      std::memcpy(&w, codes + 4 * c, sizeof w);
      i8_query(w, words + c * I8_PARTS);
    }
    for (int b = 0; b < blocks; ++b) {
      int32_t sum = 0;
      for (int i = 0; i < KV_I8_BLOCK; ++i) sum += codes[b * KV_I8_BLOCK + i];
      q_corr[static_cast<size_t>(r) * blocks + b] = -128 * sum;
    }
  }

  // Row r's query heads from hd0 on in int8 (quantize_queries), or nulls where the keys are scored
  // against float queries
  QCodes query_codes(int r, int hd0) const {
    if (!i8_queries) return {nullptr, nullptr, nullptr};
    const int blocks = q_rows / KV_I8_BLOCK, hb = head_dim / KV_I8_BLOCK;
    return {q_words.data() + (static_cast<size_t>(r) * (q_rows / 4) + static_cast<size_t>(hd0) * (head_dim / 4)) * I8_PARTS,
            q_scale.data() + static_cast<size_t>(r) * blocks + hd0 * hb,
            q_corr.data() + static_cast<size_t>(r) * blocks + hd0 * hb};
  }

  static void split(int tiles, int id, int n, int* t0, int* t1) {
    *t0 = tiles * id / n;
    *t1 = tiles * (id + 1) / n;
  }

  // row r of a [M, cols] float activation (stride `stride`) quantized into xq / dx / sx (/ hs) row r
  void quantize_row(const float* src, int stride, int cols, int r) {
    if (quantized) quantize(src + static_cast<size_t>(r) * stride, cols, xq.data() + static_cast<size_t>(r) * xq_w,
                            dx.data() + static_cast<size_t>(r) * s_w, sx.data() + static_cast<size_t>(r) * s_w,
                            half_sums ? hs.data() + static_cast<size_t>(r) * 2 * s_w : nullptr);
  }

  // y[r] = W x[r] for the M rows, this thread's share of W's rows; x: the float rows (their
  // quantized copies in xq / dx / sx when W is not float)
  void matmul(const QMat& w, int M, const float* x, int x_stride, float* y, int y_stride, int id, int n) {
    const Acts a{x, xq.data(), dx.data(), sx.data(), hs.data(), expanded.empty() ? nullptr : expanded[id].data(),
                 x_stride, xq_w, s_w};
    int t0, t1;
    if (w.bits == 32) {
      split(w.rows / 8, id, n, &t0, &t1);
      gemm_f32(w, a, M, y, y_stride, t0 * 8, id == n - 1 ? w.rows : t1 * 8);
      return;
    }
    split(w.rows / TILE, id, n, &t0, &t1);
    gemm(w, a, M, y, y_stride, t0, t1);
  }

  void matmuls(const std::vector<QMat>& parts, int M, const float* x, int x_stride, float* y, int y_stride, int id, int n) {
    for (const QMat& w : parts) {
      matmul(w, M, x, x_stride, y, y_stride, id, n);
      y += w.rows;
    }
  }

  int64_t first_key(const Layer& L, int64_t pos) const { return L.window > 0 ? std::max<int64_t>(0, pos - L.window + 1) : 0; }
  static int key_blocks(int64_t first, int64_t pos) { return static_cast<int>((pos - first + KEY_BLOCK) / KEY_BLOCK); }

  // Heads hd0 .. hd0 + count (count <= 4, one KV head) of row r over its keys k0 .. k1 (one block of
  // at most KEY_BLOCK, from the row's first key): per head, the block's top score, sum of
  // exp(score - top) and sum of exp(score - top) * value into partial task0 + h * nb. A row's blocks
  // depend on its position only, never on the threads or the other rows.
  template <int KT>
  void attend_block(int layer, const Row& row, int r, int hd0, int count, int64_t k0, int64_t k1, int task0, int nb,
                    float* sc) {
    using E = typename KvElem<KT>::type;
    const int64_t* st = row.st;
    const int64_t* slots = row.slots + k0;
    const float* q = qkv.data() + static_cast<size_t>(r) * qkv_w + hd0 * head_dim;
    const E* kbase = static_cast<const E*>(row.kv) + layer * st[1] + (hd0 / (heads / kv_heads)) * st[2];
    const E* vbase = kbase + st[0];
    const int n = static_cast<int>(k1 - k0);
    float* out[4];
    float* ml[4];
    for (int h = 0; h < count; ++h) {
      out[h] = part_o.data() + static_cast<size_t>(task0 + h * nb) * head_dim;
      ml[h] = part_ml.data() + 2 * static_cast<size_t>(task0 + h * nb);
    }
    const bool ask = kv_ahead || n <= SHORT_RUN || count == 1 || KT == KV_I8;   // (attend_heads' ask)
    const QCodes qc = query_codes(r, hd0);
    const int D = head_dim / VW;
#define KVB_HEADS(DD)                                                                                      \
    switch (count) {                                                                                       \
      case 1: return attend_heads<KT, DD, 1>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, ask, qc); \
      case 2: return attend_heads<KT, DD, 2>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, ask, qc); \
      case 3: return attend_heads<KT, DD, 3>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, ask, qc); \
      default: return attend_heads<KT, DD, 4>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, ask, qc); \
    }
    if (head_dim == D * VW) {
      switch (D) {
        case 1: KVB_HEADS(1)
        case 2: KVB_HEADS(2)
        case 4: KVB_HEADS(4)
        case 8: KVB_HEADS(8)
        case 16: KVB_HEADS(16)
        default: break;
      }
    }
#undef KVB_HEADS
    if (head_dim == D * VW && D > 16 && D % 4 == 0) {
      switch (count) {
        case 1: return attend_wide<KT, 1>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, qc);
        case 2: return attend_wide<KT, 2>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, qc);
        case 3: return attend_wide<KT, 3>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, qc);
        default: return attend_wide<KT, 4>(q, head_dim, kbase, vbase, slots, st[3], n, scaling, sc, out, ml, qc);
      }
    }
    // other head sizes: one head at a time, in columns (int8 queries: every head scored first, head h
    // at sc + h KEY_BLOCK)
    const bool int_scores = KT == KV_I8 && qc.w;
    if (int_scores) i8_scores(&qc, 1, count, head_dim, reinterpret_cast<const int8_t*>(kbase), slots, st[3], 0, n, scaling, sc);
    for (int h = 0; h < count; ++h) {
      const float* qh = q + h * head_dim;
      float* sh = int_scores ? sc + h * KEY_BLOCK : sc;
      float top = -INFINITY;
      for (int i = 0; i < n; ++i) {
        if (!int_scores) sh[i] = kv_dot<KT>(qh, kbase + slots[i] * st[3], head_dim) * scaling;
        top = std::max(top, sh[i]);
      }
      float sum = 0.f;
      for (int i = 0; i < n; ++i) {
        sh[i] = std::exp(sh[i] - top);
        sum += sh[i];
      }
      std::memset(out[h], 0, sizeof(float) * head_dim);
      for (int j = 0; j < n; ++j) {
        const E* v = vbase + slots[j] * st[3];
        for (int c = 0; c < head_dim; ++c) out[h][c] += sh[j] * kv_elem<KT>(v, c, head_dim);
      }
      ml[h][0] = top;
      ml[h][1] = sum;
    }
  }

  // Row r's attention output for every head from its blocks' partials (tasks from `base`, nb per head).
  void combine(int r, int base, int nb) {
    for (int hd = 0; hd < heads; ++hd) {
      const int t0 = base + hd * nb;
      float top = -INFINITY;
      for (int b = 0; b < nb; ++b) top = std::max(top, part_ml[2 * static_cast<size_t>(t0 + b)]);
      float* out = attn.data() + static_cast<size_t>(r) * q_rows + hd * head_dim;
      std::memset(out, 0, sizeof(float) * head_dim);
      float total = 0.f;
      for (int b = 0; b < nb; ++b) {
        const float scale = std::exp(part_ml[2 * static_cast<size_t>(t0 + b)] - top);
        total += part_ml[2 * static_cast<size_t>(t0 + b) + 1] * scale;
        const float* o = part_o.data() + static_cast<size_t>(t0 + b) * head_dim;
        for (int c = 0; c < head_dim; ++c) out[c] += o[c] * scale;
      }
      const float inv = 1.f / total;
      for (int c = 0; c < head_dim; ++c) out[c] *= inv;
    }
  }

  // Rows `count` (2 ..) of a task over key block blk (each row's own index of it) whose first `shared`
  // keys they all read, heads hd0 .. hd0 + hcount of KV head hd0 / group: one attend_shared, bit for
  // bit each row's attend_block. Head sizes that are no whole number of vectors never share (plan_for).
  template <int KT>
  void attend_rows(int layer, const Row* rows, const int* which, int count, int shared, int hd0, int hcount, int blk,
                   const std::vector<int>& off, float* sc, float* kt, int id) {
    using E = typename KvElem<KT>::type;
    const Layer& L = stack[layer];
    const Row& lead = rows[which[0]];
    const int64_t* st = lead.st;
    const E* kbase = static_cast<const E*>(lead.kv) + layer * st[1] + (hd0 / (heads / kv_heads)) * st[2];
    const E* vbase = kbase + st[0];
    const float* q[SHARED_ROWS];
    QCodes qc[SHARED_ROWS];
    const int64_t* own[SHARED_ROWS];
    int n[SHARED_ROWS];
    float* out[SHARED_ROWS * 4];
    float* ml[SHARED_ROWS * 4];
    for (int i = 0; i < count; ++i) {
      const Row& row = rows[which[i]];
      const int r = which[i];
      const int64_t k0 = first_key(L, row.pos) + static_cast<int64_t>(blk) * KEY_BLOCK;
      own[i] = row.slots + k0;
      n[i] = static_cast<int>(std::min<int64_t>(row.pos + 1, k0 + KEY_BLOCK) - k0);
      const int nb = (off[r + 1] - off[r]) / heads;
      q[i] = qkv.data() + static_cast<size_t>(r) * qkv_w + hd0 * head_dim;
      qc[i] = query_codes(r, hd0);
      for (int h = 0; h < hcount; ++h) {
        const size_t task = off[r] + static_cast<size_t>(hd0 + h) * nb + blk;
        out[i * hcount + h] = part_o.data() + task * head_dim;
        ml[i * hcount + h] = part_ml.data() + 2 * task;
      }
    }
    float* ps = kt + 16 * VW * VW;
    float* vrows = nullptr;                    // over int8 KV: the task's value rows as floats (attend_shared)
    int64_t* vat = nullptr;
    if constexpr (KT == KV_I8) {
      // shared + the sum of n[i] - shared value rows, at most count * KEY_BLOCK, and (count + 1) *
      // KEY_BLOCK places: prepare() sized both for SHARED_ROWS rows
      vrows = value_rows[id].data();
      vat = value_at[id].data();
    }
    const int D = head_dim / VW;
#define KVB_HEADS(DD)                                                                                            \
    switch (hcount) {                                                                                            \
      case 1: return attend_shared<KT, DD, 1>(q, count, head_dim, kbase, vbase, own[0], shared, own, n, st[3], scaling, sc, kt, ps, out, ml, qc, vrows, vat); \
      case 2: return attend_shared<KT, DD, 2>(q, count, head_dim, kbase, vbase, own[0], shared, own, n, st[3], scaling, sc, kt, ps, out, ml, qc, vrows, vat); \
      case 3: return attend_shared<KT, DD, 3>(q, count, head_dim, kbase, vbase, own[0], shared, own, n, st[3], scaling, sc, kt, ps, out, ml, qc, vrows, vat); \
      default: return attend_shared<KT, DD, 4>(q, count, head_dim, kbase, vbase, own[0], shared, own, n, st[3], scaling, sc, kt, ps, out, ml, qc, vrows, vat); \
    }
    switch (D) {
      case 1: KVB_HEADS(1)
      case 2: KVB_HEADS(2)
      case 4: KVB_HEADS(4)
      case 8: KVB_HEADS(8)
      default: KVB_HEADS(16)
    }
#undef KVB_HEADS
  }

  // The attention tasks of a step's layers of one window: the rows over each key block grouped by the
  // KV they read (rows of sequences mapping the same cached blocks, or of one prompt chunk, read the
  // same keys), each group with the keys its rows all share from the block's start (SHARED_MIN at
  // least), and its tasks (group, KV head, block) in the order key block, KV head, group, with the
  // keys each costs. Built once per step and window, the same on every thread.
  struct Task { int first, count, shared, g, blk; };   // rows plan.rows[first .. first + count), KV head g
  struct Plan {
    int64_t window = 0;
    std::vector<int> off;                    // partials before row r ([M + 1])
    std::vector<int> rows;                   // each task's rows, one run per task
    std::vector<Task> tasks;
    std::vector<int64_t> cost;               // per task: its keys (times rows), about its time
    std::vector<int> by_cost;                // the tasks, costliest first (the order threads claim them)
  };
  std::vector<Plan> plans;                   // one per window of the stack (the step's)
  std::unique_ptr<std::atomic<int>[]> claimed;   // per layer: its attention tasks claimed so far this step

  // keys a and b both read from k0 on (at most n): the same KV and the same slots
  int64_t common_keys(const Row& a, const Row& b, int64_t k0, int64_t n) const {
    if (a.kv != b.kv || a.st[0] != b.st[0] || a.st[1] != b.st[1] || a.st[2] != b.st[2] || a.st[3] != b.st[3]) return 0;
    if (a.slots == b.slots) return n;
    int64_t i = 0;
    while (i < n && a.slots[k0 + i] == b.slots[k0 + i]) ++i;
    return i;
  }

  void plan_for(Plan& plan, int64_t window, const Row* rows, int M) {
    plan.window = window;
    Layer probe{};
    probe.window = static_cast<int>(window);
    plan.off.assign(M + 1, 0);
    int most = 0;
    for (int r = 0; r < M; ++r) {
      const int nb = key_blocks(first_key(probe, rows[r].pos), rows[r].pos);
      plan.off[r + 1] = plan.off[r] + heads * nb;
      most = std::max(most, nb);
    }
    const int D = head_dim / VW;
    const bool can_share = head_dim == D * VW && D <= 16 && (D & (D - 1)) == 0;
    plan.rows.clear();
    plan.tasks.clear();
    plan.cost.clear();
    struct Group { std::vector<int> rows; int64_t k0, shared, keys; };
    std::vector<Group> groups;               // the rows over block b, by the keys they read
    for (int b = 0; b < most; ++b) {
      groups.clear();
      for (int r = 0; r < M; ++r) {
        const int64_t k0 = first_key(probe, rows[r].pos) + static_cast<int64_t>(b) * KEY_BLOCK;
        if (k0 > rows[r].pos) continue;      // no block b
        const int64_t n = std::min<int64_t>(rows[r].pos + 1, k0 + KEY_BLOCK) - k0;
        Group* join = nullptr;
        int64_t common = 0;
        for (Group& gr : groups) {
          if (!can_share || gr.k0 != k0 || static_cast<int>(gr.rows.size()) >= SHARED_ROWS) continue;
          common = std::min(gr.shared, common_keys(rows[gr.rows[0]], rows[r], k0, std::min(gr.shared, n)));
          if (common >= SHARED_MIN) { join = &gr; break; }
        }
        if (join) {
          join->rows.push_back(r);
          join->shared = common;
          join->keys += n;
        } else {
          groups.push_back({{r}, k0, n, n});
        }
      }
      for (int g = 0; g < kv_heads; ++g)
        for (const Group& gr : groups) {
          plan.tasks.push_back({static_cast<int>(plan.rows.size()), static_cast<int>(gr.rows.size()),
                                static_cast<int>(gr.shared), g, b});
          plan.rows.insert(plan.rows.end(), gr.rows.begin(), gr.rows.end());
          plan.cost.push_back(gr.keys + static_cast<int64_t>(gr.rows.size()) * VW);
        }
    }
    plan.by_cost.resize(plan.tasks.size());
    for (size_t i = 0; i < plan.by_cost.size(); ++i) plan.by_cost[i] = static_cast<int>(i);
    std::stable_sort(plan.by_cost.begin(), plan.by_cost.end(), [&](int a, int b) { return plan.cost[a] > plan.cost[b]; });
  }

  void plan_step(const Row* rows, int M) {
    std::vector<int64_t> windows;
    for (const Layer& L : stack)
      if (std::find(windows.begin(), windows.end(), L.window) == windows.end()) windows.push_back(L.window);
    plans.resize(windows.size());
    for (size_t i = 0; i < windows.size(); ++i) plan_for(plans[i], windows[i], rows, M);
  }

  // Attention of the M rows (their K and V written): the threads claim the plan's tasks one at a time,
  // costliest first, so heads and keys of a long context share the cores and no thread waits long
  // for another; then each row's partials combined. Every partial is computed by one thread with the
  // arithmetic of its row alone, whichever rows share its task and whichever thread claims it.
  void attention(int l, const Row* rows, int M, int id, int n) {
    const Layer& L = stack[l];
    const Plan* plan = &plans[0];
    for (const Plan& p : plans) if (p.window == L.window) plan = &p;
    const std::vector<int>& off = plan->off;
    const int group = heads / kv_heads;
    const int tasks = static_cast<int>(plan->tasks.size());
    for (int k; (k = claimed[l].fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const Task& task = plan->tasks[plan->by_cost[k]];
      const int* which = plan->rows.data() + task.first;
      const Row& lead = rows[which[0]];
      const int64_t k0 = first_key(L, lead.pos) + static_cast<int64_t>(task.blk) * KEY_BLOCK;
      const int64_t k1 = std::min<int64_t>(lead.pos + 1, k0 + KEY_BLOCK);
      float* sc = scores[id].data();
      float* kt = turned[id].data();
      for (int hd = task.g * group; hd < (task.g + 1) * group; hd += 4) {
        const int count = std::min(4, (task.g + 1) * group - hd);
        if (task.count > 1) {
          const int c = task.count, s = task.shared;
          if (kv_type == KV_F16) attend_rows<KV_F16>(l, rows, which, c, s, hd, count, task.blk, off, sc, kt, id);
          else if (kv_type == KV_BF16) attend_rows<KV_BF16>(l, rows, which, c, s, hd, count, task.blk, off, sc, kt, id);
          else if (kv_type == KV_I8) attend_rows<KV_I8>(l, rows, which, c, s, hd, count, task.blk, off, sc, kt, id);
          else attend_rows<KV_F32>(l, rows, which, c, s, hd, count, task.blk, off, sc, kt, id);
          continue;
        }
        const int r = which[0];
        const int nb = (off[r + 1] - off[r]) / heads;
        const int t0 = off[r] + hd * nb + task.blk;
        if (kv_type == KV_F16) attend_block<KV_F16>(l, rows[r], r, hd, count, k0, k1, t0, nb, sc);
        else if (kv_type == KV_BF16) attend_block<KV_BF16>(l, rows[r], r, hd, count, k0, k1, t0, nb, sc);
        else if (kv_type == KV_I8) attend_block<KV_I8>(l, rows[r], r, hd, count, k0, k1, t0, nb, sc);
        else attend_block<KV_F32>(l, rows[r], r, hd, count, k0, k1, t0, nb, sc);
      }
    }
    team.barrier(n);
    for (int r2 = id; r2 < M; r2 += n) {
      combine(r2, off[r2], (off[r2 + 1] - off[r2]) / heads);
      quantize_row(attn.data(), q_rows, q_rows, r2);
    }
  }

  // One decoder layer over the M rows, this thread's share. Per-row work goes to thread r % n,
  // matrices split by output rows, attention by (row, head): each number is computed by one
  // thread in one order, whatever M, the split and the other rows.
  void layer_step(int l, const Row* rows, int M, int id, int n) {
    const int kv_rows = kv_heads * head_dim;
    const Layer& L = stack[l];
    for (int r = id; r < M; r += n) {
      rms_norm(x.data() + static_cast<size_t>(r) * hidden, L.in_norm, hidden, eps, h.data() + static_cast<size_t>(r) * hw);
      quantize_row(h.data(), hw, hidden, r);
    }
    team.barrier(n);
    matmuls(L.qkv, M, h.data(), hw, qkv.data(), qkv_w, id, n);
    team.barrier(n);
    for (int r = id; r < M; r += n) {          // rotary, then every row's K and V written before any attends
      const Row& row = rows[r];
      float* q = qkv.data() + static_cast<size_t>(r) * qkv_w;
      float* k = q + q_rows;
      float* v = k + kv_rows;
      const float* cos = L.rope ? row.cos2 : row.cos;
      const float* sin = L.rope ? row.sin2 : row.sin;
      for (int hd = 0; hd < heads; ++hd) {
        if (L.q_norm) rms_norm(q + hd * head_dim, L.q_norm, head_dim, eps, q + hd * head_dim);
        rotate(q + hd * head_dim, cos, sin, head_dim);
      }
      if (i8_queries) quantize_queries(r);
      for (int g = 0; g < kv_heads; ++g) {
        if (L.k_norm) rms_norm(k + g * head_dim, L.k_norm, head_dim, eps, k + g * head_dim);
        rotate(k + g * head_dim, cos, sin, head_dim);
        const int64_t at = l * row.st[1] + g * row.st[2] + row.slots[row.pos] * row.st[3];
        kv_put(row.kv, kv_type, at, k + g * head_dim, head_dim);
        kv_put(row.kv, kv_type, at + row.st[0], v + g * head_dim, head_dim);
      }
    }
    team.barrier(n);
    attention(l, rows, M, id, n);
    team.barrier(n);
    matmul(L.o, M, attn.data(), q_rows, h.data(), hw, id, n);
    team.barrier(n);
    for (int r = id; r < M; r += n) {
      float* xr = x.data() + static_cast<size_t>(r) * hidden;
      float* hr = h.data() + static_cast<size_t>(r) * hw;
      if (L.attn_norm) rms_norm(hr, L.attn_norm, hidden, eps, hr);
      for (int i = 0; i < hidden; ++i) xr[i] += hr[i];
      rms_norm(xr, L.post_norm, hidden, eps, hr);
      quantize_row(h.data(), hw, hidden, r);
    }
    team.barrier(n);
    matmuls(L.gate_up, M, h.data(), hw, mlp.data(), 2 * inter, id, n);
    team.barrier(n);
    for (int r = id; r < M; r += n) {
      const float* mr = mlp.data() + static_cast<size_t>(r) * 2 * inter;
      float* ar = act.data() + static_cast<size_t>(r) * inter;
      if (activation == ACT_GELU_TANH) gelu_tanh_mul(mr, mr + inter, inter, ar);
      else silu_mul(mr, mr + inter, inter, ar);
      quantize_row(act.data(), inter, inter, r);
    }
    team.barrier(n);
    matmul(L.down, M, act.data(), inter, h.data(), hw, id, n);
    team.barrier(n);
    for (int r = id; r < M; r += n) {         // the next layer's first stage is this thread's rows too
      float* xr = x.data() + static_cast<size_t>(r) * hidden;
      float* hr = h.data() + static_cast<size_t>(r) * hw;
      if (L.mlp_norm) rms_norm(hr, L.mlp_norm, hidden, eps, hr);
      for (int i = 0; i < hidden; ++i) xr[i] += hr[i];
    }
  }

  // Final norm and head for the wanted rows (compacted: wanted row j in h / xq row j), then the
  // best exact_top logits of each recomputed in float from its float activations.
  void head_step(float* logits, int id, int n) {
    const int W = static_cast<int>(wanted.size());
    if (W == 0) return;
    team.barrier(n);                            // every row's last layer done (rows move to row j)
    for (int j = id; j < W; j += n) {
      rms_norm(x.data() + static_cast<size_t>(wanted[j]) * hidden, final_norm, hidden, eps,
               h.data() + static_cast<size_t>(j) * hw);
      quantize_row(h.data(), hw, hidden, j);
    }
    team.barrier(n);
    matmul(head, W, h.data(), hw, logits, vocab, id, n);
    if (exact_top <= 0) return;
    team.barrier(n);
    for (int j = id; j < W; j += n) refine_top(logits + static_cast<size_t>(j) * vocab, h.data() + static_cast<size_t>(j) * hw, id);
  }

  // The best exact_top rows of one row's logits (ascending scan), recomputed in float. Past the first
  // exact_top, a vector of logits none of which beats the heap's least (which only rises) is passed
  // over whole: the same rows chosen as one by one. A NaN among the first breaks the heap's order
  // (its least can fall), so then every row is offered one by one, as before.
  void refine_top(float* logits, const float* hj, int id) {
    std::vector<std::pair<float, int>>& best = tops[id];     // capacity exact_top (no allocation in the team)
    best.clear();
    auto offer = [&](int row) {
      if (logits[row] > best.front().first) {
        std::pop_heap(best.begin(), best.end(), std::greater<>());
        best.back() = {logits[row], row};
        std::push_heap(best.begin(), best.end(), std::greater<>());
      }
    };
    int row = 0;
    for (; row < head.rows && static_cast<int>(best.size()) < exact_top; ++row) {
      best.emplace_back(logits[row], row);
      std::push_heap(best.begin(), best.end(), std::greater<>());
    }
    bool ordered = true;                     // no NaN in the heap (none joins it later: NaN > x is false)
    for (const auto& entry : best) ordered = ordered && entry.first == entry.first;
    for (; ordered && row + VW <= head.rows; row += VW)
      for (unsigned m = vgt_mask(vload(logits + row), vset1(best.front().first)); m; m &= m - 1) offer(row + __builtin_ctz(m));
    for (; row < head.rows; ++row) offer(row);
    for (auto& [value, r] : best) logits[r] = exact_row(head, r, hj);
  }

  // Everything a step over these rows allocates, before its thread team starts: an exception out of
  // the team would end the process, so the team allocates nothing (std::bad_alloc, std::length_error,
  // std::out_of_range or std::invalid_argument from here: the step does not run and no KV is written).
  void prepare(int M, const Row* rows) {
    if (M < 1) throw std::invalid_argument("a step of no rows");
    for (int r = 0; r < M; ++r)
      if (rows[r].pos < 0 || rows[r].pos >= MAX_POSITION) throw std::invalid_argument("a row's position out of range");
    reserve(M);
    size_t tasks = 0;                          // the most attention tasks of any layer (no window)
    for (int r = 0; r < M; ++r) tasks += static_cast<size_t>(heads) * key_blocks(0, rows[r].pos);
    if (tasks > static_cast<size_t>(INT32_MAX)) throw std::out_of_range("attention partials past int offsets");
    if (part_ml.size() < 2 * tasks) { part_o.resize(tasks * head_dim); part_ml.resize(2 * tasks); }
    plan_step(rows, M);
    if (kv_type == KV_I8 && M > 1)             // rows that may share a key block (attend_rows)
      for (int i = 0; i < team.size(); ++i) {
        if (value_rows[i].size() < static_cast<size_t>(SHARED_ROWS) * KEY_BLOCK * head_dim)
          value_rows[i].resize(static_cast<size_t>(SHARED_ROWS) * KEY_BLOCK * head_dim);
        if (value_at[i].size() < static_cast<size_t>(SHARED_ROWS + 1) * KEY_BLOCK)
          value_at[i].resize(static_cast<size_t>(SHARED_ROWS + 1) * KEY_BLOCK);
      }
  }

  // One step over M rows: 0, or (nothing computed, no KV written) 1 where its scratch could not be
  // allocated, 2 where a row's position is out of range, 3 where its attention partials would pass
  // 2^31 entries (the int offsets of a plan).
  int step(int M, const float* x_in, const Row* rows, float* logits) {
    std::lock_guard<std::mutex> lock(busy);
    std::function<void(int, int)> job;
    try {
      prepare(M, rows);
      job = [this, M, rows, logits](int id, int n) {
        for (int l = 0; l < layers; ++l) layer_step(l, rows, M, id, n);
        head_step(logits, id, n);
      };
    } catch (const std::invalid_argument&) {
      return 2;
    } catch (const std::out_of_range&) {
      return 3;
    } catch (const std::exception&) {          // std::bad_alloc, std::length_error
      return 1;
    }
    std::memcpy(x.data(), x_in, sizeof(float) * M * hidden);
    wanted.clear();
    for (int r = 0; r < M; ++r) if (rows[r].want) wanted.push_back(r);
    for (int l = 0; l < layers; ++l) claimed[l].store(0, std::memory_order_relaxed);   // (the team starts after)
    team.run(job);
    return 0;
  }
};

// The interface's structures (native/abi.py mirrors them field for field).
struct MatArgs {             // one matrix (QMat); rows 0: absent (stacked into the matrix before it)
  const void* codes;
  const void* d;
  const void* m;
  const float* bias;
  const uint16_t* d2;        // S_U8 d and m, S_I8 d: their float16 super-block scales (see QMat), else null
  const uint16_t* m2;
  int32_t rows, cols, bits, d_type, m_type, zero;   // zero: see QMat
};

struct LayerArgs {           // one decoder layer: q holds q, k, v when k and v are absent; gate holds up
  const float* in_norm;
  const float* post_norm;
  MatArgs q, k, v, o, gate, up, down;
  int64_t window;            // 0: full attention
  const float* q_norm;       // RMSNorm weights [head_dim] of each query / key head before the rotary, or null
  const float* k_norm;
  const float* attn_norm;    // RMSNorm weights over the attention's / the MLP's output before the residual
  const float* mlp_norm;     // add (Gemma 3), or null
  int64_t rope;              // 0: the row's cos / sin; 1: cos2 / sin2
};

struct ModelArgs {
  int32_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, exact_top, threads, kv_type;   // KvType
  int32_t act;               // Act
  int32_t kv_ahead;          // 1: one-row attention asks for KV rows ahead in every block (0: only in short
                             // runs, for one query head per KV head and over int8 KV; Decoder::kv_ahead)
  float eps, scaling;
  const LayerArgs* stack;    // [layers]
  const float* final_norm;
  MatArgs head;
};

QMat qmat(const MatArgs& a) {
  return QMat{static_cast<const uint8_t*>(a.codes), a.d, a.m, a.bias, a.d2, a.m2, a.rows, a.cols, a.bits, a.d_type, a.m_type,
              static_cast<float>(a.zero)};
}

// Why matrix `a` cannot be read as a [rows, cols] matrix by the kernels ("" where it can): the
// shapes and scale types gemm / gemm_f32 run (a pair they do not would leave the output unwritten).
std::string matrix_refusal(const MatArgs& a, int rows, int cols) {
  if (a.rows != rows || a.cols != cols)
    return "is " + std::to_string(a.rows) + " x " + std::to_string(a.cols) + ", expected " + std::to_string(rows) +
           " x " + std::to_string(cols);
  if (!a.codes) return "has no codes";
  if (a.bits == 32) return "";
  if (a.bits != 4 && a.bits != 6 && a.bits != 8) return "has " + std::to_string(a.bits) + "-bit codes (4, 6, 8 or 32)";
  if (a.rows % TILE || a.cols % BLOCK) return "is not a multiple of 16 rows x 32 columns";
  if (!a.d) return "has no d";
  const bool floats = a.d_type >= S_BF16 && a.d_type <= S_F32 && ((a.m_type >= S_BF16 && a.m_type <= S_F32) || a.m_type == S_NONE);
  const bool k_quant = a.d_type == S_U8 && a.m_type == S_U8 && a.d2 && a.m2 && a.cols % (8 * BLOCK) == 0;
  const bool q6 = a.d_type == S_I8 && a.m_type == S_NONE && a.bits == 6 && a.d2 && a.zero == 32 && a.cols % (8 * BLOCK) == 0;
  if (!floats && !k_quant && !q6)
    return "has scale types d " + std::to_string(a.d_type) + ", m " + std::to_string(a.m_type) + " the kernels do not read";
  if (a.m_type != S_NONE && !a.m) return "has no m";
  if (a.m_type == S_NONE && (a.zero <= 0 || (a.zero & (a.zero - 1)))) return "has no m and a zero code that is no power of two";
  return "";
}

// Why the library cannot run this model ("" where it can): sizes, types and every matrix's shape.
std::string model_refusal(const ModelArgs& a) {
  if (a.layers < 1 || a.hidden < 1 || a.heads < 1 || a.kv_heads < 1 || a.head_dim < 2 || a.inter < 1 || a.vocab < 1 ||
      a.threads < 1)
    return "a size below one";
  if (a.heads % a.kv_heads) return "query heads not a multiple of KV heads";
  if (a.head_dim % 2) return "an odd head_dim";
  if (a.kv_type < KV_F32 || a.kv_type > KV_I8) return "an unknown KV type";
  if (a.kv_type == KV_I8 && a.head_dim % KV_I8_BLOCK) return "int8 KV needs a head_dim that is a multiple of 32";
  if (a.act != ACT_SILU && a.act != ACT_GELU_TANH) return "an unknown activation";
  if (!a.stack || !a.final_norm) return "no layers or final norm";
  const int q_rows = a.heads * a.head_dim, kv_rows = a.kv_heads * a.head_dim;
  for (int l = 0; l < a.layers; ++l) {
    const LayerArgs& L = a.stack[l];
    const std::string at = "layer " + std::to_string(l) + "'s ";
    if (!L.in_norm || !L.post_norm) return at + "norms are missing";
    if (L.window < 0 || L.rope < 0 || L.rope > 1) return at + "window or rotary kind is out of range";
    const bool fused_qkv = !L.k.rows, fused_mlp = !L.up.rows;
    if (fused_qkv != !L.v.rows) return at + "k and v are both stacked into q or neither";
    const struct { const char* name; const MatArgs* m; int rows, cols; } mats[] = {
        {"q", &L.q, fused_qkv ? q_rows + 2 * kv_rows : q_rows, a.hidden},
        {"k", fused_qkv ? nullptr : &L.k, kv_rows, a.hidden},
        {"v", fused_qkv ? nullptr : &L.v, kv_rows, a.hidden},
        {"o", &L.o, a.hidden, q_rows},
        {"gate", &L.gate, fused_mlp ? 2 * a.inter : a.inter, a.hidden},
        {"up", fused_mlp ? nullptr : &L.up, a.inter, a.hidden},
        {"down", &L.down, a.hidden, a.inter}};
    for (const auto& m : mats) {
      if (!m.m) continue;
      const std::string why = matrix_refusal(*m.m, m.rows, m.cols);
      if (!why.empty()) return at + m.name + " " + why;
    }
  }
  const std::string why = matrix_refusal(a.head, a.vocab, a.hidden);
  return why.empty() ? "" : "the head " + why;
}

// The decoder of a model model_refusal accepts (std::bad_alloc where its scratch cannot be allocated)
std::unique_ptr<Decoder> build_decoder(const ModelArgs* args) {
  std::unique_ptr<Decoder> dec(new Decoder(args->threads));
  dec->layers = args->layers; dec->hidden = args->hidden; dec->heads = args->heads; dec->kv_heads = args->kv_heads;
  dec->head_dim = args->head_dim; dec->inter = args->inter; dec->vocab = args->vocab; dec->exact_top = args->exact_top;
  dec->eps = args->eps; dec->scaling = args->scaling; dec->kv_type = args->kv_type; dec->activation = args->act;
  dec->kv_ahead = args->kv_ahead != 0;
  for (int l = 0; l < dec->layers; ++l) {
    const LayerArgs& a = args->stack[l];
    Layer L;
    L.in_norm = a.in_norm;
    L.post_norm = a.post_norm;
    L.q_norm = a.q_norm;
    L.k_norm = a.k_norm;
    L.attn_norm = a.attn_norm;
    L.mlp_norm = a.mlp_norm;
    L.rope = static_cast<int>(a.rope);
    for (const MatArgs* part : {&a.q, &a.k, &a.v}) if (part->rows) L.qkv.push_back(qmat(*part));
    for (const MatArgs* part : {&a.gate, &a.up}) if (part->rows) L.gate_up.push_back(qmat(*part));
    L.o = qmat(a.o);
    L.down = qmat(a.down);
    for (const QMat& m : {L.o, L.down}) if (m.bits != 32) dec->quantized = true;
    for (const QMat& m : L.qkv) if (m.bits != 32) dec->quantized = true;
    for (const QMat& m : L.gate_up) if (m.bits != 32) dec->quantized = true;
    for (const QMat& m : {L.o, L.down}) if (m.d_type == S_I8) dec->half_sums = true;
    for (const QMat& m : L.qkv) if (m.d_type == S_I8) dec->half_sums = true;
    for (const QMat& m : L.gate_up) if (m.d_type == S_I8) dec->half_sums = true;
    L.window = static_cast<int>(a.window);
    dec->stack.push_back(L);
  }
  dec->claimed.reset(new std::atomic<int>[dec->layers]);
  dec->final_norm = args->final_norm;
  dec->head = qmat(args->head);
  if (dec->head.bits != 32) dec->quantized = true;
  if (dec->head.bits != 32 && dec->head.d_type == S_I8) dec->half_sums = true;
  if (dec->head.bits == 32) dec->exact_top = 0;         // float logits need no recomputation
  dec->i8_queries = dec->kv_type == KV_I8 && dec->quantized && dec->head_dim <= MAX_I8_HEAD_DIM;
  const int q_rows = dec->heads * dec->head_dim, kv_rows = dec->kv_heads * dec->head_dim;
  const int widest = std::max({dec->hidden, q_rows, dec->inter});
  dec->q_rows = q_rows; dec->hw = std::max(dec->hidden, q_rows); dec->qkv_w = q_rows + 2 * kv_rows;
  dec->xq_w = widest + 64; dec->s_w = widest / BLOCK + 1;
  dec->reserve(1);
  const size_t per_thread = std::max(dec->team.size(), 64);            // (an OpenMP team may differ in size)
  dec->scores.assign(per_thread, std::vector<float>(SHARED_ROWS * 4 * KEY_BLOCK));
  dec->turned.assign(per_thread, std::vector<float>((16 + SHARED_ROWS * 4) * VW * VW));
  dec->value_rows.resize(per_thread);
  dec->value_at.resize(per_thread);
  dec->tops.resize(per_thread);
  for (auto& top : dec->tops) top.reserve(std::max(dec->exact_top, 0));
  size_t expand = 0;                                                   // the widest 6-bit tile expanded
  if (EXPANDS) {
    for (const Layer& L : dec->stack) {
      for (const QMat& m : L.qkv) if (m.bits == 6) expand = std::max(expand, expanded_bytes(m));
      for (const QMat& m : L.gate_up) if (m.bits == 6) expand = std::max(expand, expanded_bytes(m));
      for (const QMat& m : {L.o, L.down}) if (m.bits == 6) expand = std::max(expand, expanded_bytes(m));
    }
    if (dec->head.bits == 6) expand = std::max(expand, expanded_bytes(dec->head));
  }
  if (expand) dec->expanded.assign(dec->team.size(), std::vector<uint8_t>(expand));   // (thread ids < team size)
  return dec;
}

}  // namespace

extern "C" {

int kvb_abi_version() { return 16; }

// the instruction set this library was built for: "avx512", "avxvnni" or "avx2"
const char* kvb_isa() { return ISA_NAME; }

// sizeof MatArgs, LayerArgs, ModelArgs, Row (which 0..3): the loader checks abi.py lays them out alike
int64_t kvb_struct_size(int which) {
  const int64_t sizes[] = {sizeof(MatArgs), sizeof(LayerArgs), sizeof(ModelArgs), sizeof(Row)};
  return which >= 0 && which < 4 ? sizes[which] : -1;
}

// A decoder for this model, or null with the reason in why[why_size] (a model the kernels cannot run, or
// memory for its scratch that could not be allocated)
void* kvb_decoder_new(const ModelArgs* args, char* why, int why_size) {
  auto refuse = [&](const char* reason) -> void* {       // (allocates nothing: also after a bad_alloc)
    if (why && why_size > 0) {
      std::strncpy(why, reason, static_cast<size_t>(why_size) - 1);
      why[why_size - 1] = '\0';
    }
    return nullptr;
  };
  try {
    const std::string reason = model_refusal(*args);
    if (!reason.empty()) return refuse(reason.c_str());
    std::unique_ptr<Decoder> dec = build_decoder(args);
    return dec.release();
  } catch (const std::exception&) {
    return refuse("the library could not allocate its scratch memory");
  }
}

// 1 where int8 keys are scored against the query in int8 (Decoder::i8_queries), else 0
int kvb_decoder_int8_queries(void* handle) { return static_cast<Decoder*>(handle)->i8_queries ? 1 : 0; }

// One step over M rows (decode.cpp Row: each its own KV, slots and position; the rows of one
// sequence's prompt chunk share them): x [M, hidden] their embeddings; logits [wanted rows, vocab].
// 0; or, the step not run and no KV written: 1 where its scratch memory could not be allocated, 2 where
// a row's position is negative or at least MAX_POSITION, 3 where its attention partials pass 2^31
// entries (Decoder::step).
int kvb_decoder_rows(void* handle, int M, const float* x, const void* rows, float* logits) {
  return static_cast<Decoder*>(handle)->step(M, x, static_cast<const Row*>(rows), logits);
}

// The embeddings of tokens ids[0 .. M) decoded from the packed head (a model whose input embedding
// is its head's table) into x [M, hidden]; 0, or -1 where the head is float or its d float32 (then
// the caller looks them up itself).
int kvb_decoder_embed(void* handle, int M, const int64_t* ids, float* x) {
  const QMat& head = static_cast<Decoder*>(handle)->head;
  if (head.bits == 32 || head.d_type == S_F32) return -1;
  for (int i = 0; i < M; ++i)
    if (ids[i] < 0 || ids[i] >= head.rows) return -1;
  decode_rows_of(head, ids, M, x);
  return 0;
}

void kvb_decoder_free(void* handle) { delete static_cast<Decoder*>(handle); }

}  // extern "C"

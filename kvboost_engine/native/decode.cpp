// One decode step of a Llama-family model (RMSNorm, rotary, grouped-query attention, SiLU MLP)
// for one sequence, on CPU with AVX512-VNNI: every matrix-vector product reads 4-bit (layers) or
// 8-bit (head) weight codes and multiplies them with the activation quantized to int8 per block of
// 32 (vpdpbusd), then scales each block: y[n] += d[n,b] * dx[b] * sum(code * xq) + m[n,b] * dx[b] * sum(xq),
// where a weight decodes to code * d + m. Float32 weights (bits = 32, the model's own row-major
// matrices) are read as they are, with the float activations. The rest of the layer (norms, rotary, attention over the
// sequence's KV slots, residuals, SiLU) runs here too, so a step is one call from Python.
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
#include <mutex>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int TILE = 16;     // output rows per tile
constexpr int BLOCK = 32;    // input columns per block (one activation scale, one weight scale per row)

enum ScaleType { S_BF16 = 0, S_F16 = 1, S_F32 = 2 };   // element type of a matrix's d and m

struct QMat {                // weight [rows, cols] in tiles of 16 rows x blocks of 32 columns
  const uint8_t* codes;      // 4-bit: 256 bytes per (tile, block); 8-bit: 512; 32: float rows [rows, cols]
  const void* d;             // d_type [tiles][blocks][16]: code scale
  const void* m;             // m_type [tiles][blocks][16]: value of code 0
  const float* bias;         // [rows] or null
  int rows, cols, bits;
  int d_type, m_type;        // ScaleType: d bf16 / fp16 / fp32, m fp16 / fp32
};

struct Layer {
  const float* in_norm;
  const float* post_norm;
  std::vector<QMat> qkv, gate_up;   // q, k, v (or one matrix of them stacked); gate, up (or stacked)
  QMat o, down;
  int window;                // 0: full attention; else keys with pos - window < k <= pos
};

inline __m512 bf16_to_f32(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline float bf16_scalar(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float f16_scalar(uint16_t v) { return _mm512_cvtss_f32(_mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(v)))); }

// 16 scales from p + i, of element type T, as floats
template <int T>
inline __m512 load_scales(const void* p, size_t i) {
  if constexpr (T == S_BF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(p) + i);
  } else if constexpr (T == S_F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  }
}

inline float scale_at(const void* p, int type, size_t i) {
  if (type == S_BF16) return bf16_scalar(static_cast<const uint16_t*>(p)[i]);
  if (type == S_F16) return f16_scalar(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// Activation x [cols] -> int8 codes per block of 32 (round to nearest), block scale dx, dx * sum(codes).
void quantize(const float* x, int cols, int8_t* xq, float* dx, float* sx) {
  for (int b = 0; b < cols / BLOCK; ++b) {
    __m512 a0 = _mm512_loadu_ps(x + b * BLOCK), a1 = _mm512_loadu_ps(x + b * BLOCK + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(inv)));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * BLOCK), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q1));
    dx[b] = amax / 127.f;
    sx[b] = dx[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

// y[t*16 .. t1*16) of W x, x given quantized; DT, MT: the element types of d and m.
template <int DT, int MT>
void gemv_t(const QMat& w, const int8_t* xq, const float* dx, const float* sx, float* y, int t0, int t1) {
  const int blocks = w.cols / BLOCK;
  const size_t block_bytes = w.bits == 4 ? 256 : 512;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int32_t* xw = reinterpret_cast<const int32_t*>(xq);
  for (int t = t0; t < t1; ++t) {
    const uint8_t* wp = w.codes + static_cast<size_t>(t) * blocks * block_bytes;
    const size_t sp = static_cast<size_t>(t) * blocks * TILE;
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; ++b, wp += block_bytes) {
      const int32_t* xb = xw + b * (BLOCK / 4);
      __m512i s = _mm512_setzero_si512();
      if (w.bits == 4) {
        for (int j = 0; j < 4; ++j) {           // 8 columns: low nibbles 8j..8j+3, high 8j+4..8j+7
          __m512i v = _mm512_loadu_si512(wp + j * 64);
          s = _mm512_dpbusd_epi32(s, _mm512_and_si512(v, nibble), _mm512_set1_epi32(xb[2 * j]));
          s = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), _mm512_set1_epi32(xb[2 * j + 1]));
        }
      } else {
        for (int j = 0; j < 8; ++j)             // 4 columns 4j..4j+3 per load
          s = _mm512_dpbusd_epi32(s, _mm512_loadu_si512(wp + j * 64), _mm512_set1_epi32(xb[j]));
      }
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(load_scales<DT>(w.d, sp + b * TILE), _mm512_set1_ps(dx[b])), acc);
      acc = _mm512_fmadd_ps(load_scales<MT>(w.m, sp + b * TILE), _mm512_set1_ps(sx[b]), acc);
    }
    if (w.bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(w.bias + t * TILE));
    _mm512_storeu_ps(y + t * TILE, acc);
  }
}

void gemv(const QMat& w, const int8_t* xq, const float* dx, const float* sx, float* y, int t0, int t1) {
  switch (w.d_type * 3 + w.m_type) {
    case S_BF16 * 3 + S_F32: return gemv_t<S_BF16, S_F32>(w, xq, dx, sx, y, t0, t1);
    case S_BF16 * 3 + S_F16: return gemv_t<S_BF16, S_F16>(w, xq, dx, sx, y, t0, t1);
    case S_F16 * 3 + S_F32: return gemv_t<S_F16, S_F32>(w, xq, dx, sx, y, t0, t1);
    case S_F16 * 3 + S_F16: return gemv_t<S_F16, S_F16>(w, xq, dx, sx, y, t0, t1);
    case S_F32 * 3 + S_F32: return gemv_t<S_F32, S_F32>(w, xq, dx, sx, y, t0, t1);
    default: return gemv_t<S_F32, S_F16>(w, xq, dx, sx, y, t0, t1);
  }
}

// y[r0 .. r1) of W x for float32 W [rows, cols] (row-major), eight rows at a time.
void gemv_f32(const QMat& w, const float* x, float* y, int r0, int r1) {
  const float* base = reinterpret_cast<const float*>(w.codes);
  const int k = w.cols;
  int r = r0;
  for (; r + 8 <= r1; r += 8) {
    const float* a = base + static_cast<size_t>(r) * k;
    __m512 s[8];
    for (int i = 0; i < 8; ++i) s[i] = _mm512_setzero_ps();
    int c = 0;
    for (; c + 16 <= k; c += 16) {
      __m512 xv = _mm512_loadu_ps(x + c);
      for (int i = 0; i < 8; ++i) s[i] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i * k + c), xv, s[i]);
    }
    for (int i = 0; i < 8; ++i) {
      float t = _mm512_reduce_add_ps(s[i]);
      for (int cc = c; cc < k; ++cc) t += a[i * k + cc] * x[cc];
      y[r + i] = t + (w.bias ? w.bias[r + i] : 0.f);
    }
  }
  for (; r < r1; ++r) {
    const float* a = base + static_cast<size_t>(r) * k;
    float t = 0.f;
    for (int c = 0; c < k; ++c) t += a[c] * x[c];
    y[r] = t + (w.bias ? w.bias[r] : 0.f);
  }
}

// Row n of W decoded to floats, dotted with float x (the exact recomputation of the best logits).
float exact_row(const QMat& w, int n, const float* x) {
  const int blocks = w.cols / BLOCK, t = n / TILE, r = n % TILE;
  const size_t block_bytes = w.bits == 4 ? 256 : 512;
  double total = 0.0;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* wp = w.codes + (static_cast<size_t>(t) * blocks + b) * block_bytes;
    float d = scale_at(w.d, w.d_type, (static_cast<size_t>(t) * blocks + b) * TILE + r);
    float m = scale_at(w.m, w.m_type, (static_cast<size_t>(t) * blocks + b) * TILE + r);
    for (int c = 0; c < BLOCK; ++c) {
      int code;
      if (w.bits == 4) {
        int j = c / 8, i = c % 8;
        uint8_t byte = wp[j * 64 + r * 4 + (i % 4)];
        code = i < 4 ? (byte & 15) : (byte >> 4);
      } else {
        code = wp[(c / 4) * 64 + r * 4 + c % 4];
      }
      total += static_cast<double>(static_cast<float>(code) * d + m) * x[b * BLOCK + c];
    }
  }
  return static_cast<float>(total + (w.bias ? w.bias[n] : 0.f));
}

void rms_norm(const float* x, const float* weight, int n, float eps, float* out) {
  float sum = 0.f;
  for (int i = 0; i < n; ++i) sum += x[i] * x[i];
  float r = 1.f / std::sqrt(sum / n + eps);
  for (int i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * r);
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
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
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

struct Decoder {
  int layers, hidden, heads, kv_heads, head_dim, inter, vocab, exact_top;
  bool quantized = false;    // some matrix reads int8 activations
  float eps, scaling;
  std::vector<Layer> stack;
  const float* final_norm;
  QMat head;
  Team team;
  std::mutex busy;
  // scratch
  std::vector<float> x, h, qkv, attn, mlp, act, dx, sx;
  std::vector<int8_t> xq;
  std::vector<std::vector<float>> scores;
  std::vector<std::vector<std::pair<float, int>>> best;

  Decoder(int threads) : team(threads) {}

  static void split(int tiles, int id, int n, int* t0, int* t1) {
    *t0 = tiles * id / n;
    *t1 = tiles * (id + 1) / n;
  }

  // y = W x, this thread's share; x: the float activation (quantized in xq/dx/sx when W is not float)
  void matvec(const QMat& w, const float* x, float* y, int id, int n) {
    int t0, t1;
    if (w.bits == 32) {
      split(w.rows / 8, id, n, &t0, &t1);
      gemv_f32(w, x, y, t0 * 8, id == n - 1 ? w.rows : t1 * 8);
      return;
    }
    split(w.rows / TILE, id, n, &t0, &t1);
    gemv(w, xq.data(), dx.data(), sx.data(), y, t0, t1);
  }

  void matvecs(const std::vector<QMat>& parts, const float* x, float* y, int id, int n) {
    for (const QMat& w : parts) {
      matvec(w, x, y, id, n);
      y += w.rows;
    }
  }

  // keys and values of one layer: kv + kind * s0 + layer * s1 + head * s2 + slot * s3
  void attention(const Layer& L, int layer, float* kv, const int64_t* st, const int64_t* slots, int64_t pos, int id, int n) {
    const int group = heads / kv_heads;
    const int64_t first = L.window > 0 ? std::max<int64_t>(0, pos - L.window + 1) : 0;
    std::vector<float>& sc = scores[id];
    if (static_cast<int64_t>(sc.size()) < pos + 1) sc.resize(pos + 1);
    int h0, h1;
    split(heads, id, n, &h0, &h1);
    for (int hd = h0; hd < h1; ++hd) {
      const float* q = qkv.data() + hd * head_dim;
      const int g = hd / group;
      const float* kbase = kv + layer * st[1] + g * st[2];
      const float* vbase = kbase + st[0];
      float top = -INFINITY;
      for (int64_t p = first; p <= pos; ++p) {
        float s = dot(q, kbase + slots[p] * st[3], head_dim) * scaling;
        sc[p] = s;
        top = std::max(top, s);
      }
      float total = 0.f;
      for (int64_t p = first; p <= pos; ++p) { sc[p] = std::exp(sc[p] - top); total += sc[p]; }
      float* out = attn.data() + hd * head_dim;
      std::memset(out, 0, sizeof(float) * head_dim);
      for (int64_t p = first; p <= pos; ++p) {
        const float* v = vbase + slots[p] * st[3];
        const float wgt = sc[p] / total;
        for (int i = 0; i < head_dim; ++i) out[i] += wgt * v[i];
      }
    }
  }

  struct StepArgs {
    float* kv;
    const int64_t* st;
    const int64_t* slots;
    int64_t pos;
    const float* cos;
    const float* sin;
  };

  // One decoder layer, this thread's share (thread 0 does the serial parts between barriers).
  void layer_step(int l, const StepArgs& a, int id, int n) {
    float* kv = a.kv;
    const int64_t *st = a.st, *slots = a.slots;
    const int64_t pos = a.pos;
    const float *cos = a.cos, *sin = a.sin;
    const int q_rows = heads * head_dim, kv_rows = kv_heads * head_dim;
    const Layer& L = stack[l];
    if (id == 0) {
      rms_norm(x.data(), L.in_norm, hidden, eps, h.data());
      if (quantized) quantize(h.data(), hidden, xq.data(), dx.data(), sx.data());
    }
    team.barrier(n);
    matvecs(L.qkv, h.data(), qkv.data(), id, n);
    team.barrier(n);
    if (id == 0) {
      float* k = qkv.data() + q_rows;
      float* v = k + kv_rows;
      for (int hd = 0; hd < heads; ++hd) rotate(qkv.data() + hd * head_dim, cos, sin, head_dim);
      for (int g = 0; g < kv_heads; ++g) {
        rotate(k + g * head_dim, cos, sin, head_dim);
        float* at = kv + l * st[1] + g * st[2] + slots[pos] * st[3];
        std::memcpy(at, k + g * head_dim, sizeof(float) * head_dim);
        std::memcpy(at + st[0], v + g * head_dim, sizeof(float) * head_dim);
      }
    }
    team.barrier(n);
    attention(L, l, kv, st, slots, pos, id, n);
    team.barrier(n);
    if (id == 0 && quantized) quantize(attn.data(), q_rows, xq.data(), dx.data(), sx.data());
    team.barrier(n);
    matvec(L.o, attn.data(), h.data(), id, n);
    team.barrier(n);
    if (id == 0) {
      for (int i = 0; i < hidden; ++i) x[i] += h[i];
      rms_norm(x.data(), L.post_norm, hidden, eps, h.data());
      if (quantized) quantize(h.data(), hidden, xq.data(), dx.data(), sx.data());
    }
    team.barrier(n);
    matvecs(L.gate_up, h.data(), mlp.data(), id, n);
    team.barrier(n);
    if (id == 0) {
      for (int i = 0; i < inter; ++i) {
        float g = mlp[i];
        act[i] = g / (1.f + std::exp(-g)) * mlp[inter + i];
      }
      if (quantized) quantize(act.data(), inter, xq.data(), dx.data(), sx.data());
    }
    team.barrier(n);
    matvec(L.down, act.data(), h.data(), id, n);
    team.barrier(n);
    if (id == 0) for (int i = 0; i < hidden; ++i) x[i] += h[i];
  }

  // Final norm and head; with exact_top, each thread's best rows of its own range in best[id].
  void head_step(float* logits, int id, int n) {
    if (id == 0) {
      rms_norm(x.data(), final_norm, hidden, eps, h.data());
      if (quantized) quantize(h.data(), hidden, xq.data(), dx.data(), sx.data());
    }
    team.barrier(n);
    matvec(head, h.data(), logits, id, n);
    if (exact_top > 0) {             // each thread's best rows of its own range
      int t0, t1;
      split(head.rows / TILE, id, n, &t0, &t1);
      std::vector<std::pair<float, int>>& mine = best[id];
      mine.clear();
      for (int row = t0 * TILE; row < t1 * TILE; ++row) {
        if (static_cast<int>(mine.size()) < exact_top) {
          mine.emplace_back(logits[row], row);
          std::push_heap(mine.begin(), mine.end(), std::greater<>());
        } else if (logits[row] > mine.front().first) {
          std::pop_heap(mine.begin(), mine.end(), std::greater<>());
          mine.back() = {logits[row], row};
          std::push_heap(mine.begin(), mine.end(), std::greater<>());
        }
      }
    }
  }

  // Recompute the best exact_top logits in float from the float activations.
  void refine_top(float* logits) {
    std::vector<std::pair<float, int>> all;
    for (auto& b : best) all.insert(all.end(), b.begin(), b.end());
    std::sort(all.begin(), all.end(), std::greater<>());
    all.resize(std::min<size_t>(all.size(), exact_top));
    for (auto& [value, row] : all) logits[row] = exact_row(head, row, h.data());
  }

  void step(const float* x_in, float* kv, const int64_t* st, const int64_t* slots, int64_t pos,
            const float* cos, const float* sin, float* logits) {
    std::lock_guard<std::mutex> lock(busy);
    std::memcpy(x.data(), x_in, sizeof(float) * hidden);
    const StepArgs args{kv, st, slots, pos, cos, sin};
    for (auto& b : best) b.clear();         // a team smaller than the last one leaves no stale rows
    std::function<void(int, int)> job = [&](int id, int n) {
      for (int l = 0; l < layers; ++l) layer_step(l, args, id, n);
      head_step(logits, id, n);
    };
    team.run(job);
    if (exact_top > 0) refine_top(logits);
  }
};

constexpr int MAT_DIMS = 5;  // rows, cols, bits, d type, m type (ScaleType)

QMat qmat(const void* const* p, const int* dims) {
  return QMat{static_cast<const uint8_t*>(p[0]), p[1], p[2], static_cast<const float*>(p[3]),
              dims[0], dims[1], dims[2], dims[3], dims[4]};
}

}  // namespace

extern "C" {

int kvb_abi_version() { return 3; }

// sizes: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, exact_top, threads
// layer_ptrs: per layer 2 norms then 7 matrices (q, k, v, o, gate, up, down) x (codes, d, m, bias) = 30;
// a matrix of 0 rows is absent (stacked into the one before it: q holds q, k, v; gate holds gate, up)
// layer_dims: per layer 7 matrices x (rows, cols, bits, d type, m type) = 35 (types: 0 bf16, 1 fp16, 2 fp32;
// m is fp16 or fp32); windows: per layer (0 = full)
// head_ptrs: final norm, then head (codes, d, m, bias); head_dims: rows, cols, bits, d type, m type
void* kvb_decoder_new(const int* sizes, float eps, float scaling, const void* const* layer_ptrs,
                      const int* layer_dims, const int* windows, const void* const* head_ptrs, const int* head_dims) {
  auto* dec = new Decoder(sizes[8]);
  dec->layers = sizes[0]; dec->hidden = sizes[1]; dec->heads = sizes[2]; dec->kv_heads = sizes[3];
  dec->head_dim = sizes[4]; dec->inter = sizes[5]; dec->vocab = sizes[6]; dec->exact_top = sizes[7];
  dec->eps = eps; dec->scaling = scaling;
  for (int l = 0; l < dec->layers; ++l) {
    const void* const* p = layer_ptrs + l * 30;
    const int* d = layer_dims + l * 7 * MAT_DIMS;
    Layer L;
    L.in_norm = static_cast<const float*>(p[0]);
    L.post_norm = static_cast<const float*>(p[1]);
    for (int i = 0; i < 7; ++i) {
      QMat m = qmat(p + 2 + 4 * i, d + MAT_DIMS * i);
      if (m.rows == 0) continue;
      if (m.bits != 32) dec->quantized = true;
      if (i < 3) L.qkv.push_back(m);
      else if (i == 3) L.o = m;
      else if (i < 6) L.gate_up.push_back(m);
      else L.down = m;
    }
    L.window = windows[l];
    dec->stack.push_back(L);
  }
  dec->final_norm = static_cast<const float*>(head_ptrs[0]);
  dec->head = qmat(head_ptrs + 1, head_dims);
  if (dec->head.bits != 32) dec->quantized = true;
  if (dec->head.bits == 32) dec->exact_top = 0;         // float logits need no recomputation
  const int q_rows = dec->heads * dec->head_dim, kv_rows = dec->kv_heads * dec->head_dim;
  const int widest = std::max({dec->hidden, q_rows, dec->inter});
  dec->x.resize(dec->hidden); dec->h.resize(std::max(dec->hidden, q_rows));
  dec->qkv.resize(q_rows + 2 * kv_rows); dec->attn.resize(q_rows);
  dec->mlp.resize(2 * dec->inter); dec->act.resize(dec->inter);
  dec->xq.resize(widest + 64); dec->dx.resize(widest / BLOCK + 1); dec->sx.resize(widest / BLOCK + 1);
  dec->scores.resize(std::max(dec->team.size(), 64));      // per thread (an OpenMP team may differ in size)
  dec->best.resize(std::max(dec->team.size(), 64));
  return dec;
}

// kv: [2, layers, kv_heads, slots, head_dim]-shaped with element strides kv_strides (4); slots[p]: slot of position p
void kvb_decoder_step(void* handle, const float* x, float* kv, const int64_t* kv_strides, const int64_t* slots,
                      int64_t pos, const float* cos, const float* sin, float* logits) {
  static_cast<Decoder*>(handle)->step(x, kv, kv_strides, slots, pos, cos, sin, logits);
}

void kvb_decoder_free(void* handle) { delete static_cast<Decoder*>(handle); }

}  // extern "C"

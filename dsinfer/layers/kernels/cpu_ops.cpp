// Fused CPU kernels for the decode step (registered as torch.ops.dsinfer.*).
//
// Why C++: a decode step of a small model is dominated by the per-op cost of ~70 small torch
// ops per layer (casts, copies, views). Each kernel below replaces a run of them with one loop
// nest that reads its inputs once, keeps intermediates in fp32 registers, and rounds once to
// the activation dtype. Activations may be float32 or bfloat16; statistics, softmax and
// accumulations are always fp32.
//
// The scratch rule: a buffer used inside a parallel region is `thread_local`, kept across calls
// and sized with assign/clear (which keep its capacity), never allocated per call. An
// allocation there takes the lock of a malloc arena, which the team's threads share wherever
// glibc has few arenas (MALLOC_ARENA_MAX=1 or 2, as container images often set). Measured with
// one arena, one stream of SmolLM2: rope_decode_attention 6.1 → 18.3 µs a call,
// paged_prefill_attention 13.8 → 30.7 µs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The quantised matmuls' instruction sets. AVX-512 with VNNI and BF16 (Intel since Cooper
// Lake, AMD since Zen 4) has its own kernels; CPUs with AVX2 and FMA only (AMD Zen 2/3, Intel
// before Ice Lake: many of the machines people have) have theirs, over the same packed layout.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define DSINFER_AVX512_VNNI_BF16 1
#else
#define DSINFER_AVX512_VNNI_BF16 0
#endif
#if !DSINFER_AVX512_VNNI_BF16 && defined(__AVX2__) && defined(__FMA__)
#define DSINFER_AVX2_QUANT 1
#else
#define DSINFER_AVX2_QUANT 0
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Conversions written as plain bit arithmetic (c10's are branchy calls), over the raw element
// type (bf16 as uint16_t bits): gcc vectorises loops of shifts of uint16_t, not loads of the
// c10::BFloat16 struct. bf16 → fp32 is exact; fp32 → bf16 rounds to nearest even, as torch.
template <typename T>
struct Raw {
  using type = T;
};
template <>
struct Raw<c10::BFloat16> {
  using type = uint16_t;
};
template <typename T>
using raw_t = typename Raw<T>::type;
template <typename T>
inline const raw_t<T>* raw(const T* p) {
  return reinterpret_cast<const raw_t<T>*>(p);
}
template <typename T>
inline raw_t<T>* raw(T* p) {
  return reinterpret_cast<raw_t<T>*>(p);
}
inline float load_f(float v) { return v; }
inline float load_f(double v) { return static_cast<float>(v); }
inline float load_f(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename R>
inline R store_f(float v) {
  return static_cast<R>(v);
}
template <>
inline uint16_t store_f<uint16_t>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return v != v ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// The same on element values, for the scalar code.
inline float f32(float v) { return v; }
inline float f32(c10::BFloat16 v) { return load_f(v.x); }
template <typename T>
inline T from_f32(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 from_f32<c10::BFloat16>(float v) {
  return c10::BFloat16(store_f<uint16_t>(v), c10::BFloat16::from_bits());
}

// Cephes' expf constants, shared by exp_f32 and its vector versions (exp16, exp8), which take
// the same steps: the input's clamp, log2(e), ln 2 in two parts, the polynomial's coefficients.
struct CephesExp {
  static constexpr float kLo = -87.3f, kHi = 88.7f, kLog2e = 1.44269504088896341f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  static constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

// exp(x) (Cephes' expf: 2^n · e^r, |r| <= ln2 / 2, ~1 ulp) in plain arithmetic, so that the
// loops using it vectorise (std::exp is a library call per element).
inline float exp_f32(float x) {
  using C = CephesExp;
  x = std::min(std::max(x, C::kLo), C::kHi);
  const float n = std::floor(x * C::kLog2e + 0.5f);
  float r = x - n * C::kLn2Hi;
  r = r - n * C::kLn2Lo;
  float p = C::kPoly[0];
  p = p * r + C::kPoly[1];
  p = p * r + C::kPoly[2];
  p = p * r + C::kPoly[3];
  p = p * r + C::kPoly[4];
  p = p * r + C::kPoly[5];
  p = p * r * r + r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

// 1 / rms from a row's Σ x²: rsqrt(mean(x²) + eps).
inline float inv_rms(float ss, int64_t n, float eps) { return 1.f / std::sqrt(ss / static_cast<float>(n) + eps); }

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The rows' loops on 8 lanes (defined with the other AVX2 helpers below), for fp32 and bf16
// rows of a multiple of 32: Σ x² of a row; out = round(x · inv) · w; out = round(x + r), returning
// Σ out².
template <typename T>
float sum_squares8(const T* x, int64_t n);
template <typename T>
void scale_row8(const T* x, const T* w, T* out, int64_t n, float inv);
template <typename T>
float add_row8(const T* x, const T* r, T* out, int64_t n);
template <typename T>
constexpr bool kAvx2Row = (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
#endif

// out = weight * round(x * rsqrt(mean(x^2) + eps)), as the reference RMSNorm computes it:
// statistics in fp32, the normalised row rounded to the activation dtype before the weight.
template <typename T>
void rms_row(const T* xt, const T* wt, T* ot, int64_t n, float eps) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  // GCC's `omp simd` sum kept one accumulator (an FMA's latency a vector) and rounded to bf16
  // with scalar-shaped code: ~0.4 µs a 576-wide row.
  if constexpr (kAvx2Row<T>) {
    if (n % 32 == 0) {
      scale_row8(xt, wt, ot, n, inv_rms(sum_squares8(xt, n), n, eps));
      return;
    }
  }
#endif
  using R = raw_t<T>;
  const R* x = raw(xt);
  const R* w = raw(wt);
  R* out = raw(ot);
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += load_f(x[i]) * load_f(x[i]);
  const float inv = inv_rms(ss, n, eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = store_f<R>(load_f(store_f<R>(load_f(x[i]) * inv)) * load_f(w[i]));
}

template <typename T>
inline void add_row(const T* xt, const T* rt, T* ot, int64_t n) {
  using R = raw_t<T>;
  const R* x = raw(xt);
  const R* r = raw(rt);
  R* out = raw(ot);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = store_f<R>(load_f(x[i]) + load_f(r[i]));
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected contiguous [rows, hidden] activations");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "norm weight must be [hidden] in the activation dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// (norm(x + residual), x + residual): the residual add rounds to the activation dtype first,
// as `x + residual` does in the reference.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match the activations");
  auto out = at::empty_like(x);
  auto sum = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    const auto* rp = residual.data_ptr<scalar_t>();
    const auto* wp = weight.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    auto* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if constexpr (kAvx2Row<scalar_t>) {
          if (n % 32 == 0) {  // the sum's squares taken as it is written: one pass fewer
            const float ss = add_row8(xp + r * n, rp + r * n, sp + r * n, n);
            scale_row8(sp + r * n, wp, op + r * n, n, inv_rms(ss, n, static_cast<float>(eps)));
            continue;
          }
        }
#endif
        add_row(xp + r * n, rp + r * n, sp + r * n, n);
        rms_row(sp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

#if defined(__AVX512F__)
// Cephes' expf on 16 lanes (the scalar exp_f32, step for step).
inline __m512 exp16(__m512 x) {
  using C = CephesExp;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(C::kLo)), _mm512_set1_ps(C::kHi));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(C::kLog2e), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::kPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Element types the AVX-512 loops load and store (load16 / store16 below).
template <typename T>
constexpr bool kAvxElement = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
// 16 floats to bf16, rounded to nearest even as torch rounds (c10::BFloat16). With AVX512-BF16
// one instruction; without it (AVX-512 CPUs before Cooper Lake and Zen 4: Skylake-SP, Cascade
// Lake, Ice Lake) the same rounding in integer lanes: add 0x7FFF plus the kept part's lowest
// bit, keep the upper half; NaN stays a quiet NaN. (This file did not compile for such a CPU
// before: the fused backend fell back to the reference there.)
inline __m256i bf16_rne16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
// Round to the element type (bf16: nearest even, as torch) and back, or store.
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const c10::BFloat16*) {
  uint16_t tmp[16];
  _mm256_storeu_si256((__m256i*)tmp, bf16_rne16(v));
  return load16(reinterpret_cast<const c10::BFloat16*>(tmp));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, bf16_rne16(v)); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Cephes' expf on 8 lanes (the scalar exp_f32, step for step; SiLU·mul ran as scalar code on
// AVX2 CPUs before: 17 µs a SmolLM2 row on a Zen 2), for N vectors at once, each step across
// all N before the next. Why: one exp is a chain of ~15 dependent operations, and a Zen 2's FP
// scheduler holds too few of them to reach the next vector's independent work when the vectors
// follow one another in the code: SiLU·mul ran at ~48 cycles a vector that way, ~23 with 8
// vectors interleaved (same values).
template <int N>
inline void exp8n(__m256* x) {
  using C = CephesExp;
  __m256 n[N], r[N], p[N];
  for (int j = 0; j < N; ++j) {
    x[j] = _mm256_min_ps(_mm256_max_ps(x[j], _mm256_set1_ps(C::kLo)), _mm256_set1_ps(C::kHi));
    n[j] = _mm256_floor_ps(_mm256_fmadd_ps(x[j], _mm256_set1_ps(C::kLog2e), _mm256_set1_ps(0.5f)));
  }
  for (int j = 0; j < N; ++j) r[j] = _mm256_fnmadd_ps(n[j], _mm256_set1_ps(C::kLn2Hi), x[j]);
  for (int j = 0; j < N; ++j) r[j] = _mm256_fnmadd_ps(n[j], _mm256_set1_ps(C::kLn2Lo), r[j]);
  for (int j = 0; j < N; ++j) p[j] = _mm256_set1_ps(C::kPoly[0]);
  for (int i = 1; i < 6; ++i)
    for (int j = 0; j < N; ++j) p[j] = _mm256_fmadd_ps(p[j], r[j], _mm256_set1_ps(C::kPoly[i]));
  for (int j = 0; j < N; ++j) {
    p[j] = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p[j], r[j]), r[j], r[j]), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n[j]), _mm256_set1_epi32(127)), 23);
    x[j] = _mm256_mul_ps(p[j], _mm256_castsi256_ps(e));
  }
}

template <typename T>
constexpr bool kAvx2Element = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// The sum of a vector's 8 lanes.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The largest of a vector's 8 lanes.
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// fp32 → bf16 bits in the low half of each lane: round to nearest even, NaN → 0x7FC0 (torch's).
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const c10::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i w = bf16_bits8(v);  // 8 dwords → 8 words, in order
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128((__m128i*)p, packed);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
template <typename T>
float sum_squares8(const T* x, int64_t n) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = load8(x + i + 8 * j);
      a[j] = _mm256_fmadd_ps(v, v, a[j]);
    }
  return hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}
template <typename T>
void scale_row8(const T* x, const T* w, T* out, int64_t n, float inv) {
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8) store8(out + i, _mm256_mul_ps(round8(_mm256_mul_ps(load8(x + i), iv), x), load8(w + i)));
}
template <typename T>
float add_row8(const T* x, const T* r, T* out, int64_t n) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = round8(_mm256_add_ps(load8(x + i + 8 * j), load8(r + i + 8 * j)), x);
      store8(out + i + 8 * j, v);  // exact: v is already T's value
      a[j] = _mm256_fmadd_ps(v, v, a[j]);
    }
  return hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}
#endif

template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
  // Rounded where the reference rounds (silu, then the product): in bf16 a single rounding
  // is slightly more exact but moves SmolLM2's perplexity by ~1%, away from the oracle.
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kAvxElement<T>) {
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = load16(g + i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      const __m512 silu = round16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), g);
      store16(o + i, _mm512_mul_ps(silu, load16(u + i)));
    }
  }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2Element<T>) {
    // 8 vectors a step, interleaved (exp8n's reason): 1,612 → ~800 µs for 512 rows of 1536 on
    // one Zen 2 core; the same values.
    const auto vectors = [&]<int N>(int64_t at) {
      __m256 gv[N], s[N];
      for (int j = 0; j < N; ++j) {
        gv[j] = load8(g + at + 8 * j);
        s[j] = _mm256_sub_ps(_mm256_setzero_ps(), gv[j]);
      }
      exp8n<N>(s);
      for (int j = 0; j < N; ++j) s[j] = round8(_mm256_div_ps(gv[j], _mm256_add_ps(_mm256_set1_ps(1.f), s[j])), g);
      for (int j = 0; j < N; ++j) store8(o + at + 8 * j, _mm256_mul_ps(s[j], load8(u + at + 8 * j)));
    };
    for (; i + 64 <= n; i += 64) vectors.template operator()<8>(i);
    for (; i + 8 <= n; i += 8) vectors.template operator()<1>(i);
  }
#endif
  for (; i < n; ++i) {
    const float gv = f32(g[i]);
    o[i] = from_f32<T>(f32(from_f32<T>(gv / (1.f + exp_f32(-gv)))) * f32(u[i]));
  }
}

// x: [rows, 2I] laid out [gate | up] -> silu(gate) * up: [rows, I].
at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "expected [rows, 2I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({rows, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_mul", [&] {
    const auto* xp = x.data_ptr<scalar_t>();
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = xp + r * 2 * inter;
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        silu_mul_row(g, u, o, inter);
      }
    });
  });
  return out;
}

// Dot product and axpy over one head, vectorised (the loop count is the head dim).
template <typename T>
inline float dot(const float* q, const T* kt, int64_t d) {
  const raw_t<T>* k = raw(kt);
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * load_f(k[i]);
  return s;
}

template <typename T>
inline void axpy(float p, const T* vt, float* acc, int64_t d) {
  const raw_t<T>* v = raw(vt);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * load_f(v[i]);
}

// dst[i] = src[i] in fp32 (src: raw element bits).
template <typename R>
inline void widen(const R* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = load_f(src[i]);
}

// The largest of n scores: std::max_element compares one score at a time, ~3 of a decode
// task's ~35 instructions a cached token (max is exact: the same value either way).
inline float max_row(const float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(row + t));
  m = _mm512_reduce_max_ps(mv);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 mv = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + t));
  m = hmax8(mv);
#endif
  for (; t < n; ++t) m = std::max(m, row[t]);
  return m;
}

// row[t] = exp(row[t] - m); returns the sum.
inline float exp_row(float* row, int64_t n, float m) {
  float total = 0.f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mv));
    _mm512_storeu_ps(row + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
  // One element at a time on AVX2 until session 23 (the float sum kept GCC from vectorising);
  // 4 vectors interleaved (exp8n's reason).
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  const auto vectors = [&]<int N>() {
    __m256 e[N];
    for (int j = 0; j < N; ++j) e[j] = _mm256_sub_ps(_mm256_loadu_ps(row + t + 8 * j), mv);
    exp8n<N>(e);
    for (int j = 0; j < N; ++j) {
      _mm256_storeu_ps(row + t + 8 * j, e[j]);
      sum = _mm256_add_ps(sum, e[j]);
    }
    t += 8 * N;
  };
  while (t + 32 <= n) vectors.template operator()<4>();
  while (t + 8 <= n) vectors.template operator()<1>();
  total = hsum8(sum);
#endif
  for (; t < n; ++t) {
    row[t] = exp_f32(row[t] - m);
    total += row[t];
  }
  return total;
}

// Scores and the probability-weighted value sum of one (sequence, KV head), head dim a
// multiple of 16 up to 128, walked block by block: a block's tokens are contiguous rows, so
// no per-token table lookup (an integer division each), and its keys and values stay in L1
// while the group's G query heads use them. False: the caller runs the generic loops.
inline bool avx_head_dim(int64_t D) { return D % 16 == 0 && D <= 128; }

#if defined(__AVX512F__)
// r[t] = the sum of a[t]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree of 45
// shuffles and adds (a horizontal sum per vector costs ~8 dependent ones, a score each).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i, a2i+1, a2i, a2i+1] partial sums
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a4i, a4i+1, a4i+2, a4i+3] partial sums
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Add the four 128-bit lanes of each c[i]: lane i of the result is c[i]'s total, in order.
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], kEven), _mm512_shuffle_f32x4(c[0], c[1], kOdd));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], kEven), _mm512_shuffle_f32x4(c[2], c[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, kEven), _mm512_shuffle_f32x4(d0, d1, kOdd));
}
#endif

// Asks for n elements from p: a sequence's next block lies anywhere in the pool, where the
// hardware prefetcher does not look, so each block would otherwise start with a memory stall.
// Into L2 (locality 2), one block ahead: into L1, or further ahead, the requests filled the
// miss buffers and stalled the loop themselves (decode attention with the bf16-pair loops, 16
// × 192 tokens: no prefetch or into L1 ~165-195 µs a layer, into L2 ~130-165).
template <typename T>
inline void prefetch_rows(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 2);
}

// The cache pages a thread's next task will read, asked for one page per page this task walks.
// Why: one block ahead is too short a distance to hide a miss to DRAM behind a block's
// arithmetic, so a decode step over caches larger than L3 ran at ~18 GB/s against ~47 GB/s the
// two cores stream. Spread over the whole of the task before it (its K pass and its V pass
// walk as many pages as the next task reads), the next task finds its pages in L2: decode
// attention at 16 × 200 tokens, 30 layers' caches, 138 → ~85 µs a layer. All of it at once
// would fill the miss buffers and stall this task's own loads.
class NextTaskPages {
 public:
  void clear() { pages_.clear(), next_ = 0; }
  void add(const void* page, int64_t bytes) { pages_.push_back({static_cast<const char*>(page), bytes}); }
  // Asks for the next page, if any: called once for each page the current task walks.
  void step() {
    if (next_ < pages_.size()) {
      const auto& [page, bytes] = pages_[next_++];
      prefetch_rows(page, bytes);
    }
  }

 private:
  std::vector<std::pair<const char*, int64_t>> pages_;
  size_t next_ = 0;
};

// Calls f(first token, its row pointer, tokens) for runs of at most 16 consecutive cached
// tokens that lie inside one block; block(j) is block j's first row ([bs, D] contiguous).
// Each block walked also asks for one of the next task's pages (`ahead`, when given).
template <typename Block, typename F>
inline void for_token_runs(int64_t len, int64_t bs, int64_t D, const Block& block, const F& f,
                           NextTaskPages* ahead = nullptr) {
  for (int64_t j = 0; j * bs < len; ++j) {
    const auto* rows = block(j);
    const int64_t nj = std::min(bs, len - j * bs);
    if ((j + 1) * bs < len) prefetch_rows(block(j + 1), std::min(bs, len - (j + 1) * bs) * D);
    if (ahead) ahead->step();
    for (int64_t c = 0; c < nj; c += 16) f(j * bs + c, rows + c * D, std::min<int64_t>(16, nj - c));
  }
}

#if defined(__AVX512F__)
// A run of 16 cached rows of D = 16·V elements as fp32: the rows themselves (fp32, a whole
// run), else widened (bf16) or copied into `buf` with the rows past n zeroed, so the loops
// below always see 16 rows they may read.
template <int V>
inline const float* run_f32(const float* rows, int64_t n, float* buf) {
  if (n == 16) return rows;
  std::copy(rows, rows + n * V * 16, buf);
  std::fill(buf + n * V * 16, buf + 16 * V * 16, 0.f);
  return buf;
}
template <int V>
inline const float* run_f32(const c10::BFloat16* rows, int64_t n, float* buf) {
  for (int64_t i = 0; i < n * V; ++i) _mm512_storeu_ps(buf + i * 16, load16(rows + i * 16));
  std::fill(buf + n * V * 16, buf + 16 * V * 16, 0.f);
  return buf;
}

// scores[g, t] = sc · q[g] · key[t] for the G heads of one KV head; buf: 16 · D floats.
// Each head's 16 dot products of a run are summed across lanes together (sum_lanes16).
template <int V, typename T, typename Block>
void head_scores_avx(const float* q, int64_t G, int64_t len, int64_t bs, const Block& key,
                     float sc, float* scores, float* buf, NextTaskPages* ahead) {
  constexpr int64_t D = V * 16;
  const __m512 scale = _mm512_set1_ps(sc);
  for_token_runs(len, bs, D, key, [&](int64_t t0, const T* rows, int64_t n) {
    const float* k = run_f32<V>(rows, n, buf);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t g = 0; g < G; ++g) {
      __m512 qv[V], acc[16];
      for (int v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(q + g * D + v * 16);
      for (int t = 0; t < 16; ++t) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + t * D));
        for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + t * D + v * 16), a);
        acc[t] = a;
      }
      _mm512_mask_storeu_ps(scores + g * len + t0, live, _mm512_mul_ps(sum_lanes16(acc), scale));
    }
  }, ahead);
}

// out[g] = Σ_t probs[g, t] · value[t] for the G heads of one KV head; buf: 16 · D floats.
template <int V, typename T, typename Block>
void head_values_avx(const float* probs, int64_t G, int64_t len, int64_t bs, const Block& value,
                     float* out, float* buf, NextTaskPages* ahead) {
  constexpr int64_t D = V * 16;
  std::fill(out, out + G * D, 0.f);
  for_token_runs(len, bs, D, value, [&](int64_t t0, const T* rows, int64_t n) {
    const float* vals = run_f32<V>(rows, n, buf);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = probs + g * len + t0;
      __m512 acc[V];
      for (int v = 0; v < V; ++v) acc[v] = _mm512_loadu_ps(out + g * D + v * 16);
      for (int64_t t = 0; t < n; ++t) {
        const __m512 p = _mm512_set1_ps(pg[t]);
        for (int v = 0; v < V; ++v) acc[v] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vals + t * D + v * 16), acc[v]);
      }
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + g * D + v * 16, acc[v]);
    }
  }, ahead);
}

#endif

// f.operator()<N>() for N = n in 1..8 (8 for more): register arrays need N at compile time.
template <typename F>
inline void with_count(int64_t n, const F& f) {
  switch (n) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

// f.operator()<V>() for V = D / 16 in 1..8 vectors of a head (AVX-512; on AVX2, pairs of
// 8-lane vectors).
template <typename F>
inline void with_vectors(int64_t D, const F& f) {
  with_count(D / 16, f);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Decode attention's two passes on 8 lanes, for CPUs without AVX-512, where the generic loops
// below widened and summed one token and head at a time (SmolLM2 at 4,096 cached tokens: 32
// tok/s, mostly attention). A key or value row is widened once for the group's GT heads; the
// head dim is D = 16 · V (two 8-lane vectors a V).
template <int V, int GT, typename T, typename Block>
void head_scores_avx2(const float* q, int64_t len, int64_t bs, const Block& key, float sc, float* scores,
                      NextTaskPages* ahead) {
  constexpr int64_t D = 16 * V;
  for_token_runs(len, bs, D, key, [&](int64_t t0, const T* rows, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      __m256 k[2 * V];
      for (int c = 0; c < 2 * V; ++c) k[c] = load8(rows + i * D + c * 8);
      for (int g = 0; g < GT; ++g) {
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), k[0]);
        for (int c = 1; c < 2 * V; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c * 8), k[c], a);
        scores[g * len + t0 + i] = hsum8(a) * sc;
      }
    }
  }, ahead);
}

// out[g] = Σ_t probs[g, t] · value[t]: 8 lanes of the head dim at a time, the GT heads' sums
// in registers over a run's tokens.
template <int V, int GT, typename T, typename Block>
void head_values_avx2(const float* probs, int64_t len, int64_t bs, const Block& value, float* out,
                      NextTaskPages* ahead) {
  constexpr int64_t D = 16 * V;
  std::fill(out, out + GT * D, 0.f);
  for_token_runs(len, bs, D, value, [&](int64_t t0, const T* rows, int64_t n) {
    for (int c = 0; c < 2 * V; ++c) {
      __m256 acc[GT];
      for (int g = 0; g < GT; ++g) acc[g] = _mm256_loadu_ps(out + g * D + c * 8);
      for (int64_t i = 0; i < n; ++i) {
        const __m256 v = load8(rows + i * D + c * 8);
        for (int g = 0; g < GT; ++g) acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(probs + g * len + t0 + i), v, acc[g]);
      }
      for (int g = 0; g < GT; ++g) _mm256_storeu_ps(out + g * D + c * 8, acc[g]);
    }
  }, ahead);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 caches: keys and values multiplied as bf16 pairs (vdpbf16ps: two exact products added
// into an fp32 lane), with no widened copy. q and the probabilities are rounded to bf16 first,
// as the reference rounds them (its q is bf16 after rotary; it casts softmax to the cache
// dtype before the value matmul); scores and sums stay fp32 (the reference rounds its scores to
// bf16). A third of the widening kernel's instructions: it was compute-bound at ~70 cycles a
// cached token per KV head. D = 32 · V2.
inline __m512bh load_bh(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// A run of n < 16 rows copied into buf ([16, D] bf16) with the rows past n zeroed: the loops
// below read 16 rows, and a zero row times a zero probability must stay zero (stale cache rows
// may hold anything, NaN included).
inline const c10::BFloat16* run_bf16(const c10::BFloat16* rows, int64_t n, int64_t D, c10::BFloat16* buf) {
  if (n == 16) return rows;
  std::copy(rows, rows + n * D, buf);
  std::fill(buf + n * D, buf + 16 * D, c10::BFloat16(0.f));
  return buf;
}

template <int V2, typename Block>
void head_scores_bf16(const float* q, int64_t G, int64_t len, int64_t bs, const Block& key, float sc,
                      float* scores, c10::BFloat16* buf, NextTaskPages* ahead) {
  constexpr int64_t D = V2 * 32;
  const __m512 scale = _mm512_set1_ps(sc);
  alignas(64) c10::BFloat16 qb[8 * D];  // G <= 8 (checked by the caller)
  for (int64_t i = 0; i < G * D; i += 32)
    _mm512_storeu_si512(qb + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(q + i)));
  for_token_runs(len, bs, D, key, [&](int64_t t0, const c10::BFloat16* rows, int64_t n) {
    const c10::BFloat16* k = run_bf16(rows, n, D, buf);
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t g = 0; g < G; ++g) {
      __m512bh qv[V2];
      for (int v = 0; v < V2; ++v) qv[v] = load_bh(qb + g * D + v * 32);
      __m512 acc[16];
      for (int t = 0; t < 16; ++t) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], load_bh(k + t * D));
        for (int v = 1; v < V2; ++v) a = _mm512_dpbf16_ps(a, qv[v], load_bh(k + t * D + v * 32));
        acc[t] = a;
      }
      _mm512_mask_storeu_ps(scores + g * len + t0, live, _mm512_mul_ps(sum_lanes16(acc), scale));
    }
  }, ahead);
}

// out[g] = Σ_t probs[g, t] · value[t]. Tokens go in pairs: unpacking two value rows 16 bits at a
// time gives, per fp32 lane, (v[t][d], v[t+1][d]), which vdpbf16ps multiplies by the pair
// (p[t], p[t+1]) broadcast. Within each 128-bit lane that puts dims 0-3 of every 8 in the
// unpacklo half and 4-7 in the unpackhi half; the sums are put back in order at the end.
// pb: G rows of len + 1 bf16 probabilities (the last one zero, for an odd tail).
// When the GT (= G) heads' 2·V2 sums each fit in 24 of the 32 vector registers (the rest hold
// a pair's rows), a pair's unpacked rows serve every head straight from registers; otherwise
// they are unpacked once into `pairs` and each head walks them. The same products are added
// in the same order either way: the register loop does ~20% fewer instructions a cached token
// (no stores and reloads of the unpacked pairs; SmolLM2's G = 3, D = 64: 12 sums).
template <int V2, int GT, typename Block>
void head_values_bf16(const c10::BFloat16* pb, int64_t G, int64_t len, int64_t bs, const Block& value,
                      float* out, c10::BFloat16* buf, c10::BFloat16* pairs, NextTaskPages* ahead) {
  constexpr int64_t D = V2 * 32;
  // (p[t], p[t+1]) of head g; an odd run's last token pairs with a zero.
  const auto prob_pair = [&](int64_t g, int64_t t0, int64_t i, int64_t n) {
    int32_t pair;
    std::memcpy(&pair, pb + g * (len + 1) + t0 + i, 4);
    if (i + 1 >= n) pair &= 0xFFFF;
    return (__m512bh)_mm512_set1_epi32(pair);
  };
  // Lanes of a sum: [lo | hi] per 32 dims, each in the permuted order above.
  std::fill(out, out + G * D, 0.f);
  for_token_runs(len, bs, D, value, [&](int64_t t0, const c10::BFloat16* rows, int64_t n) {
    const c10::BFloat16* v = run_bf16(rows, n, D, buf);
    if constexpr (GT * 2 * V2 <= 24) {
      __m512 acc[GT][2 * V2];
      for (int g = 0; g < GT; ++g)
        for (int c = 0; c < 2 * V2; ++c) acc[g][c] = _mm512_loadu_ps(out + g * D + c * 16);
      for (int64_t i = 0; i < n; i += 2) {
        __m512i u[2 * V2];
        for (int c = 0; c < V2; ++c) {
          const __m512i a = _mm512_loadu_si512(v + i * D + c * 32), b = _mm512_loadu_si512(v + (i + 1) * D + c * 32);
          u[2 * c] = _mm512_unpacklo_epi16(a, b);
          u[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
        for (int g = 0; g < GT; ++g) {
          const __m512bh p = prob_pair(g, t0, i, n);
          for (int c = 0; c < 2 * V2; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)u[c], p);
        }
      }
      for (int g = 0; g < GT; ++g)
        for (int c = 0; c < 2 * V2; ++c) _mm512_storeu_ps(out + g * D + c * 16, acc[g][c]);
      return;
    }
    for (int64_t i = 0; i < 16; i += 2)  // the run's pairs, unpacked once for the G heads
      for (int c = 0; c < V2; ++c) {
        const __m512i a = _mm512_loadu_si512(v + i * D + c * 32), b = _mm512_loadu_si512(v + (i + 1) * D + c * 32);
        _mm512_storeu_si512(pairs + (i * V2 + 2 * c) * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_storeu_si512(pairs + (i * V2 + 2 * c + 1) * 32, _mm512_unpackhi_epi16(a, b));
      }
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[2 * V2];
      for (int c = 0; c < 2 * V2; ++c) acc[c] = _mm512_loadu_ps(out + g * D + c * 16);
      for (int64_t i = 0; i < n; i += 2) {
        const __m512bh p = prob_pair(g, t0, i, n);
        for (int c = 0; c < 2 * V2; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], load_bh(pairs + (i * V2 + c) * 32), p);
      }
      for (int c = 0; c < 2 * V2; ++c) _mm512_storeu_ps(out + g * D + c * 16, acc[c]);
    }
  }, ahead);
  // Back in order: dim 8j + r of a 32-dim chunk sits in lane 4j + r of lo (r < 4), else of hi.
  alignas(64) int32_t first[16], second[16];
  for (int k = 0; k < 16; ++k) {
    first[k] = (k % 8 < 4 ? 0 : 16) + 4 * (k / 8) + k % 4;
    second[k] = first[k] + 8;
  }
  const __m512i i0 = _mm512_load_si512(first), i1 = _mm512_load_si512(second);
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < V2; ++c) {
      float* o = out + g * D + c * 32;
      const __m512 lo = _mm512_loadu_ps(o), hi = _mm512_loadu_ps(o + 16);
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, i0, hi));
      _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, i1, hi));
    }
}

// scores [G, len] fp32 → G rows of len + 1 bf16 (round to nearest even; the last one zero).
inline void probs_to_bf16(const float* scores, int64_t G, int64_t len, c10::BFloat16* pb) {
  for (int64_t g = 0; g < G; ++g) {
    const float* s = scores + g * len;
    c10::BFloat16* d = pb + g * (len + 1);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) _mm256_storeu_si256((__m256i*)(d + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
    for (; t < len; ++t) d[t] = from_f32<c10::BFloat16>(s[t]);
    d[len] = c10::BFloat16(0.f);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bf16-pair loops above take D = 32, 64, 96 or 128 and up to 8 query heads per KV head.
inline bool bf16_pairs(int64_t D, int64_t G) { return D % 32 == 0 && D <= 128 && G <= 8; }

// f.operator()<V2>() for V2 = D / 32 (with_vectors' switch, counting pairs of vectors).
template <typename F>
inline void with_pair_vectors(int64_t D, const F& f) {
  with_vectors(D / 2, f);
}
#endif

// buf: 16 · D floats of scratch.
template <typename T, typename Block>
bool head_scores(const float* q, int64_t G, int64_t D, int64_t len, int64_t bs, const Block& key,
                 float sc, float* scores, float* buf, NextTaskPages* ahead) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_pairs(D, G)) {
      auto* rows = reinterpret_cast<c10::BFloat16*>(buf);
      with_pair_vectors(D, [&]<int V2>() { head_scores_bf16<V2>(q, G, len, bs, key, sc, scores, rows, ahead); });
      return true;
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (kAvxElement<T>) {
    if (!avx_head_dim(D)) return false;
    with_vectors(D, [&]<int V>() { head_scores_avx<V, T>(q, G, len, bs, key, sc, scores, buf, ahead); });
    return true;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2Element<T>) {
    if (!avx_head_dim(D) || G > 8) return false;
    with_vectors(D, [&]<int V>() {
      with_count(G, [&]<int GT>() { head_scores_avx2<V, GT, T>(q, len, bs, key, sc, scores, ahead); });
    });
    return true;
  }
#endif
  return false;
}

// buf: 16 · D floats of scratch; pb: G · (len + 1) bf16 of scratch (the bf16 path's
// probabilities).
template <typename T, typename Block>
bool head_values(const float* probs, int64_t G, int64_t D, int64_t len, int64_t bs,
                 const Block& value, float* out, float* buf, c10::BFloat16* pb, NextTaskPages* ahead) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_pairs(D, G)) {
      probs_to_bf16(probs, G, len, pb);
      auto* rows = reinterpret_cast<c10::BFloat16*>(buf);  // [0, 16 D): a short run; then the pairs
      c10::BFloat16* pairs = rows + 16 * D;
      with_pair_vectors(D, [&]<int V2>() {
        with_count(G, [&]<int GT>() { head_values_bf16<V2, GT>(pb, G, len, bs, value, out, rows, pairs, ahead); });
      });
      return true;
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (kAvxElement<T>) {
    if (!avx_head_dim(D)) return false;
    with_vectors(D, [&]<int V>() { head_values_avx<V, T>(probs, G, len, bs, value, out, buf, ahead); });
    return true;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (kAvx2Element<T>) {
    if (!avx_head_dim(D) || G > 8) return false;
    with_vectors(D, [&]<int V>() {
      with_count(G, [&]<int GT>() { head_values_avx2<V, GT, T>(probs, len, bs, value, out, ahead); });
    });
    return true;
  }
#endif
  return false;
}

// NeoX rotary on one head: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin].
template <typename T>
inline void rotate(const T* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = f32(x[i]), b = f32(x[i + half]);
    out[i] = a * cos[i] - b * sin[i];
    out[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// Prefill rows: NeoX rotary on q and k with the reference's roundings, then k and v written
// into the paged cache, in one pass over the rows. apply_rotary (layers/rotary.py) runs in bf16
// as three ops, each rounding to bf16: x·cos, rot(x)·sin, their sum; the same here, so the
// result is the reference's bit for bit (the eager path spent ~15 ms of a 512-row step in its
// cat, neg, two muls, add and two index_puts). bf16 only: in fp32 the compiler could contract
// the products and the sum into FMAs and round differently.
//   qkv [T, (H + 2 KV) D] bf16; cos, sin [T, D] bf16 (the step's rows); caches
//   [blocks, KV, block_size, D]; slot_blocks, slot_offsets [T] int64 -> q|k rotated [T, H + KV, D].
#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline __m512 to_bf16_and_back(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }
#endif

inline void rope_row_bf16(const c10::BFloat16* x, const c10::BFloat16* c, const c10::BFloat16* s,
                          c10::BFloat16* out, int64_t D) {
  const int64_t half = D / 2;
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  for (; j + 16 <= half; j += 16) {
    const __m512 x1 = load16(x + j), x2 = load16(x + half + j);
    const __m512 lo = _mm512_add_ps(to_bf16_and_back(_mm512_mul_ps(x1, load16(c + j))),
                                    to_bf16_and_back(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                                   load16(s + j))));
    const __m512 hi = _mm512_add_ps(to_bf16_and_back(_mm512_mul_ps(x2, load16(c + half + j))),
                                    to_bf16_and_back(_mm512_mul_ps(x1, load16(s + half + j))));
    store16(out + j, lo);
    store16(out + half + j, hi);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The same on 8 lanes (session 19; the scalar loop took ~0.9 ms of a 480-row SmolLM2 layer).
  const c10::BFloat16* bf16 = nullptr;  // round8's rounding: to bf16 and back
  for (; j + 8 <= half; j += 8) {
    const __m256 x1 = load8(x + j), x2 = load8(x + half + j);
    const __m256 lo = _mm256_add_ps(round8(_mm256_mul_ps(x1, load8(c + j)), bf16),
                                    round8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), load8(s + j)), bf16));
    const __m256 hi = _mm256_add_ps(round8(_mm256_mul_ps(x2, load8(c + half + j)), bf16),
                                    round8(_mm256_mul_ps(x1, load8(s + half + j)), bf16));
    store8(out + j, lo);
    store8(out + half + j, hi);
  }
#endif
  const auto rnd = [](float v) { return f32(from_f32<c10::BFloat16>(v)); };
  for (; j < half; ++j) {
    const float x1 = f32(x[j]), x2 = f32(x[half + j]);
    out[j] = from_f32<c10::BFloat16>(rnd(x1 * f32(c[j])) + rnd(-x2 * f32(s[j])));
    out[half + j] = from_f32<c10::BFloat16>(rnd(x2 * f32(c[half + j])) + rnd(x1 * f32(s[half + j])));
  }
}

// The cache slot of each of `rows` tokens (block, offset within it), checked before a kernel
// writes there: int64 [rows] each, inside a pool of num_blocks blocks of bs tokens.
void check_slots(const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t rows,
                 int64_t num_blocks, int64_t bs) {
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.numel() == rows &&
                  slot_offsets.numel() == rows, "slots must be int64 [T]");
  const int64_t* sb = slot_blocks.data_ptr<int64_t>();
  const int64_t* so = slot_offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(sb[t] >= 0 && sb[t] < num_blocks && so[t] >= 0 && so[t] < bs, "slot out of range");
  }
}

at::Tensor rope_write_prefill(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                              int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kBFloat16,
              "qkv must be contiguous bf16 [T, (H+2KV)D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "caches must be contiguous bf16 [blocks, KV, block_size, D]");
  const int64_t T = qkv.size(0), H = num_heads, KV = num_kv_heads;
  const int64_t D = k_cache.size(3), bs = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(D % 2 == 0 && k_cache.size(1) == KV && qkv.size(1) == (H + 2 * KV) * D, "qkv width mismatch");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "cos and sin must be the step's contiguous bf16 rows [T, D]");
  check_slots(slot_blocks, slot_offsets, T, num_blocks, bs);
  const int64_t* sb = slot_blocks.data_ptr<int64_t>();
  const int64_t* so = slot_offsets.data_ptr<int64_t>();
  auto out = at::empty({T, H + KV, D}, qkv.options());
  const auto* xp = qkv.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin.data_ptr<c10::BFloat16>();
  auto* kc = k_cache.data_ptr<c10::BFloat16>();
  auto* vc = v_cache.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const c10::BFloat16* row = xp + t * (H + 2 * KV) * D;
      c10::BFloat16* o = op + t * (H + KV) * D;
      for (int64_t h = 0; h < H + KV; ++h) rope_row_bf16(row + h * D, cp + t * D, sp + t * D, o + h * D, D);
      for (int64_t kvh = 0; kvh < KV; ++kvh) {
        const int64_t slot = ((sb[t] * KV + kvh) * bs + so[t]) * D;
        std::memcpy(kc + slot, o + (H + kvh) * D, D * sizeof(c10::BFloat16));
        std::memcpy(vc + slot, row + (H + KV + kvh) * D, D * sizeof(c10::BFloat16));
      }
    }
  });
  return out;
}

// Decode attention cuts a sequence longer than twice this into chunks of this many tokens.
constexpr int64_t kDecodeSplit = 512;

// One decode token per sequence: rotate q and k at position seq_len - 1, write k and v into the
// paged cache, attend over the sequence's seq_len cached tokens. One task per (sequence, KV
// head) serves its G query heads together, so each cached key and value is read once (a long
// sequence: one task per chunk of kDecodeSplit tokens, below).
//   qkv [B, (H + 2 KV) D]; cos/sin [max_pos, D] fp32; caches [blocks, KV, block_size, D];
//   block_tables [B, >= ceil(seq_len / block_size)] int64; seq_lens [B] int64 -> [B, H D].
at::Tensor rope_decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 int64_t num_heads, int64_t num_kv_heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv must be contiguous [B, (H+2KV)D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [blocks, KV, block_size, D]");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "cache dtype must match the activations");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "rotary tables must be contiguous fp32");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be int64");
  const int64_t B = qkv.size(0), H = num_heads, KV = num_kv_heads, G = H / KV;
  const int64_t D = k_cache.size(3), bs = k_cache.size(2), nbt = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  TORCH_CHECK(k_cache.size(1) == KV && qkv.size(1) == (H + 2 * KV) * D, "qkv width mismatch");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "one table and length per row");
  auto out = at::empty({B, H * D}, qkv.options());
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= nbt * bs && lens[b] <= cos.size(0), "bad sequence length");
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_decode_attention", [&] {
    using T = scalar_t;
    const T* qp = qkv.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const float sc = static_cast<float>(scale);
    // Tasks: (sequence, KV head, chunk). A sequence longer than 2 · kDecodeSplit tokens is cut
    // into chunks of kDecodeSplit (when its blocks tile them), each attended on its own and
    // merged after: one long sequence's few KV heads would otherwise leave threads idle and
    // read its cache one stream at a time. The cut depends on the sequence's length alone, so
    // its output does not depend on what else is in the batch.
    const bool splittable = kDecodeSplit % bs == 0;
    std::vector<int64_t> first_chunk(B + 1, 0);  // task index of (b, kvh 0, chunk 0) / KV
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = splittable && lens[b] > 2 * kDecodeSplit ? (lens[b] + kDecodeSplit - 1) / kDecodeSplit : 1;
      first_chunk[b + 1] = first_chunk[b] + n;
    }
    const int64_t tasks = first_chunk[B] * KV;
    // Per task of a split sequence: its running max and sum per head, then its G · D sums.
    const bool any_split = first_chunk[B] > B;
    std::vector<float> part(any_split ? tasks * G * (D + 2) : 0);
    // A task's sequence, KV head and the tokens it attends to.
    struct Task {
      int64_t b, kvh, chunk, chunks, t_begin, len;
      const int64_t* table;  // the chunk's blocks
    };
    // Consecutive positions of one sequence (a decode with drafts to verify, each draft a
    // row): a row must see the keys and values its predecessors write this step, so every
    // row writes first, before any task attends. Otherwise each row's last chunk writes its
    // own token just before attending (the same values either way).
    bool write_first = false;
    for (int64_t b = 1; b < B && !write_first; ++b)
      write_first = lens[b] == lens[b - 1] + 1 && bt[b * nbt] == bt[(b - 1) * nbt];
    const auto write_token = [&](int64_t b, int64_t kvh, float* k) {
      const int64_t pos = lens[b] - 1, blk = bt[b * nbt + pos / bs];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
      const T* row = qp + b * (H + 2 * KV) * D;
      const int64_t slot = ((blk * KV + kvh) * bs + pos % bs) * D;
      rotate(row + (H + kvh) * D, cp + pos * D, sp + pos * D, k, D);
      const T* v = row + (H + KV + kvh) * D;
      for (int64_t d = 0; d < D; ++d) {
        kc[slot + d] = from_f32<T>(k[d]);
        vc[slot + d] = v[d];
      }
    };
    if (write_first) {
      std::vector<float> k(D);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t kvh = 0; kvh < KV; ++kvh) write_token(b, kvh, k.data());
    }
    const auto locate = [&](int64_t task) {
      const int64_t seq_chunk = task / KV;
      const int64_t b = std::upper_bound(first_chunk.begin(), first_chunk.end(), seq_chunk) - first_chunk.begin() - 1;
      const int64_t chunk = seq_chunk - first_chunk[b], chunks = first_chunk[b + 1] - first_chunk[b];
      const int64_t t_begin = chunk * kDecodeSplit;
      const int64_t len = chunks == 1 ? lens[b] : std::min(lens[b], t_begin + kDecodeSplit) - t_begin;
      return Task{b, task % KV, chunk, chunks, t_begin, len, bt + b * nbt + t_begin / bs};
    };
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      // Each thread's scratch, kept across calls (the scratch rule, top of the file).
      thread_local std::vector<float> q, k, acc, buf, denom, scores;
      thread_local std::vector<c10::BFloat16> pb;
      q.assign(G * D, 0.f), k.assign(D, 0.f), acc.assign(G * D, 0.f), buf.assign(16 * D, 0.f);
      denom.assign(G, 0.f), scores.clear(), pb.clear();
      NextTaskPages ahead;
      for (int64_t task = begin; task < end; ++task) {
        const auto [b, kvh, chunk, chunks, t_begin, len, table] = locate(task);
        const int64_t seq_len = lens[b], pos = seq_len - 1;
        const T* row = qp + b * (H + 2 * KV) * D;
        ahead.clear();
        if (task + 1 < end) {  // the next task's key pages, then its value pages
          const Task next = locate(task + 1);
          const int64_t pages = (next.len + bs - 1) / bs, page_bytes = bs * D * static_cast<int64_t>(sizeof(T));
          for (const T* cache : {static_cast<const T*>(kc), static_cast<const T*>(vc)})
            for (int64_t j = 0; j < pages; ++j) ahead.add(cache + (next.table[j] * KV + next.kvh) * bs * D, page_bytes);
        }
        if (chunk == chunks - 1 && !write_first) write_token(b, kvh, k.data());  // its new token
        for (int64_t g = 0; g < G; ++g) {
          rotate(row + (kvh * G + g) * D, cp + pos * D, sp + pos * D, q.data() + g * D, D);
        }
        scores.resize(G * len);
        // Block j's first row, and token t's row (the generic loops), in this KV head's pages.
        const auto key_block = [&](int64_t j) -> const T* { return kc + (table[j] * KV + kvh) * bs * D; };
        const auto value_block = [&](int64_t j) -> const T* { return vc + (table[j] * KV + kvh) * bs * D; };
        const auto key = [&](int64_t t) { return key_block(t / bs) + (t % bs) * D; };
        const auto value = [&](int64_t t) { return value_block(t / bs) + (t % bs) * D; };
        if (!head_scores<T>(q.data(), G, D, len, bs, key_block, sc, scores.data(), buf.data(), &ahead)) {
          for (int64_t t = 0; t < len; ++t) {
            const T* kr = key(t);
            for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot(q.data() + g * D, kr, D) * sc;
          }
        }
        float* mine = chunks > 1 ? part.data() + task * G * (D + 2) : nullptr;  // [max G | sum G | G·D]
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * len;
          const float m = max_row(sg, len);
          denom[g] = exp_row(sg, len, m);
          if (mine) mine[g] = m;
        }
        pb.resize(G * (len + 1));
        if (!head_values<T>(scores.data(), G, D, len, bs, value_block, acc.data(), buf.data(), pb.data(), &ahead)) {
          std::fill(acc.begin(), acc.end(), 0.f);  // (head_values zeroes its own output)
          for (int64_t t = 0; t < len; ++t) {
            const T* vr = value(t);
            for (int64_t g = 0; g < G; ++g) axpy(scores[g * len + t], vr, acc.data() + g * D, D);
          }
        }
        if (mine) {
          std::copy(denom.begin(), denom.end(), mine + G);
          std::copy(acc.begin(), acc.end(), mine + 2 * G);
          continue;
        }
        for (int64_t g = 0; g < G; ++g) {
          T* o = op + b * H * D + (kvh * G + g) * D;
          const float inv = 1.f / denom[g];
          for (int64_t d = 0; d < D; ++d) o[d] = from_f32<T>(acc[g * D + d] * inv);
        }
      }
    });
    if (!any_split) return;
    // Merge the chunks of each split (sequence, KV head): rescale each chunk's sums from its
    // own max to the overall one, in chunk order.
    at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> acc;  // the scratch rule
      acc.assign(D, 0.f);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / KV, kvh = i % KV, chunks = first_chunk[b + 1] - first_chunk[b];
        if (chunks == 1) continue;
        const auto chunk_part = [&](int64_t c) { return part.data() + ((first_chunk[b] + c) * KV + kvh) * G * (D + 2); };
        for (int64_t g = 0; g < G; ++g) {
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < chunks; ++c) m = std::max(m, chunk_part(c)[g]);
          float total = 0.f;
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t c = 0; c < chunks; ++c) {
            const float* pc = chunk_part(c);
            const float w = exp_f32(pc[g] - m);
            total += w * pc[G + g];
            for (int64_t d = 0; d < D; ++d) acc[d] += w * pc[2 * G + g * D + d];
          }
          T* o = op + b * H * D + (kvh * G + g) * D;
          const float inv = 1.f / total;
          for (int64_t d = 0; d < D; ++d) o[d] = from_f32<T>(acc[d] * inv);
        }
      }
    });
  });
  return out;
}

// A prefill tile's W queries of head `head` (rows i0..i0 + rows of q [Q, H, D]) transposed to
// qg [D][W], scaled, the lanes past `rows` zero; and the tile's output og [D][W] divided by
// each query's sum (inv) into its rows of out.
template <int64_t W, typename T>
inline void tile_queries(const T* q, float* qg, int64_t H, int64_t head, int64_t D, int64_t i0, int64_t rows,
                         float sc) {
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = 0; r < W; ++r) qg[d * W + r] = r < rows ? f32(q[((i0 + r) * H + head) * D + d]) * sc : 0.f;
}
template <int64_t W, typename T>
inline void tile_store(const float* og, const float* inv, T* out, int64_t H, int64_t head, int64_t D, int64_t i0,
                       int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + ((i0 + r) * H + head) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = from_f32<T>(og[d * W + r] * inv[r]);
  }
}

#if defined(__AVX512F__)
constexpr int64_t kPrefillTile = 16;  // queries a tile: the lanes of a vector
// One (KV head, tile of 16 queries) of a prefill chunk, flash-style: the 16 queries sit in the
// lanes of a vector, so scores, the running max and sum, and the output (kept transposed,
// [D][16 queries]) all update lane-wise, with no horizontal sums; keys come in runs of 16
// from the block table, widened to fp32 once for the group's G heads.
//   q: the chunk's rows [Q, H, D]; query i0 + r sits at position p0 + r and sees keys
//   0..p0 + r; out rows i0..i0 + rows. Scratch: kbuf, vbuf 16·D; qt, ot G·D·16 floats each.
template <int V, typename T, typename KeyBlock, typename ValueBlock>
void prefill_tile(const T* q, T* out, int64_t H, int64_t G, int64_t kvh, int64_t i0, int64_t rows,
                  int64_t p0, const KeyBlock& key, const ValueBlock& value, int64_t bs, float sc,
                  float* kbuf, float* vbuf, float* qt, float* ot) {
  constexpr int64_t D = V * 16;
  __m512 m[8], l[8];  // per head: running max and sum, one lane per query (G ≤ 8)
  for (int64_t g = 0; g < G; ++g) {
    m[g] = _mm512_set1_ps(-1e30f);  // finite: the first run's rescale factor is 0, not NaN
    l[g] = _mm512_setzero_ps();
    tile_queries<16>(q, qt + g * D * 16, H, kvh * G + g, D, i0, rows, sc);
    std::fill(ot + g * D * 16, ot + (g + 1) * D * 16, 0.f);
  }
  for_token_runs(p0 + rows, bs, D, key, [&](int64_t t0, const T* krows, int64_t n) {
    const float* k = run_f32<V>(krows, n, kbuf);
    const float* v = run_f32<V>(value(t0 / bs) + (t0 % bs) * D, n, vbuf);
    // Lanes (queries r) that see key t0 + t: r ≥ t0 + t − p0 (causal), and t < n.
    __mmask16 see[16];
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t first = t0 + t - p0;
      see[t] = t >= n || first >= 16 ? 0 : first <= 0 ? 0xFFFF : static_cast<__mmask16>(0xFFFFu << first);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qt + g * D * 16;
      __m512 s[16];
      for (int t = 0; t < 16; ++t) s[t] = _mm512_setzero_ps();
      for (int64_t d0 = 0; d0 < D; d0 += 8) {  // 8 query vectors in registers a pass
        __m512 qv[8];
        for (int j = 0; j < 8; ++j) qv[j] = _mm512_loadu_ps(qg + (d0 + j) * 16);
        for (int t = 0; t < 16; ++t)
          for (int j = 0; j < 8; ++j) s[t] = _mm512_fmadd_ps(qv[j], _mm512_set1_ps(k[t * D + d0 + j]), s[t]);
      }
      __m512 mx = m[g];
      for (int t = 0; t < 16; ++t) mx = _mm512_mask_max_ps(mx, see[t], mx, s[t]);
      const __m512 alpha = exp16(_mm512_sub_ps(m[g], mx));
      m[g] = mx;
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < 16; ++t) {
        s[t] = _mm512_maskz_mov_ps(see[t], exp16(_mm512_sub_ps(s[t], mx)));
        sum = _mm512_add_ps(sum, s[t]);
      }
      l[g] = _mm512_fmadd_ps(l[g], alpha, sum);
      float* og = ot + g * D * 16;
      for (int64_t d0 = 0; d0 < D; d0 += 8) {  // 8 output dims (vectors of queries) a pass
        __m512 acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm512_mul_ps(_mm512_loadu_ps(og + (d0 + j) * 16), alpha);
        for (int64_t t = 0; t < n; ++t)
          for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(s[t], _mm512_set1_ps(v[t * D + d0 + j]), acc[j]);
        for (int j = 0; j < 8; ++j) _mm512_storeu_ps(og + (d0 + j) * 16, acc[j]);
      }
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l[g]));
    tile_store<16>(ot + g * D * 16, inv, out, H, kvh * G + g, D, i0, rows);
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kPrefillTile = 16;
// r[i][j] ↔ r[j][i] for 8 vectors of 8 lanes.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i..4i + 3, their lanes in 4 × 4 blocks per 128-bit half
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// tile_queries and tile_store for 16 queries, 8 × 8 transposes at a time (one element at a
// time they took ~15% of the tile's time at 128-token prompts: scalar bf16 rounding).
template <typename T>
inline void tile_queries16(const T* q, float* qg, int64_t H, int64_t head, int64_t D, int64_t i0, int64_t rows,
                           float sc) {
  const __m256 scale = _mm256_set1_ps(sc);
  for (int64_t r0 = 0; r0 < 16; r0 += 8)
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 v[8];
      for (int64_t r = 0; r < 8; ++r)
        v[r] = r0 + r < rows ? _mm256_mul_ps(load8(q + ((i0 + r0 + r) * H + head) * D + d0), scale)
                             : _mm256_setzero_ps();
      transpose8(v);  // v[j]: dim d0 + j of the 8 queries
      for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(qg + (d0 + j) * 16 + r0, v[j]);
    }
}
template <typename T>
inline void tile_store16(const float* og, const float* inv, T* out, int64_t H, int64_t head, int64_t D, int64_t i0,
                         int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8)
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 v[8];
      for (int64_t j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(og + (d0 + j) * 16 + r0);
      transpose8(v);  // v[r]: dims d0..d0 + 7 of query r0 + r
      for (int64_t r = 0; r < 8 && r0 + r < rows; ++r)
        store8(out + ((i0 + r0 + r) * H + head) * D + d0, _mm256_mul_ps(v[r], _mm256_set1_ps(inv[r0 + r])));
    }
}

// prefill_tile on 8 lanes, for CPUs without AVX-512. 16 queries sit in two vectors' lanes, so
// each broadcast key or value element feeds two FMAs, and every loop keeps 8 independent sums
// in registers (a Zen 2's FMA has 5 cycles of latency and 2 issue a cycle: fewer chains left it
// waiting). Session 19's tile had 8 queries: one broadcast an FMA, and its value pass 4 chains
// deep (SmolLM2's 128-token prompts, 2 threads: 428 µs a layer and sequence, 9% of a burst's
// prefill). A run of up to 16 keys is scored 4 keys at a time into s [key][query], turned into
// probabilities in place (one rescale of the running max and sum a run), then meets the values
// 4 output dims at a time.
template <int V, typename T, typename KeyBlock, typename ValueBlock>
void prefill_tile(const T* q, T* out, int64_t H, int64_t G, int64_t kvh, int64_t i0, int64_t rows,
                  int64_t p0, const KeyBlock& key, const ValueBlock& value, int64_t bs, float sc,
                  float* kbuf, float* vbuf, float* qt, float* ot) {
  constexpr int64_t D = V * 16;
  __m256 m[8][2], l[8][2];  // per head: running max and sum, a lane per query (G ≤ 8)
  for (int64_t g = 0; g < G; ++g) {
    for (int h = 0; h < 2; ++h) {
      m[g][h] = _mm256_set1_ps(-1e30f);  // finite: the first run's rescale factor is 0, not NaN
      l[g][h] = _mm256_setzero_ps();
    }
    tile_queries16(q, qt + g * D * 16, H, kvh * G + g, D, i0, rows, sc);
    std::fill(ot + g * D * 16, ot + (g + 1) * D * 16, 0.f);
  }
  // A run's rows as fp32 (widened or copied), rows past n zeroed: the score loop reads them.
  const auto as_f32 = [&](const T* rows_, int64_t n, float* buf) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      if (n == 16) return rows_;
    }
    for (int64_t i = 0; i < n * 2 * V; ++i) _mm256_storeu_ps(buf + i * 8, load8(rows_ + i * 8));
    std::fill(buf + n * D, buf + 16 * D, 0.f);
    return buf;
  };
  const __m256i lanes[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                            _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
  alignas(32) float s[16][16] = {};  // [key][query]: the run's scores, then its probabilities
  alignas(32) float see[16][16];  // [key][query]: all ones where the query sees the key
  for_token_runs(p0 + rows, bs, D, key, [&](int64_t t0, const T* krows, int64_t n) {
    const float* k = as_f32(krows, n, kbuf);
    const float* v = as_f32(value(t0 / bs) + (t0 % bs) * D, n, vbuf);
    // Queries r that see key t0 + t: r ≥ t0 + t − p0 (causal), and t < n.
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t first = t < n ? t0 + t - p0 : 16;
      const __m256i bound = _mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(first, 0, 16)) - 1);
      for (int h = 0; h < 2; ++h)
        _mm256_store_ps(see[t] + 8 * h, _mm256_castsi256_ps(_mm256_cmpgt_epi32(lanes[h], bound)));
    }
    const int64_t n4 = (n + 3) & ~int64_t{3};  // keys scored: rows n..n4 are zeros, masked below
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qt + g * D * 16;
      for (int64_t t4 = 0; t4 < n4; t4 += 4) {
        __m256 a[4][2];
        for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const __m256 qa = _mm256_loadu_ps(qg + d * 16), qb = _mm256_loadu_ps(qg + d * 16 + 8);
          for (int j = 0; j < 4; ++j) {
            const __m256 kb = _mm256_broadcast_ss(k + (t4 + j) * D + d);
            a[j][0] = _mm256_fmadd_ps(qa, kb, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(qb, kb, a[j][1]);
          }
        }
        for (int j = 0; j < 4; ++j) {
          _mm256_store_ps(s[t4 + j], a[j][0]);
          _mm256_store_ps(s[t4 + j] + 8, a[j][1]);
        }
      }
      __m256 alpha[2];
      for (int h = 0; h < 2; ++h) {
        __m256 mx = m[g][h];
        for (int64_t t = 0; t < n; ++t)
          mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_load_ps(s[t] + 8 * h), _mm256_load_ps(see[t] + 8 * h)));
        alpha[h] = _mm256_sub_ps(m[g][h], mx);
        m[g][h] = mx;
      }
      exp8n<2>(alpha);
      for (int h = 0; h < 2; ++h) {
        __m256 sum = _mm256_setzero_ps();
        // 8 keys' exps interleaved (exp8n's reason); rows past n hold finite values (zeros
        // past n4, or an earlier run's), masked here.
        for (int64_t t0_ = 0; t0_ < n; t0_ += 8) {
          __m256 p[8];
          for (int j = 0; j < 8; ++j) p[j] = _mm256_sub_ps(_mm256_load_ps(s[t0_ + j] + 8 * h), m[g][h]);
          exp8n<8>(p);
          for (int j = 0; j < 8; ++j) {
            p[j] = _mm256_and_ps(_mm256_load_ps(see[t0_ + j] + 8 * h), p[j]);
            _mm256_store_ps(s[t0_ + j] + 8 * h, p[j]);
            sum = _mm256_add_ps(sum, p[j]);
          }
        }
        l[g][h] = _mm256_fmadd_ps(l[g][h], alpha[h], sum);
      }
      float* og = ot + g * D * 16;
      for (int64_t d0 = 0; d0 < D; d0 += 4) {  // 4 output dims × 16 queries a pass
        __m256 acc[4][2];
        for (int j = 0; j < 4; ++j)
          for (int h = 0; h < 2; ++h) acc[j][h] = _mm256_mul_ps(_mm256_loadu_ps(og + (d0 + j) * 16 + 8 * h), alpha[h]);
        for (int64_t t = 0; t < n; ++t) {
          const __m256 pa = _mm256_load_ps(s[t]), pb = _mm256_load_ps(s[t] + 8);
          for (int j = 0; j < 4; ++j) {
            const __m256 vb = _mm256_broadcast_ss(v + t * D + d0 + j);
            acc[j][0] = _mm256_fmadd_ps(pa, vb, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(pb, vb, acc[j][1]);
          }
        }
        for (int j = 0; j < 4; ++j)
          for (int h = 0; h < 2; ++h) _mm256_storeu_ps(og + (d0 + j) * 16 + 8 * h, acc[j][h]);
      }
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    alignas(32) float inv[16];
    for (int h = 0; h < 2; ++h) _mm256_store_ps(inv + 8 * h, _mm256_div_ps(_mm256_set1_ps(1.f), l[g][h]));
    tile_store16(ot + g * D * 16, inv, out, H, kvh * G + g, D, i0, rows);
  }
}
#endif

// Causal attention of one sequence's prefill chunk straight from the paged cache, into which
// the chunk's own keys and values were written first: no gathered copy of the context, no
// mask tensor, no fp32 copies. q [Q, H, D] (rotated); caches [blocks, KV, bs, D]; table
// [>= ceil(ctx / bs)] int64; the chunk's last query sits at position ctx − 1 → [Q, H, D].
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& table, int64_t ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [Q, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [blocks, KV, block_size, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "cache dtype must match the queries");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1 && table.is_contiguous(),
              "the block table must be int64 [blocks]");
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KV == 0, "head shape mismatch");
  TORCH_CHECK(Q >= 1 && ctx >= Q && ctx <= table.size(0) * bs, "bad chunk or context length");
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t j = 0; j * bs < ctx; ++j)
    TORCH_CHECK(tp[j] >= 0 && tp[j] < k_cache.size(0), "block id out of range");
  auto out = at::empty_like(q);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  TORCH_CHECK(avx_head_dim(D) && H / KV <= 8, "paged_prefill_attention: head dim a multiple of 16 up to 128, "
              "at most 8 query heads a KV head");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: fp32 or bf16 only");
  constexpr int64_t W = kPrefillTile;  // 16 queries a tile (AVX-512: one vector; AVX2: two)
  const auto run = [&](auto* qp, auto* kc, auto* vc, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    const int64_t G = H / KV, tiles = (Q + W - 1) / W, p_first = ctx - Q;
    // A tile's cost grows with its position (it sees every key before it): in contiguous
    // ranges the thread with the last tiles did ~70% of the work (two threads, 8 tiles). So
    // tasks go heaviest first, dealt to the threads back and forth (0, 1, 1, 0, 0, 1, ...).
    const int64_t tasks = KV * tiles, threads = std::min<int64_t>(at::get_num_threads(), tasks);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> kbuf, vbuf, qt, ot;  // the scratch rule
      kbuf.assign(16 * D, 0.f), vbuf.assign(16 * D, 0.f), qt.assign(G * D * W, 0.f), ot.assign(G * D * W, 0.f);
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t lap = task % (2 * threads), owner = lap < threads ? lap : 2 * threads - 1 - lap;
        if (owner < begin || owner >= end) continue;
        const int64_t kvh = task % KV, i0 = (tiles - 1 - task / KV) * W, rows = std::min<int64_t>(W, Q - i0);
        const auto key = [&](int64_t j) -> const T* { return kc + (tp[j] * KV + kvh) * bs * D; };
        const auto value = [&](int64_t j) -> const T* { return vc + (tp[j] * KV + kvh) * bs * D; };
        with_vectors(D, [&]<int V>() {
          prefill_tile<V, T>(qp, op, H, G, kvh, i0, rows, p_first + i0, key, value, bs,
                             static_cast<float>(scale), kbuf.data(), vbuf.data(), qt.data(), ot.data());
        });
      }
    });
  };
  if (q.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    run(q.data_ptr<B>(), k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), out.data_ptr<B>());
  } else {
    run(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>());
  }
#else
  TORCH_CHECK(false, "paged_prefill_attention: this build has neither AVX-512 nor AVX2/FMA");
#endif
  return out;
}

bool paged_prefill_supported(int64_t head_dim, int64_t group) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return avx_head_dim(head_dim) && group <= 8;
#else
  return false;
#endif
}

// MLA decode, register-blocked (AVX-512; AVX2 below): 4 heads × 4 tokens of scores, 4 heads × 64 latent
// lanes of values per loop nest, so each load feeds several FMAs (a plain dot product per
// head and token is load-bound at one FMA per two loads). False: shapes the blocks do not
// tile (the caller runs the plain loops).
template <typename T, typename RowFn>
bool mla_blocked(const float* q, int64_t nh, int64_t W, int64_t L, int64_t len, const RowFn& row,
                 float* scores, float* out, int64_t out_stride, bool values) {
#if defined(__AVX512F__)
  if constexpr (kAvxElement<T>) {
    if (nh % 4 || W % 16 || L % 64) return false;
    if (!values) {
      const int64_t len4 = len - len % 4;
      for (int64_t t = len4; t < len; ++t) {  // the last len % 4 tokens: one at a time
        const T* r = row(t);
        for (int64_t h = 0; h < nh; ++h) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t k = 0; k < W; k += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * W + k), load16(r + k), acc);
          scores[h * len + t] = _mm512_reduce_add_ps(acc);
        }
      }
      for (int64_t t0 = 0; t0 < len4; t0 += 4) {
        const T* rows[4] = {row(t0), row(t0 + 1), row(t0 + 2), row(t0 + 3)};
        for (int64_t h0 = 0; h0 < nh; h0 += 4) {
          __m512 acc[4][4];
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
          for (int64_t k = 0; k < W; k += 16) {
            __m512 c[4];
            for (int j = 0; j < 4; ++j) c[j] = load16(rows[j] + k);
            for (int i = 0; i < 4; ++i) {
              const __m512 qv = _mm512_loadu_ps(q + (h0 + i) * W + k);
              for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(qv, c[j], acc[i][j]);
            }
          }
          for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) scores[(h0 + i) * len + t0 + j] = _mm512_reduce_add_ps(acc[i][j]);
        }
      }
      return true;
    }
    for (int64_t h0 = 0; h0 < nh; h0 += 4) {
      for (int64_t k = 0; k < L; k += 64) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
          const T* r = row(t) + k;
          __m512 c[4];
          for (int j = 0; j < 4; ++j) c[j] = load16(r + 16 * j);
          for (int i = 0; i < 4; ++i) {
            const __m512 p = _mm512_set1_ps(scores[(h0 + i) * len + t]);
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(p, c[j], acc[i][j]);
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + (h0 + i) * out_stride + k + 16 * j, acc[i][j]);
      }
    }
    return true;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The same on 8 lanes (session 23; the plain loops before: one dot product a head and
  // token, a single chain of FMAs each). Scores: 4 heads × 2 tokens, 8 independent sums;
  // values: 4 heads × 16 latent lanes.
  if constexpr (kAvx2Element<T>) {
    if (nh % 4 || W % 8 || L % 16) return false;
    if (!values) {
      const int64_t len2 = len - len % 2;
      for (int64_t t0 = 0; t0 < len; t0 += 2) {
        const int64_t nt = t0 < len2 ? 2 : 1;
        const T* rows[2] = {row(t0), row(t0 + nt - 1)};
        for (int64_t h0 = 0; h0 < nh; h0 += 4) {
          __m256 acc[4][2];
          for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
          for (int64_t k = 0; k < W; k += 8) {
            const __m256 c0 = load8(rows[0] + k), c1 = load8(rows[1] + k);
            for (int i = 0; i < 4; ++i) {
              const __m256 qv = _mm256_loadu_ps(q + (h0 + i) * W + k);
              acc[i][0] = _mm256_fmadd_ps(qv, c0, acc[i][0]);
              acc[i][1] = _mm256_fmadd_ps(qv, c1, acc[i][1]);
            }
          }
          for (int i = 0; i < 4; ++i)
            for (int64_t j = 0; j < nt; ++j) scores[(h0 + i) * len + t0 + j] = hsum8(acc[i][j]);
        }
      }
      return true;
    }
    for (int64_t h0 = 0; h0 < nh; h0 += 4) {
      for (int64_t k = 0; k < L; k += 16) {
        __m256 acc[4][2];
        for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
          const T* r = row(t) + k;
          const __m256 c0 = load8(r), c1 = load8(r + 8);
          for (int i = 0; i < 4; ++i) {
            const __m256 p = _mm256_set1_ps(scores[(h0 + i) * len + t]);
            acc[i][0] = _mm256_fmadd_ps(p, c0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(p, c1, acc[i][1]);
          }
        }
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_ps(out + (h0 + i) * out_stride + k, acc[i][0]);
          _mm256_storeu_ps(out + (h0 + i) * out_stride + k + 8, acc[i][1]);
        }
      }
    }
    return true;
  }
#endif
  return false;
}

// MLA decode rows before attention: DeepSeek checkpoints store the rope part of q and k with
// its pairs interleaved (2j, 2j + 1); read them as (evens | odds) and rotate at position
// seq_len - 1 in fp32 from the whole table; write the token's latent (c | rotated k_pe) into
// its cache slot, return q's rotated rope part in fp32 for the latent-space attention. One
// call for what the reference does in ~15 small ops (de-interleave, rotate, concatenate, write).
//   q [B, H, nope + R] (a view of q_proj's rows), kv [B, lora + R] (kv_a_proj's rows: the raw
//   k_pe at the end), c [B, lora] (the normed latent); tables [P, R] fp32; cache [blocks, bs,
//   lora + R]; slots [B] int64; seq_lens [B] int64 -> q_pe [B, H, R] fp32.
at::Tensor mla_rope_decode(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& c,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache,
                           const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                           const at::Tensor& seq_lens, int64_t nope) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [B, H, nope + R] rows");
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1 && c.dim() == 2 && c.is_contiguous(),
              "kv [B, lora + R] and c [B, lora] expected");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(), "cache must be contiguous [blocks, bs, lora + R]");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && c.scalar_type() == kv.scalar_type() &&
                  cache.scalar_type() == kv.scalar_type(), "q, kv, c and the cache share a dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(), "rotary tables must be contiguous fp32");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2) - nope, lora = c.size(1);
  const int64_t bs = cache.size(1), W = cache.size(2), num_blocks = cache.size(0), P = cos.size(0);
  TORCH_CHECK(R > 0 && R % 2 == 0 && cos.size(1) == R && sin.size(1) == R, "rope width mismatch");
  TORCH_CHECK(W == lora + R && kv.size(1) == W && kv.size(0) == B && c.size(0) == B, "latent width mismatch");
  check_slots(slot_blocks, slot_offsets, B, num_blocks, bs);
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == B,
              "seq_lens must be int64 [B]");
  const int64_t* sb = slot_blocks.data_ptr<int64_t>();
  const int64_t* so = slot_offsets.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= P, "position out of the rotary table");
  }
  auto q_pe = at::empty({B, H, R}, q.options().dtype(at::kFloat));
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  float* qo = q_pe.data_ptr<float>();
  const int64_t half = R / 2;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, kv.scalar_type(), "mla_rope_decode", [&] {
    using T = scalar_t;
    const T* qp = q.data_ptr<T>();
    const T* kp = kv.data_ptr<T>();
    const T* cp = c.data_ptr<T>();
    T* cache_p = cache.data_ptr<T>();
    // x: one rope part, pairs interleaved; out[j] = x[2j] cos[j] - x[2j+1] sin[j],
    // out[half + j] = x[2j+1] cos[half + j] + x[2j] sin[half + j] (NeoX on the de-interleaved x).
    const auto rotate = [&](const T* x, const float* cs, const float* sn, auto&& put) {
      for (int64_t j = 0; j < half; ++j) {
        const float even = f32(x[2 * j]), odd = f32(x[2 * j + 1]);
        put(j, even * cs[j] - odd * sn[j]);
        put(half + j, odd * cs[half + j] + even * sn[half + j]);
      }
    };
    for (int64_t b = 0; b < B; ++b) {
      const float* cs = ct + (lens[b] - 1) * R;
      const float* sn = st + (lens[b] - 1) * R;
      for (int64_t h = 0; h < H; ++h) {
        float* o = qo + (b * H + h) * R;
        rotate(qp + b * q.stride(0) + h * q.stride(1) + nope, cs, sn, [&](int64_t i, float v) { o[i] = v; });
      }
      T* slot = cache_p + (sb[b] * bs + so[b]) * W;
      std::memcpy(slot, cp + b * lora, lora * sizeof(T));
      rotate(kp + b * kv.stride(0) + lora, cs, sn, [&](int64_t i, float v) { slot[lora + i] = from_f32<T>(v); });
    }
  });
  return q_pe;
}

// MLA's absorbed decode over the paged latent cache, one decode token per sequence. The query
// is already in latent space (q_nope · W_UK, done by the caller as one batched GEMM), so a
// head's score against a cached token is q_lat · c + q_pe · k_pe and its output is the
// probability-weighted sum of the latents c (the caller applies W_UV). Each task serves a group
// of heads of one sequence and reads that sequence's cached latents once through its block
// table: no gathered copy of the context, no padding mask, fp32 throughout.
//   q_lat [B, H, L] fp32; q_pe [B, H, R] fp32; cache [blocks, block_size, L + R];
//   block_tables [B, >= ceil(seq_len / block_size)] int64; seq_lens [B] int64 -> [B, H, L] fp32.
at::Tensor mla_decode_attention(const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q_lat.dim() == 3 && q_lat.is_contiguous() && q_lat.scalar_type() == at::kFloat,
              "q_lat must be contiguous fp32 [B, H, L]");
  TORCH_CHECK(q_pe.dim() == 3 && q_pe.is_contiguous() && q_pe.scalar_type() == at::kFloat,
              "q_pe must be contiguous fp32 [B, H, R]");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(), "cache must be contiguous [blocks, bs, L+R]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(), "tables must be int64");
  const int64_t B = q_lat.size(0), H = q_lat.size(1), L = q_lat.size(2), R = q_pe.size(2);
  const int64_t bs = cache.size(1), W = cache.size(2), nbt = block_tables.size(1);
  const int64_t num_blocks = cache.size(0);
  TORCH_CHECK(W == L + R && q_pe.size(0) == B && q_pe.size(1) == H, "latent width mismatch");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "one table and length per row");
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= nbt * bs, "bad sequence length");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i) {
      TORCH_CHECK(bt[b * nbt + i] >= 0 && bt[b * nbt + i] < num_blocks, "block id out of range");
    }
  }
  auto out = at::empty({B, H, L}, q_lat.options());
  // Few sequences: split each one's heads so that every thread has work (each split reads the
  // context once more, from cache-warm memory).
  const int64_t threads = at::get_num_threads();
  const int64_t splits = B >= threads ? 1 : std::min<int64_t>(H, (threads + B - 1) / B);
  const int64_t per = (H + splits - 1) / splits;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, cache.scalar_type(), "mla_decode_attention", [&] {
    using T = scalar_t;
    const T* cp = cache.data_ptr<T>();
    const float* ql = q_lat.data_ptr<float>();
    const float* qr = q_pe.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scores, q, c;  // the scratch rule
      scores.clear(), q.assign(per * W, 0.f), c.assign(W, 0.f);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / splits, h0 = (task % splits) * per;
        const int64_t h1 = std::min(H, h0 + per), len = lens[b], nh = h1 - h0;
        if (nh <= 0) continue;
        const int64_t* table = bt + b * nbt;
        const auto row = [&](int64_t t) { return cp + (table[t / bs] * bs + t % bs) * W; };
        // Each head's query as one [q_lat | q_pe] row, scaled: a score is one dot product of
        // width L + R with the cached [c | k_pe] row.
        for (int64_t h = 0; h < nh; ++h) {
          const float* a = ql + (b * H + h0 + h) * L;
          const float* r = qr + (b * H + h0 + h) * R;
          for (int64_t i = 0; i < L; ++i) q[h * W + i] = a[i] * sc;
          for (int64_t i = 0; i < R; ++i) q[h * W + L + i] = r[i] * sc;
        }
        // Pass 1: scores (blocked, or a cached row widened to fp32 once for every head).
        scores.assign(nh * len, 0.f);
        float* o0 = op + (b * H + h0) * L;
        if (!mla_blocked<T>(q.data(), nh, W, L, len, row, scores.data(), o0, L, false)) {
          for (int64_t t = 0; t < len; ++t) {
            widen(raw(row(t)), c.data(), W);
            for (int64_t h = 0; h < nh; ++h) scores[h * len + t] = dot(q.data() + h * W, c.data(), W);
          }
        }
        for (int64_t h = 0; h < nh; ++h) {
          float* sg = scores.data() + h * len;
          const float inv = 1.f / exp_row(sg, len, max_row(sg, len));
          for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
        }
        // Pass 2: the probability-weighted latents.
        if (!mla_blocked<T>(q.data(), nh, W, L, len, row, scores.data(), o0, L, true)) {
          std::fill(o0, o0 + nh * L, 0.f);
          for (int64_t t = 0; t < len; ++t) {
            widen(raw(row(t)), c.data(), L);
            for (int64_t h = 0; h < nh; ++h) axpy(scores[h * len + t], c.data(), o0 + h * L, L);
          }
        }
      }
    });
  });
  return out;
}

// ---- Weight-only quantised matmuls for few activation rows (decode) ----------------------
// Activations are widened to fp32 once; weights are read once per call and widened in
// registers. Outputs are rounded to the activation dtype, as torch's packed kernels do.

// Rows in chunks of up to 4 (measured for the int8 kernels: more accumulators scale worse; the
// int4 kernel takes chunks of 8, below, 3-5% faster at 8-32 rows): f(m0, rows) with
// `rows` a compile-time constant (std::integral_constant), so that the kernels keep one
// accumulator per row in registers. A row's sums run in the same order whatever its chunk:
// a sequence's result does not depend on what else is in the batch.
//
// Wide = 8 (the int4 kernel): chunks of 8 while 8 rows are left, then as above. Its int32 dot
// products are exact whatever the chunk, so the batch invariance holds there too.
template <int Wide = 4, typename F>
inline void in_row_chunks(int64_t M, F&& f) {
  int64_t m0 = 0;
  if constexpr (Wide == 8) {
    for (; M - m0 >= 8; m0 += 8) f(m0, std::integral_constant<int, 8>{});
  }
  for (; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: f(m0, std::integral_constant<int, 1>{}); break;
      case 2: f(m0, std::integral_constant<int, 2>{}); break;
      case 3: f(m0, std::integral_constant<int, 3>{}); break;
      default: f(m0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// ---- MLA's absorbed decode: the projections into and out of latent space ------------------
// kv_b_proj's weight [H·(nope + v), lora] holds, per head h, W_UK in rows [h·(nope + v), +nope)
// and W_UV in the v rows after. The reference multiplies with an fp32 copy of both halves
// (einsums); these read the weight in its own dtype, widening bf16 exactly in registers, with
// fp32 sums: the same products in another order, from half the bytes (decode at batch 1 streams
// both halves every layer: DeepSeek-V2-Lite 2 × 2 MiB in bf16 against 2 × 4 MiB in fp32).
// Work: one task per head (each head's weight is read once for every row).

// M rows (compile time: the accumulators stay in registers) × V vectors of lanes l0 … l0 + 16V:
// q_lat[r, l] = Σ_n q[r, n] · w[n, l], q rows `q_stride` apart (fp32 or bf16), w rows `lora` apart.
template <int M, int V, typename X, typename W>
inline void absorb_lanes(const X* q, int64_t q_stride, const W* w, int64_t nope, int64_t lora, int64_t l0,
                         float* out, int64_t out_stride) {
#if defined(__AVX512F__)
  __m512 acc[M][V];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t n = 0; n < nope; ++n) {
    __m512 wv[V];
    for (int c = 0; c < V; ++c) wv[c] = load16(w + n * lora + l0 + 16 * c);
    for (int r = 0; r < M; ++r) {
      const __m512 x = _mm512_set1_ps(f32(q[r * q_stride + n]));
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(x, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(out + r * out_stride + l0 + 16 * c, acc[r][c]);
#elif defined(__AVX2__) && defined(__FMA__)
  // V vectors of 8 lanes here. Each lane sums over n in the same order as the AVX-512 code
  // (one FMA a step): the same result on either CPU.
  __m256 acc[M][V];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t n = 0; n < nope; ++n) {
    // A pass reads 8V lanes of every weight row, rows `lora` apart: asked for 8 rows ahead (the
    // hardware prefetcher misses the stride; 16 ahead measured no better).
    for (int c = 0; c < V * static_cast<int>(sizeof(W)) * 8; c += 64)
      _mm_prefetch((const char*)(w + (n + 8) * lora + l0) + c, _MM_HINT_T0);
    __m256 wv[V];
    for (int c = 0; c < V; ++c) wv[c] = load8(w + n * lora + l0 + 8 * c);
    for (int r = 0; r < M; ++r) {
      const __m256 x = _mm256_set1_ps(f32(q[r * q_stride + n]));
      for (int c = 0; c < V; ++c) acc[r][c] = _mm256_fmadd_ps(x, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < V; ++c) _mm256_storeu_ps(out + r * out_stride + l0 + 8 * c, acc[r][c]);
#endif
}

// One row over all lanes, weight rows in order (AVX2): the sums live in `out` (lora floats, in
// L1) and each weight row is read front to back, where the lane-blocked passes above read a
// strided strip of every row (V2-Lite's W_UK at batch 1, Zen 2: 186 → 133 µs a layer). Each
// lane sums over n in the same order, one FMA a step: the same result.
template <typename X, typename W>
inline void absorb_row(const X* q, const W* w, int64_t nope, int64_t lora, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t l = 0; l < lora; l += 8) _mm256_storeu_ps(out + l, _mm256_setzero_ps());
  constexpr int64_t kLine = 64 / sizeof(W);  // weights a cache line
  for (int64_t n = 0; n < nope; ++n) {
    const __m256 x = _mm256_set1_ps(f32(q[n]));
    const W* wr = w + n * lora;
    for (int64_t l = 0; l < lora; l += 8) {
      if (l % kLine == 0) _mm_prefetch((const char*)(wr + 2 * lora + l), _MM_HINT_T0);  // 2 rows ahead
      _mm256_storeu_ps(out + l, _mm256_fmadd_ps(x, load8(wr + l), _mm256_loadu_ps(out + l)));
    }
  }
#endif
}

// The lanes of one vector: absorb_lanes' V counts vectors of this many.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

// out[r, j] = Σ_l o[r, l] · w[j, l] for M rows of o (fp32, `o_stride` apart), j < v.
template <int M, typename W>
inline void expand_rows(const float* o, int64_t o_stride, const W* w, int64_t v, int64_t lora, float* out,
                        int64_t out_stride) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < v; ++j) {
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t l = 0; l < lora; l += 16) {
      const __m512 wv = load16(w + j * lora + l);
      for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(o + r * o_stride + l), wv, acc[r]);
    }
    for (int r = 0; r < M; ++r) out[r * out_stride + j] = _mm512_reduce_add_ps(acc[r]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // A chains a row, so that few rows do not wait on the FMA latency at every step.
  constexpr int A = M == 1 ? 4 : (M == 2 ? 2 : 1);
  for (int64_t j = 0; j < v; ++j) {
    __m256 acc[M][A];
    for (int r = 0; r < M; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    int64_t l = 0;
    for (; l + 8 * A <= lora; l += 8 * A) {
      // The next weight row, each line this step covers (M = 1 reads v rows of lora weights
      // in turn; a step is 8A weights: a line or two at one row, part of one at more).
      constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(W));
      for (int64_t p = l; p < l + 8 * A; p += kLine)
        if (p % kLine == 0) _mm_prefetch((const char*)(w + (j + 1) * lora + p), _MM_HINT_T0);
      for (int a = 0; a < A; ++a) {
        const __m256 wv = load8(w + j * lora + l + 8 * a);
        for (int r = 0; r < M; ++r)
          acc[r][a] = _mm256_fmadd_ps(_mm256_loadu_ps(o + r * o_stride + l + 8 * a), wv, acc[r][a]);
      }
    }
    for (; l < lora; l += 8) {
      const __m256 wv = load8(w + j * lora + l);
      for (int r = 0; r < M; ++r) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(o + r * o_stride + l), wv, acc[r][0]);
    }
    for (int r = 0; r < M; ++r) {
      for (int a = 1; a < A; ++a) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
      out[r * out_stride + j] = hsum8(acc[r][0]);
    }
  }
#endif
}

void check_kv_b(const at::Tensor& kv_b, int64_t H, int64_t nope, int64_t v) {
  TORCH_CHECK(kv_b.dim() == 2 && kv_b.is_contiguous() && kv_b.size(0) == H * (nope + v),
              "kv_b must be contiguous [H·(nope + v), lora]");
  TORCH_CHECK(kv_b.scalar_type() == at::kFloat || kv_b.scalar_type() == at::kBFloat16,
              "kv_b must be fp32 or bf16");
}

bool mla_projections_supported(int64_t lora) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return lora % kLanes == 0;
#else
  return false;
#endif
}

// q_nope [B, H, nope] (fp32 or bf16) → q_lat [B, H, lora] fp32: q_nope · W_UK per head.
at::Tensor mla_absorb_query(const at::Tensor& q_nope, const at::Tensor& kv_b, int64_t v_dim) {
  TORCH_CHECK(q_nope.dim() == 3 && q_nope.is_contiguous(), "q_nope must be contiguous [B, H, nope]");
  TORCH_CHECK(q_nope.scalar_type() == at::kFloat || q_nope.scalar_type() == at::kBFloat16,
              "q_nope must be fp32 or bf16");
  const int64_t B = q_nope.size(0), H = q_nope.size(1), nope = q_nope.size(2), lora = kv_b.size(1);
  check_kv_b(kv_b, H, nope, v_dim);
  TORCH_CHECK(mla_projections_supported(lora), "mla_absorb_query: lora must be a multiple of 16 (AVX-512) or 8 (AVX2)");
  auto out = at::empty({B, H, lora}, q_nope.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const auto run = [&](const auto* qp, const auto* wp) {
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) {
        const auto* w = wp + h * (nope + v_dim) * lora;  // W_UK: [nope, lora]
        in_row_chunks<kLanes == 16 ? 8 : 4>(B, [&](int64_t b0, auto rows) {
          constexpr int M = decltype(rows)::value;
          const auto* q = qp + (b0 * H + h) * nope;
          float* o = op + (b0 * H + h) * lora;
          // Lanes a pass by rows, 16 accumulators either way: few rows take 128 lanes (256
          // contiguous bytes of each bf16 weight row a pass, eight independent FMA chains; with
          // 32 lanes a batch-1 pass waited on two chains and read 64 bytes a row: 94 → 51-56
          // µs a V2-Lite layer). Each lane still sums over n in order: the same result.
          // AVX2 (16 registers of 8 lanes, rows in chunks of 4): 8 sums, VB weight vectors and
          // x (one row: each weight vector is used as soon as it is loaded).
          constexpr int VB = kLanes == 16 ? (M <= 2 ? 8 : (M <= 4 ? 4 : 2)) : 8 / M;
          if constexpr (kLanes == 8 && M == 1) {
            absorb_row(q, w, nope, lora, o);
            return;
          }
          int64_t l0 = 0;
          for (; l0 + kLanes * VB <= lora; l0 += kLanes * VB)
            absorb_lanes<M, VB>(q, H * nope, w, nope, lora, l0, o, H * lora);
          for (; l0 < lora; l0 += kLanes) absorb_lanes<M, 1>(q, H * nope, w, nope, lora, l0, o, H * lora);
        });
      }
    });
  };
  // AVX2: q widened once, so that each broadcast is a load (a bf16 one took three
  // instructions for one FMA's worth of lanes; with the chunks of 4 rows, 16 rows of V2-Lite,
  // Zen 2: 833 → 396 µs a layer).
  const at::Tensor qx = kLanes == 8 ? q_nope.to(at::kFloat) : q_nope;
  const bool q16 = qx.scalar_type() == at::kBFloat16, w16 = kv_b.scalar_type() == at::kBFloat16;
  using B16 = c10::BFloat16;
  if (q16 && w16) run(qx.data_ptr<B16>(), kv_b.data_ptr<B16>());
  else if (q16) run(qx.data_ptr<B16>(), kv_b.data_ptr<float>());
  else if (w16) run(qx.data_ptr<float>(), kv_b.data_ptr<B16>());
  else run(qx.data_ptr<float>(), kv_b.data_ptr<float>());
  return out;
}

// out[b, h, :] = x_bh · W_hᵀ for b < B and every head h, W_h = rows [skip, skip + width) of
// head h's nope + v rows of kv_b (read as it is, bf16 or fp32); x_bh at xp + b · x_row +
// h · x_head (x_head 0: one row for every head). → [B, H, width] fp32.
at::Tensor expand_heads(const float* xp, int64_t x_row, int64_t x_head, int64_t B, int64_t H, int64_t lora,
                        const at::Tensor& kv_b, int64_t skip, int64_t width, const at::TensorOptions& options) {
  const int64_t per_head = kv_b.size(0) / H;
  auto out = at::empty({B, H, width}, options);
  float* op = out.data_ptr<float>();
  const auto run = [&](const auto* wp) {
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) {
        const auto* w = wp + (h * per_head + skip) * lora;  // [width, lora]
        in_row_chunks<8>(B, [&](int64_t b0, auto rows) {
          expand_rows<decltype(rows)::value>(xp + b0 * x_row + h * x_head, x_row, w, width, lora,
                                             op + (b0 * H + h) * width, H * width);
        });
      }
    });
  };
  if (kv_b.scalar_type() == at::kBFloat16) run(kv_b.data_ptr<c10::BFloat16>());
  else run(kv_b.data_ptr<float>());
  return out;
}

// o_lat [B, H, lora] fp32 → [B, H, v] fp32: o_lat · W_UVᵀ per head.
at::Tensor mla_expand_output(const at::Tensor& o_lat, const at::Tensor& kv_b, int64_t nope) {
  TORCH_CHECK(o_lat.dim() == 3 && o_lat.is_contiguous() && o_lat.scalar_type() == at::kFloat,
              "o_lat must be contiguous fp32 [B, H, lora]");
  const int64_t B = o_lat.size(0), H = o_lat.size(1), lora = o_lat.size(2);
  TORCH_CHECK(kv_b.dim() == 2 && kv_b.size(1) == lora && kv_b.size(0) % H == 0, "kv_b shape mismatch");
  const int64_t v = kv_b.size(0) / H - nope;
  TORCH_CHECK(v > 0, "kv_b has no value rows");
  check_kv_b(kv_b, H, nope, v);
  TORCH_CHECK(mla_projections_supported(lora), "mla_expand_output: lora must be a multiple of 16 (AVX-512) or 8 (AVX2)");
  return expand_heads(o_lat.data_ptr<float>(), H * lora, lora, B, H, lora, kv_b, nope, v, o_lat.options());
}

// MLA's prefill: the latents of C tokens expanded to every head's keys (without rotary) and
// values, c [C, lora] fp32 × kv_b [H·(nope + v), lora] → [C, H, nope + v] fp32, kv_b read as
// it is (bf16 or fp32), each weight widened in registers. The reference widens the whole of
// kv_b to fp32 for two einsums, a copy of the weight a layer and a step (1.5 ms of V2-Lite's
// ~3.8 ms a layer for a 64-token prompt). The same products, summed in another order.
at::Tensor mla_expand_latent(const at::Tensor& c, const at::Tensor& kv_b, int64_t num_heads) {
  TORCH_CHECK(c.dim() == 2 && c.is_contiguous() && c.scalar_type() == at::kFloat,
              "c must be contiguous fp32 [C, lora]");
  const int64_t C = c.size(0), lora = c.size(1), H = num_heads;
  TORCH_CHECK(H > 0 && kv_b.dim() == 2 && kv_b.size(1) == lora && kv_b.size(0) % H == 0, "kv_b shape mismatch");
  const int64_t width = kv_b.size(0) / H;  // nope + v
  check_kv_b(kv_b, H, 0, width);
  TORCH_CHECK(mla_projections_supported(lora), "mla_expand_latent: lora must be a multiple of 16 (AVX-512) or 8 (AVX2)");
  return expand_heads(c.data_ptr<float>(), lora, 0, C, H, lora, kv_b, 0, width, c.options());
}

// out[m] = sum_k x[m, k] * w[k] for m < M: each weight is widened once for all rows (M is a
// template argument so that the accumulators stay in registers). Two accumulators per row
// (even and odd blocks of 16): one FMA chain per row would wait on the FMA latency (4 cycles)
// at every step; two keep both FMA ports busy.
template <int M>
inline void dot_i8_rows(const float* x, const int8_t* w, int64_t k, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc[M], acc2[M];
  for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + i))));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + i + 16))));
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + i), w0, acc[m]);
      acc2[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + i + 16), w1, acc2[m]);
    }
  }
  for (; i + 16 <= k; i += 16) {
    const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + i))));
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + i), wf, acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
#elif defined(__AVX2__) && defined(__FMA__)
  // The same on 8 lanes (AVX2 CPUs: without it the LM head ran as scalar code, 17 ms a token
  // for SmolLM2's 28 MB head on a Zen 2).
  __m256 acc[M], acc2[M];
  for (int m = 0; m < M; ++m) acc[m] = acc2[m] = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(w + i));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i), w0, acc[m]);
      acc2[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i + 8), w1, acc2[m]);
    }
  }
  for (; i + 8 <= k; i += 8) {
    const __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + i))));
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i), wf, acc[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = hsum8(_mm256_add_ps(acc[m], acc2[m]));
#else
  for (int m = 0; m < M; ++m) out[m] = 0.f;
#endif
  for (; i < k; ++i)
    for (int m = 0; m < M; ++m) out[m] += x[m * k + i] * static_cast<float>(w[i]);
}

// Outputs [o0, o1) of M rows (row stride O in x's K and the output's O).
template <typename T, int M>
void int8_rows(const float* xp, const int8_t* wp, const float* sp, T* op, int64_t K, int64_t O,
               int64_t o0, int64_t o1) {
  float dots[M];
  for (int64_t o = o0; o < o1; ++o) {
#if !defined(__AVX512F__) && defined(__AVX2__)
    // As the int4 kernel's codes (below): the row after next asked for ahead of its loads
    // (SmolLM2's 28 MB head at one row, Zen 2: 2.5-2.6 → 1.8-2.2 ms).
    for (int64_t j = 0; j < K; j += 64) _mm_prefetch((const char*)(wp + (o + 2) * K + j), _MM_HINT_T0);
#endif
    dot_i8_rows<M>(xp, wp + o * K, K, dots);
    for (int m = 0; m < M; ++m) op[m * O + o] = from_f32<T>(dots[m] * sp[o]);
  }
}

// y[m, o] = scales[o] * sum_k x[m, k] * w[o, k]; x [M, K], w int8 [O, K], scales [O].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 2 && w.is_contiguous() &&
                  w.scalar_type() == at::kChar && w.size(1) == x.size(1),
              "int8_linear: expected x [M, K] and int8 w [O, K]");
  const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
  TORCH_CHECK(scales.numel() == O, "int8_linear: one scale per output row");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  auto out = at::empty({M, O}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* sp = sf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear", [&] {
    auto* op = out.data_ptr<scalar_t>();
    // The outputs go in tiles of 64 weight rows (~37 KB at K = 576, in L1) and every chunk of
    // rows passes over a tile before the next is read, so the weights stream from memory once
    // per call, not once per chunk (16 rows: 4x less traffic).
    constexpr int64_t kTile = 64;
    at::parallel_for(0, (O + kTile - 1) / kTile, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t o0 = t * kTile, o1 = std::min<int64_t>(O, o0 + kTile);
        in_row_chunks(M, [&](int64_t m0, auto rows) {
          int8_rows<scalar_t, decltype(rows)::value>(xp + m0 * K, wp, sp, op + m0 * O, K, O, o0, o1);
        });
      }
    });
  });
  return out;
}

#if defined(__AVX2__) && defined(__FMA__)
// round_to_int's 8-lane path, for n a multiple of 32 (every group, and the int8 head's rows where K
// is one): the same values bit for bit (v · inv rounded to nearest even by cvtps, as
// nearbyint does). One element at a time it took ~15% of a 512-row int8 call.
template <typename Q>
inline float round_to_int_lanes(const void* x, bool bf16, int64_t at, int64_t n, Q* q, int32_t* total) {
  static_assert(std::is_same_v<Q, int8_t> || std::is_same_v<Q, int16_t>);
  constexpr float kLevels = static_cast<float>(std::numeric_limits<Q>::max());
  const auto load = [&](int64_t i) {
    return bf16 ? load8(static_cast<const c10::BFloat16*>(x) + at + i)
                : _mm256_loadu_ps(static_cast<const float*>(x) + at + i);
  };
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load(i), abs_mask));
  const float amax = hmax8(mx);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? kLevels / amax : 0.f);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 32) {
    __m256i r[4];
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(load(i + 8 * j), inv));
      sum = _mm256_add_epi32(sum, r[j]);
    }
    // packs interleave the 128-bit lanes: int16 [r0 0-3, r1 0-3 | r0 4-7, r1 4-7], put back in
    // order by 64-bit quarters; int8 dwords [r0 0-3, r1 0-3, r2 0-3, r3 0-3 | r0 4-7, ...].
    const __m256i p01 = _mm256_packs_epi32(r[0], r[1]), p23 = _mm256_packs_epi32(r[2], r[3]);
    if constexpr (std::is_same_v<Q, int16_t>) {
      _mm256_storeu_si256((__m256i*)(q + i), _mm256_permute4x64_epi64(p01, 0xD8));
      _mm256_storeu_si256((__m256i*)(q + i + 16), _mm256_permute4x64_epi64(p23, 0xD8));
    } else {
      const __m256i b = _mm256_packs_epi16(p01, p23);
      _mm256_storeu_si256((__m256i*)(q + i), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
  }
  if (total != nullptr) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    *total = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
  }
  return amax / kLevels;
}
#endif


// Elements [at, at + n) of x (fp32 or bf16) rounded to Q's symmetric range with one scale:
// q = x · L / max|x| to nearest even, L = 32767 (int16) or 127 (int8); returns the scale
// d = max|x| / L, and the rounded values' sum in `total` when asked (v: n floats of scratch,
// for the scalar path). The activations of the AVX2 kernels: a row of the int8 head's, a group
// of 32 of int4's (int16), or of int4_i8_linear's (int8).
template <typename Q>
inline float round_to_int(const void* x, bool bf16, int64_t at, int64_t n, float* v, Q* q,
                          int32_t* total = nullptr) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 32 == 0) return round_to_int_lanes(x, bf16, at, n, q, total);
#endif
  constexpr float kLevels = static_cast<float>(std::numeric_limits<Q>::max());
  if (bf16) widen(raw(static_cast<const c10::BFloat16*>(x) + at), v, n);
  else std::memcpy(v, static_cast<const float*>(x) + at, n * sizeof(float));
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(v[k]));
  const float inv = amax > 0.f ? kLevels / amax : 0.f;
  for (int64_t k = 0; k < n; ++k) q[k] = static_cast<Q>(std::nearbyint(v[k] * inv));
  if (total != nullptr) {
    int32_t sum = 0;
    for (int64_t k = 0; k < n; ++k) sum += q[k];
    *total = sum;
  }
  return amax / kLevels;
}

// Every group of 32 of x's rows (fp32 or bf16, [M, K]) rounded to int16 by round_to_int, rows
// spread over the threads: f(m, g, d, q, total) with the group's scale d, its 32 values q and
// their sum (the AVX2 int4 kernel's activations, and the int8 × int16 kernel's).
template <typename F>
inline void for_int16_groups(const at::Tensor& x, F&& f) {
  const int64_t K = x.size(1), G = K / 32;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* xp = x.const_data_ptr();
  at::parallel_for(0, x.size(0), 16, [&](int64_t m0, int64_t m1) {
    float v[32];
    int16_t q[32];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        int32_t total;
        const float d = round_to_int<int16_t>(xp, bf16, m * K + g * 32, 32, v, q, &total);
        f(m, g, d, static_cast<const int16_t*>(q), total);
      }
  });
}

// Two int16 values as one dword (a the low half), the operand `vpmaddwd` multiplies.
inline int32_t int16_pair(int16_t a, int16_t b) {
  return static_cast<int32_t>(static_cast<uint16_t>(a) | (static_cast<uint32_t>(static_cast<uint16_t>(b)) << 16));
}

// How far ahead of its loads an AVX2 int4 kernel asks for the codes (bytes): one core's
// hardware prefetcher alone kept too few lines in flight (SmolLM2's 30 layers at one row,
// weights from memory, Zen 2: 5.9-6.4 ms without, 5.1 at 1 KB ahead, 5.3-5.4 at 4 KB).
constexpr int64_t kInt4Ahead = 1024;

// ---- The int8 LM head on AVX2: int8 weights × int16 activations ---------------------------
// AVX2 has no int8 × int8 dot product that keeps the activations' precision, and the fp32
// path above (dot_i8_rows) spends an FMA on every 8 products: 16 rows of SmolLM2's 49152 × 576
// head took 8 ms a decode step on a Zen 2 (~50 GMAC/s). Here each row of activations is
// rounded to int16 with one scale, d = max|x| / 32767, and `vpmaddwd` multiplies 16 weight–
// activation pairs into exact int32 sums: 16 products an instruction, from torch's own int8
// layout [O, K] (nothing repacked). An element's rounding error is at most d / 2 = max|x| /
// 65534: below its own bf16 rounding (|x| · 2^-9) wherever |x| ≥ max|x| / 128, and tiny in
// absolute terms elsewhere. A row's arithmetic does not depend on the other rows of the call,
// nor on the row count (batch invariance: the same kernel for every decode batch).
#if DSINFER_AVX2_QUANT
struct I16Rows {
  int64_t K;
  std::unique_ptr<int16_t[]> q;  // [M, K]
  std::unique_ptr<float[]> d;    // [M]: the row's scale

  explicit I16Rows(const at::Tensor& x) : K(x.size(1)), q(new int16_t[x.numel()]), d(new float[x.size(0)]) {
    const int64_t M = x.size(0);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const void* xp = x.const_data_ptr();
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      thread_local std::vector<float> v;  // the scratch rule
      v.assign(K, 0.f);
      for (int64_t m = m0; m < m1; ++m) d[m] = round_to_int<int16_t>(xp, bf16, m * K, K, v.data(), q.get() + m * K);
    });
  }
};

// out[m] = Σ_k w0[k] · xq[m·K + k] and out[M + m] the same for w1, for M activation rows: two
// weight rows share each activation load. The int32 lanes are widened to fp32 every 2048
// inputs: a lane sums 256 products of at most 127 · 32767 there, below 2^31 (DeepSeek-V3's
// 7168 inputs would overflow in one run). The sums are GCC vector types updated with `+=`:
// written as `a = _mm256_add_epi32(a, ...)` GCC 12 put each sum in a new register and copied
// it back every step, and at 4 rows kept two sums on the stack (1.3x slower).
template <int M>
inline void i16_dot_rows(const int16_t* xq, const int8_t* w0, const int8_t* w1, int64_t K, float* out) {
  constexpr int64_t kBlock = 2048;
  for (int i = 0; i < 2 * M; ++i) out[i] = 0.f;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    __v8si a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = __v8si{};
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
      const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w0 + k)));
      const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w1 + k)));
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + m * K + k));
        a0[m] += (__v8si)_mm256_madd_epi16(v0, xv);
        a1[m] += (__v8si)_mm256_madd_epi16(v1, xv);
      }
    }
    for (int m = 0; m < M; ++m) {
      int32_t t0 = 0, t1 = 0;
      for (int64_t j = k; j < k1; ++j) {
        t0 += static_cast<int32_t>(w0[j]) * xq[m * K + j];
        t1 += static_cast<int32_t>(w1[j]) * xq[m * K + j];
      }
      out[m] += hsum8(_mm256_cvtepi32_ps((__m256i)a0[m])) + static_cast<float>(t0);
      out[M + m] += hsum8(_mm256_cvtepi32_ps((__m256i)a1[m])) + static_cast<float>(t1);
    }
  }
}

// i16_dot_rows<1> for one weight row, the way one decode row streams a head from memory: a
// row at a time (one sequential stream a thread: pairs of rows, two streams, read 15-16 GB/s
// where the machine reads 24-25) with four sums (the loads of a 64-byte line in flight
// together) and each line asked for 1 KB ahead. A lane sums the products of the same inputs
// as i16_dot_rows' (k ≡ 2j, 2j + 1 mod 16), so the int32 lanes, and the result, are the
// same bit for bit: the row's value does not depend on the row count. DeepSeek-V2-Lite's
// 102,400 × 2048 head in a harness (Zen 2, two threads): 13.3 → 8.5-8.7 ms.
constexpr int64_t kI8Ahead = 1024;

inline float i16_dot_row1(const int16_t* xq, const int8_t* w, int64_t K) {
  constexpr int64_t kBlock = 2048;  // as i16_dot_rows: int32 lanes widened every 2048 inputs
  const auto step = [&](__v8si& acc, int64_t k) {
    acc += (__v8si)_mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + k))),
                                     _mm256_loadu_si256((const __m256i*)(xq + k)));
  };
  float out = 0.f;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    __v8si a = {}, b = {}, c = {}, d = {};
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      _mm_prefetch((const char*)(w + k + kI8Ahead), _MM_HINT_T0);
      step(a, k);
      step(b, k + 16);
      step(c, k + 32);
      step(d, k + 48);
    }
    for (; k + 16 <= k1; k += 16) step(a, k);
    int32_t t = 0;
    for (; k < k1; ++k) t += static_cast<int32_t>(w[k]) * xq[k];
    out += hsum8(_mm256_cvtepi32_ps((__m256i)((a + b) + (c + d)))) + static_cast<float>(t);
  }
  return out;
}
#endif

// Whether int8_i16_linear runs here (AVX2 + FMA without the AVX-512 trio, which has
// int8_vnni_linear instead).
bool int8_i16_supported() { return DSINFER_AVX2_QUANT; }

// y[m, o] = scales[o] · d_m · Σ_k w[o, k] · xq[m, k]; x [M, K] fp32 or bf16, w int8 [O, K]
// (torch's layout), scales [O] → [M, O] in x's dtype; fp32_out as int8_vnni_linear's.
at::Tensor int8_i16_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, bool fp32_out) {
  TORCH_CHECK(int8_i16_supported(), "int8_i16_linear: this build has no AVX2/FMA kernels");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 2 && w.is_contiguous() &&
                  w.scalar_type() == at::kChar && w.size(1) == x.size(1),
              "int8_i16_linear: expected x [M, K] and int8 w [O, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_i16_linear: fp32 or bf16 activations");
  const int64_t M = x.size(0), K = x.size(1), O = w.size(0);
  TORCH_CHECK(scales.numel() == O, "int8_i16_linear: one scale per output row");
  auto out = at::empty({M, O}, x.options().dtype(fp32_out ? at::kFloat : x.scalar_type()));
#if DSINFER_AVX2_QUANT
  const I16Rows xq(x);
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  const float* sp = sf.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    // fp32_out with bf16 activations: the bf16 value widened (int8_vnni_linear's rule).
    const auto put = [&](int64_t i, float y) {
      if constexpr (std::is_same_v<T, float>) op[i] = fp32_out && bf16 ? f32(from_f32<c10::BFloat16>(y)) : y;
      else op[i] = from_f32<T>(y);
    };
    if (M == 1) {  // one decode row: the weight streamed row by row (i16_dot_row1)
      at::parallel_for(0, O, 64, [&](int64_t o0, int64_t o1) {
        for (int64_t o = o0; o < o1; ++o) put(o, i16_dot_row1(xq.q.get(), wp + o * K, K) * xq.d[0] * sp[o]);
      });
      return;
    }
    // Tiles of 64 weight rows, as int8_linear's (every chunk of rows passes over a tile before
    // the next is read); within a tile, two weight rows at a time share each activation load,
    // and a pair ahead is asked for (one core's prefetcher alone: 1.8 → 1.1 ms for SmolLM2's
    // head at one row in a test harness, Zen 2).
    constexpr int64_t kTile = 64;
    // The pair asked for: ~4 KB ahead (two pairs at K = 576, one at 2048).
    const int64_t ahead = 2 * std::max<int64_t>(1, (4096 + K) / (2 * K));
    at::parallel_for(0, (O + kTile - 1) / kTile, 1, [&](int64_t t0, int64_t t1) {
      float dots[2 * 4];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t o1 = std::min<int64_t>(O, (t + 1) * kTile);
        for (int64_t o = t * kTile; o < o1; o += 2) {
          for (int64_t j = 0; j < 2 * K; j += 64)
            if (o + ahead + 1 < O) _mm_prefetch((const char*)(wp + (o + ahead) * K + j), _MM_HINT_T0);
          const int R = o + 1 < o1 ? 2 : 1;  // an odd last row pairs with itself
          in_row_chunks(M, [&](int64_t m0, auto rows) {
            constexpr int Mr = decltype(rows)::value;
            i16_dot_rows<Mr>(xq.q.get() + m0 * K, wp + o * K, wp + (o + R - 1) * K, K, dots);
            for (int r = 0; r < R; ++r)
              for (int m = 0; m < Mr; ++m) {
                put((m0 + m) * O + o + r, dots[r * Mr + m] * xq.d[m0 + m] * sp[o + r]);
              }
          });
        }
      }
    });
  };
  if (fp32_out || !bf16) run(out.data_ptr<float>());
  else run(out.data_ptr<c10::BFloat16>());
#endif
  return out;
}

// The loop the int8 × int8 and int4 × bf16 kernels share: every block of 16 outputs, every
// chunk of rows (the block's weights stay in cache for all of them). block(ob, m0, rows, tile)
// fills tile[rows][16]; store(m, ob, t) writes row m's 16 outputs of block ob from t[16].
template <int Wide = 4, typename Block, typename Store>
inline void for_output_blocks(int64_t M, int64_t OB, int64_t grain, Block&& block, Store&& store) {
  at::parallel_for(0, OB, grain, [&](int64_t ob0, int64_t ob1) {
    float tile[Wide * 16];
    for (int64_t ob = ob0; ob < ob1; ++ob)
      in_row_chunks<Wide>(M, [&](int64_t m0, auto rows) {
        block(ob, m0, rows, tile);
        for (int64_t m = 0; m < decltype(rows)::value; ++m) store(m0 + m, ob, tile + m * 16);
      });
  });
}

// dst[0..16) = v rounded to T (one vector store for fp32 and bf16).
template <typename T>
inline void store_row16(T* dst, const float* v) {
#if defined(__AVX512F__)
  if constexpr (kAvxElement<T>) {
    store16(dst, _mm512_loadu_ps(v));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // A 512-row prefill call stores ~0.8 M outputs: one at a time, ~10% of the int8 kernel's time.
  if constexpr (kAvx2Element<T>) {
    store8(dst, _mm256_loadu_ps(v));
    store8(dst + 8, _mm256_loadu_ps(v + 8));
    return;
  }
#endif
  for (int64_t l = 0; l < 16; ++l) dst[l] = from_f32<T>(v[l]);
}

// ---- int4 → dense bf16 for many rows (prefill) --------------------------------------------
// torch's CPU int4pack layout: outputs in blocks of 64; per block and input column k, 32 bytes
// whose low nibbles are outputs 0..31 and high nibbles outputs 32..63; scales_zeros [K/G, O, 2]
// with W = (q - 8) * scale + zero. The transposed weight W^T [K, O] is written row by row: each
// (block, k) is 64 consecutive outputs, so the writes are sequential and vectorise.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline void dequant16(__m128i codes, const float* s, const float* z, c10::BFloat16* out) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  const __m512 w = _mm512_fmadd_ps(_mm512_sub_ps(q, _mm512_set1_ps(8.f)), _mm512_loadu_ps(s), _mm512_loadu_ps(z));
  _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(w));
}
#endif

bool int4_dense_supported() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor int4_dequantize_t(const at::Tensor& qweight, int64_t group, const at::Tensor& scales_zeros) {
  TORCH_CHECK(int4_dense_supported(), "int4_dequantize_t: this build has no AVX512-BF16");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "int4_dequantize_t: packed uint8 [O, K / 2] expected");
  const int64_t O = qweight.size(0), K = qweight.size(1) * 2, G = K / group;
  TORCH_CHECK(O % 64 == 0 && group > 0 && K % group == 0, "int4_dequantize_t: O % 64, K % G");
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.size(0) == G && scales_zeros.size(1) == O &&
                  scales_zeros.size(2) == 2, "int4_dequantize_t: scales_zeros [K / G, O, 2]");
  // [G, 2, O] fp32: scales and zeros each contiguous along the outputs.
  const at::Tensor sz = scales_zeros.to(at::kFloat).permute({0, 2, 1}).contiguous();
  auto out = at::empty({K, O}, qweight.options().dtype(at::kBFloat16));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* szp = sz.data_ptr<float>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, K, 16, [&](int64_t kb, int64_t ke) {
    for (int64_t k = kb; k < ke; ++k) {
      const float* s = szp + (k / group) * 2 * O;
      const float* z = s + O;
      for (int64_t nb = 0; nb < O / 64; ++nb) {
        const uint8_t* c = wp + nb * 64 * (K / 2) + k * 32;
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)c);
        const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
        c10::BFloat16* o = op + k * O + nb * 64;
        const int64_t n = nb * 64;
        dequant16(_mm256_castsi256_si128(lo), s + n, z + n, o);
        dequant16(_mm256_extracti128_si256(lo, 1), s + n + 16, z + n + 16, o + 16);
        dequant16(_mm256_castsi256_si128(hi), s + n + 32, z + n + 32, o + 32);
        dequant16(_mm256_extracti128_si256(hi, 1), s + n + 48, z + n + 48, o + 48);
      }
    }
  });
#endif
  return out;
}

// ---- int4 in the repacked ("VNNI") layout ---------------------------------------------------
// torch's packed int4 kernel widens every code to fp32, per activation row (its time grows with
// the rows). The fused backend repacks each int4 weight once after loading into a layout its
// own kernels read 64 bytes at a time: int4_bf16_linear (few rows, below) and
// int4_vnni_dequantize_t (many rows: widened to bf16 for one dense GEMM). The name is the
// layout's first user's: an int4 × int8 `vpdpbusd` kernel (llama.cpp's arithmetic, activations
// quantised per group of 32), replaced in session 15 because its int8 activations cost +1.9%
// perplexity on long texts.
//
// Layout (packed once after loading, int4_vnni_pack): codes [O/16, K/8, 64] uint8 — per
// block of 16 outputs and 8 inputs, lane l's 4 bytes hold inputs k..k+3 (low nibbles) and
// k+4..k+7 (high nibbles) of output l; scales [O/16, G, 2, 16] bf16 (s, then z).
// Whether int4_bf16_linear runs here: its AVX-512 or its AVX2 arithmetic (below).
bool int4_vnni_supported() { return DSINFER_AVX512_VNNI_BF16 || DSINFER_AVX2_QUANT; }

// The int8 × int8 LM head kernel and the packed int4 weight widened for a dense bf16 GEMM:
// AVX-512 only (an AVX2 CPU has no fast bf16 GEMM: torch's runs at ~1 GFLOP/s on a Zen 2).
bool int8_vnni_supported() { return DSINFER_AVX512_VNNI_BF16; }

// One 64-byte chunk of the layout: 16 outputs × 8 inputs, code(l, t) the code of output l at
// input t of the chunk; lane l's byte i holds input i (low nibble) and input i + 4 (high).
template <typename Code>
inline void vnni_chunk(uint8_t* d, Code&& code) {
  for (int64_t l = 0; l < 16; ++l)
    for (int64_t i = 0; i < 4; ++i) d[l * 4 + i] = code(l, i) | (code(l, i + 4) << 4);
}

// The fused int4 layout's two outputs, allocated by the caller for O rows of K inputs: codes
// [O/16, K/8, 64] uint8 and scale | zero [O/16, K/32, 2, 16] bf16, both contiguous.
void check_vnni_outputs(const char* op, const at::Tensor& codes, const at::Tensor& sz, int64_t O, int64_t K) {
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.sizes() == at::IntArrayRef({O / 16, K / 8, 64}),
              op, ": codes [", O / 16, ", ", K / 8, ", 64] uint8 expected");
  TORCH_CHECK(sz.is_contiguous() && sz.scalar_type() == at::kBFloat16 &&
                  sz.sizes() == at::IntArrayRef({O / 16, K / 32, 2, 16}),
              op, ": sz [", O / 16, ", ", K / 32, ", 2, 16] bf16 expected");
}

// int4_vnni_pack into `codes` [O/16, K/8, 64] uint8 and `sz` [O/16, K/32, 2, 16] bf16, both
// contiguous and already allocated: an expert stack's repack writes each expert into its slice
// of the stacked tensors (per-expert results stacked afterwards cost a second copy of the
// stack and twice its memory: 15 of a 60 s DeepSeek-V2-Lite artifact start, session 37).
void int4_vnni_pack_into(const at::Tensor& qweight, int64_t group, const at::Tensor& scales_zeros,
                         int64_t block_rows, at::Tensor codes, at::Tensor sz) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "int4_vnni_pack: torch's packed uint8 [O, K / 2] expected");
  const int64_t O = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(group == 32 && O % 64 == 0 && K % group == 0, "int4_vnni_pack: groups of 32, O % 64");
  TORCH_CHECK(block_rows == 64 || block_rows == 32, "int4_vnni_pack: torch's blocks of 64 or 32 rows");
  const int64_t G = K / group;
  TORCH_CHECK(scales_zeros.dim() == 3 && scales_zeros.size(0) == G && scales_zeros.size(1) == O,
              "int4_vnni_pack: scales_zeros [K / 32, O, 2]");
  check_vnni_outputs("int4_vnni_pack", codes, sz, O, K);
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  // torch's layout: per block of R outputs (64 on AVX-512 builds, 32 on AVX2) and input k,
  // R / 2 bytes; byte j holds output j (low nibble) and output R / 2 + j (high nibble). So the
  // 16 outputs of one VNNI block, at input k, are one nibble of 16 consecutive bytes (R / 2 is
  // a multiple of 16): read as runs, not code by code (~10× faster than a lookup per code,
  // which cost DeepSeek-V2-Lite's start ~25 s).
  const int64_t R = block_rows, half = R / 2;
  at::parallel_for(0, O / 16, 1, [&](int64_t ob0, int64_t ob1) {
    uint8_t nib[8][16];  // [input k within the chunk of 8][output l]
    for (int64_t ob = ob0; ob < ob1; ++ob) {
      const int64_t j0 = (ob * 16) % R;  // the first output's row within its torch block
      const int shift = j0 < half ? 0 : 4;
      const uint8_t* rows = wp + (ob * 16 / R) * half * K + j0 % half;  // + k · half: input k
      uint8_t* dst = cp + ob * (K / 8) * 64;
      for (int64_t kc = 0; kc < K / 8; ++kc) {
        for (int64_t t = 0; t < 8; ++t) {
          const uint8_t* src = rows + (kc * 8 + t) * half;
          for (int64_t l = 0; l < 16; ++l) nib[t][l] = (src[l] >> shift) & 0x0F;
        }
        vnni_chunk(dst + kc * 64, [&](int64_t l, int64_t t) { return nib[t][l]; });
      }
    }
  });
  // [G, O, 2] → [O/16, G, 2, 16]
  sz.copy_(scales_zeros.to(at::kBFloat16).view({G, O / 16, 16, 2}).permute({1, 0, 3, 2}));
}

std::tuple<at::Tensor, at::Tensor> int4_vnni_pack(const at::Tensor& qweight, int64_t group,
                                                  const at::Tensor& scales_zeros, int64_t block_rows) {
  TORCH_CHECK(qweight.dim() == 2 && group > 0, "int4_vnni_pack: torch's packed uint8 [O, K / 2] expected");
  const int64_t O = qweight.size(0), K = qweight.size(1) * 2;
  auto codes = at::empty({O / 16, K / 8, 64}, qweight.options());
  auto sz = at::empty({O / 16, K / group, 2, 16}, qweight.options().dtype(at::kBFloat16));
  int4_vnni_pack_into(qweight, group, scales_zeros, block_rows, codes, sz);
  return {codes, sz};
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// One row of activations quantised per group of 32: xq (int8), dx (scale), sx (exact sum).
// Straight from the activation dtype (fp32 or bf16: widened in registers, no fp32 copy).
template <typename T>
inline void quantize_row_q8(const T* x, int64_t K, int8_t* xq, float* dx, float* sx) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const __m512 a = load16(x + g * 32), b = load16(x + g * 32 + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(a)), _mm512_reduce_max_ps(_mm512_abs_ps(b)));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i*)(xq + g * 32), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(xq + g * 32 + 16), _mm512_cvtsepi32_epi8(qb));
    dx[g] = d;
    sx[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

// Every row of x [M, K] (contiguous fp32 or bf16), quantised per group of 32: q [M, K],
// d and s [M, K / 32] (row m's groups at m · K / 32).
struct QuantizedRows {
  int64_t K, G;
  std::vector<int8_t> q;
  std::vector<float> d, s;

  explicit QuantizedRows(const at::Tensor& x)
      : K(x.size(1)), G(x.size(1) / 32), q(x.size(0) * x.size(1)), d(x.size(0) * G), s(x.size(0) * G) {
    const int64_t M = x.size(0);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "int8 activations: fp32 or bf16 rows expected");
    // Rows on all threads (the int8 head takes up to 64).
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const void* xp = x.data_ptr();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        if (bf16)
          quantize_row_q8(static_cast<const c10::BFloat16*>(xp) + m * K, K, row_q(m), row_d(m), row_s(m));
        else
          quantize_row_q8(static_cast<const float*>(xp) + m * K, K, row_q(m), row_d(m), row_s(m));
      }
    });
  }
  int8_t* row_q(int64_t m) { return q.data() + m * K; }
  float* row_d(int64_t m) { return d.data() + m * G; }
  float* row_s(int64_t m) { return s.data() + m * G; }
};

inline __m512 load_bf16x16(const c10::BFloat16* p) { return load16(p); }

#endif

// ---- int4 × bf16 dot products (AVX512-BF16): the activations as they are ------------------
// int8 activations (the int4 × int8 kernel this replaced, llama.cpp's way) cost perplexity:
// +1.9% on a 2,000-token text fed one token a step (SmolLM2: the reference 84.86, int8
// activations 86.36, this kernel 84.73), past the 0.5% gate. Here the codes become bf16 in
// registers and `vdpbf16ps` multiplies them with the activations' own bf16 values (exact
// products, fp32 sums): the reference's arithmetic without its bf16 rounding of each
// dequantised weight. A code q becomes bf16(128 + q) by one bit operation (0x4300 | q: 128..143
// are exact in bf16's 8 significant bits), so per group g and output o:
//   Σ_k w[o,k] x[k] = s[g,o] · Σ_k (128 + q[o,k]) x[k] + (z[g,o] − 136 s[g,o]) · Σ_k x[k]
// with Σ_k x[k] the sum of the very bf16 values multiplied (fp32 activations are split into
// two bf16 terms, hi + lo, ~16 significant bits). In the packed layout above lane l of a
// 64-byte chunk holds inputs k..k+3 (low nibbles) and k+4..k+7 (high nibbles) of output l, so
// the four 16-bit pairs a lane's dword yields are inputs (k, k+2), (k+1, k+3), (k+4, k+6),
// (k+5, k+7); the activations are laid out once per call in that pair order.
// Cost: two dot instructions where int8 needed one. SmolLM2's 30 layers, weights streamed,
// 1 / 16 rows: 1.70-1.82 / 7.1 ms against int8's 1.56-1.70 / 5.6.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// One activation row as bf16 pairs in the codes' order (K / 2 dwords a term) and the exact
// fp32 sum of each group of 32 of the values multiplied.
struct Bf16PairRows {
  int64_t K, G, T;  // T: bf16 terms a row (1 for bf16 activations, 2 for fp32: hi + lo)
  std::unique_ptr<uint32_t[]> pairs;  // [M, T, K / 2]
  std::unique_ptr<float[]> sums;      // [M, G]

  explicit Bf16PairRows(const at::Tensor& x)
      : K(x.size(1)), G(x.size(1) / 32), T(x.scalar_type() == at::kBFloat16 ? 1 : 2),
        pairs(new uint32_t[x.size(0) * T * x.size(1) / 2]), sums(new float[x.size(0) * G]) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "int4_bf16_linear: fp32 or bf16 rows expected");
    const int64_t M = x.size(0);
    // Within each run of 8 words: 0 2 1 3 4 6 5 7, the codes' pair order.
    alignas(64) int16_t order[32];
    for (int i = 0; i < 32; ++i) {
      static constexpr int16_t kRun[8] = {0, 2, 1, 3, 4, 6, 5, 7};
      order[i] = static_cast<int16_t>(i / 8 * 8 + kRun[i % 8]);
    }
    const __m512i idx = _mm512_load_si512(order);
    const void* xp = x.const_data_ptr();
    // Rows on all threads (a routed expert's call has a row or two: then one task).
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t g = 0; g < G; ++g) {
          __m512i hi;
          __m512 sum;
          if (T == 1) {
            const auto* xb = static_cast<const c10::BFloat16*>(xp) + m * K + g * 32;
            hi = _mm512_loadu_si512(xb);
            sum = _mm512_add_ps(load16(xb), load16(xb + 16));
          } else {
            // x = hi + lo, each a bf16 value (the sum is of those values, as multiplied).
            const float* xf = static_cast<const float*>(xp) + m * K + g * 32;
            const __m512 a = _mm512_loadu_ps(xf), b = _mm512_loadu_ps(xf + 16);
            const __m512 ha = to_bf16_and_back(a), hb = to_bf16_and_back(b);
            const __m512 la = to_bf16_and_back(_mm512_sub_ps(a, ha));
            const __m512 lb = to_bf16_and_back(_mm512_sub_ps(b, hb));
            hi = (__m512i)_mm512_cvtne2ps_pbh(hb, ha);  // words 0..15 from a, 16..31 from b
            const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(lb, la);
            sum = _mm512_add_ps(_mm512_add_ps(ha, hb), _mm512_add_ps(la, lb));
            _mm512_storeu_si512(row(m, 1) + g * 16, _mm512_permutexvar_epi16(idx, lo));
          }
          _mm512_storeu_si512(row(m, 0) + g * 16, _mm512_permutexvar_epi16(idx, hi));
          sums[m * G + g] = _mm512_reduce_add_ps(sum);
        }
    });
  }
  const uint32_t* row(int64_t m, int64_t t) const { return pairs.get() + (m * T + t) * (K / 2); }
  uint32_t* row(int64_t m, int64_t t) { return pairs.get() + (m * T + t) * (K / 2); }
  const float* row_sums(int64_t m) const { return sums.get() + m * G; }
};

// How far ahead of its reads the one-row int4 × bf16 kernel prefetches the codes (bytes).
constexpr int64_t kBf16Ahead = 16384;

// 16 outputs (one block) for M rows of T terms: out[m][16].
template <int M, int T>
inline void bf16_block(const uint8_t* codes, const c10::BFloat16* sz, int64_t K, const Bf16PairRows& x,
                       int64_t m0, float* out) {
  const __m512i mask = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
  // (v & mask) | bias: nibble q → bf16(128 + q) in both halves of each dword (0xEA = A&B | C).
  const auto widen = [&](__m512i v) { return (__m512bh)_mm512_ternarylogic_epi32(v, mask, bias, 0xEA); };
  // Two independent sum chains a row (vdpbf16ps waits on its accumulator): pair p goes to
  // chain p % 2 for every number of rows, so a row sums in the same order in any batch. (Four
  // chains in chunks of 4 rows: 1.7-2.0 / 9.6 ms for SmolLM2's 30 layers at 1 / 16 rows;
  // these two in chunks of 8: 1.74 / 7.7, before the activations' layout was vectorised.)
  constexpr int C = 2;
  const int64_t G = K / 32;
  const uint32_t* xr[M][T];
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < T; ++t) xr[m][t] = x.row(m0 + m, t);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 dot[M][C];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < C; ++c) dot[m][c] = _mm512_setzero_ps();
    if constexpr (M == 1) {
      // One row streams the weight at memory speed: ask for the group kBf16Ahead bytes on (a
      // group's 4 lines of codes, and its scales' line, which run a quarter as fast). Past the
      // matrix's end that is the next one's: the arena holds the weights in the order a step
      // reads them (device/host_memory.py). One row, 30 layers: 414-442 → 477-504 tok/s
      // (benchmarks/profile_decode.py, five rounds alternating; 8 KiB 461-502, 1 KiB none).
      for (int64_t l = 0; l < 256; l += 64)
        _mm_prefetch((const char*)(codes + g * 256 + l + kBf16Ahead), _MM_HINT_T0);
      _mm_prefetch((const char*)(sz + g * 32) + kBf16Ahead / 4, _MM_HINT_T0);
    }
    for (int64_t c = 0; c < 4; ++c) {  // 4 chunks of 8 inputs
      const __m512i v = _mm512_loadu_si512(codes + (g * 4 + c) * 64);
      const __m512bh w[4] = {widen(v), widen(_mm512_srli_epi32(v, 8)), widen(_mm512_srli_epi32(v, 4)),
                             widen(_mm512_srli_epi32(v, 12))};
      for (int m = 0; m < M; ++m)
        for (int t = 0; t < T; ++t) {
          const uint32_t* xp = xr[m][t] + (g * 4 + c) * 4;
          for (int p = 0; p < 4; ++p) {
            __m512& d = dot[m][p % C];
            d = _mm512_dpbf16_ps(d, w[p], (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[p])));
          }
        }
    }
    const __m512 s = load_bf16x16(sz + g * 32), z = load_bf16x16(sz + g * 32 + 16);
    const __m512 zc = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, z);  // z − 136 s
    for (int m = 0; m < M; ++m) {
      __m512 d = dot[m][0];
      for (int c = 1; c < C; ++c) d = _mm512_add_ps(d, dot[m][c]);
      acc[m] = _mm512_fmadd_ps(s, d, acc[m]);
      acc[m] = _mm512_fmadd_ps(zc, _mm512_set1_ps(x.row_sums(m0 + m)[g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * 16, acc[m]);
}
#endif

// ---- int4 × int16 dot products (AVX2 + FMA: CPUs without AVX-512) -----------------------
// AVX2 has no bf16 dot product, and widening each code to fp32 for an FMA costs ~4 vector
// instructions per 8 products. Here each group of 32 activations is quantised to int16 (scale
// d = max|x| / 32767: an error of at most 2^-16 of the group's largest value, ~250× finer than
// the bf16 rounding of the activations themselves; the int8 activations that cost perplexity,
// above, are 256× coarser), and `vpmaddwd` multiplies 16 (code, activation) pairs into exact
// int32 sums an instruction. Per group g and output o:
//   Σ_k w[o,k] x[k] = s[g,o] · d · Σ_k q[o,k] xq[k] + (z[g,o] − 8 s[g,o]) · d · Σ_k xq[k]
// Same packed layout as above: a lane's dword yields the 16-bit pairs (k, k+2), (k+1, k+3),
// (k+4, k+6), (k+5, k+7), and the activations are laid out once per call in that pair order.
// A row's arithmetic does not depend on the other rows of the call (batch invariance).
#if DSINFER_AVX2_QUANT
struct I16PairRows {
  int64_t K, G;
  std::unique_ptr<int32_t[]> pairs;  // [M, K / 2]: two int16 activations a dword, codes' order
  std::unique_ptr<float[]> scale;    // [M, G]: d
  std::unique_ptr<float[]> sums;     // [M, G]: d · Σ xq (the sum of the values multiplied)

  explicit I16PairRows(const at::Tensor& x)
      : K(x.size(1)), G(x.size(1) / 32), pairs(new int32_t[x.size(0) * x.size(1) / 2]),
        scale(new float[x.size(0) * G]), sums(new float[x.size(0) * G]) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "int4_bf16_linear: fp32 or bf16 rows expected");
    for_int16_groups(x, [&](int64_t m, int64_t g, float d, const int16_t* q, int32_t total) {
      // Chunk c of 8 inputs, pair p: inputs (c·8 + a, c·8 + a + 2), a = 0, 1, 4, 5.
      static constexpr int kFirst[4] = {0, 1, 4, 5};
      int32_t* out = pairs.get() + (m * K + g * 32) / 2;
      for (int c = 0; c < 4; ++c)
        for (int p = 0; p < 4; ++p) {
          const int a = c * 8 + kFirst[p];
          out[c * 4 + p] = int16_pair(q[a], q[a + 2]);
        }
      scale[m * G + g] = d;
      sums[m * G + g] = d * static_cast<float>(total);
    });
  }
  const int32_t* row(int64_t m) const { return pairs.get() + m * (K / 2); }
  const float* row_scale(int64_t m) const { return scale.get() + m * G; }
  const float* row_sums(int64_t m) const { return sums.get() + m * G; }
};

// 16 outputs (one block) for M rows: out[m][16], in two halves of 8 outputs (a half's 32
// bytes of each chunk: its 8 lanes). M ≤ 8 int32 sums, 4 unpacked code vectors and the mask
// fit AVX2's 16 registers.
template <int M>
inline void i16_block(const uint8_t* codes, const c10::BFloat16* sz, int64_t K, const I16PairRows& x,
                      int64_t m0, float* out) {
  const __m256i mask = _mm256_set1_epi32(0x000F000F);
  const int64_t G = K / 32;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __v8si dot[M];  // `+=` on GCC vector types: see i16_dot_rows (16 rows: 22.2 → 20.8 ms)
      for (int m = 0; m < M; ++m) dot[m] = __v8si{};
      for (int64_t c = 0; c < 4; ++c) {
        if (h == 0) _mm_prefetch((const char*)(codes + (g * 4 + c) * 64 + kInt4Ahead), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + (g * 4 + c) * 64 + h * 32));
        const __m256i w0 = _mm256_and_si256(v, mask), w1 = _mm256_and_si256(_mm256_srli_epi32(v, 8), mask);
        const __m256i w2 = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask);
        const __m256i w3 = _mm256_and_si256(_mm256_srli_epi32(v, 12), mask);
        for (int m = 0; m < M; ++m) {
          const int32_t* xp = x.row(m0 + m) + (g * 4 + c) * 4;
          dot[m] += (__v8si)_mm256_madd_epi16(w0, _mm256_set1_epi32(xp[0]));
          dot[m] += (__v8si)_mm256_madd_epi16(w1, _mm256_set1_epi32(xp[1]));
          dot[m] += (__v8si)_mm256_madd_epi16(w2, _mm256_set1_epi32(xp[2]));
          dot[m] += (__v8si)_mm256_madd_epi16(w3, _mm256_set1_epi32(xp[3]));
        }
      }
      const __m256 s = load8(sz + g * 32 + h * 8), z = load8(sz + g * 32 + 16 + h * 8);
      const __m256 zc = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z);  // z − 8 s
      for (int m = 0; m < M; ++m) {
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x.row_scale(m0 + m)[g]));
        acc[m] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps((__m256i)dot[m]), acc[m]);
        acc[m] = _mm256_fmadd_ps(zc, _mm256_set1_ps(x.row_sums(m0 + m)[g]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * 16 + h * 8, acc[m]);
  }
}

// i16_block<1> in fewer instructions (one row streams the weights: its time is the memory's
// plus what the loads cannot hide). Both halves in one pass, so each activation pair is
// broadcast once for 16 outputs; and the codes in bits 4-7 of each 16-bit half (w2, w3 above)
// are multiplied in place, 16 times their value, into sums of their own that are divided by 16
// (exactly: every term is a multiple of 16; at most 8 · 2 · 16 · 15 · 32767 < 2^31 a group)
// before they join the others. The same integers and the same fp32 steps as i16_block<1>: the
// same result, bit for bit (SmolLM2's 30 layers from memory, Zen 2, the two alternating in a
// harness: 3.3-3.9 → 3.0-3.4 ms; through the op, 4.7-4.9 → 3.9-4.0 ms).
inline void i16_block1(const uint8_t* codes, const c10::BFloat16* sz, int64_t K, const I16PairRows& x,
                       int64_t m, float* out) {
  const __m256i lo = _mm256_set1_epi32(0x000F000F), hi = _mm256_set1_epi32(0x00F000F0);
  const int64_t G = K / 32;
  const int32_t* xr = x.row(m);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    __v8si dlo[2] = {}, dhi[2] = {};
    // The scales and zeros are a second stream (64 bytes a group): asked for 4 groups ahead
    // (a harness, 2816 × 2048 from memory: 159-171 → 151-155 µs).
    _mm_prefetch((const char*)(sz + g * 32) + 256, _MM_HINT_T0);
    for (int64_t c = 0; c < 4; ++c) {
      const uint8_t* cp = codes + (g * 4 + c) * 64;
      _mm_prefetch((const char*)(cp + kInt4Ahead), _MM_HINT_T0);
      const __m256i v[2] = {_mm256_loadu_si256((const __m256i*)cp), _mm256_loadu_si256((const __m256i*)(cp + 32))};
      const __m256i s8[2] = {_mm256_srli_epi32(v[0], 8), _mm256_srli_epi32(v[1], 8)};
      const int32_t* xp = xr + (g * 4 + c) * 4;
      const __m256i x0 = _mm256_set1_epi32(xp[0]), x1 = _mm256_set1_epi32(xp[1]);
      const __m256i x2 = _mm256_set1_epi32(xp[2]), x3 = _mm256_set1_epi32(xp[3]);
      for (int h = 0; h < 2; ++h) {
        dlo[h] += (__v8si)_mm256_madd_epi16(_mm256_and_si256(v[h], lo), x0);
        dlo[h] += (__v8si)_mm256_madd_epi16(_mm256_and_si256(s8[h], lo), x1);
        dhi[h] += (__v8si)_mm256_madd_epi16(_mm256_and_si256(v[h], hi), x2);
        dhi[h] += (__v8si)_mm256_madd_epi16(_mm256_and_si256(s8[h], hi), x3);
      }
    }
    const __m256 d = _mm256_set1_ps(x.row_scale(m)[g]), sums = _mm256_set1_ps(x.row_sums(m)[g]);
    for (int h = 0; h < 2; ++h) {
      const __m256i dot = _mm256_add_epi32((__m256i)dlo[h], _mm256_srai_epi32((__m256i)dhi[h], 4));
      const __m256 s = load8(sz + g * 32 + h * 8), z = load8(sz + g * 32 + 16 + h * 8);
      const __m256 zc = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z);  // z − 8 s
      acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(s, d), _mm256_cvtepi32_ps(dot), acc[h]);
      acc[h] = _mm256_fmadd_ps(zc, sums, acc[h]);
    }
  }
  _mm256_storeu_ps(out, acc[0]);
  _mm256_storeu_ps(out + 8, acc[1]);
}
#endif

// x [M, K] (fp32 or bf16) × the packed weight → [M, O] in x's dtype; the activations as they
// are with AVX-512, rounded to int16 per group of 32 with AVX2 (above).
at::Tensor int4_bf16_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz) {
  TORCH_CHECK(int4_vnni_supported(), "int4_bf16_linear: this build has neither AVX512-VNNI/BF16 nor AVX2/FMA");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_bf16_linear: contiguous [M, K] expected");
  const int64_t M = x.size(0), K = x.size(1), OB = codes.size(0), O = OB * 16, G = K / 32;
  TORCH_CHECK(codes.size(1) * 8 == K && sz.size(1) == G, "int4_bf16_linear: shape mismatch");
  auto out = at::empty({M, O}, x.options());
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  const Bf16PairRows xb(x);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<c10::BFloat16>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int4_bf16_linear", [&] {
    using T = scalar_t;
    T* op = out.data_ptr<T>();
    const auto block = [&](int64_t ob, int64_t m0, auto rows, float* tile) {
      constexpr int R = decltype(rows)::value;
      const uint8_t* c = cp + ob * (K / 8) * 64;
      const c10::BFloat16* s = szp + ob * G * 32;
      if (xb.T == 1)
        bf16_block<R, 1>(c, s, K, xb, m0, tile);
      else
        bf16_block<R, 2>(c, s, K, xb, m0, tile);
    };
    for_output_blocks<8>(M, OB, 4, block,
                         [&](int64_t m, int64_t ob, const float* t) { store_row16(op + m * O + ob * 16, t); });
  });
#elif DSINFER_AVX2_QUANT
  const I16PairRows xi(x);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<c10::BFloat16>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int4_bf16_linear", [&] {
    using T = scalar_t;
    T* op = out.data_ptr<T>();
    const auto block = [&](int64_t ob, int64_t m0, auto rows, float* tile) {
      constexpr int R = decltype(rows)::value;
      if constexpr (R == 1) i16_block1(cp + ob * (K / 8) * 64, szp + ob * G * 32, K, xi, m0, tile);
      else i16_block<R>(cp + ob * (K / 8) * 64, szp + ob * G * 32, K, xi, m0, tile);
    };
    for_output_blocks<8>(M, OB, 4, block,
                         [&](int64_t m, int64_t ob, const float* t) { store_row16(op + m * O + ob * 16, t); });
  });
#endif
  return out;
}

// ---- int4 × int8 activations: llama.cpp's arithmetic (--int8-activations) ----------------
// The int16 kernel above is bound by `vpmaddwd`: 16 products an instruction, one instruction a
// cycle on a Zen 2, ~80% of it reached at 16 rows and in prefill. `vpmaddubsw` multiplies 32
// unsigned bytes by 32 signed bytes an instruction at about the same rate: with the codes as
// the unsigned bytes (0..15) and the activations rounded to int8 per group of 32 (d = max|x| /
// 127, as llama.cpp's Q8 activations), twice the products an instruction. Same packed layout
// and the formula above, int8 for int16:
//   Σ_k w[o,k] x[k] ≈ s[g,o] · d · Σ_k q[o,k] xq[k] + (z[g,o] − 8 s[g,o]) · d · Σ_k xq[k]
// The zero points must meet the sum of the *rounded* activations: then the result is exactly
// Σ_k w[o,k] · d·xq[k], and each rounding error meets its centred weight w (a Q4_1 group's
// codes span its weights' range, so z − 8 s ≈ −7.5 s). Until session 22 they met the exact
// sum Σ x, which left the errors on the uncentred codes (q · s, 0..15 s): 2.3× the output
// error on SmolLM2's layers, +0.9-1.5% perplexity where the rounding itself costs ~0.1-0.3%
// (docs/backends.md).
// A lane's dword holds inputs k..k+3 in its low nibbles and k+4..k+7 in its high ones (byte b:
// k + b and k + 4 + b), so the activations keep their natural order: 4 bytes a broadcast.
// The int16 pair sums are exact and stay in int16 for a group: 8 instructions of at most
// 2 · 15 · 127 = 3810 each sum below 2^15. A row's arithmetic does not depend on the others.
#if defined(__AVX2__) && defined(__FMA__)
#define DSINFER_INT4_I8 1
struct I8Rows {
  int64_t K, G;
  std::unique_ptr<int8_t[]> q;       // [M, K]: the activations rounded, in their own order
  std::unique_ptr<float[]> scale;    // [M, G]: d
  std::unique_ptr<float[]> sums;     // [M, G]: d · Σ xq (the sum of the values multiplied)

  explicit I8Rows(const at::Tensor& x)
      : K(x.size(1)), G(x.size(1) / 32), q(new int8_t[x.numel()]), scale(new float[x.size(0) * G]),
        sums(new float[x.size(0) * G]) {
    const int64_t M = x.size(0);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const void* xp = x.const_data_ptr();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      float v[32];
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t g = 0; g < G; ++g) {
          int32_t total;
          const float d = round_to_int<int8_t>(xp, bf16, m * K + g * 32, 32, v, q.get() + m * K + g * 32, &total);
          scale[m * G + g] = d;
          sums[m * G + g] = d * static_cast<float>(total);
        }
    });
  }
  const int32_t* row(int64_t m) const { return reinterpret_cast<const int32_t*>(q.get() + m * K); }
};

// 16 outputs (one block) for M ≤ 6 rows, both halves of 8 in one pass: each broadcast of 4
// activations serves 16 outputs. 2M int16 sums, 4 code vectors and the mask in 16 registers
// (a Zen 2, 16 rows of 576 → 1536 in a harness: chunks of 6 rows 0.21 ms, of 8 rows a half at
// a time 0.26, the int16 kernel 0.33).
template <int M>
inline void i8_block(const uint8_t* codes, const c10::BFloat16* sz, int64_t K, const I8Rows& x, int64_t m0,
                     float* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t G = K / 32;
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __v16hi dot[M][2];  // GCC vector types with `+=`: see i16_dot_rows
    for (int m = 0; m < M; ++m) dot[m][0] = dot[m][1] = __v16hi{};
    for (int64_t c = 0; c < 4; ++c) {
      const uint8_t* cp = codes + (g * 4 + c) * 64;
      _mm_prefetch((const char*)(cp + kInt4Ahead), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)cp), v1 = _mm256_loadu_si256((const __m256i*)(cp + 32));
      const __m256i lo0 = _mm256_and_si256(v0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi32(v0, 4), mask);
      const __m256i lo1 = _mm256_and_si256(v1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi32(v1, 4), mask);
      for (int m = 0; m < M; ++m) {
        const int32_t* xp = x.row(m0 + m) + (g * 4 + c) * 2;
        const __m256i a = _mm256_set1_epi32(xp[0]), b = _mm256_set1_epi32(xp[1]);
        dot[m][0] += (__v16hi)_mm256_maddubs_epi16(lo0, a);
        dot[m][1] += (__v16hi)_mm256_maddubs_epi16(lo1, a);
        dot[m][0] += (__v16hi)_mm256_maddubs_epi16(hi0, b);
        dot[m][1] += (__v16hi)_mm256_maddubs_epi16(hi1, b);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load8(sz + g * 32 + h * 8), z = load8(sz + g * 32 + 16 + h * 8);
      const __m256 zc = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z);  // z − 8 s
      for (int m = 0; m < M; ++m) {
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(x.scale[(m0 + m) * G + g]));
        const __m256i d32 = _mm256_madd_epi16((__m256i)dot[m][h], ones);  // pairs → int32
        acc[m][h] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(d32), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(zc, _mm256_set1_ps(x.sums[(m0 + m) * G + g]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(out + m * 16, acc[m][0]);
    _mm256_storeu_ps(out + m * 16 + 8, acc[m][1]);
  }
}

#if DSINFER_AVX512_VNNI_BF16
// The same block on AVX-512 VNNI: `vpdpbusd` multiplies 64 (code, activation) byte pairs an
// instruction straight into int32 sums (16 outputs a register, both nibbles of a 64-byte chunk
// in two instructions), where the AVX2 block needs four `vpmaddubsw` and a widening. The int32
// sums are the AVX2 block's, and the float steps the same operations in the same order: the
// same bits. Chunks of up to 8 rows (2 × 8 accumulators of the 32 registers).
template <int M>
inline void i8_block512(const uint8_t* codes, const c10::BFloat16* sz, int64_t K, const I8Rows& x, int64_t m0,
                        float* out) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const int64_t G = K / 32;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    for (int64_t c = 0; c < 4; ++c) {
      const uint8_t* cp = codes + (g * 4 + c) * 64;
      _mm_prefetch((const char*)(cp + kInt4Ahead), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512((const void*)cp);
      const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), mask);
      for (int m = 0; m < M; ++m) {
        const int32_t* xp = x.row(m0 + m) + (g * 4 + c) * 2;
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(xp[0]));
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(xp[1]));
      }
    }
    const __m512 s = load16(sz + g * 32), z = load16(sz + g * 32 + 16);
    const __m512 zc = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);  // z − 8 s
    for (int m = 0; m < M; ++m) {
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(x.scale[(m0 + m) * G + g]));
      acc[m] = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(dot[m]), acc[m]);
      acc[m] = _mm512_fmadd_ps(zc, _mm512_set1_ps(x.sums[(m0 + m) * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * 16, acc[m]);
}
#endif

// f(m0, rows) over [0, M) in chunks of N rows, the rest in one chunk of fewer (compile-time
// row counts 1..N).
template <int N, typename F>
inline void in_chunks_of(int64_t M, F&& f) {
  int64_t m0 = 0;
  for (; M - m0 >= N; m0 += N) f(m0, std::integral_constant<int, N>{});
  if constexpr (N > 1) {
    if (m0 < M) in_chunks_of<N - 1>(M - m0, [&](int64_t m, auto rows) { f(m0 + m, rows); });
  }
}
#else
#define DSINFER_INT4_I8 0
#endif

bool int4_i8_supported() { return DSINFER_INT4_I8; }

// x [M, K] (fp32 or bf16) × the packed weight (int4_vnni_pack's layout) → [M, O] in x's dtype,
// the activations rounded to int8 per group of 32 (above).
at::Tensor int4_i8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz) {
  TORCH_CHECK(int4_i8_supported(), "int4_i8_linear: this build has no AVX2/FMA kernels");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_i8_linear: contiguous [M, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_i8_linear: fp32 or bf16 rows expected");
  const int64_t M = x.size(0), K = x.size(1), OB = codes.size(0), O = OB * 16, G = K / 32;
  TORCH_CHECK(codes.size(1) * 8 == K && sz.size(1) == G, "int4_i8_linear: shape mismatch");
  auto out = at::empty({M, O}, x.options());
#if DSINFER_INT4_I8
  const I8Rows xi(x);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<c10::BFloat16>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int4_i8_linear", [&] {
    using T = scalar_t;
    T* op = out.data_ptr<T>();
    // Rows a chunk: as many as the registers hold accumulators for (32 zmm / 16 ymm).
    constexpr int kChunk = DSINFER_AVX512_VNNI_BF16 ? 8 : 6;
    at::parallel_for(0, OB, 4, [&](int64_t ob0, int64_t ob1) {
      float tile[kChunk * 16];
      for (int64_t ob = ob0; ob < ob1; ++ob)
        in_chunks_of<kChunk>(M, [&](int64_t m0, auto rows) {
          constexpr int R = decltype(rows)::value;
#if DSINFER_AVX512_VNNI_BF16
          i8_block512<R>(cp + ob * (K / 8) * 64, szp + ob * G * 32, K, xi, m0, tile);
#else
          i8_block<R>(cp + ob * (K / 8) * 64, szp + ob * G * 32, K, xi, m0, tile);
#endif
          for (int m = 0; m < R; ++m) store_row16(op + (m0 + m) * O + ob * 16, tile + m * 16);
        });
    });
  });
#endif
  return out;
}

// The packed weight widened to bf16 and transposed, [K, O], for one dense GEMM (prefill).
at::Tensor int4_vnni_dequantize_t(const at::Tensor& codes, const at::Tensor& sz) {
  TORCH_CHECK(int8_vnni_supported(), "int4_vnni_dequantize_t: this build has no AVX512-VNNI/BF16");
  const int64_t OB = codes.size(0), K = codes.size(1) * 8, O = OB * 16, G = K / 32;
  auto out = at::empty({K, O}, codes.options().dtype(at::kBFloat16));
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const auto* szp = sz.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  // Blocks in pairs: the two blocks' 16 outputs of one input are 32 adjacent bf16, one whole
  // 64-byte line a store (one block a pass wrote each line in two halves, at different times).
  // O % 64 == 0, so OB is even and a pair never straddles two threads' ranges (grain 2).
  at::parallel_for(0, OB / 2, 2, [&](int64_t p0, int64_t p1) {
    const __m512i mask = _mm512_set1_epi32(0x0F);
    const __m512 eight = _mm512_set1_ps(8.f);
    for (int64_t ob = 2 * p0; ob < 2 * p1; ob += 2)
      for (int64_t g = 0; g < G; ++g) {
        const c10::BFloat16* sz0 = szp + (ob * G + g) * 32;
        const c10::BFloat16* sz1 = szp + ((ob + 1) * G + g) * 32;
        const __m512 s0 = load16(sz0), z0 = load16(sz0 + 16);
        const __m512 s1 = load16(sz1), z1 = load16(sz1 + 16);
        for (int64_t c = 0; c < 4; ++c) {
          const __m512i v0 = _mm512_loadu_si512(cp + ((ob * (K / 8)) + g * 4 + c) * 64);
          const __m512i v1 = _mm512_loadu_si512(cp + (((ob + 1) * (K / 8)) + g * 4 + c) * 64);
          for (int64_t i = 0; i < 8; ++i) {  // input k = g·32 + c·8 + i: nibble i of each lane
            const int shift = (i < 4 ? 8 * i : 8 * (i - 4) + 4);
            // One block's 16 weights of input k: (q − 8)·s + z, rounded to bf16.
            const auto widen = [&](__m512i v, __m512 s, __m512 z) {
              const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, shift), mask);
              return (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), eight), s, z));
            };
            const int64_t k = g * 32 + c * 8 + i;
            const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(widen(v0, s0, z0)), widen(v1, s1, z1), 1);
            _mm512_storeu_si512(op + k * O + ob * 16, line);
          }
        }
      }
  });
#endif
  return out;
}

// ---- int8 × int8 (VNNI) for wide int8 layers (the LM head under int4/int8) -------------------
// At one row the LM head is memory-bound and int8_linear reads it at memory speed; at 16 rows
// it is compute-bound, and widening every weight to fp32 for FMAs runs at ~36 GFMA/s on one
// thread here. `vpdpbusd` multiplies 64 int8 pairs an instruction, so the activations are
// quantised to int8 per group of 32 (llama.cpp's Q8 blocks; measured on SmolLM2's
// head: perplexity 7.906 → 7.901, mean |Δlogit| 0.04, the same argmax at every position) and
// the weights are repacked once after loading: [O/16, K/4, 64] bytes, lane l of a 64-byte row
// holding w[16·ob + l][4·q .. 4·q + 3] + 128 (vpdpbusd takes one unsigned operand).
//   y[m, o] = s[o] · (Σ_g dx[m, g] · Σ_{k∈g} (w[o, k] + 128) · xq[m, k] − 128 · Σ_g dx[m, g] Σ_{k∈g} xq[m, k])
// Where weight w[row][k] sits in the packed int8 layout (Q = K / 4 quads a row block).
inline int64_t int8_vnni_at(int64_t Q, int64_t row, int64_t k) {
  return ((row / 16) * Q + k / 4) * 64 + (row % 16) * 4 + k % 4;
}

at::Tensor int8_vnni_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar,
              "int8_vnni_pack: int8 [O, K] expected");
  const int64_t O = w.size(0), K = w.size(1);
  TORCH_CHECK(O % 16 == 0 && K % 32 == 0, "int8_vnni_pack: O % 16 and K % 32");
  auto packed = at::empty({O / 16, K / 4, 64}, w.options().dtype(at::kByte));
  const int8_t* wp = w.data_ptr<int8_t>();
  uint8_t* pp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, O, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row)
      for (int64_t k = 0; k < K; ++k)
        pp[int8_vnni_at(K / 4, row, k)] = static_cast<uint8_t>(static_cast<int>(wp[row * K + k]) + 128);
  });
  return packed;
}

// The packed weight back as its integer values, transposed: [K, O] bf16 (exact), for a dense
// GEMM when many rows are multiplied (the caller scales by s after it, as without packing).
at::Tensor int8_vnni_dequantize_t(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.scalar_type() == at::kByte,
              "int8_vnni_dequantize_t: packed [O/16, K/4, 64] expected");
  const int64_t OB = packed.size(0), K = packed.size(1) * 4, O = OB * 16;
  auto out = at::empty({K, O}, packed.options().dtype(at::kBFloat16));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  // A 64-byte run (16 outputs × 4 inputs) → 4 rows of 16 outputs: byte i of each dword is
  // input i's (a prefill of the narrow int8 layers widens them each call: SmolLM2's 960 × 576
  // one code at a time took ~0.5 ms, as long as the GEMM it feeds).
  at::parallel_for(0, K / 4, 4, [&](int64_t q0, int64_t q1) {
    const __m512i low = _mm512_set1_epi32(0xFF), bias = _mm512_set1_epi32(128);
    for (int64_t q = q0; q < q1; ++q)
      for (int64_t ob = 0; ob < OB; ++ob) {
        const __m512i v = _mm512_loadu_si512(pp + (ob * (K / 4) + q) * 64);
        for (int i = 0; i < 4; ++i) {
          const __m512i w = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i), low), bias);
          _mm256_storeu_si256((__m256i*)(op + (q * 4 + i) * O + ob * 16),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_cvtepi32_ps(w)));
        }
      }
  });
  return out;
#endif
  at::parallel_for(0, K, 4, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t row = 0; row < O; ++row)
        op[k * O + row] = c10::BFloat16(static_cast<float>(static_cast<int>(pp[int8_vnni_at(K / 4, row, k)]) - 128));
  });
  return out;
}

// Rows of the packed weight as values, (w · s[row]) in `dtype`: the embedding lookup of a model
// whose embedding is tied to this (LM head) weight reads it here instead of keeping a float copy.
at::Tensor int8_vnni_rows(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& ids,
                          at::ScalarType dtype) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.scalar_type() == at::kByte,
              "int8_vnni_rows: packed [O/16, K/4, 64] expected");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "int8_vnni_rows: int64 ids [T]");
  const int64_t OB = packed.size(0), Q = packed.size(1), K = Q * 4, O = OB * 16, T = ids.size(0);
  TORCH_CHECK(scales.numel() == O, "int8_vnni_rows: one scale per row");
  const at::Tensor idc = ids.contiguous();
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  auto out = at::empty({T, K}, packed.options().dtype(dtype));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const float* sp = sf.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < O, "int8_vnni_rows: id out of range");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "int8_vnni_rows", [&] {
    auto* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = ip[t];
        for (int64_t k = 0; k < K; ++k)
          op[t * K + k] = from_f32<scalar_t>(
              static_cast<float>(static_cast<int>(pp[int8_vnni_at(Q, row, k)]) - 128) * sp[row]);
      }
    });
  });
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// 16 outputs (one packed block) for M rows: out[m][16] = Σ_g dx[m, g] · Σ_{k∈g} (w + 128) · xq.
template <int M>
inline void vnni8_block(const uint8_t* wb, int64_t K, const int8_t* xq, const float* dx, float* out) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t G = K / 32;
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    for (int64_t q = 0; q < 8; ++q) {  // 8 quads of inputs in a group
      const __m512i wv = _mm512_loadu_si512(wb + (g * 8 + q) * 64);
      for (int m = 0; m < M; ++m) {
        int32_t xv;
        std::memcpy(&xv, xq + m * K + g * 32 + q * 4, 4);
        dot[m] = _mm512_dpbusd_epi32(dot[m], wv, _mm512_set1_epi32(xv));
      }
    }
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(dx[m * G + g]), acc[m]);
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * 16, acc[m]);
}
#endif

// x [M, K] (fp32 or bf16) × the packed weight, scales [O] → [M, O] in x's dtype; fp32_out:
// in fp32, each value rounded to x's dtype first — `.float()` of the x-dtype result, without
// writing that result and reading it back (the LM head: logits are sampled in fp32, and a
// widened copy of 16 rows of a 49k vocabulary cost ~0.15-0.3 ms of a step in the engine, with
// no page faults: 3 MB written to memory outside the caches).
at::Tensor int8_vnni_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                            bool fp32_out) {
  TORCH_CHECK(int8_vnni_supported(), "int8_vnni_linear: this build has no AVX512-VNNI/BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int8_vnni_linear: contiguous [M, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_vnni_linear: fp32 or bf16 activations");
  const int64_t M = x.size(0), K = x.size(1), OB = packed.size(0), O = OB * 16, G = K / 32;
  TORCH_CHECK(packed.size(1) * 4 == K && scales.numel() == O, "int8_vnni_linear: shape mismatch");
  auto out = at::empty({M, O}, x.options().dtype(fp32_out ? at::kFloat : x.scalar_type()));
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  QuantizedRows xq(x);
  std::vector<float> corr(M, 0.f);  // the +128 of the weights, per row: 128 · Σ_g dx Σ xq
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      int32_t sum = 0;
      for (int64_t k = 0; k < 32; ++k) sum += xq.row_q(m)[g * 32 + k];
      corr[m] += xq.row_d(m)[g] * 128.f * static_cast<float>(sum);
    }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = sf.data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto run = [&](auto* op) {
    for_output_blocks(
        M, OB, 16,
        [&](int64_t ob, int64_t m0, auto rows, float* tile) {
          vnni8_block<decltype(rows)::value>(pp + ob * (K / 4) * 64, K, xq.row_q(m0), xq.row_d(m0), tile);
        },
        [&](int64_t m, int64_t ob, const float* t) {
          const __m512 v = _mm512_sub_ps(_mm512_loadu_ps(t), _mm512_set1_ps(corr[m]));
          const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(sp + ob * 16), v);
          if constexpr (std::is_same_v<decltype(op), float*>) {
            store16(op + m * O + ob * 16, fp32_out && bf16 ? to_bf16_and_back(y) : y);
          } else {
            store16(op + m * O + ob * 16, y);
          }
        });
  };
  if (fp32_out || !bf16) {
    run(out.data_ptr<float>());
  } else {
    run(out.data_ptr<c10::BFloat16>());
  }
#endif
  return out;
}

// ---- int8 weights × int16 activations in the same layout (AVX-512): the other int8 layers ----
// The int8 layers that are not an LM head (the Q5_0/Q6_K/Q8_0 parts of a Q4_K_M file, every
// layer under --quantization int8) met torch's packed kernel, whose time grows with the rows,
// or from 16 rows a widening of the weight to bf16 on every call: 16 streams of SmolLM2's
// Q4_K_M spent ~75% of a 27 ms step there. Here the weight, packed once by int8_vnni_pack,
// is read once per chunk of rows, and `vpdpwssd` multiplies 32 (weight, activation) int16
// pairs an instruction into exact int32 sums. The activations are rounded to int16 per group
// of 32 (d = max|x| / 32767: an error of at most 2^-16 of the group's largest value, ~250×
// finer than their own bf16 rounding; the AVX2 int4 kernel's arithmetic, not the int8
// activations that cost perplexity). A packed dword holds w + 128 of inputs k..k+3 of one
// output; its bytes 0 and 2 (1 and 3), as int16 words, are the pair (k, k+2) ((k+1, k+3)),
// met by the activations laid out in that pair order once per call. Per group g, in int32:
//   Σ_{k∈g} w[o,k] xq[m,k] = Σ_{k∈g} (w[o,k] + 128) xq[m,k] − 128 Σ_{k∈g} xq[m,k]
// (at most 32 · 255 · 32767 < 2^31), then y[m, o] = s[o] · Σ_g d[m, g] · that. A row's
// arithmetic does not depend on the other rows of the call (batch invariance).
#if DSINFER_AVX512_VNNI_BF16 || DSINFER_AVX2_QUANT
// Every row's activations rounded per group of 32 by round_to_int (the AVX2 int4 kernel's
// values), laid out in the weights' pair order: per quad of inputs k..k+3 the dwords
// (k, k+2), (k+1, k+3); and per group the scale d and the offset 128 · Σ xq.
struct I16GroupPairs {
  int64_t K, G;
  std::unique_ptr<int32_t[]> pairs;   // [M, K / 2]
  std::unique_ptr<float[]> scale;     // [M, G]: d
  std::unique_ptr<int32_t[]> offset;  // [M, G]: 128 · Σ xq (the weights' +128)

  explicit I16GroupPairs(const at::Tensor& x)
      : K(x.size(1)), G(x.size(1) / 32), pairs(new int32_t[x.size(0) * x.size(1) / 2]),
        scale(new float[x.size(0) * G]), offset(new int32_t[x.size(0) * G]) {
    for_int16_groups(x, [&](int64_t m, int64_t g, float d, const int16_t* q, int32_t total) {
      scale[m * G + g] = d;
      offset[m * G + g] = 128 * total;
      int32_t* out = pairs.get() + (m * K + g * 32) / 2;
      for (int c = 0; c < 8; ++c) {
        out[c * 2] = int16_pair(q[c * 4], q[c * 4 + 2]);
        out[c * 2 + 1] = int16_pair(q[c * 4 + 1], q[c * 4 + 3]);
      }
    });
  }
  const int32_t* row(int64_t m) const { return pairs.get() + m * (K / 2); }
};
#endif

#if DSINFER_AVX512_VNNI_BF16
// 16 outputs (one packed block) for M rows: out[m][16] = Σ_g d[m, g] · Σ_{k∈g} w · xq.
template <int M>
inline void vnni16_block(const uint8_t* wb, int64_t K, const I16GroupPairs& x, int64_t m0, float* out) {
  const __m512i low = _mm512_set1_epi16(0x00FF);
  const int64_t G = K / 32;
  const int32_t* xr[M];
  for (int m = 0; m < M; ++m) xr[m] = x.row(m0 + m);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    // The sums start at −128 Σ xq. One chain a row: with several rows the chains interleave
    // (16 rows of 3072 × 576: 146 → 189 GMAC/s against a chain for each pair order); one row
    // keeps two, so that it does not wait on each dpwssd. Integer sums: the order changes
    // nothing, the result is the same for every row count.
    constexpr int C = M == 1 ? 2 : 1;
    __m512i dot[M][C];
    for (int m = 0; m < M; ++m) {
      dot[m][0] = _mm512_set1_epi32(-x.offset[(m0 + m) * G + g]);
      if constexpr (C == 2) dot[m][C - 1] = _mm512_setzero_si512();
    }
    for (int64_t q = 0; q < 8; ++q) {  // 8 quads of inputs in a group
      const __m512i wv = _mm512_loadu_si512(wb + (g * 8 + q) * 64);
      const __m512i we = _mm512_and_si512(wv, low), wo = _mm512_srli_epi16(wv, 8);
      for (int m = 0; m < M; ++m) {
        const int32_t* xp = xr[m] + (g * 8 + q) * 2;
        dot[m][0] = _mm512_dpwssd_epi32(dot[m][0], we, _mm512_set1_epi32(xp[0]));
        dot[m][C - 1] = _mm512_dpwssd_epi32(dot[m][C - 1], wo, _mm512_set1_epi32(xp[1]));
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512i sum = C == 2 ? _mm512_add_epi32(dot[m][0], dot[m][C - 1]) : dot[m][0];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(x.scale[(m0 + m) * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * 16, acc[m]);
}
#elif DSINFER_AVX2_QUANT
// The same arithmetic on 8 lanes (AVX2 has `vpmaddwd`: 16 int16 products an instruction into
// 8 int32 sums); each 64-byte chunk of the packed weight read as two halves of 8 outputs, as
// the AVX2 int4 kernel reads its codes.
template <int M>
inline void vnni16_block(const uint8_t* wb, int64_t K, const I16GroupPairs& x, int64_t m0, float* out) {
  const __m256i low = _mm256_set1_epi16(0x00FF);
  const int64_t G = K / 32;
  for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7: bytes 32h .. 32h + 31 of each chunk
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __v8si dot[M];  // GCC vector types and `+=`, as i16_block (registers, not the stack)
      for (int m = 0; m < M; ++m) dot[m] = (__v8si)_mm256_set1_epi32(-x.offset[(m0 + m) * G + g]);
      for (int64_t q = 0; q < 8; ++q) {
        const __m256i wv = _mm256_loadu_si256((const __m256i*)(wb + (g * 8 + q) * 64 + h * 32));
        const __m256i we = _mm256_and_si256(wv, low), wo = _mm256_srli_epi16(wv, 8);
        for (int m = 0; m < M; ++m) {
          const int32_t* xp = x.row(m0 + m) + (g * 8 + q) * 2;
          dot[m] += (__v8si)_mm256_madd_epi16(we, _mm256_set1_epi32(xp[0]));
          dot[m] += (__v8si)_mm256_madd_epi16(wo, _mm256_set1_epi32(xp[1]));
        }
      }
      for (int m = 0; m < M; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps((__m256i)dot[m]), _mm256_set1_ps(x.scale[(m0 + m) * G + g]),
                                 acc[m]);
    }
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * 16 + h * 8, acc[m]);
  }
}
#endif

// Whether int8_vnni_i16_linear runs here: its AVX-512 or its AVX2 arithmetic.
bool int8_vnni_i16_supported() { return DSINFER_AVX512_VNNI_BF16 || DSINFER_AVX2_QUANT; }

// x [M, K] (fp32 or bf16) × the packed int8 weight (int8_vnni_pack), scales [O] → [M, O] in x's
// dtype, the activations rounded to int16 per group of 32 (above).
at::Tensor int8_vnni_i16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(int8_vnni_i16_supported(), "int8_vnni_i16_linear: this build has neither AVX512-VNNI/BF16 nor AVX2/FMA");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int8_vnni_i16_linear: contiguous [M, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8_vnni_i16_linear: fp32 or bf16 activations");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 64 && packed.scalar_type() == at::kByte,
              "int8_vnni_i16_linear: packed [O/16, K/4, 64] expected");
  const int64_t M = x.size(0), K = x.size(1), OB = packed.size(0), O = OB * 16;
  TORCH_CHECK(packed.size(1) * 4 == K && K % 32 == 0 && scales.numel() == O, "int8_vnni_i16_linear: shape mismatch");
  auto out = at::empty({M, O}, x.options());
#if DSINFER_AVX512_VNNI_BF16 || DSINFER_AVX2_QUANT
  // Rows a chunk: as many as the registers hold accumulators for (32 zmm / 16 ymm).
  constexpr int kChunk = DSINFER_AVX512_VNNI_BF16 ? 8 : 4;
  const at::Tensor sf = scales.to(at::kFloat).contiguous();
  const I16GroupPairs xq(x);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = sf.data_ptr<float>();
  const auto run = [&](auto* op) {
    for_output_blocks<kChunk>(
        M, OB, 4,
        [&](int64_t ob, int64_t m0, auto rows, float* tile) {
          vnni16_block<decltype(rows)::value>(pp + ob * (K / 4) * 64, K, xq, m0, tile);
        },
        [&](int64_t m, int64_t ob, const float* t) {
          float y[16];
          for (int l = 0; l < 16; ++l) y[l] = sp[ob * 16 + l] * t[l];
          store_row16(op + m * O + ob * 16, y);
        });
  };
  if (x.scalar_type() == at::kBFloat16) run(out.data_ptr<c10::BFloat16>());
  else run(out.data_ptr<float>());
#endif
  return out;
}

// ---- GGUF blocks → int4 groups of 32, at load (models/gguf_int4.py) -------------------------
// The direct 4-bit GGUF load turns a file's blocks into int4 codes, scales and zeros, per
// group of 32: the 4-bit types as they are (Q4_0 x = d·(q − 8); Q4_1 x = d·q + m; Q4_K's super-
// blocks of 8 groups, scale d·sc and minimum −dmin·mn), and a Q4_K_M file's 5- and 8-bit
// expert stacks (Q5_0, Q8_0) decoded and quantised to int4 as `int4_codes` does (min/max per
// group, step (max − min) / 15). In torch these were ~10 passes over GBs of temporaries
// (DeepSeek-V2-Lite: ~29 s of a ~45 s pack); here one pass over the blocks, a row a task. The
// arithmetic is the torch path's, operation for operation in fp32 (gguf_file.q4_codes,
// quant.int4_codes): the same bits (tests/models/test_gguf_kquants.py).
enum GgufBlockType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ4_K = 2, kQ5_0 = 3, kQ8_0 = 4 };

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// One group of 32 values → int4 codes, scale and zero as quant.int4_codes computes them.
inline void int4_group(const float* v, uint8_t* q, float* scale, float* zero) {
  float lo = v[0], hi = v[0];
  for (int i = 1; i < 32; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  const float s = std::max((hi - lo) / 15.0f, 1e-12f);
  for (int i = 0; i < 32; ++i) {
    const float r = std::nearbyint((v[i] - lo) / s);  // to nearest even, as torch.round
    q[i] = static_cast<uint8_t>(std::min(15.f, std::max(0.f, r)));
  }
  *scale = s;
  *zero = lo + 8.0f * s;
}

static constexpr int64_t kGgufBlockBytes[] = {18, 20, 144, 22, 34};
static constexpr int64_t kGgufBlockValues[] = {32, 32, 256, 32, 32};

// The bytes of one row of K values in `type`'s blocks, after checking the type and K.
int64_t gguf_row_bytes(const char* op, int64_t type, int64_t K) {
  TORCH_CHECK(type >= kQ4_0 && type <= kQ8_0, op, ": unknown block type ", type);
  TORCH_CHECK(K % 32 == 0 && (type != kQ4_K || K % 256 == 0), op, ": whole blocks a row");
  return K / kGgufBlockValues[type] * kGgufBlockBytes[type];
}

// One row of blocks → its K codes and K / 32 scales and zeros.
void gguf_row_groups(const uint8_t* row, int64_t type, int64_t K, uint8_t* q, float* sc, float* zr) {
  const int64_t G = K / 32;
  if (type == kQ4_K) {
    for (int64_t b = 0; b < K / 256; ++b) {
      const uint8_t* blk = row + b * 144;
      const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
      const uint8_t *lo_sc = blk + 4, *lo_mn = blk + 8, *high = blk + 12, *qs = blk + 16;
      for (int j = 0; j < 8; ++j) {
        const int s6 = j < 4 ? lo_sc[j] & 63 : (high[j - 4] & 15) | ((lo_sc[j - 4] >> 6) << 4);
        const int m6 = j < 4 ? lo_mn[j] & 63 : (high[j - 4] >> 4) | ((lo_mn[j - 4] >> 6) << 4);
        const float step = d * static_cast<float>(s6), minimum = -(dmin * static_cast<float>(m6));
        const uint8_t* src = qs + (j / 2) * 32;  // group 2c in the low nibbles, 2c + 1 high
        uint8_t* dst = q + b * 256 + j * 32;
        for (int i = 0; i < 32; ++i) dst[i] = j % 2 ? src[i] >> 4 : src[i] & 15;
        sc[b * 8 + j] = step;
        zr[b * 8 + j] = minimum + 8.0f * step;
      }
    }
    return;
  }
  float v[32];
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = row + g * kGgufBlockBytes[type];
    const float d = fp16_at(blk);
    uint8_t* dst = q + g * 32;
    if (type == kQ4_0 || type == kQ4_1) {
      const uint8_t* src = blk + (type == kQ4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        dst[i] = src[i] & 15;
        dst[i + 16] = src[i] >> 4;
      }
      sc[g] = d;
      zr[g] = type == kQ4_1 ? fp16_at(blk + 2) + 8.0f * d : 0.f;
      continue;
    }
    if (type == kQ8_0) {
      for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(static_cast<int8_t>(blk[2 + i])) * d;
    } else {  // Q5_0: bit i of the little-endian u32 at 2 is weight i's fifth bit; x = d·(q − 16)
      uint32_t hb;
      std::memcpy(&hb, blk + 2, 4);
      for (int i = 0; i < 16; ++i) {
        const int lo = blk[6 + i] & 15, hi = blk[6 + i] >> 4;
        const int b0 = static_cast<int>((hb >> i) & 1), b1 = static_cast<int>((hb >> (i + 16)) & 1);
        v[i] = static_cast<float>((lo | (b0 << 4)) - 16) * d;
        v[i + 16] = static_cast<float>((hi | (b1 << 4)) - 16) * d;
      }
    }
    int4_group(v, dst, sc + g, zr + g);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_int4_groups(const at::Tensor& raw, int64_t type, int64_t rows,
                                                                 int64_t K) {
  TORCH_CHECK(raw.dim() == 1 && raw.is_contiguous() && raw.scalar_type() == at::kByte,
              "gguf_int4_groups: the tensor's bytes, flat uint8");
  const int64_t row_bytes = gguf_row_bytes("gguf_int4_groups", type, K), G = K / 32;
  TORCH_CHECK(raw.numel() == rows * row_bytes, "gguf_int4_groups: ", raw.numel(), " bytes for ", rows,
              " rows of ", row_bytes);
  auto codes = at::empty({rows, K}, raw.options());
  auto scale = at::empty({rows, G}, raw.options().dtype(at::kFloat));
  auto zero = at::empty({rows, G}, raw.options().dtype(at::kFloat));
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  float* zp = zero.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gguf_row_groups(rp + r * row_bytes, type, K, cp + r * K, sp + r * G, zp + r * G);
  });
  return {codes, scale, zero};
}

// The same groups written straight into the fused int4 kernels' layout (int4_vnni_pack's):
// codes [rows/16, K/8, 64] into `codes` and scale | zero [rows/16, G, 2, 16] bf16 into `sz`,
// both contiguous (an expert's rows of a stack: the gate's, then the up's). The values of
// gguf_int4_groups → int4pack_from_codes → int4_pairs → int4_vnni_pack, bit for bit, in one
// pass without their temporaries (DeepSeek-V2-Lite's expert stacks: ~35 s of a ~75 s start
// under cProfile, session 36).
void gguf_int4_vnni_into(const at::Tensor& raw, int64_t type, int64_t rows, int64_t K, at::Tensor codes,
                         at::Tensor sz) {
  TORCH_CHECK(raw.dim() == 1 && raw.is_contiguous() && raw.scalar_type() == at::kByte,
              "gguf_int4_vnni_into: the tensor's bytes, flat uint8");
  const int64_t row_bytes = gguf_row_bytes("gguf_int4_vnni_into", type, K), G = K / 32;
  TORCH_CHECK(rows % 16 == 0 && raw.numel() == rows * row_bytes, "gguf_int4_vnni_into: ", raw.numel(),
              " bytes for ", rows, " rows (a multiple of 16) of ", row_bytes);
  check_vnni_outputs("gguf_int4_vnni_into", codes, sz, rows, K);
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  c10::BFloat16* szp = sz.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows / 16, 1, [&](int64_t ob0, int64_t ob1) {
    std::vector<uint8_t> q(16 * K);  // 16 rows' codes [l][k], then packed (vnni_chunk)
    std::vector<float> sc(16 * G), zr(16 * G);
    for (int64_t ob = ob0; ob < ob1; ++ob) {
      for (int64_t l = 0; l < 16; ++l)
        gguf_row_groups(rp + (ob * 16 + l) * row_bytes, type, K, &q[l * K], &sc[l * G], &zr[l * G]);
      uint8_t* d = cp + ob * (K / 8) * 64;
      for (int64_t kc = 0; kc < K / 8; ++kc)
        vnni_chunk(d + kc * 64, [&](int64_t l, int64_t t) { return q[l * K + kc * 8 + t]; });
      c10::BFloat16* s = szp + ob * G * 32;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t l = 0; l < 16; ++l) {
          s[g * 32 + l] = c10::BFloat16(sc[l * G + g]);
          s[g * 32 + 16 + l] = c10::BFloat16(zr[l * G + g]);
        }
    }
  });
}

// Constrained decoding: logits[r, t] = -inf where bit t % 32 of word t / 32 of bitmask[r] is
// clear (xgrammar's layout). In place. Words with every bit set (all allowed: most of a JSON
// string's vocabulary) are skipped, so a step costs ~V/32 word reads per row.
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "expected contiguous fp32 [rows, vocab] logits");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.scalar_type() == at::kInt && bitmask.size(0) == logits.size(0) &&
                  bitmask.size(1) * 32 >= logits.size(1),
              "expected an int32 [rows, ceil(vocab / 32)] bitmask");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  float* lp = logits.data_ptr<float>();
  const auto* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      float* row = lp + r * vocab;
      const uint32_t* bits = bp + r * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, vocab - base);
        for (int64_t j = 0; j < n; ++j) {
          if (!((word >> j) & 1u)) row[base + j] = ninf;
        }
      }
    }
  });
}

}  // namespace

// The sampling ops (softmax_top_candidates, sample_full_rows) and their shared passes.

// The max of a row of logits, and whether it holds a NaN (max_ps drops NaNs, and exp's clamps
// would make them finite): the sampling ops' first pass.
inline float row_max(const float* l, int64_t V, bool& nan) {
  float lmax = -std::numeric_limits<float>::infinity();
  nan = false;
  int64_t v = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(lmax);
  __mmask16 unordered = 0;
  for (; v + 16 <= V; v += 16) {
    const __m512 x = _mm512_loadu_ps(l + v);
    unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, x);
  }
  lmax = _mm512_reduce_max_ps(mv);
  nan = unordered != 0;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 mv = _mm256_set1_ps(lmax), unordered = _mm256_setzero_ps();
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(l + v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    mv = _mm256_max_ps(mv, x);
  }
  lmax = hmax8(mv);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; v < V; ++v) {
    nan |= std::isnan(l[v]);
    lmax = std::max(lmax, l[v]);
  }
  return lmax;
}

// exp(y) for y = logit / t − max ≤ 0, and exactly 0 for a removed token (y = -inf), where
// exp_f32 and exp16 would clamp it to ~1e-38.
inline float token_weight(float y) { return y == -std::numeric_limits<float>::infinity() ? 0.f : exp_f32(y); }
#if defined(__AVX512F__)
inline __m512 token_weight16(__m512 y) {
  const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
  return _mm512_maskz_mov_ps(live, exp16(y));
}
#elif defined(__AVX2__) && defined(__FMA__)
// token_weight of N vectors in place, their exps interleaved (exp8n's reason). The AVX2 loops
// over the vocabulary below ran one element at a time until session 23.
template <int N>
inline void token_weights8(__m256* y) {
  __m256 live[N];
  for (int j = 0; j < N; ++j)
    live[j] = _mm256_cmp_ps(y[j], _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
  exp8n<N>(y);
  for (int j = 0; j < N; ++j) y[j] = _mm256_and_ps(live[j], y[j]);
}
#endif

// (ys[i], v + i) for each set bit i of `hit`: a vector's tokens above the cut, as candidates.
inline void collect_hits(const float* ys, uint32_t hit, int64_t v, std::vector<std::pair<float, int64_t>>& cand) {
  for (; hit; hit &= hit - 1) {
    const int i = __builtin_ctz(hit);
    cand.emplace_back(ys[i], v + i);
  }
}

namespace {
constexpr int kDrawBins = 256;
constexpr float kDrawBinsPerUnit = 8.f;
}  // namespace

// Greedy sampling: each row's argmax, as torch.argmax gives it (the first index of the
// largest value; a row holding NaN: its first NaN). torch's reduction took ~250 µs for 16 rows
// of SmolLM2's 49k vocabulary, ~2% of a 16-row decode step; this is one vectorised pass a row
// (lane-wise running maxima and their indices, then the lanes merged).
//   logits [B, V] fp32 -> [B] int64.
int64_t argmax_row(const float* row, int64_t V) {
  int64_t t = 0, best_i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  if (V >= 16) {
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i top_i = _mm512_setzero_si512();  // a lane that never rises keeps index 0: only
                                             // chosen when the whole row is -inf, like torch
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; t + 16 <= V; t += 16) {
      const __m512 v = _mm512_loadu_ps(row + t);
      const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      if (nan) return t + __builtin_ctz(nan);
      const __mmask16 up = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);  // strictly: the first stays
      top = _mm512_mask_mov_ps(top, up, v);
      top_i = _mm512_mask_mov_epi32(top_i, up, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    best = _mm512_reduce_max_ps(top);
    const __mmask16 at = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_i = _mm512_mask_reduce_min_epi32(at, top_i);  // the first index among the lanes' maxima
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // The same on 8 lanes (one element at a time until session 23: ~35 µs a row of 49k).
  if (V >= 8) {
    __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i top_i = _mm256_setzero_si256();  // as above: index 0 when the whole row is -inf
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; t + 8 <= V; t += 8) {
      const __m256 v = _mm256_loadu_ps(row + t);
      const int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      if (nan) return t + __builtin_ctz(nan);
      const __m256 up = _mm256_cmp_ps(v, top, _CMP_GT_OQ);  // strictly: the first stays
      top = _mm256_blendv_ps(top, v, up);
      top_i = _mm256_blendv_epi8(top_i, idx, _mm256_castps_si256(up));
      idx = _mm256_add_epi32(idx, step);
    }
    alignas(32) float tv[8];
    alignas(32) int32_t ti[8];
    _mm256_store_ps(tv, top);
    _mm256_store_si256((__m256i*)ti, top_i);
    best = *std::max_element(tv, tv + 8);
    best_i = std::numeric_limits<int32_t>::max();
    for (int k = 0; k < 8; ++k)  // the first index among the lanes' maxima
      if (tv[k] == best) best_i = std::min<int64_t>(best_i, ti[k]);
  }
#endif
  for (; t < V; ++t) {
    if (std::isnan(row[t])) return t;
    if (row[t] > best) best = row[t], best_i = t;
  }
  return best_i;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "argmax_rows: contiguous fp32 [rows, vocab] expected");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V <= std::numeric_limits<int32_t>::max(), "argmax_rows: bad vocabulary size");
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = argmax_row(lp + b * V, V);
  });
  return out;
}

// Sampling: the n most probable tokens of each row of softmax(logits / temperature), in falling
// order, with their probabilities — what torch.topk(torch.softmax(logits / t), n) gives, in one
// pass of arithmetic over the vocabulary instead of a division, a softmax and a top-k (2.6 ms
// for 16 rows of SmolLM2's 49k vocabulary, ~10% of a sampled decode step). Per row:
//   1. m = max(logits) / t (division is monotone, so this is the max of the quotients);
//   2. one pass: y = logits / t − m, the sum of exp(y), and a histogram of −y in bins of 1/8
//      (the last bin takes everything from 31.875 down);
//   3. the tokens in the bins up to the one where the count reaches n are the only ones that
//      can be among the top n: collected, sorted (ties by token id), the first n kept.
// A row whose max or sum is not finite (NaN logits, every token removed) gets NaN
// probabilities: the caller draws it on its own path.
//   logits [B, V] fp32, temperature [B] fp32 (> 0) -> probs [B, n] fp32, ids [B, n] int64.
std::tuple<at::Tensor, at::Tensor> softmax_top_candidates(const at::Tensor& logits, const at::Tensor& temperature,
                                                          int64_t n) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "softmax_top_candidates: contiguous fp32 [rows, vocab] logits expected");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == logits.size(0) &&
                  temperature.scalar_type() == at::kFloat && temperature.is_contiguous(),
              "softmax_top_candidates: one fp32 temperature per row");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(n >= 1 && n <= V, "softmax_top_candidates: 1 <= n <= vocab");
  auto probs = at::empty({B, n}, logits.options());
  auto ids = at::empty({B, n}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<std::pair<float, int64_t>> cand;  // the scratch rule
    cand.clear();
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = lp + r * V;
      const float t = tp[r];
      float* po = pp + r * n;
      int64_t* io = ip + r * n;
      bool nan;
      const float m = row_max(l, V, nan) / t;
      // Four histograms, token v into h[v % 4]: one shared counter would chain every
      // increment of the (crowded) last bin on the one before.
      int32_t hist[4][kDrawBins] = {};
      float sum = 0.f;
      int64_t v = 0;
#if defined(__AVX512F__)
      {
        const __m512 tv = _mm512_set1_ps(t), mm = _mm512_set1_ps(m);
        const __m512 per = _mm512_set1_ps(kDrawBinsPerUnit), top = _mm512_set1_ps(kDrawBins - 1);
        __m512 acc = _mm512_setzero_ps();
        alignas(64) int32_t bins[16];
        for (; v + 16 <= V; v += 16) {
          const __m512 y = _mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(l + v), tv), mm);
          acc = _mm512_add_ps(acc, token_weight16(y));
          // −y ≥ 0; NaN and +inf end up in the last bin (min returns its second operand).
          const __m512 b = _mm512_min_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), y), per), top);
          _mm512_store_si512(bins, _mm512_cvttps_epi32(b));
          for (int i = 0; i < 16; ++i) ++hist[i & 3][bins[i]];
        }
        sum = _mm512_reduce_add_ps(acc);
      }
#elif defined(__AVX2__) && defined(__FMA__)
      {
        const __m256 tv = _mm256_set1_ps(t), mm = _mm256_set1_ps(m);
        const __m256 per = _mm256_set1_ps(kDrawBinsPerUnit), top = _mm256_set1_ps(kDrawBins - 1);
        __m256 acc = _mm256_setzero_ps();
        alignas(32) int32_t bins[32];
        for (; v + 32 <= V; v += 32) {
          __m256 y[4], w[4];
          for (int j = 0; j < 4; ++j) w[j] = y[j] = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(l + v + 8 * j), tv), mm);
          token_weights8<4>(w);
          for (int j = 0; j < 4; ++j) {
            acc = _mm256_add_ps(acc, w[j]);
            // −y ≥ 0; NaN and +inf end up in the last bin (min returns its second operand).
            const __m256 b = _mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), y[j]), per), top);
            _mm256_store_si256((__m256i*)(bins + 8 * j), _mm256_cvttps_epi32(b));
          }
          for (int i = 0; i < 32; ++i) ++hist[i & 3][bins[i]];
        }
        sum = hsum8(acc);
      }
#endif
      for (; v < V; ++v) {
        const float y = l[v] / t - m;
        sum += token_weight(y);
        const float b = std::min(-y * kDrawBinsPerUnit, static_cast<float>(kDrawBins - 1));
        ++hist[v & 3][b >= 0.f ? static_cast<int>(b) : kDrawBins - 1];
      }
      if (nan || !std::isfinite(m) || !std::isfinite(sum) || !(sum > 0.f)) {
        std::fill(po, po + n, std::numeric_limits<float>::quiet_NaN());
        std::fill(io, io + n, 0);
        continue;
      }
      int last = 0;  // the first bin where the count of tokens so far reaches n
      for (int64_t count = 0; last < kDrawBins; ++last) {
        count += hist[0][last] + hist[1][last] + hist[2][last] + hist[3][last];
        if (count >= n) break;
      }
      const float cut = last >= kDrawBins - 1 ? -std::numeric_limits<float>::infinity()
                                              : -static_cast<float>(last + 1) / kDrawBinsPerUnit;
      cand.clear();
      v = 0;
#if defined(__AVX512F__)
      {
        const __m512 tv = _mm512_set1_ps(t), mm = _mm512_set1_ps(m), cv = _mm512_set1_ps(cut);
        alignas(64) float ys[16];
        for (; v + 16 <= V; v += 16) {
          const __m512 y = _mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(l + v), tv), mm);
          __mmask16 hit = _mm512_cmp_ps_mask(y, cv, _CMP_GT_OQ);
          if (last >= kDrawBins - 1) hit = 0xFFFF;
          if (!hit) continue;
          _mm512_store_ps(ys, y);
          collect_hits(ys, hit, v, cand);
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      {
        const __m256 tv = _mm256_set1_ps(t), mm = _mm256_set1_ps(m), cv = _mm256_set1_ps(cut);
        alignas(32) float ys[8];
        for (; v + 8 <= V; v += 8) {
          const __m256 y = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(l + v), tv), mm);
          int hit = _mm256_movemask_ps(_mm256_cmp_ps(y, cv, _CMP_GT_OQ));
          if (last >= kDrawBins - 1) hit = 0xFF;
          if (!hit) continue;
          _mm256_store_ps(ys, y);
          collect_hits(ys, hit, v, cand);
        }
      }
#endif
      for (; v < V; ++v) {
        const float y = l[v] / t - m;
        if (y > cut || last >= kDrawBins - 1) cand.emplace_back(y, v);
      }
      const auto first = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      std::partial_sort(cand.begin(), cand.begin() + n, cand.end(), first);
      const float inv = 1.f / sum;
      for (int64_t i = 0; i < n; ++i) {
        po[i] = token_weight(cand[i].first) * inv;
        io[i] = cand[i].second;
      }
    }
  });
  return {probs, ids};
}

// Sampling a whole row (no top-k, top-p or min-p: temperature alone, the OpenAI default): one
// token per row of softmax(logits / temperature) at the row's uniform u in [0, 1), by the
// inverse of its cumulative distribution, without materialising the probabilities (the torch
// path divides, takes a softmax and sums blocks: ~3.3 ms for 16 rows of 49k). Two levels, as
// token_draw.draw_tokens: fp64 sums of blocks of 256 tokens pick a block, then a scan inside
// it; only a token of nonzero probability can be picked. -1 for a row without a distribution
// (NaN logits, every token removed): the caller takes its argmax.
//   logits [B, V] fp32, temperature [B] fp32 (> 0), u [B] fp64 -> ids [B] int64.
at::Tensor sample_full_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "sample_full_rows: contiguous fp32 [rows, vocab] logits expected");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == B && temperature.scalar_type() == at::kFloat &&
                  temperature.is_contiguous(), "sample_full_rows: one fp32 temperature per row");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == B && u.scalar_type() == at::kDouble && u.is_contiguous(),
              "sample_full_rows: one fp64 uniform per row");
  constexpr int64_t kBlock = 256;
  auto ids = at::empty({B}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<double> blocks;  // the scratch rule
    blocks.assign((V + kBlock - 1) / kBlock, 0.0);
    float weights[kBlock];  // the chosen block's, computed once for its sum and its scan
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = lp + r * V;
      const float t = tp[r];
      bool nan;
      const float m = row_max(l, V, nan) / t;
      if (nan || !std::isfinite(m)) {
        ip[r] = -1;
        continue;
      }
      double total = 0.0;
      for (size_t b = 0; b < blocks.size(); ++b) {
        const int64_t v0 = b * kBlock, v1 = std::min(V, v0 + kBlock);
        float part = 0.f;
        int64_t v = v0;
#if defined(__AVX512F__)
        const __m512 tv = _mm512_set1_ps(t), mm = _mm512_set1_ps(m);
        __m512 acc = _mm512_setzero_ps();
        for (; v + 16 <= v1; v += 16)
          acc = _mm512_add_ps(acc, token_weight16(_mm512_sub_ps(_mm512_div_ps(_mm512_loadu_ps(l + v), tv), mm)));
        part = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 tv = _mm256_set1_ps(t), mm = _mm256_set1_ps(m);
        __m256 acc = _mm256_setzero_ps();
        const auto weights8 = [&]<int N>() {
          __m256 w[N];
          for (int j = 0; j < N; ++j) w[j] = _mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(l + v + 8 * j), tv), mm);
          token_weights8<N>(w);
          for (int j = 0; j < N; ++j) acc = _mm256_add_ps(acc, w[j]);
          v += 8 * N;
        };
        while (v + 32 <= v1) weights8.template operator()<4>();
        while (v + 8 <= v1) weights8.template operator()<1>();
        part = hsum8(acc);
#endif
        for (; v < v1; ++v) part += token_weight(l[v] / t - m);
        blocks[b] = part;
        total += part;
      }
      // The block: the first whose cumulative mass exceeds u · total (a block of no mass has
      // an empty interval); then inside it, the offset rescaled to the block's own fp64 sum.
      const double target = up[r] * total;
      size_t b = 0;
      double before = 0.0;
      while (b + 1 < blocks.size() && (blocks[b] == 0.0 || before + blocks[b] <= target)) before += blocks[b++];
      while (blocks[b] == 0.0 && b > 0) before -= blocks[--b];  // rounding ran past the last mass
      const int64_t v0 = b * kBlock, n = std::min(V, v0 + kBlock) - v0;
      double inner = 0.0;
      for (int64_t i = 0; i < n; ++i) inner += (weights[i] = token_weight(l[v0 + i] / t - m));
      const double offset = std::clamp((target - before) / blocks[b], 0.0, 1.0) * inner;
      int64_t pick = -1;
      double cum = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        if (weights[i] <= 0.f) continue;
        pick = v0 + i;  // the last token with mass so far: where an offset at the very end lands
        cum += weights[i];
        if (cum > offset) break;
      }
      ip[r] = pick;
    }
  });
  return ids;
}

// The candidate path of token_draw.draw_sampled for a batch of rows in one call (it was ~40
// small torch ops, ~0.4 ms a step at one stream and ~1.3 ms at 16 rows, more than the
// candidates' own C++ pass). Per row, candidates in falling probability (softmax_top_candidates):
//   1. q = the first top_k candidates, renormalised over them when top_k cuts the vocabulary;
//   2. the nucleus: a candidate whose predecessors' mass is below top_p (top_p 1: all);
//   3. the row is complete when its support ends inside the candidates (top_k ≤ n, or the
//      nucleus ended before the last one); else −1, and the caller tries more candidates;
//   4. min-p: q ≥ min_p · q[0];
//   5. the inverse of the kept candidates' cumulative distribution (fp64) at u · their mass:
//      the first candidate where it exceeds that (one of positive mass).
//   probs [R, n] fp32, top_k [R] int64 (vocab where none), top_p, min_p [R] fp32, u [R] fp64
//   in [0, 1) → [R] int64: the drawn candidate's slot, or −1.
at::Tensor draw_candidates(const at::Tensor& probs, const at::Tensor& top_k, const at::Tensor& top_p,
                           const at::Tensor& min_p, const at::Tensor& u, int64_t vocab) {
  TORCH_CHECK(probs.dim() == 2 && probs.is_contiguous() && probs.scalar_type() == at::kFloat,
              "draw_candidates: contiguous fp32 [rows, n] probabilities expected");
  const int64_t R = probs.size(0), n = probs.size(1);
  const auto check_row = [&](const at::Tensor& t, at::ScalarType type, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == R && t.scalar_type() == type && t.is_contiguous(),
                "draw_candidates: one ", what, " per row");
  };
  check_row(top_k, at::kLong, "int64 top_k");
  check_row(top_p, at::kFloat, "fp32 top_p");
  check_row(min_p, at::kFloat, "fp32 min_p");
  check_row(u, at::kDouble, "fp64 uniform");
  TORCH_CHECK(n >= 1, "draw_candidates: at least one candidate");
  auto out = at::empty({R}, top_k.options());
  const float* pp = probs.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* tp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<float> q;  // the scratch rule
    q.assign(n, 0.f);
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = pp + r * n;
      const int64_t k = std::min(kp[r], n);
      op[r] = -1;
      if (!std::isfinite(p[0])) continue;  // no distribution: the caller's full path
      float norm = 1.f;
      if (kp[r] < vocab) {
        norm = 0.f;
        for (int64_t j = 0; j < k; ++j) norm += p[j];
      }
      int64_t kept = 0;  // the support: candidates [0, kept)
      float before = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        q[j] = p[j] / norm;
        if (tp[r] < 1.f && !(before < tp[r])) break;
        before += q[j];
        kept = j + 1;
      }
      if (!(kp[r] <= n || kept < n)) continue;  // the support may go on past the candidates
      const float floor = mp[r] * q[0];
      double mass = 0.0;
      for (int64_t j = 0; j < kept; ++j)
        if (q[j] >= floor) mass += q[j];
      const double target = up[r] * mass;
      double cum = 0.0;
      for (int64_t j = 0; j < kept; ++j) {
        if (!(q[j] >= floor) || !(q[j] > 0.f)) continue;
        op[r] = j;  // the last candidate with mass so far: where a target at the very end lands
        cum += q[j];
        if (cum > target) break;
      }
    }
  });
  return out;
}

TORCH_LIBRARY(dsinfer, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("int4_dequantize_t(Tensor qweight, int group, Tensor scales_zeros) -> Tensor");
  m.def("int4_dense_supported() -> bool");
  m.def("int4_vnni_supported() -> bool");
  m.def("int8_vnni_supported() -> bool");
  m.def("int8_i16_supported() -> bool");
  m.def("int8_i16_linear(Tensor x, Tensor w, Tensor scales, bool fp32_out=False) -> Tensor");
  m.def("int4_vnni_pack(Tensor qweight, int group, Tensor scales_zeros, int block_rows=64) -> (Tensor, Tensor)");
  m.def("int4_vnni_pack_into(Tensor qweight, int group, Tensor scales_zeros, int block_rows, Tensor(a!) codes, Tensor(b!) sz) -> ()");
  m.def("int4_vnni_dequantize_t(Tensor codes, Tensor sz) -> Tensor");
  m.def("int4_bf16_linear(Tensor x, Tensor codes, Tensor sz) -> Tensor");
  m.def("int4_i8_linear(Tensor x, Tensor codes, Tensor sz) -> Tensor");
  m.def("int4_i8_supported() -> bool");
  m.def("int8_vnni_pack(Tensor w) -> Tensor");
  m.def("int8_vnni_linear(Tensor x, Tensor packed, Tensor scales, bool fp32_out=False) -> Tensor");
  m.def("int8_vnni_i16_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("int8_vnni_i16_supported() -> bool");
  m.def("gguf_int4_groups(Tensor raw, int type, int rows, int K) -> (Tensor, Tensor, Tensor)");
  m.def("gguf_int4_vnni_into(Tensor raw, int type, int rows, int K, Tensor(a!) codes, Tensor(b!) sz) -> ()");
  m.def("int8_vnni_dequantize_t(Tensor packed) -> Tensor");
  m.def("int8_vnni_rows(Tensor packed, Tensor scales, Tensor ids, ScalarType dtype) -> Tensor");
  m.def(
      "rope_decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor block_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, float scale) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.def("softmax_top_candidates(Tensor logits, Tensor temperature, int n) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("sample_full_rows(Tensor logits, Tensor temperature, Tensor u) -> Tensor");
  m.def("draw_candidates(Tensor probs, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u, int vocab) -> Tensor");
  m.def(
      "rope_write_prefill(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_blocks, Tensor slot_offsets, int num_heads, int num_kv_heads) -> Tensor");
  m.def(
      "mla_rope_decode(Tensor q, Tensor kv, Tensor c, Tensor cos, Tensor sin, Tensor(a!) cache, "
      "Tensor slot_blocks, Tensor slot_offsets, Tensor seq_lens, int nope) -> Tensor");
  m.def(
      "mla_decode_attention(Tensor q_lat, Tensor q_pe, Tensor cache, Tensor block_tables, "
      "Tensor seq_lens, float scale) -> Tensor");
  m.def("mla_projections_supported(int lora) -> bool");
  m.def("mla_absorb_query(Tensor q_nope, Tensor kv_b, int v_dim) -> Tensor");
  m.def("mla_expand_output(Tensor o_lat, Tensor kv_b, int nope) -> Tensor");
  m.def("mla_expand_latent(Tensor c, Tensor kv_b, int num_heads) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int ctx, "
      "float scale) -> Tensor");
  m.def("paged_prefill_supported(int head_dim, int group) -> bool");
}

TORCH_LIBRARY_IMPL(dsinfer, CatchAll, m) {
  m.impl("int4_dense_supported", &int4_dense_supported);
  m.impl("int4_vnni_supported", &int4_vnni_supported);
  m.impl("int8_vnni_supported", &int8_vnni_supported);
  m.impl("int8_i16_supported", &int8_i16_supported);
  m.impl("int8_vnni_i16_supported", &int8_vnni_i16_supported);
  m.impl("int4_i8_supported", &int4_i8_supported);
  m.impl("paged_prefill_supported", &paged_prefill_supported);
  m.impl("mla_projections_supported", &mla_projections_supported);
}

TORCH_LIBRARY_IMPL(dsinfer, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_dequantize_t", &int4_dequantize_t);
  m.impl("rope_decode_attention", &rope_decode_attention);
  m.impl("rope_write_prefill", &rope_write_prefill);
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
  m.impl("softmax_top_candidates", &softmax_top_candidates);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_full_rows", &sample_full_rows);
  m.impl("draw_candidates", &draw_candidates);
  m.impl("mla_rope_decode", &mla_rope_decode);
  m.impl("mla_decode_attention", &mla_decode_attention);
  m.impl("mla_absorb_query", &mla_absorb_query);
  m.impl("mla_expand_output", &mla_expand_output);
  m.impl("mla_expand_latent", &mla_expand_latent);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("int4_vnni_pack", &int4_vnni_pack);
  m.impl("int4_vnni_pack_into", &int4_vnni_pack_into);
  m.impl("int4_vnni_dequantize_t", &int4_vnni_dequantize_t);
  m.impl("int4_bf16_linear", &int4_bf16_linear);
  m.impl("int4_i8_linear", &int4_i8_linear);
  m.impl("int8_vnni_pack", &int8_vnni_pack);
  m.impl("int8_vnni_linear", &int8_vnni_linear);
  m.impl("int8_i16_linear", &int8_i16_linear);
  m.impl("int8_vnni_i16_linear", &int8_vnni_i16_linear);
  m.impl("gguf_int4_groups", &gguf_int4_groups);
  m.impl("gguf_int4_vnni_into", &gguf_int4_vnni_into);
  m.impl("int8_vnni_dequantize_t", &int8_vnni_dequantize_t);
  m.impl("int8_vnni_rows", &int8_vnni_rows);
}

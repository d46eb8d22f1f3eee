// What bounds the int4 × int8 kernel's block (cpu_ops.cpp: i8_block) on an AVX2 CPU: the block
// and variants of it, each taking one part out or doing it another way, timed alone on one
// thread. Not built by the package; docs/benchmarks.md (session 24) has what it printed.
//
//   g++ -O3 -march=native benchmarks/int4_i8_block.cpp -o /tmp/int4_i8_block && /tmp/int4_i8_block
//
// The shapes are SmolLM2's gate|up projection (K 576 → 3,072 outputs) over 510 rows, in the
// kernel's order: output blocks of 16, rows in chunks of R. The values are random: only the
// time counts (GMAC/s; one `vpmaddubsw` a cycle is 32 MAC a cycle).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

typedef short v16hi __attribute__((vector_size(32)));
constexpr int K = 576, G = K / 32, OB = 192, M = 510;
alignas(64) static uint8_t codes[OB * K * 8];
static float sz[OB * G * 32];
alignas(64) static int8_t xq[M * K];
alignas(64) static uint8_t xu[M * K];  // xq + 128, for the signed-codes variant
static float xs[M * G], xsum[M * G];
static float out[M * OB * 16];
alignas(64) static uint8_t unpacked[K / 8 * 128];
alignas(64) static int32_t wcorr[G * 16];

enum Epilogue {
  kFull,         // as the kernel: widen, convert, scale multiply, two FMAs
  kNoZeroPoint,  // without the zero-point FMA
  kNone,         // the int16 sums alone (xor'd into a register so they stay live)
  kZeroAfter,    // the zero-point FMAs after the group loop
  kNoScaleMul,   // without the per-row scale's multiply
  kShiftWiden,   // pairs widened by shifts instead of vpmaddwd
  kWidenOnly,    // vpmaddwd into int32 sums only
  kWidenCvtAdd,  // vpmaddwd, conversion, one addition
};

// Pre: codes unpacked once per block (lo0, lo1, hi0, hi1 per 8 inputs); First: a group's first
// 8 inputs set its int16 sums instead of adding to zeros.
template <int R, Epilogue E, bool Pre, bool First>
__attribute__((noinline)) void block(const uint8_t* cb, const float* s_, int m0, float* o) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  __m256i live[R][2];
  for (int m = 0; m < R; ++m) {
    acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    live[m][0] = live[m][1] = _mm256_setzero_si256();
  }
  for (int g = 0; g < G; ++g) {
    v16hi dot[R][2];
    if (!First)
      for (int m = 0; m < R; ++m) dot[m][0] = dot[m][1] = v16hi{};
    for (int c = 0; c < 4; ++c) {
      __m256i lo0, lo1, hi0, hi1;
      if (Pre) {
        const __m256i* up = (const __m256i*)(unpacked + (g * 4 + c) * 128);
        lo0 = _mm256_load_si256(up), lo1 = _mm256_load_si256(up + 1);
        hi0 = _mm256_load_si256(up + 2), hi1 = _mm256_load_si256(up + 3);
      } else {
        const uint8_t* cp = cb + (g * 4 + c) * 64;
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)cp), v1 = _mm256_loadu_si256((const __m256i*)(cp + 32));
        lo0 = _mm256_and_si256(v0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi32(v0, 4), mask);
        lo1 = _mm256_and_si256(v1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi32(v1, 4), mask);
      }
      for (int m = 0; m < R; ++m) {
        const int32_t* xp = (const int32_t*)(xq + (m0 + m) * K) + (g * 4 + c) * 2;
        const __m256i a = _mm256_set1_epi32(xp[0]), b = _mm256_set1_epi32(xp[1]);
        const v16hi p0 = (v16hi)_mm256_maddubs_epi16(lo0, a), p1 = (v16hi)_mm256_maddubs_epi16(lo1, a);
        const v16hi q0 = (v16hi)_mm256_maddubs_epi16(hi0, b), q1 = (v16hi)_mm256_maddubs_epi16(hi1, b);
        if (First && c == 0) {
          dot[m][0] = p0 + q0, dot[m][1] = p1 + q1;
        } else {
          dot[m][0] += p0, dot[m][1] += p1, dot[m][0] += q0, dot[m][1] += q1;
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(s_ + g * 32 + h * 8), z = _mm256_loadu_ps(s_ + g * 32 + 16 + h * 8);
      for (int m = 0; m < R; ++m) {
        const __m256i d = (__m256i)dot[m][h];
        if constexpr (E == kNone) {
          live[m][h] = _mm256_xor_si256(live[m][h], d);
        } else if constexpr (E == kWidenOnly) {
          live[m][h] = _mm256_add_epi32(live[m][h], _mm256_madd_epi16(d, ones));
        } else if constexpr (E == kWidenCvtAdd) {
          acc[m][h] = _mm256_add_ps(acc[m][h], _mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones)));
        } else {
          const __m256 sd = E == kNoScaleMul ? s : _mm256_mul_ps(s, _mm256_set1_ps(xs[(m0 + m) * G + g]));
          const __m256i d32 = E == kShiftWiden
              ? _mm256_add_epi32(_mm256_srai_epi32(_mm256_slli_epi32(d, 16), 16), _mm256_srai_epi32(d, 16))
              : _mm256_madd_epi16(d, ones);
          acc[m][h] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(d32), acc[m][h]);
          if constexpr (E != kNoZeroPoint && E != kZeroAfter)
            acc[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[(m0 + m) * G + g]), acc[m][h]);
        }
      }
    }
  }
  if constexpr (E == kZeroAfter)
    for (int g = 0; g < G; ++g)
      for (int h = 0; h < 2; ++h) {
        const __m256 z = _mm256_loadu_ps(s_ + g * 32 + 16 + h * 8);
        for (int m = 0; m < R; ++m)
          acc[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[(m0 + m) * G + g]), acc[m][h]);
      }
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(o + m * 16 + h * 8,
                       E == kNone || E == kWidenOnly ? _mm256_castsi256_ps(live[m][h]) : acc[m][h]);
}

__attribute__((noinline)) void unpack(const uint8_t* cb) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < K / 8; ++c) {
    const __m256i v0 = _mm256_loadu_si256((const __m256i*)(cb + c * 64));
    const __m256i v1 = _mm256_loadu_si256((const __m256i*)(cb + c * 64 + 32));
    __m256i* o = (__m256i*)(unpacked + c * 128);
    _mm256_store_si256(o, _mm256_and_si256(v0, mask));
    _mm256_store_si256(o + 1, _mm256_and_si256(v1, mask));
    _mm256_store_si256(o + 2, _mm256_and_si256(_mm256_srli_epi32(v0, 4), mask));
    _mm256_store_si256(o + 3, _mm256_and_si256(_mm256_srli_epi32(v1, 4), mask));
  }
}

// The signed-codes variant: codes unpacked as q − 8 (signed bytes) and met as vpmaddubsw's
// memory operand, the activations as unsigned bytes xq + 128; the offset's share, 128 · Σ (q − 8)
// a group and output, comes off the int32 sums.
__attribute__((noinline)) void unpack_signed(const uint8_t* cb) {
  const __m256i mask = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int g = 0; g < G; ++g) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const uint8_t* cp = cb + (g * 4 + c) * 64;
      __m256i* up = (__m256i*)(unpacked + (g * 4 + c) * 128);
      const __m256i v0 = _mm256_loadu_si256((const __m256i*)cp), v1 = _mm256_loadu_si256((const __m256i*)(cp + 32));
      const __m256i a = _mm256_sub_epi8(_mm256_and_si256(v0, mask), eight);
      const __m256i b = _mm256_sub_epi8(_mm256_and_si256(v1, mask), eight);
      const __m256i c2 = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi32(v0, 4), mask), eight);
      const __m256i d = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi32(v1, 4), mask), eight);
      _mm256_store_si256(up, a), _mm256_store_si256(up + 1, b);
      _mm256_store_si256(up + 2, c2), _mm256_store_si256(up + 3, d);
      s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_add_epi8(a, c2)), ones16));
      s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_add_epi8(b, d)), ones16));
    }
    _mm256_store_si256((__m256i*)(wcorr + g * 16), _mm256_slli_epi32(s0, 7));
    _mm256_store_si256((__m256i*)(wcorr + g * 16 + 8), _mm256_slli_epi32(s1, 7));
  }
}

template <int R>
__attribute__((noinline)) void block_signed(const float* s_, int m0, float* o) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    v16hi dot[R][2];
    for (int c = 0; c < 4; ++c) {
      const __m256i* up = (const __m256i*)(unpacked + (g * 4 + c) * 128);
      for (int m = 0; m < R; ++m) {
        const int32_t* xp = (const int32_t*)(xu + (m0 + m) * K) + (g * 4 + c) * 2;
        const __m256i a = _mm256_set1_epi32(xp[0]), b = _mm256_set1_epi32(xp[1]);
        const v16hi p0 = (v16hi)_mm256_maddubs_epi16(a, _mm256_load_si256(up));
        const v16hi p1 = (v16hi)_mm256_maddubs_epi16(a, _mm256_load_si256(up + 1));
        const v16hi q0 = (v16hi)_mm256_maddubs_epi16(b, _mm256_load_si256(up + 2));
        const v16hi q1 = (v16hi)_mm256_maddubs_epi16(b, _mm256_load_si256(up + 3));
        if (c == 0) {
          dot[m][0] = p0 + q0, dot[m][1] = p1 + q1;
        } else {
          dot[m][0] += p0, dot[m][1] += p1, dot[m][0] += q0, dot[m][1] += q1;
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_loadu_ps(s_ + g * 32 + h * 8), z = _mm256_loadu_ps(s_ + g * 32 + 16 + h * 8);
      const __m256i wc = _mm256_load_si256((const __m256i*)(wcorr + g * 16 + h * 8));
      for (int m = 0; m < R; ++m) {
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(xs[(m0 + m) * G + g]));
        const __m256i d32 = _mm256_sub_epi32(_mm256_madd_epi16((__m256i)dot[m][h], ones), wc);
        acc[m][h] = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(d32), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(xsum[(m0 + m) * G + g]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(o + m * 16 + h * 8, acc[m][h]);
}

template <typename F>
double gmacs(int R, F&& pass) {
  double best = 0;
  for (int i = 0; i < 9; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    pass();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double r = double(M / R * R) * K * OB * 16 / dt / 1e9;
    if (r > best) best = r;
  }
  return best;
}

template <int R, Epilogue E, bool Pre = false, bool First = false>
void report(const char* name) {
  const double r = gmacs(R, [] {
    for (int ob = 0; ob < OB; ++ob) {
      if (Pre) unpack(codes + ob * K * 8);
      for (int m0 = 0; m0 + R <= M; m0 += R)
        block<R, E, Pre, First>(codes + ob * K * 8, sz + ob * G * 32, m0, out + (ob * M + m0) * 16);
    }
  });
  printf("%-62s %d rows: %6.1f GMAC/s\n", name, R, r);
}

template <int R>
void report_signed(const char* name) {
  const double r = gmacs(R, [] {
    for (int ob = 0; ob < OB; ++ob) {
      unpack_signed(codes + ob * K * 8);
      for (int m0 = 0; m0 + R <= M; m0 += R) block_signed<R>(sz + ob * G * 32, m0, out + (ob * M + m0) * 16);
    }
  });
  printf("%-62s %d rows: %6.1f GMAC/s\n", name, R, r);
}

int main() {
  for (auto& c : codes) c = static_cast<uint8_t>(rand());
  for (int i = 0; i < M * K; ++i) {
    xq[i] = static_cast<int8_t>(rand() % 255 - 127);
    xu[i] = static_cast<uint8_t>(xq[i] + 128);
  }
  for (auto& f : sz) f = 0.01f;
  for (auto& f : xs) f = 0.02f;
  for (auto& f : xsum) f = 1.f;
  report<6, kFull>("as built");
  report<6, kNone>("no epilogue: the int16 sums alone");
  report<6, kWidenOnly>("epilogue = the vpmaddwd widening only");
  report<6, kWidenCvtAdd>("widening + conversion + an addition");
  report<6, kNoZeroPoint>("without the zero-point FMA");
  report<6, kNoScaleMul>("without the per-row scale's multiply");
  report<6, kZeroAfter>("the zero-point FMAs after the group loop");
  report<6, kShiftWiden>("widening by shifts instead of vpmaddwd");
  report<6, kFull, true, true>("codes unpacked once a block + first 8 inputs set the sums");
  report<7, kFull, true, true>("codes unpacked once a block + first 8 inputs set the sums");
  report_signed<6>("signed codes as the memory operand, activations + 128");
  return 0;
}

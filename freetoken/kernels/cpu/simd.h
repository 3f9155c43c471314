// Shared by the CPU kernels (expert_kernel.cpp, decode_ops.cpp): the ISA picked at build
// time (vector type V of VL floats and its load/FMA helpers, bf16 widening), the software
// prefetch cursor, the work-stealing deque, the sequential row dot product, and the
// benchmark knobs (C++17 inline variables: one instance across both sources).
// ext.py hashes this header into the build flags, so editing it rebuilds the extension.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <atomic>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
// FT_AVX512: the AVX-512 code paths. FT_SIMDE_AVX512 (tests only: ext.build_emulated) compiles
// them against SIMDe's portable AVX-512 on an AVX2 build, so a CPU without AVX-512 runs them
// (slowly) against the same float64 references; the real build is the one with -mavx512*.
#if defined(FT_SIMDE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define FT_AVX512 1
// what SIMDe 0.8 lacks, from what it has
inline simde__m512i ft_simde_cvtepu8_epi32(simde__m128i a) {
  return simde_mm512_cvtepu16_epi32(simde_mm256_cvtepu8_epi16(a));
}
inline simde__m512i ft_simde_cvtepi8_epi32(simde__m128i a) {
  return simde_mm512_cvtepi16_epi32(simde_mm256_cvtepi8_epi16(a));
}
inline float ft_simde_mask_reduce_add_ps(simde__mmask16 k, simde__m512 a) {
  float f[16], s = 0.f;
  simde_mm512_storeu_ps(f, a);
  for (int i = 0; i < 16; ++i) s += (k >> i) & 1 ? f[i] : 0.f;
  return s;
}
inline float ft_simde_reduce_add_ps(simde__m512 a) { return ft_simde_mask_reduce_add_ps(0xffff, a); }
#define _mm512_cvtepu8_epi32 ft_simde_cvtepu8_epi32
#define _mm512_cvtepi8_epi32 ft_simde_cvtepi8_epi32
#define _mm512_mask_reduce_add_ps ft_simde_mask_reduce_add_ps
#define _mm512_reduce_add_ps ft_simde_reduce_add_ps
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FT_AVX512 1
#endif

namespace ft {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(FT_AVX512)
#if defined(__AVX512BF16__)
#define FT_ISA "avx512bf16"
#define FT_HAVE_DPBF16 1
#else
#define FT_ISA "avx512"
#endif
constexpr int VL = 16;
constexpr int kHalfRows = 4;  // phase 1 tile: 4 gate + 4 up rows
constexpr int kNtMax = 3;     // tokens per tile: 8 rows x 3 tokens = 24 accumulators of 32 zmm
constexpr int kDownRows = 8;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vload(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V vload_tail(const float* p, int n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline V vload_tail(const uint16_t* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
#elif defined(__AVX2__) && defined(__FMA__)
#define FT_ISA "avx2"
constexpr int VL = 8;
constexpr int kHalfRows = 2;
constexpr int kNtMax = 2;  // 4 rows x 2 tokens = 8 accumulators of 16 ymm
constexpr int kDownRows = 4;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline V vload(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V vload_tail(const float* p, int n) {
  alignas(32) float b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; ++i) b[i] = p[i];
  return _mm256_load_ps(b);
}
inline V vload_tail(const uint16_t* p, int n) {
  alignas(16) uint16_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; ++i) b[i] = p[i];
  return vload(b);
}
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline void vstore(float* p, V a) { _mm256_storeu_ps(p, a); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#define FT_ISA "scalar"
constexpr int VL = 1;
constexpr int kHalfRows = 2;
constexpr int kNtMax = 2;
constexpr int kDownRows = 4;
using V = float;
inline V vzero() { return 0.f; }
inline V vload(const float* p) { return *p; }
inline V vload(const uint16_t* p) { return bf16_to_f32(*p); }
inline V vload_tail(const float* p, int) { return *p; }
inline V vload_tail(const uint16_t* p, int) { return bf16_to_f32(*p); }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline float vsum(V a) { return a; }
inline V vset1(float f) { return f; }
inline V vmul(V a, V b) { return a * b; }
inline void vstore(float* p, V a) { *p = a; }
#endif

// Decode path prefetch: one cursor per thread walking that thread's whole read sequence (its
// contiguous row blocks of every expert, phase 1 then phase 2) a fixed distance ahead of the
// rows it is reading; step(bytes) issues one line per 64 bytes consumed. It runs across block,
// expert and phase boundaries, so the first rows of the next block are already on their way.
inline int64_t g_pf_dist = 32768;  // bytes ahead (ft_cpu_set_prefetch_distance)
inline int g_pf_hint = 1;   // 0 = T0, 1 = T1 (to L2), 2 = T2, 3 = NTA (ft_cpu_set_prefetch_hint)

inline void prefetch_line(const char* p) {
#if defined(__AVX2__) || defined(__AVX512F__)
  switch (g_pf_hint) {
    case 0: _mm_prefetch(p, _MM_HINT_T0); break;
    case 2: _mm_prefetch(p, _MM_HINT_T2); break;
    case 3: _mm_prefetch(p, _MM_HINT_NTA); break;
    default: _mm_prefetch(p, _MM_HINT_T1);  // to L2: more lines in flight than L1 allows
  }
#else
  (void)p;
#endif
}

struct Stream {
  const char* const* seg_b = nullptr;
  const char* const* seg_e = nullptr;
  int nseg = 0, i = 0;
  const char* p = nullptr;
  int64_t credit = 0;
  inline void step(int64_t bytes) {
#if defined(__AVX2__) || defined(__AVX512F__)
    if (nseg == 0) return;
    credit += bytes;
    while (credit >= 64) {
      while (p >= seg_e[i]) {
        if (i + 1 >= nseg) { credit = 0; return; }
        p = seg_b[++i];
      }
      prefetch_line(p);
      p += 64;
      credit -= 64;
    }
#else
    (void)bytes;
#endif
  }
};

inline int g_prefetch = 1;  // ft_cpu_set_prefetch: 0 turns software prefetch off
inline int g_steal = 1;     // ft_cpu_set_steal: 0 = each thread does exactly its static share

// res[t] = row[0:len] . xs[t][0:len] for NT tokens, U accumulators per token: one row read
// start to end (a purely sequential stream), the activations re-read from L1.
template <typename W, int NT, int U>
inline void dot_row_seq(const W* row, const float* const* xs, int64_t len, float* res,
                        Stream& pf) {
  V acc[NT][U];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[t][u] = vzero();
  int64_t j = 0;
  for (; j + U * VL <= len; j += U * VL) {
    pf.step(static_cast<int64_t>(U * VL * sizeof(W)));
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const V w = vload(row + j + u * VL);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[t][u] = vfma(w, vload(xs[t] + j + u * VL), acc[t][u]);
    }
  }
  for (; j + VL <= len; j += VL) {
    const V w = vload(row + j);
    for (int t = 0; t < NT; ++t) acc[t][0] = vfma(w, vload(xs[t] + j), acc[t][0]);
  }
  if (j < len) {
    const int rem = static_cast<int>(len - j);
    const V w = vload_tail(row + j, rem);
    for (int t = 0; t < NT; ++t) acc[t][0] = vfma(w, vload_tail(xs[t] + j, rem), acc[t][0]);
  }
  for (int t = 0; t < NT; ++t) {
    float sum = 0.f;
    for (int u = 0; u < U; ++u) sum += vsum(acc[t][u]);
    res[t] = sum;
  }
}


// A thread's units: the owner takes from the front, idle threads steal from the back; both
// ends live in one 64-bit word (front low, back high), so each unit is taken exactly once.
struct alignas(64) Deque {
  std::atomic<uint64_t> s{0};
  void reset(uint32_t n) { s.store(static_cast<uint64_t>(n) << 32, std::memory_order_release); }
  int64_t take_front() {
    uint64_t v = s.load(std::memory_order_acquire);
    while ((v & 0xffffffffu) < (v >> 32))
      if (s.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel))
        return static_cast<int64_t>(v & 0xffffffffu);
    return -1;
  }
  int64_t take_back() {
    uint64_t v = s.load(std::memory_order_acquire);
    while ((v & 0xffffffffu) < (v >> 32))
      if (s.compare_exchange_weak(v, v - (uint64_t{1} << 32), std::memory_order_acq_rel))
        return static_cast<int64_t>(v >> 32) - 1;
    return -1;
  }
};

struct alignas(64) RowCount {
  std::atomic<int64_t> v{0};
};

inline void cpu_relax() {
#if defined(__AVX2__) || defined(__AVX512F__)
  _mm_pause();
#endif
}

}  // namespace ft

// The in-register conversions of the quantized CPU expert kernel (expert_quant.cpp): FP8 e4m3
// and MXFP4 e2m1 chunks of 32 columns to fp32 vectors (AVX-512, AVX2; tables in the scalar
// build), the e8m0 scales, and the "pair order" MXFP4's activations are read in.
// ext.py hashes this header into the build flags, so editing it rebuilds the extension.
#pragma once
#include "simd.h"

namespace ft {
constexpr int kChunk = 32;  // columns per scale step (one MX block; divides every fp8 block)
constexpr int kQnt = 4;     // tokens per pass over a row

inline float e8m0_to_f32(uint8_t s) {
  const uint32_t u = s ? static_cast<uint32_t>(s) << 23 : 0x00400000u;  // 0: 2^-127
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Tables {
  float fp8[256];
  float e2m1[16];
  Tables() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float v = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
      fp8[b] = (b & 0x80) ? -v : v;
    }
    const float mag[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int c = 0; c < 16; ++c) e2m1[c] = c & 8 ? -mag[c & 7] : mag[c & 7];
  }
};
inline const Tables kTables;

constexpr int kVec = kChunk / VL;  // vectors per chunk

// Accumulators per token of a row pass of NT tokens: enough independent FMA chains to cover
// the FMA latency at T = 1, few enough to stay in registers (16 ymm, 32 zmm) with the codes.
template <int NT>
constexpr int accs() {
  return VL == 1 ? 1 : NT == 1 ? 8 : NT == 2 ? (VL == 16 ? 8 : 4) : (VL == 16 ? 4 : 2);
}

// MXFP4's activations are read in "pair order": within each group of 2 * kPair columns the
// even columns first, then the odd ones (the two nibbles of a byte decode into two different
// vectors, or vector halves, without a byte shuffle: see mx_chunk). mx_pos maps a column to
// its place; at VL = 1 it is the identity.
constexpr int64_t kPair = VL == 8 ? 4 : VL;  // AVX2: 128-bit lane halves
inline int64_t mx_pos(int64_t j) {
  const int64_t g = j / (2 * kPair), o = j % (2 * kPair);
  return g * 2 * kPair + (o & 1) * kPair + o / 2;
}

#if defined(FT_AVX512)
// FP8: the 32 e4m3 bytes of a chunk as fp32 * s, in column order, where s already holds the
// 2^120 of the rebias. The byte sign-extended to 32 bits and shifted left by 20 holds the
// sign in bits 31-27 and eeee mmm in bits 26-20: masking 0x87f00000 leaves the fp32 with
// sign s, exponent 0000eeee and mantissa mmm0..., the e4m3 value * 2^-120 (subnormals too:
// they become fp32 subnormals), which the multiply by s rescales exactly.
inline void fp8_chunk(const uint8_t* p, V s, V* w) {
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(0x87f00000u));
  for (int u = 0; u < kVec; ++u) {
    const __m512i b =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * u)));
    w[u] = vmul(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), mask)), s);
  }
}

// MXFP4: the scaled 16-entry e2m1 table of one chunk (one e8m0 scale)
struct MxLut {
  V t;
};
inline MxLut mx_lut(float s) {
  const V tab = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  return MxLut{vmul(tab, vset1(s))};
}
// the 32 weights of 16 bytes in pair order: w[0] the low nibbles (even columns), w[1] the
// high ones, each one permute of the table by the code (vpermps reads an index's low 4 bits)
inline void mx_chunk(const uint8_t* p, const MxLut& l, V* w) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w[0] = _mm512_permutexvar_ps(b, l.t);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), l.t);
}
#elif defined(__AVX2__)
// FP8 as in the AVX-512 build, 8 bytes at a time
inline void fp8_chunk(const uint8_t* p, V s, V* w) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x87f00000u));
  for (int u = 0; u < kVec; ++u) {
    const __m256i b =
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * u)));
    w[u] = vmul(_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), mask)), s);
  }
}

// MXFP4: one byte shuffle per table gives each code's fp32 high half (an e2m1 value has a
// zero low half: sign, exponent, one mantissa bit), two unpacks place it into fp32 lanes, then
// the chunk's scale multiplies. 16 bytes broadcast to both lanes, lane 1 shifted right 4, are
// the 32 codes: lane 0 the low nibbles (even columns), lane 1 the high ones (odd); the
// unpacks keep that split per vector: w[v] = columns 8v, 8v+2, 8v+4, 8v+6 | 8v+1, ..., 8v+7
// (kPair = 4). Measured on Zen 3 1.3x the 8-entry vpermps route (3 index bits only).
struct MxLut {
  V s;
};
inline MxLut mx_lut(float s) { return MxLut{vset1(s)}; }
inline void mx_chunk(const uint8_t* p, const MxLut& l, V* w) {
  const __m256i hi_t = _mm256_setr_epi8(  // byte 3 of the fp32 of code c (lanes alike)
      0, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, -0x80, -0x41, -0x41, -0x41, -0x40, -0x40,
      -0x40, -0x40, 0, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, -0x80, -0x41, -0x41, -0x41,
      -0x40, -0x40, -0x40, -0x40);
  const __m256i lo_t = _mm256_setr_epi8(  // byte 2
      0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40, 0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40,
      0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40, 0, 0, -0x80, -0x40, 0, 0x40, -0x80, -0x40);
  const __m256i raw =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i code = _mm256_and_si256(
      _mm256_srlv_epi32(raw, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
  const __m256i hi = _mm256_shuffle_epi8(hi_t, code), lo = _mm256_shuffle_epi8(lo_t, code);
  const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
  const __m256i z = _mm256_setzero_si256();
  w[0] = vmul(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, a)), l.s);
  w[1] = vmul(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, a)), l.s);
  w[2] = vmul(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, b)), l.s);
  w[3] = vmul(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, b)), l.s);
}
#else
inline void fp8_chunk(const uint8_t* p, V s, V* w) {  // s holds 2^120, as the vector builds
  for (int u = 0; u < kChunk; ++u) w[u] = kTables.fp8[p[u]] * 0x1p-120f * s;
}
struct MxLut {
  float s;
};
inline MxLut mx_lut(float s) { return MxLut{s}; }
inline void mx_chunk(const uint8_t* p, const MxLut& l, V* w) {
  for (int u = 0; u < kChunk; ++u) w[u] = l.s * kTables.e2m1[(p[u >> 1] >> (4 * (u & 1))) & 15];
}
#endif

// chunks in a row at most (H, I <= 32 * kMaxScales: ft_cpu_experts_q checks)
constexpr int64_t kMaxScales = 1024;

// f[i] = the e8m0 scale s[i] as fp32 (2^(s - 127); 0 -> 2^-127, a subnormal), i < n
inline void e8m0_row(const uint8_t* s, int64_t n, float* f) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i)));
    const __m256i z = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
    const __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi32(b, 23),
                                            _mm256_set1_epi32(0x00400000), z);
    _mm256_storeu_ps(f + i, _mm256_castsi256_ps(bits));
  }
#endif
  for (; i < n; ++i) f[i] = e8m0_to_f32(s[i]);
}

}  // namespace ft

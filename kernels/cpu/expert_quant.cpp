// CPU SwiGLU expert kernel over quantized banks (kernels/quant.py): FP8 e4m3 with one fp32
// scale per B x B block (B a multiple of 32), and MXFP4 (e2m1 codes two a byte, low nibble the
// even column, one e8m0 scale per 32 columns). The weights are read as they are stored and
// converted in registers, 32 columns (one chunk) at a time, into fp32 products and sums:
// - e4m3: the byte sign-extended, shifted and masked is an fp32 of the value * 2^-120 (exact,
//   subnormals included), multiplied by the block's scale * 2^120 (fp8_chunk);
// - e2m1: one permute per vector of a per-chunk table (the 16 signed values times the chunk's
//   scale; AVX2's 8-entry permute takes the sign by one XOR, see mx_lut), so no multiply per
//   weight. The two nibbles of a byte land in two vectors (even and odd columns), so the
//   activations are read in "pair order" (mx_pos): x permuted once per call, the act rows
//   written permuted by phase 1. Scalar builds: tables, natural order.
// Each row pass keeps 8 (AVX2: 4 at 2 tokens, 2 past) accumulators per token so the FMA
// latency is covered at T = 1, for up to kQnt tokens per pass over the row.
//
// Shape legend: T tokens, K routed experts per token, E experts, H hidden, I intermediate,
// n entries (t, k) routed to one expert.
//   gate_up [E, 2I, H] rows [gate | up] (gate and up keep their own fp8 row blocks: scale grid
//   [E, 2 * ceil(I / B), ceil(H / B)]); down [E, H, I] (grid [E, ceil(H / B), ceil(I / B)]);
//   mxfp4 scales [E, rows, cols / 32]. x [T, H] fp32, out [T, K, H] fp32 (masked-out rows are
//   not touched).
// Work: phase 1 units (one expert group, 8 gate rows and the matching 8 up rows) then phase 2
// units (one group, 16 down rows), each an OpenMP dynamic loop; every output element is one
// dot product, so results do not depend on the thread count.
// gpt-oss's experts (kernels/expert_act.py): with `gu_bias` the entry's gate_up bias row
// (bias_ids[t * K + k], its logical expert: a slot bank's row is not its bias row) is added
// before the clamped SwiGLU (u + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
// u = clamp(up, -limit, limit), and its down bias row after the down product.
#include "expert_call.h"

namespace {

using namespace ft;

constexpr int kChunk = 32;  // columns per scale step (one MX block; divides every fp8 block)
constexpr int kQnt = 4;     // tokens per pass over a row

struct QMat {
  const uint8_t* data;  // one expert's [rows, cols] codes
  const void* scale;    // its scales: fp8 float grid, mxfp4 e8m0 bytes
  int64_t rows, cols, block, half, nb, cb;
};

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
const Tables kTables;

constexpr int kVec = kChunk / VL;  // vectors per chunk

// Accumulators per token of a row pass of NT tokens: enough independent FMA chains to cover
// the FMA latency at T = 1, few enough to stay in registers (16 ymm, 32 zmm) with the codes.
template <int NT>
constexpr int accs() {
  return VL == 1 ? 1 : NT == 1 ? 8 : NT == 2 ? (VL == 16 ? 8 : 4) : (VL == 16 ? 4 : 2);
}

// MXFP4's activations are read in "pair order": within each group of 2 * VL columns the even
// columns first, then the odd ones (the two nibbles of VL bytes decode to those two vectors
// without a byte shuffle). mx_pos maps a column to its place; at VL = 1 it is the identity.
inline int64_t mx_pos(int64_t j) {
  const int64_t g = j / (2 * VL), o = j % (2 * VL);
  return g * 2 * VL + (o & 1) * VL + o / 2;
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

// MXFP4: vpermps reads only 3 index bits, so the table holds the 8 magnitudes * scale, each
// XORed with its own index << 28; XORing the permuted entry with (code << 28) then cancels
// those bits and sets the sign from the code's bit 3, in one op.
struct MxLut {
  V t;
};
inline MxLut mx_lut(float s) {
  const V mag = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i pat = _mm256_slli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), 28);
  return MxLut{_mm256_xor_ps(vmul(mag, vset1(s)), _mm256_castsi256_ps(pat))};
}
inline V mx_pick(const MxLut& l, __m256i code) {  // code: one e2m1 code per lane (bits 0-3)
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(l.t, code),
                       _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}
// the 32 weights of 16 bytes in pair order (w[0], w[1]: columns 0..15; w[2], w[3]: 16..31)
inline void mx_chunk(const uint8_t* p, const MxLut& l, V* w) {
  for (int h8 = 0; h8 < 2; ++h8) {
    const __m256i b = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h8)));
    w[2 * h8] = mx_pick(l, b);  // bits 4-7 of b fall out of the << 28, vpermps ignores them
    w[2 * h8 + 1] = mx_pick(l, _mm256_srli_epi32(b, 4));
  }
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

// acc[t][(PH * kVec + v) % U] += w[v] * x[t][j + v * VL]: one chunk of NT tokens
template <int NT, int U, int PH>
inline void fma_chunk(const V* w, const float* const* xs, int64_t j, V (&acc)[NT][U]) {
#pragma GCC unroll 32
  for (int v = 0; v < kVec; ++v)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
      acc[t][(PH * kVec + v) % U] = vfma(w[v], vload(xs[t] + j + v * VL), acc[t][(PH * kVec + v) % U]);
}

// R chunks of a row from column j (R = U / kVec phases, so every accumulator gets one FMA per
// vector of the step). sc: fp8: the scale block's scale times 2^120 (*sc); mxfp4: the row's
// e8m0 scales as fp32, one per chunk.
// BIG (fp8 only): the row has a scale whose 2^120 multiple overflows; its weights are
// multiplied by 2^64 first and sc holds scale * 2^56.
template <int FMT, int NT, int U, int PH, int R, bool BIG>
inline void row_step(const uint8_t* row, const float* sc, const float* const* xs, int64_t j,
                     V (&acc)[NT][U]) {
  V w[kVec];
  if constexpr (FMT == 0) {
    fp8_chunk(row + j, vset1(*sc), w);
    if constexpr (BIG)
      for (int u = 0; u < kVec; ++u) w[u] = vmul(w[u], vset1(0x1p64f));
  } else {
    mx_chunk(row + j / 2, mx_lut(sc[j / kChunk]), w);
  }
  fma_chunk<NT, U, PH>(w, xs, j, acc);
  if constexpr (PH + 1 < R) row_step<FMT, NT, U, PH + 1, R, BIG>(row, sc, xs, j + kChunk, acc);
}

template <int FMT, int NT, int U, bool BIG>
inline void row_span(const uint8_t* row, const float* sc, const float* const* xs, int64_t j,
                     int64_t j1, V (&acc)[NT][U]) {
  constexpr int R = U > kVec ? U / kVec : 1;
  for (; j + R * kChunk <= j1; j += R * kChunk)
    row_step<FMT, NT, U, 0, R, BIG>(row, sc, xs, j, acc);
  for (; j < j1; j += kChunk) row_step<FMT, NT, U, 0, 1, BIG>(row, sc, xs, j, acc);
}

// res[t] = row r of m . xs[t] for NT tokens, the row converted chunk by chunk in registers with
// its scales (one per chunk, made first); MXFP4's xs are in pair order.
template <int FMT, int NT>
inline void qdot_row(const QMat& m, int64_t r, const float* const* xs, float* res) {
  constexpr int U = accs<NT>();
  V acc[NT][U];
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < U; ++u) acc[t][u] = vzero();
  if constexpr (FMT == 1) {
    const int64_t nc = m.cols / kChunk;
    float sc[kMaxScales];
    e8m0_row(static_cast<const uint8_t*>(m.scale) + r * nc, nc, sc);
    row_span<1, NT, U, false>(m.data + r * (m.cols / 2), sc, xs, 0, m.cols, acc);
  } else {
    // one scale block at a time
    const float* fs = static_cast<const float*>(m.scale) +
                      ((r / m.half) * m.nb + (r % m.half) / m.block) * m.cb;
    const uint8_t* row = m.data + r * m.cols;
    for (int64_t j = 0, b = 0; j < m.cols; j += m.block, ++b) {
      const int64_t j1 = std::min(m.cols, j + m.block);
      float v = fs[b] * 0x1p120f;  // exact: a power of two
      if (!std::isinf(v)) {
        row_span<0, NT, U, false>(row, &v, xs, j, j1, acc);
      } else {
        v = fs[b] * 0x1p56f;
        row_span<0, NT, U, true>(row, &v, xs, j, j1, acc);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    V sum = acc[t][0];
    for (int u = 1; u < U; ++u) sum = sum + acc[t][u];
    res[t] = vsum(sum);
  }
}

// res[t] for the n tokens of xs (any n), kQnt at a time
template <int FMT>
void qdot_tokens(const QMat& m, int64_t r, const float* const* xs, int n, float* res) {
  int t = 0;
  for (; t + kQnt <= n; t += kQnt) qdot_row<FMT, kQnt>(m, r, xs + t, res + t);
  switch (n - t) {
    case 3: qdot_row<FMT, 3>(m, r, xs + t, res + t); break;
    case 2: qdot_row<FMT, 2>(m, r, xs + t, res + t); break;
    case 1: qdot_row<FMT, 1>(m, r, xs + t, res + t); break;
    default: break;
  }
}

struct QCall {
  const uint8_t *gu, *dn;
  const void *gus, *dns;
  int64_t block;
  const float *gub = nullptr, *dnb = nullptr;  // [E', 2I], [E', H] biases (gpt-oss) or null
  const int64_t* bias_ids = nullptr;           // [T * K] logical id of each entry
  float alpha = 1.f, limit = 0.f;
};

inline float swiglu_oai(float g, float u, float alpha, float limit) {
  g = std::min(g, limit);
  u = std::min(std::max(u, -limit), limit);
  return (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
}

template <int FMT>
QMat expert_mat(const QCall& q, bool gate_up, int64_t e, int64_t H, int64_t I) {
  const int64_t rows = gate_up ? 2 * I : H, cols = gate_up ? H : I;
  const int64_t block = FMT == 0 ? q.block : kChunk;
  const int64_t half = gate_up ? I : H;
  const int64_t nb = (half + block - 1) / block, cb = (cols + block - 1) / block;
  const int64_t bytes = FMT == 0 ? rows * cols : rows * cols / 2;
  const int64_t sn = FMT == 0 ? (gate_up ? 2 : 1) * nb * cb : rows * (cols / kChunk);
  const uint8_t* data = (gate_up ? q.gu : q.dn) + e * bytes;
  const void* base = gate_up ? q.gus : q.dns;
  const void* scale = FMT == 0 ? static_cast<const void*>(static_cast<const float*>(base) + e * sn)
                               : static_cast<const void*>(static_cast<const uint8_t*>(base) +
                                                          e * sn);
  return QMat{data, scale, rows, cols, block, half, nb, cb};
}

constexpr int64_t kRows1 = 8, kRows2 = 16;

template <int FMT>
void run_quant(ExpertCall& c, const QCall& q, int nth) {
  const int64_t H = c.H, I = c.I;
  const int64_t ng = static_cast<int64_t>(c.groups.size());
  const int64_t u1 = (I + kRows1 - 1) / kRows1, u2 = (H + kRows2 - 1) / kRows2;
  int nmax = 1;
  for (const Group& g : c.groups) nmax = std::max(nmax, g.n);
  // MXFP4 reads its activations in pair order (mx_pos): x rows permuted once here, the act
  // rows written permuted by phase 1
  std::vector<float> xq;
  std::vector<const float*> xqp;
  const float* const* xrows = c.xp.data();
  if (FMT == 1 && VL > 1) {
    const int64_t n_ent = static_cast<int64_t>(c.entries.size());
    xq.resize(c.T * H);
    std::vector<char> seen(c.T, 0);
    xqp.resize(n_ent);
    for (int64_t j = 0; j < n_ent; ++j) {
      const int64_t t = c.entries[j] / c.K;
      float* dst = xq.data() + t * H;
      if (!seen[t]) {
        for (int64_t h = 0; h < H; ++h) dst[mx_pos(h)] = c.xp[j][h];
        seen[t] = 1;
      }
      xqp[j] = dst;
    }
    xrows = xqp.data();
  }
#pragma omp parallel num_threads(nth)
  {
    std::vector<float> gres(nmax), ures(nmax);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < ng * u1; ++w) {
      const Group& g = c.groups[w / u1];
      const QMat m = expert_mat<FMT>(q, true, g.expert, H, I);
      const float* const* xs = xrows + g.begin;
      const int64_t r0 = (w % u1) * kRows1, r1 = std::min(I, r0 + kRows1);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t ra = FMT == 1 ? mx_pos(r) : r;  // where the act value goes
        qdot_tokens<FMT>(m, r, xs, g.n, gres.data());
        qdot_tokens<FMT>(m, I + r, xs, g.n, ures.data());
        if (q.gub) {
          for (int t = 0; t < g.n; ++t) {
            const float* b = q.gub + q.bias_ids[c.entries[g.begin + t]] * 2 * I;
            c.act[(g.begin + t) * I + ra] =
                swiglu_oai(gres[t] + b[r], ures[t] + b[I + r], q.alpha, q.limit);
          }
          continue;
        }
        for (int t = 0; t < g.n; ++t)
          c.act[(g.begin + t) * I + ra] = gres[t] / (1.f + std::exp(-gres[t])) * ures[t];
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < ng * u2; ++w) {
      const Group& g = c.groups[w / u2];
      const QMat m = expert_mat<FMT>(q, false, g.expert, H, I);
      const float* const* as = c.ap.data() + g.begin;
      const int64_t r0 = (w % u2) * kRows2, r1 = std::min(H, r0 + kRows2);
      for (int64_t r = r0; r < r1; ++r) {
        qdot_tokens<FMT>(m, r, as, g.n, gres.data());
        for (int t = 0; t < g.n; ++t) {
          const int64_t ent = c.entries[g.begin + t];
          c.out[ent * H + r] = q.dnb ? gres[t] + q.dnb[q.bias_ids[ent] * H + r] : gres[t];
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 if an expert id is out of [0, E), 2 on a bad format code, 3 on a
// shape the kernel does not take (H or I not a multiple of 32, an fp8 block not a multiple of
// 32). fmt: 0 = fp8 (scales fp32 block grids, `block` their edge), 1 = mxfp4 (e8m0 scales).
// gu_bias / dn_bias / bias_ids null: the plain SwiGLU; else gpt-oss's (see the top).
int ft_cpu_experts_q(const float* x, int64_t T, int64_t H, const int64_t* ids, int64_t K,
                     const uint8_t* mask, const uint8_t* gate_up, const void* gate_up_scale,
                     const uint8_t* down, const void* down_scale, int64_t E, int64_t I,
                     int fmt, int64_t block, float* out, int nthreads, const float* gu_bias,
                     const float* dn_bias, const int64_t* bias_ids, float alpha, float limit) {
  if (fmt != 0 && fmt != 1) return 2;
  if (H % kChunk || I % kChunk || (fmt == 0 && (block <= 0 || block % kChunk))) return 3;
  if (std::max(H, I) > kChunk * kMaxScales) return 3;
  const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
  ExpertCall c;
  const int rc = expert_prepare(c, x, T, H, ids, K, mask, gate_up, down, E, I, 0, out, nth, 0,
                                false);
  if (rc != 0 || c.groups.empty()) return rc;
  if (gu_bias && (!dn_bias || !bias_ids)) return 2;
  const QCall q{gate_up, down, gate_up_scale, down_scale, block, gu_bias, dn_bias, bias_ids,
                alpha, limit};
  if (fmt == 0) run_quant<0>(c, q, nth);
  else run_quant<1>(c, q, nth);
  return 0;
}

}  // extern "C"

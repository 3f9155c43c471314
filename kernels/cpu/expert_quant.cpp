// CPU SwiGLU expert kernel over quantized banks (kernels/quant.py): FP8 e4m3 with one fp32
// scale per B x B block (B a multiple of 32), and MXFP4 (e2m1 codes two a byte, low nibble the
// even column, one e8m0 scale per 32 columns). The weights are read as they are stored and
// converted in registers, 32 columns (one scale) at a time: e4m3 by moving its bits into an
// fp32 and rebiasing the exponent with one multiply (exact, subnormals included), e2m1 through
// one byte shuffle through a 16-entry table of 2 * e2m1 (integers) and an int8 -> fp32
// convert (scalar: tables). The products and sums are fp32, as in expert_kernel.cpp.
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

#if defined(__AVX2__) || defined(__AVX512F__)
// The 32 e2m1 codes of 16 bytes as int8 2 * value, in column order (v[0]: columns 0..15,
// v[1]: 16..31): the nibbles split and interleaved (low nibble first), then one byte shuffle
// through the 16-entry table (2 * e2m1 is an integer: 0, 1, 2, 3, 4, 6, 8, 12, signed).
inline void mx_codes_x2(const uint8_t* p, __m128i* v) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nib = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  v[0] = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
  v[1] = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
}
#endif

// w[0..kVec) = the 32 weights of `p` (FMT 0: 32 e4m3 bytes; 1: 16 bytes of e2m1 pairs) * s
template <int FMT>
inline void load_chunk(const uint8_t* p, float s, V* w) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (FMT == 0) {
    // the e4m3 bits moved into an fp32 are the value * 2^-120: fold 2^120 into the scale
    // (exact: a power of two) unless that overflows
    const float sf = s * 0x1p120f;
    const bool fold = !std::isinf(sf);
    const V vs = vset1(fold ? sf : s), rebias = vset1(0x1p120f);
    for (int u = 0; u < kVec; ++u) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * u)));
      const __m512i bits = _mm512_or_si512(
          _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24),
          _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20));
      const V f = _mm512_castsi512_ps(bits);
      w[u] = vmul(fold ? f : vmul(f, rebias), vs);
    }
  } else {
    __m128i v[2];
    mx_codes_x2(p, v);
    const V vs = vset1(0.5f * s);
    for (int u = 0; u < kVec; ++u) w[u] = vmul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v[u])), vs);
  }
#elif defined(__AVX2__)
  if (FMT == 0) {
    const float sf = s * 0x1p120f;  // as above
    const bool fold = !std::isinf(sf);
    const V vs = vset1(fold ? sf : s), rebias = vset1(0x1p120f);
    for (int u = 0; u < kVec; ++u) {
      const __m256i b = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * u)));
      const __m256i bits = _mm256_or_si256(
          _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24),
          _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20));
      const V f = _mm256_castsi256_ps(bits);
      w[u] = vmul(fold ? f : vmul(f, rebias), vs);
    }
  } else {
    __m128i v[2];
    mx_codes_x2(p, v);
    const V vs = vset1(0.5f * s);
    for (int u = 0; u < kVec; ++u) {
      const __m128i d = u & 1 ? _mm_srli_si128(v[u >> 1], 8) : v[u >> 1];
      w[u] = vmul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(d)), vs);
    }
  }
#else
  for (int u = 0; u < kChunk; ++u)
    w[u] = s * (FMT == 0 ? kTables.fp8[p[u]] : kTables.e2m1[(p[u >> 1] >> (4 * (u & 1))) & 15]);
#endif
}

// res[t] = row r of m . xs[t] for NT tokens: the row converted chunk by chunk in registers
template <int FMT, int NT>
inline void qdot_row(const QMat& m, int64_t r, const float* const* xs, float* res) {
  V acc[NT][kVec];
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < kVec; ++u) acc[t][u] = vzero();
  const int64_t rb = FMT == 0 ? m.cols : m.cols / 2;
  const uint8_t* row = m.data + r * rb;
  const float* fscale = FMT == 0 ? static_cast<const float*>(m.scale) +
                                       ((r / m.half) * m.nb + (r % m.half) / m.block) * m.cb
                                 : nullptr;
  const uint8_t* mscale = FMT == 1 ? static_cast<const uint8_t*>(m.scale) + r * (m.cols / 32)
                                   : nullptr;
  V w[kVec];
  for (int64_t j = 0; j < m.cols; j += kChunk) {
    const float s = FMT == 0 ? fscale[j / m.block] : e8m0_to_f32(mscale[j / kChunk]);
    load_chunk<FMT>(row + (FMT == 0 ? j : j / 2), s, w);
    for (int u = 0; u < kVec; ++u)
      for (int t = 0; t < NT; ++t) acc[t][u] = vfma(w[u], vload(xs[t] + j + u * VL), acc[t][u]);
  }
  for (int t = 0; t < NT; ++t) {
    float sum = 0.f;
    for (int u = 0; u < kVec; ++u) sum += vsum(acc[t][u]);
    res[t] = sum;
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
#pragma omp parallel num_threads(nth)
  {
    std::vector<float> gres(nmax), ures(nmax);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < ng * u1; ++w) {
      const Group& g = c.groups[w / u1];
      const QMat m = expert_mat<FMT>(q, true, g.expert, H, I);
      const float* const* xs = c.xp.data() + g.begin;
      const int64_t r0 = (w % u1) * kRows1, r1 = std::min(I, r0 + kRows1);
      for (int64_t r = r0; r < r1; ++r) {
        qdot_tokens<FMT>(m, r, xs, g.n, gres.data());
        qdot_tokens<FMT>(m, I + r, xs, g.n, ures.data());
        if (q.gub) {
          for (int t = 0; t < g.n; ++t) {
            const float* b = q.gub + q.bias_ids[c.entries[g.begin + t]] * 2 * I;
            c.act[(g.begin + t) * I + r] =
                swiglu_oai(gres[t] + b[r], ures[t] + b[I + r], q.alpha, q.limit);
          }
          continue;
        }
        for (int t = 0; t < g.n; ++t)
          c.act[(g.begin + t) * I + r] = gres[t] / (1.f + std::exp(-gres[t])) * ures[t];
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

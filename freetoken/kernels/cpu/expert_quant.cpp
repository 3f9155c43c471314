// CPU SwiGLU expert kernel over quantized banks (freetoken/kernels/quant.py): FP8 e4m3 with one fp32
// scale per B x B block (B a multiple of 32), and MXFP4 (e2m1 codes two a byte, low nibble the
// even column, one e8m0 scale per 32 columns). The weights are read as they are stored and
// converted in registers, 32 columns (one chunk) at a time, into fp32 products and sums:
// - e4m3: the byte sign-extended, shifted and masked is an fp32 of the value * 2^-120 (exact,
//   subnormals included), multiplied by the block's scale * 2^120 (fp8_chunk);
// - e2m1: AVX-512: one permute per vector of a per-chunk table (the 16 signed values times
//   the chunk's scale), no multiply per weight; AVX2: two byte shuffles give each code's fp32
//   high half, two unpacks make the fp32s, one multiply by the scale (mx_chunk). The two
//   nibbles of a byte land in different vectors or lanes (even and odd columns), so the
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
// The conversions are in quant_simd.h. Work: phase 1 units (one expert group, 8 gate rows and
// the matching 8 up rows) then phase 2 units (one group, 16 down rows). Decode-size groups
// (<= kQnt tokens): each thread owns a contiguous run of each phase's units, read in order
// behind a prefetch cursor (simd.h Stream), and steals from the back of the others' runs when
// done; larger groups: OpenMP dynamic loops. Every output element is one dot product, so
// results do not depend on the thread count, the prefetch or the stealing.
// The activation (freetoken/kernels/expert_act.py, `act` codes in expert_call.h): gpt-oss's
// experts (kActOai): the entry's gate_up bias row `gu_bias` (bias_ids[t * K + k], its logical
// expert: a slot bank's row is not its bias row) is added before the clamped SwiGLU
// (u + 1) * g * sigmoid(alpha * g), g = min(gate, limit), u = clamp(up, -limit, limit), and its
// down bias row after the down product; DeepSeek-V4's (kActClamp): no biases,
// silu(min(gate, limit)) * clamp(up, -limit, limit); kActPlain: silu(gate) * up.
#include "expert_call.h"
#include "quant_simd.h"

namespace {

using namespace ft;

struct QMat {
  const uint8_t* data;  // one expert's [rows, cols] codes
  const void* scale;    // its scales: fp8 float grid, mxfp4 e8m0 bytes
  int64_t rows, cols, block, half, nb, cb;
};

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
                     int64_t j1, V (&acc)[NT][U], Stream& pf) {
  constexpr int R = U > kVec ? U / kVec : 1;
  constexpr int64_t kStep = R * kChunk / (FMT == 0 ? 1 : 2);  // code bytes per step
  int64_t owed = 0;  // bytes read since the cursor last moved: it moves every 256 (a
                     // prefetch instruction per line costs little; a call per chunk did)
  for (; j + R * kChunk <= j1; j += R * kChunk) {
    if ((owed += kStep) >= 256) {
      pf.step(owed);
      owed = 0;
    }
    row_step<FMT, NT, U, 0, R, BIG>(row, sc, xs, j, acc);
  }
  for (; j < j1; j += kChunk) {
    owed += kChunk / (FMT == 0 ? 1 : 2);
    row_step<FMT, NT, U, 0, 1, BIG>(row, sc, xs, j, acc);
  }
  if (owed) pf.step(owed);
}

// res[t] = row r of m . xs[t] for NT tokens, the row converted chunk by chunk in registers with
// its scales (one per chunk, made first); MXFP4's xs are in pair order.
template <int FMT, int NT>
inline void qdot_row(const QMat& m, int64_t r, const float* const* xs, float* res, Stream& pf) {
  constexpr int U = accs<NT>();
  V acc[NT][U];
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < U; ++u) acc[t][u] = vzero();
  if constexpr (FMT == 1) {
    const int64_t nc = m.cols / kChunk;
    float sc[kMaxScales];
    e8m0_row(static_cast<const uint8_t*>(m.scale) + r * nc, nc, sc);
    row_span<1, NT, U, false>(m.data + r * (m.cols / 2), sc, xs, 0, m.cols, acc, pf);
  } else {
    // one scale block at a time
    const float* fs = static_cast<const float*>(m.scale) +
                      ((r / m.half) * m.nb + (r % m.half) / m.block) * m.cb;
    const uint8_t* row = m.data + r * m.cols;
    for (int64_t j = 0, b = 0; j < m.cols; j += m.block, ++b) {
      const int64_t j1 = std::min(m.cols, j + m.block);
      float v = fs[b] * 0x1p120f;  // exact: a power of two
      if (!std::isinf(v)) {
        row_span<0, NT, U, false>(row, &v, xs, j, j1, acc, pf);
      } else {
        v = fs[b] * 0x1p56f;
        row_span<0, NT, U, true>(row, &v, xs, j, j1, acc, pf);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    V sum = acc[t][0];
    for (int u = 1; u < U; ++u) sum = sum + acc[t][u];
    res[t] = vsum(sum);
  }
}

// res[t] for the n tokens of xs (any n), kQnt at a time; the first pass over the row steps
// the prefetch cursor `pf` by the code bytes it reads
template <int FMT>
void qdot_tokens(const QMat& m, int64_t r, const float* const* xs, int n, float* res,
                 Stream& pf) {
  Stream none;
  int t = 0;
  for (; t + kQnt <= n; t += kQnt) qdot_row<FMT, kQnt>(m, r, xs + t, res + t, t ? none : pf);
  Stream& p = t ? none : pf;
  switch (n - t) {
    case 3: qdot_row<FMT, 3>(m, r, xs + t, res + t, p); break;
    case 2: qdot_row<FMT, 2>(m, r, xs + t, res + t, p); break;
    case 1: qdot_row<FMT, 1>(m, r, xs + t, res + t, p); break;
    default: break;
  }
}

struct QCall {
  const uint8_t *gu, *dn;
  const void *gus, *dns;
  int64_t block;
  const float *gub = nullptr, *dnb = nullptr;  // [E', 2I], [E', H] biases (kActOai) or null
  const int64_t* bias_ids = nullptr;           // [T * K] logical id of each entry
  float alpha = 1.f, limit = 0.f;
  int act = kActPlain;
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
  // phase 1 unit w: gate and up rows of one group, the act values; phase 2: down rows
  const int64_t rb = FMT == 0 ? 1 : 2;  // columns per code byte
  auto unit1 = [&](int64_t w, float* gres, float* ures, Stream& pf) {
    const Group& g = c.groups[w / u1];
    const QMat m = expert_mat<FMT>(q, true, g.expert, H, I);
    const float* const* xs = xrows + g.begin;
    const int64_t r0 = (w % u1) * kRows1, r1 = std::min(I, r0 + kRows1);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t ra = FMT == 1 ? mx_pos(r) : r;  // where the act value goes
      qdot_tokens<FMT>(m, r, xs, g.n, gres, pf);
      qdot_tokens<FMT>(m, I + r, xs, g.n, ures, pf);
      for (int t = 0; t < g.n; ++t) {
        float& out = c.act[(g.begin + t) * I + ra];
        if (q.gub) {
          const float* b = q.gub + q.bias_ids[c.entries[g.begin + t]] * 2 * I;
          out = swiglu_oai(gres[t] + b[r], ures[t] + b[I + r], q.alpha, q.limit);
        } else {
          out = swiglu(gres[t], ures[t], q.act, q.limit);
        }
      }
    }
  };
  auto unit2 = [&](int64_t w, float* res, Stream& pf) {
    const Group& g = c.groups[w / u2];
    const QMat m = expert_mat<FMT>(q, false, g.expert, H, I);
    const float* const* as = c.ap.data() + g.begin;
    const int64_t r0 = (w % u2) * kRows2, r1 = std::min(H, r0 + kRows2);
    for (int64_t r = r0; r < r1; ++r) {
      qdot_tokens<FMT>(m, r, as, g.n, res, pf);
      for (int t = 0; t < g.n; ++t) {
        const int64_t ent = c.entries[g.begin + t];
        c.out[ent * H + r] = q.dnb ? res[t] + q.dnb[q.bias_ids[ent] * H + r] : res[t];
      }
    }
  };
  // decode-size groups: each thread owns a contiguous run of each phase's units, reads them
  // in order and prefetches that read sequence ahead (simd.h Stream); a thread done with its
  // own steals from the back of the others' (a descheduled thread on a shared machine holds
  // up one unit, not its share). Larger groups: dynamic loops.
  const bool contig = nmax <= kQnt;
  std::unique_ptr<Deque[]> dq(new Deque[2 * nth]);  // [thread] phase 1, [nth + thread] phase 2
#pragma omp parallel num_threads(nth)
  {
    std::vector<float> gres(nmax), ures(nmax);
    Stream none;
    if (!contig) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < ng * u1; ++w) unit1(w, gres.data(), ures.data(), none);
#pragma omp for schedule(dynamic, 1)
      for (int64_t w = 0; w < ng * u2; ++w) unit2(w, gres.data(), none);
    } else {
      const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
      auto lo = [&](int64_t n, int64_t v) { return n * v / nt; };  // thread v's first unit
      const int64_t n1 = ng * u1, n2 = ng * u2;
      dq[tid].reset(static_cast<uint32_t>(lo(n1, tid + 1) - lo(n1, tid)));
      dq[nth + tid].reset(static_cast<uint32_t>(lo(n2, tid + 1) - lo(n2, tid)));
      std::vector<const char*> sb, se;  // the thread's code segments, in reading order
      auto add = [&](const uint8_t* p, int64_t n) {
        const char* b = reinterpret_cast<const char*>(p);
        if (!se.empty() && se.back() == b) se.back() = b + n;
        else { sb.push_back(b); se.push_back(b + n); }
      };
      for (int64_t w = lo(n1, tid); w < lo(n1, tid + 1); ++w) {
        const QMat m = expert_mat<FMT>(q, true, c.groups[w / u1].expert, H, I);
        const int64_t r0 = (w % u1) * kRows1, n = std::min(I, r0 + kRows1) - r0;
        add(m.data + r0 * (H / rb), n * (H / rb));
        add(m.data + (I + r0) * (H / rb), n * (H / rb));
      }
      for (int64_t w = lo(n2, tid); w < lo(n2, tid + 1); ++w) {
        const QMat m = expert_mat<FMT>(q, false, c.groups[w / u2].expert, H, I);
        const int64_t r0 = (w % u2) * kRows2, n = std::min(H, r0 + kRows2) - r0;
        add(m.data + r0 * (I / rb), n * (I / rb));
      }
      Stream pf;
      if (!sb.empty() && g_prefetch > 0) {
        pf.seg_b = sb.data();
        pf.seg_e = se.data();
        pf.nseg = static_cast<int>(sb.size());
        pf.p = sb[0];
        pf.step(g_pf_dist);
      }
#pragma omp barrier
      for (int64_t k; (k = dq[tid].take_front()) >= 0;)
        unit1(lo(n1, tid) + k, gres.data(), ures.data(), pf);
      for (int64_t d = 1; g_steal && d < nt; ++d)
        for (int64_t v = (tid + d) % nt, k; (k = dq[v].take_back()) >= 0;)
          unit1(lo(n1, v) + k, gres.data(), ures.data(), none);
#pragma omp barrier
      for (int64_t k; (k = dq[nth + tid].take_front()) >= 0;)
        unit2(lo(n2, tid) + k, gres.data(), pf);
      for (int64_t d = 1; g_steal && d < nt; ++d)
        for (int64_t v = (tid + d) % nt, k; (k = dq[nth + v].take_back()) >= 0;)
          unit2(lo(n2, v) + k, gres.data(), none);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 if an expert id is out of [0, E), 2 on a bad format code, 3 on a
// shape the kernel does not take (H or I not a multiple of 32, an fp8 block not a multiple of
// 32). fmt: 0 = fp8 (scales fp32 block grids, `block` their edge), 1 = mxfp4 (e8m0 scales).
// act: kActOai with gu_bias / dn_bias / bias_ids (gpt-oss's, see the top); kActPlain or
// kActClamp with them null; 2 on any other combination.
int ft_cpu_experts_q(const float* x, int64_t T, int64_t H, const int64_t* ids, int64_t K,
                     const uint8_t* mask, const uint8_t* gate_up, const void* gate_up_scale,
                     const uint8_t* down, const void* down_scale, int64_t E, int64_t I,
                     int fmt, int64_t block, float* out, int nthreads, const float* gu_bias,
                     const float* dn_bias, const int64_t* bias_ids, float alpha, float limit,
                     int act) {
  if (fmt != 0 && fmt != 1) return 2;
  if (act != kActPlain && act != kActOai && act != kActClamp) return 2;
  if ((act == kActOai) != (gu_bias != nullptr)) return 2;
  if (H % kChunk || I % kChunk || (fmt == 0 && (block <= 0 || block % kChunk))) return 3;
  if (std::max(H, I) > kChunk * kMaxScales) return 3;
  const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
  ExpertCall c;
  const int rc = expert_prepare(c, x, T, H, ids, K, mask, gate_up, down, E, I, 0, out, nth, 0,
                                false);
  if (rc != 0 || c.groups.empty()) return rc;
  if (gu_bias && (!dn_bias || !bias_ids)) return 2;
  const QCall q{gate_up, down, gate_up_scale, down_scale, block, gu_bias, dn_bias, bias_ids,
                alpha, limit, act};
  if (fmt == 0) run_quant<0>(c, q, nth);
  else run_quant<1>(c, q, nth);
  return 0;
}

}  // extern "C"

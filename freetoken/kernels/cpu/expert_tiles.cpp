// The interleaved-tile path of the expert kernel (groups of any size; the decode path is
// expert_kernel.cpp's): phase 1 splits every routed expert's gate/up rows into blocks (one
// worksharing item each: the block is streamed once and dotted with all n token vectors, tiled
// so the rows stay in L1), phase 2 does the same over down rows.
//
// Shape legend: as expert_call.h (T tokens, K top-k, E experts, H hidden, I intermediate, n
// entries routed to one expert).
#include "expert_call.h"

namespace {

using namespace ft;

// Software prefetch of the next tile's rows while this tile streams: two contiguous blocks
// (next gate rows, next up rows; or next down rows), spread evenly over this tile's iterations.
// The hardware streamer stops at each 4 KB page and the rows of a tile are interleaved streams,
// so without this a core keeps too few misses in flight to reach its share of DRAM bandwidth.
struct Prefetch {
  const char* p[2] = {nullptr, nullptr};
  const char* end[2] = {nullptr, nullptr};
  int per_iter = 0;
  inline void step() {
#if defined(__AVX2__) || defined(__AVX512F__)
    for (int b = 0; b < 2; ++b)
      for (int q = 0; q < per_iter && p[b] < end[b]; ++q, p[b] += 64)
        _mm_prefetch(p[b], _MM_HINT_T0);
#endif
  }
  inline void step(int64_t) { step(); }
};


inline Prefetch make_prefetch(const void* a, const void* b, int64_t block_bytes, int64_t len) {
  Prefetch pf;
  const int64_t iters = (len + VL - 1) / VL;
  if (block_bytes <= 0 || iters <= 0 || g_prefetch <= 0) return pf;
  pf.p[0] = static_cast<const char*>(a);
  pf.end[0] = a ? pf.p[0] + block_bytes : nullptr;
  pf.p[1] = static_cast<const char*>(b);
  pf.end[1] = b ? pf.p[1] + block_bytes : nullptr;
  pf.per_iter = static_cast<int>((block_bytes / 64 + iters - 1) / iters);
  return pf;
}

// res[r * NT + t] = rows[r][0:len] . xs[t][0:len]
template <typename W, int NR, int NT, typename PF = Prefetch>
inline void dot_tile(const W* const* rows, const float* const* xs, int64_t len, float* res,
                     PF& pf) {
  V acc[NR][NT];
#pragma GCC unroll 32
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = vzero();
  int64_t j = 0;
  for (; j + VL <= len; j += VL) {
    pf.step(static_cast<int64_t>(NR * VL * sizeof(W)));
    V xv[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) xv[t] = vload(xs[t] + j);
#pragma GCC unroll 32
    for (int r = 0; r < NR; ++r) {
      V w = vload(rows[r] + j);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[r][t] = vfma(w, xv[t], acc[r][t]);
    }
  }
  if (j < len) {
    const int rem = static_cast<int>(len - j);
    V xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = vload_tail(xs[t] + j, rem);
    for (int r = 0; r < NR; ++r) {
      V w = vload_tail(rows[r] + j, rem);
      for (int t = 0; t < NT; ++t) acc[r][t] = vfma(w, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = vsum(acc[r][t]);
}

#ifdef FT_HAVE_DPBF16
// Same contract on bf16 activations: 32 bf16 products per instruction, fp32 accumulation.
template <int NR, int NT>
inline void dot_tile_dp(const uint16_t* const* rows, const uint16_t* const* xs, int64_t len,
                        float* res, Prefetch& pf) {
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < len; j += 32) {
    const int64_t rem = len - j;
    pf.step();
    pf.step();
    const __mmask32 m = rem >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << rem) - 1);
    __m512i xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_maskz_loadu_epi16(m, xs[t] + j);
    for (int r = 0; r < NR; ++r) {
      __m512i w = _mm512_maskz_loadu_epi16(m, rows[r] + j);
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w, (__m512bh)xv[t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) res[r * NT + t] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

// res[r * n + t] for NR rows and n token vectors, in token tiles of at most kNtMax.
// `pf` is applied during the first token tile only (later tiles re-read rows from L1/L2).
template <typename W, typename X, int NR>
void dot_rows(const W* const* rows, const X* const* xs, int n, int64_t len, float* res,
              Prefetch pf) {
  float tmp[NR * kNtMax];
  for (int t0 = 0; t0 < n; t0 += kNtMax, pf = Prefetch()) {
    const int nt = n - t0 < kNtMax ? n - t0 : kNtMax;
    const X* const* xt = xs + t0;
    if constexpr (std::is_same_v<X, float>) {
      if (nt == 1) dot_tile<W, NR, 1>(rows, xt, len, tmp, pf);
      else if (nt == 2) dot_tile<W, NR, 2>(rows, xt, len, tmp, pf);
      else dot_tile<W, NR, kNtMax>(rows, xt, len, tmp, pf);
    } else if constexpr (std::is_same_v<W, uint16_t>) {
#ifdef FT_HAVE_DPBF16
      if (nt == 1) dot_tile_dp<NR, 1>(rows, xt, len, tmp, pf);
      else if (nt == 2) dot_tile_dp<NR, 2>(rows, xt, len, tmp, pf);
      else dot_tile_dp<NR, kNtMax>(rows, xt, len, tmp, pf);
#endif
    }
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < nt; ++t) res[r * n + t0 + t] = tmp[r * nt + t];
  }
}

// Groups of any size on interleaved tiles: phase 1 splits every routed expert's gate/up rows
// into blocks (one worksharing item each: the block is streamed once and dotted with all n
// token vectors, tiled so the rows stay in L1), phase 2 does the same over down rows. Decode-
// size groups cost the same per item: static contiguous chunks, so each thread's next item is
// the memory its prefetch already ran into. Bigger groups: dynamic balance. Orphaned
// worksharing loops: every thread of the enclosing region calls this.
template <typename W>
void tile_team(ExpertCall& c) {
  constexpr bool kBf16 = std::is_same_v<W, uint16_t>;
  const int64_t H = c.H, I = c.I;
  const std::vector<Group>& groups = c.groups;
  const std::vector<int64_t>& entries = c.entries;
  const W* gate_up = static_cast<const W*>(c.gate_up);
  const W* down = static_cast<const W*>(c.down);
  float* out = c.out;
  float* act = c.act.data();
  uint16_t* ab = c.ab.data();
  const auto& xp = c.xp;
  const auto& ap = c.ap;
  const auto& xbp = c.xbp;
  const auto& abp = c.abp;
  constexpr int64_t kRb1 = 16;  // gate rows per phase-1 item (plus the matching up rows)
  constexpr int64_t kRb2 = 32;  // down rows per phase-2 item
  const int64_t nb1 = (I + kRb1 - 1) / kRb1, nb2 = (H + kRb2 - 1) / kRb2;
  const int64_t items1 = static_cast<int64_t>(groups.size()) * nb1;
  const int64_t items2 = static_cast<int64_t>(groups.size()) * nb2;
  std::vector<float> res(static_cast<size_t>(2 * kHalfRows + kDownRows) * kNtMax * 64 + 1);
  auto item1 = [&](int64_t it) {
    const Group& g = groups[it / nb1];
    const int64_t r0 = (it % nb1) * kRb1, r1 = r0 + kRb1 < I ? r0 + kRb1 : I;
    const W* base = gate_up + g.expert * 2 * I * H;
    if (res.size() < static_cast<size_t>(2 * kHalfRows * g.n)) res.resize(2 * kHalfRows * g.n);
    for (int64_t r = r0; r < r1;) {
      const int hr = r1 - r >= kHalfRows ? kHalfRows : 1;
      const W* rows[2 * kHalfRows];
      for (int q = 0; q < hr; ++q) {
        rows[q] = base + (r + q) * H;
        rows[hr + q] = base + (I + r + q) * H;
      }
      const bool dp = kBf16 && g.dp;
      const int64_t nxt = r + hr < I ? (I - r - hr < kHalfRows ? I - r - hr : kHalfRows) : 0;
      const Prefetch pf = make_prefetch(base + (r + hr) * H, base + (I + r + hr) * H,
                                        nxt * H * static_cast<int64_t>(sizeof(W)), H);
      if (hr == kHalfRows) {
        if (dp) dot_rows<W, uint16_t, 2 * kHalfRows>(rows, xbp.data() + g.begin, g.n, H, res.data(), pf);
        else dot_rows<W, float, 2 * kHalfRows>(rows, xp.data() + g.begin, g.n, H, res.data(), pf);
      } else {
        if (dp) dot_rows<W, uint16_t, 2>(rows, xbp.data() + g.begin, g.n, H, res.data(), pf);
        else dot_rows<W, float, 2>(rows, xp.data() + g.begin, g.n, H, res.data(), pf);
      }
      for (int q = 0; q < hr; ++q)
        for (int t = 0; t < g.n; ++t) {
          const float gv = res[q * g.n + t], uv = res[(hr + q) * g.n + t];
          const float a = swiglu(gv, uv, c.act_kind, c.limit);
          act[(g.begin + t) * I + r + q] = a;
          if (dp) ab[(g.begin + t) * I + r + q] = f32_to_bf16(a);
        }
      r += hr;
    }
  };
  auto item2 = [&](int64_t it) {
    const Group& g = groups[it / nb2];
    const int64_t h0 = (it % nb2) * kRb2, h1 = h0 + kRb2 < H ? h0 + kRb2 : H;
    const W* base = down + g.expert * H * I;
    if (res.size() < static_cast<size_t>(kDownRows * g.n)) res.resize(kDownRows * g.n);
    const bool dp = kBf16 && g.dp;
    for (int64_t h = h0; h < h1;) {
      const int nr = h1 - h >= kDownRows ? kDownRows : 1;
      const W* rows[kDownRows];
      for (int q = 0; q < nr; ++q) rows[q] = base + (h + q) * I;
      const int64_t nxt = h + nr < H ? (H - h - nr < kDownRows ? H - h - nr : kDownRows) : 0;
      const Prefetch pf = make_prefetch(base + (h + nr) * I, nullptr,
                                        nxt * I * static_cast<int64_t>(sizeof(W)), I);
      if (nr == kDownRows) {
        if (dp) dot_rows<W, uint16_t, kDownRows>(rows, abp.data() + g.begin, g.n, I, res.data(), pf);
        else dot_rows<W, float, kDownRows>(rows, ap.data() + g.begin, g.n, I, res.data(), pf);
      } else {
        if (dp) dot_rows<W, uint16_t, 1>(rows, abp.data() + g.begin, g.n, I, res.data(), pf);
        else dot_rows<W, float, 1>(rows, ap.data() + g.begin, g.n, I, res.data(), pf);
      }
      for (int q = 0; q < nr; ++q)
        for (int t = 0; t < g.n; ++t) out[entries[g.begin + t] * H + h + q] = res[q * g.n + t];
      h += nr;
    }
  };
  if (c.small) {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items1; ++it) item1(it);
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items2; ++it) item2(it);
  } else {
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items1; ++it) item1(it);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items2; ++it) item2(it);
  }
}

}  // namespace

namespace ft {

void expert_tiles(ExpertCall& c) {
  if (c.wdtype == 1) tile_team<uint16_t>(c);
  else tile_team<float>(c);
}

}  // namespace ft

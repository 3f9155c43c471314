// CPU SwiGLU expert kernel: per (token, k) unweighted outputs, weights read once per call.
// The activation is the plain SwiGLU or DeepSeek-V4's clamped one (expert_call.h `swiglu`).
//
// Shape legend: T tokens, K routed experts per token, E experts, H hidden, I intermediate,
// n entries (t, k) routed to one expert.
//   x [T, H] fp32, ids [T, K] int64, mask [T, K] uint8 (nullable),
//   gate_up [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up), down [E, H, I]: both fp32 or bf16,
//   out [T, K, H] fp32; rows of masked-out entries are not touched.
//
// Plain C ABI (called through ctypes so the GIL is released while it runs). The ISA is picked
// at build time from flags the loader chooses after reading the CPU's features:
//   avx512bf16: bf16 rows widened to fp32 + FMA for small n (bandwidth-bound decode: exact fp32
//               activations), _mm512_dpbf16_ps on bf16 activations for n >= kDpMinTokens
//               (compute-bound prefill-size groups);
//   avx512 / avx2: widen + FMA;  scalar: plain loops (any CPU).
// Work: decode-size groups (here) give each thread contiguous row blocks of every expert, with
// work stealing; other groups take the interleaved-tile path (expert_tiles.cpp). Both run as
// the body of a team (expert_call.h): one parallel region per ft_cpu_experts call, or the
// bridge's one region per decode step (bridge_kernel.cpp).
#include "expert_call.h"

namespace {

using namespace ft;

#ifdef FT_HAVE_DPBF16
constexpr int kDpMinTokens = 4;
#endif

int g_contig = 1;    // ft_cpu_set_contig: 0 = decode groups use the interleaved-tile path
// res[(r - r0) * n + t] = rows r0..r1-1 of `base` (row length len) . xs[t], for t < n
// (n <= kNtMax), one row after another in address order.
template <typename W>
inline void dot_block(const W* base, int64_t r0, int64_t r1, int64_t len,
                      const float* const* xs, int n, float* res, Stream& pf) {
  for (int64_t r = r0; r < r1; ++r) {
    const W* row = base + r * len;
    float* o = res + (r - r0) * n;
    if (n == 1) dot_row_seq<W, 1, 4>(row, xs, len, o, pf);
    else if (n == 2) dot_row_seq<W, 2, 2>(row, xs, len, o, pf);
    else dot_row_seq<W, kNtMax, 2>(row, xs, len, o, pf);
  }
}

constexpr int64_t kRowUnit = 8;  // static split granularity (8 rows: whole pages at H=2048 bf16)
constexpr int64_t kUnit1 = 8;    // phase-1 work unit: 8 gate rows + the matching 8 up rows
constexpr int64_t kUnit2 = 32;   // phase-2 work unit: 32 down rows


// Per-call timing of the decode path, for ft_cpu_last_timing: per thread, ns from the call's
// entry to its entry into the parallel region, to its own phase-1 units done, to its last unit;
// and the number of units it stole.
constexpr int kMaxTimed = 256;
double g_tm[kMaxTimed][4];
int g_tm_threads = 0;
std::chrono::steady_clock::time_point g_call_t0;

inline double ns_since_call() {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - g_call_t0)
      .count();
}


// Decode-size groups (every n <= kNtMax, fp32 activations). Each thread owns one contiguous
// block of gate rows, the matching up rows and one contiguous block of down rows of every
// expert (its static share), cut into units, and reads them in address order with its Stream
// prefetch running ahead through all of them, so a core streams a few long sequential regions.
// A call lasts as long as its slowest thread, and at decode sizes (~0.5 ms) a core that gets
// less of the memory bandwidth for a moment decides that: threads that finish their share steal
// units from the back of the others' (phase-1 units first). Phase 2 of an expert waits only for
// that expert's gate/up rows (a row count per expert, no barrier), helping with phase-1 units
// while it waits. Each output row is still computed by one dot product, so results do not
// depend on who computed what.
template <typename W>
void small_team(ExpertCall& c, int64_t tid, int64_t nt) {
  const int64_t H = c.H, I = c.I;
  float* out = c.out;
  const std::vector<Group>& groups = c.groups;
  const std::vector<int64_t>& entries = c.entries;
  const std::vector<const float*>& xp = c.xp;
  const std::vector<const float*>& ap = c.ap;
  float* act = c.act.data();
  const W* gate_up = static_cast<const W*>(c.gate_up);
  const W* down = static_cast<const W*>(c.down);
  const int ng = static_cast<int>(groups.size());
  int nmax = 1;
  for (const Group& g : groups) nmax = g.n > nmax ? g.n : nmax;
  RowCount* done = c.done.get();  // phase-1 rows finished, per group
  Deque* dq1 = c.dq1.get();
  Deque* dq2 = c.dq2.get();
  const int64_t u1 = (I + kRowUnit - 1) / kRowUnit, u2 = (H + kRowUnit - 1) / kRowUnit;
  // static share of thread t of nt: rows [r0, r1) of `len` split in kRowUnit units
  auto share = [](int64_t units, int64_t len, int64_t t, int64_t nt, int64_t& r0, int64_t& r1) {
    r0 = std::min<int64_t>(len, units * t / nt * kRowUnit);
    r1 = std::min<int64_t>(len, units * (t + 1) / nt * kRowUnit);
  };
  auto chunks = [](int64_t r0, int64_t r1, int64_t unit) {
    return r1 > r0 ? (r1 - r0 + unit - 1) / unit : 0;
  };
  const bool steal = g_steal != 0;
  const bool timed = c.timed && nt <= kMaxTimed;
  {
    const double t_enter = timed ? ns_since_call() : 0.0;
    int64_t a0, a1, c0, c1;
    share(u1, I, tid, nt, a0, a1);
    share(u2, H, tid, nt, c0, c1);
    const int64_t ch1 = chunks(a0, a1, kUnit1), ch2 = chunks(c0, c1, kUnit2);
    dq1[tid].reset(static_cast<uint32_t>(ng * ch1));
    dq2[tid].reset(static_cast<uint32_t>(ng * ch2));
    // the owner's read sequence, in unit order: per expert, per unit its gate rows then its
    // up rows; then per expert its down rows (contiguous across that expert's units)
    std::vector<const char*> sb, se;
    sb.reserve(2 * ng * ch1 + ng);
    se.reserve(sb.capacity());
    auto add = [&](const W* p, int64_t elems) {
      if (elems <= 0) return;
      sb.push_back(reinterpret_cast<const char*>(p));
      se.push_back(reinterpret_cast<const char*>(p + elems));
    };
    for (const Group& g : groups) {
      const W* base = gate_up + g.expert * 2 * I * H;
      for (int64_t r = a0; r < a1; r += kUnit1) {
        const int64_t n = std::min(kUnit1, a1 - r) * H;
        add(base + r * H, n);
        add(base + (I + r) * H, n);
      }
    }
    for (const Group& g : groups) add(down + g.expert * H * I + c0 * I, (c1 - c0) * I);
    Stream pf;
    if (!sb.empty() && g_prefetch > 0) {
      pf.seg_b = sb.data();
      pf.seg_e = se.data();
      pf.nseg = static_cast<int>(sb.size());
      pf.p = sb[0];
      pf.step(g_pf_dist);
    }
    std::vector<float> gres(static_cast<size_t>(std::max(kUnit1, kUnit2) * nmax));
    std::vector<float> ures(gres.size());

    // unit u of thread v's deque -> (group, rows): `units`/`len` as in share(), `unit` rows
    auto unit_rows = [&](int64_t units, int64_t len, int64_t unit, int64_t v, int64_t u,
                         int& gi, int64_t& r0, int64_t& r1) {
      int64_t b0, b1;
      share(units, len, v, nt, b0, b1);
      const int64_t c = chunks(b0, b1, unit);
      gi = static_cast<int>(u / c);
      r0 = b0 + (u % c) * unit;
      r1 = std::min(b1, r0 + unit);
    };
    auto p1_unit = [&](int64_t v, int64_t u, int& gi, int64_t& r0, int64_t& r1) {
      unit_rows(u1, I, kUnit1, v, u, gi, r0, r1);
    };
    auto p2_unit = [&](int64_t v, int64_t u, int& gi, int64_t& r0, int64_t& r1) {
      unit_rows(u2, H, kUnit2, v, u, gi, r0, r1);
    };
    auto do_p1 = [&](int gi, int64_t r0, int64_t r1, Stream& s) {
      const Group& g = groups[gi];
      const W* base = gate_up + g.expert * 2 * I * H;
      const float* const* xs = xp.data() + g.begin;
      dot_block<W>(base, r0, r1, H, xs, g.n, gres.data(), s);
      dot_block<W>(base, I + r0, I + r1, H, xs, g.n, ures.data(), s);
      for (int64_t r = r0; r < r1; ++r)
        for (int t = 0; t < g.n; ++t) {
          const float gv = gres[(r - r0) * g.n + t], uv = ures[(r - r0) * g.n + t];
          act[(g.begin + t) * I + r] = swiglu(gv, uv, c.act_kind, c.limit);
        }
      done[gi].v.fetch_add(r1 - r0, std::memory_order_release);
    };
    auto do_p2 = [&](int gi, int64_t r0, int64_t r1, Stream& s) {
      const Group& g = groups[gi];
      dot_block<W>(down + g.expert * H * I, r0, r1, I, ap.data() + g.begin, g.n, gres.data(), s);
      for (int t = 0; t < g.n; ++t) {
        float* o = out + entries[g.begin + t] * H;
        for (int64_t h = r0; h < r1; ++h) o[h] = gres[(h - r0) * g.n + t];
      }
    };
    // a stolen unit gets its own short prefetch stream over its rows
    int64_t stolen = 0;
    auto steal_p1 = [&]() -> bool {
      for (int64_t k = 1; k < nt; ++k) {
        const int64_t v = (tid + k) % nt;
        const int64_t u = dq1[v].take_back();
        if (u < 0) continue;
        ++stolen;
        int gi;
        int64_t r0, r1;
        p1_unit(v, u, gi, r0, r1);
        const W* base = gate_up + groups[gi].expert * 2 * I * H;
        const char* b[2] = {reinterpret_cast<const char*>(base + r0 * H),
                            reinterpret_cast<const char*>(base + (I + r0) * H)};
        const char* e[2] = {reinterpret_cast<const char*>(base + r1 * H),
                            reinterpret_cast<const char*>(base + (I + r1) * H)};
        Stream s;
        s.seg_b = b; s.seg_e = e; s.nseg = g_prefetch > 0 ? 2 : 0; s.p = b[0];
        s.step(g_pf_dist);
        do_p1(gi, r0, r1, s);
        return true;
      }
      return false;
    };
    auto wait_ready = [&](int gi) {
      for (int spin = 0; done[gi].v.load(std::memory_order_acquire) < I; ++spin) {
        if (steal && steal_p1()) continue;
        if (spin > 4096) std::this_thread::yield();  // oversubscribed: let the others run
        else cpu_relax();
      }
    };

    int64_t u;
    while ((u = dq1[tid].take_front()) >= 0) {
      int gi;
      int64_t r0, r1;
      p1_unit(tid, u, gi, r0, r1);
      do_p1(gi, r0, r1, pf);
    }
    const double t_p1 = timed ? ns_since_call() : 0.0;
    while ((u = dq2[tid].take_front()) >= 0) {
      int gi;
      int64_t r0, r1;
      p2_unit(tid, u, gi, r0, r1);
      wait_ready(gi);
      do_p2(gi, r0, r1, pf);
    }
    if (steal) {
      while (steal_p1()) {
      }
      for (int64_t k = 1; k < nt; ++k) {
        const int64_t v = (tid + k) % nt;
        while ((u = dq2[v].take_back()) >= 0) {
          ++stolen;
          int gi;
          int64_t r0, r1;
          p2_unit(v, u, gi, r0, r1);
          wait_ready(gi);
          const W* base = down + groups[gi].expert * H * I;
          const char* b[1] = {reinterpret_cast<const char*>(base + r0 * I)};
          const char* e[1] = {reinterpret_cast<const char*>(base + r1 * I)};
          Stream s;
          s.seg_b = b; s.seg_e = e; s.nseg = g_prefetch > 0 ? 1 : 0; s.p = b[0];
          s.step(g_pf_dist);
          do_p2(gi, r0, r1, s);
        }
      }
    }
    if (timed) {
      g_tm[tid][0] = t_enter;
      g_tm[tid][1] = t_p1;
      g_tm[tid][2] = ns_since_call();
      g_tm[tid][3] = static_cast<double>(stolen);
      if (tid == 0) g_tm_threads = static_cast<int>(nt);
    }
  }
}

}  // namespace

namespace ft {

int expert_prepare(ExpertCall& c, const float* x, int64_t T, int64_t H, const int64_t* ids,
                   int64_t K, const uint8_t* mask, const void* gate_up, const void* down,
                   int64_t E, int64_t I, int wdtype, float* out, int nth, int allow_dp,
                   bool skip_negative) {
  c.T = T, c.H = H, c.K = K, c.I = I, c.wdtype = wdtype;
  c.gate_up = gate_up, c.down = down, c.out = out;
  c.groups.clear();
  // Counting sort of the computed entries by expert: each expert's rows are read once.
  c.count.assign(E, 0);
  c.start.assign(E, 0);
  auto computed = [&](int64_t j) {
    return (!mask || mask[j]) && !(skip_negative && ids[j] < 0);
  };
  for (int64_t j = 0; j < T * K; ++j) {
    if (!computed(j)) continue;
    if (ids[j] < 0 || ids[j] >= E) return 1;
    ++c.count[ids[j]];
  }
  int64_t pos = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (!c.count[e]) continue;
    c.start[e] = pos;
    bool dp = false;
#ifdef FT_HAVE_DPBF16
    dp = allow_dp && wdtype == 1 && c.count[e] >= kDpMinTokens;
#else
    (void)allow_dp;
#endif
    c.groups.push_back(Group{e, pos, c.count[e], dp});
    pos += c.count[e];
  }
  c.entries.resize(pos);
  for (int64_t j = 0; j < T * K; ++j)
    if (computed(j)) c.entries[c.start[ids[j]]++] = j;
  const int64_t n_ent = pos;
  bool any_dp = false;
  for (const Group& g : c.groups) any_dp = any_dp || g.dp;
  c.xp.resize(n_ent);
  c.ap.resize(n_ent);
  c.act.resize(n_ent * I);
  c.xb.resize(any_dp ? n_ent * H : 0);
  c.ab.resize(any_dp ? n_ent * I : 0);
  c.xbp.assign(n_ent, nullptr);
  c.abp.assign(n_ent, nullptr);
  for (int64_t j = 0; j < n_ent; ++j) {
    c.xp[j] = x + (c.entries[j] / K) * H;
    c.ap[j] = c.act.data() + j * I;
    if (any_dp) {
      c.xbp[j] = c.xb.data() + j * H;
      c.abp[j] = c.ab.data() + j * I;
    }
  }
  c.small = !any_dp;
  for (const Group& g : c.groups) c.small = c.small && g.n <= kNtMax;
  c.contig = c.small && g_contig;
  if (c.contig) {
    const size_t ng = c.groups.empty() ? 1 : c.groups.size();
    c.done.reset(new RowCount[ng]);
    c.dq1.reset(new Deque[nth > 0 ? nth : 1]);
    c.dq2.reset(new Deque[nth > 0 ? nth : 1]);
    return 0;
  }
  for (const Group& g : c.groups)
    if (g.dp)
      for (int64_t j = g.begin; j < g.begin + g.n; ++j)
        for (int64_t h = 0; h < H; ++h) c.xb[j * H + h] = f32_to_bf16(c.xp[j][h]);
  return 0;
}

void expert_team(ExpertCall& c, int tid, int nt) {
  if (c.groups.empty()) return;
  if (c.contig) {
    if (c.wdtype == 1) small_team<uint16_t>(c, tid, nt);
    else small_team<float>(c, tid, nt);
  } else {
    expert_tiles(c);
  }
}

}  // namespace ft

extern "C" {

const char* ft_cpu_isa() { return FT_ISA; }

// Benchmark knob: 0 disables the software prefetch of the next tile (for A/B timing).
void ft_cpu_set_prefetch(int on) { g_prefetch = on; }

// Benchmark knobs: prefetch distance (bytes ahead) of the decode path, and 0 to send decode
// groups through the interleaved-tile path instead of the per-thread contiguous blocks.
void ft_cpu_set_prefetch_distance(int64_t bytes) { g_pf_dist = bytes > 0 ? bytes : 0; }
void ft_cpu_set_contig(int on) { g_contig = on; }
void ft_cpu_set_steal(int on) { g_steal = on; }

// Timing of the last decode-path call: fills out[4 * t + k] (k: region entry, own phase-1
// units done, last unit done, all in ns from the call's entry; units stolen) for each thread t;
// returns the thread count (0 when the last call did not take the decode path).
int ft_cpu_last_timing(double* out, int cap) {
  const int n = g_tm_threads < cap ? g_tm_threads : cap;
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < 4; ++k) out[4 * t + k] = g_tm[t][k];
  return n;
}
void ft_cpu_set_prefetch_hint(int hint) { g_pf_hint = hint >= 0 && hint <= 3 ? hint : 1; }

// Host read-bandwidth probe: sums n floats with nthreads threads, each streaming one contiguous
// slice once (the access pattern of the expert kernel, no arithmetic in the way). pf_dist > 0
// adds the decode path's software prefetch that far ahead (the hardware streamer alone can
// leave bandwidth unused, so the ceiling is the better of the two).
float ft_stream_sum(const float* p, int64_t n, int nthreads, int64_t pf_dist) {
  const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
  float total = 0.f;
#pragma omp parallel num_threads(nth) reduction(+ : total)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t b = n * tid / nt, e = n * (tid + 1) / nt;
    const char* seg_b = reinterpret_cast<const char*>(p + b);
    const char* seg_e = reinterpret_cast<const char*>(p + e);
    Stream pf;
    if (pf_dist > 0 && e > b) {
      pf.seg_b = &seg_b;
      pf.seg_e = &seg_e;
      pf.nseg = 1;
      pf.p = seg_b;
      pf.step(pf_dist);
    }
    V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    int64_t j = b;
    for (; j + 4 * VL <= e; j += 4 * VL) {
      pf.step(4 * VL * static_cast<int64_t>(sizeof(float)));
      a0 = vfma(vload(p + j), vload(p + j), a0);
      a1 = vfma(vload(p + j + VL), vload(p + j + VL), a1);
      a2 = vfma(vload(p + j + 2 * VL), vload(p + j + 2 * VL), a2);
      a3 = vfma(vload(p + j + 3 * VL), vload(p + j + 3 * VL), a3);
    }
    float s = vsum(a0) + vsum(a1) + vsum(a2) + vsum(a3);
    for (; j < e; ++j) s += p[j] * p[j];
    total += s;
  }
  return total;
}

// Returns 0 on success, 1 if an expert id is out of [0, E), 2 on a bad dtype or act code.
// wdtype: 0 = fp32 weights, 1 = bf16 weights. nthreads <= 0: OpenMP's default. act: kActPlain
// or kActClamp (with `limit`; expert_call.h).
int ft_cpu_experts(const float* x, int64_t T, int64_t H, const int64_t* ids, int64_t K,
                   const uint8_t* mask, const void* gate_up, const void* down, int64_t E,
                   int64_t I, int wdtype, float* out, int nthreads, int allow_dp, int act,
                   float limit) {
  if (wdtype != 0 && wdtype != 1) return 2;
  if (act != kActPlain && act != kActClamp) return 2;
  g_call_t0 = std::chrono::steady_clock::now();
  g_tm_threads = 0;
  const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
  ExpertCall c;
  const int rc = expert_prepare(c, x, T, H, ids, K, mask, gate_up, down, E, I, wdtype, out,
                                nth, allow_dp, false);
  if (rc != 0 || c.groups.empty()) return rc;
  c.act_kind = act;
  c.limit = limit;
  c.timed = c.contig;
#pragma omp parallel num_threads(nth)
  expert_team(c, omp_get_thread_num(), omp_get_num_threads());
  return 0;
}

}  // extern "C"

// One prepared call of the expert kernel (expert_kernel.cpp), run by a team of threads that
// some OpenMP parallel region already holds: ft_cpu_experts opens one region per call, the
// bridge's step loop (bridge_kernel.cpp) one region per decode step for all its layers.
//
// Shape legend: T tokens, K routed experts per token, E experts, H hidden, I intermediate,
// n entries (t, k) routed to one expert.
// ext.py hashes this header (and simd.h) into the build flags, so editing it rebuilds.
#pragma once
#include "simd.h"

namespace ft {

// The experts' activation codes (freetoken/kernels/expert_act.py `act_code`): the plain SwiGLU,
// gpt-oss's biased one (the quantized kernel only: it takes the biases), DeepSeek-V4's clamp.
constexpr int kActPlain = 0, kActOai = 1, kActClamp = 2;

// The activation of one (gate, up) pair without biases: silu(g) * u, under kActClamp
// silu(min(g, limit)) * clamp(u, -limit, limit).
inline float swiglu(float g, float u, int act, float limit) {
  if (act == kActClamp) {
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
  }
  return g / (1.f + std::exp(-g)) * u;
}

struct Group {
  int64_t expert;
  int64_t begin;  // into the grouped entry order
  int n;
  bool dp;  // use bf16 activations + dpbf16
};

struct ExpertCall {
  int64_t T = 0, H = 0, K = 0, I = 0;
  int wdtype = 0;  // 0 fp32 weights, 1 bf16
  int act_kind = 0;   // kAct* (the dense kernel: kActPlain or kActClamp)
  float limit = 0.f;  // kActClamp's limit
  const void* gate_up = nullptr;  // [E, 2I, H]
  const void* down = nullptr;     // [E, H, I]
  float* out = nullptr;           // [T, K, H]
  std::vector<Group> groups;
  std::vector<int64_t> entries;   // flat (t*K + k) entry per grouped position
  std::vector<const float*> xp;   // per grouped entry: its token's x row
  std::vector<const float*> ap;   // per grouped entry: its act row
  std::vector<float> act;         // [n, I] swiglu(g, u), grouped order
  std::vector<uint16_t> xb, ab;   // bf16 copies of x rows and act rows (dpbf16 groups)
  std::vector<const uint16_t*> xbp, abp;
  bool contig = false;  // every group takes the decode path (per-thread contiguous blocks)
  bool small = false;   // every group is decode-size (static schedule on the tile path)
  bool timed = false;   // record per-thread timing (ft_cpu_last_timing)
  std::unique_ptr<RowCount[]> done;     // [groups] phase-1 rows finished (decode path)
  std::unique_ptr<Deque[]> dq1, dq2;    // [threads] phase-1 / phase-2 units (decode path)
  std::vector<int32_t> count;           // scratch of the grouping [E]
  std::vector<int64_t> start;           // scratch of the grouping [E]
};

// Groups the masked entries by expert and sets up every buffer of the call for a team of at
// most `nth` threads. skip_negative: entries with a negative id are not computed (else an id
// outside [0, E) is an error). Returns 0, or 1 for an expert id out of range.
int expert_prepare(ExpertCall& c, const float* x, int64_t T, int64_t H, const int64_t* ids,
                   int64_t K, const uint8_t* mask, const void* gate_up, const void* down,
                   int64_t E, int64_t I, int wdtype, float* out, int nth, int allow_dp,
                   bool skip_negative);

// The call's work for thread `tid` of a team of `nt` (nt <= the prepare's nth): every thread
// of the enclosing parallel region calls it once; it returns when the whole call is done
// except for the other threads' last units (the caller joins the team before reusing `c`).
void expert_team(ExpertCall& c, int tid, int nt);

// The interleaved-tile path of expert_team (expert_tiles.cpp): orphaned worksharing loops,
// so every thread of the enclosing region calls it.
void expert_tiles(ExpertCall& c);

}  // namespace ft

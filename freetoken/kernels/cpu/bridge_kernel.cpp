// The CPU branch of a captured decode step in one call per step (freetoken/experts/cpu_bridge.py
// has the protocol): the bridge's worker thread calls ft_bridge_run_step(seq) once, which opens
// ONE OpenMP parallel region for every MoE layer of the step. Per layer m, thread 0 spins on
// go[m] == seq in the flag array the GPU stores to (mapped pinned memory), groups the layer's
// masked entries (expert_prepare) and releases the team; every thread runs the layer
// (expert_team: gate/up then down, the same dot products as ft_cpu_experts); the last thread
// out writes the results into the pinned output and stores done[m] = seq (release), and the
// team goes on to layer m + 1. No fork/join, no futex sleep, no Python between layers.
//
// Shape legend: L layers, B rows of the bucket, T rows of this step (T <= B), K top-k,
// E experts, H hidden, I intermediate.
//   x [L, B, H] fp32|bf16, ids [L, B, K] int64, mask [L, B, K] bool, out [L, B, K, H] as x,
//   go, done [L] int64; gate_up[m] [E, 2I, H], down[m] [E, H, I] fp32|bf16 (one dtype).
#include <pthread.h>
#include <sched.h>

#include "expert_call.h"

namespace {

using namespace ft;
using Clock = std::chrono::steady_clock;

struct alignas(64) Gen {
  std::atomic<int64_t> v{0};
};

struct Bridge {
  int64_t L, B, K, H, E, I;
  int wdtype;  // weights: 0 fp32, 1 bf16
  int xdtype;  // x and out: 0 fp32, 1 bf16
  std::vector<const void*> gate_up, down;  // [L]
  const void* x;
  const int64_t* ids;
  const uint8_t* mask;
  void* out;
  int64_t* go;
  int64_t* done;
  int nth;
  int64_t pauses;         // spin_until's pause phase
  int64_t throttle_ns = 0;  // extra busy time per expert computed (a slower host: tests)
  std::vector<int> cpus;  // pin team thread t to cpus[t % n] (empty: no pinning)
  std::vector<float> xf;  // [B, H] the layer's x in fp32 (bf16 x)
  std::vector<float> of;  // [B, K, H] the layer's results in fp32 (bf16 out)
  ExpertCall call;
};

// torch's float -> bfloat16 (round to nearest even, NaN -> 0x7FC0), so results match the
// Python path's `.to(torch.bfloat16)` bit for bit
inline uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  return f32_to_bf16(f);
}

inline double ns_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

// Spin until pred() or `deadline` passes (then false): `pauses` polls with pause first, then
// a yield per poll, so on an oversubscribed machine (tests on 2 cores) the thread we wait for
// still gets to run. With a core per thread the pause phase is long and a yield is rare.
template <typename P>
inline bool spin_until(P pred, Clock::time_point deadline, int64_t pauses) {
  for (int64_t n = 0; !pred(); ++n) {
    if (n < pauses) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
    if ((n & 255) == 255 && Clock::now() > deadline) return pred();
  }
  return true;
}

void pin_self(const Bridge& b, int tid) {
  if (b.cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(b.cpus[tid % b.cpus.size()], &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

}  // namespace

extern "C" {

// gate_up_ptrs / down_ptrs: [L] addresses of each layer's banks. Returns an opaque handle.
void* ft_bridge_new(int64_t L, int64_t B, int64_t K, int64_t H, int64_t E, int64_t I,
                    int wdtype, int xdtype, const int64_t* gate_up_ptrs,
                    const int64_t* down_ptrs, const void* x, const int64_t* ids,
                    const uint8_t* mask, void* out, int64_t* go, int64_t* done, int nth,
                    int64_t pauses) {
  auto* b = new Bridge();
  b->L = L, b->B = B, b->K = K, b->H = H, b->E = E, b->I = I;
  b->wdtype = wdtype, b->xdtype = xdtype;
  for (int64_t m = 0; m < L; ++m) {
    b->gate_up.push_back(reinterpret_cast<const void*>(gate_up_ptrs[m]));
    b->down.push_back(reinterpret_cast<const void*>(down_ptrs[m]));
  }
  b->x = x, b->ids = ids, b->mask = mask, b->out = out, b->go = go, b->done = done;
  b->nth = nth > 0 ? nth : omp_get_max_threads();
  b->pauses = pauses;
  b->xf.resize(B * H);
  b->of.resize(B * K * H);
  return b;
}

void ft_bridge_free(void* h) { delete static_cast<Bridge*>(h); }

// Pin team thread t to cpus[t % n] (n = 0: no pinning), from the next step on.
void ft_bridge_set_cpus(void* h, const int* cpus, int n) {
  auto* b = static_cast<Bridge*>(h);
  b->cpus.assign(cpus, cpus + n);
}

// Simulate a host whose expert branch is slower (benchmarks, tests of bandwidth re-profiling):
// from the next step on, thread 0 stays busy ns_per_expert more per expert a layer computes,
// before the team runs the layer. 0: off.
void ft_bridge_set_throttle(void* h, int64_t ns_per_expert) {
  static_cast<Bridge*>(h)->throttle_ns = ns_per_expert > 0 ? ns_per_expert : 0;
}

// Runs step `seq` over rows [0, T) of every layer. stats (6 doubles): ns thread 0 waited for
// go flags, ns of the whole call, the longest wait (ns) and its layer, the layer that failed,
// the experts computed (distinct experts per layer, summed over the layers: the bytes of the
// step's CPU branch are that many experts' weights).
// Returns 0; 1 an expert id out of [0, E) (entries with a negative id are skipped); 3 go[m]
// did not reach seq within timeout_s; 4 T out of [0, B].
int ft_bridge_run_step(void* h, int64_t seq, int64_t T, double timeout_s, double* stats) {
  auto& b = *static_cast<Bridge*>(h);
  for (int k = 0; k < 6; ++k) stats[k] = 0.0;
  stats[4] = -1;
  if (T < 0 || T > b.B) return 4;
  const auto t_call = Clock::now();
  const auto budget = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout_s));
  Gen start, arrived, finished;  // layers released by thread 0 / threads out / layers done
  std::atomic<int> status{0};
  const int64_t H = b.H, K = b.K, L = b.L;
  const size_t xb = b.xdtype == 1 ? 2 : 4;
  double wait_ns = 0.0, max_wait = 0.0;
  int64_t max_layer = -1, failed = -1, experts = 0;
#pragma omp parallel num_threads(b.nth)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    pin_self(b, tid);  // every step: the runtime may hand the region other threads
    for (int64_t m = 0; m < L; ++m) {
      if (tid == 0) {
        // the layer before must be fully out of `call` before it is prepared again
        spin_until([&] { return finished.v.load(std::memory_order_acquire) >= m; },
                   Clock::time_point::max(), b.pauses);
        const auto t0 = Clock::now();
        const bool arrived_go = spin_until(
            [&] { return __atomic_load_n(&b.go[m], __ATOMIC_ACQUIRE) >= seq; }, t0 + budget,
            b.pauses);
        const double w = ns_between(t0, Clock::now());
        wait_ns += w;
        if (w > max_wait) max_wait = w, max_layer = m;
        int rc = arrived_go ? 0 : 3;
        if (rc == 0) {
          const char* xm = static_cast<const char*>(b.x) + m * b.B * H * xb;
          const float* xs = reinterpret_cast<const float*>(xm);
          if (b.xdtype == 1) {
            const uint16_t* xh = reinterpret_cast<const uint16_t*>(xm);
            for (int64_t j = 0; j < T * H; ++j) b.xf[j] = bf16_to_f32(xh[j]);
            xs = b.xf.data();
          }
          float* o = b.xdtype == 1 ? b.of.data()
                                   : static_cast<float*>(b.out) + m * b.B * K * H;
          rc = expert_prepare(b.call, xs, T, H, b.ids + m * b.B * K, K, b.mask + m * b.B * K,
                              b.gate_up[m], b.down[m], b.E, b.I, b.wdtype, o, nt, 1, true);
          const int64_t g = rc == 0 ? static_cast<int64_t>(b.call.groups.size()) : 0;
          experts += g;
          if (g && b.throttle_ns) {
            const auto until = Clock::now() + std::chrono::nanoseconds(g * b.throttle_ns);
            while (Clock::now() < until) cpu_relax();
          }
        }
        if (rc != 0) {
          failed = m;
          status.store(rc, std::memory_order_relaxed);
        }
        arrived.v.store(0, std::memory_order_relaxed);
        start.v.store(m + 1, std::memory_order_release);
      } else {
        spin_until([&] { return start.v.load(std::memory_order_acquire) > m; },
                   Clock::time_point::max(), b.pauses);
      }
      if (status.load(std::memory_order_relaxed) != 0) break;
      expert_team(b.call, tid, nt);
      if (arrived.v.fetch_add(1, std::memory_order_acq_rel) == nt - 1) {
        // last thread out: every result row of the layer is written
        if (b.xdtype == 1) {
          uint16_t* o = static_cast<uint16_t*>(b.out) + m * b.B * K * H;
          for (const int64_t j : b.call.entries)
            for (int64_t c = 0; c < H; ++c) o[j * H + c] = to_bf16(b.of[j * H + c]);
        }
        __atomic_store_n(&b.done[m], seq, __ATOMIC_RELEASE);
        finished.v.store(m + 1, std::memory_order_release);
      }
    }
  }
  stats[0] = wait_ns;
  stats[1] = ns_between(t_call, Clock::now());
  stats[2] = max_wait;
  stats[3] = static_cast<double>(max_layer);
  stats[4] = static_cast<double>(failed);
  stats[5] = static_cast<double>(experts);
  return status.load();
}

// The GPU's side of the protocol on a host thread (benchmarks and tests, no GPU): for each
// layer store go[m] = seq, spin until done[m] == seq (lat_ns[m]: the time between the two),
// then spin gap_ns (the GPU's work between two MoE layers). Returns 0, or 3 when a done flag
// did not come within timeout_s (lat_ns[m] = -1 from there on). `pauses`: as spin_until's.
int ft_bridge_sim_gpu(int64_t* go, const int64_t* done, int64_t L, int64_t seq, int64_t gap_ns,
                      double timeout_s, double* lat_ns, int64_t pauses) {
  const auto budget = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout_s));
  for (int64_t m = 0; m < L; ++m) lat_ns[m] = -1.0;
  for (int64_t m = 0; m < L; ++m) {
    const auto t0 = Clock::now();
    __atomic_store_n(&go[m], seq, __ATOMIC_RELEASE);
    if (!spin_until([&] { return __atomic_load_n(&done[m], __ATOMIC_ACQUIRE) == seq; },
                    t0 + budget, pauses))
      return 3;
    const auto t1 = Clock::now();
    lat_ns[m] = ns_between(t0, t1);
    const auto until = t1 + std::chrono::nanoseconds(gap_ns);
    spin_until([&] { return Clock::now() >= until; }, Clock::time_point::max(), pauses);
  }
  return 0;
}

// Busy-waits ns nanoseconds on this thread (a stand-in for the CPU share's work in benchmarks).
static void busy_ns(int64_t ns) {
  if (ns <= 0) return;
  const auto until = Clock::now() + std::chrono::nanoseconds(ns);
  while (Clock::now() < until) {
  }
}

// The host's side of a hand-off with work_ns of simulated work per layer (benchmarks): for each
// layer in order, wait until go[m] >= seq, busy-wait work_ns, then store done[m] = seq. Returns
// 0, or 3 when a go flag did not come within timeout_s.
int ft_bridge_echo(const int64_t* go, int64_t* done, int64_t L, int64_t seq, double timeout_s,
                   int64_t pauses, int64_t work_ns) {
  const auto budget = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(timeout_s));
  for (int64_t m = 0; m < L; ++m) {
    if (!spin_until([&] { return __atomic_load_n(&go[m], __ATOMIC_ACQUIRE) >= seq; },
                    Clock::now() + budget, pauses))
      return 3;
    busy_ns(work_ns);
    __atomic_store_n(&done[m], seq, __ATOMIC_RELEASE);
  }
  return 0;
}

// A host-function node's callback (cuLaunchHostFunc; benchmarks). p points at two int64:
// {counter, work_ns}; busy-waits work_ns, then adds one to the counter.
void ft_host_bump(void* p) {
  auto* v = static_cast<int64_t*>(p);
  busy_ns(__atomic_load_n(&v[1], __ATOMIC_ACQUIRE));
  __atomic_add_fetch(&v[0], 1, __ATOMIC_RELEASE);
}

}  // extern "C"

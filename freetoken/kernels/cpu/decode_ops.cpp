// Decode-size CPU kernels beside the experts: a plain linear layer streaming its weight once
// (ft_cpu_linear) and attention of one query row over the paged K/V pool read in place
// (ft_decode_attention). Plain C ABI, called through ctypes (freetoken/kernels/cpu/ext.py).
#include "simd.h"

namespace {

using namespace ft;

// y[t, n] = x[t, :] . w[n, :] for a few rows x (decode-size), the weight read once: each
// thread streams a contiguous block of rows with its prefetch cursor ahead, cut into units that
// idle threads steal from the back (the work-stealing scheme of run_small, one phase). Token
// tiles after the first re-read a row from L1.
template <typename W>
void linear_small(const float* x, int64_t T, int64_t K, const W* w, int64_t N, float* y,
                  int nth) {
  constexpr int64_t kUnit = 32;  // rows per unit
  const int64_t nunits = (N + kUnit - 1) / kUnit;
  std::unique_ptr<Deque[]> dq(new Deque[nth]);
  std::vector<const float*> xs(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) xs[t] = x + t * K;
#pragma omp parallel num_threads(nth)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    auto first_unit = [&](int64_t v) { return nunits * v / nt; };
    const int64_t u0 = first_unit(tid), u1 = first_unit(tid + 1);
    dq[tid].reset(static_cast<uint32_t>(u1 - u0));
    const char* seg_b = reinterpret_cast<const char*>(w + std::min(N, u0 * kUnit) * K);
    const char* seg_e = reinterpret_cast<const char*>(w + std::min(N, u1 * kUnit) * K);
    Stream pf;
    if (seg_e > seg_b && g_prefetch > 0) {
      pf.seg_b = &seg_b;
      pf.seg_e = &seg_e;
      pf.nseg = 1;
      pf.p = seg_b;
      pf.step(g_pf_dist);
    }
    float res[kNtMax];
    Stream none;  // later token tiles: the row is in L1 already
    auto do_unit = [&](int64_t u, Stream& s) {
      const int64_t r0 = u * kUnit, r1 = std::min(N, r0 + kUnit);
      for (int64_t r = r0; r < r1; ++r) {
        const W* row = w + r * K;
        for (int64_t t0 = 0; t0 < T; t0 += kNtMax) {
          const int64_t n = std::min<int64_t>(kNtMax, T - t0);
          Stream& st = t0 == 0 ? s : none;
          if (n == 1) dot_row_seq<W, 1, 4>(row, xs.data() + t0, K, res, st);
          else if (n == 2) dot_row_seq<W, 2, 2>(row, xs.data() + t0, K, res, st);
          else dot_row_seq<W, kNtMax, 2>(row, xs.data() + t0, K, res, st);
          for (int64_t t = 0; t < n; ++t) y[(t0 + t) * N + r] = res[t];
        }
      }
    };
    int64_t i;
    while ((i = dq[tid].take_front()) >= 0) do_unit(u0 + i, pf);
    if (g_steal)
      for (int64_t k = 1; k < nt; ++k) {
        const int64_t v = (tid + k) % nt;
        while ((i = dq[v].take_back()) >= 0) {
          const int64_t u = first_unit(v) + i;
          const char* b = reinterpret_cast<const char*>(w + u * kUnit * K);
          const char* e = reinterpret_cast<const char*>(w + std::min(N, (u + 1) * kUnit) * K);
          Stream s;
          s.seg_b = &b; s.seg_e = &e; s.nseg = g_prefetch > 0 ? 1 : 0; s.p = b;
          s.step(g_pf_dist);
          do_unit(u, s);
        }
      }
  }
}

// v[i] = exp(v[i] - shift) for i < n <= 16 (every v[i] - shift <= 0), returning their sum.
// AVX-512: 2^(x log2 e) split into an integer power (scalef) and a degree-6 polynomial of the
// fraction in [-1/2, 1/2] (relative error ~1e-7); elsewhere std::exp.
inline float exp_shifted(float* v, int n, float shift) {
#if defined(__AVX512F__)
  const __mmask16 mk = static_cast<__mmask16>((1u << n) - 1u);
  __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, v), _mm512_set1_ps(shift));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, k);
  __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512 e = _mm512_scalef_ps(p, k);
  _mm512_mask_storeu_ps(v, mk, e);
  return _mm512_mask_reduce_add_ps(mk, e);
#else
  float sum = 0.f;
  for (int i = 0; i < n; ++i) {
    v[i] = std::exp(v[i] - shift);
    sum += v[i];
  }
  return sum;
#endif
}

// Decode attention over a paged K/V pool, read in place: one query row per sequence attends to
// the keys and values at `slots` ([L] pool rows of [Hk, D]), softmax(q.k * scale) . v, for
// Hq query heads sharing Hk KV heads (GQA). The slots are split over threads; each keeps an
// online softmax (running max, sum and weighted V) per head and the partials merge at the end
// (flash-decoding). Each K/V row is read once for all query heads of its group, a block of
// kAttnBlock slots at a time, the rows kAttnAhead slots on prefetched into L2 (slots need not be
// contiguous). D % VL == 0.
constexpr int64_t kAttnBlock = 16;  // slots per online-softmax update
constexpr int64_t kAttnAhead = 48;  // prefetch distance in slots (16-96 measured alike)

template <typename W>
void decode_attention(const float* q, const W* kp, const W* vp, const int64_t* slots, int64_t L,
                      int64_t Hq, int64_t Hk, int64_t D, float scale, float* out, int nth) {
  const int64_t rep = Hq / Hk, row = Hk * D, nv = D / VL;
  nth = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nth, (L + 63) / 64)));
  std::vector<float> part_m(nth * Hq, -INFINITY), part_l(nth * Hq, 0.f), part_o(nth * Hq * D, 0.f);
#pragma omp parallel num_threads(nth)
  {
    const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t j0 = L * tid / nt, j1 = L * (tid + 1) / nt;
    float* m = part_m.data() + tid * Hq;
    float* l = part_l.data() + tid * Hq;
    float* acc = part_o.data() + tid * Hq * D;
    std::vector<float> qs(Hq * D);
    for (int64_t i = 0; i < Hq * D; ++i) qs[i] = q[i] * scale;
    const int64_t row_bytes = row * static_cast<int64_t>(sizeof(W));
    // blocks of kAttnBlock slots: all scores of the block first, then one running-max update
    // and one pass over the accumulator per head and vector column
    float sc[kAttnBlock];
    for (int64_t j = j0; j < j1; j += kAttnBlock) {
      const int64_t nb = std::min<int64_t>(kAttnBlock, j1 - j);
      for (int64_t g = 0; g < Hk; ++g) {
        for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
          const float* qh = qs.data() + h * D;
          float bmax = -INFINITY;
          for (int64_t b = 0; b < nb; ++b) {
#if defined(__AVX2__) || defined(__AVX512F__)
            if (h == 0 && j + b + kAttnAhead < j1) {  // rows kAttnAhead slots on, spread evenly
              const char* pk = reinterpret_cast<const char*>(kp + slots[j + b + kAttnAhead] * row);
              const char* pv = reinterpret_cast<const char*>(vp + slots[j + b + kAttnAhead] * row);
              for (int64_t off = 0; off < row_bytes; off += 64) {
                _mm_prefetch(pk + off, _MM_HINT_T1);
                _mm_prefetch(pv + off, _MM_HINT_T1);
              }
            }
#endif
            const W* kg = kp + slots[j + b] * row + g * D;
            V a = vzero();
            for (int64_t c = 0; c < nv; ++c) a = vfma(vload(kg + c * VL), vload(qh + c * VL), a);
            sc[b] = vsum(a);
            bmax = std::max(bmax, sc[b]);
          }
          const float mnew = std::max(m[h], bmax);
          const float corr = std::exp(m[h] - mnew);  // 0 on the first block (m = -inf)
          const float psum = exp_shifted(sc, static_cast<int>(nb), mnew);
          l[h] = l[h] * corr + psum;
          m[h] = mnew;
          float* o = acc + h * D;
          const V vc = vset1(corr);
          for (int64_t c = 0; c < nv; ++c) {
            V a = vmul(vload(o + c * VL), vc);
            for (int64_t b = 0; b < nb; ++b)
              a = vfma(vload(vp + slots[j + b] * row + g * D + c * VL), vset1(sc[b]), a);
            vstore(o + c * VL, a);
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < Hq; ++h) {  // merge the per-thread partials
    float mx = -INFINITY;
    for (int t = 0; t < nth; ++t) mx = std::max(mx, part_m[t * Hq + h]);
    float denom = 0.f;
    float* o = out + h * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int t = 0; t < nth; ++t) {
      if (part_l[t * Hq + h] == 0.f) continue;  // a thread that saw no slots
      const float w = std::exp(part_m[t * Hq + h] - mx);
      denom += part_l[t * Hq + h] * w;
      const float* po = part_o.data() + (t * Hq + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += po[d] * w;
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= denom;
  }
}

}  // namespace

extern "C" {

// y [T, N] fp32 = x [T, K] fp32 . w [N, K]^T (no bias), the weight fp32 (wdtype 0) or bf16
// (wdtype 1), contiguous. Returns 0, or 2 on a bad dtype code.
int ft_cpu_linear(const float* x, int64_t T, int64_t K, const void* w, int wdtype, int64_t N,
                  float* y, int nthreads) {
  if (wdtype != 0 && wdtype != 1) return 2;
  if (T <= 0 || N <= 0) return 0;
  const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
  if (wdtype == 1)
    linear_small<uint16_t>(x, T, K, static_cast<const uint16_t*>(w), N, y, nth);
  else
    linear_small<float>(x, T, K, static_cast<const float*>(w), N, y, nth);
  return 0;
}

// out [Hq, D] fp32: decode attention of one query q [Hq, D] fp32 over the pool rows `slots`
// [L] of k_pool, v_pool [S, Hk, D] (fp32: kvdtype 0; bf16: 1). Returns 0; 2 on a bad dtype;
// 3 when D is not a multiple of the vector width or Hq is not a multiple of Hk (the caller
// takes another path).
int ft_decode_attention(const float* q, const void* k_pool, const void* v_pool, int kvdtype,
                        const int64_t* slots, int64_t L, int64_t Hq, int64_t Hk, int64_t D,
                        float scale, float* out, int nthreads) {
  if (kvdtype != 0 && kvdtype != 1) return 2;
  if (D % VL != 0 || Hk <= 0 || Hq % Hk != 0 || L <= 0) return 3;
  const int nth = nthreads > 0 ? nthreads : omp_get_max_threads();
  if (kvdtype == 1)
    decode_attention<uint16_t>(q, static_cast<const uint16_t*>(k_pool),
                               static_cast<const uint16_t*>(v_pool), slots, L, Hq, Hk, D, scale,
                               out, nth);
  else
    decode_attention<float>(q, static_cast<const float*>(k_pool),
                            static_cast<const float*>(v_pool), slots, L, Hq, Hk, D, scale, out,
                            nth);
  return 0;
}

}  // extern "C"

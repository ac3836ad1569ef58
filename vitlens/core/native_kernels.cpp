// vitlens's native CPU kernels for the attention views (Fig. 6 rollout, Fig. 7 right and Fig. 11 attention
// distance), built on the user's machine by vitlens.core.native (g++, ATen's headers and vector types, ATen's
// thread pool) and called through ctypes. Every function returns 0, or 1 after an exception (the caller then
// falls back to its eager code).
//
// The sums follow the rule FLOAT32_RTOL is derived from (vitlens/views/distance.py): per query, float32 sums over
// blocks of at most `key_block` keys (any order inside a block), the block sums added in float64.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

inline float sum_of(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

inline float max_of(const float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t k = 0;
  if (n >= W) {
    Vec acc = Vec::loadu(row);
    for (k = W; k + W <= n; k += W) acc = at::vec::maximum(acc, Vec::loadu(row + k));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; k < n; ++k) m = std::max(m, row[k]);
  return m;
}

// softmax of one row in place: exp(x - max), summed in float32, times 1 / sum. The exp is ATen's exp_u20, the one
// ATen's own fused attention kernel (flash attention's softmax, the plain forward's) runs: within 20 ulp as its source
// says (vitlens.core.native.EXP_ULPS), a quarter faster than the Sleef exp (1 ulp); results below about sqrt(2) times
// float32's smallest normal number are flushed to 0. The last n % W keys take std::exp.
inline void softmax_row(float* row, int64_t n) {
  const float mx = max_of(row, n);
  const Vec vmx(mx);
  Vec acc(0.f);
  int64_t k = 0;
  for (; k + W <= n; k += W) {
    const Vec e = (Vec::loadu(row + k) - vmx).exp_u20();
    e.store(row + k);
    acc = acc + e;
  }
  float total = sum_of(acc);
  for (; k < n; ++k) {
    row[k] = std::exp(row[k] - mx);
    total += row[k];
  }
  const float inv = 1.f / total;
  const Vec vinv(inv);
  for (k = 0; k + W <= n; k += W) (Vec::loadu(row + k) * vinv).store(row + k);
  for (; k < n; ++k) row[k] *= inv;
}

// (sum_k p[k] d[k], sum_k p[k]) over n keys: float32 sums over blocks of key_block keys, added in float64
inline void block_sums(const float* p, const float* d, int64_t n, int64_t key_block, double* weighted,
                       double* mass) {
  double w = 0.0, m = 0.0;
  for (int64_t k0 = 0; k0 < n; k0 += key_block) {
    const int64_t len = std::min(key_block, n - k0);
    Vec aw(0.f), am(0.f);
    int64_t j = 0;
    for (; j + W <= len; j += W) {
      const Vec pv = Vec::loadu(p + k0 + j);
      aw = at::vec::fmadd(pv, Vec::loadu(d + k0 + j), aw);
      am = am + pv;
    }
    float fw = sum_of(aw), fm = sum_of(am);
    for (; j < len; ++j) {
      fw += p[k0 + j] * d[k0 + j];
      fm += p[k0 + j];
    }
    w += fw;
    m += fm;
  }
  *weighted = w;
  *mass = m;
}

// a float16 row (its bits) as float32 times inv_scale, a power of two (exact): F16C's conversion where the build
// has it, c10::Half's otherwise
inline void half_row(const uint16_t* src, float* dst, int64_t n, float inv_scale) {
  int64_t k = 0;
#if defined(__F16C__)
  const __m256 s = _mm256_set1_ps(inv_scale);
  for (; k + 8 <= n; k += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
    _mm256_storeu_ps(dst + k, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
  }
#endif
  for (; k < n; ++k) dst[k] = static_cast<float>(c10::Half(src[k], c10::Half::from_bits())) * inv_scale;
}

// a float32 row times scale (a power of two: exact) rounded to float16 (its bits), to nearest even: F16C's
// conversion where the build has it, c10::Half's (also round to nearest even) otherwise and for the tail; the same
// numbers as torch's float32 -> float16 copy_ (vitlens.views.rollout_store.store_half)
inline void half_of_row(const float* src, uint16_t* dst, int64_t n, float scale) {
  int64_t k = 0;
#if defined(__F16C__)
  const __m256 s = _mm256_set1_ps(scale);
  for (; k + 8 <= n; k += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + k), s),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), h);
  }
#endif
  for (; k < n; ++k) dst[k] = c10::Half(src[k] * scale).x;
}

// rollout's chain step (vitlens_rollout_step) over rows given by row_of(b, r, buffer): a pointer to row r of image
// b as T floats (the map's own memory, or the buffer of T floats it filled)
template <typename RowOf>
int rollout_step_rows(RowOf row_of, int64_t B, int64_t T, const double* v, double* w, double* out) {
  try {
    const int64_t chunk = 64;  // rows per task
    const int64_t tasks = (T + chunk - 1) / chunk;
    for (int64_t b = 0; b < B; ++b) {
      const double* vb = v + b * T;
      double* wb = w + b * T;
      double* ob = out + b * T;
      // row sums and w, in parallel over rows
      at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
        std::vector<float> buf(static_cast<size_t>(T));
        for (int64_t r = begin; r < end; ++r) {
          const float* row = row_of(b, r, buf.data());
          double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight running sums: the compiler vectorises them
          int64_t k = 0;
          for (; k + 8 <= T; k += 8)
            for (int j = 0; j < 8; ++j) lane[j] += static_cast<double>(row[k + j]);
          double s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
          for (; k < T; ++k) s += static_cast<double>(row[k]);
          wb[r] = vb[r] / (s + 1.0);
        }
      });
      // out = w a, each chunk of rows into its own partial vector, the partials added in chunk order
      std::vector<double> partial(static_cast<size_t>(tasks * T), 0.0);
      at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> buf(static_cast<size_t>(T));
        for (int64_t c = begin; c < end; ++c) {
          double* acc = partial.data() + c * T;
          for (int64_t r = c * chunk; r < std::min(T, (c + 1) * chunk); ++r) {
            const double wr = wb[r];
            const float* row = row_of(b, r, buf.data());
            for (int64_t k = 0; k < T; ++k) acc[k] += wr * static_cast<double>(row[k]);
          }
        }
      });
      for (int64_t k = 0; k < T; ++k) ob[k] = wb[k];
      for (int64_t c = 0; c < tasks; ++c) {
        const double* acc = partial.data() + c * T;
        for (int64_t k = 0; k < T; ++k) ob[k] += acc[k];
      }
    }
  } catch (...) {
    return 1;
  }
  return 0;
}

}  // namespace

extern "C" {

// Softmax over the last axis of scores [B, H, R, T] (float32, keys contiguous, row stride ld >= T: rows padded to
// an aligned stride, vitlens.core.attention.padded_row_stride, or ld == T, contiguous), in place, and in the same
// pass, per row block of a layer:
//  - distance (non-null): [R - first, T - prefix] float32 pixel distances of the rows first.. (the patch queries)
//    to the patch keys (keys prefix..); sums [2, B * H, R - first] float64 receives, per query, the
//    distance-weighted sum and the mass over the patch keys (block_sums);
//  - mean (non-null): [B, R, T] float32 rows (image stride mean_batch_stride, row stride T) receive the mean over
//    the H heads (summed in head order in float32, divided by H);
//  - half (non-null): [B, R, T] float16 rows (their bits; image stride half_batch_stride, row stride T) receive that
//    mean times half_scale (a power of two), rounded to nearest even (half_of_row): rollout's float16 store
//    (vitlens.views.rollout_store) written by this pass. Without `mean` the float32 row is the thread's own.
int vitlens_softmax_taps(float* scores, int64_t B, int64_t H, int64_t R, int64_t T, int64_t ld,
                         const float* distance, int64_t first, int64_t prefix, int64_t key_block, double* sums,
                         float* mean, int64_t mean_batch_stride, uint16_t* half, int64_t half_batch_stride,
                         float half_scale) {
  try {
    const int64_t Q = R - first, N = T - prefix;
    at::parallel_for(0, B * R, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(half && !mean ? static_cast<size_t>(T) : 0);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / R, r = i % R;
        float* mrow = mean ? mean + b * mean_batch_stride + r * T : (half ? scratch.data() : nullptr);
        for (int64_t h = 0; h < H; ++h) {
          float* row = scores + ((b * H + h) * R + r) * ld;
          softmax_row(row, T);
          if (distance && r >= first) {
            const int64_t at = (b * H + h) * Q + (r - first);
            block_sums(row + prefix, distance + (r - first) * N, N, key_block, sums + at, sums + B * H * Q + at);
          }
          if (mrow) {
            if (h == 0) {
              std::copy(row, row + T, mrow);
            } else {
              int64_t k = 0;
              for (; k + W <= T; k += W) (Vec::loadu(mrow + k) + Vec::loadu(row + k)).store(mrow + k);
              for (; k < T; ++k) mrow[k] += row[k];
            }
          }
        }
        if (mrow) {
          const Vec vh(static_cast<float>(H));
          int64_t k = 0;
          for (; k + W <= T; k += W) (Vec::loadu(mrow + k) / vh).store(mrow + k);
          for (; k < T; ++k) mrow[k] /= static_cast<float>(H);
          if (half) half_of_row(mrow, half + b * half_batch_stride + r * T, T, half_scale);
        }
      }
    });
  } catch (...) {
    return 1;
  }
  return 0;
}

// Attention distance's sums on given maps: rows [M, Q, N] float32 (strides row_m, row_q; keys contiguous) with
// distances [Q, N] float32 (row stride N); out [2, M, Q] float64 = (sum_k A d, sum_k A) by block_sums.
int vitlens_key_block_sums(const float* rows, int64_t M, int64_t Q, int64_t N, int64_t row_m, int64_t row_q,
                           const float* distance, int64_t key_block, double* out) {
  try {
    at::parallel_for(0, M * Q, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / Q, q = i % Q;
        block_sums(rows + m * row_m + q * row_q, distance + q * N, N, key_block, out + i, out + M * Q + i);
      }
    });
  } catch (...) {
    return 1;
  }
  return 0;
}

// One step of rollout's chain from the last block back (vitlens.views.rollout.rollout_row), for a head-fused map
// a [B, T, T] float32 (image stride a_batch, row stride T): w = v / (rowsum(a) + 1) and out = w a + w, in float64
// (v, w, out: [B, T] contiguous float64). Each thread sums its rows into its own float64 vector; those are added
// in thread order.
int vitlens_rollout_step(const float* a, int64_t B, int64_t T, int64_t a_batch, const double* v, double* w,
                         double* out) {
  return rollout_step_rows([&](int64_t b, int64_t r, float*) { return a + b * a_batch + r * T; }, B, T, v, w, out);
}

// The same step from a map stored in float16 times a power of two (vitlens.views.rollout_store): each row is made
// float32 and times `inv_scale` (exact) in the thread's buffer, then summed as above.
int vitlens_rollout_step_half(const uint16_t* a, int64_t B, int64_t T, int64_t a_batch, float inv_scale,
                              const double* v, double* w, double* out) {
  return rollout_step_rows([&](int64_t b, int64_t r, float* buf) {
    half_row(a + b * a_batch + r * T, buf, T, inv_scale);
    return static_cast<const float*>(buf);
  }, B, T, v, w, out);
}

}  // extern "C"

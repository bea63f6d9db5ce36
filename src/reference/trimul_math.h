// Row-level math of the triangle multiplicative update, shared by the FP64 reference and the CPU
// path, on values of type T (double, or float for the CPU path's stored intermediates). Every sum
// accumulates in double and runs in index order.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/indexing.h"
#include "core/numeric.h"
#include "tpf/parallel.h"
#include "tpf/trimul.h"

namespace tpf::trimul_math {

template <typename T>
using Vec = std::vector<T>;

template <typename T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

// A [rows, cols] parameter (or an [n] vector: one row), row-major.
template <typename T>
Vec<T> load_param(const TensorView& t) {
  const int64_t rows = t.ndim == 2 ? t.shape[0] : 1, cols = t.shape[t.ndim - 1];
  Vec<T> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    load_row(t, t.ndim == 2 ? offset_of(t, r, 0) : 0, cols, &out[r * cols]);
  return out;
}

template <typename T>
void store_param(const TensorView& t, const T* v) {
  const int64_t rows = t.ndim == 2 ? t.shape[0] : 1, cols = t.shape[t.ndim - 1];
  for (int64_t r = 0; r < rows; ++r)
    store_row(t, t.ndim == 2 ? offset_of(t, r, 0) : 0, cols, v + r * cols);
}

template <typename T>
Vec<T> load_optional(const OptionalTensor& t, int64_t n) {
  return t.present ? load_param<T>(t.view) : Vec<T>(n, T(0));
}

template <typename T>
Vec<T> transposed(const Vec<T>& w, int64_t rows, int64_t cols) {
  Vec<T> t(w.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = w[r * cols + c];
  return t;
}

// The weights in T; absent biases are zeros. The projections also transposed ([in, out]) so that
// linear() runs over contiguous memory.
template <typename T>
struct Params {
  Vec<T> ln_in_w, ln_in_b, wp_in, wg_in, bp_in, bg_in, ln_out_w, ln_out_b, wp_out, wg_out, bp_out,
      bg_out;
  Vec<T> wp_in_t, wg_in_t, wp_out_t, wg_out_t;
  Params(const TrimulWeights& w, int64_t D)
      : ln_in_w(load_param<T>(w.norm_in_weight)),
        ln_in_b(load_param<T>(w.norm_in_bias)),
        wp_in(load_param<T>(w.p_in_weight)),
        wg_in(load_param<T>(w.g_in_weight)),
        bp_in(load_optional<T>(w.p_in_bias, 2 * D)),
        bg_in(load_optional<T>(w.g_in_bias, 2 * D)),
        ln_out_w(load_param<T>(w.norm_out_weight)),
        ln_out_b(load_param<T>(w.norm_out_bias)),
        wp_out(load_param<T>(w.p_out_weight)),
        wg_out(load_param<T>(w.g_out_weight)),
        bp_out(load_optional<T>(w.p_out_bias, D)),
        bg_out(load_optional<T>(w.g_out_bias, D)),
        wp_in_t(transposed(wp_in, 2 * D, D)),
        wg_in_t(transposed(wg_in, 2 * D, D)),
        wp_out_t(transposed(wp_out, D, D)),
        wg_out_t(transposed(wg_out, D, D)) {}
};

// out[o] = sum_c w[o][c] in[c] + bias[o] (nn.Linear), from w_t = w^T [n_in, n_out]; sums in c order.
inline void linear(const double* in, const Vec<double>& w_t, const Vec<double>& bias, int64_t n_out,
                   int64_t n_in, double* out) {
  for (int64_t o = 0; o < n_out; ++o) out[o] = 0.0;
  for (int64_t c = 0; c < n_in; ++c) {
    const double v = in[c];
    const double* wc = &w_t[c * n_out];
    for (int64_t o = 0; o < n_out; ++o) out[o] += wc[o] * v;
  }
  for (int64_t o = 0; o < n_out; ++o) out[o] += bias[o];
}

// out[c] += sum_o g[o] w[o][c]: the input gradient of linear(), accumulated in double.
template <typename T>
void linear_backward(const T* g, const Vec<T>& w, int64_t n_out, int64_t n_in, double* out) {
  for (int64_t o = 0; o < n_out; ++o) {
    const double gv = g[o];
    const T* wo = &w[o * n_in];
    for (int64_t c = 0; c < n_in; ++c) out[c] += gv * wo[c];
  }
}

// LayerNorm of one row without its affine part: xhat = (x - mean) / sigma; returns 1 / sigma.
template <typename T>
T layer_norm(const T* x, int64_t D, double eps, T* xhat) {
  double mean = 0, var = 0;
  for (int64_t c = 0; c < D; ++c) mean += x[c];
  mean /= double(D);
  for (int64_t c = 0; c < D; ++c) var += (x[c] - mean) * (x[c] - mean);
  const double rstd = 1.0 / std::sqrt(var / double(D) + eps);
  for (int64_t c = 0; c < D; ++c) xhat[c] = T((x[c] - mean) * rstd);
  return T(rstd);
}

// dx of y = xhat * w + b from dy: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy * w.
template <typename T>
void layer_norm_backward(const double* dy, const T* xhat, const Vec<T>& w, T rstd, int64_t D,
                         T* dx) {
  double s1 = 0, s2 = 0;
  for (int64_t c = 0; c < D; ++c) {
    s1 += dy[c] * w[c];
    s2 += dy[c] * w[c] * xhat[c];
  }
  s1 /= double(D);
  s2 /= double(D);
  for (int64_t c = 0; c < D; ++c) dx[c] = T(rstd * (dy[c] * w[c] - s1 - xhat[c] * s2));
}

// dw[o][c] += sum_r gy[r][o] in[r][c] (and db[o] += sum_r gy[r][o] when db is given), r in order:
// the weight gradient of linear() over `rows` positions. One task per block of kRowsPerTask weight
// rows, so that `in` streams through once per block.
template <typename T>
void accumulate_linear_grads(const Vec<T>& gy, const Vec<T>& in, int64_t rows, int64_t n_out,
                             int64_t n_in, double* dw, double* db) {
  constexpr int64_t kRowsPerTask = 16;
  parallel_for((n_out + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task) {
    const int64_t o0 = task * kRowsPerTask, o1 = std::min(n_out, o0 + kRowsPerTask);
    for (int64_t r = 0; r < rows; ++r) {
      const T* ir = &in[r * n_in];
      for (int64_t o = o0; o < o1; ++o) {
        const double gv = gy[r * n_out + o];
        if (db) db[o] += gv;
        double* wo = &dw[o * n_in];
        for (int64_t c = 0; c < n_in; ++c) wo[c] += gv * ir[c];
      }
    }
  });
}

// Z = L R for S x S row-major matrices.
template <typename T>
void matmul(const T* L, const T* R, int64_t S, T* Z) {
  std::vector<double> zi(S);
  for (int64_t i = 0; i < S; ++i) {
    std::fill(zi.begin(), zi.end(), 0.0);
    for (int64_t k = 0; k < S; ++k) {
      const double l = L[i * S + k];
      const T* rk = R + k * S;
      for (int64_t j = 0; j < S; ++j) zi[j] += l * rk[j];
    }
    for (int64_t j = 0; j < S; ++j) Z[i * S + j] = T(zi[j]);
  }
}

template <typename T>
void transpose(const T* X, int64_t S, T* Xt) {
  for (int64_t i = 0; i < S; ++i)
    for (int64_t j = 0; j < S; ++j) Xt[j * S + i] = X[i * S + j];
}

// The contraction of one channel as Z = L R:
//   outgoing (z_ij = sum_k a_ik b_jk): L = A, R = B^T;  incoming (z_ij = sum_k a_ki b_kj): L = A^T, R = B.
template <typename T>
void contract(const T* A, const T* B, int64_t S, bool outgoing, T* Z) {
  Vec<T> t(S * S);
  if (outgoing) {
    transpose(B, S, t.data());
    matmul(A, t.data(), S, Z);
  } else {
    transpose(A, S, t.data());
    matmul(t.data(), B, S, Z);
  }
}

// Its backward: outgoing dA = dZ B, dB = dZ^T A;  incoming dA = B dZ^T, dB = A dZ.
template <typename T>
void contract_backward(const T* A, const T* B, const T* dZ, int64_t S, bool outgoing, T* dA,
                       T* dB) {
  Vec<T> t(S * S);
  transpose(dZ, S, t.data());
  if (outgoing) {
    matmul(dZ, B, S, dA);
    matmul(t.data(), A, S, dB);
  } else {
    matmul(B, t.data(), S, dA);
    matmul(A, dZ, S, dB);
  }
}

}  // namespace tpf::trimul_math

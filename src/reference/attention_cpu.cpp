// CPU path of triangle attention: FP32 math, blocked the way the GPU kernels are.
//
// Forward: one task per (b, n, h, query tile); online softmax over key tiles.
// Backward: a preprocessing pass computes delta = rowsum(dO * (O + r)) in FP32 (r: the BF16 residual
// of O's rounding, when given). The main pass has one task per (b, h, key tile) that walks the slices
// n and the query tiles, recomputing each probability tile once for all four gradients: dK and dV stay
// local to the task, dbias for the task's key columns is summed over n in order, and dQ leaves as one
// partial per key tile, summed in key-tile order by a reduction pass. Slices are processed in chunks
// so the dQ partials stay within a fixed memory budget. Every sum has a fixed order: results are
// bitwise reproducible whatever the thread count.
//
// Inputs are read as FP32 (exact for every input dtype); scores, probabilities, dP, delta and dS
// and every sum (dot products, the online-softmax accumulators, the gradient accumulators) are
// FP64, so each output rounds once to its dtype. O's rounding is kept as the residual (float32
// outputs too), so the backward's delta = rowsum(dO * (O + r)) is the FP64 value's, and the
// cancellation in dP - delta does not amplify it: the CPU path is more accurate than PyTorch's at
// every dtype.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/indexing.h"
#include "core/numeric.h"
#include "reference/cpu.h"
#include "tpf/parallel.h"

namespace tpf {
namespace {

constexpr int64_t kQueryTile = 64;  // rows of q per task, as the GPU's query tile
constexpr int64_t kKeyTile = 64;    // keys per inner step, as the GPU's key tile
constexpr int64_t kPartialBudgetBytes = int64_t(64) << 20;

constexpr float kInf = std::numeric_limits<float>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Loads rows [r0, r0+rn) of the [.., S, D] matrix at (b, n, h) into dst[rn][D] as float.
void load_rows(const TensorView& t, int64_t b, int64_t n, int64_t h, int64_t r0, int64_t rn,
               int64_t D, float* dst) {
  for (int64_t i = 0; i < rn; ++i) load_row(t, offset_of(t, b, n, h, r0 + i, 0), D, dst + i * D);
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_dst, float* dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[j * ld_dst + i] = src[i * cols + j];
}

// c[i][j] = sum_d a[i][d] * bt[d][j] in FP64: a [m][kd], bt [kd][n], c [m][n]; n <= kKeyTile.
void matmul_abt(const float* a, const float* bt, int64_t m, int64_t n, int64_t kd, double* c) {
  for (int64_t i = 0; i < m; ++i) {
    double* acc = c + i * n;
    std::fill(acc, acc + n, 0.0);
    for (int64_t d = 0; d < kd; ++d) {
      const double ad = a[i * kd + d];
      const float* b = bt + d * n;
      for (int64_t j = 0; j < n; ++j) acc[j] += ad * b[j];
    }
  }
}

}  // namespace

void cpu::attention_forward(const AttentionForwardArgs& a, const AttentionDims& d) {
  const int64_t D = d.D, Sq = d.Sq, Sk = d.Sk;
  const int64_t jq = ceil_div(Sq, kQueryTile);
  const double scale = a.scale;

  parallel_for(d.B * d.N * d.H * jq, [&](int64_t t) {
    const int64_t qt = t % jq, h = (t / jq) % d.H, n = (t / (jq * d.H)) % d.N,
                  b = t / (jq * d.H * d.N);
    const int64_t q0 = qt * kQueryTile, qn = std::min(kQueryTile, Sq - q0);
    std::vector<float> q(qn * D), kt(D * kKeyTile), v(kKeyTile * D), k(kKeyTile * D);
    std::vector<float> bias(kKeyTile);
    std::vector<double> s(qn * kKeyTile), m(qn, -double(kInf)), acc(qn * D, 0.0), l(qn, 0.0);
    std::vector<uint8_t> key_ok(kKeyTile);
    load_rows(a.q, b, n, h, q0, qn, D, q.data());

    for (int64_t k0 = 0; k0 < Sk; k0 += kKeyTile) {
      const int64_t kn = std::min(kKeyTile, Sk - k0);
      load_rows(a.k, b, n, h, k0, kn, D, k.data());
      load_rows(a.v, b, n, h, k0, kn, D, v.data());
      transpose(k.data(), kn, D, kn, kt.data());
      bool any = false;
      for (int64_t j = 0; j < kn; ++j) any |= (key_ok[j] = mask_at(a.mask, b, n, k0 + j));
      if (!any) continue;
      matmul_abt(q.data(), kt.data(), qn, kn, D, s.data());
      for (int64_t i = 0; i < qn; ++i) {
        double* si = s.data() + i * kn;
        load_row(a.bias, offset_of(a.bias, b, h, q0 + i, k0), kn, bias.data());
        double row_max = -double(kInf);
        for (int64_t j = 0; j < kn; ++j) {
          si[j] = key_ok[j] ? scale * si[j] + double(bias[j]) : -double(kInf);
          row_max = std::max(row_max, si[j]);
        }
        const double m_new = std::max(m[i], row_max);
        // A row with no finite score yet (masked keys, or a bias of -inf) subtracts 0, not -inf,
        // so its p and correction are exp(-inf) = 0 rather than exp(NaN), as in the CUDA kernels.
        const double m_use = m_new == -double(kInf) ? 0.0 : m_new;
        const double correction = std::exp(m[i] - m_use);  // m[i] = -inf: 0, acc, l are 0
        double row_sum = 0.0;
        for (int64_t j = 0; j < kn; ++j) {
          si[j] = std::exp(si[j] - m_use);
          row_sum += si[j];
        }
        l[i] = l[i] * correction + row_sum;
        m[i] = m_new;
        double* ai = acc.data() + i * D;
        for (int64_t c = 0; c < D; ++c) ai[c] *= correction;
        for (int64_t j = 0; j < kn; ++j) {
          const double p = si[j];
          const float* vj = v.data() + j * D;
          for (int64_t c = 0; c < D; ++c) ai[c] += p * vj[c];
        }
      }
    }

    std::vector<float> out(D), resid(D);
    for (int64_t i = 0; i < qn; ++i) {
      const bool empty = l[i] == 0.0;
      const double inv = empty ? 0.0 : 1.0 / l[i];
      for (int64_t c = 0; c < D; ++c) {
        const double exact = acc[i * D + c] * inv;
        out[c] = round_to(a.o.dtype, float(exact));
        resid[c] = float(exact - double(out[c]));
      }
      const double lse = empty ? double(kInf) : m[i] + std::log(l[i]);
      store_row(a.o, offset_of(a.o, b, n, h, q0 + i, 0), D, out.data());
      store_row(a.lse, offset_of(a.lse, b, n, h, q0 + i), 1, &lse);
      if (a.residual.present)
        store_row(a.residual.view, offset_of(a.residual.view, b, n, h, q0 + i, 0), D, resid.data());
    }
  });
}

void cpu::attention_backward(const AttentionBackwardArgs& a, const AttentionDims& d) {
  const int64_t B = d.B, N = d.N, H = d.H, Sq = d.Sq, Sk = d.Sk, D = d.D;
  const int64_t jk = ceil_div(Sk, kKeyTile);
  const double scale = a.scale;

  // Preprocessing: delta[b, n, h, i] = sum_c dO * (O + r), in FP64.
  std::vector<double> delta(B * N * H * Sq);
  parallel_for(B * N * H, [&](int64_t t) {
    const int64_t h = t % H, n = (t / H) % N, b = t / (H * N);
    std::vector<float> o(D), dout(D), r(D, 0.0f);
    for (int64_t i = 0; i < Sq; ++i) {
      load_row(a.o, offset_of(a.o, b, n, h, i, 0), D, o.data());
      load_row(a.dout, offset_of(a.dout, b, n, h, i, 0), D, dout.data());
      if (a.residual.present)
        load_row(a.residual.view, offset_of(a.residual.view, b, n, h, i, 0), D, r.data());
      double acc = 0.0;
      for (int64_t c = 0; c < D; ++c) acc += double(dout[c]) * (double(o[c]) + double(r[c]));
      delta[t * Sq + i] = acc;
    }
  });

  // dbias accumulators, one [Sq][kKeyTile] block per (b, h, key tile), carried across chunks.
  std::vector<double> dbias_acc(B * H * jk * Sq * kKeyTile, 0.0);
  const int64_t partial_per_slice = jk * B * H * Sq * D * int64_t(sizeof(double));
  const int64_t chunk = std::clamp<int64_t>(kPartialBudgetBytes / partial_per_slice, 1, N);
  std::vector<double> dq_partial(jk * B * H * chunk * Sq * D);
  auto partial_at = [&](int64_t kt, int64_t b, int64_t h, int64_t nn) {
    return dq_partial.data() + ((((kt * B + b) * H + h) * chunk + nn) * Sq) * D;
  };

  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t n1 = std::min(N, n0 + chunk);
    parallel_for(B * H * jk, [&](int64_t t) {
      const int64_t kt = t % jk, h = (t / jk) % H, b = t / (jk * H);
      const int64_t k0 = kt * kKeyTile, kn = std::min(kKeyTile, Sk - k0);
      double* dbias = dbias_acc.data() + t * Sq * kKeyTile;
      std::vector<float> k(kn * D), v(kn * D), kT(D * kn), vT(D * kn);
      std::vector<double> dk(kn * D), dv(kn * D);
      std::vector<float> q(kQueryTile * D), dout(kQueryTile * D), bias(kn);
      std::vector<double> p(kQueryTile * kn), dp(kQueryTile * kn);
      std::vector<uint8_t> key_ok(kn);
      for (int64_t n = n0; n < n1; ++n) {
        load_rows(a.k, b, n, h, k0, kn, D, k.data());
        load_rows(a.v, b, n, h, k0, kn, D, v.data());
        transpose(k.data(), kn, D, kn, kT.data());
        transpose(v.data(), kn, D, kn, vT.data());
        for (int64_t j = 0; j < kn; ++j) key_ok[j] = mask_at(a.mask, b, n, k0 + j);
        std::fill(dk.begin(), dk.end(), 0.0);
        std::fill(dv.begin(), dv.end(), 0.0);
        const double* delta_row = delta.data() + ((b * N + n) * H + h) * Sq;
        for (int64_t q0 = 0; q0 < Sq; q0 += kQueryTile) {
          const int64_t qn = std::min(kQueryTile, Sq - q0);
          load_rows(a.q, b, n, h, q0, qn, D, q.data());
          load_rows(a.dout, b, n, h, q0, qn, D, dout.data());
          matmul_abt(q.data(), kT.data(), qn, kn, D, p.data());
          matmul_abt(dout.data(), vT.data(), qn, kn, D, dp.data());
          double* dq = partial_at(kt, b, h, n - n0) + q0 * D;
          for (int64_t i = 0; i < qn; ++i) {
            double lse;
            load_row(a.lse, offset_of(a.lse, b, n, h, q0 + i), 1, &lse);
            load_row(a.bias, offset_of(a.bias, b, h, q0 + i, k0), kn, bias.data());
            double* pi = p.data() + i * kn;
            double* dsi = dp.data() + i * kn;  // dP, then dS in place
            for (int64_t j = 0; j < kn; ++j) {
              // lse is the forward's FP64 value (stored as float32): p as exact as the forward's.
              pi[j] = (key_ok[j] && lse != double(kInf))
                          ? std::exp(scale * pi[j] + double(bias[j]) - lse)
                          : 0.0;
              dsi[j] = pi[j] * (dsi[j] - delta_row[q0 + i]);
              dbias[(q0 + i) * kKeyTile + j] += dsi[j];
            }
            const float* qi = q.data() + i * D;
            const float* doi = dout.data() + i * D;
            double* dqi = dq + i * D;
            std::fill(dqi, dqi + D, 0.0);
            for (int64_t j = 0; j < kn; ++j) {
              double* dvj = dv.data() + j * D;
              double* dkj = dk.data() + j * D;
              const float* kj = k.data() + j * D;
              const double pij = pi[j], dsij = dsi[j];
              for (int64_t c = 0; c < D; ++c) {
                dvj[c] += pij * doi[c];
                dkj[c] += dsij * qi[c];
                dqi[c] += dsij * kj[c];
              }
            }
            for (int64_t c = 0; c < D; ++c) dqi[c] *= scale;
          }
        }
        for (int64_t x = 0; x < kn * D; ++x) dk[x] *= double(scale);
        for (int64_t j = 0; j < kn; ++j) {
          store_row(a.dk, offset_of(a.dk, b, n, h, k0 + j, 0), D, dk.data() + j * D);
          store_row(a.dv, offset_of(a.dv, b, n, h, k0 + j, 0), D, dv.data() + j * D);
        }
      }
    });
    // dQ: sum the key-tile partials in key-tile order.
    parallel_for(B * (n1 - n0) * H, [&](int64_t t) {
      const int64_t h = t % H, nn = (t / H) % (n1 - n0), b = t / (H * (n1 - n0));
      std::vector<double> row(D);
      for (int64_t i = 0; i < Sq; ++i) {
        std::fill(row.begin(), row.end(), 0.0);
        for (int64_t kt = 0; kt < jk; ++kt) {
          const double* part = partial_at(kt, b, h, nn) + i * D;
          for (int64_t c = 0; c < D; ++c) row[c] += part[c];
        }
        store_row(a.dq, offset_of(a.dq, b, n0 + nn, h, i, 0), D, row.data());
      }
    });
  }

  // dbias: each (b, h, key tile) block was summed over n in order; write it out.
  parallel_for(B * H * jk, [&](int64_t t) {
    const int64_t kt = t % jk, h = (t / jk) % H, b = t / (jk * H);
    const int64_t k0 = kt * kKeyTile, kn = std::min(kKeyTile, Sk - k0);
    const double* acc = dbias_acc.data() + t * Sq * kKeyTile;
    for (int64_t i = 0; i < Sq; ++i)
      store_row(a.dbias, offset_of(a.dbias, b, h, i, k0), kn, acc + i * kKeyTile);
  });
}

}  // namespace tpf

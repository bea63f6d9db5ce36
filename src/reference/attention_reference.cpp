// FP64 reference of triangle attention: plain loops, the definition and nothing else.
//   s[q,k] = scale * <q_q, k_k> + bias[q,k]   (masked keys: -inf)
//   p = softmax_k(s), o = p v, lse = log sum_k exp(s)
// Backward: dv = p^T do, dp = do v^T, ds = p * (dp - rowsum(do * o)),
//           dq = scale ds k, dk = scale ds^T q, dbias = sum over slices n of ds.
#include <cmath>
#include <limits>
#include <vector>

#include "core/indexing.h"
#include "core/numeric.h"
#include "reference/cpu.h"
#include "tpf/parallel.h"

namespace tpf::cpu {
namespace {

struct Slice {
  // One (b, n, h): inputs as double.
  std::vector<double> q, k, v, bias, p, o;
  std::vector<double> lse;
  std::vector<bool> key_ok;
};

void load_slice(const TensorView& q, const TensorView& k, const TensorView& v,
                const TensorView& bias, const OptionalTensor& mask, const AttentionDims& d,
                int64_t b, int64_t n, int64_t h, double scale, Slice& s) {
  const int64_t Sq = d.Sq, Sk = d.Sk, D = d.D;
  s.q.resize(Sq * D);
  s.k.resize(Sk * D);
  s.v.resize(Sk * D);
  s.bias.resize(Sq * Sk);
  s.key_ok.resize(Sk);
  for (int64_t i = 0; i < Sq; ++i) load_row(q, offset_of(q, b, n, h, i, 0), D, &s.q[i * D]);
  for (int64_t j = 0; j < Sk; ++j) {
    load_row(k, offset_of(k, b, n, h, j, 0), D, &s.k[j * D]);
    load_row(v, offset_of(v, b, n, h, j, 0), D, &s.v[j * D]);
    s.key_ok[j] = mask_at(mask, b, n, j);
  }
  for (int64_t i = 0; i < Sq; ++i) load_row(bias, offset_of(bias, b, h, i, 0), Sk, &s.bias[i * Sk]);

  // Probabilities and output.
  s.p.assign(Sq * Sk, 0.0);
  s.o.assign(Sq * D, 0.0);
  s.lse.assign(Sq, std::numeric_limits<double>::infinity());
  for (int64_t i = 0; i < Sq; ++i) {
    double m = -std::numeric_limits<double>::infinity();
    std::vector<double> row(Sk);
    for (int64_t j = 0; j < Sk; ++j) {
      if (!s.key_ok[j]) continue;
      double acc = 0;
      for (int64_t c = 0; c < D; ++c) acc += s.q[i * D + c] * s.k[j * D + c];
      row[j] = scale * acc + s.bias[i * Sk + j];
      if (row[j] > m) m = row[j];
    }
    if (m == -std::numeric_limits<double>::infinity()) continue;  // no key: zeros, lse = +inf
    double sum = 0;
    for (int64_t j = 0; j < Sk; ++j)
      if (s.key_ok[j]) sum += std::exp(row[j] - m);
    s.lse[i] = m + std::log(sum);
    for (int64_t j = 0; j < Sk; ++j) {
      if (!s.key_ok[j]) continue;
      double pij = std::exp(row[j] - s.lse[i]);
      s.p[i * Sk + j] = pij;
      for (int64_t c = 0; c < D; ++c) s.o[i * D + c] += pij * s.v[j * D + c];
    }
  }
}

}  // namespace

void attention_forward_f64(const AttentionForwardArgs& a, const AttentionDims& d) {
  parallel_for(d.B * d.N * d.H, [&](int64_t t) {
    const int64_t h = t % d.H, n = (t / d.H) % d.N, b = t / (d.H * d.N);
    Slice s;
    load_slice(a.q, a.k, a.v, a.bias, a.mask, d, b, n, h, a.scale, s);
    for (int64_t i = 0; i < d.Sq; ++i) {
      store_row(a.o, offset_of(a.o, b, n, h, i, 0), d.D, &s.o[i * d.D]);
      store_row(a.lse, offset_of(a.lse, b, n, h, i), 1, &s.lse[i]);
    }
  });
}

void attention_backward_f64(const AttentionBackwardArgs& a, const AttentionDims& d) {
  const int64_t Sq = d.Sq, Sk = d.Sk, D = d.D;
  // dbias sums over slices: one task per (b, h) walks every n in order.
  parallel_for(d.B * d.H, [&](int64_t t) {
    const int64_t h = t % d.H, b = t / d.H;
    std::vector<double> dbias(Sq * Sk, 0.0);
    Slice s;
    std::vector<double> dout(Sq * D), dq(Sq * D), dk(Sk * D), dv(Sk * D), ds(Sq * Sk);
    for (int64_t n = 0; n < d.N; ++n) {
      load_slice(a.q, a.k, a.v, a.bias, a.mask, d, b, n, h, a.scale, s);
      for (int64_t i = 0; i < Sq; ++i)
        load_row(a.dout, offset_of(a.dout, b, n, h, i, 0), D, &dout[i * D]);
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (int64_t i = 0; i < Sq; ++i) {
        double delta = 0;
        for (int64_t c = 0; c < D; ++c) delta += dout[i * D + c] * s.o[i * D + c];
        for (int64_t j = 0; j < Sk; ++j) {
          const double pij = s.p[i * Sk + j];
          double dp = 0;
          for (int64_t c = 0; c < D; ++c) dp += dout[i * D + c] * s.v[j * D + c];
          ds[i * Sk + j] = pij * (dp - delta);
          for (int64_t c = 0; c < D; ++c) dv[j * D + c] += pij * dout[i * D + c];
        }
      }
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t j = 0; j < Sk; ++j) {
          const double g = ds[i * Sk + j];
          dbias[i * Sk + j] += g;
          for (int64_t c = 0; c < D; ++c) {
            dq[i * D + c] += a.scale * g * s.k[j * D + c];
            dk[j * D + c] += a.scale * g * s.q[i * D + c];
          }
        }
      for (int64_t i = 0; i < Sq; ++i)
        store_row(a.dq, offset_of(a.dq, b, n, h, i, 0), D, &dq[i * D]);
      for (int64_t j = 0; j < Sk; ++j) {
        store_row(a.dk, offset_of(a.dk, b, n, h, j, 0), D, &dk[j * D]);
        store_row(a.dv, offset_of(a.dv, b, n, h, j, 0), D, &dv[j * D]);
      }
    }
    for (int64_t i = 0; i < Sq; ++i)
      store_row(a.dbias, offset_of(a.dbias, b, h, i, 0), Sk, &dbias[i * Sk]);
  });
}

}  // namespace tpf::cpu

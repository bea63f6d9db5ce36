// CPU path of the triangle multiplicative update, in the stages of the GPU kernels.
//
// What the GPU stores, this path stores in the same precision: a, b, z and go in x's dtype, the
// backward's intermediates (dz, dA, dB, per-position gradients) in FP32. Arithmetic on those values
// runs in FP64 (trimul_math.h), so each stored value is rounded once.
//
// Forward: (1) per tile of 64 positions (b, i, j0..j0+63): LayerNorm_in, the five projections, gates
// and mask, writing a and b channel-major and the output gate logits go; (2) per channel: the
// contraction (trimul_math.h); (3) per tile: LayerNorm_out, output projection and gate.
// Backward: (1) per tile: the output side, giving dz; (2) per channel: dA and dB; (3) per tile: the
// input side, giving dx. Bias and LayerNorm gradients are summed per tile in row order, then over
// tiles in tile order; weight gradients are one task per weight row summing all positions in order.
// Results are bitwise reproducible whatever the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/indexing.h"
#include "core/numeric.h"
#include "reference/cpu.h"
#include "reference/trimul_math.h"
#include "tpf/parallel.h"

namespace tpf {
namespace {

constexpr int64_t kTileRows = 64;  // positions per tile, as the GPU kernels' row tile

using namespace trimul_math;
using V = Vec<double>;  // per-position temporaries
using F = Vec<float>;   // stored intermediates

// Tiles of kTileRows positions along j within one (b, i).
struct Tiles {
  int64_t B, S, per_row, count;
  explicit Tiles(const TrimulDims& d)
      : B(d.B), S(d.S), per_row((d.S + kTileRows - 1) / kTileRows), count(d.B * d.S * per_row) {}
  void at(int64_t t, int64_t& b, int64_t& i, int64_t& j0, int64_t& n) const {
    const int64_t bi = t / per_row;
    b = bi / S;
    i = bi % S;
    j0 = (t % per_row) * kTileRows;
    n = std::min(kTileRows, S - j0);
  }
  // Index of position (b, i, j) among all B * S * S positions.
  int64_t row(int64_t b, int64_t i, int64_t j) const { return (b * S + i) * S + j; }
};

// The S x S matrix of channel c of a channel-major [B, D, S, S] tensor.
void load_channel(const TensorView& t, int64_t b, int64_t c, int64_t S, float* dst) {
  load_row(t, offset_of(t, b, c, 0, 0), S * S, dst);
}

// Rows of a channel-major tile: dst[r][c] = t[b, c, i, j0 + r] for r < n.
void load_channel_major_tile(const TensorView& t, int64_t b, int64_t i, int64_t j0, int64_t n,
                             int64_t D, double* dst) {
  V col(n);
  for (int64_t c = 0; c < D; ++c) {
    load_row(t, offset_of(t, b, c, i, j0), n, col.data());
    for (int64_t r = 0; r < n; ++r) dst[r * D + c] = col[r];
  }
}

// LayerNorm_in of one position: xhat, x_ln and 1/sigma.
double input_norm(const TensorView& x, const Params<double>& w, double eps, int64_t b, int64_t i,
                  int64_t j, int64_t D, double* xhat, double* xln) {
  V row(D);
  load_row(x, offset_of(x, b, i, j, 0), D, row.data());
  const double rstd = layer_norm(row.data(), D, eps, xhat);
  for (int64_t c = 0; c < D; ++c) xln[c] = xhat[c] * w.ln_in_w[c] + w.ln_in_b[c];
  return rstd;
}

// LayerNorm_out of one position from z (its row of the tile): zhat, z_ln and 1/sigma.
double output_norm(const double* z, const Params<double>& w, double eps, int64_t D, double* zhat,
                   double* zln) {
  const double rstd = layer_norm(z, D, eps, zhat);
  for (int64_t c = 0; c < D; ++c) zln[c] = zhat[c] * w.ln_out_w[c] + w.ln_out_b[c];
  return rstd;
}

double mask_value(const OptionalTensor& mask, int64_t b, int64_t i, int64_t j) {
  double m = 1.0;
  if (mask.present) load_row(mask.view, offset_of(mask.view, b, i, j), 1, &m);
  return m;
}

// dw = gy^T in over all positions (trimul_math.h), stored in dw's dtype.
void linear_weight_grad(const F& gy, const F& in, int64_t rows, int64_t n_out, int64_t n_in,
                        const TensorView& dw) {
  V out(n_out * n_in, 0.0);
  accumulate_linear_grads(gy, in, rows, n_out, n_in, out.data(), nullptr);
  store_param(dw, out.data());
}

// Per-tile column sums [tiles][cols], summed over tiles in order into a list of segments.
void reduce_tile_sums(const V& partial, int64_t tiles, int64_t cols,
                      std::initializer_list<std::pair<const TensorView*, int64_t>> segments) {
  V total(cols, 0.0);
  parallel_for(cols, [&](int64_t c) {
    double acc = 0.0;
    for (int64_t t = 0; t < tiles; ++t) acc += partial[t * cols + c];
    total[c] = acc;
  });
  int64_t at = 0;
  for (const auto& [view, n] : segments) {
    if (view) store_param(*view, &total[at]);
    at += n;
  }
}

const TensorView* optional_ptr(const OptionalTensor& t) { return t.present ? &t.view : nullptr; }

}  // namespace

void cpu::trimul_forward(const TrimulForwardArgs& a, const TrimulDims& d) {
  const Params<double> w(a.w, d.D);
  const int64_t S = d.S, D = d.D;
  const Tiles tiles(d);
  const TrimulSaved& s = a.saved;

  parallel_for(tiles.count, [&](int64_t t) {
    int64_t b, i, j0, n;
    tiles.at(t, b, i, j0, n);
    V xhat(D), xln(D), p(2 * D), g(2 * D), go(D), ab(2 * D * n);
    for (int64_t r = 0; r < n; ++r) {
      input_norm(a.x, w, a.eps, b, i, j0 + r, D, xhat.data(), xln.data());
      const double m = mask_value(a.mask, b, i, j0 + r);
      linear(xln.data(), w.wp_in_t, w.bp_in, 2 * D, D, p.data());
      linear(xln.data(), w.wg_in_t, w.bg_in, 2 * D, D, g.data());
      for (int64_t c = 0; c < 2 * D; ++c) ab[c * n + r] = sigmoid(g[c]) * p[c] * m;
      linear(xln.data(), w.wg_out_t, w.bg_out, D, D, go.data());
      store_row(s.go, offset_of(s.go, b, i, j0 + r, 0), D, go.data());
    }
    for (int64_t c = 0; c < D; ++c) {
      store_row(s.a, offset_of(s.a, b, c, i, j0), n, &ab[c * n]);
      store_row(s.b, offset_of(s.b, b, c, i, j0), n, &ab[(D + c) * n]);
    }
  });

  parallel_for(d.B * D, [&](int64_t t) {
    const int64_t b = t / D, c = t % D;
    F A(S * S), B(S * S), Z(S * S);
    load_channel(s.a, b, c, S, A.data());
    load_channel(s.b, b, c, S, B.data());
    contract(A.data(), B.data(), S, a.outgoing, Z.data());
    store_row(s.z, offset_of(s.z, b, c, 0, 0), S * S, Z.data());
  });

  parallel_for(tiles.count, [&](int64_t t) {
    int64_t b, i, j0, n;
    tiles.at(t, b, i, j0, n);
    V z(n * D), zhat(D), zln(D), po(D), go(D), y(D);
    load_channel_major_tile(s.z, b, i, j0, n, D, z.data());
    for (int64_t r = 0; r < n; ++r) {
      output_norm(&z[r * D], w, a.eps, D, zhat.data(), zln.data());
      linear(zln.data(), w.wp_out_t, w.bp_out, D, D, po.data());
      load_row(s.go, offset_of(s.go, b, i, j0 + r, 0), D, go.data());
      for (int64_t c = 0; c < D; ++c) y[c] = sigmoid(go[c]) * po[c];
      store_row(a.y, offset_of(a.y, b, i, j0 + r, 0), D, y.data());
    }
  });
}

void cpu::trimul_backward(const TrimulBackwardArgs& a, const TrimulDims& d) {
  const Params<double> w(a.w, d.D);
  const int64_t S = d.S, D = d.D, SS = S * S, R = d.B * SS;
  const Tiles tiles(d);
  const TrimulSaved& s = a.saved;

  // Output side. Per position: dpo, dgo, zln (for the weight gradients); dz channel-major.
  // Tile sums: [d norm_out_weight | d norm_out_bias | d p_out_bias | d g_out_bias].
  F dpo(R * D), dgo(R * D), zln(R * D), dz(d.B * D * SS);
  V out_sums(tiles.count * 4 * D);
  parallel_for(tiles.count, [&](int64_t t) {
    int64_t b, i, j0, n;
    tiles.at(t, b, i, j0, n);
    V z(n * D), zhat(D), zl(D), po(D), go(D), dy(D), dp(D), dg(D), dzln(D), dzr(D);
    double* sums = &out_sums[t * 4 * D];
    std::fill(sums, sums + 4 * D, 0.0);
    load_channel_major_tile(s.z, b, i, j0, n, D, z.data());
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = tiles.row(b, i, j0 + r);
      const double rstd = output_norm(&z[r * D], w, a.eps, D, zhat.data(), zl.data());
      linear(zl.data(), w.wp_out_t, w.bp_out, D, D, po.data());
      load_row(s.go, offset_of(s.go, b, i, j0 + r, 0), D, go.data());
      load_row(a.dy, offset_of(a.dy, b, i, j0 + r, 0), D, dy.data());
      for (int64_t c = 0; c < D; ++c) {
        const double sg = sigmoid(go[c]);
        dp[c] = dy[c] * sg;
        dg[c] = dy[c] * po[c] * sg * (1.0 - sg);
        dpo[row * D + c] = float(dp[c]);
        dgo[row * D + c] = float(dg[c]);
        zln[row * D + c] = float(zl[c]);
      }
      std::fill(dzln.begin(), dzln.end(), 0.0);
      linear_backward(dp.data(), w.wp_out, D, D, dzln.data());
      trimul_math::layer_norm_backward(dzln.data(), zhat.data(), w.ln_out_w, rstd, D, dzr.data());
      for (int64_t c = 0; c < D; ++c) {
        dz[(b * D + c) * SS + i * S + j0 + r] = float(dzr[c]);
        sums[c] += dzln[c] * zhat[c];
        sums[D + c] += dzln[c];
        sums[2 * D + c] += dp[c];
        sums[3 * D + c] += dg[c];
      }
    }
  });

  // The contraction's backward, per channel.
  F da(d.B * D * SS), db(d.B * D * SS);
  parallel_for(d.B * D, [&](int64_t t) {
    const int64_t b = t / D, c = t % D;
    F A(SS), B(SS);
    load_channel(s.a, b, c, S, A.data());
    load_channel(s.b, b, c, S, B.data());
    contract_backward(A.data(), B.data(), &dz[t * SS], S, a.outgoing, &da[t * SS], &db[t * SS]);
  });

  // Input side. Per position: x_ln, dp, dg (for the weight gradients); dx.
  // Tile sums: [d norm_in_weight | d norm_in_bias | d p_in_bias | d g_in_bias].
  F xln(R * D), dp(R * 2 * D), dg(R * 2 * D);
  V in_sums(tiles.count * 6 * D);
  parallel_for(tiles.count, [&](int64_t t) {
    int64_t b, i, j0, n;
    tiles.at(t, b, i, j0, n);
    V xhat(D), xl(D), p(2 * D), g(2 * D), dpr(2 * D), dgr(2 * D), dgor(D), dxln(D), dx(D);
    double* sums = &in_sums[t * 6 * D];
    std::fill(sums, sums + 6 * D, 0.0);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t row = tiles.row(b, i, j0 + r);
      const double rstd = input_norm(a.x, w, a.eps, b, i, j0 + r, D, xhat.data(), xl.data());
      const double m = mask_value(a.mask, b, i, j0 + r);
      linear(xl.data(), w.wp_in_t, w.bp_in, 2 * D, D, p.data());
      linear(xl.data(), w.wg_in_t, w.bg_in, 2 * D, D, g.data());
      const int64_t pos = i * S + j0 + r;
      for (int64_t c = 0; c < 2 * D; ++c) {
        const double dab = c < D ? da[(b * D + c) * SS + pos] : db[(b * D + c - D) * SS + pos];
        const double sg = sigmoid(g[c]);
        dpr[c] = dab * sg * m;
        dgr[c] = dab * p[c] * m * sg * (1.0 - sg);
        dp[row * 2 * D + c] = float(dpr[c]);
        dg[row * 2 * D + c] = float(dgr[c]);
        sums[2 * D + c] += dpr[c];
        sums[4 * D + c] += dgr[c];
      }
      for (int64_t c = 0; c < D; ++c) {
        dgor[c] = dgo[row * D + c];
        xln[row * D + c] = float(xl[c]);
      }
      std::fill(dxln.begin(), dxln.end(), 0.0);
      linear_backward(dpr.data(), w.wp_in, 2 * D, D, dxln.data());
      linear_backward(dgr.data(), w.wg_in, 2 * D, D, dxln.data());
      linear_backward(dgor.data(), w.wg_out, D, D, dxln.data());
      trimul_math::layer_norm_backward(dxln.data(), xhat.data(), w.ln_in_w, rstd, D, dx.data());
      store_row(a.dx, offset_of(a.dx, b, i, j0 + r, 0), D, dx.data());
      for (int64_t c = 0; c < D; ++c) {
        sums[c] += dxln[c] * xhat[c];
        sums[D + c] += dxln[c];
      }
    }
  });

  const TrimulWeightGrads& g = a.dw;
  linear_weight_grad(dpo, zln, R, D, D, g.p_out_weight);
  linear_weight_grad(dgo, xln, R, D, D, g.g_out_weight);
  linear_weight_grad(dp, xln, R, 2 * D, D, g.p_in_weight);
  linear_weight_grad(dg, xln, R, 2 * D, D, g.g_in_weight);
  reduce_tile_sums(out_sums, tiles.count, 4 * D,
                   {{&g.norm_out_weight, D},
                    {&g.norm_out_bias, D},
                    {optional_ptr(g.p_out_bias), D},
                    {optional_ptr(g.g_out_bias), D}});
  reduce_tile_sums(in_sums, tiles.count, 6 * D,
                   {{&g.norm_in_weight, D},
                    {&g.norm_in_bias, D},
                    {optional_ptr(g.p_in_bias), 2 * D},
                    {optional_ptr(g.g_in_bias), 2 * D}});
}

}  // namespace tpf

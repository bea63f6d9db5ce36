// FP64 reference of the triangle multiplicative update: plain loops, the definition and nothing else
// (row-level math in trimul_math.h). One batch element at a time, everything kept in double; the
// backward recomputes the forward. Every sum runs in index order.
#include <vector>

#include "core/indexing.h"
#include "core/numeric.h"
#include "reference/cpu.h"
#include "reference/trimul_math.h"
#include "tpf/parallel.h"

namespace tpf::cpu {
namespace {

using namespace trimul_math;
using V = Vec<double>;

// The forward of one batch element with every intermediate. Per position r = i * S + j, row-major:
// xhat, xln, zhat, zln, po, go (D each), p, g (2D). Per channel c: a, b, z ([D][S][S]).
struct Forward {
  V xhat, xln, rstd_in, p, g, m, a, b, z, zhat, zln, rstd_out, po, go;
};

void run_forward(const TensorView& x, const OptionalTensor& mask, const Params<double>& w,
                 bool outgoing, double eps, int64_t bidx, int64_t S, int64_t D, Forward& f) {
  const int64_t SS = S * S;
  f.xhat.resize(SS * D);
  f.xln.resize(SS * D);
  f.rstd_in.resize(SS);
  f.p.resize(SS * 2 * D);
  f.g.resize(SS * 2 * D);
  f.m.assign(SS, 1.0);
  f.a.resize(D * SS);
  f.b.resize(D * SS);
  f.go.resize(SS * D);
  parallel_for(S, [&](int64_t i) {
    V row(D);
    for (int64_t j = 0; j < S; ++j) {
      const int64_t r = i * S + j;
      load_row(x, offset_of(x, bidx, i, j, 0), D, row.data());
      f.rstd_in[r] = layer_norm(row.data(), D, eps, &f.xhat[r * D]);
      double* xln = &f.xln[r * D];
      for (int64_t c = 0; c < D; ++c) xln[c] = f.xhat[r * D + c] * w.ln_in_w[c] + w.ln_in_b[c];
      if (mask.present) load_row(mask.view, offset_of(mask.view, bidx, i, j), 1, &f.m[r]);
      double* p = &f.p[r * 2 * D];
      double* g = &f.g[r * 2 * D];
      linear(xln, w.wp_in_t, w.bp_in, 2 * D, D, p);
      linear(xln, w.wg_in_t, w.bg_in, 2 * D, D, g);
      for (int64_t c = 0; c < 2 * D; ++c) {
        const double v = sigmoid(g[c]) * p[c] * f.m[r];
        (c < D ? f.a[c * SS + r] : f.b[(c - D) * SS + r]) = v;
      }
      linear(xln, w.wg_out_t, w.bg_out, D, D, &f.go[r * D]);
    }
  });
  f.z.resize(D * SS);
  parallel_for(D,
               [&](int64_t c) { contract(&f.a[c * SS], &f.b[c * SS], S, outgoing, &f.z[c * SS]); });
  f.zhat.resize(SS * D);
  f.zln.resize(SS * D);
  f.rstd_out.resize(SS);
  f.po.resize(SS * D);
  parallel_for(S, [&](int64_t i) {
    V row(D);
    for (int64_t j = 0; j < S; ++j) {
      const int64_t r = i * S + j;
      for (int64_t c = 0; c < D; ++c) row[c] = f.z[c * SS + r];
      f.rstd_out[r] = layer_norm(row.data(), D, eps, &f.zhat[r * D]);
      double* zln = &f.zln[r * D];
      for (int64_t c = 0; c < D; ++c) zln[c] = f.zhat[r * D + c] * w.ln_out_w[c] + w.ln_out_b[c];
      linear(zln, w.wp_out_t, w.bp_out, D, D, &f.po[r * D]);
    }
  });
}

// dw[c] += sum_r dy[r][c] xhat[r][c], db[c] += sum_r dy[r][c].
void accumulate_norm_grads(const V& dy, const V& xhat, int64_t rows, int64_t D, V& dw, V& db) {
  parallel_for(D, [&](int64_t c) {
    for (int64_t r = 0; r < rows; ++r) {
      dw[c] += dy[r * D + c] * xhat[r * D + c];
      db[c] += dy[r * D + c];
    }
  });
}

}  // namespace

void trimul_forward_f64(const TrimulForwardArgs& a, const TrimulDims& d) {
  const Params<double> w(a.w, d.D);
  const int64_t S = d.S, D = d.D;
  Forward f;
  for (int64_t bidx = 0; bidx < d.B; ++bidx) {
    run_forward(a.x, a.mask, w, a.outgoing, a.eps, bidx, S, D, f);
    parallel_for(S, [&](int64_t i) {
      V y(D);
      for (int64_t j = 0; j < S; ++j) {
        const int64_t r = i * S + j;
        for (int64_t c = 0; c < D; ++c) y[c] = sigmoid(f.go[r * D + c]) * f.po[r * D + c];
        store_row(a.y, offset_of(a.y, bidx, i, j, 0), D, y.data());
      }
    });
  }
}

void trimul_backward_f64(const TrimulBackwardArgs& a, const TrimulDims& d) {
  const Params<double> w(a.w, d.D);
  const int64_t S = d.S, D = d.D, SS = S * S;
  V d_ln_in_w(D, 0), d_ln_in_b(D, 0), d_wp_in(2 * D * D, 0), d_wg_in(2 * D * D, 0),
      d_bp_in(2 * D, 0), d_bg_in(2 * D, 0), d_ln_out_w(D, 0), d_ln_out_b(D, 0), d_wp_out(D * D, 0),
      d_wg_out(D * D, 0), d_bp_out(D, 0), d_bg_out(D, 0);
  Forward f;
  V dpo(SS * D), dgo(SS * D), dzln(SS * D), dz(D * SS), da(D * SS), db(D * SS), dp(SS * 2 * D),
      dg(SS * 2 * D), dxln(SS * D);
  for (int64_t bidx = 0; bidx < d.B; ++bidx) {
    run_forward(a.x, a.mask, w, a.outgoing, a.eps, bidx, S, D, f);
    // Output gate, output projection and LayerNorm_out.
    parallel_for(S, [&](int64_t i) {
      V dy(D), dzr(D);
      for (int64_t j = 0; j < S; ++j) {
        const int64_t r = i * S + j;
        load_row(a.dy, offset_of(a.dy, bidx, i, j, 0), D, dy.data());
        for (int64_t c = 0; c < D; ++c) {
          const double sg = sigmoid(f.go[r * D + c]);
          dpo[r * D + c] = dy[c] * sg;
          dgo[r * D + c] = dy[c] * f.po[r * D + c] * sg * (1 - sg);
        }
        double* dzl = &dzln[r * D];
        std::fill(dzl, dzl + D, 0.0);
        linear_backward(&dpo[r * D], w.wp_out, D, D, dzl);
        trimul_math::layer_norm_backward(dzl, &f.zhat[r * D], w.ln_out_w, f.rstd_out[r], D,
                                         dzr.data());
        for (int64_t c = 0; c < D; ++c) dz[c * SS + r] = dzr[c];
      }
    });
    parallel_for(D, [&](int64_t c) {
      contract_backward(&f.a[c * SS], &f.b[c * SS], &dz[c * SS], S, a.outgoing, &da[c * SS],
                        &db[c * SS]);
    });
    // Gates, mask, input projections and LayerNorm_in.
    parallel_for(S, [&](int64_t i) {
      V dx(D);
      for (int64_t j = 0; j < S; ++j) {
        const int64_t r = i * S + j;
        for (int64_t c = 0; c < 2 * D; ++c) {
          const double dab = c < D ? da[c * SS + r] : db[(c - D) * SS + r];
          const double sg = sigmoid(f.g[r * 2 * D + c]);
          dp[r * 2 * D + c] = dab * sg * f.m[r];
          dg[r * 2 * D + c] = dab * f.p[r * 2 * D + c] * f.m[r] * sg * (1 - sg);
        }
        double* dxl = &dxln[r * D];
        std::fill(dxl, dxl + D, 0.0);
        linear_backward(&dp[r * 2 * D], w.wp_in, 2 * D, D, dxl);
        linear_backward(&dg[r * 2 * D], w.wg_in, 2 * D, D, dxl);
        linear_backward(&dgo[r * D], w.wg_out, D, D, dxl);
        trimul_math::layer_norm_backward(dxl, &f.xhat[r * D], w.ln_in_w, f.rstd_in[r], D,
                                         dx.data());
        store_row(a.dx, offset_of(a.dx, bidx, i, j, 0), D, dx.data());
      }
    });
    accumulate_linear_grads(dpo, f.zln, SS, D, D, d_wp_out.data(), d_bp_out.data());
    accumulate_linear_grads(dgo, f.xln, SS, D, D, d_wg_out.data(), d_bg_out.data());
    accumulate_linear_grads(dp, f.xln, SS, 2 * D, D, d_wp_in.data(), d_bp_in.data());
    accumulate_linear_grads(dg, f.xln, SS, 2 * D, D, d_wg_in.data(), d_bg_in.data());
    accumulate_norm_grads(dzln, f.zhat, SS, D, d_ln_out_w, d_ln_out_b);
    accumulate_norm_grads(dxln, f.xhat, SS, D, d_ln_in_w, d_ln_in_b);
  }
  const TrimulWeightGrads& g = a.dw;
  store_param(g.norm_in_weight, d_ln_in_w.data());
  store_param(g.norm_in_bias, d_ln_in_b.data());
  store_param(g.p_in_weight, d_wp_in.data());
  store_param(g.g_in_weight, d_wg_in.data());
  if (g.p_in_bias.present) store_param(g.p_in_bias.view, d_bp_in.data());
  if (g.g_in_bias.present) store_param(g.g_in_bias.view, d_bg_in.data());
  store_param(g.norm_out_weight, d_ln_out_w.data());
  store_param(g.norm_out_bias, d_ln_out_b.data());
  store_param(g.p_out_weight, d_wp_out.data());
  store_param(g.g_out_weight, d_wg_out.data());
  if (g.p_out_bias.present) store_param(g.p_out_bias.view, d_bp_out.data());
  if (g.g_out_bias.present) store_param(g.g_out_bias.view, d_bg_out.data());
}

}  // namespace tpf::cpu

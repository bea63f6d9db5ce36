// CPU loops of the fused glue ops (tpf/glue.h): FP64 arithmetic, one rounding per output, walking
// the elements the kernels walk (core/glue_geometry.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/numeric.h"
#include "reference/cpu.h"
#include "tpf/parallel.h"

namespace tpf::cpu {
namespace {

// Fixed chunks of rows for the CPU path's weight gradients: the partial sums, and so the result,
// do not depend on the thread count.
constexpr int64_t kCpuRowsPerChunk = 256;

}  // namespace

void layer_norm_forward(const LayerNormForwardArgs& a, const glue::Rows& rows, int64_t n_rows) {
  const int64_t C = a.x.shape[a.x.ndim - 1];
  const float* w = static_cast<const float*>(a.weight.data);
  const float* b = static_cast<const float*>(a.bias.data);
  float* mean = static_cast<float*>(a.mean.data);
  float* rstd = static_cast<float*>(a.rstd.data);
  parallel_for((n_rows + kCpuRowsPerChunk - 1) / kCpuRowsPerChunk, [&](int64_t chunk) {
    // FP64 throughout, one rounding to y's dtype: at least as accurate as PyTorch's at any dtype.
    std::vector<double> v(size_t(C), 0.0);
    const int64_t end = std::min(n_rows, (chunk + 1) * kCpuRowsPerChunk);
    for (int64_t r = chunk * kCpuRowsPerChunk; r < end; ++r) {
      load_row(a.x, rows.offset(r), C, v.data());
      double m = 0;
      for (double e : v) m += e;
      m /= double(C);
      double var = 0;
      for (double e : v) var += (e - m) * (e - m);
      const double rs = 1.0 / std::sqrt(var / double(C) + a.eps);
      for (int64_t c = 0; c < C; ++c) v[c] = (v[c] - m) * rs * double(w[c]) + double(b[c]);
      store_row(a.y, r * C, C, v.data());
      mean[r] = float(m);
      rstd[r] = float(rs);
    }
  });
}

void layer_norm_backward(const LayerNormBackwardArgs& a, const glue::Rows& rows, int64_t n_rows) {
  const int64_t C = a.x.shape[a.x.ndim - 1];
  const float* w = static_cast<const float*>(a.weight.data);
  const float* mean = static_cast<const float*>(a.mean.data);
  const float* rstd = static_cast<const float*>(a.rstd.data);
  const int64_t chunks = (n_rows + kCpuRowsPerChunk - 1) / kCpuRowsPerChunk;
  // FP64 throughout (the saved float32 mean and rstd as given), one rounding per output.
  std::vector<double> partial(size_t(chunks * 2 * C), 0.0);
  parallel_for(chunks, [&](int64_t chunk) {
    std::vector<double> x(static_cast<size_t>(C)), dy(static_cast<size_t>(C)),
        dx(static_cast<size_t>(C));
    double* dw = &partial[size_t(chunk * 2 * C)];
    double* db = dw + C;
    const int64_t end = std::min(n_rows, (chunk + 1) * kCpuRowsPerChunk);
    for (int64_t r = chunk * kCpuRowsPerChunk; r < end; ++r) {
      load_row(a.x, rows.offset(r), C, x.data());
      load_row(a.dy, r * C, C, dy.data());
      const double mu = mean[r], rs = rstd[r];
      double sum_g = 0, sum_gx = 0;
      for (int64_t c = 0; c < C; ++c) {
        const double xhat = (x[c] - mu) * rs;
        const double g = dy[c] * double(w[c]);
        sum_g += g;
        sum_gx += g * xhat;
        dw[c] += dy[c] * xhat;
        db[c] += dy[c];
        x[c] = xhat;
      }
      const double mg = sum_g / double(C), mgx = sum_gx / double(C);
      for (int64_t c = 0; c < C; ++c) dx[c] = rs * (dy[c] * double(w[c]) - mg - x[c] * mgx);
      store_row(a.dx, rows.offset(r), C, dx.data());
    }
  });
  float* dw = static_cast<float*>(a.dweight.data);
  float* db = static_cast<float*>(a.dbias.data);
  for (int64_t c = 0; c < C; ++c) {
    double sw = 0, sb = 0;  // chunks in order: the same result for any thread count
    for (int64_t k = 0; k < chunks; ++k) {
      sw += partial[size_t(k * 2 * C + c)];
      sb += partial[size_t(k * 2 * C + C + c)];
    }
    dw[c] = float(sw);
    db[c] = float(sb);
  }
}

void swiglu(const SwigluArgs& a, bool backward, int64_t M, int64_t H) {
  parallel_for(M, [&](int64_t m) {
    // FP64, one rounding per output.
    std::vector<double> ab(static_cast<size_t>(2 * H)), h(static_cast<size_t>(H));
    load_row(a.ab, m * 2 * H, 2 * H, ab.data());
    if (backward) load_row(a.dh, m * H, H, h.data());
    for (int64_t j = 0; j < H; ++j) {
      const double x = ab[j], b = ab[H + j], s = 1.0 / (1.0 + std::exp(-x));
      if (backward) {
        ab[j] = h[j] * b * (s * (1.0 + x * (1.0 - s)));  // d silu(x) / dx
        ab[H + j] = h[j] * x * s;
      } else {
        h[j] = x * s * b;
      }
    }
    if (backward)
      store_row(a.dab, m * 2 * H, 2 * H, ab.data());
    else
      store_row(a.h, m * H, H, h.data());
  });
}

void gated_output(const GatedOutputArgs& a, const glue::Heads& heads, bool backward) {
  const int64_t R = a.g.shape[0], HD = a.g.shape[1];
  parallel_for(R, [&](int64_t r) {
    // FP64, one rounding per output.
    std::vector<double> g(static_cast<size_t>(HD)), o(static_cast<size_t>(HD)),
        dy(static_cast<size_t>(HD)), out1(static_cast<size_t>(HD)), out2(static_cast<size_t>(HD));
    load_row(a.g, r * a.g.stride[0], HD, g.data());
    for (int64_t h = 0; h < heads.H; ++h)
      load_row(a.o, heads.o_offset(r, h * heads.D), heads.D, &o[size_t(h * heads.D)]);
    if (backward) load_row(a.dy, r * HD, HD, dy.data());
    for (int64_t c = 0; c < HD; ++c) {
      const double s = 1.0 / (1.0 + std::exp(-g[c]));
      if (backward) {
        out1[c] = dy[c] * o[c] * s * (1.0 - s);  // dg
        out2[c] = dy[c] * s;                     // do
      } else {
        out1[c] = s * o[c];
      }
    }
    if (!backward) return store_row(a.y, r * HD, HD, out1.data());
    store_row(a.dg, r * HD, HD, out1.data());
    for (int64_t h = 0; h < heads.H; ++h)
      store_row(a.do_, heads.o_offset(r, h * heads.D), heads.D, &out2[size_t(h * heads.D)]);
  });
}

}  // namespace tpf::cpu

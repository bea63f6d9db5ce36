// Index arithmetic of the fused glue ops (tpf/glue.h), shared by the CPU path and the kernels so
// that both walk the same elements.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define TPF_HD __host__ __device__ __forceinline__
#else
#define TPF_HD inline
#endif

namespace tpf::glue {

// The rows of a layer norm's input: up to three leading dims (n0 x n1 x n2 rows, any strides in
// elements), channels contiguous. Row r is the r-th in logical (row-major) order.
struct Rows {
  int64_t n1 = 1, n2 = 1;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  TPF_HD int64_t offset(int64_t r) const {
    const int64_t i2 = r % n2, q = r / n2;
    return (q / n1) * s0 + (q % n1) * s1 + i2 * s2;
  }
};

// The gated output's geometry: rows r = bn * S + s of H*D columns; o is [BN, H, S, D] contiguous.
struct Heads {
  int64_t S = 1, H = 1, D = 1;
  TPF_HD int64_t o_offset(int64_t r, int64_t c) const {
    const int64_t bn = r / S, s = r % S, h = c / D, d = c % D;
    return ((bn * H + h) * S + s) * D + d;
  }
};

TPF_HD float silu_grad_factor(float a, float s) { return s * (1.0f + a * (1.0f - s)); }

}  // namespace tpf::glue

// Helpers shared by the C++ tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace tpf {

// max |got - want| / max |want|; flags elements that are not finite (never written).
inline double max_rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got[i])) << "element " << i << " is not finite (unwritten?)";
    err = std::max(err, std::abs(double(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

// Every `stride`-th element of x: central finite differences of loss() with an exactly
// representable step against grad, within tol * (1 + |grad|).
inline void expect_matches_finite_differences(std::vector<float>& x,
                                              const std::vector<double>& grad,
                                              const std::string& name,
                                              const std::function<double()>& loss, size_t stride,
                                              double tol) {
  const float h = 1.0f / 256;
  for (size_t i = 0; i < x.size(); i += stride) {
    const float saved = x[i];
    x[i] = saved + h;
    const double up = loss();
    x[i] = saved - h;
    const double down = loss();
    x[i] = saved;
    const double fd = (up - down) / (2.0 * h);
    EXPECT_NEAR(fd, grad[i], tol * (1 + std::abs(grad[i]))) << name << "[" << i << "]";
  }
}

// sum(y * dy), the scalar whose gradients the backward computes for an output y and its gradient dy.
inline double dot(const std::vector<double>& y, const std::vector<float>& dy) {
  double l = 0;
  for (size_t i = 0; i < y.size(); ++i) l += y[i] * dy[i];
  return l;
}

}  // namespace tpf

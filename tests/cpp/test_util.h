// Helpers shared by the C++ tests.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

}  // namespace tpf

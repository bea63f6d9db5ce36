// Layout of shared-memory tiles common to the kernel families.
#pragma once

namespace tpf::cuda {

// Elements (16 bytes of a 16-bit type) of padding per shared-memory row: rows of 64 or 128
// elements would otherwise start on the same bank, and ldmatrix's eight row reads would conflict.
constexpr int kPad = 8;

}  // namespace tpf::cuda

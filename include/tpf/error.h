// Errors: every failure the library reports is a tpf::Error whose message names the argument and
// what was expected. The library never prints and never exits.
#pragma once
#include <stdexcept>
#include <string>

namespace tpf {

// Bad arguments from the caller (shape, dtype, device, stride, value). Maps to Python's ValueError.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A failure of the machine or a library underneath (CUDA, cuBLAS, I/O). Maps to RuntimeError.
class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace tpf

#define TPF_CHECK(cond, msg)                              \
  do {                                                    \
    if (!(cond)) throw ::tpf::Error(std::string() + msg); \
  } while (0)

// Errors: every failure the library reports is a tpf::Error whose message names the argument and
// what was expected. The library never prints and never exits.
#pragma once
#include <stdexcept>
#include <string>
#include <utility>

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

// A file that does not exist. Maps to Python's FileNotFoundError (errno ENOENT, the path as its
// filename).
class FileNotFoundError : public RuntimeError {
 public:
  // what(): "<kind> <path> does not exist".
  FileNotFoundError(const std::string& kind, std::string path)
      : RuntimeError(kind + " " + path + " does not exist"),
        reason_(kind + " does not exist"),
        path_(std::move(path)) {}
  const std::string& path() const { return path_; }
  const std::string& reason() const { return reason_; }

 private:
  std::string reason_, path_;
};

}  // namespace tpf

#define TPF_CHECK(cond, msg)                              \
  do {                                                    \
    if (!(cond)) throw ::tpf::Error(std::string() + msg); \
  } while (0)

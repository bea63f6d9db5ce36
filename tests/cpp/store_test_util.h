// Helpers shared by the store's tests and fuzzer: an in-memory ByteSource, seeded random records
// and a temporary directory.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "tpf/error.h"
#include "tpf/source.h"
#include "tpf/store.h"

namespace tpf::store::testing {

class MemorySource final : public ByteSource {
 public:
  explicit MemorySource(std::vector<std::byte> bytes, std::string name = "memory")
      : bytes_(std::move(bytes)), name_(std::move(name)) {}
  uint64_t size() const override { return bytes_.size(); }
  void read(uint64_t offset, size_t length, void* dst) const override {
    if (offset > bytes_.size() || length > bytes_.size() - offset)
      throw Error("read past the end of " + name_);
    if (length) std::memcpy(dst, bytes_.data() + offset, length);
  }
  std::string name() const override { return name_; }
  const std::vector<std::byte>& bytes() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
  std::string name_;
};

// A record as the tests hold it: owned arrays plus the ArrayRefs the writer takes.
struct TestRecord {
  std::vector<std::string> keys;
  std::vector<std::vector<std::byte>> data;
  std::vector<ArrayRef> refs;

  void add(const std::string& key, DType dtype, uint32_t itemsize, std::vector<uint64_t> shape,
           std::mt19937_64& rng) {
    uint64_t n = itemsize;
    for (uint64_t s : shape) n *= s;
    std::vector<std::byte> bytes(n);
    for (auto& b : bytes) b = std::byte(rng() & 0xff);
    if (dtype == DType::boolean)
      for (auto& b : bytes) b = std::byte(uint8_t(b) & 1);
    keys.push_back(key);
    data.push_back(std::move(bytes));
    ArrayRef r;
    r.dtype = dtype;
    r.itemsize = itemsize;
    r.ndim = int(shape.size());
    for (size_t d = 0; d < shape.size(); ++d) r.shape[d] = shape[d];
    refs.push_back(r);
  }
  std::vector<ArrayRef> view() const {
    std::vector<ArrayRef> v = refs;
    for (size_t i = 0; i < v.size(); ++i) {
      v[i].key = keys[i];
      v[i].data = data[i].data();
    }
    return v;
  }
};

// A structure-like record with `atoms` atoms: positions, numbers, forces, energy, cell, pbc, and
// (every third record) a custom 2-d mask and names, so layouts vary.
inline TestRecord random_record(std::mt19937_64& rng, uint64_t atoms, uint64_t salt) {
  TestRecord r;
  r.add("positions", DType::f32, 4, {atoms, 3}, rng);
  r.add("atomic_numbers", DType::u8, 1, {atoms}, rng);
  r.add("energy", DType::f64, 8, {}, rng);
  r.add("forces", DType::f32, 4, {atoms, 3}, rng);
  r.add("cell", DType::f64, 8, {3, 3}, rng);
  r.add("pbc", DType::boolean, 1, {3}, rng);
  if (salt % 3 == 0) {
    r.add("mask", DType::boolean, 1, {atoms, 2}, rng);
    r.add("atom_names", DType::bytes, 4, {atoms}, rng);
    r.add("residue_index", DType::i32, 4, {atoms}, rng);
  }
  return r;
}

// Records whose content is a function of (seed, i) alone, so a test can regenerate and compare.
inline TestRecord record_for(uint64_t seed, uint64_t i) {
  std::mt19937_64 rng(seed * 1000003u + i);
  return random_record(rng, 1 + rng() % 97, i);
}

// True when `rec` holds exactly `want`'s keys, dtypes, shapes and bytes.
inline bool same_record(const Record& rec, const TestRecord& want, std::string* why) {
  if (rec.num_fields() != want.keys.size()) {
    *why = "field count " + std::to_string(rec.num_fields()) +
           " != " + std::to_string(want.keys.size());
    return false;
  }
  for (size_t f = 0; f < want.keys.size(); ++f) {
    const Field& field = rec.field(f);
    if (rec.key(f) != want.keys[f] || field.dtype != want.refs[f].dtype ||
        field.ndim != want.refs[f].ndim || field.nbytes != want.data[f].size() ||
        std::memcmp(rec.data(f), want.data[f].data(), field.nbytes) != 0) {
      *why = "field '" + want.keys[f] + "' differs";
      return false;
    }
    for (int d = 0; d < field.ndim; ++d)
      if (field.shape[d] != want.refs[f].shape[d]) {
        *why = "field '" + want.keys[f] + "' has another shape";
        return false;
      }
  }
  return true;
}

inline std::vector<std::byte> read_file(const std::string& path) {
  std::vector<std::byte> out(std::filesystem::file_size(path));
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!out.empty() && std::fread(out.data(), 1, out.size(), f) != out.size()) out.clear();
  std::fclose(f);
  return out;
}

inline void write_file(const std::string& path, const std::vector<std::byte>& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

// The message of the tpf error that fn() throws (prefixed with the type for the machine's errors),
// or "no error".
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const FileNotFoundError& e) {
    return std::string("FileNotFoundError: ") + e.what();
  } catch (const RuntimeError& e) {
    return std::string("RuntimeError: ") + e.what();
  }
  return "no error";
}

// A fresh directory per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tpf-store-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace tpf::store::testing

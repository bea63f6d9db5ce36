// From a record's bytes to typed fields, and the rules of FORMAT.md's well-known keys: the public
// decode API every reader of records shares (the mmap Reader, FoldPipe's streaming loader, the
// Python bindings). The bytes-to-Record step itself is tpf::store::decode_record (tpf/store.h);
// this header adds decoding into the caller's memory and the key conventions.
//
// Errors: tpf::Error naming the record or the field and what was expected.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::store {

// ---------------------------------------------------------------------------------------------
// Decoding

// Decodes record i from its stored bytes (exactly entry(i).stored_length of them) like
// decode_record, but into memory the caller provides: an uncompressed record's fields point into
// `stored`, a compressed one decompresses into `raw`, which must hold decoded_size(index, i) bytes
// at an 8-byte-aligned address (unused, and may be empty, for an uncompressed record). The Record
// owns nothing (owns_data() is false): it is valid while `stored`, `raw` and `index` are. For
// readers that decode into one reused buffer. Throws tpf::Error naming the record on a checksum
// mismatch (with `verify_checksum`), a wrong length, a record that does not decompress to its
// layout's size, or a `raw` too small or misaligned.
Record decode_record_into(const Index& index, uint64_t i, std::span<const std::byte> stored,
                          std::span<std::byte> raw, bool verify_checksum = true);

// Bytes of record i once decoded (its layout's raw_size). Throws tpf::Error for i >= size().
uint64_t decoded_size(const Index& index, uint64_t i);

// ---------------------------------------------------------------------------------------------
// Well-known keys (FORMAT.md, "Well-known keys"): the conventions the Python API checks on every
// record it writes. Any other key may hold any array.

enum class KeyRule : uint8_t {
  any,           // not a well-known key
  per_atom,      // [N, ...]: atomic_numbers, charges, b_factors, occupancy, residue_index,
                 // residue_names, chain_id, atom_names
  per_atom_xyz,  // [N, 3]: positions, forces, velocities
  cell,          // [3, 3]
  pbc,           // [3] bool
  stress,        // [6] (Voigt) or [3, 3]
  scalar,        // energy, resolution
  identifier,    // a scalar utf8 (str)
};
KeyRule key_rule(std::string_view key);

// The element kind of a value, as numpy's dtype.kind spells it: 'b' bool, 'i' signed integer,
// 'u' unsigned integer, 'f' floating point, 'S' bytes, 'U' text; anything else (e.g. '?') is
// none of these.
char dtype_kind(DType d);

// The kind rules: positions are floating point, atomic_numbers integers (bool accepted) and an
// identifier is text ('U'); other keys accept every kind.
bool key_accepts_kind(std::string_view key, char kind);
// "record field '<key>' must be floating point | integers | a str, got <got>", for a kind that
// key_accepts_kind refuses; `got` names the value's type.
Error key_kind_error(std::string_view key, std::string_view got);
// Throws key_kind_error(key, got) when key_accepts_kind(key, kind) is false.
void check_key_kind(std::string_view key, char kind, std::string_view got);

// The shape rules of one record's fields, checked one field at a time: every per-atom key must
// have an atom axis (positions, forces and velocities [N, 3]) and all of them the same N; cell
// [3, 3], pbc [3], stress [6] or [3, 3], energy, resolution and identifier scalars.
class KeyChecker {
 public:
  // Throws tpf::Error naming `key`, its shape and what was expected (or the first per-atom key and
  // its atom count when N differs).
  void check_shape(std::string_view key, KeyRule rule, const uint64_t* shape, int ndim);
  void check_shape(std::string_view key, const uint64_t* shape, int ndim) {
    check_shape(key, key_rule(key), shape, ndim);
  }
  // Every rule for a typed field: its kind (check_key_kind), pbc stored as bool, and its shape.
  void check(std::string_view key, DType dtype, const uint64_t* shape, int ndim);

 private:
  std::string atoms_key_;  // the first per-atom key seen
  uint64_t atoms_ = 0;
};

// Checks every field of a record against the well-known keys' rules (KeyChecker::check), in
// order: the fields a writer is given, or a decoded record's.
void check_well_known(std::span<const ArrayRef> fields);
void check_well_known(const Record& record);

}  // namespace tpf::store

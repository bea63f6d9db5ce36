// The rules of FORMAT.md's well-known keys (tpf/record.h): which keys are per atom, which have
// fixed shapes, which are scalars, and the element kinds of positions, atomic_numbers, pbc and
// identifier.
#include <string>
#include <utility>

#include "tpf/error.h"
#include "tpf/record.h"

namespace tpf::store {

namespace {

std::string shape_text(const uint64_t* shape, int ndim) {
  std::string t = "[";
  for (int d = 0; d < ndim; ++d) t += (d ? ", " : "") + std::to_string(shape[d]);
  return t + "]";
}

Error field_error(std::string_view key, const std::string& what) {
  return Error("record field '" + std::string(key) + "' " + what);
}

}  // namespace

KeyRule key_rule(std::string_view key) {
  static const std::pair<std::string_view, KeyRule> rules[] = {
      {"positions", KeyRule::per_atom_xyz},
      {"forces", KeyRule::per_atom_xyz},
      {"velocities", KeyRule::per_atom_xyz},
      {"atomic_numbers", KeyRule::per_atom},
      {"charges", KeyRule::per_atom},
      {"b_factors", KeyRule::per_atom},
      {"occupancy", KeyRule::per_atom},
      {"residue_index", KeyRule::per_atom},
      {"residue_names", KeyRule::per_atom},
      {"chain_id", KeyRule::per_atom},
      {"atom_names", KeyRule::per_atom},
      {"cell", KeyRule::cell},
      {"pbc", KeyRule::pbc},
      {"stress", KeyRule::stress},
      {"energy", KeyRule::scalar},
      {"resolution", KeyRule::scalar},
      {"identifier", KeyRule::identifier}};
  for (const auto& [k, r] : rules)
    if (k == key) return r;
  return KeyRule::any;
}

char dtype_kind(DType d) {
  switch (d) {
    case DType::boolean: return 'b';
    case DType::u8:
    case DType::u16:
    case DType::u32:
    case DType::u64: return 'u';
    case DType::i8:
    case DType::i16:
    case DType::i32:
    case DType::i64: return 'i';
    case DType::f16:
    case DType::f32:
    case DType::f64: return 'f';
    case DType::bytes: return 'S';
    case DType::utf8: return 'U';
  }
  return '?';
}

bool key_accepts_kind(std::string_view key, char kind) {
  if (key == "positions") return kind == 'f';
  if (key == "atomic_numbers") return kind == 'i' || kind == 'u' || kind == 'b';
  if (key == "identifier") return kind == 'U';
  return true;
}

Error key_kind_error(std::string_view key, std::string_view got) {
  const char* expected = key == "positions"        ? "floating point"
                         : key == "atomic_numbers" ? "integers"
                         : key == "identifier"     ? "a str"
                                                   : "of another kind";
  return field_error(key, std::string("must be ") + expected + ", got " + std::string(got));
}

void check_key_kind(std::string_view key, char kind, std::string_view got) {
  if (!key_accepts_kind(key, kind)) throw key_kind_error(key, got);
}

void KeyChecker::check_shape(std::string_view key, KeyRule rule, const uint64_t* shape, int ndim) {
  const auto got = [&] { return shape_text(shape, ndim); };
  switch (rule) {
    case KeyRule::any: return;
    case KeyRule::per_atom:
    case KeyRule::per_atom_xyz:
      if (ndim < 1)
        throw field_error(key, "is per-atom and needs an atom axis, got shape " + got());
      if (rule == KeyRule::per_atom_xyz && (ndim != 2 || shape[1] != 3))
        throw field_error(key, "must have shape [n_atoms, 3], got " + got());
      if (atoms_key_.empty()) {
        atoms_key_ = key;
        atoms_ = shape[0];
      } else if (shape[0] != atoms_) {
        throw field_error(key, "has " + std::to_string(shape[0]) + " atoms but '" + atoms_key_ +
                                   "' has " + std::to_string(atoms_));
      }
      return;
    case KeyRule::cell:
      if (ndim != 2 || shape[0] != 3 || shape[1] != 3)
        throw field_error(key, "must have shape [3, 3], got " + got());
      return;
    case KeyRule::pbc:
      if (ndim != 1 || shape[0] != 3) throw field_error(key, "must have shape [3], got " + got());
      return;
    case KeyRule::stress:
      if (!(ndim == 1 && shape[0] == 6) && !(ndim == 2 && shape[0] == 3 && shape[1] == 3))
        throw field_error(key, "must have shape [6] or [3, 3], got " + got());
      return;
    case KeyRule::scalar:
    case KeyRule::identifier:
      if (ndim != 0) throw field_error(key, "must be a scalar, got shape " + got());
      return;
  }
}

void KeyChecker::check(std::string_view key, DType dtype, const uint64_t* shape, int ndim) {
  const KeyRule rule = key_rule(key);
  if (rule == KeyRule::any) return;
  check_key_kind(key, dtype_kind(dtype), dtype_name(dtype));
  if (rule == KeyRule::pbc && dtype != DType::boolean)
    throw field_error(key, "must be bool, got " + std::string(dtype_name(dtype)));
  check_shape(key, rule, shape, ndim);
}

void check_well_known(std::span<const ArrayRef> fields) {
  KeyChecker checker;
  for (const ArrayRef& f : fields) checker.check(f.key, f.dtype, f.shape, f.ndim);
}

void check_well_known(const Record& record) {
  KeyChecker checker;
  for (size_t i = 0; i < record.num_fields(); ++i) {
    const Field& f = record.field(i);
    checker.check(record.key(i), f.dtype, f.shape, f.ndim);
  }
}

}  // namespace tpf::store

// Records as Python dicts: the one route from a decoded record (tpf/record.h) to {key: value},
// shared by the store's reader and the streaming loader so both hand out the same types (numpy
// arrays, numpy scalars for 0-d numeric fields, str or "U" arrays for utf8 text).
#pragma once
#include <nanobind/nanobind.h>

#include <memory>
#include <string>
#include <vector>

#include "tpf/record.h"

namespace tpf::py {

// Per index: its keys as interned str and, per layout (made on first use; the GIL serialises the
// filling), what making each field's value takes. Refers to the index (keep it alive).
class RecordDicts {
  struct FieldPlan;
  using LayoutPlan = std::vector<FieldPlan>;

 public:
  explicit RecordDicts(const store::Index& index);
  ~RecordDicts();
  RecordDicts(const RecordDicts&) = delete;
  RecordDicts& operator=(const RecordDicts&) = delete;

  // The arrays of a dict being made, borrowed from it: one per field, null where the value is
  // made from the record's bytes (a scalar, text).
  class Arrays {
   public:
    Arrays() = default;
    Arrays(const Arrays&) = delete;
    Arrays& operator=(const Arrays&) = delete;

   private:
    friend class RecordDicts;
    const LayoutPlan* plan_ = nullptr;
    PyObject** at_ = inline_;
    PyObject* inline_[16] = {};
    std::vector<PyObject*> more_;
    bool own_ = false;
  };

  // Step 1: the dict of a record of layout `layout_id`, in the layout's key order, holding its
  // arrays: views of the decoded record's bytes at `view` (kept alive by `owner`, made their base)
  // or, when `view` is null, empty arrays of their own. None holds the place of the other values.
  // Made before the record's bytes are needed, so they load meanwhile.
  nanobind::object begin(uint32_t layout_id, const std::byte* view, nanobind::handle owner,
                         Arrays& arrays) const;
  // Step 2, from the decoded record: copies its bytes into the arrays of their own (writable only
  // with `writable`) and puts in the scalars and text. `source_name` and `record` label errors.
  void finish(nanobind::handle dict, const Arrays& arrays, const store::Record& rec, bool writable,
              const std::string& source_name, uint64_t record) const;
  // Both steps for a record already decoded: with `owner`, arrays view the record's bytes (which
  // it keeps alive); without (a null handle), arrays of their own, read-only.
  nanobind::object dict(uint32_t layout_id, const store::Record& rec, nanobind::handle owner,
                        const std::string& source_name, uint64_t record) const;

  // The interned str of key `key_id`.
  PyObject* key(uint32_t key_id) const { return keys_[key_id].ptr(); }

 private:
  const LayoutPlan& plan(uint32_t layout_id) const;

  const store::Index* index_;
  std::vector<nanobind::object> keys_;
  mutable std::vector<std::shared_ptr<const LayoutPlan>> plans_;
};

}  // namespace tpf::py

// Records as Python dicts, shared by the store's reader and the streaming loader so both hand out
// the same types (numpy views, numpy scalars for 0-d fields, str for text).
#pragma once
#include <nanobind/nanobind.h>

#include <string>
#include <vector>

#include "tpf/store.h"

namespace tpf::py {

// {key: value} for a decoded record whose bytes `owner` keeps alive (the arrays are views into
// them). `source_name` and `record` label errors.
nanobind::object record_to_dict(const store::Record& rec, nanobind::object owner,
                                const std::string& source_name, uint64_t record);
// The same with the keys taken from `keys` (interned str by key id, filled here as keys are first
// seen), one per index: no str is made and hashed per field per record.
nanobind::object record_to_dict(const store::Record& rec, nanobind::object owner,
                                const std::string& source_name, uint64_t record,
                                std::vector<nanobind::object>& keys);

}  // namespace tpf::py

// Batch reads: a plan of where each record's fields go in the per-key outputs, then the records
// decoded straight into them, in file order, on whatever split among threads the caller chooses.
#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "store/record.h"
#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::store {

BatchPlan::BatchPlan(const Index& index, std::span<const uint64_t> indices, bool stack)
    : index_(&index), indices_(indices.begin(), indices.end()) {
  const size_t B = indices.size();
  TPF_CHECK(B > 0, "indices: a batch needs at least one record");
  TPF_CHECK(B <= UINT32_MAX,
            "indices: a batch holds at most 2^32 - 1 records, got " + std::to_string(B));
  entries_.resize(B);
  index.entries(indices, entries_.data());

  const uint64_t first_record = indices[0];
  const Layout& first = index.layout(entries_[0].layout_id);
  const size_t F = first.fields.size();
  outputs_.resize(F);
  for (size_t t = 0; t < F; ++t) {
    const Field& g = first.fields[t];
    BatchOutput& o = outputs_[t];
    o.key_id = g.key_id;
    o.dtype = g.dtype;
    o.itemsize = g.itemsize;
    o.concatenated = !stack && g.ndim > 0;
  }

  // Each distinct layout of the batch is checked against the first record's once.
  auto fail = [&](uint64_t record, const std::string& why) {
    return Error(index.name() + ": batch: record " + std::to_string(record) + " " + why);
  };
  auto plan_layout = [&](uint32_t layout_id, uint64_t record) {
    const Layout& l = index.layout(layout_id);
    if (l.fields.size() != F)
      throw fail(record, "has " + std::to_string(l.fields.size()) + " fields, record " +
                             std::to_string(first_record) + " has " + std::to_string(F) +
                             "; a batch needs the same keys in every record");
    std::vector<FieldCopy> copies(F);
    for (size_t a = 0; a < F; ++a) {
      const Field& f = l.fields[a];
      size_t t = 0;
      while (t < F && first.fields[t].key_id != f.key_id) ++t;
      const std::string& name = index.keys()[f.key_id];
      if (t == F)
        throw fail(record, "has key '" + name + "' that record " + std::to_string(first_record) +
                               " lacks; a batch needs the same keys in every record");
      const Field& g = first.fields[t];
      const bool text = dtype_size(f.dtype) == 0;
      bool same = f.dtype == g.dtype && (text || f.itemsize == g.itemsize) && f.ndim == g.ndim;
      for (int d = stack ? 0 : 1; same && d < f.ndim; ++d) same = f.shape[d] == g.shape[d];
      if (!same)
        throw fail(record,
                   "has field '" + name + "' of another dtype or shape than record " +
                       std::to_string(first_record) +
                       (stack ? " (stacking needs identical shapes)" : " (beyond the first axis)"));
      outputs_[t].itemsize = std::max(outputs_[t].itemsize, f.itemsize);
      copies[a] = {f.offset, f.nbytes, 0, f.ndim ? f.shape[0] : 1, uint32_t(t), f.itemsize};
    }
    return copies;
  };
  plan_of_.resize(B);
  std::unordered_map<uint32_t, uint32_t> plan_of_layout;
  uint32_t last_layout = entries_[0].layout_id;
  plan_of_layout[last_layout] = 0;
  copies_.push_back(plan_layout(last_layout, first_record));
  for (size_t b = 1; b < B; ++b) {
    const uint32_t lid = entries_[b].layout_id;
    if (lid == last_layout) {
      plan_of_[b] = plan_of_[b - 1];
      continue;
    }
    const auto [it, added] = plan_of_layout.try_emplace(lid, uint32_t(copies_.size()));
    if (added) copies_.push_back(plan_layout(lid, indices[b]));
    plan_of_[b] = it->second;
    last_layout = lid;
  }

  // Every record's share of every output, in the order asked for; text widened to the widest.
  for (std::vector<FieldCopy>& copies : copies_)
    for (FieldCopy& c : copies) c.out_nbytes = c.nbytes / c.itemsize * outputs_[c.output].itemsize;
  start_.resize(B * F);
  std::vector<uint64_t> at(F, 0), rows(F, 0);
  for (BatchOutput& o : outputs_)
    if (o.concatenated) o.lengths.resize(B);
  for (size_t b = 0; b < B; ++b) {
    for (const FieldCopy& c : copies_[plan_of_[b]]) {
      BatchOutput& o = outputs_[c.output];
      start_[b * F + c.output] = at[c.output];
      at[c.output] += c.out_nbytes;
      if (o.concatenated) {
        o.lengths[b] = int64_t(c.rows);
        rows[c.output] += c.rows;
      }
    }
  }
  for (size_t t = 0; t < F; ++t) {
    const Field& g = first.fields[t];
    BatchOutput& o = outputs_[t];
    o.shape.push_back(o.concatenated ? rows[t] : B);
    for (int d = o.concatenated ? 1 : 0; d < g.ndim; ++d) o.shape.push_back(g.shape[d]);
    o.nbytes = at[t];
  }

  std::vector<std::pair<uint64_t, uint32_t>> by_offset(B);
  for (size_t b = 0; b < B; ++b) by_offset[b] = {entries_[b].offset, uint32_t(b)};
  std::sort(by_offset.begin(), by_offset.end());
  order_.resize(B);
  for (size_t k = 0; k < B; ++k) order_[k] = by_offset[k].second;
}

void BatchPlan::decode(std::span<const std::byte> file, size_t begin, size_t end,
                       std::span<std::byte* const> out, bool verify) const {
  TPF_CHECK(begin <= end && end <= order_.size(),
            "range: expected begin <= end <= " + std::to_string(order_.size()) + ", got [" +
                std::to_string(begin) + ", " + std::to_string(end) + ")");
  TPF_CHECK(out.size() == outputs_.size(), "out: expected " + std::to_string(outputs_.size()) +
                                               " outputs, got " + std::to_string(out.size()));
  const size_t F = outputs_.size();
  auto inside = [&](const RecordEntry& e) {
    return e.offset <= file.size() && e.stored_length <= file.size() - e.offset;
  };
  // Compressed records decode into 8-byte-aligned words (every field offset is aligned for its
  // type), kept per thread up to kKeepBytes so that a batch allocates nothing per record, while one
  // huge record leaves no huge buffer behind.
  constexpr uint64_t kKeepBytes = uint64_t(1) << 20;
  thread_local std::vector<uint64_t> scratch;
  std::vector<uint64_t> large;
  // The records of a shuffled batch lie far apart: the next few are kept loading while one is
  // checked and copied, into L2 (locality 1), which keeps more misses in flight than L1. (Written
  // in the loop: GCC deletes calls to a function that only prefetches, as if it did nothing.)
  constexpr size_t kAhead = 4;
  size_t loading = begin;
  for (size_t k = begin; k < end; ++k) {
    for (; loading < end && loading <= k + kAhead; ++loading) {
      const RecordEntry& e = entries_[order_[loading]];
      if (!inside(e)) continue;
      for (uint64_t line = e.offset & ~uint64_t(63); line < e.offset + e.stored_length; line += 64)
        __builtin_prefetch(file.data() + line, 0, 1);
    }
    const uint32_t b = order_[k];
    const RecordEntry& e = entries_[b];
    const uint64_t i = indices_[b];
    if (!inside(e))
      throw Error(index_->name() + ": record " + std::to_string(i) + " lies outside the " +
                  std::to_string(file.size()) + " bytes given as the file");
    const std::span<const std::byte> stored = file.subspan(e.offset, e.stored_length);
    detail::check_stored(*index_, i, e, stored, verify);
    const std::byte* base = stored.data();
    if (e.codec != Codec::none) {
      const uint64_t raw_size = index_->layout(e.layout_id).raw_size;
      std::vector<uint64_t>& words = raw_size <= kKeepBytes ? scratch : large;
      if (words.size() < raw_size / 8 + 1) words.resize(raw_size / 8 + 1);
      const std::span<std::byte> raw(reinterpret_cast<std::byte*>(words.data()), raw_size);
      detail::decompress_record(*index_, i, e, stored, raw);
      base = raw.data();
    }
    const uint64_t* start = start_.data() + size_t(b) * F;
    for (const FieldCopy& c : copies_[plan_of_[b]]) {
      if (c.nbytes == 0) continue;
      std::byte* dst = out[c.output] + start[c.output];
      if (c.out_nbytes == c.nbytes) {
        std::memcpy(dst, base + c.offset, c.nbytes);
        continue;
      }
      const uint32_t width = outputs_[c.output].itemsize;
      for (uint64_t from = 0; from < c.nbytes; from += c.itemsize, dst += width)
        std::memcpy(dst, base + c.offset + from, c.itemsize);
    }
  }
}

}  // namespace tpf::store

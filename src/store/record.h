// Checking and decompressing one record's stored bytes: the steps decode_record and batch reads
// share.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

#include "tpf/store.h"

namespace tpf::store::detail {

// Checks record i's stored bytes against its entry `e`: their length, their checksum when
// `verify`, and for a compressed record that they can decode to its layout's size (checked before
// anything of that size is allocated). Throws tpf::Error naming the record.
void check_stored(const Index& index, uint64_t i, const RecordEntry& e,
                  std::span<const std::byte> stored, bool verify);

// Decompresses checked stored bytes of a compressed record into `raw` (its layout's raw_size
// bytes). Throws tpf::Error naming the record when they do not decode to exactly that.
void decompress_record(const Index& index, uint64_t i, const RecordEntry& e,
                       std::span<const std::byte> stored, std::span<std::byte> raw);

}  // namespace tpf::store::detail

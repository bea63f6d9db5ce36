// Per-record compression: one frame (zstd) or one block (lz4) per record.
#pragma once
#include <cstddef>
#include <span>
#include <vector>

#include "tpf/store.h"

namespace tpf::store::detail {

// Compresses `raw` into `out` (resized). Returns false when the codec would not make the record
// smaller, in which case the caller stores it uncompressed.
bool compress(Codec codec, int level, std::span<const std::byte> raw, std::vector<std::byte>& out);

// A cheap check that `stored` can decode to `raw_size` bytes: a zstd frame must declare that
// content size, and an LZ4 block cannot expand more than 255-fold.
bool may_decompress_to(Codec codec, std::span<const std::byte> stored, uint64_t raw_size);

// Decompresses `stored` into exactly `raw.size()` bytes; false when the input is malformed or does
// not decode to that size.
bool decompress(Codec codec, std::span<const std::byte> stored, std::span<std::byte> raw);

}  // namespace tpf::store::detail

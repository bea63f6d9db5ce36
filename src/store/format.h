// On-disk constants of FORMAT.md and the encoders the writer shares with the tests and the fuzzer.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tpf/store.h"

namespace tpf::store::detail {

inline constexpr char kHeaderMagic[8] = {'T', 'P', 'F', 'S', 'T', 'O', 'R', 'E'};
inline constexpr char kIndexMagic[8] = {'T', 'P', 'F', 'I', 'N', 'D', 'E', 'X'};
inline constexpr size_t kSlotBytes = 64;
inline constexpr size_t kSlotChecksumAt = 56;  // the slot checksum covers bytes [0, 56)
inline constexpr size_t kIndexPrefixBytes = 32;
inline constexpr size_t kEntryBytes = 32;
inline constexpr uint64_t kRecordAlignment = 8;
inline constexpr size_t kMaxKeyBytes = 1024;

// Slot bytes for `h` (its `valid` and `problem` are ignored); the checksum is filled in.
void encode_header_slot(const HeaderSlot& h, std::span<std::byte, kSlotBytes> out);

// The index block for keys, layouts and entries (entries are kEntryBytes each, already encoded).
std::vector<std::byte> encode_index(const std::vector<std::string>& keys,
                                    const std::vector<Layout>& layouts,
                                    std::span<const std::byte> entries, uint64_t record_count);

void encode_entry(const RecordEntry& e, std::byte* out);

// Field offsets and the decoded size of a layout whose fields have dtype/itemsize/shape set.
// Throws tpf::Error (mentioning `what`) when sizes overflow 64 bits.
void place_fields(Layout& layout, const char* what);

// Alignment of a field inside a decoded record: the largest power of two dividing its itemsize,
// at most 8, so every array of a record at an 8-aligned address is naturally aligned.
uint64_t field_alignment(uint32_t itemsize);

}  // namespace tpf::store::detail

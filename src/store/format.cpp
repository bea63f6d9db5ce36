// Header slots, the index block and its validation: the committed state of a file.
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "store/bytes.h"
#include "store/format.h"
#include "tpf/error.h"

namespace tpf::store {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::boolean: return "bool";
    case DType::u8: return "uint8";
    case DType::i8: return "int8";
    case DType::u16: return "uint16";
    case DType::i16: return "int16";
    case DType::u32: return "uint32";
    case DType::i32: return "int32";
    case DType::u64: return "uint64";
    case DType::i64: return "int64";
    case DType::f16: return "float16";
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bytes: return "bytes";
    case DType::utf8: return "utf8";
  }
  return "unknown";
}

uint32_t dtype_size(DType d) {
  switch (d) {
    case DType::boolean:
    case DType::u8:
    case DType::i8: return 1;
    case DType::u16:
    case DType::i16:
    case DType::f16: return 2;
    case DType::u32:
    case DType::i32:
    case DType::f32: return 4;
    case DType::u64:
    case DType::i64:
    case DType::f64: return 8;
    case DType::bytes:
    case DType::utf8: return 0;
  }
  return 0;
}

static bool known_dtype(uint8_t code) { return code >= 1 && code <= 14; }

const char* codec_name(Codec c) {
  switch (c) {
    case Codec::none: return "none";
    case Codec::zstd: return "zstd";
    case Codec::lz4: return "lz4";
  }
  return "unknown";
}

Codec parse_codec(std::string_view name, const char* argument) {
  if (name == "none") return Codec::none;
  if (name == "zstd") return Codec::zstd;
  if (name == "lz4") return Codec::lz4;
  throw Error(std::string(argument) + " must be 'none', 'zstd' or 'lz4', got '" +
              std::string(name) + "'");
}

namespace detail {

#if defined(__x86_64__)
uint64_t checksum_avx2(const void* data, size_t n);  // checksum_avx2.cpp
#endif

// AVX2 where the CPU has it, else the library's baseline (SSE2) build; the same value either way.
// Not xxHash's runtime dispatch: it picks AVX-512 where present, and a single-record read,
// which hashes 1-2 KiB between stretches of Python, then pays the wide unit's warm-up on every
// call (measured on a Xeon VM: +300 ns per 1.6 KiB record, against +50 ns for AVX2 and +110 ns
// for SSE2).
uint64_t checksum(const void* data, size_t n) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return checksum_avx2(data, n);
#endif
  return XXH3_64bits(data, n);
}

void Cursor::need(size_t n, const char* field) const {
  if (n > b_.size() - pos_)
    throw Error(what_ + ": index block ends inside " + field + " (at byte " + std::to_string(pos_) +
                " of " + std::to_string(b_.size()) + ")");
}

uint64_t field_alignment(uint32_t itemsize) {
  uint64_t a = 1;
  while (a < 8 && itemsize % (a * 2) == 0) a *= 2;
  return a;
}

void place_fields(Layout& layout, const char* what) {
  uint64_t at = 0;
  for (Field& f : layout.fields) {
    uint64_t n = f.itemsize;
    for (int d = 0; d < f.ndim; ++d) {
      if (f.shape[d] != 0 && n > UINT64_MAX / f.shape[d])
        throw Error(std::string(what) + ": array size overflows 64 bits");
      n *= f.shape[d];
    }
    // Both steps checked: a field of 2^64 - 14 bytes once passed the size check and let the next
    // field's alignment wrap the offset round to a few bytes (found by the batch fuzzer).
    if (at > UINT64_MAX - 7) throw Error(std::string(what) + ": record size overflows 64 bits");
    at = align_up(at, field_alignment(f.itemsize));
    if (n > UINT64_MAX - at) throw Error(std::string(what) + ": record size overflows 64 bits");
    f.offset = at;
    f.nbytes = n;
    at += n;
  }
  layout.raw_size = at;
}

void encode_header_slot(const HeaderSlot& h, std::span<std::byte, kSlotBytes> out) {
  std::byte* p = out.data();
  std::memset(p, 0, kSlotBytes);
  std::memcpy(p, kHeaderMagic, 8);
  store<uint32_t>(p + 8, h.version);
  store<uint32_t>(p + 12, 0);
  store<uint64_t>(p + 16, h.generation);
  store<uint64_t>(p + 24, h.record_count);
  store<uint64_t>(p + 32, h.index_offset);
  store<uint64_t>(p + 40, h.index_length);
  store<uint64_t>(p + 48, h.index_checksum);
  store<uint64_t>(p + kSlotChecksumAt, checksum(p, kSlotChecksumAt));
}

void encode_entry(const RecordEntry& e, std::byte* out) {
  std::memset(out, 0, kEntryBytes);
  store<uint64_t>(out, e.offset);
  store<uint32_t>(out + 8, e.stored_length);
  store<uint32_t>(out + 12, e.layout_id);
  store<uint8_t>(out + 16, uint8_t(e.codec));
  store<uint64_t>(out + 24, e.checksum);
}

std::vector<std::byte> encode_index(const std::vector<std::string>& keys,
                                    const std::vector<Layout>& layouts,
                                    std::span<const std::byte> entries, uint64_t record_count) {
  std::vector<std::byte> out(kIndexPrefixBytes);
  std::memcpy(out.data(), kIndexMagic, 8);
  store<uint64_t>(out.data() + 8, record_count);
  store<uint32_t>(out.data() + 16, uint32_t(keys.size()));
  store<uint32_t>(out.data() + 20, uint32_t(layouts.size()));
  for (const std::string& k : keys) {
    put<uint16_t>(out, uint16_t(k.size()));
    put_bytes(out, k.data(), k.size());
  }
  for (const Layout& l : layouts) {
    put<uint32_t>(out, uint32_t(l.fields.size()));
    for (const Field& f : l.fields) {
      put<uint32_t>(out, f.key_id);
      put<uint8_t>(out, uint8_t(f.dtype));
      put<uint8_t>(out, uint8_t(f.ndim));
      put<uint16_t>(out, 0);
      put<uint32_t>(out, f.itemsize);
      for (int d = 0; d < f.ndim; ++d) put<uint64_t>(out, f.shape[d]);
    }
  }
  pad_to(out, 8);
  store<uint64_t>(out.data() + 24, out.size());
  put_bytes(out, entries.data(), entries.size());
  return out;
}

namespace {

// The checksum is checked before any field is believed: a flipped byte anywhere in a slot (its
// version included) makes that slot invalid, never the file unreadable.
HeaderSlot decode_slot(const std::byte* p) {
  HeaderSlot h;
  if (std::all_of(p, p + kSlotBytes, [](std::byte b) { return b == std::byte{0}; })) {
    h.problem = "never written (all zero)";
    return h;
  }
  if (std::memcmp(p, kHeaderMagic, 8) != 0) {
    h.problem = "wrong magic (expected \"TPFSTORE\")";
    return h;
  }
  if (load<uint64_t>(p + kSlotChecksumAt) != detail::checksum(p, kSlotChecksumAt)) {
    h.problem = "checksum mismatch (torn or corrupted header)";
    return h;
  }
  h.version = load<uint32_t>(p + 8);
  if (h.version != kFormatVersion) {
    h.newer = h.version > kFormatVersion;
    h.problem = "format version " + std::to_string(h.version) + " (this reader knows version " +
                std::to_string(kFormatVersion) + ")";
    return h;
  }
  if (load<uint32_t>(p + 12) != 0) {
    h.problem = "reserved flags are not zero";
    return h;
  }
  h.generation = load<uint64_t>(p + 16);
  h.record_count = load<uint64_t>(p + 24);
  h.index_offset = load<uint64_t>(p + 32);
  h.index_length = load<uint64_t>(p + 40);
  h.index_checksum = load<uint64_t>(p + 48);
  if (h.index_offset < kHeaderRegionBytes || h.index_offset % kRecordAlignment != 0 ||
      h.index_length < kIndexPrefixBytes || h.index_length > UINT64_MAX - h.index_offset) {
    h.problem = "index range is malformed";
    return h;
  }
  h.valid = true;
  return h;
}

bool never_written(const HeaderSlot& h) {
  return !h.valid && h.problem.rfind("never written", 0) == 0;
}

}  // namespace
}  // namespace detail

Headers parse_headers(std::span<const std::byte> region, uint64_t file_size,
                      const std::string& name) {
  using namespace detail;
  if (file_size == 0)
    throw Error(name + " is empty (0 bytes); a store starts with a 128-byte header region");
  if (region.size() < kHeaderRegionBytes || file_size < kHeaderRegionBytes)
    throw Error(name + " is truncated: " + std::to_string(file_size) +
                " bytes, a store starts with a 128-byte header region");
  Headers h;
  for (int s = 0; s < 2; ++s) h.slot[s] = decode_slot(region.data() + s * kSlotBytes);
  for (int s = 0; s < 2; ++s) {
    if (h.slot[s].newer)
      throw Error(name + " has format version " + std::to_string(h.slot[s].version) +
                  ", newer than this reader's version " + std::to_string(kFormatVersion) +
                  "; upgrade tpfkit to read it");
  }
  if (!h.slot[0].valid && !h.slot[1].valid) {
    if (never_written(h.slot[0]) && never_written(h.slot[1]))
      throw Error(name +
                  " has an unfinished first commit: its 128-byte header region is all zero "
                  "(the writer that created it stopped before its first commit completed), so it "
                  "holds no committed records");
    if (std::memcmp(region.data(), kHeaderMagic, 8) != 0 &&
        std::memcmp(region.data() + kSlotBytes, kHeaderMagic, 8) != 0)
      throw Error(name + " is not a TurboPairFormer store (wrong magic: expected \"TPFSTORE\")");
    throw Error(name + " has no intact header: slot 0 " + h.slot[0].problem + ", slot 1 " +
                h.slot[1].problem);
  }
  if (h.slot[0].valid && h.slot[1].valid)
    h.current = h.slot[1].generation > h.slot[0].generation ? 1 : 0;
  else
    h.current = h.slot[0].valid ? 0 : 1;
  const HeaderSlot& c = h.slot[h.current];
  if (c.index_offset + c.index_length > file_size)
    throw Error(name + " is truncated: commit generation " + std::to_string(c.generation) +
                " has its index at bytes [" + std::to_string(c.index_offset) + ", " +
                std::to_string(c.index_offset + c.index_length) + ") but the file has " +
                std::to_string(file_size) + " bytes");
  const HeaderSlot& other = h.slot[1 - h.current];
  if (other.valid || never_written(other)) return h;
  // The other slot is damaged. Every commit's index lies after the previous commit's, so the
  // damaged slot held an older commit when nothing follows the current commit's index, or when
  // its (unverified) fields name an intact index block that ends before the current one starts.
  h.damaged = 1 - h.current;
  h.bytes_after = file_size - (c.index_offset + c.index_length);
  const std::byte* raw = region.data() + h.damaged * kSlotBytes;
  h.damaged_index_offset = load<uint64_t>(raw + 32);
  h.damaged_index_length = load<uint64_t>(raw + 40);
  h.damaged_index_checksum = load<uint64_t>(raw + 48);
  h.fallback = h.bytes_after != 0;
  return h;
}

void check_fallback(Headers& h, const std::string& name, bool recover,
                    const std::function<uint64_t(uint64_t offset, uint64_t length)>& checksum_of) {
  if (!h.fallback) return;
  const HeaderSlot& c = h.slot[h.current];
  const uint64_t off = h.damaged_index_offset, len = h.damaged_index_length;
  if (off >= kHeaderRegionBytes && len >= detail::kIndexPrefixBytes && len <= c.index_offset &&
      off <= c.index_offset - len && checksum_of(off, len) == h.damaged_index_checksum) {
    h.fallback = false;  // it names an older, intact index: the slot of an older commit
    return;
  }
  if (recover) return;
  throw Error(fallback_message(h, name) + ". Reading generation " + std::to_string(c.generation) +
              " would drop any records committed after it: open the file with recover=True to "
              "read it anyway, or restore the file from a copy");
}

std::string fallback_message(const Headers& h, const std::string& name) {
  const HeaderSlot& c = h.slot[h.current];
  return (name.empty() ? std::string() : name + ": ") + "header slot " + std::to_string(h.damaged) +
         " is damaged: " + h.slot[h.damaged].problem +
         ", and may hold a newer commit than generation " + std::to_string(c.generation) + " (" +
         std::to_string(c.record_count) + " records), the last intact one; the file holds " +
         std::to_string(h.bytes_after) + " bytes after that commit";
}

Index Index::from_block(const HeaderSlot& header, std::span<const std::byte> block,
                        std::shared_ptr<const void> owner, uint64_t file_size,
                        const std::string& name) {
  using namespace detail;
  const std::string what = name + " (generation " + std::to_string(header.generation) + ")";
  if (block.size() != header.index_length)
    throw Error(what + ": index block is " + std::to_string(block.size()) + " bytes, header says " +
                std::to_string(header.index_length));
  if (checksum(block.data(), block.size()) != header.index_checksum)
    throw Error(what + ": index checksum mismatch (the index is corrupt)");
  Cursor c(block, what);
  auto magic = c.take_bytes(8, "the index magic");
  if (std::memcmp(magic.data(), kIndexMagic, 8) != 0)
    throw Error(what + ": index has wrong magic (expected \"TPFINDEX\")");
  Index ix;
  ix.header_ = header;
  ix.name_ = name;
  ix.owner_ = std::move(owner);
  ix.record_count_ = c.take<uint64_t>("the record count");
  if (ix.record_count_ != header.record_count)
    throw Error(what + ": index holds " + std::to_string(ix.record_count_) +
                " records, header says " + std::to_string(header.record_count));
  const uint32_t key_count = c.take<uint32_t>("the key count");
  const uint32_t layout_count = c.take<uint32_t>("the layout count");
  const uint64_t entries_offset = c.take<uint64_t>("the entries offset");
  // Each key takes at least 3 bytes and each layout at least 4, so counts beyond that are corrupt
  // (and must not size an allocation).
  if (key_count > c.remaining() / 3 || layout_count > c.remaining() / 4)
    throw Error(what + ": key or layout count exceeds the index size");
  ix.keys_.reserve(key_count);
  for (uint32_t k = 0; k < key_count; ++k) {
    const uint16_t n = c.take<uint16_t>("a key length");
    if (n == 0 || n > kMaxKeyBytes)
      throw Error(what + ": key " + std::to_string(k) + " has length " + std::to_string(n));
    auto s = c.take_bytes(n, "a key");
    ix.keys_.emplace_back(reinterpret_cast<const char*>(s.data()), n);
  }
  ix.layouts_.reserve(layout_count);
  for (uint32_t l = 0; l < layout_count; ++l) {
    const uint32_t nf = c.take<uint32_t>("a layout's field count");
    if (nf > c.remaining() / 12)  // a field takes at least 12 bytes
      throw Error(what + ": layout " + std::to_string(l) + " has more fields than the index holds");
    Layout layout;
    layout.fields.resize(nf);
    for (Field& f : layout.fields) {
      f.key_id = c.take<uint32_t>("a field key id");
      const uint8_t code = c.take<uint8_t>("a field dtype");
      f.ndim = c.take<uint8_t>("a field ndim");
      const uint16_t reserved = c.take<uint16_t>("a field's reserved bytes");
      f.itemsize = c.take<uint32_t>("a field itemsize");
      const std::string at = what + ": layout " + std::to_string(l);
      if (f.key_id >= key_count)
        throw Error(at + " names key " + std::to_string(f.key_id) + " of " +
                    std::to_string(key_count));
      if (!known_dtype(code)) throw Error(at + " has unknown dtype code " + std::to_string(code));
      f.dtype = DType(code);
      if (f.ndim > kMaxFieldDims)
        throw Error(at + " has a field with " + std::to_string(f.ndim) + " dims (at most 8)");
      if (reserved != 0) throw Error(at + " has nonzero reserved bytes");
      const uint32_t size = dtype_size(f.dtype);
      if (size ? f.itemsize != size : f.itemsize == 0)
        throw Error(at + " has itemsize " + std::to_string(f.itemsize) + " for dtype " +
                    dtype_name(f.dtype));
      for (int d = 0; d < f.ndim; ++d) f.shape[d] = c.take<uint64_t>("a field dim");
    }
    for (size_t a = 0; a < nf; ++a)
      for (size_t b = a + 1; b < nf; ++b)
        if (layout.fields[a].key_id == layout.fields[b].key_id)
          throw Error(what + ": layout " + std::to_string(l) + " repeats a key");
    place_fields(layout, what.c_str());
    if (layout.raw_size > UINT32_MAX)
      throw Error(what + ": layout " + std::to_string(l) + " describes a record of 4 GiB or more");
    ix.layouts_.push_back(std::move(layout));
  }
  if (entries_offset < c.pos() || entries_offset % 8 != 0 || entries_offset > block.size() ||
      (block.size() - entries_offset) / kEntryBytes != ix.record_count_ ||
      (block.size() - entries_offset) % kEntryBytes != 0)
    throw Error(what + ": entry table does not fit the index block (offset " +
                std::to_string(entries_offset) + ", " + std::to_string(ix.record_count_) +
                " records)");
  ix.entries_ = block.data() + entries_offset;
  const uint64_t data_end = std::min<uint64_t>(header.index_offset, file_size);
  for (uint64_t i = 0; i < ix.record_count_; ++i) {
    const std::byte* e = ix.entries_ + i * kEntryBytes;
    const uint64_t off = load<uint64_t>(e);
    const uint32_t len = load<uint32_t>(e + 8);
    const uint32_t lid = load<uint32_t>(e + 12);
    const uint8_t codec = load<uint8_t>(e + 16);
    bool reserved_zero = true;
    for (int b = 17; b < 24; ++b) reserved_zero &= e[b] == std::byte{0};
    const std::string at = what + ": record " + std::to_string(i);
    if (off < kHeaderRegionBytes || off % kRecordAlignment != 0 || off > data_end ||
        len > data_end - off)
      throw Error(at + " lies outside the data region [128, " + std::to_string(data_end) + ")");
    if (lid >= layout_count)
      throw Error(at + " names layout " + std::to_string(lid) + " of " +
                  std::to_string(layout_count));
    if (codec > uint8_t(Codec::lz4))
      throw Error(at + " has unknown codec " + std::to_string(codec));
    if (!reserved_zero) throw Error(at + " has nonzero reserved bytes");
    if (Codec(codec) == Codec::none && len != ix.layouts_[lid].raw_size)
      throw Error(at + " is stored uncompressed in " + std::to_string(len) +
                  " bytes but its layout needs " + std::to_string(ix.layouts_[lid].raw_size));
  }
  return ix;
}

RecordEntry Index::entry(uint64_t i) const {
  using namespace detail;
  if (i >= record_count_)
    throw Error("index " + std::to_string(i) + " is out of range for " + name_ + " with " +
                std::to_string(record_count_) + " records");
  const std::byte* e = entries_ + i * kEntryBytes;
  RecordEntry r;
  r.offset = load<uint64_t>(e);
  r.stored_length = load<uint32_t>(e + 8);
  r.layout_id = load<uint32_t>(e + 12);
  r.codec = Codec(load<uint8_t>(e + 16));
  r.checksum = load<uint64_t>(e + 24);
  return r;
}

void Index::prefetch(uint64_t i) const {
  if (i < record_count_) __builtin_prefetch(entries_ + i * detail::kEntryBytes);
}

void Index::entries(std::span<const uint64_t> indices, RecordEntry* out) const {
  // Far enough ahead that a load from memory completes while the entries before it are decoded.
  constexpr size_t kAhead = 16;
  const size_t n = indices.size();
  for (size_t k = 0; k < n; ++k) {
    if (k + kAhead < n && indices[k + kAhead] < record_count_)
      __builtin_prefetch(entries_ + indices[k + kAhead] * detail::kEntryBytes);
    if (indices[k] >= record_count_)
      throw Error("indices[" + std::to_string(k) + "] = " + std::to_string(indices[k]) +
                  " is out of range for " + name_ + " with " + std::to_string(record_count_) +
                  " records");
    out[k] = entry(indices[k]);
  }
}

Index open_index(const ByteSource& source, bool recover, Headers* headers) {
  const std::string name = source.name();
  const uint64_t size = source.size();
  std::byte region[kHeaderRegionBytes];
  const size_t head = size_t(std::min<uint64_t>(size, kHeaderRegionBytes));
  if (head) source.read(0, head, region);
  Headers h = parse_headers(std::span<const std::byte>(region, head), size, name);
  check_fallback(h, name, recover, [&](uint64_t offset, uint64_t length) {
    std::vector<std::byte> block(length);
    source.read(offset, length, block.data());
    return detail::checksum(block.data(), block.size());
  });
  if (headers) *headers = h;
  const HeaderSlot& c = h.slot[h.current];
  auto block = std::make_shared<std::vector<std::byte>>(c.index_length);
  source.read(c.index_offset, c.index_length, block->data());
  std::span<const std::byte> bytes(block->data(), block->size());
  return Index::from_block(c, bytes, block, size, name);
}

}  // namespace tpf::store

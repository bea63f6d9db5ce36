// Decoding one record from its stored bytes: the checks and decompression every read path shares
// (the mmap reader, any ByteSource reader, batch reads).
#include <cstdint>
#include <memory>
#include <string>

#include "store/bytes.h"
#include "store/codec.h"
#include "store/record.h"
#include "tpf/error.h"
#include "tpf/record.h"
#include "tpf/store.h"

namespace tpf::store {

int Record::find(std::string_view key) const {
  for (size_t i = 0; i < layout_->fields.size(); ++i)
    if ((*keys_)[layout_->fields[i].key_id] == key) return int(i);
  return -1;
}

namespace detail {

namespace {
Error record_error(const Index& index, uint64_t i, const std::string& why) {
  return Error(index.name() + ": record " + std::to_string(i) + " " + why);
}
std::string no_decode(const Index& index, const RecordEntry& e) {
  return std::string("does not decompress (") + codec_name(e.codec) + ") to its " +
         std::to_string(index.layout(e.layout_id).raw_size) + "-byte layout";
}
}  // namespace

void check_stored(const Index& index, uint64_t i, const RecordEntry& e,
                  std::span<const std::byte> stored, bool verify) {
  if (stored.size() != e.stored_length)
    throw record_error(index, i,
                       "was given " + std::to_string(stored.size()) + " bytes, its entry says " +
                           std::to_string(e.stored_length));
  if (verify && checksum(stored.data(), stored.size()) != e.checksum)
    throw record_error(index, i, "is corrupt (checksum mismatch)");
  if (e.codec != Codec::none &&
      !may_decompress_to(e.codec, stored, index.layout(e.layout_id).raw_size))
    throw record_error(index, i, no_decode(index, e));
}

void decompress_record(const Index& index, uint64_t i, const RecordEntry& e,
                       std::span<const std::byte> stored, std::span<std::byte> raw) {
  if (!decompress(e.codec, stored, raw)) throw record_error(index, i, no_decode(index, e));
}

}  // namespace detail

Record decode_record_into(const Index& index, uint64_t i, std::span<const std::byte> stored,
                          std::span<std::byte> raw, bool verify_checksum) {
  const RecordEntry e = index.entry(i);
  detail::check_stored(index, i, e, stored, verify_checksum);
  Record r;
  r.layout_ = &index.layout(e.layout_id);
  r.keys_ = &index.keys();
  if (e.codec == Codec::none) {
    r.base_ = stored.data();
    return r;
  }
  const uint64_t raw_size = r.layout_->raw_size;
  if (raw.size() < raw_size || reinterpret_cast<uintptr_t>(raw.data()) % 8 != 0)
    throw Error(index.name() + ": record " + std::to_string(i) + " decodes to " +
                std::to_string(raw_size) +
                " bytes; expected a buffer of at least that many at an " +
                "8-byte-aligned address, got " + std::to_string(raw.size()) + " bytes" +
                (reinterpret_cast<uintptr_t>(raw.data()) % 8 ? " (misaligned)" : ""));
  detail::decompress_record(index, i, e, stored, raw.first(raw_size));
  r.base_ = raw.data();
  return r;
}

uint64_t decoded_size(const Index& index, uint64_t i) {
  return index.layout(index.entry(i).layout_id).raw_size;
}

Record decode_record(const Index& index, uint64_t i, std::span<const std::byte> stored,
                     bool verify_checksum) {
  const RecordEntry e = index.entry(i);
  if (e.codec == Codec::none) return decode_record_into(index, i, stored, {}, verify_checksum);
  // Checked before the buffer is allocated, so bytes that cannot decode to a huge layout never
  // allocate it; the decode below then skips the checksum.
  detail::check_stored(index, i, e, stored, verify_checksum);
  const uint64_t raw_size = index.layout(e.layout_id).raw_size;
  // 8-byte-aligned storage so every decoded array is naturally aligned.
  std::shared_ptr<std::byte[]> buf(
      reinterpret_cast<std::byte*>(new uint64_t[(raw_size + 7) / 8 + 1]),
      [](std::byte* p) { delete[] reinterpret_cast<uint64_t*>(p); });
  Record r = decode_record_into(index, i, stored, std::span<std::byte>(buf.get(), raw_size), false);
  r.owned_ = std::move(buf);
  return r;
}

}  // namespace tpf::store

// Decoding one record from its stored bytes: the single decode path of the mmap reader and of any
// ByteSource reader.
#include <memory>
#include <string>

#include "store/bytes.h"
#include "store/codec.h"
#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::store {

int Record::find(std::string_view key) const {
  for (size_t i = 0; i < layout_->fields.size(); ++i)
    if ((*keys_)[layout_->fields[i].key_id] == key) return int(i);
  return -1;
}

Record decode_record(const Index& index, uint64_t i, std::span<const std::byte> stored,
                     bool verify_checksum) {
  const RecordEntry e = index.entry(i);
  auto fail = [&](const std::string& why) {
    return Error(index.name() + ": record " + std::to_string(i) + " " + why);
  };
  if (stored.size() != e.stored_length)
    throw fail("was given " + std::to_string(stored.size()) + " bytes, its entry says " +
               std::to_string(e.stored_length));
  if (verify_checksum && detail::checksum(stored.data(), stored.size()) != e.checksum)
    throw fail("is corrupt (checksum mismatch)");
  Record r;
  r.layout_ = &index.layout(e.layout_id);
  r.keys_ = &index.keys();
  if (e.codec == Codec::none) {
    r.base_ = stored.data();
    return r;
  }
  const uint64_t raw_size = r.layout_->raw_size;
  // Reject, before allocating raw_size bytes, stored bytes that cannot decode to raw_size.
  if (!detail::may_decompress_to(e.codec, stored, raw_size))
    throw fail(std::string("does not decompress (") + codec_name(e.codec) + ") to its " +
               std::to_string(raw_size) + "-byte layout");
  // 8-byte-aligned storage so every decoded array is naturally aligned.
  std::shared_ptr<std::byte[]> buf(
      reinterpret_cast<std::byte*>(new uint64_t[(raw_size + 7) / 8 + 1]),
      [](std::byte* p) { delete[] reinterpret_cast<uint64_t*>(p); });
  if (!detail::decompress(e.codec, stored, std::span<std::byte>(buf.get(), raw_size)))
    throw fail(std::string("does not decompress (") + codec_name(e.codec) + ") to its " +
               std::to_string(raw_size) + "-byte layout");
  r.base_ = buf.get();
  r.owned_ = std::move(buf);
  return r;
}

}  // namespace tpf::store

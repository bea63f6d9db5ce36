// libFuzzer target over the store's read path (header slots, index block, record decoding, batch
// reads), run under ASan and UBSan. The first input byte picks a mode: bit 0 recomputes the header
// and index checksums after mutation (otherwise almost every mutant stops at a checksum, and the
// parsers behind it are never reached); bit 1 verifies record checksums; bit 2 stacks the batch.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "store/bytes.h"
#include "store/format.h"
#include "store_test_util.h"

namespace {

using namespace tpf::store;

void fix_checksums(std::vector<std::byte>& b) {
  if (b.size() < kHeaderRegionBytes) return;
  for (size_t s = 0; s < 2; ++s) {
    std::byte* slot = b.data() + s * detail::kSlotBytes;
    if (std::memcmp(slot, detail::kHeaderMagic, 8) != 0) continue;
    const uint64_t off = detail::load<uint64_t>(slot + 32);
    const uint64_t len = detail::load<uint64_t>(slot + 40);
    if (off <= b.size() && len <= b.size() - off)
      detail::store<uint64_t>(slot + 48, detail::checksum(b.data() + off, len));
    detail::store<uint64_t>(slot + detail::kSlotChecksumAt,
                            detail::checksum(slot, detail::kSlotChecksumAt));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::vector<std::byte> bytes(size - 1);
  if (size > 1) std::memcpy(bytes.data(), data + 1, size - 1);
  if (mode & 1) fix_checksums(bytes);
  const testing::MemorySource src(std::move(bytes), "fuzz");
  try {
    const Index ix = open_index(src);
    uint64_t sink = 0;
    for (uint64_t i = 0; i < ix.size() && i < 64; ++i) {
      const RecordEntry e = ix.entry(i);
      // A valid compressed record may legitimately decode to up to 4 GiB; allocation size is not
      // what is fuzzed here, libFuzzer's malloc limit is.
      if (ix.layout(e.layout_id).raw_size > (uint64_t(16) << 20)) continue;
      std::vector<std::byte> stored(e.stored_length);
      src.read(e.offset, e.stored_length, stored.data());
      try {
        const Record r = decode_record(ix, i, stored, (mode & 2) != 0);
        for (size_t f = 0; f < r.num_fields(); ++f) {
          const Field& field = r.field(f);
          sink += r.key(f).size() + field.nbytes;
          if (field.nbytes) sink += uint64_t(r.data(f)[0]) + uint64_t(r.data(f)[field.nbytes - 1]);
        }
      } catch (const tpf::Error&) {}
    }
    // The same records as one batch (bit 2: stacked), decoded in two parts.
    std::vector<uint64_t> batch;
    for (uint64_t i = 0; i < ix.size() && i < 64; ++i)
      if (ix.layout(ix.entry(i).layout_id).raw_size <= (uint64_t(1) << 20)) batch.push_back(i);
    if (!batch.empty()) {
      try {
        const BatchPlan plan(ix, batch, (mode & 4) != 0);
        uint64_t total = 0;
        for (const BatchOutput& o : plan.outputs()) total += o.nbytes;
        if (total <= (uint64_t(32) << 20)) {
          std::vector<std::vector<std::byte>> out;
          std::vector<std::byte*> ptrs;
          for (const BatchOutput& o : plan.outputs()) out.emplace_back(o.nbytes);
          for (auto& o : out) ptrs.push_back(o.data());
          const size_t half = plan.size() / 2;
          plan.decode(src.bytes(), half, plan.size(), ptrs, (mode & 2) != 0);
          plan.decode(src.bytes(), 0, half, ptrs, (mode & 2) != 0);
          for (const auto& o : out)
            if (!o.empty()) sink += uint64_t(o.front()) + uint64_t(o.back());
        }
      } catch (const tpf::Error&) {}
    }
    if (sink == 1) std::memset(&sink, 0, sizeof sink);  // keeps the reads observable
  } catch (const tpf::Error&) {
  } catch (const tpf::RuntimeError&) {}
  return 0;
}

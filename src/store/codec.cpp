#include "store/codec.h"

#include <lz4.h>
#include <zstd.h>

#include <climits>

namespace tpf::store::detail {

namespace {

// One context per thread and direction: creating a zstd context per record costs more than
// compressing a small record. Contexts are plain memory, so a fork()ed child may keep using its copy.
struct ZstdContexts {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  ZSTD_DCtx* d = ZSTD_createDCtx();
  ~ZstdContexts() {
    ZSTD_freeCCtx(c);
    ZSTD_freeDCtx(d);
  }
};
ZstdContexts& zstd() {
  thread_local ZstdContexts contexts;
  return contexts;
}

}  // namespace

bool compress(Codec codec, int level, std::span<const std::byte> raw, std::vector<std::byte>& out) {
  if (codec == Codec::zstd) {
    out.resize(ZSTD_compressBound(raw.size()));
    const size_t n =
        ZSTD_compressCCtx(zstd().c, out.data(), out.size(), raw.data(), raw.size(), level);
    if (ZSTD_isError(n) || n >= raw.size()) return false;
    out.resize(n);
    return true;
  }
  if (codec == Codec::lz4) {
    if (raw.size() > size_t(LZ4_MAX_INPUT_SIZE)) return false;
    out.resize(size_t(LZ4_compressBound(int(raw.size()))));
    const int n =
        LZ4_compress_default(reinterpret_cast<const char*>(raw.data()),
                             reinterpret_cast<char*>(out.data()), int(raw.size()), int(out.size()));
    if (n <= 0 || size_t(n) >= raw.size()) return false;
    out.resize(size_t(n));
    return true;
  }
  return false;
}

bool may_decompress_to(Codec codec, std::span<const std::byte> stored, uint64_t raw_size) {
  if (codec == Codec::zstd)
    return ZSTD_getFrameContentSize(stored.data(), stored.size()) == raw_size;
  if (codec == Codec::lz4) return raw_size <= 255 * uint64_t(stored.size()) + 16;
  return stored.size() == raw_size;
}

bool decompress(Codec codec, std::span<const std::byte> stored, std::span<std::byte> raw) {
  if (codec == Codec::zstd) {
    const size_t n =
        ZSTD_decompressDCtx(zstd().d, raw.data(), raw.size(), stored.data(), stored.size());
    return !ZSTD_isError(n) && n == raw.size();
  }
  if (codec == Codec::lz4) {
    if (stored.size() > size_t(INT_MAX) || raw.size() > size_t(INT_MAX)) return false;
    const int n = LZ4_decompress_safe(reinterpret_cast<const char*>(stored.data()),
                                      reinterpret_cast<char*>(raw.data()), int(stored.size()),
                                      int(raw.size()));
    return n >= 0 && size_t(n) == raw.size();
  }
  return false;
}

}  // namespace tpf::store::detail

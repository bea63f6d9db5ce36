// The append-only writer. Records go after the last commit's index; commit() writes a complete new
// index, syncs it, then switches the older header slot to a new generation and syncs again, so a
// crash at any point leaves the previous commit readable.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <unordered_map>

#include "store/bytes.h"
#include "store/codec.h"
#include "store/file_source.h"
#include "store/format.h"
#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::store {

namespace {

constexpr size_t kFlushBytes = size_t(8) << 20;

std::string os_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

void pwrite_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, off_t(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw RuntimeError(os_error("cannot write", path));
    }
    p += w;
    n -= size_t(w);
    offset += uint64_t(w);
  }
}

void sync(int fd, const std::string& path) {
  if (::fdatasync(fd) != 0) throw RuntimeError(os_error("cannot sync", path));
}

}  // namespace

struct Writer::State {
  std::string path;
  WriterOptions options;
  int fd = -1;
  std::vector<std::string> keys;
  std::unordered_map<std::string, uint32_t> key_ids;
  std::vector<Layout> layouts;
  std::unordered_map<std::string, uint32_t> layout_ids;  // by signature
  std::vector<std::byte> entries;
  uint64_t count = 0;
  uint64_t committed = 0;
  uint64_t generation = 0;
  int slot = 1;  // slot of the last commit; the next commit writes the other one
  uint64_t data_end = kHeaderRegionBytes;  // where the next record goes (buffered or not)
  std::vector<std::byte> buffer;           // bytes for [buffer_at, data_end)
  uint64_t buffer_at = kHeaderRegionBytes;
  std::vector<std::byte> raw, packed, signature;
  Layout scratch;

  void flush() {
    if (!buffer.empty()) pwrite_all(fd, buffer.data(), buffer.size(), buffer_at, path);
    buffer.clear();
    buffer_at = data_end;
  }
  void step(int s) {
    if (options.on_commit_step) options.on_commit_step(s);
  }
};

Writer::Writer(const std::string& path, WriterOptions options) : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.path = path;
  s.options = options;
  if (options.codec == Codec::zstd && (options.level < 1 || options.level > 19))
    throw Error("level must be in [1, 19] for zstd, got " + std::to_string(options.level));
  s.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (s.fd < 0) throw RuntimeError(os_error("cannot open", path));
  try {
    if (::flock(s.fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK)
        throw RuntimeError(path + " is locked by another writer; a store has one writer at a time");
      throw RuntimeError(os_error("cannot lock", path));
    }
    struct stat st {};
    if (::fstat(s.fd, &st) != 0) throw RuntimeError(os_error("cannot stat", path));
    if (options.overwrite || st.st_size == 0) {
      if (::ftruncate(s.fd, 0) != 0) throw RuntimeError(os_error("cannot truncate", path));
      const std::byte zeros[kHeaderRegionBytes] = {};
      pwrite_all(s.fd, zeros, sizeof zeros, 0, path);
      commit();  // an empty commit, so the file is a valid store from the start
      return;
    }
    detail::FdSource src(s.fd, path, uint64_t(st.st_size));
    const Index ix = open_index(src);
    s.keys = ix.keys();
    for (uint32_t k = 0; k < s.keys.size(); ++k) s.key_ids.emplace(s.keys[k], k);
    s.layouts = ix.layouts();
    for (uint32_t l = 0; l < s.layouts.size(); ++l) {
      std::string sig;
      for (const Field& f : s.layouts[l].fields) {
        sig.append(reinterpret_cast<const char*>(&f.key_id), 4);
        sig.push_back(char(f.dtype));
        sig.append(reinterpret_cast<const char*>(&f.itemsize), 4);
        sig.push_back(char(f.ndim));
        sig.append(reinterpret_cast<const char*>(f.shape), 8 * size_t(f.ndim));
      }
      s.layout_ids.emplace(std::move(sig), l);
    }
    s.count = s.committed = ix.size();
    s.entries.resize(ix.size() * detail::kEntryBytes);
    for (uint64_t i = 0; i < ix.size(); ++i)
      detail::encode_entry(ix.entry(i), s.entries.data() + i * detail::kEntryBytes);
    s.generation = ix.generation();
    std::byte region[kHeaderRegionBytes];
    src.read(0, kHeaderRegionBytes, region);
    s.slot = parse_headers(region, src.size(), path).current;
    const HeaderSlot& h = ix.header();
    const uint64_t end = h.index_offset + h.index_length;
    // Bytes after the last commit belong to no commit (a crashed writer's appends): drop them.
    if (::ftruncate(s.fd, off_t(end)) != 0) throw RuntimeError(os_error("cannot truncate", path));
    s.data_end = s.buffer_at = detail::align_up(end, detail::kRecordAlignment);
    if (s.data_end != end)
      s.buffer.resize(s.data_end - end);  // zero padding before the next record
    s.buffer_at = end;
  } catch (...) {
    ::close(s.fd);
    throw;
  }
}

Writer::~Writer() { close(); }

void Writer::close() {
  if (s_ && s_->fd >= 0) {
    ::close(s_->fd);
    s_->fd = -1;
  }
}

uint64_t Writer::size() const { return s_->count; }
uint64_t Writer::committed_size() const { return s_->committed; }
uint64_t Writer::generation() const { return s_->generation; }
const std::string& Writer::path() const { return s_->path; }

void Writer::append(std::span<const ArrayRef> fields) {
  State& s = *s_;
  TPF_CHECK(s.fd >= 0, "writer for " + s.path + " is closed");
  for (size_t a = 0; a < fields.size(); ++a) {
    const ArrayRef& f = fields[a];
    const std::string key(f.key);
    TPF_CHECK(!key.empty(), "record field " + std::to_string(a) + " has an empty key");
    TPF_CHECK(key.size() <= detail::kMaxKeyBytes,
              "record key '" + key.substr(0, 32) + "...' is longer than 1024 bytes");
    TPF_CHECK(key[0] != '_', "record key '" + key + "' starts with '_', which is reserved");
    TPF_CHECK(f.ndim >= 0 && f.ndim <= kMaxFieldDims,
              "record field '" + key + "' has " + std::to_string(f.ndim) + " dims, at most 8");
    TPF_CHECK(uint8_t(f.dtype) >= 1 && uint8_t(f.dtype) <= 14,
              "record field '" + key + "' has an unknown dtype");
    const uint32_t size = dtype_size(f.dtype);
    TPF_CHECK(size ? f.itemsize == size : f.itemsize > 0,
              "record field '" + key + "' has itemsize " + std::to_string(f.itemsize) +
                  ", expected " + (size ? std::to_string(size) : std::string("> 0")) + " for " +
                  dtype_name(f.dtype));
    for (size_t b = 0; b < a; ++b)
      TPF_CHECK(fields[b].key != f.key, "record key '" + key + "' appears twice");
  }
  Layout& layout = s.scratch;
  layout.fields.resize(fields.size());
  for (size_t a = 0; a < fields.size(); ++a) {
    const ArrayRef& in = fields[a];
    Field& f = layout.fields[a];
    f.dtype = in.dtype;
    f.itemsize = in.itemsize;
    f.ndim = in.ndim;
    std::copy(in.shape, in.shape + in.ndim, f.shape);
    std::fill(f.shape + in.ndim, f.shape + kMaxFieldDims, 0);
  }
  detail::place_fields(layout, "record");
  TPF_CHECK(layout.raw_size <= UINT32_MAX,
            "record is " + std::to_string(layout.raw_size) + " bytes; records must be under 4 GiB");
  for (size_t a = 0; a < fields.size(); ++a)
    TPF_CHECK(fields[a].data != nullptr || layout.fields[a].nbytes == 0,
              "record field '" + std::string(fields[a].key) + "' has no data");

  s.signature.clear();
  for (size_t a = 0; a < fields.size(); ++a) {
    const std::string key(fields[a].key);
    auto [it, added] = s.key_ids.emplace(key, uint32_t(s.keys.size()));
    if (added) s.keys.push_back(key);
    Field& f = layout.fields[a];
    f.key_id = it->second;
    detail::put<uint32_t>(s.signature, f.key_id);
    detail::put<uint8_t>(s.signature, uint8_t(f.dtype));
    detail::put<uint32_t>(s.signature, f.itemsize);
    detail::put<uint8_t>(s.signature, uint8_t(f.ndim));
    detail::put_bytes(s.signature, f.shape, 8 * size_t(f.ndim));
  }
  const std::string sig(reinterpret_cast<const char*>(s.signature.data()), s.signature.size());
  auto [lit, new_layout] = s.layout_ids.emplace(sig, uint32_t(s.layouts.size()));
  if (new_layout) s.layouts.push_back(layout);
  const uint32_t layout_id = lit->second;

  s.raw.assign(layout.raw_size, std::byte{0});
  for (size_t a = 0; a < fields.size(); ++a)
    if (layout.fields[a].nbytes)
      std::memcpy(s.raw.data() + layout.fields[a].offset, fields[a].data, layout.fields[a].nbytes);

  RecordEntry e;
  e.layout_id = layout_id;
  std::span<const std::byte> stored(s.raw);
  if (s.options.codec != Codec::none &&
      detail::compress(s.options.codec, s.options.level, s.raw, s.packed)) {
    e.codec = s.options.codec;
    stored = s.packed;
  }
  e.offset = s.data_end;
  e.stored_length = uint32_t(stored.size());
  e.checksum = detail::checksum(stored.data(), stored.size());
  const uint64_t padded = detail::align_up(stored.size(), detail::kRecordAlignment);
  detail::put_bytes(s.buffer, stored.data(), stored.size());
  s.buffer.resize(s.buffer.size() + (padded - stored.size()), std::byte{0});
  s.data_end += padded;
  const size_t at = s.entries.size();
  s.entries.resize(at + detail::kEntryBytes);
  detail::encode_entry(e, s.entries.data() + at);
  ++s.count;
  if (s.buffer.size() >= kFlushBytes) s.flush();
}

void Writer::commit() {
  State& s = *s_;
  TPF_CHECK(s.fd >= 0, "writer for " + s.path + " is closed");
  s.flush();
  const std::vector<std::byte> index = detail::encode_index(s.keys, s.layouts, s.entries, s.count);
  HeaderSlot h;
  h.version = kFormatVersion;
  h.generation = s.generation + 1;
  h.record_count = s.count;
  h.index_offset = s.data_end;
  h.index_length = index.size();
  h.index_checksum = detail::checksum(index.data(), index.size());
  s.step(kWriteIndex);
  pwrite_all(s.fd, index.data(), index.size(), h.index_offset, s.path);
  s.step(kSyncIndex);
  sync(s.fd, s.path);
  std::byte slot[detail::kSlotBytes];
  detail::encode_header_slot(h, std::span<std::byte, detail::kSlotBytes>(slot));
  const int next = 1 - s.slot;
  s.step(kWriteHeader);
  pwrite_all(s.fd, slot, sizeof slot, uint64_t(next) * detail::kSlotBytes, s.path);
  s.step(kSyncHeader);
  sync(s.fd, s.path);
  s.slot = next;
  s.generation = h.generation;
  s.committed = s.count;
  // Later records go after this index, which stays in place for readers of this generation.
  const uint64_t end = h.index_offset + h.index_length;
  s.data_end = detail::align_up(end, detail::kRecordAlignment);
  s.buffer.assign(s.data_end - end, std::byte{0});
  s.buffer_at = end;
}

}  // namespace tpf::store

// The append-only writer. Records go after the last commit's index; commit() writes a complete new
// index, syncs it, then switches the older header slot to a new generation and syncs again, so a
// crash at any point leaves the previous commit readable. New files and overwrites are built under
// a hidden name and renamed into place, so `path` never holds a half-made store and a reader of an
// overwritten file keeps its own (never truncated) inode.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <unordered_map>

#include "store/bytes.h"
#include "store/codec.h"
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

// Takes the writer's lock on `fd` (of `path`).
void lock(int fd, const std::string& path) {
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return;
  if (errno == EWOULDBLOCK)
    throw RuntimeError(path + " is locked by another writer; a store has one writer at a time");
  throw RuntimeError(os_error("cannot lock", path));
}

// True when `fd` is still the file at `path` (an overwrite may rename a new file over it between
// open() and flock(); the lock would then guard a file nobody else will open).
bool still_at_path(int fd, const std::string& path) {
  struct stat a {
  }, b{};
  return ::fstat(fd, &a) == 0 && ::stat(path.c_str(), &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

constexpr const char* kPartialSuffix = ".tpf-partial";

// A partial file of `path` is named ".<name>.", 12 random hex digits, ".tpf-partial".
std::string partial_name_prefix(const std::string& path) {
  std::string prefix(1, '.');
  prefix.append(base_of(path)).push_back('.');
  return prefix;
}

std::string partial_prefix(const std::string& path) {
  if (path.find('/') == std::string::npos) return partial_name_prefix(path);
  return dir_of(path) + "/" + partial_name_prefix(path);
}

// Removes partial files of `path` that no live writer holds (a live one has them locked).
void remove_dead_partials(const std::string& path) {
  const std::string dir = dir_of(path), prefix = partial_name_prefix(path);
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;  // the directory is checked when the file is created
  const size_t want = prefix.size() + 12 + std::strlen(kPartialSuffix);
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() != want || name.compare(0, prefix.size(), prefix) != 0 ||
        name.compare(name.size() - std::strlen(kPartialSuffix), std::string::npos,
                     kPartialSuffix) != 0)
      continue;
    const std::string full = dir + "/" + name;
    const int fd = ::open(full.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) ::unlink(full.c_str());
    ::close(fd);
  }
  ::closedir(d);
}

// Makes a rename in the directory of `path` durable.
void sync_dir(const std::string& path) {
  const std::string dir = dir_of(path);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw RuntimeError(os_error("cannot open the directory", dir));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems cannot sync a directory (EINVAL); their renames are as durable as they get.
  if (rc != 0 && err != EINVAL) {
    errno = err;
    throw RuntimeError(os_error("cannot sync the directory", dir));
  }
}

}  // namespace

struct Writer::State {
  std::string path;
  WriterOptions options;
  int fd = -1;
  // While the file being written is not yet at `path`: its partial name, and (for an overwrite)
  // the locked file it will replace, whose lock keeps other writers out until the rename.
  std::string partial;
  int replaced_fd = -1;
  std::string target;  // the file `path` names (through a symbolic link, the link's target)
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
  uint32_t last_layout = UINT32_MAX;  // the layout of the last record appended

  void flush() {
    if (!buffer.empty()) pwrite_all(fd, buffer.data(), buffer.size(), buffer_at, path);
    buffer.clear();
    buffer_at = data_end;
  }
  void step(int s) {
    if (options.on_commit_step) options.on_commit_step(s);
  }
  // Creates and locks a partial file of `path` with `mode`, as `fd`.
  void create_partial(mode_t mode) {
    std::random_device rd;
    for (int attempt = 0; attempt < 16; ++attempt) {
      char tag[13];
      std::snprintf(tag, sizeof tag, "%06x%06x", rd() & 0xffffff, rd() & 0xffffff);
      const std::string name = partial_prefix(target) + tag + kPartialSuffix;
      fd = ::open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
      if (fd < 0 && errno == EEXIST) continue;
      if (fd < 0) throw RuntimeError(os_error("cannot create", name));
      partial = name;
      lock(fd, partial);
      return;
    }
    throw RuntimeError("cannot create a partial file next to " + path +
                       ": every name tried exists");
  }
  // Puts the partial file at `path`: over the replaced file, or (a new store) only if nothing
  // appeared there meanwhile.
  void publish() {
    if (replaced_fd >= 0) {
      if (::rename(partial.c_str(), target.c_str()) != 0)
        throw RuntimeError(os_error("cannot rename " + partial + " to", target));
    } else if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE) !=
               0) {
      if (errno == EEXIST)
        throw RuntimeError(path +
                           " was created by another writer meanwhile; a store has one "
                           "writer at a time");
      // File systems without RENAME_NOREPLACE: a link fails as well when the name is taken.
      if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
        throw RuntimeError(os_error("cannot rename " + partial + " to", target));
      if (::link(partial.c_str(), target.c_str()) != 0) {
        if (errno == EEXIST)
          throw RuntimeError(path +
                             " was created by another writer meanwhile; a store has one "
                             "writer at a time");
        throw RuntimeError(os_error("cannot link " + partial + " to", target));
      }
      ::unlink(partial.c_str());
    }
    partial.clear();
    sync_dir(target);
    if (replaced_fd >= 0) ::close(replaced_fd);
    replaced_fd = -1;
  }
  // Closes everything; a partial file not yet published is removed.
  void release() {
    if (!partial.empty()) ::unlink(partial.c_str());
    partial.clear();
    if (fd >= 0) ::close(fd);
    if (replaced_fd >= 0) ::close(replaced_fd);
    fd = replaced_fd = -1;
  }
};

Writer::Writer(const std::string& path, WriterOptions options) : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.path = path;
  s.options = options;
  if (options.codec == Codec::zstd && (options.level < 1 || options.level > 19))
    throw Error("level must be in [1, 19] for zstd, got " + std::to_string(options.level));
  try {
    s.target = path;
    struct stat link {};
    if (::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode))
      if (char* real = ::realpath(path.c_str(), nullptr)) {
        s.target = real;
        std::free(real);
      }
    remove_dead_partials(s.target);
    struct stat st {};
    int existing = -1;
    // Open and lock the file at `path`, if any; retried when an overwrite renamed another file
    // over it in between (the lock must be on the file that others will open).
    for (int attempt = 0;; ++attempt) {
      existing = ::open(s.target.c_str(), (options.overwrite ? O_RDONLY : O_RDWR) | O_CLOEXEC);
      if (existing < 0 && errno == ENOENT) break;
      if (existing < 0) throw RuntimeError(os_error("cannot open", path));
      try {
        lock(existing, path);
      } catch (...) {
        ::close(existing);
        throw;
      }
      if (still_at_path(existing, s.target)) break;
      ::close(existing);
      existing = -1;
      if (attempt == 8) throw RuntimeError(path + " keeps being replaced by other writers");
    }
    if (existing >= 0 && ::fstat(existing, &st) != 0) {
      ::close(existing);
      throw RuntimeError(os_error("cannot stat", path));
    }
    if (existing >= 0 && !S_ISREG(st.st_mode)) {
      ::close(existing);
      throw Error(path + " exists and is not a regular file; a store is one file");
    }
    if (existing >= 0 && !options.overwrite && st.st_size > 0) {
      s.fd = existing;
      open_existing(uint64_t(st.st_size));
      return;
    }
    // A new store: built as a partial file with an empty first commit, then renamed into place;
    // an overwrite of a non-empty file waits for the first commit() to rename.
    s.replaced_fd = existing;
    s.create_partial(existing >= 0 ? (st.st_mode & 07777) : 0644);
    if (existing >= 0) ::fchmod(s.fd, st.st_mode & 07777);  // the replaced file's mode, umask aside
    const std::byte zeros[kHeaderRegionBytes] = {};
    pwrite_all(s.fd, zeros, sizeof zeros, 0, s.partial);
    commit();  // an empty commit, so the file is a valid store from the start
    if (existing < 0 || st.st_size == 0) {
      s.step(kReplace);
      s.publish();
    }
  } catch (...) {
    s.release();
    throw;
  }
}

void Writer::open_existing(uint64_t file_size) {
  State& s = *s_;
  const std::string& path = s.path;
  FdSource src(s.fd, path, file_size);
  Headers headers;
  const Index ix = [&] {
    try {
      return open_index(src, s.options.recover, &headers);
    } catch (const Error& e) {
      if (std::string(e.what()).find("unfinished first commit") == std::string::npos) throw;
      throw Error(std::string(e.what()) + "; overwrite=True starts it again");
    }
  }();
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
  s.slot = headers.current;
  const HeaderSlot& h = ix.header();
  const uint64_t end = h.index_offset + h.index_length;
  // Bytes after the last commit belong to no commit (a crashed writer's appends): drop them.
  if (::ftruncate(s.fd, off_t(end)) != 0) throw RuntimeError(os_error("cannot truncate", path));
  s.data_end = detail::align_up(end, detail::kRecordAlignment);
  if (s.data_end != end) s.buffer.resize(s.data_end - end);  // zero padding before the next record
  s.buffer_at = end;
}

Writer::~Writer() { close(); }

void Writer::close() {
  if (s_) s_->release();
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
    const std::string_view key = f.key;
    TPF_CHECK(!key.empty(), "record field " + std::to_string(a) + " has an empty key");
    TPF_CHECK(key.size() <= detail::kMaxKeyBytes,
              "record key '" + std::string(key.substr(0, 32)) + "...' is longer than 1024 bytes");
    TPF_CHECK(key[0] != '_',
              "record key '" + std::string(key) + "' starts with '_', which is reserved");
    TPF_CHECK(f.ndim >= 0 && f.ndim <= kMaxFieldDims, "record field '" + std::string(key) +
                                                          "' has " + std::to_string(f.ndim) +
                                                          " dims, at most 8");
    TPF_CHECK(uint8_t(f.dtype) >= 1 && uint8_t(f.dtype) <= 14,
              "record field '" + std::string(key) + "' has an unknown dtype");
    const uint32_t size = dtype_size(f.dtype);
    TPF_CHECK(size ? f.itemsize == size : f.itemsize > 0,
              "record field '" + std::string(key) + "' has itemsize " + std::to_string(f.itemsize) +
                  ", expected " + (size ? std::to_string(size) : std::string("> 0")) + " for " +
                  dtype_name(f.dtype));
    for (size_t b = 0; b < a; ++b)
      TPF_CHECK(fields[b].key != key, "record key '" + std::string(key) + "' appears twice");
  }

  // Records mostly repeat the previous record's layout: that is checked field by field, without
  // building a signature or hashing anything.
  uint32_t layout_id = s.last_layout;
  bool same = layout_id < s.layouts.size() && s.layouts[layout_id].fields.size() == fields.size();
  for (size_t a = 0; same && a < fields.size(); ++a) {
    const ArrayRef& in = fields[a];
    const Field& f = s.layouts[layout_id].fields[a];
    same = f.dtype == in.dtype && f.itemsize == in.itemsize && f.ndim == in.ndim &&
           std::equal(in.shape, in.shape + in.ndim, f.shape) && s.keys[f.key_id] == in.key;
  }
  if (!same) layout_id = find_layout(fields);
  const Layout& layout = s.layouts[layout_id];
  for (size_t a = 0; a < fields.size(); ++a)
    TPF_CHECK(fields[a].data != nullptr || layout.fields[a].nbytes == 0,
              "record field '" + std::string(fields[a].key) + "' has no data");
  s.last_layout = layout_id;

  // The decoded record goes straight into the write buffer (or, to be compressed, into scratch).
  RecordEntry e;
  e.layout_id = layout_id;
  e.offset = s.data_end;
  const uint64_t raw_size = layout.raw_size;
  const bool compress = s.options.codec != Codec::none;
  std::vector<std::byte>& dst = compress ? s.raw : s.buffer;
  const size_t at = compress ? 0 : dst.size();
  dst.resize(at + raw_size + (compress ? 0 : detail::align_up(raw_size, 8) - raw_size));
  std::byte* out = dst.data() + at;
  uint64_t filled = 0;
  for (size_t a = 0; a < fields.size(); ++a) {
    const Field& f = layout.fields[a];
    std::memset(out + filled, 0, f.offset - filled);  // alignment padding
    if (f.nbytes) std::memcpy(out + f.offset, fields[a].data, f.nbytes);
    filled = f.offset + f.nbytes;
  }
  std::memset(out + filled, 0, dst.size() - at - filled);  // padding to the next record
  std::span<const std::byte> stored(out, raw_size);
  if (compress && detail::compress(s.options.codec, s.options.level, stored, s.packed)) {
    e.codec = s.options.codec;
    stored = s.packed;
  }
  if (compress) {
    const uint64_t padded = detail::align_up(stored.size(), detail::kRecordAlignment);
    detail::put_bytes(s.buffer, stored.data(), stored.size());
    s.buffer.resize(s.buffer.size() + (padded - stored.size()), std::byte{0});
    stored = std::span<const std::byte>(s.buffer.data() + s.buffer.size() - padded, stored.size());
  }
  e.stored_length = uint32_t(stored.size());
  e.checksum = detail::checksum(stored.data(), stored.size());
  s.data_end += detail::align_up(stored.size(), detail::kRecordAlignment);
  const size_t entry_at = s.entries.size();
  s.entries.resize(entry_at + detail::kEntryBytes);
  detail::encode_entry(e, s.entries.data() + entry_at);
  ++s.count;
  if (s.buffer.size() >= kFlushBytes) s.flush();
}

// The layout of `fields` (known or new), by signature: key ids, dtypes, itemsizes and shapes.
uint32_t Writer::find_layout(std::span<const ArrayRef> fields) {
  State& s = *s_;
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
  return lit->second;
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
  const bool first_of_overwrite = s.replaced_fd >= 0 && s.generation >= 1;
  s.slot = next;
  s.generation = h.generation;
  s.committed = s.count;
  // Later records go after this index, which stays in place for readers of this generation.
  const uint64_t end = h.index_offset + h.index_length;
  s.data_end = detail::align_up(end, detail::kRecordAlignment);
  s.buffer.assign(s.data_end - end, std::byte{0});
  s.buffer_at = end;
  // An overwrite's first commit puts the new file in place (the constructor does it for a new
  // file, after the empty commit that this call then is).
  if (first_of_overwrite) {
    s.step(kReplace);
    s.publish();
  }
}

}  // namespace tpf::store

// The record store: append-only shard files of complete records, an immutable index committed
// atomically through two alternating headers, and read paths over mmap or any tpf::ByteSource.
// FORMAT.md (repository root) is the byte-level specification; this header is the C++ contract.
//
// Errors: every function below throws tpf::Error for bad input (a malformed, truncated, corrupt or
// newer-version file, a bad argument) and tpf::RuntimeError for a failure of the machine (open, mmap,
// write, fsync, lock). Messages name the file or the argument and what was expected.
//
// Threads: Index, Reader and Record are immutable once built; every const member may be called from
// many threads at once, and a Reader stays valid in a child created by fork(). A Writer is used by
// one thread at a time.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tpf/source.h"

namespace tpf::store {

inline constexpr uint32_t kFormatVersion = 1;
inline constexpr size_t kHeaderRegionBytes = 128;  // two 64-byte header slots at offsets 0 and 64
inline constexpr int kMaxFieldDims = 8;

// Element types of stored arrays (values are the on-disk codes of FORMAT.md). `bytes` is a
// fixed-width, zero-padded byte string per element (numpy "S<itemsize>"), for ASCII names; `utf8`
// is the same for text that reads back as str (numpy "U"), for identifiers.
enum class DType : uint8_t {
  boolean = 1,
  u8 = 2,
  i8 = 3,
  u16 = 4,
  i16 = 5,
  u32 = 6,
  i32 = 7,
  u64 = 8,
  i64 = 9,
  f16 = 10,
  f32 = 11,
  f64 = 12,
  bytes = 13,
  utf8 = 14,
};
const char* dtype_name(DType d);
// Bytes per element; 0 for `bytes` and `utf8`, whose width is per field.
uint32_t dtype_size(DType d);

enum class Codec : uint8_t { none = 0, zstd = 1, lz4 = 2 };
const char* codec_name(Codec c);
// "none", "zstd", "lz4"; throws tpf::Error naming `argument` otherwise.
Codec parse_codec(std::string_view name, const char* argument = "compression");

// ---------------------------------------------------------------------------------------------
// Records as the writer takes them: named, typed, C-contiguous N-d arrays (a 0-d array is a scalar).
struct ArrayRef {
  std::string_view key;
  DType dtype = DType::f32;
  uint32_t itemsize = 0;  // bytes per element; must equal dtype_size(dtype) unless dtype is `bytes`
  int ndim = 0;
  uint64_t shape[kMaxFieldDims] = {};
  const void* data = nullptr;  // itemsize * prod(shape) bytes, little-endian elements
};

// ---------------------------------------------------------------------------------------------
// Decoded committed state. Byte-level helpers first (for a reader over any ByteSource), then the
// Index that ties them together.

// One header slot, decoded. `valid` is false when the slot is torn, zeroed or corrupt; `problem`
// then says why (wrong magic, checksum mismatch, ...). Fields are believed only from a slot whose
// checksum holds.
struct HeaderSlot {
  bool valid = false;
  bool newer = false;  // intact, but written by a newer format version
  std::string problem;
  uint32_t version = 0;
  uint64_t generation = 0;
  uint64_t record_count = 0;
  uint64_t index_offset = 0;
  uint64_t index_length = 0;
  uint64_t index_checksum = 0;
};

// Both header slots of a file and the one to use (the valid one with the higher generation).
struct Headers {
  HeaderSlot slot[2];
  int current = -1;
  // The other slot when it is damaged (invalid, but not never written), else -1.
  int damaged = -1;
  // True when the damaged slot may have held a newer commit than `current`, so that reading
  // `current` may drop committed records (see check_fallback).
  bool fallback = false;
  uint64_t bytes_after = 0;  // bytes of the file after the current commit's index
  // The damaged slot's index fields as stored (unverified), for check_fallback.
  uint64_t damaged_index_offset = 0, damaged_index_length = 0, damaged_index_checksum = 0;
};

// Decodes both header slots from the first kHeaderRegionBytes of a file and chooses the current
// one. Throws tpf::Error when the region is short, neither slot is valid (naming an unfinished
// first commit, a file that is not a store, or the two problems), an intact slot declares a newer
// format version, or the current commit's index lies past the end; `name` labels messages.
Headers parse_headers(std::span<const std::byte> region, uint64_t file_size,
                      const std::string& name);

// Settles `headers.fallback`: a damaged slot whose stored fields name an intact index block
// before the current one (`checksum_of(offset, length)` hashes file bytes) held an older commit,
// and nothing is lost. Otherwise, unless `recover`, throws tpf::Error saying which slot is
// damaged, which generation is the last intact one, and that recover=True reads it.
void check_fallback(Headers& headers, const std::string& name, bool recover,
                    const std::function<uint64_t(uint64_t offset, uint64_t length)>& checksum_of);
// "<name>: header slot S is damaged: <problem>, and may hold a newer commit than generation G
// ..." (without "<name>: " when `name` is empty).
std::string fallback_message(const Headers& headers, const std::string& name);

// One field of a layout: where its bytes sit inside a decoded (uncompressed) record.
struct Field {
  uint32_t key_id = 0;
  DType dtype = DType::f32;
  uint32_t itemsize = 0;
  int ndim = 0;
  uint64_t shape[kMaxFieldDims] = {};
  uint64_t offset = 0;  // from the start of the decoded record; aligned to min(itemsize, 8)
  uint64_t nbytes = 0;
};

// A layout is the ordered field list shared by every record of the same keys, dtypes and shapes.
struct Layout {
  std::vector<Field> fields;
  uint64_t raw_size = 0;  // decoded record size in bytes
};

// Where a record's stored bytes are and how to decode them.
struct RecordEntry {
  uint64_t offset = 0;  // file offset of the stored bytes (8-byte aligned)
  uint32_t stored_length = 0;
  uint32_t layout_id = 0;
  Codec codec = Codec::none;
  uint64_t checksum = 0;  // XXH3-64 (seed 0) of the stored bytes
};

// The committed index of one file: keys, layouts and record entries. Holds (or shares) the index
// bytes it was built from; every lookup is O(1).
class Index {
 public:
  // Validates an index block (already read from the file) against its header slot: checksum,
  // magic, counts, every key, layout and entry (ranges inside [kHeaderRegionBytes, index_offset)).
  // `owner` keeps `block` alive (a vector, a mapping); `name` labels messages.
  static Index from_block(const HeaderSlot& header, std::span<const std::byte> block,
                          std::shared_ptr<const void> owner, uint64_t file_size,
                          const std::string& name);

  uint64_t size() const { return record_count_; }
  uint64_t generation() const { return header_.generation; }
  const HeaderSlot& header() const { return header_; }
  // Entry i; throws tpf::Error naming `index` when i >= size().
  RecordEntry entry(uint64_t i) const;
  // Entries of records `indices` into out[0, indices.size()). The entries of a shuffled batch lie
  // far apart in the table, so each is loaded well before it is decoded and the misses overlap.
  // Throws tpf::Error naming the position of the first index >= size().
  void entries(std::span<const uint64_t> indices, RecordEntry* out) const;
  // Asks the CPU to load entry i into its cache (a hint: nothing happens for i >= size()), so a
  // later entry(i) of a far-apart record does not wait on memory.
  void prefetch(uint64_t i) const;
  const std::vector<std::string>& keys() const { return keys_; }
  const std::vector<Layout>& layouts() const { return layouts_; }
  const Layout& layout(uint32_t id) const { return layouts_.at(id); }
  const std::string& name() const { return name_; }

 private:
  HeaderSlot header_;
  std::string name_;
  uint64_t record_count_ = 0;
  std::vector<std::string> keys_;
  std::vector<Layout> layouts_;
  const std::byte* entries_ = nullptr;  // record_count_ entries of kEntryBytes, inside block
  std::shared_ptr<const void> owner_;
};

// (1) Reads the header region and the committed index through `source` (two reads) and validates
// them; a fallback to an older commit is an error unless `recover` (check_fallback). The returned
// Index is independent of `source`; `headers`, when given, receives both slots as found.
Index open_index(const ByteSource& source, bool recover = false, Headers* headers = nullptr);

// A ByteSource over an open file descriptor (pread; retried on EINTR and short reads), for readers
// of local files that do not map them. Does not own `fd`; `size` is the file size to expose.
class FdSource final : public ByteSource {
 public:
  FdSource(int fd, std::string path, uint64_t size)
      : fd_(fd), path_(std::move(path)), size_(size) {}
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, size_t length, void* dst) const override;
  std::string name() const override { return path_; }

 private:
  int fd_;
  std::string path_;
  uint64_t size_;
};

// (2) The byte range of record i is index.entry(i).offset, .stored_length.

// (3) A decoded record. For an uncompressed record its arrays point into the caller's `stored`
// bytes (valid while those bytes are); for a compressed one into a buffer the Record owns.
class Record {
 public:
  size_t num_fields() const { return layout_->fields.size(); }
  const Field& field(size_t i) const { return layout_->fields[i]; }
  const std::string& key(size_t i) const { return (*keys_)[field(i).key_id]; }
  const std::byte* data(size_t i) const { return base_ + field(i).offset; }
  // The decoded record: layout().raw_size bytes, field i at field(i).offset.
  const std::byte* bytes() const { return base_; }
  const Layout& layout() const { return *layout_; }
  // Position of `key`, or -1.
  int find(std::string_view key) const;
  bool owns_data() const { return owned_ != nullptr; }
  // The decoded record's bytes: shared ownership for zero-copy consumers of compressed records
  // (null for an uncompressed record, whose bytes the caller owns).
  std::shared_ptr<const std::byte[]> owned() const { return owned_; }

 private:
  friend Record decode_record(const Index&, uint64_t, std::span<const std::byte>, bool);
  friend Record decode_record_into(const Index&, uint64_t, std::span<const std::byte>,
                                   std::span<std::byte>, bool);
  const Layout* layout_ = nullptr;
  const std::vector<std::string>* keys_ = nullptr;
  const std::byte* base_ = nullptr;
  std::shared_ptr<const std::byte[]> owned_;
};

// Decodes record i from its stored bytes (exactly entry(i).stored_length of them). With
// `verify_checksum` the XXH3-64 of the stored bytes must match the entry. Throws tpf::Error naming
// the record on a checksum mismatch or a record that does not decompress to its layout's size.
// The Record refers to `index` (keep it alive). tpf/record.h decodes into the caller's memory
// instead and has the rules of the well-known keys.
Record decode_record(const Index& index, uint64_t i, std::span<const std::byte> stored,
                     bool verify_checksum = true);

// ---------------------------------------------------------------------------------------------
// Batch reads: many records gathered into one array per key, as a training step consumes them.
// 0-d fields become [B]. With `stack`, every field becomes [B, *shape] (shapes must be equal);
// otherwise fields of 1 or more dims are concatenated along their first axis and `lengths` gives
// each record's number of rows. `bytes` and `utf8` elements are widened, zero padded, to the
// widest element in the batch.
struct BatchOutput {
  uint32_t key_id = 0;
  DType dtype = DType::f32;
  uint32_t itemsize = 0;        // bytes per output element
  std::vector<uint64_t> shape;  // of the output array
  bool concatenated = false;
  std::vector<int64_t> lengths;  // rows of each record, when concatenated
  uint64_t nbytes = 0;
};

class BatchPlan {
 public:
  // Plans reading records `indices` of `index` (any order, repeats allowed; at least one). The
  // first record's layout fixes the keys. Throws tpf::Error naming the record whose keys, dtypes or
  // dims differ from the first record's, or the position of an index >= index.size(). The plan
  // refers to `index` (keep it alive).
  BatchPlan(const Index& index, std::span<const uint64_t> indices, bool stack);

  size_t size() const { return order_.size(); }
  // In the order of the first record's fields.
  const std::vector<BatchOutput>& outputs() const { return outputs_; }

  // Decodes the records at positions [begin, end) of the file order (neighbours in the file are
  // read together) from `file`, all bytes of the file `index` describes, into out[t]
  // (outputs()[t].nbytes bytes each; zeroed beforehand where the dtype is bytes or utf8). Calls on
  // disjoint ranges may run on different threads at once, and the outputs do not depend on how the
  // records are split. With `verify` each record's checksum is checked. Throws tpf::Error naming
  // the record on a checksum mismatch, a record that does not decode, or one outside `file`.
  void decode(std::span<const std::byte> file, size_t begin, size_t end,
              std::span<std::byte* const> out, bool verify) const;

 private:
  // One field of a layout used by the batch: where it is in a decoded record and where it goes.
  struct FieldCopy {
    uint64_t offset = 0;
    uint64_t nbytes = 0;
    uint64_t out_nbytes = 0;  // more than nbytes where text is widened
    uint64_t rows = 0;        // first-axis length; 1 for a 0-d field
    uint32_t output = 0;
    uint32_t itemsize = 0;  // < the output's itemsize when text is widened
  };
  const Index* index_ = nullptr;
  std::vector<uint64_t> indices_;
  std::vector<RecordEntry> entries_;
  std::vector<uint32_t> order_;                 // positions in file order
  std::vector<uint32_t> plan_of_;               // per position: which of copies_
  std::vector<std::vector<FieldCopy>> copies_;  // per distinct layout in the batch
  std::vector<uint64_t> start_;                 // [position * outputs + t]: byte offset in output t
  std::vector<BatchOutput> outputs_;
};

// ---------------------------------------------------------------------------------------------
// Memory-mapped reader of a local file.
struct ReaderOptions {
  bool verify_checksums = true;
  // Read the last intact commit even when the newer header slot is damaged (check_fallback).
  bool recover = false;
};

class Reader {
 public:
  // Maps `path` read-only and opens its last commit. Throws tpf::FileNotFoundError when `path`
  // does not exist, tpf::Error for a file that is not a valid store (or whose current header slot
  // is damaged, unless options.recover), tpf::RuntimeError when it cannot be opened or mapped.
  static std::shared_ptr<const Reader> open(const std::string& path, ReaderOptions options = {});
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  uint64_t size() const { return index_.size(); }
  const Index& index() const { return index_; }
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return map_size_; }
  bool verify_checksums() const { return options_.verify_checksums; }
  // Record i. Arrays of an uncompressed record point into the mapping and stay valid while this
  // Reader lives; keep the shared_ptr alongside any view handed out.
  Record read(uint64_t i) const;
  // The mapped file's bytes (for zero-copy consumers).
  std::span<const std::byte> bytes() const { return {map_, map_size_}; }
  // Both header slots as found at open; `fallback` set means an older generation is being read
  // (only when opened with options.recover).
  const Headers& headers() const { return headers_; }

 private:
  Reader() = default;
  std::string path_;
  ReaderOptions options_;
  Headers headers_;
  const std::byte* map_ = nullptr;
  size_t map_size_ = 0;
  Index index_;
};

// ---------------------------------------------------------------------------------------------
// Writer. One process at a time may write a file (an exclusive advisory lock, taken at open; a
// second writer gets tpf::RuntimeError naming the file). Appended records become visible to readers
// only at commit(); a crash at any point leaves the last commit intact and readable.
//
// A new file (and an overwrite) is built as a hidden partial file in the same directory,
// ".<name>.<random>.tpf-partial", and put in place by rename: a new store appears at `path` only
// once its first (empty) commit is durable, and an overwrite replaces `path` at its first commit(),
// so readers of the old file keep reading the old bytes and a crash before that commit leaves the
// old contents whole. A writer removes the partial files that dead writers of `path` left behind.
struct WriterOptions {
  Codec codec = Codec::none;
  int level = 3;           // zstd level (1..19); ignored by lz4 and none
  bool overwrite = false;  // replace `path` by a new store even if it exists (at commit())
  // Append to the last intact commit of a file whose newer header slot is damaged, dropping the
  // bytes after it (see check_fallback); without it, opening such a file throws.
  bool recover = false;
  // Test hook: called at each step of commit() (see CommitStep) so crash tests can kill the
  // process at a chosen point. Unset in normal use.
  std::function<void(int step)> on_commit_step;
};

// The steps of commit(), in order; on_commit_step(step) runs before each. kReplace comes only in
// the commits that put a new file in place (the first of a new file or of an overwrite).
enum CommitStep : int {
  kWriteIndex = 0,
  kSyncIndex = 1,
  kWriteHeader = 2,
  kSyncHeader = 3,
  kReplace = 4
};

class Writer {
 public:
  // Creates `path`, or opens an existing store to append after its last commit (anything written
  // after that commit, e.g. by a crashed writer, is discarded). Throws tpf::Error for an existing
  // file that is not a store (or whose first commit never finished: overwrite=true starts it
  // again), tpf::RuntimeError when the file cannot be created, locked or written.
  Writer(const std::string& path, WriterOptions options = {});
  ~Writer();  // does not commit: uncommitted records are dropped (and an overwrite is abandoned)
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Appends one record. Throws tpf::Error naming the field for an empty or duplicate key, a key
  // starting with '_' (reserved), a bad itemsize, more than kMaxFieldDims dims or a record of
  // 4 GiB or more.
  void append(std::span<const ArrayRef> fields);
  // Makes every record appended so far visible atomically and durably (fdatasync; for the commit
  // that puts a new file in place, also the rename and its directory).
  void commit();
  // Records appended, committed or not.
  uint64_t size() const;
  uint64_t committed_size() const;
  uint64_t generation() const;
  const std::string& path() const;
  // Releases the file and the lock; uncommitted records are dropped, and an overwrite that was
  // never committed leaves the old file as it was.
  void close();

 private:
  void open_existing(uint64_t file_size);  // continues after the last commit of the open file
  uint32_t find_layout(std::span<const ArrayRef> fields);  // the id of their layout, made if new
  struct State;
  std::unique_ptr<State> s_;
};

// ---------------------------------------------------------------------------------------------
// Inspector: a human-readable description of a file (both header slots, generation, record count,
// keys, layouts, sizes by codec). Works on a file that fails to open as far as it can, then says
// what is wrong.
std::string describe(const std::string& path);

}  // namespace tpf::store

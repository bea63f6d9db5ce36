// The record store: round trips through the mmap reader and the ByteSource path, one test per
// failure mode (LevelDB's log_test style), and crash tests that SIGKILL a writer process in the
// middle of appends and at each step of a commit.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>

#include "store/format.h"
#include "store_test_util.h"

namespace tpf::store {
namespace {

using testing::error_of;
using testing::MemorySource;
using testing::TempDir;
using testing::TestRecord;

// The test's seed, as in the Python suite (tests/conftest.py): TPF_SEED when it is an integer, a
// fresh one when it is "random", else fixed per test (FNV-1a of its name).
uint64_t test_seed() {
  const std::string env = std::getenv("TPF_SEED") ? std::getenv("TPF_SEED") : "";
  if (env == "random") return std::random_device{}();
  if (!env.empty()) return std::strtoull(env.c_str(), nullptr, 10);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  uint64_t h = 1469598103934665603ull;
  for (char c : std::string(info->test_suite_name()) + "." + info->name()) {
    h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  }
  return h;
}

void write_records(const std::string& path, uint64_t seed, uint64_t begin, uint64_t end,
                   WriterOptions o = {}) {
  Writer w(path, o);
  for (uint64_t i = begin; i < end; ++i) w.append(testing::record_for(seed, i).view());
  w.commit();
}

WriterOptions overwriting() {
  WriterOptions o;
  o.overwrite = true;
  return o;
}

void expect_records(const Reader& r, uint64_t seed, uint64_t count) {
  ASSERT_EQ(r.size(), count);
  for (uint64_t i = 0; i < count; ++i) {
    std::string why;
    ASSERT_TRUE(testing::same_record(r.read(i), testing::record_for(seed, i), &why))
        << "record " << i << ": " << why;
  }
}

void flip_byte(const std::string& path, uint64_t offset) {
  auto bytes = testing::read_file(path);
  bytes.at(offset) ^= std::byte{0x5a};
  testing::write_file(path, bytes);
}

// ---- round trips --------------------------------------------------------------------------------

TEST(Store, RoundTripEveryCodecThroughMmapAndByteSource) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  for (Codec codec : {Codec::none, Codec::zstd, Codec::lz4}) {
    const std::string path = dir.file(std::string("rt-") + codec_name(codec) + ".tpf");
    WriterOptions o;
    o.codec = codec;
    {
      Writer w(path, o);
      for (uint64_t i = 0; i < 150; ++i) w.append(testing::record_for(seed, i).view());
      w.commit();
      for (uint64_t i = 150; i < 301; ++i) w.append(testing::record_for(seed, i).view());
      w.commit();
      EXPECT_EQ(w.generation(), 3u);
    }
    auto r = Reader::open(path);
    expect_records(*r, seed, 301);
    MemorySource src(testing::read_file(path), path);
    const Index ix = open_index(src);
    ASSERT_EQ(ix.size(), 301u);
    for (uint64_t i = 0; i < ix.size(); ++i) {
      const RecordEntry e = ix.entry(i);
      std::vector<std::byte> stored(e.stored_length);
      src.read(e.offset, e.stored_length, stored.data());
      std::string why;
      ASSERT_TRUE(
          testing::same_record(decode_record(ix, i, stored), testing::record_for(seed, i), &why))
          << codec_name(codec) << " record " << i << ": " << why;
    }
  }
}

TEST(Store, CompressionShrinksCompressibleRecordsAndKeepsIncompressibleOnesRaw) {
  TempDir dir;
  std::vector<float> zeros(3000, 0.f);
  std::vector<std::byte> noise(4000);
  std::mt19937_64 rng(7);
  for (auto& b : noise) b = std::byte(rng());
  ArrayRef a{"x", DType::f32, 4, 1, {3000}, zeros.data()};
  ArrayRef b{"y", DType::u8, 1, 1, {4000}, noise.data()};
  WriterOptions o;
  o.codec = Codec::zstd;
  {
    Writer w(dir.file("c.tpf"), o);
    w.append(std::span(&a, 1));
    w.append(std::span(&b, 1));
    w.commit();
  }
  auto r = Reader::open(dir.file("c.tpf"));
  EXPECT_EQ(r->index().entry(0).codec, Codec::zstd);
  EXPECT_LT(r->index().entry(0).stored_length, 12000u / 10);
  EXPECT_EQ(r->index().entry(1).codec, Codec::none);
  EXPECT_EQ(std::memcmp(r->read(1).data(0), noise.data(), noise.size()), 0);
}

TEST(Store, EmptyRecordsZeroAtomsAndEveryDtype) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir;
  TestRecord empty, zero_atoms, all;
  zero_atoms.add("positions", DType::f32, 4, {0, 3}, rng);
  const DType types[] = {DType::boolean, DType::u8,  DType::i8,  DType::u16,
                         DType::i16,     DType::u32, DType::i32, DType::u64,
                         DType::i64,     DType::f16, DType::f32, DType::f64};
  for (DType t : types) all.add(std::string("a_") + dtype_name(t), t, dtype_size(t), {5, 3}, rng);
  all.add("text", DType::bytes, 7, {2}, rng);
  all.add("utf", DType::utf8, 3, {}, rng);
  all.add("scalar", DType::f64, 8, {}, rng);
  for (int d = 0; d <= kMaxFieldDims; ++d) {
    std::vector<uint64_t> shape(size_t(d), 2);
    all.add("dims" + std::to_string(d), DType::i16, 2, shape, rng);
  }
  {
    Writer w(dir.file("e.tpf"));
    w.append(empty.view());
    w.append(zero_atoms.view());
    w.append(all.view());
    w.commit();
  }
  auto r = Reader::open(dir.file("e.tpf"));
  std::string why;
  EXPECT_TRUE(testing::same_record(r->read(0), empty, &why)) << why;
  EXPECT_TRUE(testing::same_record(r->read(1), zero_atoms, &why)) << why;
  const Record rec = r->read(2);
  EXPECT_TRUE(testing::same_record(rec, all, &why)) << why;
  for (size_t f = 0; f < rec.num_fields(); ++f)
    EXPECT_EQ(
        reinterpret_cast<uintptr_t>(rec.data(f)) % detail::field_alignment(rec.field(f).itemsize),
        0u)
        << rec.key(f) << " is not naturally aligned";
}

TEST(Store, UncommittedRecordsAreInvisibleAndDroppedOnReopen) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  const std::string path = dir.file("u.tpf");
  {
    Writer w(path);
    for (uint64_t i = 0; i < 10; ++i) w.append(testing::record_for(seed, i).view());
    w.commit();
    for (uint64_t i = 10; i < 20; ++i) w.append(testing::record_for(seed, 1000 + i).view());
    // A reader opened now sees the last commit only.
    expect_records(*Reader::open(path), seed, 10);
  }  // destroyed without commit
  {
    Writer w(path);
    EXPECT_EQ(w.size(), 10u);
    for (uint64_t i = 10; i < 25; ++i) w.append(testing::record_for(seed, i).view());
    w.commit();
  }
  expect_records(*Reader::open(path), seed, 25);
}

TEST(Store, ReaderIsSafeFromManyThreads) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  const std::string path = dir.file("t.tpf");
  WriterOptions o;
  o.codec = Codec::lz4;
  write_records(path, seed, 0, 200, o);
  auto r = Reader::open(path);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + uint64_t(t));
      for (int k = 0; k < 400; ++k) {
        const uint64_t i = rng() % 200;
        std::string why;
        if (!testing::same_record(r->read(i), testing::record_for(seed, i), &why)) ++bad;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
}

// ---- batch reads ----------------------------------------------------------------------------------

// Output t of a batch as record-by-record reads give it: the records' bytes of that key, one after
// another, each element zero padded to `width` bytes.
std::vector<std::byte> expected_output(const Reader& r, const std::vector<uint64_t>& indices,
                                       const std::string& key, uint32_t width) {
  std::vector<std::byte> out;
  for (uint64_t i : indices) {
    const Record rec = r.read(i);
    const int f = rec.find(key);
    if (f < 0) throw Error("record " + std::to_string(i) + " lacks " + key);
    const Field& field = rec.field(size_t(f));
    for (uint64_t at = 0; at < field.nbytes; at += field.itemsize) {
      out.insert(out.end(), rec.data(size_t(f)) + at, rec.data(size_t(f)) + at + field.itemsize);
      out.resize(out.size() + (width - field.itemsize), std::byte{0});
    }
  }
  return out;
}

struct BatchBuffers {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<std::byte*> ptrs;
  explicit BatchBuffers(const BatchPlan& plan) {
    for (const BatchOutput& o : plan.outputs()) bytes.emplace_back(o.nbytes, std::byte{0});
    for (auto& b : bytes) ptrs.push_back(b.data());
  }
};

TEST(StoreBatch, MatchesRecordByRecordReadsForEveryCodecAndAnySplit) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir;
  for (Codec codec : {Codec::none, Codec::zstd, Codec::lz4}) {
    SCOPED_TRACE(codec_name(codec));
    const std::string path = dir.file(std::string("b-") + codec_name(codec) + ".tpf");
    WriterOptions o;
    o.codec = codec;
    write_records(path, seed, 0, 300, o);
    auto r = Reader::open(path);
    // record_for gives every third record extra keys: a batch takes one kind or the other. Atom
    // counts vary, so a batch spans many layouts; indices repeat and are not sorted.
    for (uint64_t kind : {0, 1}) {
      std::vector<uint64_t> indices;
      while (indices.size() < 257) {
        const uint64_t i = rng() % 300;
        if ((i % 3 == 0) == (kind == 0)) indices.push_back(i);
      }
      const BatchPlan plan(r->index(), indices, false);
      ASSERT_EQ(plan.size(), indices.size());
      const Record first = r->read(indices[0]);
      ASSERT_EQ(plan.outputs().size(), first.num_fields());
      BatchBuffers whole(plan);
      plan.decode(r->bytes(), 0, plan.size(), whole.ptrs, true);
      for (size_t t = 0; t < plan.outputs().size(); ++t) {
        const BatchOutput& out = plan.outputs()[t];
        const std::string& key = r->index().keys()[out.key_id];
        EXPECT_EQ(key, first.key(t));
        EXPECT_EQ(out.concatenated, first.field(t).ndim > 0) << key;
        uint64_t rows = 0;
        for (size_t b = 0; b < indices.size(); ++b) {
          const Record rec = r->read(indices[b]);
          const Field& f = rec.field(size_t(rec.find(key)));
          rows += f.ndim ? f.shape[0] : 1;
          if (out.concatenated) {
            EXPECT_EQ(out.lengths[b], int64_t(f.ndim ? f.shape[0] : 1)) << key;
          }
        }
        EXPECT_EQ(out.shape[0], out.concatenated ? rows : indices.size()) << key;
        EXPECT_TRUE(whole.bytes[t] == expected_output(*r, indices, key, out.itemsize)) << key;
      }
      // Any split of the file order, decoded in any order, gives the same bytes.
      std::vector<std::pair<size_t, size_t>> parts;
      for (size_t k = 0; k < plan.size();) {
        const size_t n = std::min<size_t>(plan.size() - k, 1 + rng() % 40);
        parts.push_back({k, k + n});
        k += n;
      }
      std::shuffle(parts.begin(), parts.end(), rng);
      BatchBuffers split(plan);
      std::vector<std::thread> threads;
      for (int w = 0; w < 3; ++w)
        threads.emplace_back([&, w] {
          for (size_t p = size_t(w); p < parts.size(); p += 3)
            plan.decode(r->bytes(), parts[p].first, parts[p].second, split.ptrs, true);
        });
      for (auto& t : threads) t.join();
      EXPECT_TRUE(split.bytes == whole.bytes);
    }
  }
}

TEST(StoreBatch, StacksEqualShapesAndWidensText) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  TempDir dir;
  const std::string path = dir.file("s.tpf");
  {
    Writer w(path);
    for (uint32_t i = 0; i < 40; ++i) {
      TestRecord rec;
      rec.add("positions", DType::f32, 4, {5, 3}, rng);
      rec.add("names", DType::bytes, 1 + i % 6, {4}, rng);
      rec.add("id", DType::utf8, 1 + i % 9, {}, rng);
      rec.add("energy", DType::f64, 8, {}, rng);
      w.append(rec.view());
    }
    w.commit();
  }
  auto r = Reader::open(path);
  std::vector<uint64_t> indices;
  for (int k = 0; k < 70; ++k) indices.push_back(rng() % 40);
  const BatchPlan plan(r->index(), indices, true);
  BatchBuffers out(plan);
  plan.decode(r->bytes(), 0, plan.size(), out.ptrs, true);
  const uint64_t B = indices.size();
  const std::vector<std::vector<uint64_t>> shapes = {{B, 5, 3}, {B, 4}, {B}, {B}};
  uint32_t widest_name = 0, widest_id = 0;
  for (uint64_t i : indices) {
    widest_name = std::max(widest_name, uint32_t(1 + i % 6));
    widest_id = std::max(widest_id, uint32_t(1 + i % 9));
  }
  const uint32_t widths[] = {4, widest_name, widest_id, 8};
  for (size_t t = 0; t < 4; ++t) {
    const BatchOutput& o = plan.outputs()[t];
    const std::string& key = r->index().keys()[o.key_id];
    EXPECT_FALSE(o.concatenated) << key;
    EXPECT_EQ(o.shape, shapes[t]) << key;
    EXPECT_EQ(o.itemsize, widths[t]) << key;
    EXPECT_TRUE(out.bytes[t] == expected_output(*r, indices, key, widths[t])) << key;
  }
}

TEST(StoreBatch, DecodesCompressedRecordsOfAnySize) {
  // Records past the per-thread buffer a batch keeps (1 MiB) decode through their own buffer.
  std::mt19937_64 rng(5);
  TempDir dir;
  const std::string path = dir.file("z.tpf");
  WriterOptions o;
  o.codec = Codec::zstd;
  {
    Writer w(path, o);
    for (uint64_t n : {uint64_t(10), uint64_t(400000), uint64_t(7), uint64_t(300000)}) {
      std::vector<float> x(n);
      for (auto& v : x) v = float(rng() % 4);
      ArrayRef a{"x", DType::f32, 4, 1, {n}, x.data()};
      w.append(std::span(&a, 1));
    }
    w.commit();
  }
  auto r = Reader::open(path);
  ASSERT_EQ(r->index().entry(1).codec, Codec::zstd);
  const std::vector<uint64_t> indices = {3, 0, 1, 2, 1};
  const BatchPlan plan(r->index(), indices, false);
  BatchBuffers out(plan);
  plan.decode(r->bytes(), 0, plan.size(), out.ptrs, true);
  EXPECT_TRUE(out.bytes[0] == expected_output(*r, indices, "x", 4));
}

TEST(StoreBatch, RejectsRecordsThatDoNotFitTogether) {
  std::mt19937_64 rng(3);
  TempDir dir;
  const std::string path = dir.file("m.tpf");
  {
    Writer w(path);
    TestRecord a, b, c, d;
    a.add("positions", DType::f32, 4, {4, 3}, rng);
    b.add("positions", DType::f32, 4, {6, 3}, rng);
    c.add("positions", DType::f32, 4, {4, 2}, rng);
    d.add("forces", DType::f32, 4, {4, 3}, rng);
    for (const TestRecord* rec : {&a, &b, &c, &d}) w.append(rec->view());
    w.commit();
  }
  auto r = Reader::open(path);
  auto plan_error = [&](std::vector<uint64_t> indices, bool stack) {
    return error_of([&] { BatchPlan(r->index(), indices, stack); });
  };
  EXPECT_EQ(plan_error({0, 1}, false), "no error");
  EXPECT_NE(plan_error({0, 1}, true)
                .find("record 1 has field 'positions' of another dtype or shape "
                      "than record 0 (stacking needs identical shapes)"),
            std::string::npos);
  EXPECT_NE(plan_error({1, 2}, false).find("beyond the first axis"), std::string::npos);
  EXPECT_NE(plan_error({0, 3}, false).find("record 3 has key 'forces' that record 0 lacks"),
            std::string::npos);
  EXPECT_NE(plan_error({0, 4}, false).find("indices[1] = 4 is out of range"), std::string::npos);
  EXPECT_NE(plan_error({}, false).find("at least one record"), std::string::npos);
}

// A layout whose field sizes only add up by wrapping round 2^64 (found by the batch fuzzer: a field
// of 2^64 - 14 bytes passed the size check, then the next field's alignment wrapped the offset to 0,
// so the layout claimed an 8-byte record).
TEST(StoreFormat, LayoutWhoseSizesWrapRound64BitsIsRejected) {
  tpf::store::Layout layout;
  layout.fields.resize(3);
  layout.fields[0].dtype = tpf::store::DType::i32;
  layout.fields[0].itemsize = 4;
  layout.fields[0].ndim = 1;
  layout.fields[0].shape[0] = 3;
  layout.fields[1].dtype = tpf::store::DType::u8;
  layout.fields[1].itemsize = 1;
  layout.fields[1].ndim = 1;
  layout.fields[1].shape[0] = UINT64_MAX - 13;
  layout.fields[2].dtype = tpf::store::DType::f64;
  layout.fields[2].itemsize = 8;
  layout.fields[2].ndim = 1;
  layout.fields[2].shape[0] = 1;
  EXPECT_THROW(tpf::store::detail::place_fields(layout, "layout"), tpf::Error);
}

TEST(Store, WriterRejectsBadRecords) {
  TempDir dir;
  Writer w(dir.file("bad.tpf"));
  float x[3] = {};
  ArrayRef dup[2] = {{"x", DType::f32, 4, 1, {3}, x}, {"x", DType::f32, 4, 1, {3}, x}};
  EXPECT_NE(error_of([&] { w.append(dup); }).find("appears twice"), std::string::npos);
  ArrayRef reserved{"_x", DType::f32, 4, 1, {3}, x};
  EXPECT_NE(error_of([&] { w.append(std::span(&reserved, 1)); }).find("reserved"),
            std::string::npos);
  ArrayRef itemsize{"x", DType::f32, 8, 1, {3}, x};
  EXPECT_NE(error_of([&] { w.append(std::span(&itemsize, 1)); }).find("itemsize"),
            std::string::npos);
  ArrayRef empty_key{"", DType::f32, 4, 1, {3}, x};
  EXPECT_NE(error_of([&] { w.append(std::span(&empty_key, 1)); }).find("empty key"),
            std::string::npos);
  ArrayRef huge{"x", DType::f64, 8, 2, {1u << 20, 1u << 20}, x};
  EXPECT_NE(error_of([&] { w.append(std::span(&huge, 1)); }).find("4 GiB"), std::string::npos);
  EXPECT_EQ(w.size(), 0u);
  EXPECT_NE(error_of([] { parse_codec("gzip"); }).find("'none', 'zstd' or 'lz4'"),
            std::string::npos);
}

// ---- failure modes: one test each -----------------------------------------------------------

class StoreFailure : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = test_seed();
    path_ = dir_.file("f.tpf");
    write_records(path_, seed_, 0, 20);
    {
      Writer w(path_);
      for (uint64_t i = 20; i < 30; ++i) w.append(testing::record_for(seed_, i).view());
      w.commit();  // generation 3 in slot 0 after generations 1 (slot 0) and 2 (slot 1)
    }
    auto r = Reader::open(path_);
    generation_ = r->index().generation();
    current_ = r->headers().current;
    index_offset_ = r->index().header().index_offset;
    record5_ = r->index().entry(5);
  }
  TempDir dir_;
  uint64_t seed_ = 0;
  std::string path_;
  uint64_t generation_ = 0;
  int current_ = 0;
  uint64_t index_offset_ = 0;
  RecordEntry record5_;
};

TEST_F(StoreFailure, EmptyFile) {
  testing::write_file(path_, {});
  EXPECT_NE(error_of([&] { Reader::open(path_); }).find("is empty (0 bytes)"), std::string::npos);
}

TEST_F(StoreFailure, TruncatedFile) {
  auto bytes = testing::read_file(path_);
  for (uint64_t keep : {uint64_t(10), uint64_t(100), record5_.offset + 3, index_offset_ + 40,
                        uint64_t(bytes.size() - 1)}) {
    std::vector<std::byte> cut = bytes;
    cut.resize(keep);
    testing::write_file(path_, cut);
    EXPECT_NE(error_of([&] { Reader::open(path_); }).find("is truncated"), std::string::npos)
        << "kept " << keep << " bytes";
  }
}

TEST_F(StoreFailure, FlippedByteInRecord) {
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed_));
  flip_byte(path_, record5_.offset + record5_.stored_length / 2);
  auto r = Reader::open(path_);
  EXPECT_NE(error_of([&] { r->read(5); }).find("record 5 is corrupt (checksum mismatch)"),
            std::string::npos);
  std::string why;
  EXPECT_TRUE(testing::same_record(r->read(4), testing::record_for(seed_, 4), &why)) << why;
  EXPECT_TRUE(testing::same_record(r->read(6), testing::record_for(seed_, 6), &why)) << why;
  ReaderOptions fast;
  fast.verify_checksums = false;
  EXPECT_NO_THROW(Reader::open(path_, fast)->read(5));  // unchecked: returns the bytes as stored
}

TEST_F(StoreFailure, FlippedByteInCompressedRecordWithoutChecksumIsAnErrorNotACrash) {
  WriterOptions o;
  o.codec = Codec::zstd;
  std::vector<float> zeros(500, 0.f);
  ArrayRef a{"x", DType::f32, 4, 1, {500}, zeros.data()};
  const std::string path = dir_.file("z.tpf");
  {
    Writer w(path, o);
    w.append(std::span(&a, 1));
    w.commit();
  }
  ReaderOptions fast;
  fast.verify_checksums = false;
  const RecordEntry e = Reader::open(path)->index().entry(0);
  ASSERT_EQ(e.codec, Codec::zstd);
  for (uint32_t at = 0; at < e.stored_length; ++at) {
    flip_byte(path, e.offset + at);
    auto r = Reader::open(path, fast);
    const std::string err = error_of([&] { r->read(0); });
    EXPECT_TRUE(err == "no error" || err.find("does not decompress") != std::string::npos) << err;
    flip_byte(path, e.offset + at);
  }
}

TEST_F(StoreFailure, FlippedByteInIndex) {
  flip_byte(path_, index_offset_ + 40);
  EXPECT_NE(error_of([&] { Reader::open(path_); }).find("index checksum mismatch"),
            std::string::npos);
}

// Issue 20, item 3: a damaged current slot is an error, not a silent step back to the previous
// commit; recover reads the previous commit, and says so in headers().
TEST_F(StoreFailure, FlippedByteInCurrentHeaderIsAnErrorUnlessRecovering) {
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed_));
  flip_byte(path_, uint64_t(current_) * 64 + 20);
  const std::string err = error_of([&] { Reader::open(path_); });
  EXPECT_NE(err.find("header slot " + std::to_string(current_) + " is damaged: checksum mismatch"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("recover=True"), std::string::npos) << err;
  EXPECT_NE(error_of([&] { Writer w(path_); }).find("is damaged"), std::string::npos);
  {
    MemorySource src(testing::read_file(path_), path_);
    EXPECT_NE(error_of([&] { open_index(src); }).find("is damaged"), std::string::npos);
    EXPECT_EQ(open_index(src, true).generation(), generation_ - 1);
  }
  ReaderOptions recover;
  recover.recover = true;
  auto r = Reader::open(path_, recover);
  EXPECT_EQ(r->index().generation(), generation_ - 1);
  EXPECT_TRUE(r->headers().fallback);
  EXPECT_EQ(r->headers().damaged, current_);
  EXPECT_NE(r->headers().slot[current_].problem.find("checksum mismatch"), std::string::npos);
  expect_records(*r, seed_, 20);
  WriterOptions append;
  append.recover = true;
  write_records(path_, seed_, 20, 25, append);  // drops generation 3's records, as asked
  expect_records(*Reader::open(path_), seed_, 25);
}

// Issue 20, item 2: the version field is believed only from a slot whose checksum holds, so a
// flipped byte anywhere in the older slot leaves the file readable.
TEST_F(StoreFailure, FlippedByteInOlderHeaderIsHarmless) {
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed_));
  const uint64_t older = uint64_t(1 - current_) * 64;
  for (uint64_t at : {older + 8, older + 9, older + 11, older + 20, older + 40, older + 60}) {
    SCOPED_TRACE("flipped byte " + std::to_string(at));
    flip_byte(path_, at);
    auto r = Reader::open(path_);
    EXPECT_EQ(r->index().generation(), generation_);
    EXPECT_EQ(r->headers().damaged, 1 - current_);
    EXPECT_FALSE(r->headers().fallback);
    expect_records(*r, seed_, 30);
    // Also while a writer's uncommitted appends follow the current index: the damaged slot names
    // an intact older index, so it is known to be older.
    auto bytes = testing::read_file(path_);
    bytes.resize(bytes.size() + 1000, std::byte{7});
    const std::string grown = dir_.file("grown.tpf");
    testing::write_file(grown, bytes);
    if (at != older + 40) {  // the flipped byte is not in the index range the check needs
      EXPECT_EQ(Reader::open(grown)->index().generation(), generation_);
    } else {
      EXPECT_NE(error_of([&] { Reader::open(grown); }).find("is damaged"), std::string::npos);
    }
    flip_byte(path_, at);
  }
}

TEST_F(StoreFailure, FlippedBytesInBothHeaders) {
  flip_byte(path_, 20);
  flip_byte(path_, 64 + 20);
  EXPECT_NE(error_of([&] { Reader::open(path_); }).find("has no intact header"), std::string::npos);
}

TEST_F(StoreFailure, WrongMagic) {
  auto bytes = testing::read_file(path_);
  std::memcpy(bytes.data(), "NOTASTOR", 8);
  std::memcpy(bytes.data() + 64, "NOTASTOR", 8);
  testing::write_file(path_, bytes);
  EXPECT_NE(error_of([&] { Reader::open(path_); }).find("is not a TurboPairFormer store"),
            std::string::npos);
}

TEST_F(StoreFailure, NewerFormatVersion) {
  auto bytes = testing::read_file(path_);
  HeaderSlot h = Reader::open(path_)->index().header();
  h.version = kFormatVersion + 1;
  detail::encode_header_slot(h, std::span<std::byte, 64>(bytes.data() + current_ * 64, 64));
  testing::write_file(path_, bytes);
  EXPECT_NE(error_of([&] { Reader::open(path_); }).find("newer than this reader's version"),
            std::string::npos);
}

TEST_F(StoreFailure, SecondWriterOnTheSameFile) {
  Writer first(path_);
  EXPECT_NE(error_of([&] { Writer second(path_); }).find("locked by another writer"),
            std::string::npos);
  first.close();
  EXPECT_NO_THROW(Writer third(path_));
}

TEST_F(StoreFailure, NotAStoreOpenedForWriting) {
  testing::write_file(path_, std::vector<std::byte>(300, std::byte{'x'}));
  EXPECT_NE(error_of([&] { Writer w(path_); }).find("is not a TurboPairFormer store"),
            std::string::npos);
}

// Issue 20, item 4.
TEST_F(StoreFailure, MissingFile) {
  const std::string missing = dir_.file("nope.tpf");
  EXPECT_EQ(error_of([&] { Reader::open(missing); }),
            "FileNotFoundError: store file " + missing + " does not exist");
  EXPECT_EQ(error_of([&] { describe(missing); }),
            "FileNotFoundError: store file " + missing + " does not exist");
}

// Issue 20, item 4: a zeroed header region is what a first commit that never finished leaves (as
// writers before the rename did when killed); it is named as such.
TEST_F(StoreFailure, UnfinishedFirstCommit) {
  std::vector<std::byte> bytes(128 + 32, std::byte{0});
  std::memcpy(bytes.data() + 128, "TPFINDEX", 8);
  testing::write_file(path_, bytes);
  EXPECT_NE(error_of([&] { Reader::open(path_); }).find("has an unfinished first commit"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Writer w(path_); }).find("overwrite=True starts it again"),
            std::string::npos);
  WriterOptions o;
  o.overwrite = true;
  write_records(path_, seed_, 0, 3, o);
  expect_records(*Reader::open(path_), seed_, 3);
}

TEST_F(StoreFailure, FlippedByteInARecordOfABatch) {
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed_));
  flip_byte(path_, record5_.offset + record5_.stored_length / 3);
  auto r = Reader::open(path_);
  const std::vector<uint64_t> indices = {
      7, 5, 4};  // one set of keys (record_for adds keys to i % 3 == 0)
  const BatchPlan plan(r->index(), indices, false);
  BatchBuffers out(plan);
  EXPECT_NE(error_of([&] {
              plan.decode(r->bytes(), 0, 3, out.ptrs, true);
            }).find("record 5 is corrupt (checksum mismatch)"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { plan.decode(r->bytes(), 0, 3, out.ptrs, false); }), "no error");
  EXPECT_NE(error_of([&] {
              plan.decode(r->bytes().first(record5_.offset), 0, 3, out.ptrs, true);
            }).find("lies outside"),
            std::string::npos);
}

TEST_F(StoreFailure, IndexOutOfRange) {
  auto r = Reader::open(path_);
  EXPECT_NE(error_of([&] { r->read(30); }).find("out of range"), std::string::npos);
}

// ---- crash tests: a real writer process, killed with SIGKILL -------------------------------------

// Runs `child` in a forked process and waits for it; true when it died of SIGKILL.
template <typename Fn>
bool killed_in_child(Fn child) {
  const pid_t pid = fork();
  if (pid == 0) {
    try {
      child();
    } catch (...) {
      _exit(3);
    }
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

TEST(StoreCrash, KillAtEveryStepOfACommit) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  for (int step = kWriteIndex; step <= kSyncHeader; ++step) {
    SCOPED_TRACE("commit step " + std::to_string(step));
    const std::string path = dir.file("crash-" + std::to_string(step) + ".tpf");
    write_records(path, seed, 0, 40);
    ASSERT_TRUE(killed_in_child([&] {
      WriterOptions o;
      o.codec = Codec::lz4;
      o.on_commit_step = [step](int s) {
        if (s == step) raise(SIGKILL);
      };
      Writer w(path, o);
      for (uint64_t i = 40; i < 90; ++i) w.append(testing::record_for(seed, i).view());
      w.commit();
    }));
    auto r = Reader::open(path);
    // Until the header is written the old commit is the visible one; once written (even unsynced,
    // it is in the page cache) the new one is, complete.
    if (step < kSyncHeader) {
      expect_records(*r, seed, 40);
    } else {
      expect_records(*r, seed, r->size());
      EXPECT_TRUE(r->size() == 40 || r->size() == 90) << r->size();
    }
    const uint64_t have = r->size();
    {  // a new writer continues after the surviving commit
      Writer w(path);
      for (uint64_t i = have; i < have + 15; ++i) w.append(testing::record_for(seed, i).view());
      w.commit();
    }
    expect_records(*Reader::open(path), seed, have + 15);
  }
}

// Files in `dir` other than the stores named.
std::vector<std::string> other_files(const TempDir& dir, const std::vector<std::string>& stores) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(dir.file("")))) {
    const std::string name = e.path().filename().string();
    if (std::find(stores.begin(), stores.end(), name) == stores.end()) out.push_back(name);
  }
  return out;
}

// Issue 20, item 4: a kill anywhere in the first commit of a new file leaves nothing at its path
// (the file is built under a partial name), and the next writer starts afresh and removes the
// dead writer's partial file.
TEST(StoreCrash, KillAtEveryStepOfTheFirstCommit) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  for (int step = kWriteIndex; step <= kReplace; ++step) {
    SCOPED_TRACE("commit step " + std::to_string(step));
    TempDir dir;
    const std::string path = dir.file("new.tpf");
    ASSERT_TRUE(killed_in_child([&] {
      WriterOptions o;
      o.on_commit_step = [step](int s) {
        if (s == step) raise(SIGKILL);
      };
      Writer w(path, o);
    }));
    EXPECT_EQ(error_of([&] { Reader::open(path); }),
              "FileNotFoundError: store file " + path + " does not exist");
    EXPECT_EQ(other_files(dir, {}).size(), 1u);  // the partial file
    write_records(path, seed, 0, 10);
    expect_records(*Reader::open(path), seed, 10);
    EXPECT_TRUE(other_files(dir, {"new.tpf"}).empty());
  }
}

// Issue 20, item 1: an overwrite killed anywhere before its first commit has put the new file in
// place leaves the old contents whole; once that commit returns, the new file is there, complete.
TEST(StoreCrash, KillAtEveryStepOfAnOverwrite) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  const std::string path = dir.file("o.tpf");
  const uint64_t new_seed = seed + 1;
  struct KillPoint {
    int commit;  // 1: the constructor's empty commit, 2: the first commit(); 0: none
    int step;    // a CommitStep; for commit 0, -1 kills before commit() and 1 after it returns
  };
  std::vector<KillPoint> points = {{0, -1}, {0, 1}};
  for (int step = kWriteIndex; step <= kSyncHeader; ++step) points.push_back({1, step});
  for (int step = kWriteIndex; step <= kReplace; ++step) points.push_back({2, step});
  for (const KillPoint& at : points) {
    SCOPED_TRACE("commit " + std::to_string(at.commit) + " step " + std::to_string(at.step));
    write_records(path, seed, 0, 40, overwriting());
    auto reader = Reader::open(path);
    ASSERT_TRUE(killed_in_child([&] {
      WriterOptions o;
      o.overwrite = true;
      o.codec = Codec::zstd;
      int commits = 0;
      o.on_commit_step = [&](int s) {
        if (s == kWriteIndex) ++commits;
        if (commits == at.commit && s == at.step) raise(SIGKILL);
      };
      Writer w(path, o);
      for (uint64_t i = 0; i < 25; ++i) w.append(testing::record_for(new_seed, i).view());
      if (at.commit == 0 && at.step == -1) raise(SIGKILL);
      w.commit();
      raise(SIGKILL);
    }));
    expect_records(*reader, seed, 40);  // the reader's file, whatever happened at `path`
    const bool replaced = at.commit == 0 && at.step == 1;
    expect_records(*Reader::open(path), replaced ? new_seed : seed, replaced ? 25 : 40);
    // The dead writer's partial file, unless it had been renamed into place.
    EXPECT_EQ(other_files(dir, {"o.tpf"}).size(), replaced ? 0u : 1u);
  }
  write_records(path, seed, 40, 45);  // the next writer appends to what is there
  EXPECT_TRUE(other_files(dir, {"o.tpf"}).empty());
}

// Issue 20, item 1: a reader keeps reading the file it opened while an overwrite replaces it with
// a smaller one (it used to be truncated under the reader's mapping: SIGBUS).
TEST(StoreCrash, OverwriteLeavesTheReadersFileAlone) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  const std::string path = dir.file("r.tpf");
  write_records(path, seed, 0, 300);
  auto reader = Reader::open(path);
  std::filesystem::permissions(path, std::filesystem::perms::owner_read |
                                         std::filesystem::perms::owner_write |
                                         std::filesystem::perms::group_read);
  {
    Writer w(path, overwriting());
    w.append(testing::record_for(seed + 1, 0).view());
    EXPECT_EQ(Reader::open(path)->size(), 300u);  // until the commit, the old file is at `path`
    w.commit();
    EXPECT_EQ(Reader::open(path)->size(), 1u);
    // The lock moved to the new file: another writer is still refused.
    EXPECT_NE(error_of([&] { Writer second(path); }).find("locked by another writer"),
              std::string::npos);
  }
  expect_records(*reader, seed, 300);
  EXPECT_EQ(std::filesystem::status(path).permissions(),
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write |
                std::filesystem::perms::group_read);  // the replaced file's mode
  {  // an overwrite that is closed without a commit changes nothing
    Writer w(path, overwriting());
    w.append(testing::record_for(seed, 0).view());
  }
  EXPECT_EQ(Reader::open(path)->size(), 1u);
  EXPECT_TRUE(other_files(dir, {"r.tpf"}).empty());
}

TEST(StoreCrash, TornHeaderWriteFallsBackToThePreviousCommit) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  const std::string path = dir.file("torn.tpf");
  write_records(path, seed, 0, 12);
  const auto before = testing::read_file(path);
  {
    Writer w(path);
    for (uint64_t i = 12; i < 30; ++i) w.append(testing::record_for(seed, i).view());
    w.commit();
  }
  // Keep the new slot's first half and the old bytes after it: what a torn 64-byte write leaves.
  auto after = testing::read_file(path);
  const int slot = Reader::open(path)->headers().current;
  std::memcpy(after.data() + slot * 64 + 32, before.data() + slot * 64 + 32, 32);
  testing::write_file(path, after);
  expect_records(*Reader::open(path), seed, 12);
}

TEST(StoreCrash, KillDuringAppendsKeepsEveryCommittedRecord) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE("TPF_SEED=" + std::to_string(seed));
  TempDir dir;
  std::mt19937_64 rng(seed);
  constexpr uint64_t kCommitEvery = 25;
  for (int trial = 0; trial < 4; ++trial) {
    const std::string path = dir.file("append-" + std::to_string(trial) + ".tpf");
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      ::close(fds[0]);
      try {
        WriterOptions o;
        o.codec = trial % 2 ? Codec::zstd : Codec::none;
        Writer w(path, o);
        for (uint64_t i = 0;; ++i) {
          w.append(testing::record_for(seed, i).view());
          if ((i + 1) % kCommitEvery == 0) {
            w.commit();
            const uint64_t n = i + 1;
            if (write(fds[1], &n, sizeof n) != sizeof n) _exit(4);
          }
        }
      } catch (...) {
        _exit(3);
      }
    }
    ::close(fds[1]);
    // Let it commit a few times, then kill it wherever it is.
    uint64_t committed = 0, n = 0;
    const int commits_before_kill = 2 + int(rng() % 6);
    for (int c = 0; c < commits_before_kill && read(fds[0], &n, sizeof n) == sizeof n; ++c)
      committed = n;
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    while (read(fds[0], &n, sizeof n) == sizeof n) committed = n;
    ::close(fds[0]);
    ASSERT_TRUE(WIFSIGNALED(status)) << "writer exited with status " << status;
    auto r = Reader::open(path);
    EXPECT_GE(r->size(), committed);
    EXPECT_EQ(r->size() % kCommitEvery, 0u);
    expect_records(*r, seed, r->size());
  }
}

}  // namespace
}  // namespace tpf::store

// The public decode API (tpf/record.h): records decoded into the caller's memory for every codec,
// bad records as clear errors, and each rule of FORMAT.md's well-known keys.
#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "store_test_util.h"
#include "tpf/record.h"

namespace tpf::store {
namespace {

using testing::error_of;
using testing::TempDir;

#define EXPECT_ERROR(expr, text)                                           \
  EXPECT_NE(error_of([&] { (void)(expr); }).find(text), std::string::npos) \
      << error_of([&] { (void)(expr); })

std::shared_ptr<const Reader> write_and_open(const TempDir& dir, Codec codec, uint64_t seed,
                                             uint64_t count) {
  WriterOptions o;
  o.codec = codec;
  const std::string path = dir.file(std::string("r-") + codec_name(codec) + ".tpf");
  Writer w(path, o);
  for (uint64_t i = 0; i < count; ++i) w.append(testing::record_for(seed, i).view());
  w.commit();
  ReaderOptions ro;
  return Reader::open(path, ro);
}

std::span<const std::byte> stored_of(const Reader& r, uint64_t i) {
  const RecordEntry e = r.index().entry(i);
  return r.bytes().subspan(e.offset, e.stored_length);
}

TEST(RecordDecode, IntoCallerMemoryForEveryCodec) {
  TempDir dir;
  for (Codec codec : {Codec::none, Codec::zstd, Codec::lz4}) {
    const auto r = write_and_open(dir, codec, 7, 24);
    std::vector<uint64_t> words;
    for (uint64_t i = 0; i < r->size(); ++i) {
      const uint64_t size = decoded_size(r->index(), i);
      EXPECT_EQ(size, r->index().layout(r->index().entry(i).layout_id).raw_size);
      words.assign(size / 8 + 1, 0);
      const std::span<std::byte> raw(reinterpret_cast<std::byte*>(words.data()), size);
      const std::span<const std::byte> stored = stored_of(*r, i);
      const Record rec = decode_record_into(r->index(), i, stored, raw);
      std::string why;
      EXPECT_TRUE(testing::same_record(rec, testing::record_for(7, i), &why))
          << codec_name(codec) << " record " << i << ": " << why;
      EXPECT_FALSE(rec.owns_data());
      const bool compressed = r->index().entry(i).codec != Codec::none;
      EXPECT_EQ(rec.bytes(), compressed ? raw.data() : stored.data());
      EXPECT_EQ(rec.layout().raw_size, size);
      // The same as the owning decode.
      const Record owned = decode_record(r->index(), i, stored);
      EXPECT_EQ(std::memcmp(owned.bytes(), rec.bytes(), size), 0);
      if (!compressed) {  // an uncompressed record needs no buffer at all
        const Record view = decode_record_into(r->index(), i, stored, {});
        EXPECT_EQ(view.bytes(), stored.data());
      }
    }
  }
}

TEST(RecordDecode, BadRecordsAreClearErrors) {
  TempDir dir;
  const auto plain = write_and_open(dir, Codec::none, 3, 4);
  const auto packed = write_and_open(dir, Codec::zstd, 3, 4);
  const Index& ix = plain->index();
  const std::span<const std::byte> stored = stored_of(*plain, 1);
  std::vector<std::byte> copy(stored.begin(), stored.end());
  copy[copy.size() / 2] ^= std::byte{0x40};
  EXPECT_ERROR(decode_record_into(ix, 1, copy, {}), ": record 1 is corrupt (checksum mismatch)");
  EXPECT_EQ(error_of([&] { decode_record_into(ix, 1, copy, {}, /*verify_checksum=*/false); }),
            "no error");
  EXPECT_ERROR(decode_record_into(ix, 1, stored.first(stored.size() - 1), {}),
               ": record 1 was given " + std::to_string(stored.size() - 1) + " bytes");
  EXPECT_ERROR(decode_record_into(ix, 99, stored, {}), "99");
  EXPECT_ERROR(decoded_size(ix, 4), "4");

  // A compressed record needs an aligned buffer of its decoded size, and bytes that decode.
  const Index& px = packed->index();
  uint64_t i = 0;
  while (i < px.size() && px.entry(i).codec == Codec::none) ++i;
  ASSERT_LT(i, px.size()) << "no record compressed";
  const std::span<const std::byte> zipped = stored_of(*packed, i);
  const uint64_t size = decoded_size(px, i);
  std::vector<uint64_t> words(size / 8 + 2);
  auto* base = reinterpret_cast<std::byte*>(words.data());
  EXPECT_ERROR(decode_record_into(px, i, zipped, std::span<std::byte>(base, size - 1)),
               "decodes to " + std::to_string(size) + " bytes; expected a buffer");
  EXPECT_ERROR(decode_record_into(px, i, zipped, std::span<std::byte>(base + 1, size)),
               "(misaligned)");
  std::vector<std::byte> garbage(zipped.begin(), zipped.end());
  for (size_t k = garbage.size() / 2; k < garbage.size(); ++k) garbage[k] = std::byte{0xff};
  EXPECT_ERROR(decode_record_into(px, i, garbage, std::span<std::byte>(base, size), false),
               "does not decompress (zstd)");
  EXPECT_ERROR(decode_record_into(px, i, garbage, std::span<std::byte>(base, size)), "corrupt");
}

// ---- well-known keys ----------------------------------------------------------------------------

ArrayRef field(const char* key, DType dtype, std::initializer_list<uint64_t> shape) {
  ArrayRef r;
  r.key = key;
  r.dtype = dtype;
  r.itemsize = dtype_size(dtype) ? dtype_size(dtype) : 4;
  r.ndim = int(shape.size());
  int d = 0;
  for (uint64_t s : shape) r.shape[d++] = s;
  return r;
}

std::string check(std::vector<ArrayRef> fields) {
  return error_of([&] { check_well_known(fields); });
}

TEST(WellKnownKeys, EachKeyHasItsRule) {
  const std::pair<KeyRule, std::vector<std::string>> groups[] = {
      {KeyRule::per_atom_xyz, {"positions", "forces", "velocities"}},
      {KeyRule::per_atom,
       {"atomic_numbers", "charges", "b_factors", "occupancy", "residue_index", "residue_names",
        "atom_names", "chain_id"}},
      {KeyRule::scalar, {"energy", "resolution"}},
      {KeyRule::cell, {"cell"}},
      {KeyRule::pbc, {"pbc"}},
      {KeyRule::stress, {"stress"}},
      {KeyRule::identifier, {"identifier"}},
      {KeyRule::any, {"mask", "Positions", "positions ", ""}}};
  for (const auto& [rule, keys] : groups)
    for (const std::string& key : keys) EXPECT_EQ(key_rule(key), rule) << key;
}

TEST(WellKnownKeys, AWholeStructurePasses) {
  EXPECT_EQ(
      check({field("positions", DType::f32, {5, 3}), field("atomic_numbers", DType::u8, {5}),
             field("forces", DType::f64, {5, 3}), field("velocities", DType::f32, {5, 3}),
             field("charges", DType::f32, {5}), field("b_factors", DType::f32, {5}),
             field("occupancy", DType::f32, {5}), field("residue_index", DType::i32, {5}),
             field("residue_names", DType::bytes, {5}), field("atom_names", DType::bytes, {5}),
             field("chain_id", DType::bytes, {5}), field("energy", DType::f64, {}),
             field("resolution", DType::f64, {}), field("cell", DType::f64, {3, 3}),
             field("pbc", DType::boolean, {3}), field("stress", DType::f64, {6}),
             field("identifier", DType::utf8, {}), field("mask", DType::boolean, {2, 7})}),
      "no error");
  EXPECT_EQ(check({field("stress", DType::f32, {3, 3})}), "no error");
  EXPECT_EQ(check({field("positions", DType::f64, {0, 3}), field("forces", DType::f32, {0, 3})}),
            "no error");  // zero atoms
  for (DType d : {DType::i8, DType::u16, DType::i64, DType::boolean})
    EXPECT_EQ(check({field("atomic_numbers", d, {2})}), "no error") << dtype_name(d);
  EXPECT_EQ(check({field("anything", DType::utf8, {4, 4, 4})}), "no error");
}

TEST(WellKnownKeys, EachBrokenRuleNamesTheField) {
  const std::pair<std::vector<ArrayRef>, std::string> cases[] = {
      {{field("positions", DType::f32, {4, 2})},
       "record field 'positions' must have shape [n_atoms, 3], got [4, 2]"},
      {{field("forces", DType::f32, {4})},
       "record field 'forces' must have shape [n_atoms, 3], got [4]"},
      {{field("velocities", DType::f32, {})},
       "record field 'velocities' is per-atom and needs an atom axis, got shape []"},
      {{field("charges", DType::f32, {})},
       "record field 'charges' is per-atom and needs an atom axis, got shape []"},
      {{field("positions", DType::f32, {4, 3}), field("forces", DType::f32, {5, 3})},
       "record field 'forces' has 5 atoms but 'positions' has 4"},
      {{field("atomic_numbers", DType::u8, {4}), field("chain_id", DType::bytes, {3})},
       "record field 'chain_id' has 3 atoms but 'atomic_numbers' has 4"},
      {{field("cell", DType::f64, {3})}, "record field 'cell' must have shape [3, 3], got [3]"},
      {{field("pbc", DType::boolean, {2})}, "record field 'pbc' must have shape [3], got [2]"},
      {{field("pbc", DType::u8, {3})}, "record field 'pbc' must be bool, got uint8"},
      {{field("stress", DType::f64, {3, 2})},
       "record field 'stress' must have shape [6] or [3, 3], got [3, 2]"},
      {{field("energy", DType::f64, {2})}, "record field 'energy' must be a scalar, got shape [2]"},
      {{field("resolution", DType::f32, {1})},
       "record field 'resolution' must be a scalar, got shape [1]"},
      {{field("identifier", DType::utf8, {2})},
       "record field 'identifier' must be a scalar, got shape [2]"},
      {{field("identifier", DType::bytes, {})},
       "record field 'identifier' must be a str, got bytes"},
      {{field("positions", DType::i32, {4, 3})},
       "record field 'positions' must be floating point, got int32"},
      {{field("atomic_numbers", DType::f32, {4})},
       "record field 'atomic_numbers' must be integers, got float32"},
  };
  for (const auto& [fields, message] : cases) EXPECT_EQ(check(fields), message);
}

TEST(WellKnownKeys, KindsAsNumpySpellsThem) {
  EXPECT_EQ(dtype_kind(DType::boolean), 'b');
  EXPECT_EQ(dtype_kind(DType::u32), 'u');
  EXPECT_EQ(dtype_kind(DType::i8), 'i');
  EXPECT_EQ(dtype_kind(DType::f16), 'f');
  EXPECT_EQ(dtype_kind(DType::bytes), 'S');
  EXPECT_EQ(dtype_kind(DType::utf8), 'U');
  EXPECT_TRUE(key_accepts_kind("positions", 'f'));
  EXPECT_FALSE(key_accepts_kind("positions", 'c'));  // complex: not floating point
  EXPECT_TRUE(key_accepts_kind("atomic_numbers", 'b'));
  EXPECT_FALSE(key_accepts_kind("identifier", 'i'));
  EXPECT_TRUE(key_accepts_kind("energy", 'c'));  // only the three keys have kind rules
  EXPECT_EQ(error_of([] { check_key_kind("identifier", '?', "int"); }),
            "record field 'identifier' must be a str, got int");
}

TEST(WellKnownKeys, DecodedRecordsAreChecked) {
  TempDir dir;
  const auto r = write_and_open(dir, Codec::lz4, 11, 12);
  for (uint64_t i = 0; i < r->size(); ++i)
    EXPECT_EQ(error_of([&] { check_well_known(r->read(i)); }), "no error") << "record " << i;

  Writer w(dir.file("bad.tpf"));
  const float xyz[6] = {};
  ArrayRef pos = field("positions", DType::f32, {3, 2});
  pos.data = xyz;
  w.append(std::span<const ArrayRef>(&pos, 1));  // the store takes any array under any key
  w.commit();
  const auto bad = Reader::open(dir.file("bad.tpf"));
  EXPECT_EQ(error_of([&] { check_well_known(bad->read(0)); }),
            "record field 'positions' must have shape [n_atoms, 3], got [3, 2]");
}

}  // namespace
}  // namespace tpf::store

// Writes a seed corpus for store_fuzz: small valid stores of every codec, in each fuzz mode.
#include <cstdio>
#include <string>

#include "store_test_util.h"

int main(int argc, char** argv) {
  using namespace tpf::store;
  if (argc != 2) {
    std::fprintf(stderr, "usage: store_fuzz_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  int n = 0;
  for (Codec codec : {Codec::none, Codec::zstd, Codec::lz4}) {
    for (int records : {0, 1, 3}) {
      const std::string path = dir + "/store.tmp";
      WriterOptions o;
      o.codec = codec;
      o.overwrite = true;
      {
        Writer w(path, o);
        for (int i = 0; i < records; ++i) {
          std::mt19937_64 rng(uint64_t(i) + 1);
          w.append(testing::random_record(rng, 1 + uint64_t(i) * 3, uint64_t(i)).view());
          if (i == 1) w.commit();
        }
        w.commit();
      }
      const auto bytes = testing::read_file(path);
      for (uint8_t mode = 0; mode < 4; ++mode) {
        std::vector<std::byte> seed(1, std::byte(mode));
        seed.insert(seed.end(), bytes.begin(), bytes.end());
        testing::write_file(dir + "/seed-" + std::to_string(n++), seed);
      }
      std::remove(path.c_str());
    }
  }
  return 0;
}

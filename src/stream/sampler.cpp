// Deterministic epoch orders and their split across ranks and DataLoader workers. The random
// numbers come from SplitMix64 and Lemire's bounded draw, both fully specified, so an order is the
// same on every platform and standard library (std::uniform_int_distribution is not).
#include <numeric>

#include "tpf/error.h"
#include "tpf/stream.h"

namespace tpf::stream {

namespace {

__extension__ typedef unsigned __int128 u128;

struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n), n > 0, without modulo bias.
  uint64_t below(uint64_t n) {
    u128 m = static_cast<u128>(next()) * n;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < n) {
      const uint64_t threshold = -n % n;
      while (low < threshold) {
        m = static_cast<u128>(next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
};

template <typename T>
void fisher_yates(T* first, uint64_t n, SplitMix64& rng) {
  for (uint64_t i = n; i > 1; --i) std::swap(first[i - 1], first[rng.below(i)]);
}

SplitMix64 rng_for(uint64_t seed, uint64_t epoch, uint64_t stream) {
  SplitMix64 mix{seed};
  uint64_t s = mix.next();
  s ^= SplitMix64{epoch + 0x632BE59BD9B4E019ull}.next();
  s ^= SplitMix64{stream * 0xD1B54A32D192ED03ull + 1}.next();
  return SplitMix64{s};
}

}  // namespace

std::vector<uint64_t> epoch_order(const SamplerOptions& options, uint64_t epoch) {
  const uint64_t n = options.num_records;
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), uint64_t{0});
  if (!options.shuffle || n < 2) return order;
  if (options.block_size <= 1) {
    SplitMix64 rng = rng_for(options.seed, epoch, 0);
    fisher_yates(order.data(), n, rng);
    return order;
  }
  const uint64_t b = options.block_size;
  const uint64_t blocks = (n + b - 1) / b;
  std::vector<uint64_t> block_order(blocks);
  std::iota(block_order.begin(), block_order.end(), uint64_t{0});
  SplitMix64 rng = rng_for(options.seed, epoch, 1);
  fisher_yates(block_order.data(), blocks, rng);
  uint64_t pos = 0;
  for (uint64_t blk : block_order) {
    const uint64_t lo = blk * b, hi = std::min(n, lo + b);
    for (uint64_t r = lo; r < hi; ++r) order[pos + (r - lo)] = r;
    fisher_yates(order.data() + pos, hi - lo, rng);
    pos += hi - lo;
  }
  return order;
}

std::vector<uint64_t> rank_slice(const std::vector<uint64_t>& order, uint64_t consumed,
                                 uint32_t rank, uint32_t world_size, bool drop_last) {
  TPF_CHECK(world_size >= 1, "world_size: expected >= 1, got 0");
  TPF_CHECK(rank < world_size, "rank: expected < world_size (" + std::to_string(world_size) +
                                   "), got " + std::to_string(rank));
  const uint64_t n = order.size();
  const uint64_t left = consumed >= n ? 0 : n - consumed;
  const uint64_t total = drop_last ? left / world_size * world_size
                                   : (left + world_size - 1) / world_size * world_size;
  std::vector<uint64_t> out;
  out.reserve(total / world_size);
  for (uint64_t i = rank; i < total; i += world_size) {
    const uint64_t pos = consumed + i;
    // Padding repeats the order from its start, so the extra samples are spread, not one record.
    out.push_back(pos < n ? order[pos] : order[(pos - n) % n]);
  }
  return out;
}

std::vector<uint64_t> worker_slice(const std::vector<uint64_t>& rank_list, uint32_t worker,
                                   uint32_t num_workers, uint64_t batch_size) {
  TPF_CHECK(num_workers >= 1, "num_workers: expected >= 1, got 0");
  TPF_CHECK(worker < num_workers, "worker: expected < num_workers (" + std::to_string(num_workers) +
                                      "), got " + std::to_string(worker));
  TPF_CHECK(batch_size >= 1, "batch_size: expected >= 1, got 0");
  std::vector<uint64_t> out;
  const uint64_t n = rank_list.size();
  for (uint64_t start = uint64_t(worker) * batch_size; start < n;
       start += uint64_t(num_workers) * batch_size)
    for (uint64_t i = start; i < std::min(n, start + batch_size); ++i) out.push_back(rank_list[i]);
  return out;
}

std::vector<uint64_t> worker_plan(uint64_t num_records, const PlanOptions& o) {
  const auto order = epoch_order({num_records, o.seed, o.shuffle, o.block_size}, o.epoch);
  return worker_slice(rank_slice(order, o.consumed, o.rank, o.world_size, o.drop_last), o.worker,
                      o.num_workers, o.batch_size);
}

uint64_t rank_count(uint64_t num_records, const PlanOptions& o) {
  TPF_CHECK(o.world_size >= 1, "world_size: expected >= 1, got 0");
  TPF_CHECK(o.rank < o.world_size, "rank: expected < world_size (" + std::to_string(o.world_size) +
                                       "), got " + std::to_string(o.rank));
  const uint64_t left = o.consumed >= num_records ? 0 : num_records - o.consumed;
  return o.drop_last ? left / o.world_size : (left + o.world_size - 1) / o.world_size;
}

}  // namespace tpf::stream

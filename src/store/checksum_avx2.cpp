// XXH3-64 built for AVX2 (xxHash's own header, inlined with its vector width fixed), for
// checksum() to call on CPUs that have AVX2. This file alone is compiled with -mavx2.
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

namespace tpf::store::detail {

uint64_t checksum_avx2(const void* data, size_t n) { return XXH3_64bits(data, n); }

}  // namespace tpf::store::detail

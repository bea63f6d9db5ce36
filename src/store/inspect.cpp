// The inspector: a file's structure in words (Riegeli's describe tool is the model).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <sstream>

#include "tpf/error.h"
#include "tpf/store.h"

namespace tpf::store {

namespace {

std::string human(uint64_t n) {
  std::ostringstream o;
  o << n << " B";
  if (n >= 1024) {
    const char* unit[] = {"KiB", "MiB", "GiB", "TiB"};
    double v = double(n);
    int u = -1;
    while (v >= 1024 && u < 3) {
      v /= 1024;
      ++u;
    }
    o.precision(v < 10 ? 2 : 1);
    o << std::fixed << " (" << v << " " << unit[u] << ")";
  }
  return o.str();
}

std::string shape_range(const std::vector<std::vector<uint64_t>>& shapes) {
  std::string s = "[";
  const size_t nd = shapes.front().size();
  for (size_t d = 0; d < nd; ++d) {
    uint64_t lo = UINT64_MAX, hi = 0;
    for (const auto& sh : shapes) {
      lo = std::min(lo, sh[d]);
      hi = std::max(hi, sh[d]);
    }
    if (d) s += ", ";
    s += lo == hi ? std::to_string(lo) : std::to_string(lo) + ".." + std::to_string(hi);
  }
  return s + "]";
}

}  // namespace

std::string describe(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw FileNotFoundError("store file", path);
    throw RuntimeError("cannot open " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  ::fstat(fd, &st);
  const uint64_t size = uint64_t(st.st_size);
  FdSource src(fd, path, size);
  std::ostringstream o;
  o << "file        " << path << "\n";
  o << "size        " << human(size) << "\n";
  try {
    std::byte region[kHeaderRegionBytes] = {};
    const size_t head = size_t(std::min<uint64_t>(size, kHeaderRegionBytes));
    if (head) src.read(0, head, region);
    const Headers h = parse_headers(std::span<const std::byte>(region, head), size, path);
    for (int s = 0; s < 2; ++s) {
      const HeaderSlot& slot = h.slot[s];
      o << "header " << s << "    ";
      if (slot.valid)
        o << "generation " << slot.generation << ", " << slot.record_count << " records, index at ["
          << slot.index_offset << ", " << slot.index_offset + slot.index_length << ")"
          << (s == h.current ? "  <- current" : "") << "\n";
      else
        o << "invalid: " << slot.problem << "\n";
    }
    Headers settled;
    const Index ix = open_index(src, /*recover=*/true, &settled);
    if (settled.damaged >= 0 && settled.fallback)
      o << "damaged     " << fallback_message(settled, "") << "; readers refuse the file unless "
        << "opened with recover=True, which reads generation " << ix.generation() << " (below)\n";
    else if (settled.damaged >= 0)
      o << "note        header slot " << settled.damaged << " is damaged but held an older commit "
        << "than generation " << ix.generation() << ": nothing is lost, and the next commit "
        << "rewrites that slot\n";
    o << "version     " << ix.header().version << "\n";
    o << "generation  " << ix.generation() << "\n";
    o << "records     " << ix.size() << "\n";
    std::map<Codec, std::pair<uint64_t, uint64_t>> by_codec;  // count, stored bytes
    std::vector<uint64_t> per_layout(ix.layouts().size());
    uint64_t stored = 0, raw = 0;
    for (uint64_t i = 0; i < ix.size(); ++i) {
      const RecordEntry e = ix.entry(i);
      by_codec[e.codec].first += 1;
      by_codec[e.codec].second += e.stored_length;
      stored += e.stored_length;
      raw += ix.layout(e.layout_id).raw_size;
      per_layout[e.layout_id] += 1;
    }
    o << "index       " << human(ix.header().index_length) << "\n";
    o << "data        " << human(stored) << " stored, " << human(raw) << " decoded\n";
    for (const auto& [codec, v] : by_codec)
      o << "  " << codec_name(codec) << std::string(10 - std::strlen(codec_name(codec)), ' ')
        << v.first << " records, " << human(v.second) << "\n";
    o << "layouts     " << ix.layouts().size() << "\n";
    o << "schema      (key: dtype shape, records holding it)\n";
    for (uint32_t k = 0; k < ix.keys().size(); ++k) {
      std::map<std::string, std::vector<std::vector<uint64_t>>> shapes_by_type;
      uint64_t records = 0;
      for (size_t l = 0; l < ix.layouts().size(); ++l)
        for (const Field& f : ix.layouts()[l].fields)
          if (f.key_id == k) {
            std::ostringstream type;
            type << dtype_name(f.dtype);
            if (dtype_size(f.dtype) == 0) type << f.itemsize;
            type << "/" << f.ndim;
            shapes_by_type[type.str()].emplace_back(f.shape, f.shape + f.ndim);
            records += per_layout[l];
          }
      o << "  " << ix.keys()[k] << ":";
      for (const auto& [type, shapes] : shapes_by_type)
        o << " " << type.substr(0, type.find('/')) << " " << shape_range(shapes);
      o << ", " << records << " records\n";
    }
  } catch (const std::exception& e) {
    o << "error       " << e.what() << "\n";
  }
  ::close(fd);
  return o.str();
}

}  // namespace tpf::store

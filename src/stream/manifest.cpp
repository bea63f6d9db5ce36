// Dataset manifests (FORMAT.md): read through any source, checked, their shards resolved. A remote
// manifest that fails its checks is read again: a byte flipped in transit turns a manifest into
// invalid JSON or breaks its manifest_sha256, and a later download comes right.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>
#include <thread>

#include "stream/sources.h"
#include "tpf/error.h"
#include "tpf/stream.h"

namespace tpf::stream {

namespace {

constexpr const char* kFormat = "tpfkit-manifest";
// The name manifests were written under before the package was renamed tpfkit (the seed paper's
// package holds "turbopairformer" on PyPI); still read, never written.
constexpr const char* kFormatBefore = "turbopairformer-manifest";
constexpr const char* kDigestKey = "\"manifest_sha256\"";
constexpr int kNewestVersion = 2;
constexpr size_t kDigestChars = 64;

// Where the 64 hex digits of manifest_sha256's value start in `text`; throws Error when the key
// is missing, appears twice or its value is not a string of 64 characters.
size_t digest_position(const std::string& text) {
  const size_t key = text.find(kDigestKey);
  if (key == std::string::npos) throw Error("has no manifest_sha256");
  if (text.find(kDigestKey, key + 1) != std::string::npos)
    throw Error("names manifest_sha256 more than once");
  size_t at = key + std::char_traits<char>::length(kDigestKey);
  auto skip_space = [&] {
    while (at < text.size() &&
           (text[at] == ' ' || text[at] == '\t' || text[at] == '\n' || text[at] == '\r'))
      ++at;
  };
  skip_space();
  if (at >= text.size() || text[at] != ':') throw Error("has a malformed manifest_sha256");
  ++at;
  skip_space();
  if (at >= text.size() || text[at] != '"' || at + 1 + kDigestChars >= text.size() ||
      text[at + 1 + kDigestChars] != '"')
    throw Error("has a manifest_sha256 that is not 64 hex digits");
  return at + 1;
}

uint64_t count_field(const nlohmann::json& shard, const char* key, size_t i) {
  const auto it = shard.find(key);
  if (it == shard.end()) return 0;
  if (!it->is_number_unsigned())
    throw Error(std::string("shards[") + std::to_string(i) + "]." + key +
                " is not a non-negative integer");
  return it->get<uint64_t>();
}

// The manifest's shards, or throws Error saying which check `text` failed.
Manifest parse(const std::string& location, std::string text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error("is not valid JSON");
  const std::string format = j.is_object() ? j.value("format", std::string()) : std::string();
  if (format != kFormat && format != kFormatBefore)
    throw Error(std::string("is not a JSON object with format = \"") + kFormat + "\"");
  const auto version = j.find("version");
  if (version == j.end() || !version->is_number_unsigned() || version->get<uint64_t>() < 1 ||
      version->get<uint64_t>() > kNewestVersion)
    throw Error("has a version this reader does not know (it reads 1 to " +
                std::to_string(kNewestVersion) + ")");
  Manifest m;
  m.location = location;
  const auto digest = j.find("manifest_sha256");
  if (digest != j.end() || version->get<uint64_t>() >= 2) {
    if (digest == j.end() || !digest->is_string()) throw Error("has no manifest_sha256");
    const std::string expected = digest->get<std::string>();
    const std::string actual = manifest_digest(text);
    if (actual != expected)
      throw Error("does not match its manifest_sha256 (" + expected + "; its bytes hash to " +
                  actual + ")");
    m.verified = true;
  }
  const auto shards = j.find("shards");
  if (shards == j.end() || !shards->is_array() || shards->empty())
    throw Error("has no non-empty list 'shards'");
  for (size_t i = 0; i < shards->size(); ++i) {
    const nlohmann::json& s = (*shards)[i];
    if (!s.is_object()) throw Error("shards[" + std::to_string(i) + "] is not an object");
    std::string name;
    for (const char* key : {"url", "path"}) {
      const auto it = s.find(key);
      if (it != s.end() && it->is_string() && !it->get<std::string>().empty()) {
        name = it->get<std::string>();
        break;
      }
    }
    if (name.empty()) throw Error("shards[" + std::to_string(i) + "] has neither 'url' nor 'path'");
    m.shards.push_back({resolve_location(location, name), count_field(s, "records", i),
                        count_field(s, "bytes", i), count_field(s, "generation", i)});
  }
  m.text = std::move(text);
  return m;
}

}  // namespace

bool is_manifest(const std::string& location) {
  return location.size() >= 5 && location.compare(location.size() - 5, 5, ".json") == 0;
}

std::string manifest_digest(std::string text) {
  const size_t at = digest_position(text);
  std::fill_n(text.begin() + std::ptrdiff_t(at), kDigestChars, '0');
  return sha256_hex_of(text);
}

Manifest read_manifest(const std::string& location, const SourceOptions& options) {
  // A local file reads the same bytes every time: one read. A remote one is read again after a
  // failed check, as a failed request would be.
  const int attempts = is_remote(location) ? std::max(1, options.max_attempts) : 1;
  std::mt19937_64 rng(std::random_device{}());
  std::string problem;
  for (int attempt = 1;; ++attempt) {
    std::string text;
    {
      SourceOptions o = options;
      o.expected_size = 0;
      const auto source = open_source(location, o);
      text.resize(size_t(source->size()));
      source->read(0, text.size(), text.data());
    }
    try {
      Manifest m = parse(location, std::move(text));
      m.downloads = attempt;
      return m;
    } catch (const Error& e) {
      problem = e.what();
    }
    if (attempt >= attempts) break;
    const double cap = std::min(options.backoff_max_s,
                                options.backoff_base_s * double(1ull << std::min(attempt - 1, 30)));
    std::this_thread::sleep_for(
        std::chrono::duration<double>(std::uniform_real_distribution<double>(0.5 * cap, cap)(rng)));
  }
  throw Error("manifest '" + location + "' " + problem +
              (attempts > 1 ? " (checked on each of " + std::to_string(attempts) + " downloads)"
                            : std::string()));
}

}  // namespace tpf::stream

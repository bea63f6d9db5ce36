// AWS Signature Version 4 for S3 GET/HEAD requests, with OpenSSL's SHA-256 and HMAC.
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cctype>

#include "stream/sources.h"
#include "tpf/error.h"

namespace tpf::stream {

namespace {

std::string hex(const unsigned char* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[data[i] >> 4];
    out[2 * i + 1] = digits[data[i] & 15];
  }
  return out;
}

std::string sha256_hex(const std::string& s) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(), digest);
  return hex(digest, sizeof digest);
}

std::string hmac(const std::string& key, const std::string& msg) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len))
    throw RuntimeError("HMAC-SHA256 failed in OpenSSL while signing an S3 request");
  return std::string(reinterpret_cast<char*>(out), len);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

std::string sha256_hex_of(const std::string& bytes) { return sha256_hex(bytes); }

std::string uri_encode_path(const std::string& key) {
  static const char* digits = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || c == '/') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += digits[c >> 4];
      out += digits[c & 15];
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> sigv4_headers(
    const AwsCredentials& creds, const std::string& method, const std::string& host,
    const std::string& path, const std::vector<std::pair<std::string, std::string>>& headers,
    const std::string& amz_date) {
  TPF_CHECK(amz_date.size() == 16, "amz_date: expected YYYYMMDDTHHMMSSZ, got '" + amz_date + "'");
  const std::string payload_hash = sha256_hex("");
  std::vector<std::pair<std::string, std::string>> added = {{"x-amz-content-sha256", payload_hash},
                                                            {"x-amz-date", amz_date}};
  if (!creds.session_token.empty()) added.push_back({"x-amz-security-token", creds.session_token});

  std::vector<std::pair<std::string, std::string>> canon = {{"host", host}};
  for (const auto& [k, v] : headers) canon.push_back({lower(k), trim(v)});
  for (const auto& [k, v] : added) canon.push_back({k, v});
  std::sort(canon.begin(), canon.end());

  std::string canonical_headers, signed_headers;
  for (const auto& [k, v] : canon) {
    canonical_headers += k + ":" + v + "\n";
    signed_headers += (signed_headers.empty() ? "" : ";") + k;
  }
  const std::string canonical_request = method + "\n" + (path.empty() ? "/" : path) + "\n" + "\n" +
                                        canonical_headers + "\n" + signed_headers + "\n" +
                                        payload_hash;
  const std::string date = amz_date.substr(0, 8);
  const std::string scope = date + "/" + creds.region + "/s3/aws4_request";
  const std::string string_to_sign =
      "AWS4-HMAC-SHA256\n" + amz_date + "\n" + scope + "\n" + sha256_hex(canonical_request);
  std::string key = hmac("AWS4" + creds.secret_key, date);
  key = hmac(key, creds.region);
  key = hmac(key, "s3");
  key = hmac(key, "aws4_request");
  const std::string sig = hmac(key, string_to_sign);
  added.push_back(
      {"Authorization", "AWS4-HMAC-SHA256 Credential=" + creds.access_key + "/" + scope +
                            ",SignedHeaders=" + signed_headers + ",Signature=" +
                            hex(reinterpret_cast<const unsigned char*>(sig.data()), sig.size())});
  return added;
}

}  // namespace tpf::stream

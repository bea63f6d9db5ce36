// Internal: the source constructors behind tpf::stream::open_source, and SigV4 signing (exposed so
// the tests can check it against AWS's published example).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tpf/stream.h"

namespace tpf::stream {

// Throws tpf::Error when [offset, offset + length) does not lie inside the source.
void check_range(const ByteSource& source, uint64_t offset, size_t length);

std::unique_ptr<CancellableSource> open_file_source(const std::string& path);
std::unique_ptr<CancellableSource> open_http_source(const std::string& url,
                                                    const SourceOptions& options);
std::unique_ptr<CancellableSource> open_s3_source(const std::string& url,
                                                  const SourceOptions& options);

struct AwsCredentials {
  std::string access_key, secret_key, session_token, region;
};

// The headers that sign one S3 request with AWS Signature Version 4 (a body-less request):
// x-amz-date, x-amz-content-sha256, x-amz-security-token (when there is one) and Authorization.
// `headers` are the other headers to sign (e.g. Range), as (name, value); `amz_date` is
// YYYYMMDDTHHMMSSZ. `path` is the URI path, already percent-encoded.
std::vector<std::pair<std::string, std::string>> sigv4_headers(
    const AwsCredentials& creds, const std::string& method, const std::string& host,
    const std::string& path, const std::vector<std::pair<std::string, std::string>>& headers,
    const std::string& amz_date);

// SHA-256 of `bytes`, as 64 lower-case hex digits.
std::string sha256_hex_of(const std::string& bytes);

// Percent-encodes an S3 key for a URI path (RFC 3986 unreserved characters and '/' stay).
std::string uri_encode_path(const std::string& key);

}  // namespace tpf::stream

// Helpers shared by the file tier's unit tests (not part of the library).
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "cascade/block_id.h"
#include "cascade/config.h"
#include "cascade/env.h"
#include "tiers/file/store_key.h"

namespace cascade::file_test {

// A fresh directory under $CASCADE_TEST_TMP (or /tmp), removed at the end.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("CASCADE_TEST_TMP");
    std::string root = base && *base ? base : "/tmp";
    std::filesystem::create_directories(root);
    std::string pattern = root + "/cascade-file-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    char* made = ::mkdtemp(buf.data());
    path_ = made ? made : root + "/cascade-file-fallback";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline BlockId id_of(uint64_t n) {
  BlockId id;
  for (int i = 0; i < 8; ++i) id.bytes[i] = static_cast<uint8_t>(n >> (8 * i));
  id.bytes[15] = 0xf1;
  return id;
}

// Deterministic bytes for block n.
inline std::vector<uint8_t> bytes_of(uint64_t n, size_t size) {
  std::vector<uint8_t> v(size);
  std::mt19937_64 rng(n * 7919 + size);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < size; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

inline CascadeConfig file_config(const std::string& dir) {
  CascadeConfig c;
  c.pipeline = "file";
  c.file_path = dir;
  c.segment_size_bytes = 1 << 20;
  c.index_shards = 16;
  return c;
}

// Names of the segment files (seg-*.dat) in dir, sorted.
inline std::vector<std::string> segment_files(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& e : std::filesystem::directory_iterator(dir)) {
    std::string n = e.path().filename().string();
    if (n.size() == 24 && n.rfind("seg-", 0) == 0 && n.substr(20) == ".dat")
      out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The key of a file-tier directory (its KEY file).
inline file::RecordKey dir_key(const std::string& dir, Env* env = Env::Default()) {
  auto key = file::load_store_key(env, dir, 0600, /*create=*/false, /*check_owner=*/false);
  return key.ok() ? key.value() : file::RecordKey();
}

inline void flip_bit(const std::string& path, uint64_t offset, int bit) {
  FILE* f = std::fopen(path.c_str(), "r+b");
  std::fseek(f, static_cast<long>(offset), SEEK_SET);
  int c = std::fgetc(f);
  std::fseek(f, static_cast<long>(offset), SEEK_SET);
  std::fputc(c ^ (1 << bit), f);
  std::fclose(f);
}

}  // namespace cascade::file_test

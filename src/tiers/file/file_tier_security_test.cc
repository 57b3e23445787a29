// FileTier against a hostile neighbourhood: owner-only modes, the key file
// and its refusals, records and summaries planted by someone without the key,
// format 1 segments, and errno mapped to the right codes.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <filesystem>

#include "cascade/file_tier.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"
#include "tiers/file/segment_scan.h"

namespace cascade {
namespace {

using file_test::bytes_of;
using file_test::id_of;
using file_test::TempDir;

uint32_t mode_of(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 0777;
}

Status put(Tier* t, uint64_t n, size_t size) {
  auto data = bytes_of(n, size);
  return t->put(id_of(n), data.data(), size, PutOptions{});
}

bool reads_back(Tier* t, uint64_t n, size_t size) {
  std::vector<uint8_t> out(size + 1);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  if (!t->read(id_of(n), req, &r).ok() || r.block_size != size) return false;
  return std::memcmp(out.data(), bytes_of(n, size).data(), size) == 0;
}

// Every file in dir (and dir itself) has the expected mode.
void expect_modes(const std::string& dir, uint32_t dir_mode, uint32_t file_mode) {
  EXPECT_EQ(mode_of(dir), dir_mode) << dir;
  size_t files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(mode_of(e.path().string()), file_mode) << e.path();
    ++files;
  }
  EXPECT_GE(files, 4u);  // LOCK, KEY, a segment and its summary at least
}

class UmaskGuard {
 public:
  explicit UmaskGuard(mode_t m) : old_(::umask(m)) {}
  ~UmaskGuard() { ::umask(old_); }

 private:
  mode_t old_;
};

TEST(FileTierSecurityTest, OwnerOnlyModesByDefault) {
  UmaskGuard umask(022);
  TempDir tmp;
  auto c = file_test::file_config(tmp.sub("tier"));
  c.segment_size_bytes = 64 << 10;
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (uint64_t i = 0; i < 40; ++i)
      ASSERT_TRUE(put(t->get(), i, 5000).ok());  // several sealed segments
  }
  expect_modes(c.file_path, 0700, 0600);
  // A directory that exists keeps its mode; the files still get file_mode.
  ASSERT_EQ(::mkdir(tmp.sub("open").c_str(), 0755), 0);
  c.file_path = tmp.sub("open");
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    for (uint64_t i = 0; i < 20; ++i) ASSERT_TRUE(put(t->get(), i, 5000).ok());
  }
  expect_modes(c.file_path, 0755, 0600);
}

TEST(FileTierSecurityTest, FileModeSharesWithTheGroup) {
  UmaskGuard umask(077);  // would narrow 0640 to 0600
  TempDir tmp;
  auto c = file_test::file_config(tmp.sub("a/tier"));
  c.segment_size_bytes = 64 << 10;
  c.file_mode = 0640;
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (uint64_t i = 0; i < 40; ++i) ASSERT_TRUE(put(t->get(), i, 5000).ok());
  }
  expect_modes(c.file_path, 0750, 0640);
  c.file_mode = 0400;
  EXPECT_TRUE(FileTier::Open(c, nullptr).status().is(Code::kInvalidArgument));
}

TEST(FileTierSecurityTest, KeyIsCreatedOnceAndRefusedWhenNotOurs) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.sub("tier"));
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(put(t->get(), 1, 3000).ok());
  }
  const std::string key = c.file_path + "/KEY";
  ASSERT_EQ(std::filesystem::file_size(key), 32u);
  auto first = file_test::dir_key(c.file_path);
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    EXPECT_TRUE(reads_back(t->get(), 1, 3000));  // the same key read back
  }
  EXPECT_EQ(
      std::memcmp(first.secret(), file_test::dir_key(c.file_path).secret(), file::kKeySecretBytes),
      0);

  auto refused = [&](const char* why) {
    auto t = FileTier::Open(c, nullptr);
    EXPECT_FALSE(t.ok()) << why;
    if (!t.ok()) {
      EXPECT_NE(t.status().message().find("KEY"), std::string::npos) << t.status().ToString();
    }
  };
  // Open to others beyond file_mode.
  ASSERT_EQ(::chmod(key.c_str(), 0644), 0);
  refused("mode 0644");
  ASSERT_EQ(::chmod(key.c_str(), 0600), 0);
  // Owned by another user (we run as root in CI; skip where chown is refused).
  if (::chown(key.c_str(), 12345, 12345) == 0) {
    refused("owned by another user");
    ASSERT_EQ(::chown(key.c_str(), ::geteuid(), ::getegid()), 0);
  }
  // A symbolic link to a key file elsewhere.
  std::filesystem::copy_file(key, tmp.sub("elsewhere"));
  ::chmod(tmp.sub("elsewhere").c_str(), 0600);
  std::filesystem::rename(key, tmp.sub("real-key"));
  ASSERT_EQ(::symlink(tmp.sub("elsewhere").c_str(), key.c_str()), 0);
  refused("a symbolic link");
  std::filesystem::remove(key);
  // Not a key at all.
  {
    FILE* f = std::fopen(key.c_str(), "wb");
    std::fputs("short", f);
    std::fclose(f);
  }
  ::chmod(key.c_str(), 0600);
  refused("5 bytes");
  std::filesystem::rename(tmp.sub("real-key"), key);
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(reads_back(t->get(), 1, 3000));
}

// The v1 (unkeyed) header of a record at (segment, offset), as the format 1
// tier wrote it: anyone could compute it.
file::RecordHeader legacy_v1_header(const BlockId& id, const uint8_t* payload, uint64_t n,
                                    uint64_t segment_id, uint64_t offset) {
  file::RecordHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = file::kRecordMagic;
  h.format_version = 1;
  std::memcpy(h.block_id, id.bytes.data(), 16);
  h.payload_length = n;
  h.payload_xxh3 = XXH3_64bits(payload, n);
  h.sequence = segment_id;  // format 1 kept the segment id in this field
  h.record_offset = offset;
  uint64_t place[2] = {segment_id, offset};
  uint64_t seed = XXH3_64bits(place, sizeof(place)) ^ 0x6361736361646531ull;
  h.header_xxh3 = XXH3_64bits_withSeed(&h, offsetof(file::RecordHeader, header_xxh3), seed);
  return h;
}

// A client controls a block's bytes and plants a record image for another
// id inside them, at the segment offset where it will land; then the real
// record's header page is lost and the segment has no summary (a crash
// before sealing). The planted record must not be served after reopen.
TEST(FileTierSecurityTest, RecordPlantedInABlockIsNotServedAfterReopen) {
  for (int variant = 0; variant < 2; ++variant) {
    TempDir tmp;
    auto c = file_test::file_config(tmp.path());
    const BlockId victim = id_of(777);
    std::vector<uint8_t> fake(100, 0xAB);
    std::vector<uint8_t> carrier = bytes_of(1, 64 << 10);
    const uint64_t planted_at =
        file::kPage + 8192;  // segment 1, payload byte 8192 of the first record
    {
      auto t = FileTier::Open(c, nullptr);
      ASSERT_TRUE(t.ok());
      file::RecordHeader h;
      if (variant == 0) {
        h = legacy_v1_header(victim, fake.data(), fake.size(), 1, planted_at);
      } else {  // even an image made with the directory's own key
        file::RecordKey key = file_test::dir_key(tmp.path());
        h = file::make_record_header(key, victim, fake.size(),
                                     file::payload_checksum(key, fake.data(), fake.size()), 0, 1000,
                                     1, planted_at);
      }
      std::memcpy(carrier.data() + 8192, &h, sizeof(h));
      std::memcpy(carrier.data() + 8192 + file::kRecordHeaderSize, fake.data(), fake.size());
      ASSERT_TRUE((*t)->put(id_of(1), carrier.data(), carrier.size(), PutOptions{}).ok());
      ASSERT_TRUE(put(t->get(), 2, 100).ok());
    }
    auto segs = file_test::segment_files(tmp.path());
    ASSERT_EQ(segs.size(), 1u);
    std::filesystem::remove(segs[0].substr(0, segs[0].size() - 4) + ".sum");
    {
      FILE* f = std::fopen(segs[0].c_str(), "r+b");
      std::vector<uint8_t> zeros(file::kPage, 0);
      std::fwrite(zeros.data(), 1, zeros.size(), f);
      std::fclose(f);
    }
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    EXPECT_FALSE((*t)->contains(victim)) << "variant " << variant;
    EXPECT_FALSE(reads_back(t->get(), 777, fake.size())) << "variant " << variant;
    EXPECT_GE((*t)->recovery_report().corrupt_records, 1u);  // the lost header page is damage
    // The segment was not deleted: its bytes are kept for inspection.
    EXPECT_TRUE(std::filesystem::exists(segs[0]));
  }
}

// A summary someone without the key wrote (listing a record for an id of
// their choice) is rejected; the segment is walked instead.
TEST(FileTierSecurityTest, PlantedSummaryIsNotTrusted) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(put(t->get(), 1, 10000).ok());
  }
  auto segs = file_test::segment_files(tmp.path());
  ASSERT_EQ(segs.size(), 1u);
  // The forger lists a record for id 777 at offset 0 with a key of its own.
  file::RecordKey forger;
  auto fake = file::make_record_header(forger, id_of(777), 10000, 0, 0, 1, 1, 0);
  ASSERT_TRUE(file::write_summary(Env::Default(), tmp.path(), 1, forger, {fake}, {},
                                  std::filesystem::file_size(segs[0]), true)
                  .ok());
  auto t = FileTier::Open(c, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->recovery_report().segments_scanned, 1u);
  EXPECT_FALSE((*t)->contains(id_of(777)));
  EXPECT_TRUE(reads_back(t->get(), 1, 10000));
}

// Segments of format 1 (no key) are foreign: not served, not deleted,
// counted on open and reported by inspect_directory.
TEST(FileTierSecurityTest, FormatOneSegmentsAreLeftAlone) {
  TempDir tmp;
  auto payload = bytes_of(5, 3000);
  std::vector<uint8_t> image(file::kPage, 0);
  auto h = legacy_v1_header(id_of(5), payload.data(), payload.size(), 3, 0);
  std::memcpy(image.data(), &h, sizeof(h));
  std::memcpy(image.data() + file::kRecordHeaderSize, payload.data(), payload.size());
  std::filesystem::create_directories(tmp.path());
  const std::string old_seg = tmp.sub(file::segment_file_name(3));
  {
    FILE* f = std::fopen(old_seg.c_str(), "wb");
    std::fwrite(image.data(), 1, image.size(), f);
    std::fclose(f);
  }
  auto c = file_test::file_config(tmp.path());
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ((*t)->recovery_report().foreign_segments, 1u);
    EXPECT_FALSE((*t)->contains(id_of(5)));
    ASSERT_TRUE(put(t->get(), 6, 100).ok());  // new segments do not collide with it
    EXPECT_TRUE(reads_back(t->get(), 6, 100));
  }
  EXPECT_TRUE(std::filesystem::exists(old_seg));
  EXPECT_EQ(std::filesystem::file_size(old_seg), file::kPage);
  auto report = inspect_directory(tmp.path(), true);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->foreign_segments, 1u);
  EXPECT_EQ(report->live_records, 1u);
  EXPECT_TRUE(report->ok());
  bool seen = false;
  for (const auto& s : report->segments)
    if (s.segment_id == 3) {
      seen = true;
      EXPECT_TRUE(s.foreign);
      EXPECT_EQ(s.format_version, 1);
    }
  EXPECT_TRUE(seen);
}

TEST(FileTierSecurityTest, InspectNeedsTheKey) {
  TempDir tmp;
  auto c = file_test::file_config(tmp.path());
  {
    auto t = FileTier::Open(c, nullptr);
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(put(t->get(), 1, 100).ok());
  }
  ASSERT_TRUE(inspect_directory(tmp.path(), true).ok());
  std::filesystem::rename(tmp.sub("KEY"), tmp.sub("key-away"));
  auto r = inspect_directory(tmp.path(), true);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("KEY"), std::string::npos) << r.status().ToString();
  std::filesystem::rename(tmp.sub("key-away"), tmp.sub("KEY"));
  EXPECT_TRUE(inspect_directory(tmp.sub("nope"), false).status().is(Code::kNotFound));
}

// EROFS, EACCES, EPERM and a missing file are I/O errors, not bad arguments
// and not "block not found".
TEST(FileTierSecurityTest, FileSystemErrorsAreIOErrors) {
  TempDir tmp;
  FaultInjectingEnv env(Env::Default());
  env.set_read_only(true);
  auto t = FileTier::Open(file_test::file_config(tmp.sub("ro")), nullptr, &env);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(t.status().is(Code::kIOError)) << t.status().ToString();
  ASSERT_TRUE(Env::Default()->create_dirs(tmp.sub("ro")).ok());
  t = FileTier::Open(file_test::file_config(tmp.sub("ro")), nullptr, &env);
  ASSERT_FALSE(t.ok());
  EXPECT_TRUE(t.status().is(Code::kIOError)) << t.status().ToString();
  FileOpenOptions ro;
  EXPECT_TRUE(Env::Default()->open(tmp.sub("missing"), ro).status().is(Code::kIOError));
  EXPECT_TRUE(Env::Default()->unlink(tmp.sub("missing")).is(Code::kIOError));
  EXPECT_TRUE(Env::Default()->stat(tmp.sub("missing")).status().is(Code::kNotFound));
  // A directory path that runs through a file.
  FileOpenOptions w;
  w.write = w.create = true;
  ASSERT_TRUE(Env::Default()->open(tmp.sub("plain"), w).ok());
  EXPECT_TRUE(Env::Default()->open(tmp.sub("plain/x"), ro).status().is(Code::kIOError));
  // Puts on a store whose file system turned read-only fail as I/O errors.
  FaultInjectingEnv later(Env::Default());
  auto c = file_test::file_config(tmp.sub("rw"));
  auto tier = FileTier::Open(c, nullptr, &later);
  ASSERT_TRUE(tier.ok());
  later.set_read_only(true);
  Status st = put(tier->get(), 1, 100);
  EXPECT_TRUE(st.is(Code::kIOError)) << st.ToString();
}

}  // namespace
}  // namespace cascade

// Env: the POSIX and memory Envs behave alike; faults fire when armed.
#include "cascade/env.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "tiers/file/file_test_util.h"

namespace cascade {
namespace {

void exercise(Env* env, const std::string& dir) {
  ASSERT_TRUE(env->create_dirs(dir + "/a/b").ok());
  ASSERT_TRUE(env->create_dirs(dir + "/a/b").ok());  // exists: fine
  FileOpenOptions o;
  o.write = o.create = true;
  auto f = env->open(dir + "/a/b/x", o);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const char msg[] = "hello, segment";
  ASSERT_TRUE((*f)->pwrite(msg, sizeof(msg), 100).ok());
  EXPECT_EQ(*(*f)->size(), 100 + sizeof(msg));
  char buf[64] = {};
  auto got = (*f)->pread(buf, sizeof(buf), 100);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, sizeof(msg));  // short at end of file
  EXPECT_STREQ(buf, msg);
  char a[4], b[5];
  struct iovec iov[2] = {{a, 4}, {b, 5}};
  got = (*f)->preadv(iov, 2, 100);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 9u);
  EXPECT_EQ(std::memcmp(a, "hell", 4), 0);
  EXPECT_EQ(std::memcmp(b, "o, se", 5), 0);
  EXPECT_TRUE((*f)->sync().ok());
  EXPECT_TRUE((*f)->truncate(50).ok());
  EXPECT_EQ(*(*f)->size(), 50u);
  EXPECT_EQ(*env->file_size(dir + "/a/b/x"), 50u);
  ASSERT_TRUE(env->rename(dir + "/a/b/x", dir + "/a/b/y").ok());
  EXPECT_FALSE(env->file_exists(dir + "/a/b/x"));
  auto names = env->list_dir(dir + "/a/b");
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, std::vector<std::string>{"y"});
  EXPECT_TRUE(env->sync_dir(dir + "/a/b").ok());
  ASSERT_TRUE(env->unlink(dir + "/a/b/y").ok());
  // A missing file is an I/O error for file operations; stat() answers
  // "does it exist" with NotFound.
  EXPECT_TRUE(env->unlink(dir + "/a/b/y").is(Code::kIOError));
  EXPECT_TRUE(env->stat(dir + "/a/b/y").status().is(Code::kNotFound));
  EXPECT_TRUE(env->file_size(dir + "/a/b/y").status().is(Code::kIOError));
  auto d = env->stat(dir + "/a/b");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->type, FileInfo::Type::kDirectory);
  // An unlinked file stays readable through its open handle.
  got = (*f)->pread(buf, 10, 0);
  EXPECT_TRUE(got.ok());
  FileOpenOptions ro;
  EXPECT_TRUE(env->open(dir + "/missing", ro).status().is(Code::kIOError));
  o.exclusive = true;
  auto g = env->open(dir + "/a/new", o);
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(env->open(dir + "/a/new", o).ok());
  // Locks: a second holder is refused with Busy until the first lets go.
  auto l1 = env->lock_file(dir + "/LOCK");
  ASSERT_TRUE(l1.ok());
  auto l2 = env->lock_file(dir + "/LOCK");
  EXPECT_TRUE(l2.status().is(Code::kBusy)) << l2.status().ToString();
  l1->reset();
  EXPECT_TRUE(env->lock_file(dir + "/LOCK").ok());
  EXPECT_TRUE(env->space(dir).ok());
}

// Created files and directories get exactly the mode asked for, whatever
// the umask; existing ones keep theirs.
void check_modes(Env* env, const std::string& dir) {
  ASSERT_TRUE(env->create_dirs(dir + "/m", 0750).ok());
  auto d = env->stat(dir + "/m");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->mode, 0750u);
  ASSERT_TRUE(env->create_dirs(dir + "/m", 0700).ok());
  EXPECT_EQ(env->stat(dir + "/m")->mode, 0750u);
  FileOpenOptions o;
  o.write = o.create = true;
  o.mode = 0640;
  auto f = env->open(dir + "/m/f", o);
  ASSERT_TRUE(f.ok());
  auto info = (*f)->info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->mode, 0640u);
  EXPECT_EQ(info->type, FileInfo::Type::kRegular);
  o.mode = 0600;
  ASSERT_TRUE(env->open(dir + "/m/f", o).ok());  // exists: mode unchanged
  EXPECT_EQ(env->stat(dir + "/m/f")->mode, 0640u);
  auto lock = env->lock_file(dir + "/m/LOCK", 0600);
  ASSERT_TRUE(lock.ok());
  EXPECT_EQ(env->stat(dir + "/m/LOCK")->mode, 0600u);
}

TEST(EnvTest, ModesIgnoreTheUmask) {
  mode_t old = ::umask(022);
  file_test::TempDir tmp;
  check_modes(Env::Default(), tmp.path());
  ::umask(077);
  check_modes(Env::Default(), tmp.sub("narrow"));
  ::umask(old);
  auto mem = NewMemoryEnv();
  check_modes(mem.get(), "/mem");
}

TEST(EnvTest, NoFollowRefusesSymlinks) {
  file_test::TempDir tmp;
  FileOpenOptions o;
  o.write = o.create = true;
  ASSERT_TRUE(Env::Default()->open(tmp.sub("real"), o).ok());
  ASSERT_EQ(::symlink(tmp.sub("real").c_str(), tmp.sub("link").c_str()), 0);
  FileOpenOptions nf;
  nf.no_follow = true;
  auto f = Env::Default()->open(tmp.sub("link"), nf);
  EXPECT_TRUE(f.status().is(Code::kIOError)) << f.status().ToString();
  EXPECT_EQ(Env::Default()->stat(tmp.sub("link"))->type, FileInfo::Type::kSymlink);
  EXPECT_TRUE(Env::Default()->open(tmp.sub("link"), FileOpenOptions{}).ok());
}

TEST(EnvTest, AFifoOrADirectoryIsRefusedAtOnce) {
  // A FIFO where a file tier expects a segment (or its key, or its epoch):
  // before, the open waited for a writer for ever, and a server stopped
  // with SIGTERM never ran its handler.
  file_test::TempDir tmp;
  ASSERT_EQ(::mkfifo(tmp.sub("fifo").c_str(), 0600), 0);
  ASSERT_EQ(::mkdir(tmp.sub("dir").c_str(), 0700), 0);
  for (const char* name : {"fifo", "dir"}) {
    for (bool write : {false, true}) {
      FileOpenOptions o;
      o.write = write;
      const auto t0 = std::chrono::steady_clock::now();
      auto f = Env::Default()->open(tmp.sub(name), o);
      EXPECT_FALSE(f.ok()) << name;
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << name;
    }
  }
  auto fifo = Env::Default()->open(tmp.sub("fifo"), FileOpenOptions{});
  EXPECT_NE(fifo.status().message().find("not a regular file"), std::string::npos)
      << fifo.status().ToString();
}

TEST(EnvTest, PunchHoleGivesSpaceBack) {
  auto check = [](Env* env, const std::string& dir, bool counts) {
    ASSERT_TRUE(env->create_dirs(dir).ok());
    FileOpenOptions o;
    o.write = o.create = true;
    auto f = env->open(dir + "/p", o);
    ASSERT_TRUE(f.ok());
    std::vector<uint8_t> data(64 << 10, 0x5a);
    ASSERT_TRUE((*f)->pwrite(data.data(), data.size(), 0).ok());
    uint64_t before = env->space(dir)->free_bytes;
    Status st = (*f)->punch_hole(4096, 32 << 10);
    if (st.is(Code::kNotSupported)) return;
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(*(*f)->size(), data.size());  // the size is kept
    std::vector<uint8_t> back(data.size());
    ASSERT_EQ(*(*f)->pread(back.data(), back.size(), 0), back.size());
    for (size_t i = 0; i < back.size(); ++i) {
      bool hole = i >= 4096 && i < 4096 + (32 << 10);
      ASSERT_EQ(back[i], hole ? 0 : 0x5a) << i;
    }
    if (counts) {
      EXPECT_EQ(env->space(dir)->free_bytes, before + (32 << 10));
    }
  };
  file_test::TempDir tmp;
  check(Env::Default(), tmp.path(), false);
  auto mem = NewMemoryEnv(1 << 20);
  check(mem.get(), "/d", true);
}

TEST(EnvTest, MemoryEnvCapacityFailsWritesWithNoSpace) {
  auto env = NewMemoryEnv(16 << 10);  // four pages
  ASSERT_TRUE(env->create_dirs("/d").ok());
  FileOpenOptions o;
  o.write = o.create = true;
  auto f = env->open("/d/f", o);
  std::vector<uint8_t> data(12 << 10, 1);
  ASSERT_TRUE((*f)->pwrite(data.data(), data.size(), 0).ok());
  Status st = (*f)->pwrite(data.data(), data.size(), data.size());
  EXPECT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_EQ(*(*f)->size(), 16u << 10);  // what fits was written
  EXPECT_EQ(env->space("/d")->free_bytes, 0u);
  ASSERT_TRUE((*f)->truncate(4096).ok());
  EXPECT_EQ(env->space("/d")->free_bytes, 12u << 10);
  auto g = env->open("/d/g", o);
  ASSERT_TRUE((*g)->pwrite(data.data(), data.size(), 0).ok());
  ASSERT_TRUE(env->unlink("/d/g").ok());
  EXPECT_EQ(env->space("/d")->free_bytes, 0u);  // still open
  g->reset();
  EXPECT_EQ(env->space("/d")->free_bytes, 12u << 10);
}

TEST(EnvTest, PosixEnv) {
  file_test::TempDir tmp;
  exercise(Env::Default(), tmp.path());
}

TEST(EnvTest, MemoryEnv) {
  auto env = NewMemoryEnv();
  exercise(env.get(), "/mem");
}

TEST(EnvTest, PosixDirectIoWithAlignedBuffers) {
  file_test::TempDir tmp;
  FileOpenOptions o;
  o.write = o.create = o.direct = true;
  auto f = Env::Default()->open(tmp.sub("d"), o);
  ASSERT_TRUE(f.ok());
  void* p = nullptr;
  ASSERT_EQ(posix_memalign(&p, 4096, 8192), 0);
  std::memset(p, 0x7e, 8192);
  ASSERT_TRUE((*f)->pwrite(p, 8192, 4096).ok());
  std::memset(p, 0, 8192);
  auto got = (*f)->pread(p, 8192, 4096);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, 8192u);
  EXPECT_EQ(static_cast<uint8_t*>(p)[8191], 0x7e);
  std::free(p);
}

TEST(EnvTest, FaultEnvNoSpaceAfterBytes) {
  auto mem = NewMemoryEnv();
  FaultInjectingEnv env(mem.get());
  ASSERT_TRUE(env.create_dirs("/d").ok());
  FileOpenOptions o;
  o.write = o.create = true;
  auto f = env.open("/d/f", o);
  ASSERT_TRUE(f.ok());
  std::vector<uint8_t> data(1000, 1);
  env.fail_writes_after(2500);
  EXPECT_TRUE((*f)->pwrite(data.data(), 1000, 0).ok());
  EXPECT_TRUE((*f)->pwrite(data.data(), 1000, 1000).ok());
  Status st = (*f)->pwrite(data.data(), 1000, 2000);
  EXPECT_TRUE(st.is(Code::kNoSpace)) << st.ToString();
  EXPECT_EQ(*(*f)->size(), 2500u);  // the part that fit was written
  EXPECT_TRUE((*f)->pwrite(data.data(), 1, 0).is(Code::kNoSpace));
  env.clear_faults();
  EXPECT_TRUE((*f)->pwrite(data.data(), 1000, 2000).ok());
  EXPECT_GE(env.injected_faults(), 2u);
}

TEST(EnvTest, FaultEnvReadErrorsTornWritesReadOnly) {
  auto mem = NewMemoryEnv();
  FaultInjectingEnv env(mem.get());
  ASSERT_TRUE(env.create_dirs("/d").ok());
  FileOpenOptions o;
  o.write = o.create = true;
  auto f = env.open("/d/seg-1", o);
  ASSERT_TRUE(f.ok());
  std::vector<uint8_t> data(8192, 3);
  ASSERT_TRUE((*f)->pwrite(data.data(), data.size(), 0).ok());
  env.fail_reads("seg-1", 4096, 4097);
  std::vector<uint8_t> buf(4096);
  EXPECT_TRUE((*f)->pread(buf.data(), 4096, 0).ok());
  EXPECT_TRUE((*f)->pread(buf.data(), 4096, 4096).status().is(Code::kIOError));
  EXPECT_TRUE((*f)->pread(buf.data(), 4097, 0).status().is(Code::kIOError));
  env.clear_faults();
  EXPECT_TRUE((*f)->pread(buf.data(), 4096, 4096).ok());

  env.tear_next_write(100);
  std::vector<uint8_t> other(1000, 9);
  EXPECT_TRUE((*f)->pwrite(other.data(), 1000, 10000).is(Code::kIOError));
  EXPECT_EQ(*(*f)->size(), 10100u);
  EXPECT_TRUE((*f)->pwrite(other.data(), 1000, 10000).ok());  // one-shot

  env.set_read_only(true);
  EXPECT_FALSE(env.open("/d/new", o).ok());
  EXPECT_FALSE(env.lock_file("/d/LOCK").ok());
  EXPECT_FALSE(env.create_dirs("/d/sub").ok());
  EXPECT_TRUE(env.create_dirs("/d").ok());  // exists already
  FileOpenOptions ro;
  EXPECT_TRUE(env.open("/d/seg-1", ro).ok());
  env.set_read_only(false);
  env.fail_syncs(true);
  EXPECT_FALSE((*f)->sync().ok());
  EXPECT_FALSE(env.sync_dir("/d").ok());
}

}  // namespace
}  // namespace cascade

// Env: the POSIX and memory Envs behave alike; faults fire when armed.
#include "cascade/env.h"

#include <gtest/gtest.h>

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
  EXPECT_TRUE(env->unlink(dir + "/a/b/y").is(Code::kNotFound));
  // An unlinked file stays readable through its open handle.
  got = (*f)->pread(buf, 10, 0);
  EXPECT_TRUE(got.ok());
  FileOpenOptions ro;
  EXPECT_TRUE(env->open(dir + "/missing", ro).status().is(Code::kNotFound));
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

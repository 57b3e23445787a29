// Copies out of a file mapping cut short under them end as failures, not
// as the end of the process; a fault outside them is left as it was.
#include "util/sigbus_guard.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "util/block_checksum.h"
#include "util/thread_pool.h"

namespace cascade {
namespace {

constexpr size_t kPages = 64;

// A file of kPages pages mapped read-only, then cut to its first page.
class CutShort {
 public:
  CutShort() {
    path_ = "/dev/shm/cascade-sigbus-test-" + std::to_string(::getpid());
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    page_ = size_t(::sysconf(_SC_PAGESIZE));
    std::vector<uint8_t> bytes(kPages * page_);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 7);
    if (fd_ < 0 || ::pwrite(fd_, bytes.data(), bytes.size(), 0) != ssize_t(bytes.size())) return;
    void* m = ::mmap(nullptr, bytes.size(), PROT_READ, MAP_SHARED, fd_, 0);
    if (m == MAP_FAILED) return;
    map_ = static_cast<const uint8_t*>(m);
    first_.assign(bytes.begin(), bytes.begin() + page_);
    (void)!::ftruncate(fd_, off_t(page_));
    // The mapping and the descriptor hold the file: no name is left behind
    // by a test process a signal ends.
    ::unlink(path_.c_str());
  }
  ~CutShort() {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), kPages * page_);
    if (fd_ >= 0) ::close(fd_);
    ::unlink(path_.c_str());  // one set up only in part
  }
  const uint8_t* map() const { return map_; }
  size_t page() const { return page_; }
  const std::vector<uint8_t>& first() const { return first_; }

 private:
  std::string path_;
  int fd_ = -1;
  size_t page_ = 4096;
  const uint8_t* map_ = nullptr;
  std::vector<uint8_t> first_;
};

TEST(SigbusGuardTest, ACopyPastTheFilesEndFailsAndTheNextOneWorks) {
  CutShort f;
  ASSERT_NE(f.map(), nullptr);
  std::vector<uint8_t> out(kPages * f.page());
  for (int round = 0; round < 3; ++round) {  // the handler stays, SIGBUS unblocked
    EXPECT_FALSE(copy_out_of_mapping(out.data(), f.map(), out.size()));
    ASSERT_TRUE(copy_out_of_mapping(out.data(), f.map(), f.page()));
    EXPECT_EQ(0, std::memcmp(out.data(), f.first().data(), f.page()));
  }
}

TEST(SigbusGuardTest, ACheckedCopyOverThreadsFailsWhereverItsChunksFault) {
  CutShort f;
  ASSERT_NE(f.map(), nullptr);
  ThreadPool pool(4);
  std::vector<uint8_t> out(kPages * f.page());
  uint64_t sum = 7;
  EXPECT_FALSE(copy_out_of_mapping_with_checksum(out.data(), f.map(), out.size(), &sum, &pool, 0));
  EXPECT_EQ(sum, 7u);  // untouched
  ASSERT_TRUE(copy_out_of_mapping_with_checksum(out.data(), f.map(), f.page(), &sum, &pool, 0));
  EXPECT_EQ(sum, block_checksum(f.first().data(), f.page()));
}

TEST(SigbusGuardTest, AFaultOutsideAGuardedCopyStillEndsTheProcess) {
  CutShort f;
  ASSERT_NE(f.map(), nullptr);
  std::vector<uint8_t> out(f.page());
  ASSERT_TRUE(copy_out_of_mapping(out.data(), f.map(), f.page()));  // the handler is in
  const pid_t child = ::fork();
  if (child == 0) {
    volatile uint8_t x = f.map()[2 * f.page()];  // past the end, unguarded
    (void)x;
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // Ended by the fault: by SIGBUS itself, or as the handler there before
  // ends a process (a sanitizer's report, then abort).
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  if (WIFSIGNALED(status) && WTERMSIG(status) != SIGABRT) EXPECT_EQ(WTERMSIG(status), SIGBUS);
}

// A SIGBUS someone sends (kill) is not a fault of a copy: it ends the
// process as it would have without the guard. Run in a process of its own
// started with no SIGBUS handler before the guard's (a transport library
// linked in installs one at load unless told not to).
TEST(SigbusGuardTest, ASigbusSentIsNotTakenForAFault) {
  if (std::getenv("CASCADE_SIGBUS_SENT_CHILD")) {
    CutShort f;
    std::vector<uint8_t> out(kPages * f.page());
    if (!f.map() || copy_out_of_mapping(out.data(), f.map(), out.size())) ::_exit(3);
    ::kill(::getpid(), SIGBUS);
    ::_exit(0);  // only when the signal was swallowed
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::setenv("CASCADE_SIGBUS_SENT_CHILD", "1", 1);
    ::setenv("UCX_HANDLE_ERRORS", "none", 1);
    ::execl("/proc/self/exe", "/proc/self/exe",
            "--gtest_filter=SigbusGuardTest.ASigbusSentIsNotTakenForAFault", nullptr);
    ::_exit(127);
  }
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  // Ended by the signal (or, under a sanitizer whose handler came first,
  // by its report), not carried on past it.
  EXPECT_FALSE(WIFEXITED(status) &&
               (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 3 || WEXITSTATUS(status) == 127))
      << status;
  if (WIFSIGNALED(status) && WTERMSIG(status) != SIGABRT) EXPECT_EQ(WTERMSIG(status), SIGBUS);
}

}  // namespace
}  // namespace cascade

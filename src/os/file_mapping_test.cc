// map_file_read_only maps only the file it was told of, and the mapping
// outlives the file's name.
#include "os/file_mapping.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace cascade {
namespace {

std::string unique_path(const std::string& tag) {
  static int n = 0;
  return "/dev/shm/cascade-mapping-test-" + std::to_string(::getpid()) + "-" + tag + "-" +
         std::to_string(n++);
}

// A file of `pages` pages, page i filled with byte i + 1; fd stays open.
int make_file(const std::string& path, int pages) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  EXPECT_GE(fd, 0) << path;
  const long page = ::sysconf(_SC_PAGESIZE);
  for (int i = 0; i < pages; ++i) {
    std::vector<uint8_t> b(size_t(page), uint8_t(i + 1));
    EXPECT_EQ(::pwrite(fd, b.data(), b.size(), off_t(i) * page), ssize_t(page));
  }
  return fd;
}

TEST(FileMapping, BootIdIsStable) {
  const std::string a = boot_id();
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(a, boot_id());
}

TEST(FileMapping, MapsTheDescribedFileAndOutlivesItsName) {
  const std::string path = unique_path("ok");
  const int fd = make_file(path, 4);
  auto who = describe_open_file(fd);
  ASSERT_TRUE(who.ok()) << who.status().ToString();
  EXPECT_EQ(who->path, path);
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  auto m = map_file_read_only(path, who->device, who->inode, page, 2 * page);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->size(), 2 * page);
  EXPECT_EQ((*m)->data()[0], 2);
  EXPECT_EQ((*m)->data()[2 * page - 1], 3);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  // Removed: the open file has no name any more, and the mapping still reads it.
  auto gone = describe_open_file(fd);
  ASSERT_TRUE(gone.ok());
  EXPECT_TRUE(gone->path.empty());
  ::close(fd);
  EXPECT_EQ((*m)->data()[page], 3);
}

TEST(FileMapping, RefusesAnotherFileAtThePath) {
  const std::string path = unique_path("swap");
  const int fd = make_file(path, 2);
  auto who = describe_open_file(fd);
  ASSERT_TRUE(who.ok());
  ::close(fd);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ::close(make_file(path, 2));  // same name, another file
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  auto m = map_file_read_only(path, who->device, who->inode, 0, page);
  EXPECT_TRUE(m.status().is(Code::kInvalidArgument)) << m.status().ToString();
  ::unlink(path.c_str());
}

TEST(FileMapping, RefusesBadRangesLinksFifosAndMissingFiles) {
  const std::string path = unique_path("range");
  const int fd = make_file(path, 2);
  auto who = describe_open_file(fd);
  ASSERT_TRUE(who.ok());
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  EXPECT_TRUE(map_file_read_only(path, who->device, who->inode, 0, 3 * page)
                  .status()
                  .is(Code::kInvalidArgument));
  EXPECT_TRUE(map_file_read_only(path, who->device, who->inode, 100, page)
                  .status()
                  .is(Code::kInvalidArgument));
  EXPECT_TRUE(
      map_file_read_only(path, who->device, who->inode, 0, 0).status().is(Code::kInvalidArgument));
  const std::string link = unique_path("link");
  ASSERT_EQ(::symlink(path.c_str(), link.c_str()), 0);
  EXPECT_FALSE(map_file_read_only(link, who->device, who->inode, 0, page).ok());
  ::unlink(link.c_str());
  const std::string fifo = unique_path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  struct stat fst;
  ASSERT_EQ(::stat(fifo.c_str(), &fst), 0);
  EXPECT_TRUE(map_file_read_only(fifo, fst.st_dev, fst.st_ino, 0, page)
                  .status()
                  .is(Code::kInvalidArgument));  // refused without blocking on the fifo
  ::unlink(fifo.c_str());
  EXPECT_TRUE(map_file_read_only(unique_path("none"), who->device, who->inode, 0, page)
                  .status()
                  .is(Code::kNotFound));
  ::close(fd);
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace cascade

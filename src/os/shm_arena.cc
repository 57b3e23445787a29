#include "os/shm_arena.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <vector>

#include "cascade/config.h"
#include "util/errno_status.h"

namespace cascade {

// Declared in cascade/config.h (shm_path's default); defined here, beside
// the code that creates the file.
std::string default_shm_path() { return "/dev/shm/cascade-" + std::to_string(::geteuid()); }

namespace {

// The first bytes of the header page (docs/formats.md). Format version 1
// had the same first 40 bytes, with table_slots reserved (zero) and no more.
struct ArenaHeader {
  char magic[16];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t capacity;
  uint32_t creator_uid;
  uint32_t table_slots;  // 0: an ephemeral arena, no table
  uint64_t table_bytes;  // bytes between the header page and the usable arena
  uint8_t key[ShmArena::kKeyBytes];
};
static_assert(sizeof(ArenaHeader) == 80, "ArenaHeader is 80 bytes");

uint64_t table_region_bytes(uint64_t header, uint32_t slots) {
  if (slots == 0) return 0;
  const uint64_t end = header + uint64_t(slots) * ShmArena::kSlotBytes;
  return ((end + ShmArena::kTableAlign - 1) & ~(ShmArena::kTableAlign - 1)) - header;
}

Status random_key(uint8_t* key, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::getrandom(key + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, "random bytes for the arena's block table key");
    }
    got += size_t(r);
  }
  return Status::OK();
}

std::string human(uint64_t b) {
  char buf[64];
  if (b >= (1ULL << 30)) snprintf(buf, sizeof buf, "%.1f GiB", b / double(1ULL << 30));
  else snprintf(buf, sizeof buf, "%.1f MiB", b / double(1ULL << 20));
  return buf;
}

std::string type_name(mode_t m) {
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISFIFO(m)) return "a fifo";
  if (S_ISSOCK(m)) return "a socket";
  return "of an unknown type";
}

Status not_ours(const std::string& path, const std::string& why) {
  return Status::InvalidArgument("shm_path '" + path +
                                 "' exists and is not a Cascade arena of this user: " + why +
                                 "; it was left untouched: remove it or choose another shm_path");
}

// Why an existing file may not be adopted; empty when its metadata says it
// may (the header is checked once the file is locked).
std::string refusal(const struct stat& st, dev_t dir_dev) {
  if (S_ISLNK(st.st_mode)) return "it is a symbolic link";
  if (!S_ISREG(st.st_mode)) return "it is not a regular file but " + type_name(st.st_mode);
  if (st.st_uid != ::geteuid())
    return "it is owned by uid " + std::to_string(st.st_uid) + ", this process runs as uid " +
           std::to_string(::geteuid());
  if ((st.st_mode & 07777) != 0600) {
    char buf[64];
    snprintf(buf, sizeof buf, "it has mode %04o, an arena has mode 0600",
             unsigned(st.st_mode & 07777));
    return buf;
  }
  if (st.st_nlink != 1) return "it has " + std::to_string(st.st_nlink) + " links, an arena has one";
  if (st.st_dev != dir_dev) return "it is on another file system than its directory";
  return "";
}

// Whether the file at fd is one whose creation stopped before its header
// was written: empty (created, not sized yet), or sized to at least a page
// with zeros where the header goes. Anything else is someone's file.
bool half_made(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return false;
  if (st.st_size == 0) return true;
  if (st.st_size < 4096) return false;
  uint8_t head[sizeof(ArenaHeader)];
  if (::pread(fd, head, sizeof head, 0) != ssize_t(sizeof head)) return false;
  return std::all_of(head, head + sizeof head, [](uint8_t b) { return b == 0; });
}

// Why a locked existing file may not be adopted; empty when it may, with its
// header in *h (fields past a version 1 header are zero for one).
std::string header_refusal(int fd, ArenaHeader* out) {
  ArenaHeader h{};
  constexpr size_t kV1Bytes = 40;
  ssize_t n = ::pread(fd, &h, sizeof h, 0);
  if (n < ssize_t(kV1Bytes) || std::memcmp(h.magic, ShmArena::kMagic, sizeof h.magic) != 0)
    return "it has no Cascade arena header";
  if (h.version == 0 || h.version > ShmArena::kFormatVersion)
    return "its arena format version is " + std::to_string(h.version) + ", this build uses " +
           std::to_string(ShmArena::kFormatVersion);
  if (h.version < ShmArena::kFormatVersion) {  // an older arena: only its first 40 bytes count
    std::memset(reinterpret_cast<uint8_t*>(&h) + kV1Bytes, 0, sizeof h - kV1Bytes);
  } else if (n != ssize_t(sizeof h)) {
    return "it has no Cascade arena header";
  }
  *out = h;
  if (h.creator_uid != ::geteuid())
    return "its header names uid " + std::to_string(h.creator_uid) + " as its creator";
  return "";
}

// The pids of the processes that took the flock locks on file (dev, ino),
// as /proc/locks shows them (see in_initial_pid_namespace for the locks it
// leaves out); nullopt when the list cannot be read.
std::optional<std::vector<long>> flock_holders(dev_t dev, ino_t ino) {
  std::vector<long> pids;
  FILE* f = std::fopen("/proc/locks", "re");
  if (!f) return std::nullopt;
  char want[64];
  std::snprintf(want, sizeof want, "%02x:%02x:%lu", major(dev), minor(dev),
                static_cast<unsigned long>(ino));
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    // "1: FLOCK  ADVISORY  WRITE 2970 00:1b:106005 0 EOF"; waiters have "->".
    char kind[16], mode[16], access[16], file[64];
    long pid = 0;
    if (std::strstr(line, "->")) continue;
    const char* colon = std::strchr(line, ':');
    if (!colon ||
        std::sscanf(colon + 1, "%15s %15s %15s %ld %63s", kind, mode, access, &pid, file) != 5)
      continue;
    if (std::strcmp(kind, "FLOCK") == 0 && std::strcmp(file, want) == 0) pids.push_back(pid);
  }
  std::fclose(f);
  return pids;
}

// Whether this process lives in the initial pid namespace (the host's,
// whose inode number the kernel fixes). There /proc/locks lists every flock
// with its holder's pid, gone or not; in another namespace (a container's)
// it leaves out the locks of holders it cannot name: one that has exited,
// or one that lives outside this namespace.
bool in_initial_pid_namespace() {
  constexpr ino_t kInitialPidNamespace = 0xEFFFFFFCu;
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) != 0 || st.st_ino == kInitialPidNamespace;
}

// True when pid names no running process (gone, or a zombie not yet reaped).
bool process_gone(long pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  char path[64], state = 0;
  std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  FILE* f = std::fopen(path, "re");
  if (!f) return errno == ENOENT;
  // "pid (comm) S ...": the state follows the last ')'.
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  if (const char* close = std::strrchr(buf, ')')) state = close[1] == ' ' ? close[2] : 0;
  return state == 'Z' || state == 'X';
}

// Whether the running process `pid` has the file (dev, ino) open or
// mapped, as the taker of a flock on it does while it lives. /proc/locks
// names a lock's taker by pid, and a pid reused by another process since
// the taker died must not keep the file busy. The taker of an arena's lock
// was a process of the arena's owner, this effective uid: a process of
// another user at that pid is not it. Where its descriptors cannot be
// read, it is taken to have the file.
bool process_has_file(long pid, dev_t dev, ino_t ino) {
  char path[96];
  std::snprintf(path, sizeof path, "/proc/%ld", pid);
  struct stat ps {};
  if (::stat(path, &ps) != 0) return errno != ENOENT;
  if (ps.st_uid != ::geteuid() && ::geteuid() != 0) return false;
  std::snprintf(path, sizeof path, "/proc/%ld/fd", pid);
  DIR* d = ::opendir(path);
  if (!d) return errno != ENOENT;
  bool has = false;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    char link[160];
    std::snprintf(link, sizeof link, "%s/%s", path, e->d_name);
    struct stat fs {};
    if (::stat(link, &fs) == 0 && fs.st_dev == dev && fs.st_ino == ino) {
      has = true;
      break;
    }
  }
  ::closedir(d);
  if (has) return true;
  // A mapping keeps the lock's open file description too, after its
  // descriptor was closed: "start-end perms offset major:minor inode path".
  std::snprintf(path, sizeof path, "/proc/%ld/maps", pid);
  FILE* f = std::fopen(path, "re");
  if (!f) return errno != ENOENT;
  char line[4096];
  while (!has && std::fgets(line, sizeof line, f)) {
    unsigned maj = 0, min = 0;
    unsigned long long inode = 0;
    if (std::sscanf(line, "%*s %*s %*s %x:%x %llu", &maj, &min, &inode) == 3)
      has = inode == static_cast<unsigned long long>(ino) && ::makedev(maj, min) == dev;
    // A line longer than the buffer: skip the rest of it.
    while (!std::strchr(line, '\n') && std::fgets(line, sizeof line, f)) {
    }
  }
  std::fclose(f);
  return has;
}

enum class LockOutcome { kTaken, kHeld, kLeftInUse };

// Takes the flock on fd's file, or says why not: kHeld while a running
// process holds it; kLeftInUse when every process that took a lock on the
// file is gone and the lock is held on by descriptions they passed on or
// mappings that outlive them. A dead process's lock can also go a moment
// after its exit is reported, so the lock is tried again for a while before
// that answer.
LockOutcome take_lock(int fd, dev_t dev, ino_t ino, int* err) {
  *err = 0;
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return LockOutcome::kTaken;
  if (errno != EWOULDBLOCK) {
    *err = errno;
    return LockOutcome::kHeld;
  }
  const std::optional<std::vector<long>> listed = flock_holders(dev, ino);
  if (!listed) return LockOutcome::kHeld;
  const std::vector<long>& holders = *listed;
  // A lock that /proc/locks does not list: outside the initial pid
  // namespace its holder has exited, or lives where this namespace cannot
  // see it. A server restarted in a container finds its dead predecessor's
  // lock so (held on by clients that still map the arena), and takes it
  // for gone; a live holder of another namespace looks the same, which is
  // why a pool server first looks for a live server on its socket.
  const bool gone = holders.empty()
                        ? !in_initial_pid_namespace()
                        : std::all_of(holders.begin(), holders.end(), [&](long pid) {
                            return process_gone(pid) || !process_has_file(pid, dev, ino);
                          });
  if (!gone) return LockOutcome::kHeld;
  for (int i = 0; i < 50; ++i) {
    ::usleep(20000);
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return LockOutcome::kTaken;
  }
  return LockOutcome::kLeftInUse;
}

}  // namespace

// The marks' places: the header page, after the header.
constexpr off_t kBelowMarkOffset = sizeof(ArenaHeader);
constexpr off_t kPlaceMarkOffset = kBelowMarkOffset + sizeof(uint64_t);
constexpr off_t kKeptMarkOffset = kPlaceMarkOffset + sizeof(uint64_t);

uint64_t ShmArena::read_mark(off_t at) const {
  if (fd_ < 0 || !persistent()) return 0;
  uint64_t v = 0;
  if (::pread(fd_, &v, sizeof v, at) != ssize_t(sizeof v)) return 0;
  return v;
}

bool ShmArena::write_mark(off_t at, uint64_t value) {
  if (fd_ < 0 || !persistent()) return false;
  return ::pwrite(fd_, &value, sizeof value, at) == ssize_t(sizeof value);
}

void ShmArena::set_below_mark(uint64_t below) {
  if (below != 0) (void)write_mark(kBelowMarkOffset, below);
}

void ShmArena::set_place_mark(uint64_t place) { (void)write_mark(kPlaceMarkOffset, place); }

uint64_t ShmArena::place_mark() const { return read_mark(kPlaceMarkOffset); }

void ShmArena::set_kept_mark(uint64_t kept) { (void)write_mark(kKeptMarkOffset, kept); }

uint64_t ShmArena::kept_mark() const { return read_mark(kKeptMarkOffset); }

uint64_t ShmArena::take_below_mark() {
  const uint64_t v = read_mark(kBelowMarkOffset);
  // Unset at once: a crash from here on must not find it set.
  if (v == 0 || !write_mark(kBelowMarkOffset, 0)) return 0;
  return v;
}

Result<std::unique_ptr<ShmArena>> ShmArena::Create(const std::string& path, uint64_t capacity,
                                                   bool prefault, uint32_t table_slots) {
  if (capacity == 0) return Status::InvalidArgument("shm_capacity_bytes is 0");
  if (table_slots > kMaxTableSlots)
    return Status::InvalidArgument("block table of " + std::to_string(table_slots) +
                                   " slots is larger than " + std::to_string(kMaxTableSlots));
  const uint64_t page = std::max<uint64_t>(4096, uint64_t(::sysconf(_SC_PAGESIZE)));
  // The header page, then the block table region: the file offset of the
  // usable arena.
  const uint64_t table_bytes = table_region_bytes(page, table_slots);
  const uint64_t header = page + table_bytes;
  if (capacity > uint64_t(INT64_MAX) - header)
    return Status::InvalidArgument("shm_capacity_bytes " + std::to_string(capacity) +
                                   " is too large");
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? std::string(".") : path.substr(0, slash + 1);
  struct stat dir_st;
  struct statvfs vfs;
  if (::stat(dir.c_str(), &dir_st) != 0 || ::statvfs(dir.c_str(), &vfs) != 0)
    return errno_status(errno, "shm_path directory '" + dir + "'");
  uint64_t free_bytes = uint64_t(vfs.f_bavail) * vfs.f_frsize;
  auto too_large = [&](uint64_t free) {
    return Status::InvalidArgument("shm_capacity_bytes " + human(capacity) +
                                   " is larger than the free space of the file system holding '" +
                                   path + "' (" + human(free) + ")");
  };
  // Refused before anything sized by the capacity is made (the arena keeps
  // state per chunk): not even the file at path, given back, would make
  // room. The exact check, which knows whether that file may go, is below.
  struct stat at_path;
  const uint64_t reclaimable = ::lstat(path.c_str(), &at_path) == 0 && S_ISREG(at_path.st_mode)
                                   ? uint64_t(at_path.st_blocks) * 512
                                   : 0;
  if (header + capacity > free_bytes + reclaimable) return too_large(free_bytes + reclaimable);

  std::unique_ptr<ShmArena> a(new ShmArena(capacity));
  a->path_ = path;
  a->header_bytes_ = header;
  a->table_bytes_ = table_bytes;
  a->table_slots_ = table_slots;
  // Until the arena holds the file, a failure closes fd and removes the file
  // only if it is ours (created by this call, or a stale arena whose reset
  // has begun) and the path still names it.
  int fd = -1;
  bool created = false;
  bool owned = false;
  auto fail = [&](Status st) -> Status {
    if (fd >= 0) {
      if (owned) {
        struct stat now;
        if (::lstat(path.c_str(), &now) == 0 && now.st_dev == a->dev_ && now.st_ino == a->ino_)
          ::unlink(path.c_str());
      }
      ::close(fd);
    }
    return st;
  };

  struct stat st;
  for (int attempt = 0;; ++attempt) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
      created = owned = true;
      if (::fstat(fd, &st) != 0) return fail(errno_status(errno, "stat shm_path '" + path + "'"));
      a->dev_ = st.st_dev;
      a->ino_ = st.st_ino;
      break;
    }
    if (errno != EEXIST) return errno_status(errno, "create shm_path '" + path + "'");
    // Something is there: only a stale arena of ours may be taken over.
    struct stat lst;
    if (::lstat(path.c_str(), &lst) != 0) {
      if (errno == ENOENT && attempt < 8) continue;  // removed meanwhile: create it
      return errno_status(errno, "stat shm_path '" + path + "'");
    }
    std::string why = refusal(lst, dir_st.st_dev);
    if (!why.empty()) return not_ours(path, why);
    // O_NONBLOCK and O_NOCTTY: should the path change into a fifo or a
    // device before this open, the open neither blocks nor takes a terminal;
    // fstat below refuses it.
    fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT && attempt < 8) continue;
      if (errno == ELOOP) return not_ours(path, "it is a symbolic link");
      return errno_status(errno, "open existing shm_path '" + path + "'");
    }
    if (::fstat(fd, &st) != 0) return fail(errno_status(errno, "stat shm_path '" + path + "'"));
    why = refusal(st, dir_st.st_dev);
    if (!why.empty()) return fail(not_ours(path, why));
    break;
  }

  // Left behind in use: the store that locked the file is gone, and the
  // lock lives on in processes it handed the file to (its pool clients),
  // which still map it and may still read blocks they leased there. Its
  // memory is not taken over under them: a new file replaces it at the
  // path, and theirs stays theirs until they let it go.
  int lock_err = 0;
  const LockOutcome lock = take_lock(fd, st.st_dev, st.st_ino, &lock_err);
  if (lock_err) return fail(errno_status(lock_err, "lock shm_path '" + path + "'"));
  const bool left_in_use = lock == LockOutcome::kLeftInUse && !created;
  if (lock != LockOutcome::kTaken && !left_in_use)
    return fail(
        Status::Busy("shm_path '" + path +
                     "' is in use by another open store; give each store its own shm_path"));
  // A file created here, and replaced at the path (as half made) by another
  // store before this one locked it, is not the arena at the path.
  auto still_at_path = [&] {
    struct stat now;
    return ::lstat(path.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino;
  };
  if (created && !still_at_path())
    return fail(Status::Busy("shm_path '" + path + "' was replaced by another store meanwhile"));
  bool keep = false;  // a persistent arena reattached with its contents
  ArenaHeader found{};
  if (!created) {
    std::string why = header_refusal(fd, &found);
    // A creator killed before it wrote the header leaves an empty or zeroed
    // file: once its lock is free, it is replaced like any stale arena
    // (else every later start would refuse it).
    if (!why.empty() && !(lock == LockOutcome::kTaken && half_made(fd)))
      return fail(not_ours(path, why));
  }
  if (!created && !left_in_use) {
    keep = table_slots > 0 && found.version == kFormatVersion && found.header_bytes == page &&
           found.capacity == capacity && found.table_slots == table_slots &&
           found.table_bytes == table_bytes && uint64_t(st.st_size) == header + capacity;
    // A stale arena: its memory is given back below (or kept), so it counts as free.
    free_bytes += uint64_t(st.st_blocks) * 512;
  }
  if (header + capacity > free_bytes) return fail(too_large(free_bytes));
  const bool adopted = !created;
  a->replaced_in_use_ = left_in_use;
  a->discarded_ = adopted && !keep && !left_in_use && table_slots > 0;
  if (adopted && !keep) {
    // A stale arena is discarded by removing its file and creating a new
    // one in its place, never by truncating it: a process that still maps
    // the old file (a cluster member of this host copying a block it
    // leased there) reads the old bytes instead of faulting on a shrunk
    // file, and its mapping frees the memory when it ends.
    struct stat now;
    if (::lstat(path.c_str(), &now) != 0 || now.st_dev != st.st_dev || now.st_ino != st.st_ino)
      return fail(Status::Busy("shm_path '" + path + "' changed while it was being adopted"));
    if (::unlink(path.c_str()) != 0)
      return fail(errno_status(errno, "remove the stale arena '" + path + "'"));
    ::close(fd);
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST)
        return Status::Busy("shm_path '" + path +
                            "' was created by another store while this one replaced it");
      return errno_status(errno, "create shm_path '" + path + "'");
    }
    created = true;
    if (::fstat(fd, &st) != 0) return fail(errno_status(errno, "stat shm_path '" + path + "'"));
    a->dev_ = st.st_dev;
    a->ino_ = st.st_ino;
    owned = true;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || !still_at_path())
      return fail(Status::Busy("shm_path '" + path + "' is in use by another open store"));
  }
  a->dev_ = st.st_dev;
  a->ino_ = st.st_ino;
  if (keep) {
    // Reattached: the file, its header and its key stay as they are; a
    // failure from here closes it without removing it.
    owned = false;
    std::memcpy(a->key_, found.key, kKeyBytes);
  } else {
    // From here the file is ours, created by this call (in place of a
    // stale arena of this user, whose contents are discarded: the host tier
    // starts empty).
    owned = true;
    if (created && ::fchmod(fd, 0600) != 0)  // exactly 0600 whatever the umask
      return fail(errno_status(errno, "chmod shm_path '" + path + "'"));
    if (::ftruncate(fd, static_cast<off_t>(header + capacity)) != 0)
      return fail(errno_status(errno, "size shm_path '" + path + "'"));
    // The header page and the table are backed now: the table is written
    // at every put and must never fault for memory.
    if (int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(header)); rc != 0)
      return fail(errno_status(rc, "write the header of shm_path '" + path + "'"));
    if (table_slots > 0) {
      Status ks = random_key(a->key_, kKeyBytes);
      if (!ks.ok()) return fail(ks);
    }
    std::vector<uint8_t> head(page, 0);
    ArenaHeader h{};
    std::memcpy(h.magic, kMagic, sizeof h.magic);
    h.version = kFormatVersion;
    h.header_bytes = uint32_t(page);
    h.capacity = capacity;
    h.creator_uid = ::geteuid();
    h.table_slots = table_slots;
    h.table_bytes = table_bytes;
    std::memcpy(h.key, a->key_, kKeyBytes);
    std::memcpy(head.data(), &h, sizeof h);
    ssize_t wrote = ::pwrite(fd, head.data(), page, 0);
    if (wrote != ssize_t(page))
      return fail(
          errno_status(wrote < 0 ? errno : EIO, "write the header of shm_path '" + path + "'"));
  }

  if (table_bytes > 0) {
    void* t = ::mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                     static_cast<off_t>(page));
    if (t == MAP_FAILED) return fail(errno_status(errno, "map shm_path '" + path + "'"));
    a->table_ = static_cast<uint8_t*>(t);
  }
  void* p =
      ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(header));
  if (p == MAP_FAILED) return fail(errno_status(errno, "map shm_path '" + path + "'"));
  ::madvise(p, capacity, MADV_HUGEPAGE);  // best effort: honoured where shmem THP is enabled
  a->fd_ = fd;
  a->base_ = static_cast<uint8_t*>(p);
  a->adopted_ = adopted;
  a->reattached_ = keep;
  if (prefault) CASCADE_RETURN_IF_ERROR(a->commit(capacity));
  return a;
}

ShmArena::~ShmArena() {
  committed_.stop_warming();  // the warmers use the mapping and the file
  if (base_) ::munmap(base_, capacity_);
  if (table_) ::munmap(table_, table_bytes_);
  if (fd_ < 0) return;
  // A persistent arena stays for the next open (unless remove_if_new()). An
  // ephemeral one is removed only while the path still names it: a file
  // someone put there since is not ours.
  struct stat now;
  if ((table_slots_ == 0 || remove_at_close_) && ::lstat(path_.c_str(), &now) == 0 &&
      now.st_dev == dev_ && now.st_ino == ino_)
    ::unlink(path_.c_str());
  ::close(fd_);  // releases the flock
}

ShmArena::ShmArena(uint64_t capacity)
    : capacity_(capacity),
      committed_(capacity, [this](uint64_t from, uint64_t to) { return back(from, to); }) {}

Status ShmArena::back(uint64_t from, uint64_t to) {
  int rc = ::posix_fallocate(fd_, static_cast<off_t>(header_bytes_ + from),
                             static_cast<off_t>(to - from));
  // posix_fallocate may leave a partial allocation; CommittedMemory then
  // advertises none of the step.
  if (rc != 0)
    return errno_status(rc, "commit host arena memory in '" + path_ + "' (is /dev/shm full?)");
  (void)populate_pages(base_ + from, to - from);  // best effort: the pages are allocated already
  return Status::OK();
}

}  // namespace cascade

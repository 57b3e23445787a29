// Removal records across kills and power losses (FaultEnv): an id whose
// removal a flush made durable is never found again with the bytes it had
// before, whatever a reopen, a compaction, a failed fsync or a failed
// unlink do in between.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "tiers/file/fault_env_testing.h"
#include "tiers/file/file_test_util.h"
#include "tiers/file/file_tier.h"

namespace cascade {
namespace {

using file_test::FaultEnv;
using file_test::id_of;

constexpr uint64_t kX = 1;  // the id removed

std::vector<uint8_t> bytes_of(uint64_t n, uint64_t version, size_t size) {
  return file_test::bytes_of(n * 1000 + version, size);
}

struct Dirs {
  file_test::TempDir tmp;
  std::string dir = tmp.sub("dir"), shadow = tmp.sub("shadow");
  CascadeConfig config() const {
    CascadeConfig c = file_test::file_config(dir);
    c.segment_size_bytes = 64 << 10;
    return c;
  }
};

// Runs fn with a tier on a FaultEnv in a child, which then kills
// itself (SIGKILL), or closes the tier and exits. The child exits non-zero
// where fn returns false. fail_open_syncs: every fsync of the open fails.
void in_child_then_killed(const Dirs& d, const std::function<bool(FileTier*, FaultEnv*)>& fn,
                          bool killed = true, bool fail_open_syncs = false) {
  std::fflush(stdout);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    FaultEnv env(d.shadow);
    env.fail_syncs = fail_open_syncs;
    env.fail_dir_syncs = fail_open_syncs;
    auto t = FileTier::Open(d.config(), nullptr, &env);
    env.fail_syncs = false;
    env.fail_dir_syncs = false;
    if (!t.ok() || !fn(t->get(), &env)) ::_exit(3);
    if (killed) ::kill(::getpid(), SIGKILL);
    t->reset();
    ::_exit(0);
  }
  int ws = 0;
  ASSERT_EQ(::waitpid(child, &ws, 0), child);
  if (killed)
    ASSERT_TRUE(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL) << "the child failed first: " << ws;
  else ASSERT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0) << ws;
}

bool put(FileTier* t, uint64_t n, uint64_t version, size_t size) {
  auto b = bytes_of(n, version, size);
  return t->put(id_of(n), b.data(), b.size(), PutOptions{}).ok();
}

// The version of block n a tier opened on d after a power loss serves (0:
// none, -1: bytes of no version).
int version_after_power_loss(const Dirs& d, uint64_t n, size_t size) {
  FaultEnv::power_loss(d.dir, d.shadow);
  auto t = FileTier::Open(d.config(), nullptr, nullptr);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (!t.ok()) return -2;
  std::vector<uint8_t> out(size);
  ReadRequest req;
  req.out = out.data();
  req.capacity = out.size();
  ReadResult r;
  if (!(*t)->read(id_of(n), req, &r).ok()) return 0;
  for (uint64_t v = 1; v < 4; ++v)
    if (r.copied == size && out == bytes_of(n, v, size)) return static_cast<int>(v);
  return -1;
}

// A flush while every fsync fails: whether it said so.
bool flush_fails(FileTier* t, FaultEnv* env) {
  env->fail_syncs = true;
  env->fail_dir_syncs = true;
  const bool failed = !t->flush().ok();
  env->fail_syncs = false;
  env->fail_dir_syncs = false;
  return failed;
}

// X's first version and a live block in one segment, flushed; X removed and
// the removal flushed (durable).
bool removed_durably(FileTier* t) {
  return put(t, kX, 1, 3000) && put(t, 2, 1, 57344) && t->flush().ok() &&
         t->remove_lasting(id_of(kX)).ok() && t->flush().ok();
}

// Removed again after a second version, the second removal never synced
// before the kill: a reopen that then takes it as the one guard of the first
// version must have made it durable first (it syncs the killed store's
// segments), or, where that sync fails, keep the older removal record too.
void removed_again_then_killed(const Dirs& d) {
  in_child_then_killed(d, [](FileTier* t, FaultEnv*) {
    return removed_durably(t) && put(t, 3, 1, 50000) && t->remove_lasting(id_of(3)).ok() &&
           put(t, kX, 2, 3000) && t->remove_lasting(id_of(kX)).ok();
  });
}

TEST(FilePowerLossTest, AReopenSyncsTheKilledStoresSegmentsBeforeItTrustsThem) {
  Dirs d;
  removed_again_then_killed(d);
  in_child_then_killed(
      d, [](FileTier* t, FaultEnv*) { return t->compact(1).ok() && t->flush().ok(); },
      /*killed=*/false);
  EXPECT_EQ(version_after_power_loss(d, kX, 3000), 0);
}

TEST(FilePowerLossTest, AReopenWhoseSyncFailsKeepsTheOlderRemovalRecordsToo) {
  Dirs d;
  removed_again_then_killed(d);
  in_child_then_killed(
      d,
      [](FileTier* t, FaultEnv*) {
        // X's two removal records and block 3's one.
        return t->recovery_report().removals == 3 && t->compact(1).ok() && t->flush().ok();
      },
      /*killed=*/false, /*fail_open_syncs=*/true);
  EXPECT_EQ(version_after_power_loss(d, kX, 3000), 0);
}

// A flush whose fsync failed, then one that succeeds: the pages dirty at
// the failure are lost for good, so a removal record among them never
// becomes the id's one guard.
TEST(FilePowerLossTest, ARemovalRecordWhoseFsyncFailedNeverSupersedesAnother) {
  Dirs d;
  in_child_then_killed(d, [](FileTier* t, FaultEnv* env) {
    if (!removed_durably(t) || !put(t, 3, 1, 49152) || !t->remove_lasting(id_of(3)).ok() ||
        !put(t, kX, 2, 3000) || !t->remove_lasting(id_of(kX)).ok() || !put(t, 4, 1, 3000))
      return false;
    const bool failed = flush_fails(t, env);
    return failed && t->flush().ok() && t->compact(1).ok();
  });
  EXPECT_EQ(version_after_power_loss(d, kX, 3000), 0);
}

// An id evicted (not written down), put again with other bytes and flushed,
// then removed by a user (not flushed): a compaction dropping the second
// version's record must not count on that removal record, which a power
// loss can take, and leave the first version as the id's newest.
TEST(FilePowerLossTest, ACompactionDoesNotCountOnARemovalRecordNotYetDurable) {
  Dirs d;
  in_child_then_killed(d, [](FileTier* t, FaultEnv*) {
    return put(t, kX, 1, 3000) && put(t, 2, 1, 57344) && t->flush().ok() &&
           t->remove(id_of(kX)).ok() &&  // an eviction
           put(t, kX, 2, 50000) && put(t, 3, 1, 20000) && t->flush().ok() &&
           t->remove_lasting(id_of(kX)).ok() && t->compact(1).ok();
  });
  const int v = version_after_power_loss(d, kX, 3000);
  EXPECT_NE(v, 1) << "the first version came back, though the second replaced it durably";
}

// clear() keeps the segments holding removal records while another segment
// could not be deleted; what those segments hold stays known, so a later
// compaction does not delete the removal record before the record it guards.
TEST(FilePowerLossTest, SegmentsAClearLeavesBehindKeepTheirRemovalRecords) {
  Dirs d;
  in_child_then_killed(
      d,
      [](FileTier* t, FaultEnv* env) {
        if (!removed_durably(t) || !put(t, 3, 1, 49152) || !put(t, 4, 1, 20000)) return false;
        env->fail_unlinks_of("seg-0000000000000001.dat");  // X's first version's segment
        t->clear();
        return t->compact().ok() && t->flush().ok();
      },
      /*killed=*/false);
  EXPECT_EQ(version_after_power_loss(d, kX, 3000), 0);
}

// A flush whose fsync fails, then one that would succeed without the pages
// the failure dropped: the second rewrites what the failed segment holds
// before it says OK, so everything put or removed before it survives a
// power loss.
TEST(FilePowerLossTest, AFlushAfterAFailedFsyncSaysOKOnlyOnceWhatItLostIsRewritten) {
  Dirs d;
  in_child_then_killed(d, [](FileTier* t, FaultEnv* env) {
    if (!put(t, kX, 1, 3000) || !t->flush().ok() || !t->remove_lasting(id_of(kX)).ok() ||
        !put(t, 2, 1, 3000))
      return false;
    const bool failed = flush_fails(t, env);
    return failed && t->flush().ok();
  });
  EXPECT_EQ(version_after_power_loss(d, kX, 3000), 0) << "a removal before an OK flush undone";
  auto t = FileTier::Open(d.config(), nullptr, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE((*t)->contains(id_of(2))) << "a put before an OK flush lost";
}

// A compaction whose fsync fails leaves its copies to a segment that takes
// no more: the next compaction writes into a fresh one, whose records a
// reopen after a power loss finds (a scan stops at the first lost page).
TEST(FilePowerLossTest, ACompactionAfterOneWhoseFsyncFailedWritesItsCopiesElsewhere) {
  Dirs d;
  in_child_then_killed(d, [](FileTier* t, FaultEnv* env) {
    // Segment 1: block 2 (live) beside blocks 3 and 4, removed (dead).
    if (!put(t, 2, 1, 3000) || !put(t, 3, 1, 30000) || !put(t, 4, 1, 30000) ||
        !put(t, 5, 1, 30000) || !t->remove(id_of(3)).ok() || !t->remove(id_of(4)).ok() ||
        !t->flush().ok())
      return false;
    env->fail_syncs = true;  // the segments' own fsyncs, not the directory's
    (void)t->compact(1);     // its copies are not durable, whatever it returns
    env->fail_syncs = false;
    return t->compact(1).ok() && t->flush().ok();
  });
  FaultEnv::power_loss(d.dir, d.shadow);
  auto t = FileTier::Open(d.config(), nullptr, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE((*t)->contains(id_of(2))) << "a block a compaction moved was lost";
  EXPECT_TRUE((*t)->contains(id_of(5)));
}

}  // namespace
}  // namespace cascade

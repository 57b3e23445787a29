// CascadeConfig: every knob of a store, with its default and the reason for it.
//
// One struct for the whole store. The Python package can fill it from a dict
// or a YAML file (cascade.config). validate() checks the fields alone and
// against each other, never the machine; opening a store calls it first and
// finds out what the machine offers as it opens the tiers.
//
// Thread-safety: a value; copy it freely.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/status.h"

namespace cascade {

enum class EvictionPolicy : uint8_t {
  kLru,   // least recently used first (second-chance LRU; see docs/design.md)
  kFifo,  // oldest insertion first; cheaper bookkeeping, ignores reuse
};

// How the host tier's arena is backed by memory ahead of use (docs/design.md,
// "Warming the arena").
enum class ShmPopulate : uint8_t {
  kLazy,   // only by the put that needs it, 64 MiB at a time
  kAhead,  // background threads keep 512 MiB beyond the high-water mark backed
  kFull,   // background threads back the whole capacity right after open
};

enum class WritePolicy : uint8_t {
  kWriteBack,     // put writes the top tier; lower tiers get a block when it is evicted
  kWriteThrough,  // put writes every tier of the pipeline before returning
};

enum class FileIoEngine : uint8_t {
  kPsync,    // pread/pwrite from a thread pool
  kIoUring,  // io_uring (needs liburing at build time)
};

// kRemote: the host-memory level of a distributed store (this rank's arena
// and, over MPI, every other rank's); opened by OpenDistributed
// (cascade/distributed.h), never by CascadeStore::Open.
enum class TierKind : uint8_t { kGpu, kHost, kFile, kRemote, kPool };

const char* tier_kind_name(TierKind kind);  // "gpu", "host", "file", "remote", "pool"

// "/dev/shm/cascade-<effective uid>": shm_path's default.
std::string default_shm_path();

struct CascadeConfig {
  // Which tiers, top (fastest) to bottom, joined with '|': "gpu|host|file",
  // "host|file", "host", "file". Empty (default) = automatic: "gpu" when
  // use_gpu and a GPU is usable, then "host", then "file" when file_path is
  // set. Tiers must appear in gpu, host, file order, each at most once.
  // "remote" (distributed stores only) stands where "host" would. Names are
  // case-insensitive, spaces around them are ignored, and three have
  // aliases: gpu = hbm, device; host = shm, cache, dram; file = lustre,
  // posix, disk.
  std::string pipeline;

  // ---- gpu tier ---------------------------------------------------------
  // Device memory for the gpu tier. 4 GiB leaves room for the model on any
  // GPU we support.
  uint64_t gpu_capacity_bytes = 4ULL << 30;
  int gpu_device_id = 0;  // CUDA ordinal of the device holding the gpu tier
  // Whether the automatic pipeline may include the gpu tier. An explicit
  // pipeline naming "gpu" fails with Unavailable when there is no GPU.
  bool use_gpu = true;

  // ---- host tier --------------------------------------------------------
  // Size of the shared-memory arena. Memory is committed as blocks arrive
  // (plus shm_populate's window), so a large value costs nothing up front.
  // 4 GiB fits any machine we run on.
  uint64_t shm_capacity_bytes = 4ULL << 30;
  // The arena's file. Must be on a tmpfs (/dev/shm) for memory speed. One
  // store per path: a second store on the same path is refused (Busy).
  // Created 0600 with O_EXCL; an existing file is adopted only when it is a
  // stale arena of this user, never truncated or removed otherwise.
  // Default: /dev/shm/cascade-<effective uid>, one per user.
  std::string shm_path = default_shm_path();
  // Touch the whole arena at open so no put ever takes a first-touch page
  // fault; open waits for it (with every warming thread helping). Off:
  // costs time and memory up front.
  bool shm_prefault = false;
  // Keep the arena and its blocks across close, a crash or SIGKILL (warm
  // restart): close leaves the file in place, and the next store opened on
  // it with the same shm_capacity_bytes and shm_table_slots reattaches it,
  // verifies each block's checksum and serves what passes. Blocks are
  // recorded in a block table in the file and sealed (checksummed) in the
  // background; flush() seals every block stored before it. A crash loses
  // only blocks not sealed yet. Off: the arena is a cache emptied by close
  // (and by the next open after a crash).
  bool shm_persist = false;
  // Slots of the block table with shm_persist: at most this many blocks are
  // kept across a restart (more are stored, not kept; counted in the host
  // tier's unpersisted_blocks). 0 = shm_capacity_bytes / 64 KiB, at least
  // 1024 and at most one per 4 KiB; 64 bytes of the file each.
  uint64_t shm_table_slots = 0;
  // How the arena is backed ahead of use, in the background, with one
  // thread per core (at most 16); a put never waits for a warmer except on
  // the one chunk (4 MiB) being backed that it needs. Ahead: a fresh
  // store's first puts run near copy speed for the cost of 512 MiB of
  // memory backed beyond what is used. Full: a node-wide store that should
  // take its memory once, at start.
  ShmPopulate shm_populate = ShmPopulate::kAhead;

  // ---- node pool (a client of `cascade serve`) ----------------------------
  // The Unix socket of the node's pool server. Set: the automatic pipeline
  // uses the pool where it would use the host tier ("gpu|pool"), and a
  // pipeline may name "pool" (level of host). The pool's blocks live in the
  // server's shared arena (and the tiers below it on the server), shared by
  // every process of the node that uses the same namespace.
  std::string pool_socket;
  // Which blocks this process shares: processes with the same namespace
  // (and allowed by the server) see the same blocks; others never do. Put
  // in it what must not be mixed (model, dtype, layout, rank, tenant); the
  // server adds the client's uid unless it shares the namespace across users.
  std::string pool_namespace;
  // Request channels to the server (one per thread that talks to it at a
  // time; a batch's I/O threads use up to two each); 0 = two per I/O thread
  // and two more, at least one per core, at most 64.
  int pool_channels = 0;
  // How long a request may wait for the server, from when it is sent,
  // before it fails with Unavailable; a server that leaves one request
  // unanswered this long is taken as gone (every later call fails). Above
  // what a cluster member's server may take for one request with its
  // default deadlines (six calls of 2 s in turn; docs/node-pool.md).
  uint32_t pool_timeout_ms = 15000;

  // ---- file tier --------------------------------------------------------
  // (Python and YAML also accept the names lustre_path, lustre_stripe_size
  // and lustre_stripe_count for the three fields below.)
  // Directory of the file tier (NVMe, Lustre, any POSIX file system). Empty:
  // no file tier in the automatic pipeline.
  std::string file_path;
  // Lustre striping applied to new segment files; 0 = inherit the
  // directory's layout. Ignored (documented no-op) on other file systems.
  uint64_t file_stripe_size = 0;
  int file_stripe_count = 0;
  // Bound on the file tier's bytes on disk (records + dead space). 0 = no
  // bound beyond the file system's free space.
  uint64_t file_capacity_bytes = 0;
  // Segment files are appended to until they reach this size. 256 MiB keeps
  // file counts low on metadata-bound file systems and compaction cheap.
  uint64_t segment_size_bytes = 256ULL << 20;
  // Use O_DIRECT for segment I/O (no page cache): predictable, and the only
  // way to measure cold reads. Off by default so small machines keep the
  // page cache as an extra tier.
  bool io_direct = false;
  FileIoEngine file_io_engine = FileIoEngine::kPsync;
  // Cap on the file tier's read bandwidth, bytes per second, shared by every
  // thread reading from it: a read returns no sooner than the cap allows
  // after the reads before it. For a store sharing a file system (Lustre)
  // with other jobs, and for measuring a slow tier. 0 = no cap; otherwise at
  // least 64 KiB/s (a lower cap would stall a read of one block for minutes).
  uint64_t file_read_bytes_per_s = 0;
  // Permission bits of the file tier's files (segments, summaries, its key
  // and lock). Its directory gets the same bits plus search (x) where read
  // is granted. Owner-only by default: stored KV blocks are the prompts of
  // whoever used the engine. 0640 (with the directory's group set by the
  // operator) shares a directory with a group for read.
  uint32_t file_mode = 0600;
  // fsync data (and new segment directories) before a put returns.
  // Off: flush() makes everything durable; a crash may lose recent puts
  // but never exposes a torn or wrong block.
  bool sync_writes = false;

  // ---- store ------------------------------------------------------------
  // Store identical content under different ids once (content fingerprint
  // XXH3-128, confirmed by a byte comparison before two ids share bytes).
  // Off by default: ids made with compute_block_id are content addresses
  // already, so duplicates collapse for free; fingerprinting costs a pass
  // over every block put.
  bool dedup_enabled = false;
  // Compress blocks in lower tiers. Not implemented: KV tensors (bf16/fp8)
  // compress poorly and the codec would cap throughput. true fails validate().
  bool compression_enabled = false;
  // Threads that move data: batch items and slices of large copies spread
  // over them (the calling thread is one of them). 0 = one per CPU core
  // (at most 64).
  int num_io_threads = 0;
  // Copies at least this large are split across the I/O threads; one thread
  // reaches a fraction of DRAM bandwidth (docs/benchmarks.md, host tier).
  uint64_t parallel_copy_threshold = 4ULL << 20;
  EvictionPolicy eviction_policy = EvictionPolicy::kLru;
  WritePolicy write_policy = WritePolicy::kWriteBack;
  // Durability contract (docs/design.md): with a persistent tier (file),
  // flush() and close() first write every block held only in memory tiers
  // down to it, so a store opened later finds every block stored before
  // them. An ephemeral store skips that on close(): its memory tiers are a
  // cache that may start cold (flush() still writes down).
  bool ephemeral = false;
  // Copy a block found in a lower tier up into the top tier on get.
  bool promote_on_hit = true;
  // Index shards: a power of two. 256 keeps contention low at 64 threads
  // while a shard's table stays cache friendly.
  int index_shards = 256;

  // Checks the fields alone and against each other, never the machine.
  // The pipeline must resolve (as if a GPU were usable, so with use_gpu the
  // automatic pipeline includes "gpu"), and each tier in it needs its fields:
  // host or remote: shm_capacity_bytes > 0, shm_path set and shm_populate
  // one of its values; pool: pool_socket set, pool_channels 0 to 64,
  // pool_namespace at most 256 bytes; gpu:
  // gpu_capacity_bytes > 0 and gpu_device_id >= 0; file: file_path set and
  // segment_size_bytes >= 1 MiB. Whatever the pipeline: file_stripe_count
  // >= 0; file_mode holds permission bits only (<= 0777) and grants the owner
  // read and write; num_io_threads is 0 to 1024; index_shards is a power of
  // two from 1 to 65536. InvalidArgument when one fails; NotSupported when
  // compression_enabled is set.
  Status validate() const;
  // The tiers this config asks for, top to bottom, after resolving the
  // automatic pipeline with `gpu_available`.
  Result<std::vector<TierKind>> resolve_pipeline(bool gpu_available) const;
};

}  // namespace cascade

// The KEY file. See store_key.h.
#include "tiers/file/store_key.h"

#include <openssl/rand.h>
#include <unistd.h>

#include <cstdio>

#include "tiers/file/segment_scan.h"
#include "util/xxh3.h"

namespace cascade::file {
namespace {

std::string octal(uint32_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0%03o", mode & 0777);
  return buf;
}

Status check_key_file(const FileInfo& info, const std::string& path, uint32_t file_mode,
                      bool check_owner) {
  if (info.type != FileInfo::Type::kRegular)
    return Status::IOError(path + " is not a regular file; refusing it as the directory's key");
  if (info.size != kKeyBytes)
    return Status::Corruption(path + " holds " + std::to_string(info.size) + " bytes, not a " +
                              std::to_string(kKeyBytes) + "-byte key");
  if (!check_owner) return Status::OK();
  if (info.uid != static_cast<uint32_t>(::geteuid()))
    return Status::IOError(path + " belongs to user " + std::to_string(info.uid) +
                           ", not to this process's user; refusing it as the directory's key");
  if (info.mode & 077 & ~file_mode)
    return Status::IOError(path + " has mode " + octal(info.mode) + ", more open than file_mode " +
                           octal(file_mode) + " allows; refusing it as the directory's key");
  return Status::OK();
}

Result<RecordKey> create_key(Env* env, const std::string& dir, uint32_t file_mode) {
  uint8_t key[kKeyBytes];
  if (RAND_bytes(key, sizeof(key)) != 1)
    return Status::IOError("no random bytes for the directory's key");
  std::string path = join_path(dir, kKeyFileName);
  std::string tmp = path + ".tmp";
  (void)env->unlink(tmp);
  FileOpenOptions o;
  o.write = o.create = o.exclusive = o.no_follow = true;
  o.mode = file_mode;
  auto f = env->open(tmp, o);
  if (!f.ok()) return f.status();
  Status st = (*f)->pwrite(key, sizeof(key), 0);
  if (st.ok()) st = (*f)->sync();
  f->reset();
  if (st.ok()) st = env->rename(tmp, path);
  if (!st.ok()) {
    (void)env->unlink(tmp);
    return st;
  }
  CASCADE_RETURN_IF_ERROR(env->sync_dir(dir));
  return RecordKey(key, sizeof(key));
}

}  // namespace

Result<RecordKey> load_store_key(Env* env, const std::string& dir, uint32_t file_mode, bool create,
                                 bool check_owner) {
  std::string path = join_path(dir, kKeyFileName);
  auto info = env->stat(path);
  if (!info.ok()) {
    if (!info.status().is(Code::kNotFound)) return info.status();
    if (!create)
      return Status::NotFound(path + " is missing: the directory's records cannot be checked");
    return create_key(env, dir, file_mode);
  }
  CASCADE_RETURN_IF_ERROR(check_key_file(*info, path, file_mode, check_owner));
  FileOpenOptions o;
  o.no_follow = true;
  auto f = env->open(path, o);
  if (!f.ok()) return f.status();
  auto opened = (*f)->info();  // what was opened, not what was there a moment ago
  if (!opened.ok()) return opened.status();
  CASCADE_RETURN_IF_ERROR(check_key_file(*opened, path, file_mode, check_owner));
  uint8_t key[kKeyBytes];
  auto got = (*f)->pread(key, sizeof(key), 0);
  if (!got.ok()) return got.status();
  if (*got != sizeof(key)) return Status::Corruption(path + " is shorter than a key");
  return RecordKey(key, sizeof(key));
}

namespace {

// The nonce's record: the nonce and its checksum, keyed with the
// directory's key (a torn or foreign file does not validate).
uint64_t nonce_checksum(uint64_t nonce, const RecordKey& key) {
  return xxh3::hash_with_secret(&nonce, sizeof nonce, key.secret(), kKeySecretBytes);
}

}  // namespace

OpenNonces advance_open_nonce(Env* env, const std::string& dir, uint32_t file_mode,
                              const RecordKey& key) {
  OpenNonces out;
  const std::string path = join_path(dir, kEpochFileName);
  {
    FileOpenOptions o;
    o.no_follow = true;
    auto f = env->open(path, o);
    uint64_t rec[2] = {0, 0};
    if (f.ok()) {
      auto got = (*f)->pread(rec, sizeof rec, 0);
      if (got.ok() && *got == sizeof rec && rec[0] != 0 && rec[1] == nonce_checksum(rec[0], key))
        out.previous = rec[0];
    }
  }
  uint64_t nonce = 0;
  while (nonce == 0)
    if (RAND_bytes(reinterpret_cast<unsigned char*>(&nonce), sizeof nonce) != 1) break;
  const std::string tmp = path + ".tmp";
  (void)env->unlink(tmp);
  Status st = nonce ? Status::OK() : Status::IOError("no random bytes for the open nonce");
  if (st.ok()) {
    FileOpenOptions o;
    o.write = o.create = o.exclusive = o.no_follow = true;
    o.mode = file_mode;
    auto f = env->open(tmp, o);
    st = f.status();
    if (st.ok()) {
      const uint64_t rec[2] = {nonce, nonce_checksum(nonce, key)};
      st = (*f)->pwrite(rec, sizeof rec, 0);
      if (st.ok()) st = (*f)->sync();
    }
  }
  if (st.ok()) st = env->rename(tmp, path);
  if (st.ok()) st = env->sync_dir(dir);
  if (st.ok()) {
    out.current = nonce;
  } else {
    (void)env->unlink(tmp);
    (void)env->unlink(path);
    (void)env->sync_dir(dir);
  }
  return out;
}

}  // namespace cascade::file

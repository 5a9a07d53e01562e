#include "offload/nvme_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>
#include <unordered_map>

#include "core/bytes.h"
#include "core/check.h"
#include "core/logging.h"
#include "core/mutex.h"
#include "offload/crc32c.h"
#include "offload/slab_allocator.h"
#include "tierzero/files.h"

namespace tierzero {

struct NvmeStore::File {
  std::string path;
  int fd = -1;
  bool remove_on_close = false;
  std::unique_ptr<SlabAllocator> space;  // guarded by the store's mu_
};

struct NvmeStore::Piece {
  int file;
  uint64_t offset;         // in the file
  uint64_t bytes;          // multiple of 4 KiB
  uint64_t extent_offset;  // where the piece starts in the extent (and the buffer)
};

struct NvmeStore::ExtentInfo {
  uint64_t bytes = 0;
  std::vector<Piece> pieces;
  uint32_t crc = 0;
  bool crc_valid = false;  // a write with checksums completed
};

struct NvmeStore::Registry {
  std::unordered_map<uint64_t, ExtentInfo> extents;
};

// One submitted read or write: its requests, their completion count and the first error.
class NvmeStore::Operation {
 public:
  NvmeStore* store = nullptr;
  bool write = false;
  uint64_t extent_id = 0;
  uint64_t bytes = 0;  // as requested (the CRC covers these)
  uint8_t* buf = nullptr;
  bool check_crc = false;  // a read to verify
  uint32_t expected_crc = 0;
  uint32_t write_crc = 0;  // a write: the CRC to record on success
  std::vector<IoRequest> requests;

  Mutex mu;
  CondVar cv;
  int pending TZ_GUARDED_BY(mu) = 0;
  Status status TZ_GUARDED_BY(mu);  // the first error
  bool verified TZ_GUARDED_BY(mu) = false;

  void Fail(Status s) {
    MutexLock lock(mu);
    if (status.ok()) status = std::move(s);
  }
  // Marks one request finished; the last one records a write's CRC and wakes waiters. Nothing
  // is touched after the lock is released: a waiter may destroy the operation at once.
  void FinishOne() {
    MutexLock lock(mu);
    if (--pending != 0) return;
    if (write && store->options_.checksums) {
      // A failed write leaves the extent's content undefined: no checksum until a rewrite.
      MutexLock store_lock(store->mu_);
      auto it = store->registry_->extents.find(extent_id);
      if (it != store->registry_->extents.end()) {
        it->second.crc = write_crc;
        it->second.crc_valid = status.ok();
      }
    }
    --store->live_operations_;
    cv.NotifyAll();
  }
};

namespace {

std::string Describe(bool write, const std::string& path, uint64_t offset, uint64_t len) {
  return std::string(write ? "write to " : "read from ") + path + " at offset " +
         std::to_string(offset) + ", length " + std::to_string(len);
}

}  // namespace

// ---- Ticket ------------------------------------------------------------------------------------

NvmeStore::Ticket& NvmeStore::Ticket::operator=(Ticket&& other) noexcept {
  if (this != &other) {
    if (op_) (void)Wait();
    op_ = std::move(other.op_);
    waited_ = std::exchange(other.waited_, false);
  }
  return *this;
}

NvmeStore::Ticket::~Ticket() {
  if (op_) {
    const bool report = !waited_;
    Status s = Wait();
    if (!s.ok() && report) {
      TZ_LOG(kWarn, kNvme) << "an NVMe operation nobody waited for failed: " << s.ToString();
    }
  }
}

bool NvmeStore::Ticket::Done() const {
  if (!op_) return true;
  MutexLock lock(op_->mu);
  return op_->pending == 0;
}

Status NvmeStore::Ticket::Wait() {
  if (!op_) return FailedPreconditionError("Wait on an empty NVMe ticket");
  waited_ = true;
  Operation& op = *op_;
  MutexLock lock(op.mu);
  op.cv.Wait(lock, [&]() TZ_REQUIRES(op.mu) { return op.pending == 0; });
  if (op.status.ok() && op.check_crc && !op.verified) {
    op.verified = true;
    const uint32_t got = Crc32c(op.buf, op.bytes);
    if (got != op.expected_crc) {
      char crcs[64];
      std::snprintf(crcs, sizeof(crcs), "stored 0x%08x, read 0x%08x", op.expected_crc, got);
      op.status = DataLossError("NVMe extent " + std::to_string(op.extent_id) + " (" +
                                FormatBytes(op.bytes) + ") failed its CRC32C check: " + crcs +
                                "; the swap file is corrupt");
    }
  }
  return op.status;
}

// ---- Open and close ----------------------------------------------------------------------------

NvmeStore::NvmeStore(const NvmeStoreOptions& options)
    : options_(options), direct_io_(options.direct_io), registry_(std::make_unique<Registry>()) {}

NvmeStore::~NvmeStore() {
  TZ_CHECK(live_operations_.load() == 0)
      << live_operations_.load() << " NVMe operation(s) still in flight at close";
  io_.reset();  // joins the completion threads
  for (auto& f : files_) {
    // The file it made, removed by name only if the name still is that file: one that replaced
    // it meanwhile is someone else's.
    bool same = false;
    if (f->remove_on_close && f->fd >= 0) {
      struct stat mine {
      }, now{};
      same = ::fstat(f->fd, &mine) == 0 && ::lstat(f->path.c_str(), &now) == 0 &&
             mine.st_dev == now.st_dev && mine.st_ino == now.st_ino;
    }
    if (f->fd >= 0) ::close(f->fd);
    if (f->remove_on_close) {
      if (same) ::unlink(f->path.c_str());
      KeepOnSignalExit(f->path);
    }
  }
}

StatusOr<std::unique_ptr<NvmeStore>> NvmeStore::Open(const NvmeStoreOptions& options) {
  if (options.paths.empty()) return InvalidArgumentError("nvme.paths is empty; give at least one");
  if (options.bytes_per_path == 0) {
    return InvalidArgumentError("the NVMe budget per path (engine.nvme_budget) must be > 0");
  }
  if (options.block_bytes < kNvmeAlignment || options.block_bytes % kNvmeAlignment != 0 ||
      options.block_bytes > (uint64_t{1} << 30)) {
    return InvalidArgumentError("nvme.block_bytes = " + std::to_string(options.block_bytes) +
                                " is out of range; expected a multiple of 4 KiB up to 1 GiB");
  }
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return InvalidArgumentError("nvme.queue_depth = " + std::to_string(options.queue_depth) +
                                " is out of range; expected 1..4096");
  }
  std::unique_ptr<NvmeStore> store(new NvmeStore(options));
  RETURN_IF_ERROR(store->OpenFiles());

  std::vector<int> fds;
  for (auto& f : store->files_) fds.push_back(f->fd);
  BlockIoOptions io_options;
  io_options.queue_depth = options.queue_depth;
  io_options.sqpoll = options.sqpoll;
  io_options.threads = std::clamp(options.queue_depth, 1, 16);
  std::unique_ptr<BlockIo> io;
  if (options.backend != IoBackend::kThreadPool) {
    auto uring = CreateUringBlockIo(fds, io_options);
    if (uring.ok()) {
      io = std::move(uring).value();
    } else if (options.backend == IoBackend::kIoUring ||
               uring.status().code() != StatusCode::kUnavailable) {
      return std::move(uring).status().WithContext("opening the NVMe store");
    } else {
      TZ_LOG_ONCE(kWarn, kNvme) << "io_uring is unavailable here (" << uring.status().message()
                                << "); using thread-pool pread/pwrite for the NVMe tier";
    }
  }
  if (io == nullptr) {
    ASSIGN_OR_RETURN(io, CreateThreadPoolBlockIo(fds, io_options));
  }
  store->io_ = options.wrap_io ? options.wrap_io(std::move(io)) : std::move(io);
  TZ_LOG(kInfo, kNvme) << "NVMe store: " << options.paths.size() << " path(s) x "
                       << FormatBytes(options.bytes_per_path) << ", " << store->io_->name()
                       << (store->direct_io_ ? ", O_DIRECT" : ", buffered");
  return store;
}

namespace {

uint64_t FreeBytes(const struct statvfs& v) {
  return static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
}

}  // namespace

Status NvmeStore::OpenFiles() {
  const uint64_t size = AlignUp(options_.bytes_per_path, kNvmeAlignment);
  for (const std::string& path : options_.paths) {
    auto file = std::make_unique<File>();
    std::error_code ec;
    const bool is_dir = std::filesystem::is_directory(path, ec);
    const std::string space_dir =
        is_dir ? path : std::filesystem::path(path).parent_path().string();
    struct statvfs vfs;
    if (::statvfs(space_dir.empty() ? "." : space_dir.c_str(), &vfs) != 0) {
      return ErrnoError("NVMe path " + path + " is not usable (statvfs of " + space_dir + ")",
                        errno, StatusCode::kNotFound);
    }
    auto no_space = [&](uint64_t free_now) {
      return OutOfMemoryError(
          "NVMe store needs " + FormatBytes(size) + " at " + path + " but only " +
          FormatBytes(free_now) +
          " is free there (the tier reserves its whole size when it opens: what the run "
          "places on NVMe); free space there, give --nvme-path (engine.nvme_path) a disk with "
          "the room, or raise the host budget so less goes to NVMe");
    };
    // Note [Free space that statvfs does not see yet]
    // XFS and btrfs free an unlinked file's blocks in the background: a run resumed right after
    // the one before it ended saw 219 MiB free where 256 MiB could be had two seconds later
    // (hunt 42). So a short count is read again after the file system is synced (which commits
    // btrfs's transaction and XFS's pending frees), for up to three seconds, before it refuses.
    // (Not left to fallocate: ext4 and XFS keep what a failed fallocate took until the file
    // goes, filling a disk others write to; review 42.)
    uint64_t free_bytes = FreeBytes(vfs);
    const uint64_t capacity = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
    // A file system of no blocks at all stores nothing: the kernel's /proc or /sys. It was said
    // as "only 0 B is free there", and the advice (free space there) could not be followed.
    if (capacity == 0)
      return FailedPreconditionError(
          "the NVMe path " + path +
          " is on a file system that reports no capacity (the kernel's /proc or /sys, which "
          "store no files, or a ramfs, whose room cannot be known), not on a disk: give "
          "--nvme-path (engine.nvme_path) a directory on a disk");
    if (free_bytes < size && size <= capacity) {  // (a budget past the disk never fits)
      const int dfd = ::open(space_dir.empty() ? "." : space_dir.c_str(), O_RDONLY | O_CLOEXEC);
      if (dfd >= 0) {
        (void)::syncfs(dfd);
        ::close(dfd);
      }
      for (int look = 0; look < 10 && free_bytes < size; ++look) {
        if (look > 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        if (::statvfs(space_dir.empty() ? "." : space_dir.c_str(), &vfs) == 0)
          free_bytes = FreeBytes(vfs);
      }
    }
    if (free_bytes < size) return no_space(free_bytes);

    auto open_file = [&](int extra_flags) -> int {
      if (is_dir) {
        int fd = ::open(path.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | extra_flags, 0600);
        if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR)) return fd;
        // No O_TMPFILE on this filesystem: a named file, unlinked right away.
        std::string tmpl = path + "/tierzero-swap-XXXXXX";
        fd = ::mkostemp(tmpl.data(), O_CLOEXEC | extra_flags);
        if (fd >= 0) ::unlink(tmpl.c_str());
        return fd;
      }
      // A file of its own: created here (O_EXCL), so the one it removes on close is never a
      // file someone else made (an existing file is refused below, not truncated).
      const int fd =
          ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | extra_flags, 0600);
      if (fd >= 0) {
        file->remove_on_close = true;
        // (A signal's exit does not close the store.) Only this file: one put at its name
        // since is someone else's.
        RemoveOnSignalExitIfSame(path, fd);
      }
      return fd;
    };
    file->path = is_dir ? path + "/<swap>" : path;
    int fd = direct_io_ ? open_file(O_DIRECT) : open_file(0);
    if (fd < 0 && direct_io_ && errno == EINVAL) {
      TZ_LOG_ONCE(kWarn, kNvme) << "O_DIRECT is not supported on " << path
                                << " (tmpfs?); using buffered I/O for the NVMe tier";
      direct_io_ = false;
      fd = open_file(0);
    }
    if (fd < 0 && errno == EEXIST) {
      return FailedPreconditionError(
          "the NVMe path " + path +
          " is an existing file; tierzero swaps to a directory (files of "
          "its own inside) or to a file it creates, and never overwrites "
          "one it did not create: name a directory or a new file");
    }
    if (fd < 0) return ErrnoError("cannot create the NVMe swap file at " + path, errno);
    file->fd = fd;
    int r = ::posix_fallocate(fd, 0, static_cast<off_t>(size));
    if ((r == EOPNOTSUPP || r == EINVAL) && direct_io_) {
      // No fallocate in the file system (ext2, ext3): glibc then writes a byte into every block,
      // which an O_DIRECT descriptor refuses (EINVAL), and the swap file stayed sparse, its
      // space unreserved (hunt 42). The same file through a buffered descriptor takes them.
      TZ_LOG(kInfo, kNvme) << "no fallocate on " << path << ": reserving " << FormatBytes(size)
                           << " for the NVMe tier by writing into every block";
      const std::string self = "/proc/self/fd/" + std::to_string(fd);
      const int buffered = ::open(self.c_str(), O_RDWR | O_CLOEXEC);
      if (buffered >= 0) {
        r = ::posix_fallocate(buffered, 0, static_cast<off_t>(size));
        if (r == 0 && ::fdatasync(buffered) != 0) r = errno;
        ::close(buffered);
      }
    }
    if (r == ENOSPC) {
      files_.push_back(std::move(file));  // closed (and removed) by the destructor
      // The room counted before was taken meanwhile (another rank's or process's swap on the
      // same disk): said so, not "needs 6 MiB but 10 MiB is free" (hunt 49).
      return OutOfMemoryError(
          "NVMe store needs " + FormatBytes(size) + " at " + path + ": " + FormatBytes(free_bytes) +
          " was free there, but the disk filled while it was reserved (other ranks or processes "
          "swapping to the same disk, each reserving what it places there); give each rank its "
          "own disk (--nvme-path), free space there, or raise the host budget so less goes to "
          "NVMe");
    }
    if (r == EOPNOTSUPP || r == EINVAL) {
      TZ_LOG_ONCE(kWarn, kNvme) << "fallocate is not supported on " << path
                                << "; the swap file is sized but not preallocated";
      if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
        files_.push_back(std::move(file));
        return ErrnoError("cannot size the NVMe swap file at " + path, errno);
      }
    } else if (r != 0) {
      files_.push_back(std::move(file));
      return ErrnoError("cannot preallocate " + FormatBytes(size) + " at " + path, r);
    }
    file->space = std::make_unique<SlabAllocator>(size, kNvmeAlignment);
    files_.push_back(std::move(file));
  }
  return Status::OK();
}

// ---- Extents -----------------------------------------------------------------------------------

StatusOr<NvmeExtent> NvmeStore::Allocate(uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("NVMe extent of 0 bytes");
  const uint64_t rounded = AlignUp(bytes, kNvmeAlignment);
  MutexLock lock(mu_);
  ExtentInfo info;
  info.bytes = bytes;
  const size_t paths = files_.size();
  bool ok = false;
  if (rounded >= options_.stripe_min_bytes && paths > 1) {
    // Equal page counts per path (the first `extra` get one more page).
    const uint64_t pages = rounded / kNvmeAlignment;
    uint64_t offset_in_extent = 0;
    ok = true;
    for (size_t f = 0; f < paths && offset_in_extent < rounded; ++f) {
      const uint64_t n = (pages / paths + (f < pages % paths ? 1 : 0)) * kNvmeAlignment;
      if (n == 0) continue;
      auto off = files_[f]->space->Allocate(n);
      if (!off) {
        ok = false;
        break;
      }
      info.pieces.push_back({static_cast<int>(f), *off, n, offset_in_extent});
      offset_in_extent += n;
    }
    if (!ok) {
      for (const Piece& p : info.pieces) files_[p.file]->space->Free(p.offset);
      info.pieces.clear();
    }
  } else {
    // The path with the most free space, then the others.
    std::vector<size_t> order(paths);
    for (size_t f = 0; f < paths; ++f) order[f] = f;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return files_[a]->space->stat().current < files_[b]->space->stat().current;
    });
    for (size_t f : order) {
      if (auto off = files_[f]->space->Allocate(rounded)) {
        info.pieces.push_back({static_cast<int>(f), *off, rounded, 0});
        ok = true;
        break;
      }
    }
  }
  if (!ok) {
    uint64_t free_total = 0, largest = 0;
    for (auto& f : files_) {
      free_total += f->space->capacity() - f->space->stat().current;
      largest = std::max(largest, f->space->largest_free_block());
    }
    return OutOfMemoryError(
        "NVMe store cannot allocate " + FormatBytes(bytes) + ": " + FormatBytes(free_total) +
        " free across " + std::to_string(paths) + " path(s), largest free block " +
        FormatBytes(largest) +
        " (raise the NVMe budget, engine.nvme_budget or --nvme-budget, or add a path)");
  }
  const uint64_t id = next_id_++;
  registry_->extents.emplace(id, std::move(info));
  space_.OnAlloc(rounded);
  return NvmeExtent{id, bytes};
}

Status NvmeStore::Free(const NvmeExtent& extent) {
  MutexLock lock(mu_);
  auto it = registry_->extents.find(extent.id);
  if (it == registry_->extents.end()) {
    return InvalidArgumentError("Free of unknown NVMe extent " + std::to_string(extent.id));
  }
  for (const Piece& p : it->second.pieces) files_[p.file]->space->Free(p.offset);
  space_.OnFree(AlignUp(it->second.bytes, kNvmeAlignment));
  registry_->extents.erase(it);
  return Status::OK();
}

// ---- I/O ---------------------------------------------------------------------------------------

// A request's completion: counted, a short transfer resubmitted, an error kept; the operation's
// last request wakes its waiters.
void NvmeStore::Complete(Operation* op, IoRequest& r, const std::string& path, int64_t res) {
  ++requests_;
  // Transient: a pread/pwrite interrupted by a signal (NFS with `intr`, FUSE) or asked to try
  // again gave no error of the disk's; the same request is resubmitted, a few times at most.
  constexpr int kTransientRetries = 16;
  if ((res == -EINTR || res == -EAGAIN) && r.transient_retries < kTransientRetries) {
    ++r.transient_retries;
    Status s = io_->Resubmit(&r);
    if (s.ok()) return;
    ++errors_;
    op->Fail(std::move(s).WithContext("resubmitting an interrupted transfer"));
    op->FinishOne();
    return;
  }
  if (res < 0) {
    ++errors_;
    op->Fail(
        ErrnoError(Describe(op->write, path, r.offset, r.len) + " failed", static_cast<int>(-res)));
  } else if (res == 0) {
    ++errors_;
    op->Fail(DataLossError(Describe(op->write, path, r.offset, r.len) +
                           " transferred nothing: the swap file ends early (truncated?)"));
  } else if (static_cast<uint64_t>(res) < r.len) {
    // A short transfer: resubmit the remainder.
    ++short_;
    (op->write ? bytes_written_ : bytes_read_) += static_cast<uint64_t>(res);
    r.offset += static_cast<uint64_t>(res);
    r.buf = static_cast<uint8_t*>(r.buf) + res;
    r.len -= static_cast<uint32_t>(res);
    Status s = io_->Resubmit(&r);
    if (s.ok()) return;
    op->Fail(std::move(s).WithContext("resubmitting a short transfer"));
  } else {
    (op->write ? bytes_written_ : bytes_read_) += static_cast<uint64_t>(res);
  }
  op->FinishOne();
}

StatusOr<NvmeStore::Ticket> NvmeStore::Submit(const NvmeExtent& extent, void* buf, bool write) {
  if (buf == nullptr || reinterpret_cast<uintptr_t>(buf) % kNvmeAlignment != 0) {
    return InvalidArgumentError("NVMe buffers must be 4 KiB aligned (use the pinned arena)");
  }
  auto op = std::make_shared<Operation>();
  op->store = this;
  op->write = write;
  op->extent_id = extent.id;
  op->buf = static_cast<uint8_t*>(buf);
  std::vector<Piece> pieces;
  {
    MutexLock lock(mu_);
    auto it = registry_->extents.find(extent.id);
    if (it == registry_->extents.end()) {
      return InvalidArgumentError("I/O on unknown NVMe extent " + std::to_string(extent.id));
    }
    pieces = it->second.pieces;
    op->bytes = it->second.bytes;
    if (!write && options_.checksums) {
      if (!it->second.crc_valid) {
        return DataLossError("NVMe extent " + std::to_string(extent.id) +
                             " has no checksum: it was never written successfully");
      }
      op->check_crc = true;
      op->expected_crc = it->second.crc;
    }
  }
  if (write && options_.checksums) op->write_crc = Crc32c(buf, op->bytes);

  for (const Piece& p : pieces) {
    for (uint64_t done = 0; done < p.bytes; done += options_.block_bytes) {
      IoRequest r;
      r.op = write ? IoRequest::Op::kWrite : IoRequest::Op::kRead;
      r.file = p.file;
      r.offset = p.offset + done;
      r.buf = op->buf + p.extent_offset + done;
      r.len = static_cast<uint32_t>(std::min(options_.block_bytes, p.bytes - done));
      op->requests.push_back(std::move(r));
    }
  }
  {
    MutexLock lock(op->mu);  // not yet shared with another thread: for the annotations
    op->pending = static_cast<int>(op->requests.size());
  }
  Operation* raw = op.get();
  for (size_t i = 0; i < op->requests.size(); ++i) {
    IoRequest& r = op->requests[i];
    const std::string& path = files_[static_cast<size_t>(r.file)]->path;
    r.done = [this, raw, &r, &path](int64_t res) { Complete(raw, r, path, res); };
  }
  // Counted live once nothing that may throw is left before its submission (a std::function's
  // allocation above, under a memory limit): an operation counted and then dropped failed
  // ~NvmeStore's check that none is in flight, an abort in place of the error.
  ++live_operations_;
  // Submit after every request is set up: completions may start arriving at once.
  for (size_t i = 0; i < op->requests.size(); ++i) {
    Status s = io_->Submit(&op->requests[i]);
    if (!s.ok()) {
      // The rest will never complete: account them as failed so waiters wake.
      op->Fail(std::move(s));
      for (size_t j = i; j < op->requests.size(); ++j) op->FinishOne();
      break;
    }
  }
  Ticket t;
  t.op_ = std::move(op);
  return t;
}

StatusOr<NvmeStore::Ticket> NvmeStore::SubmitWrite(const NvmeExtent& extent, const void* buf) {
  // The buffer is only read by a write; the shared Operation type holds a mutable pointer.
  return Submit(extent, const_cast<void*>(buf), /*write=*/true);
}

StatusOr<NvmeStore::Ticket> NvmeStore::SubmitRead(const NvmeExtent& extent, void* buf) {
  return Submit(extent, buf, /*write=*/false);
}

Status NvmeStore::Write(const NvmeExtent& extent, const void* buf) {
  ASSIGN_OR_RETURN(Ticket t, SubmitWrite(extent, buf));
  return t.Wait();
}

Status NvmeStore::Read(const NvmeExtent& extent, void* buf) {
  ASSIGN_OR_RETURN(Ticket t, SubmitRead(extent, buf));
  return t.Wait();
}

// Note [Register reused buffers]
// Without fixed buffers the kernel pins the user pages of every request. Measured on this
// machine's VM (4 MiB requests, depth 32): reading into one fresh 1 GiB buffer ran at ~1.5 GB/s,
// but cycling through 32 reused 4 MiB buffers at ~1.0 GB/s, repeating pins of the same pages
// being the expensive case. The engine's pinned arenas are exactly such reused buffers, so their
// owners register them here.
Status NvmeStore::RegisterBuffers(const std::vector<std::pair<void*, size_t>>& regions) {
  MutexLock lock(mu_);
  std::vector<std::pair<void*, size_t>> all = registered_;
  for (const auto& r : regions) {
    if (std::find(all.begin(), all.end(), r) == all.end()) all.push_back(r);
  }
  RETURN_IF_ERROR(io_->RegisterBuffers(all));
  registered_ = std::move(all);
  return Status::OK();
}

std::string NvmeStore::backend_name() const { return io_->name(); }

uint64_t NvmeStore::capacity_bytes() const {
  MutexLock lock(mu_);
  uint64_t total = 0;
  for (auto& f : files_) total += f->space->capacity();
  return total;
}

NvmeStats NvmeStore::stats() const {
  NvmeStats s;
  {
    MutexLock lock(mu_);
    s.space = space_;
  }
  s.bytes_read = bytes_read_;
  s.bytes_written = bytes_written_;
  s.requests = requests_;
  s.short_transfers = short_;
  s.errors = errors_;
  return s;
}

}  // namespace tierzero

// NvmeStore: the NVMe tier. Preallocated swap files on one or more paths, an extent allocator,
// and asynchronous whole-extent reads and writes through a BlockIo (io_uring by default).
//
// - Space: at Open each path gets one swap file of `bytes_per_path`, preallocated with
//   fallocate; if the space is not there, Open fails naming the path, the bytes needed and the
//   bytes free. A path that is a directory gets a fresh, already-unlinked file (nothing is left
//   behind after a crash); a path that names a file is created and removed at close.
// - Extents: 4 KiB-aligned ranges from a best-fit allocator per file (SlabAllocator). An extent
//   of at least `stripe_min_bytes` is split into equal 4 KiB-aligned pieces, one per path, so
//   several devices add their bandwidth; smaller extents go to the path with the most free space.
// - I/O: each piece is cut into requests of at most `block_bytes`, with O_DIRECT where the
//   filesystem allows it (tmpfs does not: announced once, then buffered I/O). Every completion is
//   checked: a short transfer is resubmitted for the remainder; an error becomes a Status naming
//   the path, offset, length and errno; a read past the end of the file is DataLoss.
// - Integrity: with `checksums`, a CRC32C per extent is computed when written and verified when
//   read (DataLoss naming the extent on mismatch).
// - Buffers: 4 KiB aligned (the pinned arena's slots are), covering the extent's rounded size.
//   RegisterBuffers makes them io_uring fixed buffers.
//
// Thread-safety: every method may be called from any thread. Operations on different extents
// run concurrently; concurrent reads and writes of the same extent are the caller's to order.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/memory_stat.h"
#include "core/mutex.h"
#include "core/status.h"
#include "offload/block_io.h"

namespace tierzero {

inline constexpr uint64_t kNvmeAlignment = 4096;

enum class IoBackend : uint8_t { kAuto, kIoUring, kThreadPool };

struct NvmeStoreOptions {
  // Directories (a swap file is created inside) or file paths. At least one.
  std::vector<std::string> paths;
  // Swap file size per path, rounded up to 4 KiB. Required (> 0).
  uint64_t bytes_per_path = 0;
  // Largest single request. Default: 1 MiB.
  uint64_t block_bytes = uint64_t{1} << 20;
  // Extents at least this large are striped across all paths. Default: 4 MiB.
  uint64_t stripe_min_bytes = uint64_t{4} << 20;
  // Requests in flight. Default: 32.
  int queue_depth = 32;
  // kAuto: io_uring, falling back to the thread pool when io_uring is unavailable.
  IoBackend backend = IoBackend::kAuto;
  // Open with O_DIRECT (falls back to buffered I/O where unsupported). Default: true.
  bool direct_io = true;
  // io_uring SQPOLL (costs a polling kernel thread, i.e. a core). Default: false.
  bool sqpoll = false;
  // CRC32C per extent. Default: true. Measured (bench/RESULTS.md): 14-15 GB/s on one core, ten
  // times the disk's read speed; inside the swap pipeline the verification runs on the compute
  // thread while the next read is in flight, so it costs almost nothing, and it turns silent
  // corruption of a swap file into a DataLoss error naming the extent.
  bool checksums = true;
  // Wraps the BlockIo (tests put FaultInjectionBlockIo here). Default: none.
  std::function<std::unique_ptr<BlockIo>(std::unique_ptr<BlockIo>)> wrap_io;
};

// An allocated extent. Copyable handle; the store owns the metadata.
struct NvmeExtent {
  uint64_t id = 0;
  uint64_t bytes = 0;  // as requested
  bool valid() const { return id != 0; }
};

struct NvmeStats {
  MemoryStat space;  // bytes of extents (rounded to 4 KiB)
  uint64_t bytes_read = 0, bytes_written = 0;
  uint64_t requests = 0, short_transfers = 0, errors = 0;
};

class NvmeStore {
 public:
  class Operation;
  // A submitted read or write. Wait() (or Done()) on it; dropping it without waiting blocks in
  // the destructor until the I/O has finished, so buffers are never written after release.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(Ticket&& other) noexcept
        : op_(std::move(other.op_)), waited_(std::exchange(other.waited_, false)) {}
    Ticket& operator=(Ticket&&) noexcept;
    ~Ticket();
    // Blocks until the operation completes; its Status (and, for reads with checksums, the
    // verification). Calling it again returns the same Status.
    Status Wait();
    // True once every request of the operation has completed.
    bool Done() const;
    bool valid() const { return op_ != nullptr; }

   private:
    friend class NvmeStore;
    std::shared_ptr<Operation> op_;
    bool waited_ = false;
  };

  static StatusOr<std::unique_ptr<NvmeStore>> Open(const NvmeStoreOptions& options);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  // An extent of `bytes` (> 0). OutOfMemory naming the request and the free space when full.
  StatusOr<NvmeExtent> Allocate(uint64_t bytes);
  // REQUIRES: no I/O on the extent is in flight. Unknown extents are InvalidArgument.
  Status Free(const NvmeExtent& extent);

  // Asynchronous whole-extent transfers. `buf` is 4 KiB aligned and holds
  // RoundedBytes(extent) bytes. An argument error is returned here; I/O errors through Wait.
  StatusOr<Ticket> SubmitWrite(const NvmeExtent& extent, const void* buf);
  StatusOr<Ticket> SubmitRead(const NvmeExtent& extent, void* buf);
  // Synchronous forms.
  Status Write(const NvmeExtent& extent, const void* buf);
  Status Read(const NvmeExtent& extent, void* buf);

  // Adds host memory (a pinned arena) to the io_uring fixed buffers: requests whose buffer lies in
  // a registered region skip per-request page pinning. See Note [Register reused buffers]; do
  // this at setup, with no I/O in flight (the ring re-registers the whole set). Regions
  // registered before stay registered.
  Status RegisterBuffers(const std::vector<std::pair<void*, size_t>>& regions);

  static uint64_t RoundedBytes(const NvmeExtent& e) {
    return (e.bytes + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment;
  }
  // "io_uring", "threadpool", ... and whether O_DIRECT is in use.
  std::string backend_name() const;
  bool direct_io() const { return direct_io_; }
  uint64_t capacity_bytes() const;
  // How many transfers of `bytes` can be in flight before a Submit waits for the queue (each is
  // cut into requests of at most block_bytes; queue_depth requests fly at once). At least 1.
  int TransfersInFlight(uint64_t bytes) const {
    const uint64_t requests =
        std::max<uint64_t>(1, (bytes + options_.block_bytes - 1) / options_.block_bytes);
    return std::max(1, static_cast<int>(static_cast<uint64_t>(options_.queue_depth) / requests));
  }
  NvmeStats stats() const;

 private:
  struct File;
  struct Piece;
  struct ExtentInfo;
  explicit NvmeStore(const NvmeStoreOptions& options);
  Status OpenFiles();
  StatusOr<Ticket> Submit(const NvmeExtent& extent, void* buf, bool write);
  void Complete(Operation* op, IoRequest& r, const std::string& path, int64_t res);

  NvmeStoreOptions options_;
  bool direct_io_ = true;
  std::vector<std::unique_ptr<File>> files_;
  std::unique_ptr<BlockIo> io_;
  mutable Mutex mu_;
  uint64_t next_id_ TZ_GUARDED_BY(mu_) = 1;
  struct Registry;
  std::unique_ptr<Registry> registry_ TZ_PT_GUARDED_BY(mu_);  // extent metadata
  MemoryStat space_ TZ_GUARDED_BY(mu_);
  std::atomic<int64_t> live_operations_{0};
  std::vector<std::pair<void*, size_t>> registered_ TZ_GUARDED_BY(mu_);
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0}, requests_{0}, short_{0}, errors_{0};
};

}  // namespace tierzero

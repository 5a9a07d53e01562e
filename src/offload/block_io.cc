#include "offload/block_io.h"

#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <optional>
#include <semaphore>
#include <thread>

#include "core/check.h"
#include "core/logging.h"
#include "core/mutex.h"

namespace tierzero {
namespace {

// A limit on requests in flight, shared by the backends.
using InFlight = std::counting_semaphore<1 << 16>;

// Set by Resubmit while a completion callback runs on this thread: the permit of the completed
// request then carries over to the resubmitted one instead of being released.
thread_local bool t_resubmitted = false;

// user_data of a submission queue entry turned into a no-op after io_uring_submit failed.
char kIgnoredCompletion;

class UringBlockIo final : public BlockIo {
 public:
  UringBlockIo(int depth, bool sqpoll) : in_flight_(depth), sqpoll_(sqpoll) {}

  Status Init(const std::vector<int>& fds, int depth) {
    io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    if (sqpoll_) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = 2000;  // ms before the poller sleeps
    }
    int r = io_uring_queue_init_params(static_cast<unsigned>(depth), &ring_, &params);
    if (r < 0) {
      // Why a ring may not be had, said with what to change (the caller falls back to threads).
      std::string why;
      if (-r == ENOMEM)
        why =
            "; before Linux 5.12 a ring's memory counts against the locked-memory limit: "
            "raise it (ulimit -l)";
      else if (-r == EPERM || -r == ENOSYS)
        why =
            "; io_uring is disabled here (the kernel's io_uring_disabled setting, or a "
            "container's seccomp profile)";
      const Status e = ErrnoError("io_uring setup (depth " + std::to_string(depth) + ")", -r,
                                  StatusCode::kUnavailable);
      return Status(e.code(), std::string(e.message()) + why);
    }
    ring_ready_ = true;
    fds_ = fds;
    r = io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size()));
    if (r < 0) return ErrnoError("io_uring_register_files", -r, StatusCode::kUnavailable);
    completer_ = std::thread([this] { CompletionLoop(); });
    return Status::OK();
  }

  ~UringBlockIo() override {
    if (completer_.joinable()) {
      {
        // A NOP with no request is the stop signal; it completes after everything before it.
        MutexLock lock(sq_mu_);
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        while (sqe == nullptr) {
          io_uring_submit(&ring_);
          sqe = io_uring_get_sqe(&ring_);
        }
        io_uring_prep_nop(sqe);
        sqe->flags |= IOSQE_IO_DRAIN;  // completes only after everything submitted before it
        io_uring_sqe_set_data(sqe, nullptr);
        io_uring_submit(&ring_);
      }
      completer_.join();
    }
    if (ring_ready_) io_uring_queue_exit(&ring_);
  }

  Status Submit(IoRequest* req) override {
    in_flight_.acquire();
    Status s = Queue(req);
    if (!s.ok()) in_flight_.release();
    return s;
  }

  Status Resubmit(IoRequest* req) override {
    Status s = Queue(req);
    if (s.ok()) t_resubmitted = true;  // the completing request's permit carries over
    return s;
  }

  Status Queue(IoRequest* req) {
    MutexLock lock(sq_mu_);
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    TZ_CHECK(sqe != nullptr) << "io_uring submission queue full despite the in-flight limit";
    const int fixed = FixedIndex(req->buf, req->len);
    if (req->op == IoRequest::Op::kRead) {
      if (fixed >= 0) {
        io_uring_prep_read_fixed(sqe, req->file, req->buf, req->len, req->offset, fixed);
      } else {
        io_uring_prep_read(sqe, req->file, req->buf, req->len, req->offset);
      }
    } else {
      if (fixed >= 0) {
        io_uring_prep_write_fixed(sqe, req->file, req->buf, req->len, req->offset, fixed);
      } else {
        io_uring_prep_write(sqe, req->file, req->buf, req->len, req->offset);
      }
    }
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, req);
    int r;
    int tries = 0;
    while ((r = io_uring_submit(&ring_)) < 0 && (r == -EINTR || r == -EAGAIN || r == -EBUSY) &&
           ++tries < 1000) {
      std::this_thread::yield();
    }
    if (r < 0) {
      // The entry is still in the ring and the next submit would issue it: make it a no-op the
      // completion loop ignores, so the request is truly not queued.
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, &kIgnoredCompletion);
      return ErrnoError("io_uring_submit", -r);
    }
    return Status::OK();
  }

  Status RegisterBuffers(const std::vector<std::pair<void*, size_t>>& regions) override {
    MutexLock lock(sq_mu_);
    if (!regions_.empty()) {
      io_uring_unregister_buffers(&ring_);
      regions_.clear();
    }
    std::vector<iovec> iov;
    for (auto [p, n] : regions) iov.push_back({p, n});
    int r = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (r < 0) {
      const Status e = ErrnoError("io_uring_register_buffers", -r);
      if (-r != ENOMEM) return e;
      return Status(e.code(), std::string(e.message()) +
                                  "; registered buffers are locked memory: this process's limit "
                                  "on it (ulimit -l) is too low for them (the I/O still runs, "
                                  "through unregistered buffers)");
    }
    regions_ = regions;
    return Status::OK();
  }

  std::string name() const override { return sqpoll_ ? "io_uring+sqpoll" : "io_uring"; }

 private:
  // The registered region holding [buf, buf+len), or -1.
  int FixedIndex(const void* buf, size_t len) const TZ_REQUIRES(sq_mu_) {
    auto* b = static_cast<const uint8_t*>(buf);
    for (size_t i = 0; i < regions_.size(); ++i) {
      auto* r = static_cast<const uint8_t*>(regions_[i].first);
      if (b >= r && b + len <= r + regions_[i].second) return static_cast<int>(i);
    }
    return -1;
  }

  void CompletionLoop() {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int r = io_uring_wait_cqe(&ring_, &cqe);
      if (r == -EINTR) continue;
      TZ_CHECK(r == 0) << "io_uring_wait_cqe failed: " << std::strerror(-r);
      auto* req = static_cast<IoRequest*>(io_uring_cqe_get_data(cqe));
      const int64_t res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (req == nullptr) return;  // stop signal
      if (static_cast<void*>(req) == &kIgnoredCompletion) continue;
      t_resubmitted = false;
      // (may Resubmit, keeping the permit; must not touch req afterwards)
      req->done(res == -ECANCELED ? RunHere(*req) : res);
      if (!t_resubmitted) in_flight_.release();
    }
  }

  // Note [A request io_uring cancels runs here]
  // Nothing here cancels a request, but the kernel does when it cannot start an io-wq worker for
  // it (a write to a regular file, a read that would block): a worker is a thread of this user,
  // so under the user's limit on processes (`ulimit -u`, a container's pids limit) a request
  // completed with ECANCELED and the run failed, at set-up or in any later step where one more
  // worker was wanted (a default run under `ulimit -u 12`: "Operation canceled"). Such a request
  // is done on the completion thread with pread/pwrite instead: slower while the limit binds,
  // the same bytes.
  int64_t RunHere(const IoRequest& req) {
    TZ_LOG_ONCE(kWarn, kNvme)
        << "io_uring cancelled a request (it could not start a worker thread: "
           "this user's limit on processes and threads, ulimit -u, or a "
           "container's pids limit?); such requests run synchronously";
    const int fd = fds_[static_cast<size_t>(req.file)];
    for (;;) {
      const ssize_t n = req.op == IoRequest::Op::kRead
                            ? ::pread(fd, req.buf, req.len, static_cast<off_t>(req.offset))
                            : ::pwrite(fd, req.buf, req.len, static_cast<off_t>(req.offset));
      if (n < 0 && errno == EINTR) continue;
      return n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
    }
  }

  io_uring ring_{};
  bool ring_ready_ = false;
  std::vector<int> fds_;  // the registered files, by index (RunHere)
  InFlight in_flight_;
  const bool sqpoll_;
  Mutex sq_mu_;
  std::vector<std::pair<void*, size_t>> regions_ TZ_GUARDED_BY(sq_mu_);
  std::thread completer_;
};

class ThreadPoolBlockIo final : public BlockIo {
 public:
  ThreadPoolBlockIo(std::vector<int> fds, int depth) : fds_(std::move(fds)), in_flight_(depth) {}
  // Its workers, started outside the constructor: a thread the system will not start (`ulimit
  // -u`, a container's pids limit) is an error, and the destructor stops and joins the ones
  // that started (thrown from a constructor, running threads were destroyed: std::terminate).
  Status Start(int threads) {
    for (int i = 0; i < threads; ++i) {
      Status s = CatchingExceptions([&] {
        workers_.emplace_back([this] { Work(); });
        return Status::OK();
      });
      if (!s.ok()) return s.WithContext("starting the thread-pool NVMe I/O's workers");
    }
    return Status::OK();
  }
  ~ThreadPoolBlockIo() override {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    cv_.NotifyAll();
    for (auto& t : workers_) t.join();
  }

  Status Submit(IoRequest* req) override {
    in_flight_.acquire();
    Status s = Resubmit(req);
    if (!s.ok()) in_flight_.release();  // (not queued: its permit is not a worker's to give back)
    return s;
  }
  Status Resubmit(IoRequest* req) override {
    // A queue that cannot grow (memory out, under a limit) is this request's error: an
    // exception here escaped NvmeStore::Submit with its operation counted live and part of it
    // queued, and ~NvmeStore's check aborted (review 46).
    try {
      MutexLock lock(mu_);
      queue_.push_back(req);
    } catch (const std::bad_alloc&) {
      return OutOfMemoryError("queueing an NVMe request: no memory for the I/O queue");
    }
    cv_.NotifyOne();
    t_resubmitted = true;  // harmless outside a callback: Work() resets it before each one
    return Status::OK();
  }
  Status RegisterBuffers(const std::vector<std::pair<void*, size_t>>&) override {
    return Status::OK();
  }
  std::string name() const override { return "threadpool"; }

 private:
  void Work() {
    for (;;) {
      IoRequest* req;
      {
        MutexLock lock(mu_);
        cv_.Wait(lock, [&]() TZ_REQUIRES(mu_) { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        req = queue_.front();
        queue_.pop_front();
      }
      const int fd = fds_[static_cast<size_t>(req->file)];
      ssize_t r = req->op == IoRequest::Op::kRead
                      ? ::pread(fd, req->buf, req->len, static_cast<off_t>(req->offset))
                      : ::pwrite(fd, req->buf, req->len, static_cast<off_t>(req->offset));
      const int64_t res = r < 0 ? -errno : r;
      t_resubmitted = false;
      req->done(res);
      if (!t_resubmitted) in_flight_.release();
    }
  }

  std::vector<int> fds_;
  InFlight in_flight_;
  Mutex mu_;
  CondVar cv_;
  std::deque<IoRequest*> queue_ TZ_GUARDED_BY(mu_);
  bool stopping_ TZ_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace

StatusOr<std::unique_ptr<BlockIo>> CreateUringBlockIo(const std::vector<int>& fds,
                                                      const BlockIoOptions& options) {
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return InvalidArgumentError("io queue depth " + std::to_string(options.queue_depth) +
                                " is out of range; expected 1..4096");
  }
  auto io = std::make_unique<UringBlockIo>(options.queue_depth, options.sqpoll);
  RETURN_IF_ERROR(io->Init(fds, options.queue_depth));
  return std::unique_ptr<BlockIo>(std::move(io));
}

StatusOr<std::unique_ptr<BlockIo>> CreateThreadPoolBlockIo(const std::vector<int>& fds,
                                                           const BlockIoOptions& options) {
  if (options.queue_depth < 1 || options.threads < 1) {
    return InvalidArgumentError("thread-pool I/O needs queue_depth >= 1 and threads >= 1");
  }
  auto io = std::make_unique<ThreadPoolBlockIo>(fds, options.queue_depth);
  RETURN_IF_ERROR(io->Start(options.threads));
  return std::unique_ptr<BlockIo>(std::move(io));
}

// ---- Fault injection
// -----------------------------------------------------------------------------

struct FaultInjectionBlockIo::State {
  Mutex mu;
  std::vector<BlockIoFault> faults TZ_GUARDED_BY(mu);
  int injected TZ_GUARDED_BY(mu) = 0;
};

FaultInjectionBlockIo::FaultInjectionBlockIo(std::unique_ptr<BlockIo> target)
    : target_(std::move(target)), state_(std::make_unique<State>()) {}

FaultInjectionBlockIo::~FaultInjectionBlockIo() = default;

void FaultInjectionBlockIo::Inject(BlockIoFault fault) {
  MutexLock lock(state_->mu);
  state_->faults.push_back(fault);
}

void FaultInjectionBlockIo::Clear() {
  MutexLock lock(state_->mu);
  state_->faults.clear();
}

int FaultInjectionBlockIo::injected() const {
  MutexLock lock(state_->mu);
  return state_->injected;
}

Status FaultInjectionBlockIo::Submit(IoRequest* req) { return Apply(req, false); }
Status FaultInjectionBlockIo::Resubmit(IoRequest* req) { return Apply(req, true); }

Status FaultInjectionBlockIo::Apply(IoRequest* req, bool resubmit) {
  auto forward = [&](IoRequest* r) { return resubmit ? target_->Resubmit(r) : target_->Submit(r); };
  std::optional<BlockIoFault> hit;
  {
    MutexLock lock(state_->mu);
    for (BlockIoFault& f : state_->faults) {
      if (f.op != req->op || f.count <= 0) continue;
      if (f.skip > 0) {
        --f.skip;
        continue;
      }
      --f.count;
      ++state_->injected;
      hit = f;
      break;
    }
  }
  if (!hit) return forward(req);
  switch (hit->kind) {
    case BlockIoFault::Kind::kFail:
      req->done(-hit->error_code);
      return Status::OK();
    case BlockIoFault::Kind::kShorten: {
      const uint32_t half = std::max<uint32_t>(4096, (req->len / 2) & ~uint32_t{4095});
      if (half >= req->len) return forward(req);  // too small to shorten
      auto* shorter = new IoRequest(*req);
      shorter->len = half;
      // The wrapper request deletes itself last ("delete this"): nothing touches the lambda's
      // captures after the delete.
      shorter->done = [req, shorter](int64_t res) {
        IoRequest* original = req;
        delete shorter;
        original->done(res);
      };
      return forward(shorter);
    }
    case BlockIoFault::Kind::kDelay: {
      auto* delayed = new IoRequest(*req);
      const int ms = hit->delay_ms;
      delayed->done = [req, delayed, ms](int64_t res) {
        IoRequest* original = req;  // copies first: the delete ends the captures' lifetime
        const int wait_ms = ms;
        delete delayed;
        std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
        original->done(res);
      };
      return forward(delayed);
    }
  }
  return Status::OK();
}

}  // namespace tierzero

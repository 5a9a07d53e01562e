#include "zero/device_collectives.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "zero/collective.h"
#include "zero/nccl.h"

namespace tierzero {
namespace {

using zero::CollectiveKind;

bool InPlace(const void* block, const void* whole, int rank, size_t block_bytes) {
  return block == static_cast<const uint8_t*>(whole) + static_cast<size_t>(rank) * block_bytes;
}

// The simulated device: each collective runs in a host function of the stream, on a duplicate of
// the trainer's communicator, and is waited for there (so the stream's later work sees its
// result). The stream's host functions run one at a time, in order, on the stream's thread: the
// only thread that starts collectives on the duplicate.
class HostFuncCollectives final : public DeviceCollectives {
 public:
  HostFuncCollectives(Device& device, Stream stream, std::shared_ptr<Communicator> comm)
      : device_(device), stream_(std::move(stream)), state_(std::make_shared<State>()) {
    state_->comm = std::move(comm);
    rank_ = state_->comm->rank();
    size_ = state_->comm->size();
  }
  ~HostFuncCollectives() override { (void)stream_.Synchronize(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return state_->comm->backend(); }
  StreamHandle stream() const override { return stream_.handle(); }

  Status AllGather(const void* send, void* recv, size_t count, DType dtype) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllGather, count, dtype, false));
    const size_t bytes = DTypeBytes(dtype, count);
    const bool in_place = InPlace(send, recv, rank_, bytes);
    Count(CollectiveKind::kAllGather, count, dtype);
    return Queue("all_gather", [=](State& st) -> Status {
      // MPI forbids a send buffer inside the receive buffer: send a copy.
      const void* s = send;
      if (in_place) {
        st.scratch.resize(bytes);
        std::memcpy(st.scratch.data(), send, bytes);
        s = st.scratch.data();
      }
      ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req, st.comm->AllGather(s, recv, count, dtype));
      return req->Wait();
    });
  }

  Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                       ReduceOp op) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kReduceScatter, count, dtype, true));
    Count(CollectiveKind::kReduceScatter, count, dtype);
    // Every backend reads all of send before it writes recv (communicator.h), so in place needs
    // no copy.
    return Queue("reduce_scatter", [=](State& st) -> Status {
      ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                       st.comm->ReduceScatter(send, recv, count, dtype, op));
      return req->Wait();
    });
  }

  Status Check() override {
    MutexLock lock(state_->mu);
    return state_->error;
  }
  Status Drain() override {
    RETURN_IF_ERROR(stream_.Synchronize());
    return Check();
  }
  CommStats stats() const override { return stats_; }

 private:
  struct State {
    std::shared_ptr<Communicator> comm;
    std::vector<uint8_t> scratch;  // the stream's thread only
    Mutex mu;
    Status error TZ_GUARDED_BY(mu);
  };

  void Count(CollectiveKind kind, size_t count, DType dtype) {
    ++stats_.collectives;
    stats_.bytes_sent += zero::BytesSent(kind, count, dtype, size_, false);
  }

  Status Queue(const char* what, std::function<Status(State&)> run) {
    std::shared_ptr<State> st = state_;
    return device_.LaunchHostFunc(stream_.handle(), [st, what, run = std::move(run)] {
      {
        MutexLock lock(st->mu);
        if (!st->error.ok()) return;  // out of step: later collectives would only wait
      }
      Status s = run(*st);
      if (s.ok()) return;
      MutexLock lock(st->mu);
      if (st->error.ok())
        st->error = std::move(s).WithContext(std::string(what) + " on the stream");
    });
  }

  Device& device_;
  Stream stream_;
  std::shared_ptr<State> state_;
  int rank_ = 0, size_ = 1;
  CommStats stats_;
};

// NCCL: the communicator queues each collective on its stream; the requests are kept until they
// complete, to see failures and deadlines. A watchdog thread tests them too: NCCL's deadline is
// enforced only by Test and Wait (which abort the communicator), and without it a collective
// waiting for a dead peer would hold every later synchronisation of the device forever.
class QueuedCollectives final : public DeviceCollectives {
 public:
  QueuedCollectives(Stream stream, std::shared_ptr<Communicator> comm)
      : stream_(std::move(stream)), comm_(std::move(comm)) {
    watchdog_ = std::thread([this] {
      MutexLock lock(mu_);
      while (!stop_) {
        cv_.WaitFor(lock, std::chrono::milliseconds(200));
        (void)ReapLocked();
      }
    });
  }
  ~QueuedCollectives() override {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    watchdog_.join();
    in_flight_.clear();  // each waits for its collective, up to the deadline
    comm_.reset();       // before its stream
  }

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  std::string backend() const override { return comm_->backend(); }
  StreamHandle stream() const override { return stream_.handle(); }

  Status AllGather(const void* send, void* recv, size_t count, DType dtype) override {
    MutexLock lock(mu_);
    RETURN_IF_ERROR(ReapLocked());
    ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req, comm_->AllGather(send, recv, count, dtype));
    in_flight_.push_back(std::move(req));
    return Status::OK();
  }
  Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                       ReduceOp op) override {
    MutexLock lock(mu_);
    RETURN_IF_ERROR(ReapLocked());
    ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                     comm_->ReduceScatter(send, recv, count, dtype, op));
    in_flight_.push_back(std::move(req));
    return Status::OK();
  }
  Status Check() override {
    MutexLock lock(mu_);
    return ReapLocked();
  }
  Status Drain() override {
    MutexLock lock(mu_);
    while (error_.ok() && !in_flight_.empty()) {
      Status s = in_flight_.front()->Wait();  // bounded by the deadline
      if (!s.ok()) error_ = std::move(s);
      in_flight_.pop_front();
    }
    return error_;
  }
  CommStats stats() const override { return comm_->stats(); }

 private:
  // Drops the completed requests at the front; the first failure is kept.
  Status ReapLocked() TZ_REQUIRES(mu_) {
    while (error_.ok() && !in_flight_.empty()) {
      StatusOr<bool> done = in_flight_.front()->Test();
      if (!done.ok()) {
        error_ = done.status();
        break;
      }
      if (!*done) {
        // Later requests may have passed their deadline while the front one waits: test them
        // too (each aborts the communicator when its own deadline is gone).
        for (size_t i = 1; i < in_flight_.size(); ++i) {
          StatusOr<bool> later = in_flight_[i]->Test();
          if (!later.ok()) {
            error_ = later.status();
            break;
          }
        }
        break;
      }
      in_flight_.pop_front();
    }
    return error_;
  }

  Stream stream_;
  std::shared_ptr<Communicator> comm_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ TZ_GUARDED_BY(mu_) = false;
  std::deque<std::unique_ptr<CommRequest>> in_flight_ TZ_GUARDED_BY(mu_);
  Status error_ TZ_GUARDED_BY(mu_);
  std::thread watchdog_;
};

}  // namespace

StatusOr<std::unique_ptr<DeviceCollectives>> CreateDeviceCollectives(
    Device& device, const std::shared_ptr<Communicator>& comm) {
  if (comm == nullptr) return InvalidArgumentError("device collectives need a communicator");
  switch (device.info().kind) {
    case DeviceKind::kHostSim: {
      // The stream's thread starts and waits for the collectives, so the communicator must
      // progress without its starting thread's help, and allow calls from another thread.
      if (!comm->asynchronous()) {
        return FailedPreconditionError(
            "collectives on the simulated device's stream need a communicator that progresses "
            "on its own (MPI's comm thread, which TZ_MPI_COMM_THREAD=0 turns off); set "
            "ranks.collectives to host");
      }
      auto stream = Stream::Create(device, "comm");
      // A collective follows (MPI_Comm_dup): a rank that failed must not leave the others in it.
      RETURN_IF_ERROR(AgreeOnStatus(*comm, stream.status()));
      ASSIGN_OR_RETURN(std::shared_ptr<Communicator> dup, comm->Duplicate());
      dup->SetTimeout(comm->timeout());
      return std::unique_ptr<DeviceCollectives>(
          new HostFuncCollectives(device, std::move(stream).value(), std::move(dup)));
    }
    case DeviceKind::kCuda: {
      auto created = Stream::Create(device, "comm");
      RETURN_IF_ERROR(AgreeOnStatus(*comm, created.status()));
      Stream stream = std::move(created).value();
      NcclOptions o;
      o.device = &device;
      o.stream = stream.handle();
      o.bootstrap = comm;
      o.timeout_s = comm->timeout();
      ASSIGN_OR_RETURN(std::shared_ptr<Communicator> nccl, CreateNcclCommunicator(o));
      return std::unique_ptr<DeviceCollectives>(
          new QueuedCollectives(std::move(stream), std::move(nccl)));
    }
  }
  return InvalidArgumentError("unknown device kind");
}

}  // namespace tierzero

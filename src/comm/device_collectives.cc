#include "comm/device_collectives.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/nccl.h"
#include "comm/quantized_stream.h"
#include "core/convert.h"
#include "core/mutex.h"

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
  // `node` and `cross` (Communicator::Split of comm) are null without node collectives.
  HostFuncCollectives(Device& device, Stream stream, std::shared_ptr<Communicator> comm,
                      std::shared_ptr<Communicator> node, std::shared_ptr<Communicator> cross)
      : device_(device), stream_(std::move(stream)), state_(std::make_shared<State>()) {
    state_->comm = std::move(comm);
    state_->node = std::move(node);
    state_->cross = std::move(cross);
    rank_ = state_->comm->rank();
    size_ = state_->comm->size();
    topology_ = state_->comm->topology();
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
    Count(zero::BytesSent(CollectiveKind::kAllGather, count, dtype, size_, false));
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
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kReduceScatter, count, dtype, true, op));
    Count(zero::BytesSent(CollectiveKind::kReduceScatter, count, dtype, size_, false));
    // Every backend reads all of send before it writes recv (communicator.h), so in place needs
    // no copy.
    return Queue("reduce_scatter", [=](State& st) -> Status {
      ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                       st.comm->ReduceScatter(send, recv, count, dtype, op));
      return req->Wait();
    });
  }

  int node_size() const override {
    return state_->node != nullptr ? state_->node->size() : topology_.local_size;
  }

  Status NodeAllGather(const void* send, void* recv, size_t count, DType dtype) override {
    RETURN_IF_ERROR(NeedNodes());
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllGather, count, dtype, false));
    const size_t bytes = DTypeBytes(dtype, count);
    const bool in_place = InPlace(send, recv, state_->node->rank(), bytes);
    ++stats_.collectives;
    stats_.bytes_sent +=
        zero::BytesSent(CollectiveKind::kAllGather, count, dtype, state_->node->size(), false);
    return Queue("all_gather inside the node", [=](State& st) -> Status {
      const void* s = send;
      if (in_place) {  // MPI forbids a send buffer inside the receive buffer
        st.scratch.resize(bytes);
        std::memcpy(st.scratch.data(), send, bytes);
        s = st.scratch.data();
      }
      ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req, st.node->AllGather(s, recv, count, dtype));
      return req->Wait();
    });
  }

  // Nothing to make in host memory, but the contract is the GPU's (device_collectives.h): a
  // quantization never prepared fails here too, so the simulated device's tests catch it.
  Status PrepareQuantized(const ShardQuantization& q) override {
    RETURN_IF_ERROR(NeedNodes());
    if (q.shards() != size_) return InvalidArgumentError("a quantization for other ranks");
    prepared_.insert(&q);
    return Status::OK();
  }
  Status QuantizedAllGather(const ShardQuantization& q, const void* send, void* recv,
                            DType dtype) override {
    RETURN_IF_ERROR(NeedNodes());
    RETURN_IF_ERROR(Prepared(q));
    Count(q.slot_bytes() * static_cast<uint64_t>(size_ - 1));
    const ShardQuantization* qp = &q;
    // QuantizedAllGather reads all of send before it writes recv: in place needs no copy.
    return Queue("quantized all_gather", [=](State& st) -> Status {
      return tierzero::QuantizedAllGather(*st.comm, *qp, send, dtype, recv, st.scratch);
    });
  }

  Status QuantizedReduceScatter(const ShardQuantization& q, const void* send, void* recv,
                                DType dtype) override {
    RETURN_IF_ERROR(NeedNodes());
    RETURN_IF_ERROR(Prepared(q));
    const auto l = static_cast<uint64_t>(state_->node->size());
    const auto n = static_cast<uint64_t>(state_->cross->size());
    // Inside the node (L - 1) x N slots leave; across nodes N - 1 (Note [Quantized collectives]).
    stats_.collectives += n > 1 ? 2 : 1;
    stats_.bytes_sent += q.slot_bytes() * ((l - 1) * n + (n - 1));
    stats_.bytes_cross_node += q.slot_bytes() * (n - 1);
    const ShardQuantization* qp = &q;
    return Queue("quantized reduce_scatter", [=](State& st) -> Status {
      st.mean.resize(qp->shard_elems());
      RETURN_IF_ERROR(tierzero::QuantizedReduceScatter(*st.node, *st.cross, *qp, send, dtype,
                                                       st.mean.data(), st.scratch));
      return Convert(st.mean.data(), DType::kF32, recv, dtype, qp->shard_elems());
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
    std::shared_ptr<Communicator> comm, node, cross;
    std::vector<uint8_t> scratch;  // the stream's thread only
    std::vector<float> mean;       // the stream's thread only
    Mutex mu;
    Status error TZ_GUARDED_BY(mu);
  };

  // One collective over every rank that sent `bytes`.
  void Count(uint64_t bytes) {
    ++stats_.collectives;
    stats_.bytes_sent += bytes;
    stats_.bytes_cross_node += zero::CrossNodeBytes(bytes, topology_);
  }
  Status NeedNodes() const {
    if (state_->node == nullptr) {
      return FailedPreconditionError(
          "collectives inside a node need device collectives created with node_collectives");
    }
    return Status::OK();
  }
  Status Prepared(const ShardQuantization& q) const {
    if (prepared_.count(&q) > 0) return Status::OK();
    return FailedPreconditionError(
        "a quantized collective with a quantization never prepared (PrepareQuantized at set-up)");
  }

  Status Queue(const char* what, std::function<Status(State&)> run) {
    std::shared_ptr<State> st = state_;
    return device_.LaunchHostFunc(stream_.handle(), [st, what, run = std::move(run)] {
      {
        MutexLock lock(st->mu);
        if (!st->error.ok()) return;  // out of step: later collectives would only wait
      }
      // (A host function must not throw: an exception of the collective's, oneTBB's when a
      // worker it wakes cannot start, say, is its error.)
      Status s;
      try {
        s = run(*st);
      } catch (...) {
        s = StatusOfCurrentException();
      }
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
  Topology topology_;
  CommStats stats_;
  std::set<const ShardQuantization*> prepared_;  // PrepareQuantized (the caller's thread)
};

// NCCL: the communicator queues each collective on its stream; the requests are kept until they
// complete, to see failures and deadlines. A watchdog thread tests them too: NCCL's deadline is
// enforced only by Test and Wait (which abort the communicator), and without it a collective
// waiting for a dead peer would hold every later synchronisation of the device forever. With
// node collectives, the node and cross-node communicators (ncclCommSplit) queue on the same
// stream, and ZeRO++'s quantized collectives are StreamQuantized's kernels and collectives there.
class QueuedCollectives final : public DeviceCollectives {
 public:
  // `node` and `cross` (Split of comm) are null without node collectives.
  QueuedCollectives(Device& device, Stream stream, std::shared_ptr<Communicator> comm,
                    std::shared_ptr<Communicator> node, std::shared_ptr<Communicator> cross)
      : stream_(std::move(stream)),
        comm_(std::move(comm)),
        node_(std::move(node)),
        cross_(std::move(cross)) {
    if (node_ != nullptr) {
      quantized_ =
          std::make_unique<StreamQuantized>(device, stream_.handle(), *comm_, *node_, *cross_);
    }
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
    // The quantization kernels after the last collectives may still be queued: their memory goes
    // once the stream is past them (every collective has finished or been aborted by now).
    if (quantized_ != nullptr) (void)stream_.Synchronize();
    quantized_.reset();
    cross_.reset();  // the communicators before their stream
    node_.reset();
    comm_.reset();
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
  int node_size() const override {
    return node_ != nullptr ? node_->size() : comm_->topology().local_size;
  }
  Status NodeAllGather(const void* send, void* recv, size_t count, DType dtype) override {
    RETURN_IF_ERROR(NeedNodes());
    MutexLock lock(mu_);
    RETURN_IF_ERROR(ReapLocked());
    ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req, node_->AllGather(send, recv, count, dtype));
    in_flight_.push_back(std::move(req));
    return Status::OK();
  }
  Status PrepareQuantized(const ShardQuantization& q) override {
    RETURN_IF_ERROR(NeedNodes());
    return quantized_->Prepare(q);
  }
  Status QuantizedAllGather(const ShardQuantization& q, const void* send, void* recv,
                            DType dtype) override {
    RETURN_IF_ERROR(NeedNodes());
    MutexLock lock(mu_);
    RETURN_IF_ERROR(ReapLocked());
    return Keep(quantized_->AllGather(q, send, recv, dtype, &queued_));
  }
  Status QuantizedReduceScatter(const ShardQuantization& q, const void* send, void* recv,
                                DType dtype) override {
    RETURN_IF_ERROR(NeedNodes());
    MutexLock lock(mu_);
    RETURN_IF_ERROR(ReapLocked());
    return Keep(quantized_->ReduceScatter(q, send, recv, dtype, &queued_));
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
  // The three communicators' counts: the node's collectives count nothing across nodes, the
  // cross-node ones everything (their split topologies say so).
  CommStats stats() const override {
    CommStats s = comm_->stats();
    for (const auto* c : {node_.get(), cross_.get()}) {
      if (c == nullptr) continue;
      const CommStats o = c->stats();
      s.collectives += o.collectives;
      s.bytes_sent += o.bytes_sent;
      s.bytes_cross_node += o.bytes_cross_node;
    }
    return s;
  }

 private:
  Status NeedNodes() const {
    if (node_ == nullptr) {
      return FailedPreconditionError(
          "collectives inside a node need device collectives created with node_collectives");
    }
    return Status::OK();
  }
  // Keeps the requests of what a quantized collective queued (queued_), also when a later stage
  // failed to queue; that failure is kept as the first failure too (the ranks are out of step).
  Status Keep(Status s) TZ_REQUIRES(mu_) {
    for (auto& r : queued_) in_flight_.push_back(std::move(r));
    queued_.clear();
    if (!s.ok() && error_.ok()) error_ = s;
    return s;
  }

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
  std::shared_ptr<Communicator> comm_, node_, cross_;
  std::unique_ptr<StreamQuantized> quantized_;  // with node collectives
  Mutex mu_;
  std::vector<std::unique_ptr<CommRequest>> queued_ TZ_GUARDED_BY(mu_);  // Keep's
  CondVar cv_;
  bool stop_ TZ_GUARDED_BY(mu_) = false;
  std::deque<std::unique_ptr<CommRequest>> in_flight_ TZ_GUARDED_BY(mu_);
  Status error_ TZ_GUARDED_BY(mu_);
  std::thread watchdog_;
};

}  // namespace

Status CheckNodeMajor(const Topology& t) {
  if (t.local_size < 1 || t.size % t.local_size != 0 || t.nodes * t.local_size != t.size ||
      t.rank != t.node * t.local_size + t.local_rank) {
    return InvalidArgumentError(
        "ZeRO++ needs the ranks numbered node by node with as many on every node, but rank " +
        std::to_string(t.rank) + " of " + std::to_string(t.size) + " is local rank " +
        std::to_string(t.local_rank) + " of " + std::to_string(t.local_size) + " on node " +
        std::to_string(t.node) + " of " + std::to_string(t.nodes) +
        "; launch with mpirun --map-by core (ranks filled node by node), or set "
        "ranks.ranks_per_node to a divisor of the ranks");
  }
  return Status::OK();
}

StatusOr<std::unique_ptr<DeviceCollectives>> CreateDeviceCollectives(
    Device& device, const std::shared_ptr<Communicator>& comm,
    const DeviceCollectivesOptions& options) {
  if (comm == nullptr) return InvalidArgumentError("device collectives need a communicator");
  if (options.node_collectives) {
    // Every rank checks its own place, and they fail together before the splits.
    RETURN_IF_ERROR(AgreeOnStatus(*comm, CheckNodeMajor(comm->topology())));
  }
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
      std::shared_ptr<Communicator> node, cross;
      if (options.node_collectives) {
        ASSIGN_OR_RETURN(node, dup->Split(SplitBy::kNode));
        ASSIGN_OR_RETURN(cross, dup->Split(SplitBy::kLocalRank));
        node->SetTimeout(comm->timeout());
        cross->SetTimeout(comm->timeout());
      }
      return std::unique_ptr<DeviceCollectives>(new HostFuncCollectives(
          device, std::move(stream).value(), std::move(dup), std::move(node), std::move(cross)));
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
      std::shared_ptr<Communicator> node, cross;
      if (options.node_collectives) {
        // ncclCommSplit: the same GPU and stream, the ranks of this node / of this local rank.
        ASSIGN_OR_RETURN(node, nccl->Split(SplitBy::kNode));
        ASSIGN_OR_RETURN(cross, nccl->Split(SplitBy::kLocalRank));
        node->SetTimeout(comm->timeout());
        cross->SetTimeout(comm->timeout());
      }
      return std::unique_ptr<DeviceCollectives>(new QueuedCollectives(
          device, std::move(stream), std::move(nccl), std::move(node), std::move(cross)));
    }
  }
  return InvalidArgumentError("unknown device kind");
}

}  // namespace tierzero

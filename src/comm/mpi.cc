// The MPI communicator: host buffers, non-blocking collectives on a duplicate of
// MPI_COMM_WORLD with MPI_ERRORS_RETURN (an MPI failure is a Status naming the collective).
// bf16 and fp16 reductions are user-defined MPI operations that add in fp32.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "core/mutex.h"
#include "core/tunable.h"

namespace tierzero {

namespace {

// A collective of this process given up (Note [Collective deadlines]) or failed by MPI, on any of
// its communicators (the engine's are duplicates of the trainer's): Communicator::gave_up.
std::atomic<bool> g_gave_up{false};

TZ_TUNABLE(bool, kMpiCommThread, "TZ_MPI_COMM_THREAD", true,
           "run MPI collectives on their own comm thread when MPI allows it (0: on the caller's "
           "thread; Note [The MPI comm thread])");
TZ_TUNABLE_RANGE(double, kEmulatedCrossNodeGBps, "TZ_EMULATE_CROSS_NODE_GBPS", 0.0,
                 "benchmarks and tests only: hold each MPI collective until this rank's "
                 "cross-node bytes would have crossed a link of this many GB/s (0: off; Note [An "
                 "emulated slow link])",
                 0.0, 1e6);
}  // namespace
namespace {

using zero::CollectiveKind;

Status MpiError(int code, const std::string& what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return InternalError("MPI " + what + " failed: " + std::string(text, static_cast<size_t>(len)));
}

// User-defined reductions for 16-bit floats (MPI has no bf16 or fp16 type).
template <DType D, ReduceOp O>
void Reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  zero::ReduceInto(inout, in, static_cast<size_t>(*len), D, O);
}

struct Ops {
  MPI_Op bf16_sum, bf16_max, f16_sum, f16_max;
};
const Ops& GetOps() {
  static Ops ops = [] {
    Ops o;
    MPI_Op_create(&Reduce16<DType::kBF16, ReduceOp::kSum>, 1, &o.bf16_sum);
    MPI_Op_create(&Reduce16<DType::kBF16, ReduceOp::kMax>, 1, &o.bf16_max);
    MPI_Op_create(&Reduce16<DType::kF16, ReduceOp::kSum>, 1, &o.f16_sum);
    MPI_Op_create(&Reduce16<DType::kF16, ReduceOp::kMax>, 1, &o.f16_max);
    return o;
  }();
  return ops;
}

// One lock around every MPI call of the process (tierzero's), so that the comm thread, the
// caller's Abort and the exit's MPI_Finalize never call MPI at the same time: what
// MPI_THREAD_SERIALIZED asks of us.
Mutex& MpiLock() {
  static auto* mu = new Mutex();
  return *mu;
}

void FinalizeAtExit() {
  MutexLock lock(MpiLock());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// Note [Collective deadlines]
// A rank that dies under mpirun takes the job down (mpirun kills the others), and a rank that
// fails with an error calls Communicator::Abort. What remains is a rank that is alive but never
// joins the collective the others wait in (a bug, a diverged program). MPI_Wait would block
// forever; collectives are polled with MPI_Test instead and given up after the communicator's
// timeout (counted from the call that started them) with DeadlineExceeded, which the trainer
// reports before aborting. A collective cannot be cancelled, so the communicator is unusable
// after that, and what its completion step owns (reduce_scatter's exchange buffer) is kept
// alive: MPI may still write into it.
//
// Note [The MPI comm thread]
// Non-blocking MPI collectives move data only inside MPI calls (Open MPI's libnbc progresses
// in MPI_Test). Called from the trainer, a gather's all_gather would advance only while the
// trainer waits for it, so it could not overlap compute. Instead, when MPI runs at
// MPI_THREAD_SERIALIZED or above, one thread per communicator (the comm stream of DESIGN.md
// section 6) starts the collectives in the order they were called and polls the ones in flight
// (yielding the core between polls, which oversubscribed runs need). A request may be waited
// for from any thread: the thread that started it also drives the queue while it waits (when
// the comm thread is not driving: a waited-for agreement then needs no thread hand-off); any
// other thread sleeps until the collective completes, making no MPI call, so a device stream's
// host function can wait for a gather's all_gather (CUDA forbids host functions that call into
// CUDA, which a CUDA-aware MPI may do). Completion steps (reduce_scatter's sum of the exchanged
// blocks, the mean's division) run on the driving thread. Below SERIALIZED (a program that
// initialised MPI FUNNELED itself) or with TZ_MPI_COMM_THREAD=0 the caller's Wait and Test drive
// the same queue, on the caller's thread; asynchronous() tells callers which.
// Note [An emulated slow link]
// ZeRO++ matters where the links between nodes are slow, which one machine cannot show: its
// "nodes" (ranks_per_node) share memory. With TZ_EMULATE_CROSS_NODE_GBPS = B, each rank has one
// outgoing cross-node link of B GB/s, busy for a collective's cross-node bytes
// (CommStats::bytes_cross_node) from when the collective starts or the link frees up, whichever
// is later; the collective completes no earlier than that. Collectives inside a node are not
// held. It models a rank's own sends only (every rank of a symmetric collective sends as much as
// it receives), and it is a simulation: figures measured with it say so.
std::chrono::steady_clock::time_point LinkDoneAt(uint64_t cross_bytes) {
  static std::chrono::steady_clock::time_point link_free;  // guarded by MpiLock()
  const auto now = std::chrono::steady_clock::now();
  const double gbps = kEmulatedCrossNodeGBps.Get();
  if (gbps <= 0 || cross_bytes == 0) return now;
  // (At most 10^6 s a collective: a rate near 1e-300 GB/s made a wait whose nanoseconds
  // overflowed the clock, a time in the past, and no throttle at all.)
  const double seconds = std::min(static_cast<double>(cross_bytes) / (gbps * 1e9), 1e6);
  link_free =
      std::max(link_free, now) + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                     std::chrono::duration<double>(seconds));
  return link_free;
}

struct MpiOp {
  std::function<int(MPI_Request*)> start;            // the MPI_I* call
  uint64_t cross_node_bytes = 0;                     // for the emulated link
  std::chrono::steady_clock::time_point not_before;  // the emulated link's completion
  std::function<void()> on_done;                     // the local completion step; may be empty
  std::string what;
  std::chrono::steady_clock::time_point called;
  std::thread::id caller;  // the thread that started it (the one that may drive the queue)
  MPI_Request req = MPI_REQUEST_NULL;
  bool started = false;
  bool done = false;  // guarded by the queue's mutex
  Status status;
};

class MpiQueue {
 public:
  MpiQueue(bool threaded, double timeout_s) : threaded_(threaded), timeout_s_(timeout_s) {
    if (threaded_) thread_ = std::thread([this] { Loop(); });
  }
  ~MpiQueue() {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    if (thread_.joinable()) thread_.join();
  }
  bool threaded() const { return threaded_; }
  void SetTimeout(double s) {
    MutexLock lock(mu_);
    timeout_s_ = s;
  }

  // Queues `op`; without the thread it is started here, before the call returns.
  void Submit(const std::shared_ptr<MpiOp>& op) {
    op->called = std::chrono::steady_clock::now();
    op->caller = std::this_thread::get_id();
    {
      MutexLock lock(mu_);
      queued_.push_back(op);
    }
    if (threaded_) {
      cv_.NotifyAll();
    } else {
      Drive();
    }
  }

  // The thread that started a collective drives the queue itself while it waits, whenever the
  // comm thread is not, so a collective it waits for completes without two thread hand-offs
  // (the agreements' small all_gathers are latency-bound). Any other thread (a device stream's
  // host function, which must make no MPI call that could call CUDA) sleeps until the driver
  // completes the collective.
  Status Wait(const std::shared_ptr<MpiOp>& op) {
    if (threaded_ && std::this_thread::get_id() != op->caller) {
      MutexLock lock(mu_);
      done_cv_.Wait(lock, [&]() TZ_REQUIRES(mu_) { return op->done; });
      return op->status;
    }
    for (;;) {
      {
        MutexLock lock(mu_);
        if (op->done) return op->status;
      }
      Help();
      std::this_thread::yield();
    }
  }
  StatusOr<bool> Test(const std::shared_ptr<MpiOp>& op) {
    if (!threaded_ || std::this_thread::get_id() == op->caller) Help();
    MutexLock lock(mu_);
    if (!op->done) return false;
    if (!op->status.ok()) return op->status;
    return true;
  }

 private:
  // Drives the queue unless another thread is driving it (then that one makes the progress).
  void Help() {
    if (!drive_mu_.TryLock()) return;
    DriveLocked();
    drive_mu_.Unlock();
  }
  // Returns whether collectives remain in flight.
  bool Drive() {
    MutexLock drive(drive_mu_);
    return DriveLocked();
  }
  // Starts what was queued (in order), polls what is in flight, completes and times out.
  // Returns whether collectives remain in flight. On the comm thread or a waiter's thread, one
  // at a time (drive_mu_ held).
  bool DriveLocked() TZ_REQUIRES(drive_mu_) {
    std::vector<std::shared_ptr<MpiOp>> fresh;
    double timeout_s;
    {
      MutexLock lock(mu_);
      fresh.swap(queued_);
      timeout_s = timeout_s_;
    }
    std::vector<std::shared_ptr<MpiOp>> finished;
    {
      MutexLock mpi(MpiLock());
      for (auto& op : fresh) {
        const int rc = op->start(&op->req);
        op->started = true;
        op->not_before = LinkDoneAt(op->cross_node_bytes);
        if (rc != MPI_SUCCESS) {
          op->status = MpiError(rc, op->what);
          op->on_done = nullptr;
          finished.push_back(op);
        } else {
          inflight_.push_back(op);
        }
      }
      const auto now = std::chrono::steady_clock::now();
      for (size_t i = 0; i < inflight_.size();) {
        MpiOp& op = *inflight_[i];
        int flag = 0;
        const int rc = MPI_Test(&op.req, &flag, MPI_STATUS_IGNORE);
        bool finish = true;
        if (rc != MPI_SUCCESS) {
          op.status = MpiError(rc, op.what);
          op.on_done = nullptr;
          g_gave_up = true;
        } else if (!flag || now < op.not_before) {
          if (!flag && std::chrono::duration<double>(now - op.called).count() > timeout_s) {
            static auto* abandoned = new std::vector<std::function<void()>>();
            abandoned->push_back(std::move(op.on_done));
            op.on_done = nullptr;
            g_gave_up = true;
            op.status = DeadlineExceededError(
                op.what + " did not complete in " + std::to_string(static_cast<int>(timeout_s)) +
                " s: another rank has failed, stopped, or started a different collective");
          } else {
            finish = false;
          }
        }
        if (finish) {
          finished.push_back(std::move(inflight_[i]));
          inflight_.erase(inflight_.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
    }
    for (auto& op : finished) {
      if (op->on_done) op->on_done();
      op->on_done = nullptr;
    }
    const bool busy = !inflight_.empty();
    {
      MutexLock lock(mu_);
      for (auto& op : finished) op->done = true;
      // Whoever drove, the comm thread keeps polling what is still in flight.
      busy_ = busy;
    }
    if (!finished.empty()) done_cv_.NotifyAll();
    if (busy && threaded_) cv_.NotifyAll();
    return busy;
  }

  void Loop() {
    for (;;) {
      {
        MutexLock lock(mu_);
        cv_.Wait(lock, [&]() TZ_REQUIRES(mu_) { return stop_ || !queued_.empty() || busy_; });
        if (stop_ && queued_.empty() && !busy_) return;
      }
      if (Drive()) std::this_thread::yield();
    }
  }

  const bool threaded_;
  Mutex mu_;         // also guards every op's done
  CondVar cv_;       // new work or stop, for the thread
  CondVar done_cv_;  // a collective completed, for waiters that do not drive
  std::vector<std::shared_ptr<MpiOp>> queued_ TZ_GUARDED_BY(mu_);
  double timeout_s_ TZ_GUARDED_BY(mu_);
  bool stop_ TZ_GUARDED_BY(mu_) = false;
  bool busy_ TZ_GUARDED_BY(mu_) = false;
  Mutex drive_mu_;
  std::vector<std::shared_ptr<MpiOp>> inflight_ TZ_GUARDED_BY(drive_mu_);
  std::thread thread_;
};

// A collective started through the queue. Dropping it waits for it.
class MpiRequest final : public CommRequest {
 public:
  MpiRequest(std::shared_ptr<MpiQueue> queue, std::shared_ptr<MpiOp> op)
      : queue_(std::move(queue)), op_(std::move(op)) {}
  ~MpiRequest() override { (void)Wait(); }
  Status Wait() override { return queue_->Wait(op_); }
  StatusOr<bool> Test() override { return queue_->Test(op_); }

 private:
  std::shared_ptr<MpiQueue> queue_;
  std::shared_ptr<MpiOp> op_;
};

// Receive buffers for the exchange, kept between collectives: a fresh 256 MiB allocation costs
// its page faults every time.
class ScratchPool {
 public:
  std::vector<uint8_t> Take(size_t bytes) {
    MutexLock lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].size() >= bytes) {
        std::vector<uint8_t> b = std::move(free_[i]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return b;
      }
    }
    return std::vector<uint8_t>(bytes);
  }
  // Keeps the two largest buffers (smaller ones would only be reallocated for the next large
  // collective).
  void Give(std::vector<uint8_t> b) {
    MutexLock lock(mu_);
    if (free_.size() < 2) {
      free_.push_back(std::move(b));
      return;
    }
    auto smallest = std::min_element(free_.begin(), free_.end(), [](const auto& x, const auto& y) {
      return x.size() < y.size();
    });
    if (smallest->size() < b.size()) *smallest = std::move(b);
  }

 private:
  Mutex mu_;
  std::vector<std::vector<uint8_t>> free_ TZ_GUARDED_BY(mu_);
};

// Note [Reduce-scatter as all-to-all]
// Open MPI's reduce_scatter_block on one machine reduces through a root and scatters: measured
// 0.4-0.5 GB/s bus bandwidth here against 1.6-2.7 GB/s for all_gather of the same size. A rank's
// block of the result needs only the other ranks' copies of that block, so we exchange blocks
// with one all_to_all (the same (W-1)/W of the buffer on the wire) and reduce the W copies
// locally, in rank order. Besides speed this makes the result independent of MPI's algorithm
// (every rank adds in the order 0..W-1) and, for bf16/fp16, more accurate: the sum is kept in
// fp32 and rounded once.
class MpiCommunicator final : public Communicator {
 public:
  // MPI_Init_thread unless MPI is initialised already (by us, or by the program); under MpiLock.
  static Status InitLocked() {
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) return Status::OK();
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      return UnavailableError("MPI_Init_thread failed");
    std::atexit(FinalizeAtExit);
    ByUs() = provided;
    return Status::OK();
  }
  // The thread level MPI_Init_thread gave us; -1 where the program initialised MPI itself.
  static int& ByUs() {
    static int provided = -1;
    return provided;
  }

  // Ranks sharing memory form a node; nodes are numbered by their lowest world rank.
  // Collective over `comm` (its ranks' own calls, with no deadline).
  static Status SharedTopology(MPI_Comm comm, Topology& t) {
    MPI_Comm_rank(comm, &t.rank);
    MPI_Comm_size(comm, &t.size);
    MPI_Comm local;
    if (int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, t.rank, MPI_INFO_NULL, &local);
        rc != MPI_SUCCESS)
      return MpiError(rc, "Comm_split_type");
    MPI_Comm_rank(local, &t.local_rank);
    MPI_Comm_size(local, &t.local_size);
    int lowest = t.rank;
    const int rc = MPI_Allreduce(&t.rank, &lowest, 1, MPI_INT, MPI_MIN, local);
    MPI_Comm_free(&local);
    if (rc != MPI_SUCCESS) return MpiError(rc, "Allreduce (topology)");
    std::vector<int> leaders(static_cast<size_t>(t.size));
    const int mine = t.rank == lowest ? t.rank : -1;
    if (int rc2 = MPI_Allgather(&mine, 1, MPI_INT, leaders.data(), 1, MPI_INT, comm);
        rc2 != MPI_SUCCESS)
      return MpiError(rc2, "Allgather (topology)");
    t.nodes = 0;
    t.node = 0;
    for (int l : leaders) {
      if (l < 0) continue;
      ++t.nodes;
      if (l < lowest) ++t.node;
    }
    return Status::OK();
  }

  // The world as InitMpi joined it: a duplicate of MPI_COMM_WORLD and its shared-memory
  // topology, made at once by every rank; the first communicator Create makes takes it.
  struct Joined {
    bool made = false;  // (once: the communicator that takes it leaves comm null)
    MPI_Comm comm = MPI_COMM_NULL;
    Topology shared;
  };
  static Joined& EarlyJoin() {
    static Joined joined;
    return joined;
  }

  // Under MpiLock: MPI_Init, then the calls of Create that wait for every rank with no deadline
  // (Comm_dup, the topology), once (Note [Every rank joins before it reads]).
  static Status JoinLocked() {
    RETURN_IF_ERROR(InitLocked());
    if (EarlyJoin().made) return Status::OK();
    EarlyJoin().made = true;
    MPI_Comm dup;
    if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup); rc != MPI_SUCCESS)
      return MpiError(rc, "Comm_dup");
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    Topology t;
    if (Status s = SharedTopology(dup, t); !s.ok()) {
      MPI_Comm_free(&dup);
      return s;
    }
    EarlyJoin().comm = dup;
    EarlyJoin().shared = t;
    return Status::OK();
  }

  static StatusOr<std::shared_ptr<Communicator>> Create(int ranks_per_node) {
    // Declared before the lock: on an error it is destroyed (its destructor takes the lock)
    // after the lock is released.
    std::shared_ptr<MpiCommunicator> c;
    MutexLock mpi(MpiLock());
    RETURN_IF_ERROR(InitLocked());
    bool threaded;
    if (ByUs() >= 0) {
      // Every call of ours is under MpiLock (Note [The MPI comm thread]).
      threaded = ByUs() >= MPI_THREAD_SERIALIZED;
    } else {
      // The program may call MPI on its own threads, outside our lock.
      int provided = 0;
      MPI_Query_thread(&provided);
      threaded = provided >= MPI_THREAD_MULTIPLE;
    }
    if (!kMpiCommThread.Get()) threaded = false;
    GetOps();  // MPI_Op_create under the lock, before the comm thread exists
    c.reset(new MpiCommunicator());
    c->queue_ = std::make_shared<MpiQueue>(threaded, c->timeout_s_);
    Topology& t = c->topo_;
    Joined& joined = EarlyJoin();
    if (joined.comm != MPI_COMM_NULL) {
      // Note [Every rank joins before it reads]: the world joined in InitMpi, once.
      c->comm_ = joined.comm;
      t = joined.shared;
      joined.comm = MPI_COMM_NULL;
    } else {
      if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c->comm_); rc != MPI_SUCCESS)
        return MpiError(rc, "Comm_dup");
      MPI_Comm_set_errhandler(c->comm_, MPI_ERRORS_RETURN);
      if (ranks_per_node <= 0) RETURN_IF_ERROR(SharedTopology(c->comm_, t));
    }
    MPI_Comm_rank(c->comm_, &t.rank);
    MPI_Comm_size(c->comm_, &t.size);
    if (ranks_per_node > 0) {
      t.local_rank = t.rank % ranks_per_node;
      t.node = t.rank / ranks_per_node;
      t.nodes = (t.size + ranks_per_node - 1) / ranks_per_node;
      t.local_size = std::min(ranks_per_node, t.size - t.node * ranks_per_node);
    }
    mpi.Unlock();
    return std::shared_ptr<Communicator>(std::move(c));
  }

  ~MpiCommunicator() override {
    queue_.reset();  // waits for the thread (every request holds the queue; none is left)
    if (comm_ == MPI_COMM_NULL) return;
    MutexLock mpi(MpiLock());
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return topo_.rank; }
  int size() const override { return topo_.size; }
  Topology topology() const override { return topo_; }
  std::string backend() const override { return "mpi"; }
  bool gave_up() const override { return g_gave_up.load(); }
  bool asynchronous() const override { return queue_->threaded(); }

  StatusOr<std::unique_ptr<CommRequest>> AllGather(const void* send, void* recv, size_t count,
                                                   DType dtype) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllGather, count, dtype, false));
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "all_gather"));
    return Start(
        [=, comm = comm_](MPI_Request* r) {
          return MPI_Iallgather(send, bytes, MPI_BYTE, recv, bytes, MPI_BYTE, comm, r);
        },
        "all_gather", CollectiveKind::kAllGather, count, dtype);
  }

  StatusOr<std::unique_ptr<CommRequest>> ReduceScatter(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    // Note [Reduce-scatter as all-to-all].
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kReduceScatter, count, dtype, true, op));
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "reduce_scatter"));
    std::vector<uint8_t> blocks =
        scratch_->Take(static_cast<size_t>(bytes) * static_cast<size_t>(topo_.size));
    // The exchanged blocks go back to the pool once summed.
    auto exchanged = std::make_shared<std::vector<uint8_t>>(std::move(blocks));
    return Start(
        [=, comm = comm_](MPI_Request* r) {
          return MPI_Ialltoall(send, bytes, MPI_BYTE, exchanged->data(), bytes, MPI_BYTE, comm, r);
        },
        "Ialltoall (reduce_scatter)", CollectiveKind::kReduceScatter, count, dtype, false,
        [exchanged, pool = scratch_, recv, count, dtype, op, w = topo_.size] {
          zero::ReduceBlocks(exchanged->data(), w, recv, count, dtype, op);
          pool->Give(std::move(*exchanged));
        });
  }

  StatusOr<std::unique_ptr<CommRequest>> AllReduce(const void* send, void* recv, size_t count,
                                                   DType dtype, ReduceOp op) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllReduce, count, dtype, true, op));
    ASSIGN_OR_RETURN(int n, IntCount(count, "all_reduce"));
    const void* s = send == recv ? MPI_IN_PLACE : send;
    std::function<void()> mean;
    if (op == ReduceOp::kMean) {
      mean = [recv, count, dtype, w = topo_.size] { zero::DivideInPlace(recv, count, dtype, w); };
    }
    return Start([=, type = Type(dtype), mpi_op = Op(dtype, op), comm = comm_](
                     MPI_Request* r) { return MPI_Iallreduce(s, recv, n, type, mpi_op, comm, r); },
                 "all_reduce", CollectiveKind::kAllReduce, count, dtype, false, std::move(mean));
  }

  StatusOr<std::unique_ptr<CommRequest>> AllToAll(const void* send, void* recv, size_t count,
                                                  DType dtype) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllToAll, count, dtype, false));
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "all_to_all"));
    return Start(
        [=, comm = comm_](MPI_Request* r) {
          return MPI_Ialltoall(send, bytes, MPI_BYTE, recv, bytes, MPI_BYTE, comm, r);
        },
        "all_to_all", CollectiveKind::kAllToAll, count, dtype);
  }

  StatusOr<std::unique_ptr<CommRequest>> Broadcast(void* buf, size_t count, DType dtype,
                                                   int root) override {
    RETURN_IF_ERROR(zero::CheckBroadcast(count, dtype, root, topo_.size));
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "broadcast"));
    return Start([=, comm = comm_](
                     MPI_Request* r) { return MPI_Ibcast(buf, bytes, MPI_BYTE, root, comm, r); },
                 "broadcast", CollectiveKind::kBroadcast, count, dtype, root == topo_.rank);
  }

  Status Barrier() override {
    auto op = std::make_shared<MpiOp>();
    op->start = [comm = comm_](MPI_Request* r) { return MPI_Ibarrier(comm, r); };
    op->what = "barrier";
    queue_->Submit(op);
    return queue_->Wait(op);
  }

  CommStats stats() const override { return stats_; }

  StatusOr<std::shared_ptr<Communicator>> Duplicate() override {
    MutexLock mpi(MpiLock());
    MPI_Comm comm = MPI_COMM_NULL;
    if (int rc = MPI_Comm_dup(comm_, &comm); rc != MPI_SUCCESS) return MpiError(rc, "Comm_dup");
    return Derived(comm, topo_);
  }

  StatusOr<std::shared_ptr<Communicator>> Split(SplitBy by) override {
    RETURN_IF_ERROR(zero::CheckSplit(by));
    MutexLock mpi(MpiLock());
    const bool by_node = by == SplitBy::kNode;
    MPI_Comm comm = MPI_COMM_NULL;
    if (int rc = MPI_Comm_split(comm_, by_node ? topo_.node : topo_.local_rank,
                                by_node ? topo_.local_rank : topo_.node, &comm);
        rc != MPI_SUCCESS)
      return MpiError(rc, "Comm_split");
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    return Derived(comm, zero::SplitTopology(by, rank, size));
  }

  double timeout() const override { return timeout_s_; }
  void SetTimeout(double seconds) override {
    timeout_s_ = seconds;
    queue_->SetTimeout(seconds);
  }
  [[noreturn]] void Abort(int exit_code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    // The comm thread never blocks inside MPI, so the lock comes free.
    MpiLock().Lock();
    MPI_Abort(comm_, exit_code);
    std::_Exit(exit_code);
  }

 private:
  MpiCommunicator() = default;

  // A communicator over `comm` (just duplicated or split from this one's, MpiLock() held) with
  // this one's queue mode and timeout. Its destructor takes the lock, so nothing may fail (and
  // drop it) before the caller has released the lock.
  std::shared_ptr<Communicator> Derived(MPI_Comm comm, const Topology& topo) {
    std::shared_ptr<MpiCommunicator> c(new MpiCommunicator());
    c->queue_ = std::make_shared<MpiQueue>(queue_->threaded(), timeout_s_);
    c->timeout_s_ = timeout_s_;
    c->topo_ = topo;
    c->comm_ = comm;
    MPI_Comm_set_errhandler(c->comm_, MPI_ERRORS_RETURN);
    return c;
  }

  static StatusOr<int> IntCount(size_t count, const char* what) {
    if (count > static_cast<size_t>(INT_MAX))
      return UnsupportedError(std::string(what) + " of " + std::to_string(count) +
                              " elements: MPI counts stop at 2^31 - 1; split the buffer");
    return static_cast<int>(count);
  }
  static StatusOr<int> IntBytes(DType dtype, size_t count, const char* what) {
    return IntCount(DTypeBytes(dtype, count), what);
  }
  static MPI_Datatype Type(DType dtype) { return dtype == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T; }
  static MPI_Op Op(DType dtype, ReduceOp op) {
    const bool max = op == ReduceOp::kMax;
    if (dtype == DType::kF32) return max ? MPI_MAX : MPI_SUM;
    const Ops& o = GetOps();
    if (dtype == DType::kBF16) return max ? o.bf16_max : o.bf16_sum;
    return max ? o.f16_max : o.f16_sum;
  }
  std::unique_ptr<CommRequest> Start(std::function<int(MPI_Request*)> start, const char* what,
                                     CollectiveKind kind, size_t count, DType dtype,
                                     bool is_root = false,
                                     std::function<void()> on_done = nullptr) {
    ++stats_.collectives;
    const uint64_t sent = zero::BytesSent(kind, count, dtype, topo_.size, is_root);
    stats_.bytes_sent += sent;
    auto op = std::make_shared<MpiOp>();
    op->cross_node_bytes = zero::CrossNodeBytes(sent, topo_);
    stats_.bytes_cross_node += op->cross_node_bytes;
    op->start = std::move(start);
    op->on_done = std::move(on_done);
    op->what = what;
    queue_->Submit(op);
    return std::make_unique<MpiRequest>(queue_, std::move(op));
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  double timeout_s_ = 300;
  std::shared_ptr<ScratchPool> scratch_ = std::make_shared<ScratchPool>();
  std::shared_ptr<MpiQueue> queue_;
  Topology topo_;
  CommStats stats_;
};

}  // namespace

Status Communicator::InitMpi() {
  MutexLock mpi(MpiLock());
  return MpiCommunicator::JoinLocked();
}

StatusOr<std::shared_ptr<Communicator>> Communicator::Mpi(int ranks_per_node) {
  return MpiCommunicator::Create(ranks_per_node);
}

}  // namespace tierzero

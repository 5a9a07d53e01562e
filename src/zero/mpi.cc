// The MPI communicator: host buffers, non-blocking collectives on a duplicate of
// MPI_COMM_WORLD with MPI_ERRORS_RETURN (an MPI failure is a Status naming the collective).
// bf16 and fp16 reductions are user-defined MPI operations that add in fp32.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "zero/collective.h"

namespace tierzero {
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

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// Note [Collective deadlines]
// A rank that dies under mpirun takes the job down (mpirun kills the others), and a rank that
// fails with an error calls Communicator::Abort. What remains is a rank that is alive but never
// joins the collective the others wait in (a bug, a diverged program). MPI_Wait would block
// forever; Wait polls MPI_Test instead (yielding the core, which oversubscribed runs need) and
// gives up after the communicator's timeout with DeadlineExceeded, which the trainer reports
// before aborting. A collective cannot be cancelled, so the communicator is unusable after that.
//
// A started MPI collective. `on_done` is the local part that follows the transfer (the mean's
// division, reduce_scatter's sum of the exchanged blocks); it runs once, on the thread that sees
// the transfer complete.
class MpiRequest final : public CommRequest {
 public:
  MpiRequest(MPI_Request r, std::string what, std::function<void()> on_done, double timeout_s)
      : req_(r), what_(std::move(what)), on_done_(std::move(on_done)), timeout_s_(timeout_s) {}
  ~MpiRequest() override { (void)Wait(); }
  // Polls instead of MPI_Wait so that a collective another rank never joins ends in an error,
  // not a hang (Note [Collective deadlines]).
  Status Wait() override {
    const auto t0 = std::chrono::steady_clock::now();
    while (!done_) {
      int flag = 0;
      const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS || flag) {
        Finish(rc);
        break;
      }
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >
          timeout_s_) {
        // The request cannot be cancelled (MPI forbids it for collectives); the caller is
        // expected to Abort. Mark it done so the destructor does not wait again, and keep what
        // the completion step owns (reduce_scatter's exchange buffer) alive: MPI may still
        // write into it.
        static auto* abandoned = new std::vector<std::function<void()>>();
        abandoned->push_back(std::move(on_done_));
        done_ = true;
        status_ = DeadlineExceededError(
            what_ + " did not complete in " + std::to_string(static_cast<int>(timeout_s_)) +
            " s: another rank has failed, stopped, or started a different collective");
        on_done_ = nullptr;
        break;
      }
      std::this_thread::yield();
    }
    return status_;
  }
  StatusOr<bool> Test() override {
    if (!done_) {
      int flag = 0;
      const int rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS || flag) Finish(rc);
    }
    if (!status_.ok()) return status_;
    return done_;
  }

 private:
  void Finish(int rc) {
    done_ = true;
    if (rc != MPI_SUCCESS) {
      status_ = MpiError(rc, what_);
    } else if (on_done_) {
      on_done_();
    }
    on_done_ = nullptr;
  }
  MPI_Request req_;
  std::string what_;
  std::function<void()> on_done_;
  double timeout_s_;
  bool done_ = false;
  Status status_;
};

// Receive buffers for the exchange, kept between collectives: a fresh 256 MiB allocation costs
// its page faults every time.
class ScratchPool {
 public:
  std::vector<uint8_t> Take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
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
    std::lock_guard<std::mutex> lock(mu_);
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
  std::mutex mu_;
  std::vector<std::vector<uint8_t>> free_;
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
  static StatusOr<std::shared_ptr<Communicator>> Create(int ranks_per_node) {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      int provided = 0;
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return UnavailableError("MPI_Init_thread failed");
      std::atexit(FinalizeAtExit);
    }
    auto c = std::shared_ptr<MpiCommunicator>(new MpiCommunicator());
    if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c->comm_); rc != MPI_SUCCESS)
      return MpiError(rc, "Comm_dup");
    MPI_Comm_set_errhandler(c->comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(c->comm_, &c->topo_.rank);
    MPI_Comm_size(c->comm_, &c->topo_.size);
    Topology& t = c->topo_;
    if (ranks_per_node > 0) {
      t.local_rank = t.rank % ranks_per_node;
      t.node = t.rank / ranks_per_node;
      t.nodes = (t.size + ranks_per_node - 1) / ranks_per_node;
      t.local_size = std::min(ranks_per_node, t.size - t.node * ranks_per_node);
    } else {
      // Ranks sharing memory form a node; nodes are numbered by their lowest world rank.
      MPI_Comm local;
      if (int rc =
              MPI_Comm_split_type(c->comm_, MPI_COMM_TYPE_SHARED, t.rank, MPI_INFO_NULL, &local);
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
      if (int rc2 = MPI_Allgather(&mine, 1, MPI_INT, leaders.data(), 1, MPI_INT, c->comm_);
          rc2 != MPI_SUCCESS)
        return MpiError(rc2, "Allgather (topology)");
      t.nodes = 0;
      t.node = 0;
      for (int l : leaders) {
        if (l < 0) continue;
        ++t.nodes;
        if (l < lowest) ++t.node;
      }
    }
    return std::shared_ptr<Communicator>(std::move(c));
  }

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  int rank() const override { return topo_.rank; }
  int size() const override { return topo_.size; }
  Topology topology() const override { return topo_; }
  std::string backend() const override { return "mpi"; }

  StatusOr<std::unique_ptr<CommRequest>> AllGather(const void* send, void* recv, size_t count,
                                                   DType dtype) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllGather, count, dtype, false));
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "all_gather"));
    MPI_Request r;
    if (int rc = MPI_Iallgather(send, bytes, MPI_BYTE, recv, bytes, MPI_BYTE, comm_, &r);
        rc != MPI_SUCCESS)
      return MpiError(rc, "Iallgather");
    return Started(r, "all_gather", CollectiveKind::kAllGather, count, dtype);
  }

  StatusOr<std::unique_ptr<CommRequest>> ReduceScatter(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    // Note [Reduce-scatter as all-to-all].
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kReduceScatter, count, dtype, true));
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "reduce_scatter"));
    std::vector<uint8_t> blocks =
        scratch_->Take(static_cast<size_t>(bytes) * static_cast<size_t>(topo_.size));
    MPI_Request r;
    if (int rc = MPI_Ialltoall(send, bytes, MPI_BYTE, blocks.data(), bytes, MPI_BYTE, comm_, &r);
        rc != MPI_SUCCESS)
      return MpiError(rc, "Ialltoall (reduce_scatter)");
    // The exchanged blocks go back to the pool once summed.
    auto exchanged = std::make_shared<std::vector<uint8_t>>(std::move(blocks));
    return Started(r, "Ialltoall (reduce_scatter)", CollectiveKind::kReduceScatter, count, dtype,
                   false, [exchanged, pool = scratch_, recv, count, dtype, op, w = topo_.size] {
                     zero::ReduceBlocks(exchanged->data(), w, recv, count, dtype, op);
                     pool->Give(std::move(*exchanged));
                   });
  }

  StatusOr<std::unique_ptr<CommRequest>> AllReduce(const void* send, void* recv, size_t count,
                                                   DType dtype, ReduceOp op) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllReduce, count, dtype, true));
    ASSIGN_OR_RETURN(int n, IntCount(count, "all_reduce"));
    MPI_Request r;
    const void* s = send == recv ? MPI_IN_PLACE : send;
    if (int rc = MPI_Iallreduce(s, recv, n, Type(dtype), Op(dtype, op), comm_, &r);
        rc != MPI_SUCCESS)
      return MpiError(rc, "Iallreduce");
    std::function<void()> mean;
    if (op == ReduceOp::kMean) {
      mean = [recv, count, dtype, w = topo_.size] { zero::DivideInPlace(recv, count, dtype, w); };
    }
    return Started(r, "all_reduce", CollectiveKind::kAllReduce, count, dtype, false,
                   std::move(mean));
  }

  StatusOr<std::unique_ptr<CommRequest>> AllToAll(const void* send, void* recv, size_t count,
                                                  DType dtype) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kAllToAll, count, dtype, false));
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "all_to_all"));
    MPI_Request r;
    if (int rc = MPI_Ialltoall(send, bytes, MPI_BYTE, recv, bytes, MPI_BYTE, comm_, &r);
        rc != MPI_SUCCESS)
      return MpiError(rc, "Ialltoall");
    return Started(r, "all_to_all", CollectiveKind::kAllToAll, count, dtype);
  }

  StatusOr<std::unique_ptr<CommRequest>> Broadcast(void* buf, size_t count, DType dtype,
                                                   int root) override {
    RETURN_IF_ERROR(zero::CheckCollective(CollectiveKind::kBroadcast, count, dtype, false));
    if (root < 0 || root >= topo_.size)
      return InvalidArgumentError("broadcast root " + std::to_string(root) + " of " +
                                  std::to_string(topo_.size) + " ranks");
    ASSIGN_OR_RETURN(int bytes, IntBytes(dtype, count, "broadcast"));
    MPI_Request r;
    if (int rc = MPI_Ibcast(buf, bytes, MPI_BYTE, root, comm_, &r); rc != MPI_SUCCESS)
      return MpiError(rc, "Ibcast");
    return Started(r, "broadcast", CollectiveKind::kBroadcast, count, dtype, root == topo_.rank);
  }

  Status Barrier() override {
    MPI_Request r;
    if (int rc = MPI_Ibarrier(comm_, &r); rc != MPI_SUCCESS) return MpiError(rc, "Ibarrier");
    return MpiRequest(r, "barrier", nullptr, timeout_s_).Wait();
  }

  CommStats stats() const override { return stats_; }
  void SetTimeout(double seconds) override { timeout_s_ = seconds; }
  [[noreturn]] void Abort(int exit_code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(comm_, exit_code);
    std::_Exit(exit_code);
  }

 private:
  MpiCommunicator() = default;

  static StatusOr<int> IntCount(size_t count, const char* what) {
    if (count > static_cast<size_t>(INT_MAX))
      return UnsupportedError(std::string(what) + " of " + std::to_string(count) +
                              " elements: MPI counts stop at 2^31 - 1; split the buffer");
    return static_cast<int>(count);
  }
  static StatusOr<int> IntBytes(DType dtype, size_t count, const char* what) {
    return IntCount(zero::ElementBytes(dtype, count), what);
  }
  static MPI_Datatype Type(DType dtype) { return dtype == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T; }
  static MPI_Op Op(DType dtype, ReduceOp op) {
    const bool max = op == ReduceOp::kMax;
    if (dtype == DType::kF32) return max ? MPI_MAX : MPI_SUM;
    const Ops& o = GetOps();
    if (dtype == DType::kBF16) return max ? o.bf16_max : o.bf16_sum;
    return max ? o.f16_max : o.f16_sum;
  }
  std::unique_ptr<CommRequest> Started(MPI_Request r, const char* what, CollectiveKind kind,
                                       size_t count, DType dtype, bool is_root = false,
                                       std::function<void()> on_done = nullptr) {
    ++stats_.collectives;
    stats_.bytes_sent += zero::BytesSent(kind, count, dtype, topo_.size, is_root);
    return std::make_unique<MpiRequest>(r, what, std::move(on_done), timeout_s_);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  double timeout_s_ = 300;
  std::shared_ptr<ScratchPool> scratch_ = std::make_shared<ScratchPool>();
  Topology topo_;
  CommStats stats_;
};

}  // namespace

StatusOr<std::shared_ptr<Communicator>> Communicator::Mpi(int ranks_per_node) {
  return MpiCommunicator::Create(ranks_per_node);
}

}  // namespace tierzero

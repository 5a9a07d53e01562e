// Ranks that share the model (ZeRO-3) and the collectives between them (DESIGN.md section 6).
//
//   auto comm = *Communicator::Mpi();          // under mpirun: MPI_COMM_WORLD
//   auto req = *comm->AllGather(shard, gathered, shard_elems, DType::kBF16);
//   ... other work ...
//   req->Wait();                               // gathered now holds every rank's shard
//
// Backends: single-rank (one process, no MPI), MPI (host buffers: the simulated device and CPU
// runs) and, with the GPU issue, NCCL (device buffers). Collectives are started asynchronously
// and return a request; buffers must stay untouched until it completes. Every rank must start the
// same collectives in the same order (MPI's rule).
//
// Thread-safety: one thread starts a communicator's collectives. When asynchronous() is true
// they progress on their own (MPI: a comm thread; NCCL: a CUDA stream) and a request may be
// waited for from any thread; otherwise only from the starting thread, whose Wait and Test move
// the data. tierzero initialises MPI with MPI_THREAD_MULTIPLE asked for; a program that calls
// MPI itself should initialise it first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "tierzero/status.h"
#include "tierzero/types.h"

namespace tierzero {

// kMean divides the sum by the number of ranks (gradient averaging).
enum class ReduceOp : uint8_t { kSum, kMean, kMax };

// A collective in flight. Dropping an unfinished request waits for it (buffers are never
// touched after the request is gone).
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  // Blocks until the collective is complete; its Status (the same on every call).
  virtual Status Wait() = 0;
  // Progresses the collective without blocking; true once it is complete (then Wait returns at
  // once).
  virtual StatusOr<bool> Test() = 0;
};

// Where the ranks are: `node` of `nodes`, and this rank's place among the `local_size` ranks of
// its node. From MPI's shared-memory split, or from ranks_per_node when given (to emulate several
// nodes on one machine).
struct Topology {
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;
  int node = 0, nodes = 1;
};

// Bytes this rank sent, per collective kind, as the algorithm-independent volume NCCL's tests
// use: all_gather and reduce_scatter (W-1)/W of the full buffer, all_reduce twice that,
// all_to_all (W-1)/W of the send buffer, broadcast the buffer (root) or nothing.
// bytes_cross_node is the part of bytes_sent addressed to ranks on other nodes, under the same
// model (each rank's block goes straight to the rank it is for): (size - local_size) / (size - 1)
// of it; all of it on a communicator across nodes (SplitBy::kLocalRank), none inside a node.
struct CommStats {
  uint64_t collectives = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_cross_node = 0;
};

// The bytes of one use of a trainer's collectives (the engine's gathers of parameters, its
// gradient reductions; docs/zero.md, "Bytes on the wire"), in the convention of CommStats: before
// quantization (the values in the compute dtype), sent, and the part sent to ranks on other
// nodes (the rest stayed inside the node).
struct WireBytes {
  uint64_t collectives = 0;
  uint64_t bytes_unquantized = 0, bytes_sent = 0, bytes_cross_node = 0;

  WireBytes operator+(const WireBytes& o) const {
    return {collectives + o.collectives, bytes_unquantized + o.bytes_unquantized,
            bytes_sent + o.bytes_sent, bytes_cross_node + o.bytes_cross_node};
  }
  WireBytes operator-(const WireBytes& o) const {
    return {collectives - o.collectives, bytes_unquantized - o.bytes_unquantized,
            bytes_sent - o.bytes_sent, bytes_cross_node - o.bytes_cross_node};
  }
};

// Which ranks a sub-communicator (Communicator::Split) groups.
enum class SplitBy : uint8_t {
  kNode,       // the ranks of this rank's node, in local-rank order
  kLocalRank,  // the ranks with this rank's local rank, one per node, in node order
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Topology topology() const = 0;
  virtual std::string backend() const = 0;  // "single", "mpi", "nccl"
  // Whether collectives complete without the starting thread's Wait or Test (see above).
  virtual bool asynchronous() const { return true; }
  // Whether a collective of this process was given up (its deadline passed: a rank stopped or
  // diverged) or failed in the transport. The communicator is then unusable and the ranks do not
  // know each other's state: a failure after it is the job's (Abort), not one they agreed on.
  virtual bool gave_up() const { return false; }

  // Counts are elements per rank; dtypes fp32, bf16, fp16 and int8 (int4 for the data
  // movement collectives, with an even count). Reductions: fp32, bf16, fp16. On the MPI and
  // single-rank backends reduce_scatter adds the ranks' blocks in rank order in fp32 and rounds
  // once, so its result does not depend on the transport's algorithm; NCCL's reductions, and
  // all_reduce everywhere, follow the transport's order (bf16/fp16 rounded at each pairwise step;
  // nccl.h). InvalidArgument for a bad dtype or count.
  //
  // recv[r * count ...] = rank r's send[0 .. count).
  virtual StatusOr<std::unique_ptr<CommRequest>> AllGather(const void* send, void* recv,
                                                           size_t count, DType dtype) = 0;
  // send holds size() blocks of count; recv = block rank() of op over the ranks' sends. recv
  // may be this rank's block of send (in place: every rank's send is read before recv is written).
  virtual StatusOr<std::unique_ptr<CommRequest>> ReduceScatter(const void* send, void* recv,
                                                               size_t count, DType dtype,
                                                               ReduceOp op) = 0;
  // recv = op over the ranks' send (count elements; send == recv is allowed).
  virtual StatusOr<std::unique_ptr<CommRequest>> AllReduce(const void* send, void* recv,
                                                           size_t count, DType dtype,
                                                           ReduceOp op) = 0;
  // send holds size() blocks of count; recv block r = rank r's send block rank().
  virtual StatusOr<std::unique_ptr<CommRequest>> AllToAll(const void* send, void* recv,
                                                          size_t count, DType dtype) = 0;
  // buf (count elements) from `root` to every rank.
  virtual StatusOr<std::unique_ptr<CommRequest>> Broadcast(void* buf, size_t count, DType dtype,
                                                           int root) = 0;
  virtual Status Barrier() = 0;
  virtual CommStats stats() const = 0;
  // A communicator over the same ranks whose collectives never match this one's (MPI_Comm_dup),
  // for collectives started by another thread in an order of their own (the chunk manager's
  // stream-ordered gathers, comm/device_collectives.h). A collective call: every rank calls it,
  // in the same order as its other collectives. Unsupported for NCCL.
  virtual StatusOr<std::shared_ptr<Communicator>> Duplicate() = 0;

  // A communicator over some of these ranks (MPI_Comm_split, ncclCommSplit), for collectives
  // inside a node (kNode: its rank is the local rank, and it has one node) or across nodes
  // (kLocalRank: its rank is the node's place among the nodes that have this local rank, and
  // every rank is a node of its own). Its collectives never match this one's. A collective
  // call: every rank calls it, in the same order as its other collectives.
  virtual StatusOr<std::shared_ptr<Communicator>> Split(SplitBy by) = 0;

  // A collective still incomplete after this many seconds fails with DeadlineExceeded (another
  // rank died, left, or started different collectives) instead of hanging. Default: 300.
  virtual void SetTimeout(double seconds) { (void)seconds; }
  virtual double timeout() const { return 300; }
  // Ends every rank's process with `exit_code` (MPI_Abort): what a rank does after an error it
  // cannot share, so the others never wait for it. The one-process communicator exits.
  [[noreturn]] virtual void Abort(int exit_code);

  // The one-process communicator (always available).
  static std::shared_ptr<Communicator> Single();
  // MPI_COMM_WORLD (MPI is initialised here unless the program did; it is finalised at exit).
  // ranks_per_node > 0 overrides the shared-memory split. Unavailable in a build without MPI.
  static StatusOr<std::shared_ptr<Communicator>> Mpi(int ranks_per_node = 0);
  // Joins the launcher's job now (MPI_Init), as Mpi() would, unless MPI is initialised already.
  // Note [Every rank joins before it reads]: a program started by mpirun calls it before it reads
  // its inputs (`tierzero train` does; commands that use no MPI do not: MPI may be initialised
  // once a process, and a job script may run several). MPI_Init waits for every rank to call it,
  // with no deadline: a rank blocked on an input before it (a FIFO as its config) or one that ended
  // without it held the others there for good; joined first, they wait in a collective, which has
  // the collective deadline.
  static Status InitMpi();
};

// Every rank's `bytes` bytes, in rank order (collective: every rank calls it with the same size).
StatusOr<std::vector<uint8_t>> AllGatherBytes(Communicator& comm, const void* data, size_t bytes);

// Every rank's value of a trivially copyable type, in rank order: how a trainer shares a few
// numbers (its loss as a double, a step count as an int64_t, a flag) and reduces them in an order
// that is the same on every rank, so every rank gets the same bits.
template <typename T>
StatusOr<std::vector<T>> AllGatherValue(Communicator& comm, const T& value) {
  static_assert(std::is_trivially_copyable_v<T>);
  auto raw = AllGatherBytes(comm, &value, sizeof(T));
  if (!raw.ok()) return raw.status();
  std::vector<T> out(static_cast<size_t>(comm.size()));
  std::memcpy(out.data(), raw->data(), raw->size());
  return out;
}

// Note [Agreeing on an outcome]
// A collective call in which a rank can fail on its own (writing its checkpoint file, rank 0
// writing the manifest or the export) must not leave the other ranks waiting in the next
// collective for the collective deadline. Each such step ends with AgreeOnStatus: every rank
// shares its outcome, and all of them return an error if any rank failed (this rank's own, or
// the lowest failing rank's, prefixed "rank r of W: "), or OK together. A collective: every rank
// calls it, whatever happened before.
Status AgreeOnStatus(Communicator& comm, const Status& local);

}  // namespace tierzero

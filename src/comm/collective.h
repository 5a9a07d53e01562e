// Shared pieces of the communicator backends (src/zero): argument checks, element sizes, the
// algorithm-independent byte counts of CommStats, and a request that is already complete.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/status.h"
#include "tierzero/communicator.h"

namespace tierzero::zero {

enum class CollectiveKind : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kBroadcast
};

// InvalidArgument unless `dtype` is a DType that suits the collective (a reduction when
// `reduction`, with `op` a ReduceOp), `count` is whole bytes, and its bytes times the ranks'
// blocks are a size a buffer can have (at most kMaxCollectiveElems elements).
inline constexpr uint64_t kMaxCollectiveElems = uint64_t{1} << 48;
Status CheckCollective(CollectiveKind kind, size_t count, DType dtype, bool reduction,
                       ReduceOp op = ReduceOp::kSum);
// InvalidArgument unless `by` is a SplitBy.
Status CheckSplit(SplitBy by);
// CheckCollective for a broadcast, and `root` one of the `size` ranks.
Status CheckBroadcast(size_t count, DType dtype, int root, int size);
// Bytes one rank sends for the collective, as NCCL's tests count them (communicator.h).
uint64_t BytesSent(CollectiveKind kind, size_t count, DType dtype, int size, bool is_root);
// The part of `bytes_sent` addressed to ranks on other nodes (CommStats::bytes_cross_node).
uint64_t CrossNodeBytes(uint64_t bytes_sent, const Topology& topology);
// The topology of a rank that is rank `rank` of `size` in the sub-communicator Split(by) made.
Topology SplitTopology(SplitBy by, int rank, int size);

class DoneRequest final : public CommRequest {
 public:
  explicit DoneRequest(Status s = Status::OK()) : status_(std::move(s)) {}
  Status Wait() override { return status_; }
  StatusOr<bool> Test() override {
    if (!status_.ok()) return status_;
    return true;
  }

 private:
  Status status_;
};

// In-place reductions of `n` elements: acc = acc op in (fp32, bf16, fp16), and acc /= divisor.
void ReduceInto(void* acc, const void* in, size_t n, DType dtype, ReduceOp op);
void DivideInPlace(void* buf, size_t n, DType dtype, double divisor);
// out = op over `blocks` consecutive blocks of n elements (block order 0..blocks-1), accumulated
// in fp32 and rounded once; kMean divides by `blocks`.
void ReduceBlocks(const void* blocks, int num_blocks, void* out, size_t n, DType dtype,
                  ReduceOp op);

// Every rank's `bytes` bytes from `data`, rank by rank (one all_gather, waited for). For the
// small agreements between ranks: trace checks, plan inputs, norms, losses.
// AllGatherBytes, AllGatherValue and AgreeOnStatus are public (tierzero/communicator.h).

}  // namespace tierzero::zero

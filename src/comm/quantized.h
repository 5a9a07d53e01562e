// ZeRO++'s quantized collectives over host buffers (docs/zero.md, "ZeRO++"): the qwZ weight
// all_gather and the qgZ hierarchical gradient reduce-scatter, on the block quantization of
// kernels/quantize.h.
//
//   auto q = *ShardQuantization::Create({8, 256}, runs_of_each_rank_shard);
//   QuantizedAllGather(comm, q, my_shard, DType::kBF16, chunk, scratch);      // qwZ
//   QuantizedReduceScatter(node, cross, q, grad_chunk, DType::kBF16, mean, scratch);  // qgZ
//
// Note [Quantized collectives]
// qwZ: each rank quantizes its shard with the shard's own layout (its blocks never span two
// tensors), the scales and payload packed in one slot of slot_bytes() (the largest packed shard
// of the chunk, so every rank's slot has one size), and ONE all_gather moves the slots; each rank
// dequantizes every slot into its place in the chunk. So every rank computes on
// dequantize(quantize(shard)) of every rank, the same bits everywhere.
//
// qgZ (rank (n, l) of N nodes of L ranks, world rank n * L + l): (1) the gradient chunk's W
// shards are quantized, each with its destination's layout, and sent inside the node with one
// all_to_all: local rank l' gets the N shards of the ranks (n', l'); (2) each rank sums the L
// copies it got of each of those shards in fp32 and requantizes the sum (the fused kernel);
// (3) one all_to_all across nodes (among the ranks of local rank l) sends node n' its shard's
// partial sum; (4) the N partial sums of this rank's own shard are dequantized, added in fp32 in
// node order, and divided by W. With one node, step (3) is skipped and (2) sums straight into
// fp32. Cross-node bytes: N - 1 quantized shards per rank (plain ZeRO-3: (W - L) shards of the
// compute dtype).
//
// Error bound (checked by tests/zero/quantized_test.cc): with A_r the absmax of rank r's input
// over the quantization block holding an element, the mean's error is at most
// sum_r A_r / (qmax * W) (two roundings of at most half a scale each; one node: half that), up
// to fp32 rounding. Every rank must use the same ShardQuantization and call in the same order.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/quantize.h"
#include "tierzero/communicator.h"

namespace tierzero {

class ShardQuantization {
 public:
  // One layout per rank's shard: shard_runs[r] are the lengths of the tensor pieces in rank r's
  // shard (all shards equally long). InvalidArgument for a bad spec or unequal shards.
  static StatusOr<ShardQuantization> Create(const kernels::QuantSpec& spec,
                                            const std::vector<std::vector<uint64_t>>& shard_runs);

  int shards() const { return static_cast<int>(layouts_.size()); }
  uint64_t shard_elems() const { return layouts_.empty() ? 0 : layouts_[0].elems(); }
  const kernels::QuantLayout& layout(int r) const { return layouts_[static_cast<size_t>(r)]; }
  // Bytes of one packed shard's slot: the largest packed shard, rounded up to 16.
  uint64_t slot_bytes() const { return slot_bytes_; }

 private:
  std::vector<kernels::QuantLayout> layouts_;
  uint64_t slot_bytes_ = 0;
};

// qwZ's dequantization: out (W shards of `dtype`, in rank order) = rank r's packed shard, found
// at slots + r * stride, dequantized, for every rank r.
Status DequantizeShards(const ShardQuantization& q, const uint8_t* slots, uint64_t stride,
                        DType dtype, void* out);

// recv (W shards of `dtype`, in rank order) = every rank's shard at `send` quantized and
// dequantized (Note [Quantized collectives]). `scratch` is reused between calls.
Status QuantizedAllGather(Communicator& comm, const ShardQuantization& q, const void* send,
                          DType dtype, void* recv, std::vector<uint8_t>& scratch);

// mean (shard_elems fp32) = this rank's shard of the mean over the ranks of `send` (W shards of
// `dtype`), through the two-hop quantized reduction (Note [Quantized collectives]). `node` holds
// this node's ranks and `cross` the ranks of this local rank (Communicator::Split); the world's
// ranks must be numbered node by node (rank = node * L + local rank) with L ranks on every node.
Status QuantizedReduceScatter(Communicator& node, Communicator& cross, const ShardQuantization& q,
                              const void* send, DType dtype, float* mean,
                              std::vector<uint8_t>& scratch);

// The same reduction in its stages, for a caller that overlaps its two all_to_alls with other
// work (the host path's qgZ strategy, zeropp_host.cc): Quantize, node.AllToAll(to_peers(),
// from_peers(), node_block_bytes()), SumNode, then with more than one node
// cross.AllToAll(partial(), from_nodes(), slot_bytes()) and Finish. The buffers are views of a
// caller's scratch of scratch_bytes().
class QuantizedReduction {
 public:
  // Rank `local_rank` of `node_size` on node `node` of `nodes`.
  static StatusOr<QuantizedReduction> Create(const ShardQuantization& q, int node_size,
                                             int local_rank, int nodes, int node);

  uint64_t scratch_bytes() const;
  uint64_t slot_bytes() const { return q_->slot_bytes(); }
  uint64_t node_block_bytes() const { return q_->slot_bytes() * static_cast<uint64_t>(n_size_); }
  uint8_t* to_peers(uint8_t* scratch) const { return scratch; }
  uint8_t* from_peers(uint8_t* scratch) const { return scratch + node_block_bytes() * l_size_; }
  uint8_t* partial(uint8_t* scratch) const { return scratch + 2 * node_block_bytes() * l_size_; }
  uint8_t* from_nodes(uint8_t* scratch) const { return partial(scratch) + node_block_bytes(); }
  bool one_node() const { return n_size_ == 1; }

  // (1) Every destination's shard of `send` (W shards of `dtype`), quantized into to_peers.
  Status Quantize(const void* send, DType dtype, uint8_t* scratch) const;
  // (2) The node's copies summed in fp32 and requantized into partial (one node: the mean's sum,
  // into `mean`, and Finish only divides).
  Status SumNode(uint8_t* scratch, float* mean) const;
  // (4) This shard's partial sums added in node order (more than one node), divided by W.
  Status Finish(uint8_t* scratch, float* mean) const;

 private:
  const ShardQuantization* q_ = nullptr;
  int l_size_ = 1, l_ = 0, n_size_ = 1, n_ = 0;
};

}  // namespace tierzero

// ZeRO++'s quantized collectives over host buffers (comm/quantized.h).
#include "comm/quantized.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/bytes.h"

namespace tierzero {

using kernels::QuantLayout;

StatusOr<ShardQuantization> ShardQuantization::Create(
    const kernels::QuantSpec& spec, const std::vector<std::vector<uint64_t>>& shard_runs) {
  ShardQuantization q;
  for (const auto& runs : shard_runs) {
    ASSIGN_OR_RETURN(QuantLayout l, QuantLayout::Create(spec, runs));
    if (!q.layouts_.empty() && l.elems() != q.layouts_[0].elems()) {
      return InvalidArgumentError(
          "quantized shards of unequal lengths: " + std::to_string(q.layouts_[0].elems()) +
          " and " + std::to_string(l.elems()) + " elements");
    }
    q.slot_bytes_ = std::max(q.slot_bytes_, AlignUp(l.bytes(), 16));
    q.layouts_.push_back(std::move(l));
  }
  if (q.layouts_.empty()) return InvalidArgumentError("a shard quantization needs a shard");
  return q;
}

namespace {

Status Wait(StatusOr<std::unique_ptr<CommRequest>> req) {
  if (!req.ok()) return req.status();
  return (*req)->Wait();
}

}  // namespace

Status DequantizeShards(const ShardQuantization& q, const uint8_t* slots, uint64_t stride,
                        DType dtype, void* out) {
  auto* o = static_cast<uint8_t*>(out);
  for (int r = 0; r < q.shards(); ++r) {
    RETURN_IF_ERROR(kernels::Dequantize(q.layout(r), slots + stride * static_cast<uint64_t>(r),
                                        o + DTypeBytes(dtype, q.shard_elems() * r), dtype));
  }
  return Status::OK();
}

Status QuantizedAllGather(Communicator& comm, const ShardQuantization& q, const void* send,
                          DType dtype, void* recv, std::vector<uint8_t>& scratch) {
  const int w = comm.size();
  if (q.shards() != w) {
    return InvalidArgumentError("a quantization of " + std::to_string(q.shards()) + " shards for " +
                                std::to_string(w) + " ranks");
  }
  const uint64_t slot = q.slot_bytes();
  scratch.resize(slot * static_cast<uint64_t>(w + 1));
  uint8_t* mine = scratch.data() + slot * static_cast<uint64_t>(w);
  RETURN_IF_ERROR(kernels::Quantize(q.layout(comm.rank()), send, dtype, mine));
  RETURN_IF_ERROR(Wait(comm.AllGather(mine, scratch.data(), slot, DType::kI8)));
  return DequantizeShards(q, scratch.data(), slot, dtype, recv);
}

StatusOr<QuantizedReduction> QuantizedReduction::Create(const ShardQuantization& q, int node_size,
                                                        int local_rank, int nodes, int node) {
  if (node_size < 1 || nodes < 1 || q.shards() != node_size * nodes) {
    return InvalidArgumentError("a quantization of " + std::to_string(q.shards()) + " shards for " +
                                std::to_string(nodes) + " nodes of " + std::to_string(node_size) +
                                " ranks (every node needs as many)");
  }
  QuantizedReduction r;
  r.q_ = &q;
  r.l_size_ = node_size;
  r.l_ = local_rank;
  r.n_size_ = nodes;
  r.n_ = node;
  return r;
}

// [to node peers: L x N slots][from node peers: L x N slots][partial sums: N][received: N]
uint64_t QuantizedReduction::scratch_bytes() const {
  return node_block_bytes() * (2 * static_cast<uint64_t>(l_size_) + 2);
}

// Local rank l' gets the shards of the ranks (n', l'), each in its destination's layout.
Status QuantizedReduction::Quantize(const void* send, DType dtype, uint8_t* scratch) const {
  const auto* in = static_cast<const uint8_t*>(send);
  const uint64_t s = q_->shard_elems(), slot = slot_bytes();
  uint8_t* out = to_peers(scratch);
  for (int lp = 0; lp < l_size_; ++lp) {
    for (int np = 0; np < n_size_; ++np) {
      const int dest = np * l_size_ + lp;
      RETURN_IF_ERROR(kernels::Quantize(q_->layout(dest), in + DTypeBytes(dtype, s * dest), dtype,
                                        out + slot * static_cast<uint64_t>(n_size_ * lp + np)));
    }
  }
  return Status::OK();
}

// The L copies of each shard (n', l), summed in fp32 and requantized.
Status QuantizedReduction::SumNode(uint8_t* scratch, float* mean) const {
  const uint64_t slot = slot_bytes(), nn = static_cast<uint64_t>(n_size_);
  const uint8_t* from = from_peers(scratch);
  std::vector<const void*> inputs(static_cast<size_t>(l_size_));
  for (int np = 0; np < n_size_; ++np) {
    for (int k = 0; k < l_size_; ++k) inputs[static_cast<size_t>(k)] = from + slot * (nn * k + np);
    const kernels::QuantLayout& layout = q_->layout(np * l_size_ + l_);
    if (one_node()) {
      RETURN_IF_ERROR(kernels::DequantizeSum(layout, inputs, mean));
    } else {
      RETURN_IF_ERROR(
          kernels::DequantizeSumRequantize(layout, inputs, partial(scratch) + slot * np));
    }
  }
  return Status::OK();
}

Status QuantizedReduction::Finish(uint8_t* scratch, float* mean) const {
  if (!one_node()) {
    std::vector<const void*> inputs(static_cast<size_t>(n_size_));
    for (int np = 0; np < n_size_; ++np)
      inputs[static_cast<size_t>(np)] = from_nodes(scratch) + slot_bytes() * np;
    RETURN_IF_ERROR(kernels::DequantizeSum(q_->layout(n_ * l_size_ + l_), inputs, mean));
  }
  const auto w = static_cast<float>(l_size_ * n_size_);
  for (uint64_t i = 0; i < q_->shard_elems(); ++i) mean[i] /= w;
  return Status::OK();
}

Status QuantizedReduceScatter(Communicator& node, Communicator& cross, const ShardQuantization& q,
                              const void* send, DType dtype, float* mean,
                              std::vector<uint8_t>& scratch) {
  ASSIGN_OR_RETURN(QuantizedReduction r, QuantizedReduction::Create(q, node.size(), node.rank(),
                                                                    cross.size(), cross.rank()));
  scratch.resize(r.scratch_bytes());
  uint8_t* s = scratch.data();
  RETURN_IF_ERROR(r.Quantize(send, dtype, s));
  RETURN_IF_ERROR(
      Wait(node.AllToAll(r.to_peers(s), r.from_peers(s), r.node_block_bytes(), DType::kI8)));
  RETURN_IF_ERROR(r.SumNode(s, mean));
  if (!r.one_node()) {
    RETURN_IF_ERROR(
        Wait(cross.AllToAll(r.partial(s), r.from_nodes(s), r.slot_bytes(), DType::kI8)));
  }
  return r.Finish(s, mean);
}

}  // namespace tierzero

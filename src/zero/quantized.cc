// ZeRO++'s quantized collectives over host buffers (zero/quantized.h).
#include "zero/quantized.h"

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
  auto* out = static_cast<uint8_t*>(recv);
  for (int r = 0; r < w; ++r) {
    RETURN_IF_ERROR(kernels::Dequantize(q.layout(r), scratch.data() + slot * r,
                                        out + DTypeBytes(dtype, q.shard_elems() * r), dtype));
  }
  return Status::OK();
}

Status QuantizedReduceScatter(Communicator& node, Communicator& cross, const ShardQuantization& q,
                              const void* send, DType dtype, float* mean,
                              std::vector<uint8_t>& scratch) {
  const int l_size = node.size(), n_size = cross.size();
  const int l = node.rank(), n = cross.rank();
  if (q.shards() != l_size * n_size) {
    return InvalidArgumentError("a quantization of " + std::to_string(q.shards()) + " shards for " +
                                std::to_string(n_size) + " nodes of " + std::to_string(l_size) +
                                " ranks (every node needs as many)");
  }
  const uint64_t slot = q.slot_bytes();
  const auto ln = static_cast<uint64_t>(l_size), nn = static_cast<uint64_t>(n_size);
  // [to node peers: L x N slots][from node peers: L x N slots][partial sums: N][received: N]
  scratch.resize(slot * (2 * ln * nn + 2 * nn));
  uint8_t* to_peers = scratch.data();
  uint8_t* from_peers = to_peers + slot * ln * nn;
  uint8_t* partial = from_peers + slot * ln * nn;
  uint8_t* from_nodes = partial + slot * nn;
  const auto* in = static_cast<const uint8_t*>(send);
  const uint64_t s = q.shard_elems();
  // (1) Local rank l' gets the shards of the ranks (n', l'), each in its destination's layout.
  for (int lp = 0; lp < l_size; ++lp) {
    for (int np = 0; np < n_size; ++np) {
      const int dest = np * l_size + lp;
      RETURN_IF_ERROR(kernels::Quantize(q.layout(dest), in + DTypeBytes(dtype, s * dest), dtype,
                                        to_peers + slot * (nn * lp + np)));
    }
  }
  RETURN_IF_ERROR(Wait(node.AllToAll(to_peers, from_peers, slot * nn, DType::kI8)));
  // (2) The L copies of each shard (n', l), summed in fp32 and requantized (one node: summed
  // straight into the mean).
  std::vector<const void*> inputs(ln);
  for (int np = 0; np < n_size; ++np) {
    for (int k = 0; k < l_size; ++k) inputs[k] = from_peers + slot * (nn * k + np);
    const QuantLayout& layout = q.layout(np * l_size + l);
    if (n_size == 1) {
      RETURN_IF_ERROR(kernels::DequantizeSum(layout, inputs, mean));
    } else {
      RETURN_IF_ERROR(kernels::DequantizeSumRequantize(layout, inputs, partial + slot * np));
    }
  }
  if (n_size > 1) {
    // (3) Node n' gets its shard's partial sum; (4) this shard's N partial sums, in node order.
    RETURN_IF_ERROR(Wait(cross.AllToAll(partial, from_nodes, slot, DType::kI8)));
    inputs.resize(nn);
    for (int np = 0; np < n_size; ++np) inputs[np] = from_nodes + slot * np;
    RETURN_IF_ERROR(kernels::DequantizeSum(q.layout(n * l_size + l), inputs, mean));
  }
  const auto w = static_cast<float>(l_size * n_size);
  for (uint64_t i = 0; i < s; ++i) mean[i] /= w;
  return Status::OK();
}

}  // namespace tierzero

// ZeRO++'s quantized collectives on a device stream (comm/quantized_stream.h).
#include "comm/quantized_stream.h"

#include <algorithm>
#include <string>

#include "core/bytes.h"
#include "kernels/quantize.h"

namespace tierzero {

using kernels::QuantLayout;

Status StreamQuantized::Prepare(const ShardQuantization& q) {
  if (tables_.count(&q) > 0) return Status::OK();
  const int w = q.shards();
  if (w != comm_.size() || w != node_.size() * cross_.size()) {
    return InvalidArgumentError("a quantization of " + std::to_string(w) + " shards for " +
                                std::to_string(cross_.size()) + " nodes of " +
                                std::to_string(node_.size()) + " ranks");
  }
  // The run tables, rank after rank.
  Tables t;
  std::vector<QuantLayout::Run> runs;
  for (int r = 0; r < w; ++r) {
    t.first.push_back(runs.size());
    const auto& lr = q.layout(r).runs();
    runs.insert(runs.end(), lr.begin(), lr.end());
  }
  const size_t table_bytes = std::max<size_t>(1, runs.size()) * sizeof(QuantLayout::Run);
  auto buf = DeviceBuffer::Allocate(device_, table_bytes);
  if (!buf.ok()) {
    return std::move(buf).status().WithContext("the run tables of ZeRO++'s quantized collectives");
  }
  t.runs = std::move(buf).value();
  if (!runs.empty()) {
    RETURN_IF_ERROR(device_.CopyAsync(t.runs.data(), runs.data(), runs.size() * sizeof(runs[0]),
                                      CopyKind::kHostToDevice, stream_));
    RETURN_IF_ERROR(device_.SynchronizeStream(stream_));  // `runs` is about to go
  }
  // One scratch for both collectives: qwZ's W slots, qgZ's QuantizedReduction layout.
  const uint64_t slot = q.slot_bytes();
  const uint64_t node_block = slot * static_cast<uint64_t>(cross_.size());
  const uint64_t need = std::max(slot * static_cast<uint64_t>(w),
                                 node_block * (2 * static_cast<uint64_t>(node_.size()) + 2));
  if (need > scratch_.bytes()) {
    RETURN_IF_ERROR(device_.SynchronizeStream(stream_));  // no queued collective uses it now
    scratch_.Reset();
    auto s = DeviceBuffer::Allocate(device_, need);
    if (!s.ok()) {
      tables_.clear();  // sized for the old scratch: each must be prepared again
      return std::move(s).status().WithContext("the scratch of ZeRO++'s quantized collectives (" +
                                               FormatBytes(need) + ")");
    }
    scratch_ = std::move(s).value();
  }
  tables_.emplace(&q, std::move(t));
  return Status::OK();
}

Status StreamQuantized::Prepared(const ShardQuantization& q) const {
  if (tables_.count(&q) > 0) return Status::OK();
  return FailedPreconditionError(
      "a quantized collective with a quantization never prepared (PrepareQuantized at set-up)");
}

const QuantLayout::Run* StreamQuantized::Runs(const ShardQuantization& q, int r) const {
  const Tables& t = tables_.at(&q);
  return static_cast<const QuantLayout::Run*>(t.runs.data()) + t.first[static_cast<size_t>(r)];
}

Status StreamQuantized::AllGather(const ShardQuantization& q, const void* send, void* recv,
                                  DType dtype, std::vector<std::unique_ptr<CommRequest>>* queued) {
  RETURN_IF_ERROR(Prepared(q));
  const int me = comm_.rank();
  const uint64_t slot = q.slot_bytes();
  auto* slots = static_cast<uint8_t*>(scratch_.data());
  uint8_t* mine = slots + slot * static_cast<uint64_t>(me);
  // Quantized into its slot (send read whole before anything writes recv), gathered in place,
  // every slot dequantized into its shard.
  RETURN_IF_ERROR(
      kernels::QuantizeCudaAsync(q.layout(me), Runs(q, me), send, dtype, mine, cuda_stream()));
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   comm_.AllGather(mine, slots, slot, DType::kI8));
  queued->push_back(std::move(req));
  auto* out = static_cast<uint8_t*>(recv);
  for (int r = 0; r < q.shards(); ++r) {
    RETURN_IF_ERROR(kernels::DequantizeCudaAsync(
        q.layout(r), Runs(q, r), slots + slot * static_cast<uint64_t>(r),
        out + DTypeBytes(dtype, q.shard_elems() * static_cast<uint64_t>(r)), dtype, cuda_stream()));
  }
  return Status::OK();
}

Status StreamQuantized::ReduceScatter(const ShardQuantization& q, const void* send, void* recv,
                                      DType dtype,
                                      std::vector<std::unique_ptr<CommRequest>>* queued) {
  RETURN_IF_ERROR(Prepared(q));
  const int l_size = node_.size(), l = node_.rank(), n_size = cross_.size(), n = cross_.rank();
  ASSIGN_OR_RETURN(QuantizedReduction red, QuantizedReduction::Create(q, l_size, l, n_size, n));
  auto* s = static_cast<uint8_t*>(scratch_.data());
  const uint64_t slot = q.slot_bytes(), nn = static_cast<uint64_t>(n_size);
  const auto* in = static_cast<const uint8_t*>(send);
  // (1) Each destination's shard in its own layout; local rank l' gets the shards of (n', l').
  for (int lp = 0; lp < l_size; ++lp) {
    for (int np = 0; np < n_size; ++np) {
      const int dest = np * l_size + lp;
      RETURN_IF_ERROR(kernels::QuantizeCudaAsync(
          q.layout(dest), Runs(q, dest),
          in + DTypeBytes(dtype, q.shard_elems() * static_cast<uint64_t>(dest)), dtype,
          red.to_peers(s) + slot * (nn * static_cast<uint64_t>(lp) + static_cast<uint64_t>(np)),
          cuda_stream()));
    }
  }
  ASSIGN_OR_RETURN(
      std::unique_ptr<CommRequest> inside,
      node_.AllToAll(red.to_peers(s), red.from_peers(s), red.node_block_bytes(), DType::kI8));
  queued->push_back(std::move(inside));
  const auto w = static_cast<float>(l_size * n_size);
  const int own = n * l_size + l;
  // The copies of shard (n', l) from local rank k lie at from_peers + slot * (N k + n').
  const uint64_t peer_stride = slot * nn;
  if (red.one_node()) {
    // (2) + (4): the node's copies summed, divided, rounded once.
    RETURN_IF_ERROR(kernels::DequantizeMeanCudaAsync(q.layout(own), Runs(q, own), red.from_peers(s),
                                                     l_size, peer_stride, w, recv, dtype,
                                                     cuda_stream()));
    return Status::OK();
  }
  // (2) Each node's partial sum of shard (n', l), requantized; (3) across nodes.
  for (int np = 0; np < n_size; ++np) {
    const int dest = np * l_size + l;
    RETURN_IF_ERROR(kernels::DequantizeSumRequantizeCudaAsync(
        q.layout(dest), Runs(q, dest), red.from_peers(s) + slot * static_cast<uint64_t>(np), l_size,
        peer_stride, red.partial(s) + slot * static_cast<uint64_t>(np), cuda_stream()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> across,
                   cross_.AllToAll(red.partial(s), red.from_nodes(s), slot, DType::kI8));
  queued->push_back(std::move(across));
  // (4) This shard's partial sums in node order, the mean rounded once.
  RETURN_IF_ERROR(kernels::DequantizeMeanCudaAsync(q.layout(own), Runs(q, own), red.from_nodes(s),
                                                   n_size, slot, w, recv, dtype, cuda_stream()));
  return Status::OK();
}

}  // namespace tierzero

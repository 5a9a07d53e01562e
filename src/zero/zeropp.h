// ZeRO++'s gather and reduce strategies (docs/zero.md, "ZeRO++"): beside the plain ones of
// zero/gather.h and zero/reduce.h, chosen by the chunk manager when any of the three is on.
//
//   qwZ  a chunk's all_gather moves every rank's shard block-quantized (int8 or int4) with its
//        scales in one collective, and each rank computes on the dequantized chunk.
//   hpZ  a chunk's first gather of an iteration (forward) crosses nodes; each rank then keeps the
//        1/L of the gathered chunk that is its part inside the node (its secondary partition),
//        and the chunk's later gathers of the iteration (backward, recomputation) all-gather
//        those parts inside the node only (Note [A secondary partition that is never stale]).
//   qgZ  a gradient chunk is reduced with the two-hop quantized all-to-all of comm/quantized.h.
//
// The fp32 master weights and the optimizer never see quantized values: the shards hold the
// compute dtype's exact values, and only the copies the device computes on were quantized.
//
// Thread-safety: the trainer's thread calls a strategy (through the chunk manager).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/device_collectives.h"
#include "comm/quantized.h"
#include "kernels/quantize.h"
#include "zero/gather.h"
#include "zero/reduce.h"
#include "zero/transfer.h"

namespace tierzero {

struct ZeroPPOptions {
  bool qwz = false;
  kernels::QuantSpec qwz_spec{8, 256};
  bool hpz = false;
  // Where hpZ's secondary partition lives: kDevice (device memory beside the budget), or kHost
  // (pinned host memory).
  Tier hpz_tier = Tier::kDevice;
  bool qgz = false;
  kernels::QuantSpec qgz_spec{4, 256};
  // The lengths of the runs of every rank's shard of every chunk, [chunk][rank]: the tensors'
  // pieces and the padding, in shard order, covering the shard (no quantization block spans two
  // tensors). Filled by the chunk manager from its layout.
  std::vector<std::vector<std::vector<uint64_t>>> shard_runs;

  bool any() const { return qwz || hpz || qgz; }
};

// Bytes of hpZ's secondary partition: 1/L of every chunk.
inline uint64_t HpzBytes(int num_chunks, uint64_t chunk_bytes, int ranks_per_node) {
  return static_cast<uint64_t>(num_chunks) * (chunk_bytes / static_cast<uint64_t>(ranks_per_node));
}

// One ShardQuantization per chunk from zeropp.shard_runs (the same on every rank: made from
// every rank's runs).
StatusOr<std::vector<ShardQuantization>> ChunkQuantizations(const kernels::QuantSpec& spec,
                                                            const ZeroPPOptions& zeropp,
                                                            int num_chunks);

// W > 1 with device collectives created with node_collectives (DeviceCollectivesOptions). The
// gather strategy serves qwZ and/or hpZ, the reduce strategy qgZ; the chunk manager takes the
// plain device strategies for the parts that are off.
StatusOr<std::unique_ptr<GatherStrategy>> CreateZeroPPDeviceGather(TransferContext& ctx,
                                                                   DeviceCollectives& comm,
                                                                   const GatherOptions& options,
                                                                   const ZeroPPOptions& zeropp);
StatusOr<std::unique_ptr<ReduceStrategy>> CreateZeroPPDeviceReduce(TransferContext& ctx,
                                                                   DeviceCollectives& comm,
                                                                   const ReduceOptions& options,
                                                                   const ZeroPPOptions& zeropp);

// ZeRO++ through host buffers (W > 1, a host communicator that must outlive the strategies; host
// parameter shards need kGatherTagBytes after them): the counterparts of HostGather and
// HostReduce (zeropp_host.cc). hpZ's secondary partition is pinned host memory there.
StatusOr<std::unique_ptr<GatherStrategy>> CreateZeroPPHostGather(TransferContext& ctx,
                                                                 Communicator& comm,
                                                                 const GatherOptions& options,
                                                                 const ZeroPPOptions& zeropp);
StatusOr<std::unique_ptr<ReduceStrategy>> CreateZeroPPHostReduce(TransferContext& ctx,
                                                                 Communicator& comm,
                                                                 const ReduceOptions& options,
                                                                 const ZeroPPOptions& zeropp);

// The pinned host memory of the host path's ZeRO++ strategies, for the engine's fixed host
// overheads: a gather staging slot (as many as GatherOptions::staging_bytes holds, 2 to 32), each
// of kZeroPPReduceSlots reduce slots, and hpZ's secondary partition. Zero for the parts that are
// off. InvalidArgument unless every node has as many ranks.
inline constexpr uint32_t kZeroPPReduceSlots = 4;
struct ZeroPPHostSlots {
  uint64_t gather_slot = 0, reduce_slot = 0, hpz = 0;
  uint64_t gather_send = 0, gather_recv = 0;  // the gather slot's send and receive areas
};
StatusOr<ZeroPPHostSlots> ZeroPPHostSlotBytes(const ShardGeometry& g, int node_size,
                                              const ZeroPPOptions& zeropp);

}  // namespace tierzero

// ZeRO++'s quantized collectives on a device stream (NCCL on a GPU): the counterparts of
// QuantizedAllGather and QuantizedReduceScatter (comm/quantized.h, Note [Quantized collectives])
// whose every stage is queued on one stream, the CUDA quantization kernels (kernels/quantize.h)
// between the communicators' collectives, so nothing waits on the host.
//
//   StreamQuantized sq(device, stream, nccl, nccl_node, nccl_cross);  // all queue on `stream`
//   sq.Prepare(q);                                   // set-up: run tables, scratch
//   std::vector<std::unique_ptr<CommRequest>> queued;               // to see them complete
//   sq.AllGather(q, my_shard, chunk, DType::kBF16, &queued);          // qwZ, in place
//
// Same arithmetic as the host implementation: each rank quantizes with its destinations'
// layouts, partial sums are added in fp32 in input order and requantized, the mean divided in
// fp32 and rounded once, so the two paths give the same bits (tests/zero/collectives_test.cc).
//
// Device memory: the layouts' run tables and one scratch area (the largest of qwZ's W slots and
// qgZ's 2L + 2 node blocks, QuantizedReduction::scratch_bytes), allocated by Prepare and reused
// by every collective, which the stream orders one after another. Prepare waits for the stream
// before it replaces a smaller scratch; the owner waits for the stream before destroying this.
// Thread-safety: one thread.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "comm/quantized.h"
#include "offload/device.h"
#include "tierzero/communicator.h"

namespace tierzero {

class StreamQuantized {
 public:
  // `comm` spans the ranks; `node` and `cross` are its Split(kNode) and Split(kLocalRank); all
  // three queue their collectives on `stream`, a stream of `device`, and outlive this object.
  StreamQuantized(Device& device, StreamHandle stream, Communicator& comm, Communicator& node,
                  Communicator& cross)
      : device_(device), stream_(stream), comm_(comm), node_(node), cross_(cross) {}

  // Makes the device memory for collectives with `q`, which must stay alive and unchanged as
  // long as this object (its tables are found by address): OutOfMemory, naming what it is for,
  // when the device cannot hold it (then every quantization must be prepared again). Waits for
  // the stream; call at set-up, not while collectives are queued.
  Status Prepare(const ShardQuantization& q);

  // The collectives append the requests of what they queued to `queued`, also when a later
  // stage fails to queue (the caller must still see those complete). FailedPrecondition for a
  // quantization not prepared.
  //
  // qwZ: recv (W shards of dtype) = every rank's shard, quantized and dequantized; in place when
  // send is this rank's shard of recv.
  Status AllGather(const ShardQuantization& q, const void* send, void* recv, DType dtype,
                   std::vector<std::unique_ptr<CommRequest>>* queued);
  // qgZ: recv (shard_elems of dtype) = this rank's shard of the mean of send (W shards), through
  // the two-hop quantized reduction; recv may be this rank's shard of send.
  Status ReduceScatter(const ShardQuantization& q, const void* send, void* recv, DType dtype,
                       std::vector<std::unique_ptr<CommRequest>>* queued);

 private:
  Status Prepared(const ShardQuantization& q) const;
  // Rank r's layout's runs in device memory.
  const kernels::QuantLayout::Run* Runs(const ShardQuantization& q, int r) const;
  void* cuda_stream() const { return stream_.impl; }

  Device& device_;
  StreamHandle stream_;
  Communicator& comm_;
  Communicator& node_;
  Communicator& cross_;
  struct Tables {
    DeviceBuffer runs;
    std::vector<uint64_t> first;  // rank r's runs start at runs[first[r]]
  };
  std::map<const ShardQuantization*, Tables> tables_;
  DeviceBuffer scratch_;
};

}  // namespace tierzero

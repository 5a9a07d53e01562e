// Collectives ordered on a device stream: the chunk manager's device-to-device gathers and
// reduce-scatters (docs/zero.md, "Collectives on the device").
//
//   auto dc = *CreateDeviceCollectives(device, comm);
//   device.StreamWaitEvent(dc->stream(), shard_copied);        // my shard is in its place
//   dc->AllGather(chunk + rank * shard_bytes, chunk, shard_bytes, DType::kI8);  // in place
//   device.RecordEvent(gathered, dc->stream());                // compute waits on this
//
// Each collective runs on stream() after the work queued there before it, and work queued there
// after it waits for it; the caller orders its other streams against stream() with events, as
// with any device work. Every rank must queue the same collectives in the same order. Buffers
// are device memory.
//
// Two implementations, chosen by the device:
//   - CUDA: NCCL (comm/nccl.h) on its own stream, bootstrapped over `comm`. A GPU per rank.
//   - The simulated device, whose memory the host addresses: a stream of the device whose host
//     functions run each collective, waited for, on a duplicate of `comm`
//     (Communicator::Duplicate), so they never interleave with the collectives the trainer's
//     thread starts on `comm` itself. This runs the device path end to end under mpirun on a
//     machine without a GPU, with the MPI backend.
//
// ZeRO++ (docs/zero.md, "ZeRO++"): created with node_collectives, the communicator is also split
// by node (Communicator::Split), for the all_gather inside a node of hpZ's secondary partition,
// and the quantized collectives of comm/quantized.h (qwZ's gather, qgZ's two-hop reduction) run
// on the same stream. On the simulated device they are the host implementations in the stream's
// host functions; with NCCL the node and cross-node communicators come from ncclCommSplit and
// the quantization kernels run on the stream between the collectives (comm/quantized_stream.h).
//
// Failures. A collective that fails (an error, or the deadline when another rank stopped taking
// part) cannot report it from the call that queued it: Check() returns the first failure so far
// without blocking, and Drain() waits for everything queued, then does the same. What a failed
// collective and every later one leave in their buffers is undefined (the host implementation
// skips the later ones; NCCL's communicator is aborted), so the caller must treat the ranks as
// out of step. Thread-safety: one thread queues collectives and calls Check and Drain.
#pragma once

#include <memory>
#include <string>

#include "comm/quantized.h"
#include "offload/device.h"
#include "tierzero/communicator.h"

namespace tierzero {

class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "nccl", or the host communicator's backend run in host functions ("mpi", "single").
  virtual std::string backend() const = 0;
  virtual StreamHandle stream() const = 0;

  // recv[r * count ...] = rank r's send[0 .. count) (Communicator::AllGather). In place when
  // send is this rank's block of recv.
  virtual Status AllGather(const void* send, void* recv, size_t count, DType dtype) = 0;
  // recv = block rank() of op over the ranks' sends (Communicator::ReduceScatter). In place when
  // recv is this rank's block of send.
  virtual Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                               ReduceOp op) = 0;

  // ---- With node collectives (ZeRO++) ----
  // Ranks per node (L); the world's ranks are numbered node by node (checked at creation).
  virtual int node_size() const = 0;
  // recv[l * count ...] = local rank l's send, over this node's ranks. In place when send is
  // this rank's block of recv.
  virtual Status NodeAllGather(const void* send, void* recv, size_t count, DType dtype) = 0;
  // Readies the collectives for quantized collectives with `q` (which must stay alive and
  // unchanged): on a GPU the layouts' run tables and the scratch in device memory
  // (comm/quantized_stream.h), OutOfMemory naming them when the device cannot hold them. Call
  // at set-up, before the quantized collectives with q (on a GPU they fail with
  // FailedPrecondition for a quantization never prepared). Local (no collective).
  virtual Status PrepareQuantized(const ShardQuantization& q) { return Status::OK(); }
  // qwZ: recv (W shards of `dtype`) = every rank's shard, quantized and dequantized
  // (QuantizedAllGather). In place when send is this rank's shard of recv. `q` must stay alive
  // and unchanged until the stream has passed the collective.
  virtual Status QuantizedAllGather(const ShardQuantization& q, const void* send, void* recv,
                                    DType dtype) = 0;
  // qgZ: recv (q.shard_elems() of `dtype`) = this rank's shard of the mean over the ranks of
  // send (W shards), through the two-hop quantized reduction (QuantizedReduceScatter), rounded
  // once to `dtype`. recv may be this rank's shard of send.
  virtual Status QuantizedReduceScatter(const ShardQuantization& q, const void* send, void* recv,
                                        DType dtype) = 0;

  // The first failure of a collective so far (never blocks); OK when none failed yet.
  virtual Status Check() = 0;
  // Waits for every queued collective; then Check().
  virtual Status Drain() = 0;
  virtual CommStats stats() const = 0;
};

struct DeviceCollectivesOptions {
  // Split the ranks by node for ZeRO++'s collectives (a collective call; the ranks must be
  // numbered node by node with as many on every node). Default: false.
  bool node_collectives = false;
};

// NCCL for a CUDA device (Unavailable where NCCL cannot load; every rank fails together), host
// functions over comm->Duplicate() for the simulated device. A collective call over `comm`; the
// deadline of each collective is comm's (Communicator::timeout).
StatusOr<std::unique_ptr<DeviceCollectives>> CreateDeviceCollectives(
    Device& device, const std::shared_ptr<Communicator>& comm,
    const DeviceCollectivesOptions& options = {});

// OK when the ranks are numbered node by node (rank = node * L + local rank) with L ranks on
// every node, as ZeRO++'s two-hop reduction needs; else InvalidArgument saying how to launch.
// Local: every rank can check its own topology.
Status CheckNodeMajor(const Topology& t);

}  // namespace tierzero

// The NCCL communicator: collectives between GPUs on device buffers, enqueued on one CUDA stream
// (the comm stream) in call order (DESIGN.md section 6).
//
//   auto comm = *CreateNcclCommunicator({&cuda_device, comm_stream.handle(), mpi});
//   device.StreamWaitEvent(comm_stream, shard_ready);  // after the copy that fills the shard
//   auto req = *comm->AllGather(d_shard, d_chunk, n, DType::kBF16);
//   device.RecordEvent(gathered, comm_stream);  // the compute stream waits on this
//
// Every buffer is device memory of `device`. A collective is queued on `stream` when the call
// returns, so the caller orders it against its other streams with the Device's events; the
// returned request completes when the stream reaches the collective's end (Wait and Test only
// observe it). The bootstrap communicator (MPI, or Single for one rank) broadcasts NCCL's unique
// id and supplies the topology; it must have the same ranks.
//
// Each rank needs its own GPU: NCCL refuses two ranks on one device. Pick the device ordinal
// from the topology's local rank.
//
// Reductions follow NCCL's algorithm (ring or tree order; bf16 and fp16 are rounded at each
// step), unlike the MPI backend's fixed rank order in fp32 (communicator.h): sums may differ in
// the last bits between backends and between world sizes.
//
// NCCL is loaded with dlopen when the first communicator is created (libnccl.so.2 on the loader
// path, or the file named by TZ_NCCL_LIBRARY), so binaries start on machines without it and the
// library is one tierzero does not ship.
//
// Timeouts: the communicator is non-blocking (ncclConfig_t.blocking = 0); a collective or the
// initialisation still unfinished after the timeout aborts the NCCL communicator
// (ncclCommAbort, which frees the stream) and fails with DeadlineExceeded; the communicator is
// unusable afterwards. An NCCL older than the headers tierzero was built with has no
// ncclCommInitRankConfig: initialisation then falls back to the blocking ncclCommInitRank,
// which has no deadline (collectives keep theirs).
#pragma once

#include <memory>

#include "offload/device.h"
#include "tierzero/communicator.h"

namespace tierzero {

struct NcclOptions {
  Device* device = nullptr;  // a CUDA device (DeviceKind::kCuda)
  StreamHandle stream;       // the comm stream, of `device`
  std::shared_ptr<Communicator> bootstrap;
  // Seconds before an unfinished initialisation or collective fails. Default: 300.
  double timeout_s = 300;
};

// Unavailable in a build without CUDA, without a loadable NCCL (the message names the library
// tried), or for a device that is not a GPU; InvalidArgument for a missing stream or bootstrap.
StatusOr<std::shared_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options);

// OK when NCCL loads on this machine (libnccl.so.2, or TZ_NCCL_LIBRARY); Unavailable, naming
// what was tried, otherwise. Local: no collective, no GPU needed.
Status NcclLoadable();

}  // namespace tierzero

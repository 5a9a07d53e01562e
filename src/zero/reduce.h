// ReduceStrategy: how a gradient chunk, once its backward is complete on the device, reaches
// this rank's gradient shard in host memory (mean over the ranks with W > 1). One strategy is
// chosen with the gather strategy (zero/gather.h), for the same path:
//
//   LocalReduce   one rank: the chunk is copied D2H into the gradient shard (with gradient
//                 accumulation, into a pinned staging slot and added in fp32 on the D2H stream).
//   HostReduce    W ranks over a host communicator: the chunk is copied D2H into a reduce slot,
//                 waited for, and reduce-scattered (mean) into the gradient shard, started on the
//                 trainer's thread and completed later (Finish) while backward goes on.
//   DeviceReduce  W ranks with device collectives: reduce-scattered in place on the comm stream,
//                 then only the local shard of the mean is copied D2H as in LocalReduce.
//
// Thread-safety: the trainer's thread calls a strategy (through the chunk manager).
#pragma once

#include <memory>

#include "comm/device_collectives.h"
#include "core/status.h"
#include "tierzero/communicator.h"
#include "zero/transfer.h"

namespace tierzero {

struct ReduceOptions {
  // Add each micro-batch's gradient into fp32 gradient shards instead of overwriting them.
  bool accumulate = false;
};

class ReduceStrategy {
 public:
  virtual ~ReduceStrategy() = default;

  // Reduces the gradient chunk at `device_grad` (chunk_bytes, complete on the compute stream at
  // `written`, which the D2H stream already waits for) into the local gradient shard. True when
  // a copy out of `device_grad` is still queued on the D2H stream (the memory is in use until
  // the stream passes it); false when the strategy is done with it.
  virtual StatusOr<bool> Reduce(int chunk, void* device_grad, const Event& written) = 0;
  // Completes reductions in flight: all of them (wait_all), the oldest (wait_oldest), or those
  // already done. With W > 1 a failure leaves the ranks out of step.
  virtual Status Finish(bool wait_all, bool wait_oldest) {
    (void)wait_all, (void)wait_oldest;
    return Status::OK();
  }
  // True when a Reduce's last work on the chunk is queued on the D2H stream (the gradient shard
  // is final once the stream passes it); false when Finish completes it later on the host.
  virtual bool final_on_d2h() const { return true; }
};

StatusOr<std::unique_ptr<ReduceStrategy>> CreateLocalReduce(TransferContext& ctx,
                                                            const ReduceOptions& options);
StatusOr<std::unique_ptr<ReduceStrategy>> CreateHostReduce(TransferContext& ctx, Communicator& comm,
                                                           const ReduceOptions& options);
StatusOr<std::unique_ptr<ReduceStrategy>> CreateDeviceReduce(TransferContext& ctx,
                                                             DeviceCollectives& comm,
                                                             const ReduceOptions& options);

// acc[0 .. n) += src[0 .. n) in fp32 (gradient accumulation): core/convert.h's AddToF32 over
// spans on every core (Note [Accumulating on the host's cores]); the same bits on any number.
Status AddToF32Parallel(float* acc, const void* src, DType dtype, uint64_t n);

}  // namespace tierzero

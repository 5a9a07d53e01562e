// Built without CUDA: CreateNcclCommunicator says so.
#include "comm/nccl.h"

namespace tierzero {

StatusOr<std::shared_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions&) {
  return UnavailableError(
      "this build has no CUDA, so no NCCL (install the CUDA Toolkit at /usr/local/cuda and "
      "reconfigure)");
}

Status NcclLoadable() { return UnavailableError("this build has no CUDA, so no NCCL"); }

}  // namespace tierzero

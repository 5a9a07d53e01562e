// Built without MPI: Communicator::Mpi() says so.
#include "tierzero/communicator.h"

namespace tierzero {

Status Communicator::InitMpi() {
  return UnavailableError(
      "this build has no MPI (install libopenmpi-dev and reconfigure with TZ_ENABLE_MPI=ON)");
}

StatusOr<std::shared_ptr<Communicator>> Communicator::Mpi(int) {
  return UnavailableError(
      "this build has no MPI (install libopenmpi-dev and reconfigure with TZ_ENABLE_MPI=ON)");
}

}  // namespace tierzero

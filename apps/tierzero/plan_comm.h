// The communicator's latency and rate for `mpirun -np N tierzero plan --calibrate` (plan.cc).
#pragma once

#include <utility>

#include "tierzero/communicator.h"
#include "tierzero/status.h"

namespace tierzero::app {

// The communicator's latency (seconds) and rate (bytes a rank receives per second): Note
// [Collectives on the cores that compute], src/engine/plan.cc.
StatusOr<std::pair<double, double>> MeasureComm(Communicator& comm);

}  // namespace tierzero::app

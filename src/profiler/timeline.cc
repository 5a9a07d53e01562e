#include "profiler/timeline.h"

namespace tierzero {

const char* TrackName(Track t) {
  switch (t) {
    case Track::kCompute:
      return "compute";
    case Track::kH2D:
      return "H2D";
    case Track::kD2H:
      return "D2H";
    case Track::kNvmeRead:
      return "NVMe read";
    case Track::kNvmeWrite:
      return "NVMe write";
    case Track::kOptimizer:
      return "optimizer";
    case Track::kComm:
      return "comm";
  }
  return "?";
}

}  // namespace tierzero

// MeasureComm (plan_comm.h): timed collectives of three sizes, fitted to latency + bytes / rate.
#include "plan_comm.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace tierzero::app {

// plan_comm.h
// The ranks all-gather and reduce-scatter bf16 blocks of three sizes, as
// the chunks' collectives do; rank 0's median seconds per collective, fitted by least squares to
// latency + the bytes a rank receives / rate.
StatusOr<std::pair<double, double>> MeasureComm(Communicator& comm) {
  const size_t w = static_cast<size_t>(comm.size());
  std::vector<double> xs, ys;
  for (const size_t count : {size_t{512}, size_t{16384}, size_t{262144}}) {
    std::vector<uint16_t> send(count * w, 0x3f80), recv(count * w);
    TZ_RETURN_IF_ERROR(comm.Barrier());
    std::vector<double> t;
    for (int i = 0; i < 48; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      TZ_ASSIGN_OR_RETURN(auto g, comm.AllGather(send.data(), recv.data(), count, DType::kBF16));
      TZ_RETURN_IF_ERROR(g->Wait());
      TZ_ASSIGN_OR_RETURN(auto r, comm.ReduceScatter(send.data(), recv.data(), count, DType::kBF16,
                                                     ReduceOp::kSum));
      TZ_RETURN_IF_ERROR(r->Wait());
      if (i >= 8)
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                    2);
    }
    std::sort(t.begin(), t.end());
    xs.push_back(static_cast<double>((w - 1) * count * 2));
    ys.push_back(t[t.size() / 2]);
  }
  double mx = 0, my = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    mx += xs[i] / static_cast<double>(xs.size());
    my += ys[i] / static_cast<double>(ys.size());
  }
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    sxy += (xs[i] - mx) * (ys[i] - my);
    sxx += (xs[i] - mx) * (xs[i] - mx);
  }
  const double per_byte = sxx > 0 ? sxy / sxx : 0;
  if (!(per_byte > 0)) return InternalError("the collectives' times do not grow with their bytes");
  const double latency = std::max(ys.front() - per_byte * xs.front(), 0.0);
  return std::make_pair(latency, 1.0 / per_byte);
}

}  // namespace tierzero::app

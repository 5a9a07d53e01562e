// `tierzero plan`'s searches over configs (plan_search.cc): what would make a run fit, the most
// layers of a shape, and the largest model the budgets train (--largest).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpt/gpt.h"
#include "tierzero/plan.h"
#include "train.h"

namespace tierzero::app {

// One plan of a config (plan.cc): the GPT (or a trace file's parameters) registered on an engine
// that never finalizes.
// The compute of a GPT's moments by kind, timed on this machine (plan.cc), and the rest of a step.
struct ComputeTimes {
  std::vector<double> kinds;
  double other_s = 0;
};

struct Planner {
  int ranks_per_node = 0;
  const MachineRates& rates;
  std::vector<double> kinds;      // measured compute per kind of moment (GPT, this machine)
  double other_s = 0;             // and the rest of a step
  const WarmupTrace* file_trace;  // --trace
  // The run `kinds` were timed for: a plan of another width, heads, batch or context takes none
  // of them (its blocks take another time; plan --largest printed a 10 x 640 GPT's step from a
  // 5 x 192's blocks: figures hunt 47). Another layer count takes them (one time per layer).
  RunConfig timed;
  // Times another run's compute (plan --largest's answer); empty where nothing is timed here.
  std::function<StatusOr<ComputeTimes>(const RunConfig&)> time_compute;
  StatusOr<PlanPrediction> Run(const RunConfig& cfg, int ranks) const;
  // Whether `kinds` are of cfg's model and batch (a layer count aside).
  bool TimedFor(const RunConfig& cfg) const;
};

// What would make a run that does not fit fit: each budget, the rank count, activation
// checkpointing, the moments' format, the batch size and the sequence length alone, then the
// smallest device and host budgets together. Printed, and into out["advice"].
void Advise(const Planner& pl, const RunConfig& cfg, int ranks, nlohmann::json& out);
// `tierzero train` reserves what its placement puts on NVMe (each rank on the machine its own)
// when it opens the tier: when the disk under nvme_path has less free, a line says the run would
// refuse to start, and `out` gets "nvme_free_bytes". `nvme_placed`: the placement's NVMe bytes
// per rank (0: no tier opened, nothing said).
void WarnNvmeSpace(const RunConfig& cfg, uint64_t nvme_placed, int ranks, int ranks_per_node,
                   nlohmann::json& out);
// A plan that fits its budgets, but whose host memory (with the simulated device's) is more than
// this process may use here: train refuses it on this machine; says so, and `out`
// gets "host_memory_limit_bytes".
void WarnHostMemory(const RunConfig& cfg, const PlanPrediction& p, int ranks, int ranks_per_node,
                    nlohmann::json& out);

// The most layers of this width that fit these budgets (0: not one).
int LargestModel(const Planner& pl, const RunConfig& cfg, int ranks);

// --largest: over a ladder of widths (heads 64 wide), each with the most layers that fit (at most
// d_model / 64), the
// model with the most parameters these budgets train at this batch, sequence length and moment
// format; printed with its plan (where every byte lives), and into out["largest"].
Status Largest(const Planner& pl, const RunConfig& cfg, int ranks, nlohmann::json& out);

}  // namespace tierzero::app

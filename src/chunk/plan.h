// The placement plan (DESIGN.md section 5): from the warm-up trace, which gathered chunks to
// evict and which gathers to start at each moment so that transfers hide behind compute.
//
// Model. Moments run in order on the compute stream, each for its traced compute time, and
// start only when all their chunks are gathered. Gathers run one after another on the copy link,
// chunk c taking gather_seconds[c] (its tier's bandwidth; NVMe-resident shards include the disk
// read). The device holds at most slots[k] gathered chunks during moment k:
//     slots[k] = (capacity - max(non-model peak of moments k and k+1) - workspace) / chunk bytes
// Policies:
//   - kOnDemand: keep only the current moment's chunks; gather each at its moment (what warm-up
//     does, and what a system without a cache would do).
//   - kLru: gather on demand, keep chunks cached, evict the least recently used.
//   - kBelady: gather on demand, evict the chunk whose next use is furthest (the fewest gathers
//     any policy can do with these slots; used for the lower bound).
//   - kPlan: Belady eviction (the chunk whose next use is furthest) and prefetch: at each moment,
//     start gathers for upcoming moments, in order of use, as far ahead as the slots of every
//     moment in between, and the staging slots, allow.
// The gathered chunks live in one slot region reserved for the whole iteration, so every moment
// gets the same number of slots: the smallest slots[k] (the region must leave room for the
// activation peak). Chunks held by outer scopes (Moment::held) and chunks in
// options.grads_in_place between their first and last backward use are never evicted, under
// every policy. Simulate() runs a policy through the model and reports the compute-stream stall
// and the decisions, which the chunk manager replays.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "chunk/trace.h"
#include "core/status.h"

namespace tierzero {

enum class CachePolicy : uint8_t { kOnDemand, kLru, kBelady, kPlan };
std::string_view CachePolicyName(CachePolicy p);

struct PlanOptions {
  uint64_t device_capacity = 0;        // bytes for gathered chunks plus non-model data
  uint64_t workspace_bytes = 0;        // kept free (library workspaces)
  uint64_t chunk_bytes = 0;            // one gathered chunk
  std::vector<double> gather_seconds;  // per chunk id
  // Chunks whose gradients are written into the gathered copy itself (chunk reuse). Such a chunk
  // cannot be evicted between its first and its last backward use: its slot holds the only copy
  // of the gradients written so far. Empty: none.
  std::vector<bool> grads_in_place;
  // Of those, chunks that are reduced only when backward ends (a tensor had no backward use):
  // pinned from their first backward use to the end of the iteration. Empty: none.
  std::vector<bool> reduced_at_end;
  // Chunks that are always on the device (device-resident shards): never gathered, evicted or
  // counted against the slots. Empty: none.
  std::vector<bool> always_resident;
  // Chunks whose gather holds a pinned staging slot from its start until its copy to the device
  // is done (NVMe-resident shards; every chunk on the host-buffer collective path), and how many
  // such slots there are. kPlan stops a moment's prefetches (which go in order of use) at the
  // first staged chunk that finds staging_slots staged gathers in flight (Note [Prefetches
  // within the staging slots]). Empty / 0: unlimited.
  std::vector<bool> staged;
  int staging_slots = 0;
};

struct MomentDecision {
  int slots = 0;            // gathered chunks the device can hold during this moment
  std::vector<int> evict;   // evicted when the moment begins, before its gathers
  std::vector<int> gather;  // gathers started when the moment begins (its own misses first,
                            // then prefetches for later moments)
  double start_s = 0;       // simulated start of the moment's compute
  double stall_s = 0;       // simulated wait before it
};

struct Schedule {
  CachePolicy policy = CachePolicy::kPlan;
  std::vector<MomentDecision> moments;
  double stall_s = 0;     // total compute-stream stall
  double compute_s = 0;   // total compute
  double transfer_s = 0;  // total time the copy link was busy
  int gathers = 0;
  int prefetch_hits = 0;  // chunks already gathered (or in flight) when their moment began
};

// Device slots per moment; OutOfMemory when a moment's own chunks do not fit (naming the
// moment, the chunks it needs, the slots available and the non-model bytes that took the rest).
StatusOr<std::vector<int>> SlotsPerMoment(const std::vector<Moment>& moments,
                                          const PlanOptions& options);

// Runs `policy` over the trace. The chunk ids in the moments index options.gather_seconds.
StatusOr<Schedule> Simulate(const std::vector<Moment>& moments, const PlanOptions& options,
                            CachePolicy policy);

// A lower bound on any policy's stall in this model, the larger of: for every moment k, the
// gathers of all chunks first used by moments 0..k minus the compute of moments 0..k-1 (the link
// is serial and starts with the iteration); and the copy link's total work with Belady's minimal
// number of gathers (from a kBelady schedule) minus all compute but the last moment's.
double StallLowerBound(const std::vector<Moment>& moments, const PlanOptions& options,
                       const Schedule& belady_schedule);

}  // namespace tierzero

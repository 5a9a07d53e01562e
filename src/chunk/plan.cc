#include "chunk/plan.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "core/bytes.h"

namespace tierzero {

std::string_view CachePolicyName(CachePolicy p) {
  switch (p) {
    case CachePolicy::kOnDemand:
      return "on_demand";
    case CachePolicy::kLru:
      return "lru";
    case CachePolicy::kBelady:
      return "belady";
    case CachePolicy::kPlan:
      return "plan";
  }
  return "?";
}

StatusOr<std::vector<int>> SlotsPerMoment(const std::vector<Moment>& moments,
                                          const PlanOptions& o) {
  if (o.chunk_bytes == 0) return InvalidArgumentError("plan: chunk_bytes is 0");
  std::vector<int> slots(moments.size());
  for (size_t k = 0; k < moments.size(); ++k) {
    uint64_t nonmodel = std::max(moments[k].nonmodel_bytes, moments[k].nonmodel_peak);
    if (k + 1 < moments.size()) {
      nonmodel = std::max({nonmodel, moments[k + 1].nonmodel_bytes, moments[k + 1].nonmodel_peak});
    }
    const uint64_t reserved = nonmodel + o.workspace_bytes;
    const uint64_t room = o.device_capacity > reserved ? o.device_capacity - reserved : 0;
    // (At most 2^30: a budget of an exabyte over small chunks would not fit an int.)
    slots[k] = static_cast<int>(std::min<uint64_t>(room / o.chunk_bytes, uint64_t{1} << 30));
    std::set<int> distinct(moments[k].chunks.begin(), moments[k].chunks.end());
    distinct.insert(moments[k].held.begin(), moments[k].held.end());
    for (auto it = distinct.begin(); it != distinct.end();) {
      const size_t c = static_cast<size_t>(*it);
      it = (c < o.always_resident.size() && o.always_resident[c]) ? distinct.erase(it) : ++it;
    }
    if (static_cast<int>(distinct.size()) > slots[k]) {
      return OutOfMemoryError(
          "moment " + std::to_string(k) + " needs " + std::to_string(distinct.size()) +
          " gathered chunks of " + FormatBytes(o.chunk_bytes) + " but only " +
          std::to_string(slots[k]) + " fit: device capacity " + FormatBytes(o.device_capacity) +
          ", non-model data " + FormatBytes(nonmodel) + ", workspace " +
          FormatBytes(o.workspace_bytes) +
          "; raise the device budget, use smaller chunks, or fewer activations (checkpointing)");
    }
  }
  return slots;
}

namespace {

constexpr int kNever = std::numeric_limits<int>::max();

// next_use[k][c]: the first moment >= k that uses chunk c (kNever if none), built lazily per chunk
// as a sorted list of use moments.
class NextUse {
 public:
  NextUse(const std::vector<Moment>& moments, int num_chunks)
      : uses_(static_cast<size_t>(num_chunks)) {
    for (size_t k = 0; k < moments.size(); ++k) {
      for (int c : moments[k].chunks) {
        auto& u = uses_[static_cast<size_t>(c)];
        if (u.empty() || u.back() != static_cast<int>(k)) u.push_back(static_cast<int>(k));
      }
    }
  }
  // The first use at or after moment k.
  int After(int c, int k) const {
    const auto& u = uses_[static_cast<size_t>(c)];
    auto it = std::lower_bound(u.begin(), u.end(), k);
    return it == u.end() ? kNever : *it;
  }

 private:
  std::vector<std::vector<int>> uses_;
};

}  // namespace

StatusOr<Schedule> Simulate(const std::vector<Moment>& moments, const PlanOptions& o,
                            CachePolicy policy) {
  const int num_chunks = static_cast<int>(o.gather_seconds.size());
  for (const Moment& m : moments) {
    for (int c : m.chunks) {
      if (c < 0 || c >= num_chunks) {
        return InvalidArgumentError("plan: moment names chunk " + std::to_string(c) + " of " +
                                    std::to_string(num_chunks));
      }
    }
  }
  ASSIGN_OR_RETURN(std::vector<int> slots, SlotsPerMoment(moments, o));
  const int K = static_cast<int>(moments.size());
  // One region for the iteration: the tightest moment decides its size.
  const int region = slots.empty() ? 0 : *std::min_element(slots.begin(), slots.end());
  std::fill(slots.begin(), slots.end(), region);
  auto resident = [&](int c) {
    return static_cast<size_t>(c) < o.always_resident.size() &&
           o.always_resident[static_cast<size_t>(c)];
  };
  NextUse next(moments, num_chunks);
  // Backward interval per chunk whose gradients live in its slot: [first, last] backward use.
  std::vector<int> first_bwd(static_cast<size_t>(num_chunks), kNever),
      last_bwd(static_cast<size_t>(num_chunks), -1);
  for (int k = 0; k < K; ++k) {
    if (!moments[static_cast<size_t>(k)].backward) continue;
    for (int c : moments[static_cast<size_t>(k)].chunks) {
      if (static_cast<size_t>(c) < o.grads_in_place.size() &&
          o.grads_in_place[static_cast<size_t>(c)]) {
        first_bwd[static_cast<size_t>(c)] = std::min(first_bwd[static_cast<size_t>(c)], k);
        last_bwd[static_cast<size_t>(c)] = std::max(last_bwd[static_cast<size_t>(c)], k);
      }
    }
  }
  for (int c = 0; c < num_chunks; ++c) {
    if (static_cast<size_t>(c) < o.reduced_at_end.size() &&
        o.reduced_at_end[static_cast<size_t>(c)] && first_bwd[static_cast<size_t>(c)] != kNever) {
      last_bwd[static_cast<size_t>(c)] = K;  // reduced by FinishBackward
    }
  }
  // Evicting c when moment k begins would lose gradients written at an earlier moment.
  auto pinned = [&](int c, int k) {
    return first_bwd[static_cast<size_t>(c)] < k && last_bwd[static_cast<size_t>(c)] >= k;
  };

  Schedule sched;
  sched.policy = policy;
  sched.moments.resize(static_cast<size_t>(K));
  // Gathered or in flight: chunk -> time its gather completes.
  std::map<int, double> cached;
  // Completion times of the staged gathers started so far.
  std::vector<double> staged_done;
  auto staged = [&](int c) {
    return static_cast<size_t>(c) < o.staged.size() && o.staged[static_cast<size_t>(c)];
  };
  auto staging_full = [&](double now) {  // `now` never decreases
    if (o.staging_slots <= 0) return false;
    std::erase_if(staged_done, [&](double t) { return t <= now; });
    return static_cast<int>(staged_done.size()) >= o.staging_slots;
  };
  std::map<int, int> last_used;  // for LRU
  double link_free = 0, compute_end = 0;
  // Note [The look-ahead's cursor]
  // The plan's prefetch looks ahead from moment k + 1 for chunks neither resident nor gathered,
  // and skips every moment whose chunks all are. Rescanning those for each k made the plan
  // quadratic in moments: 49,000 moments of a trace whose chunks all fit took 28 s (hunt 46).
  // `scan_from` is where the last look-ahead stopped: every chunk of the moments between k + 1
  // and it is resident or gathered, so the scan starts there, doing what the rescan did
  // (PlanTest.PlanDecidesAsALookAheadThatRescansEveryMoment). The look-ahead evicts only chunks
  // used after where it is, and a moment has misses to evict for only past the cursor; an
  // eviction still moves the cursor back to the chunk's next use, so no order of them breaks it.
  int scan_from = 0;

  auto gather = [&](int c, double now, MomentDecision& d) {
    const double start = std::max(link_free, now);
    link_free = start + o.gather_seconds[static_cast<size_t>(c)];
    sched.transfer_s += o.gather_seconds[static_cast<size_t>(c)];
    cached[c] = link_free;
    if (staged(c)) staged_done.push_back(link_free);
    d.gather.push_back(c);
    ++sched.gathers;
  };

  for (int k = 0; k < K; ++k) {
    MomentDecision& d = sched.moments[static_cast<size_t>(k)];
    d.slots = slots[static_cast<size_t>(k)];
    const double now = compute_end;  // the host reaches moment k's Acquire
    // What the moment uses, plus what outer scopes still hold: neither may be evicted.
    std::set<int> needed;
    for (int c : moments[static_cast<size_t>(k)].chunks) {
      if (!resident(c)) needed.insert(c);
    }
    std::set<int> keep = needed;
    for (int c : moments[static_cast<size_t>(k)].held) {
      if (!resident(c)) keep.insert(c);
    }
    for (int c : needed) {
      if (cached.count(c)) ++sched.prefetch_hits;
    }
    // Evict to make room for this moment's misses.
    auto evict = [&](int c) {
      cached.erase(c);
      d.evict.push_back(c);
      scan_from = std::min(scan_from, next.After(c, k + 1));
    };
    if (policy == CachePolicy::kOnDemand) {
      std::vector<int> drop;
      for (auto& [c, t] : cached) {
        if (!keep.count(c) && !pinned(c, k)) drop.push_back(c);
      }
      for (int c : drop) evict(c);
    }
    int misses = 0;
    for (int c : needed) misses += cached.count(c) ? 0 : 1;
    while (static_cast<int>(cached.size()) + misses > d.slots) {
      int victim = -1;
      for (auto& [c, t] : cached) {
        if (keep.count(c) || pinned(c, k)) continue;
        if (victim < 0) {
          victim = c;
          continue;
        }
        if (policy == CachePolicy::kLru) {
          if (last_used[c] < last_used[victim]) victim = c;
        } else if (next.After(c, k) > next.After(victim, k)) {
          victim = c;
        }
      }
      if (victim < 0) {
        return OutOfMemoryError("moment " + std::to_string(k) + " needs " + std::to_string(misses) +
                                " more slot(s) but the " + std::to_string(cached.size()) +
                                " gathered chunks all hold gradients not yet reduced; raise the "
                                "device budget or use smaller chunks");
      }
      evict(victim);
    }
    for (int c : moments[static_cast<size_t>(k)].chunks) {
      if (!resident(c) && !cached.count(c)) gather(c, now, d);
    }
    // Prefetch for later moments (the plan only), within the staging slots.
    //
    // Note [Prefetches within the staging slots]
    // A gather through a pinned staging slot (an NVMe read; every gather on the host-buffer
    // collective path) takes the slot on the caller's thread when it is issued, and the slot
    // comes back only when the device has copied out of it. The caller runs ahead of the device,
    // so with all slots taken it waits inside the moment's prefetches, before it has queued the
    // next moment's compute: once the device catches up, the compute stream idles until enough
    // earlier copies are done. With room for every chunk on the device, chunk_bench's plan
    // started all 36 NVMe gathers at the first moment and stalled 52-62 ms there. So the plan
    // starts a staged prefetch only while fewer than staging_slots staged gathers are in flight
    // in the model; the rest start at later moments. A moment's own misses are not held back.
    if (policy == CachePolicy::kPlan) {
      bool stop = false;
      int j = std::max(k + 1, scan_from);
      for (; j < K && !stop; ++j) {
        for (int c : moments[static_cast<size_t>(j)].chunks) {
          if (resident(c) || cached.count(c)) continue;
          if (staged(c) && staging_full(now)) {
            stop = true;
            break;
          }
          if (static_cast<int>(cached.size()) >= region) {  // (every moment's slots)
            // Evict the chunk used furthest in the future, if that is after j.
            int victim = -1;
            for (auto& [v, t] : cached) {
              if (keep.count(v) || pinned(v, k)) continue;
              if (victim < 0 || next.After(v, k + 1) > next.After(victim, k + 1)) victim = v;
            }
            if (victim < 0 || next.After(victim, k + 1) <= j) {
              stop = true;
              break;
            }
            evict(victim);  // (used after j: the moments before j keep theirs)
          }
          gather(c, now, d);
        }
        if (stop) break;
      }
      scan_from = j;  // (stopped inside moment j, or K: nothing left to gather)
    }
    double ready = now;
    for (int c : needed) ready = std::max(ready, cached[c]);
    d.start_s = ready;
    d.stall_s = ready - compute_end;
    sched.stall_s += d.stall_s;
    compute_end = ready + moments[static_cast<size_t>(k)].compute_seconds;
    sched.compute_s += moments[static_cast<size_t>(k)].compute_seconds;
    for (int c : needed) last_used[c] = k;
  }
  return sched;
}

double StallLowerBound(const std::vector<Moment>& moments, const PlanOptions& o,
                       const Schedule& belady) {
  if (moments.empty()) return 0;
  // Prefix bound: before moment k starts, every chunk used by moments 0..k has crossed the
  // (serial) link at least once, while only the compute of moments 0..k-1 has run.
  double bound = 0, transfers = 0, compute = 0;
  std::set<int> seen;
  for (const Moment& m : moments) {
    for (int c : m.chunks) {
      if (seen.insert(c).second) transfers += o.gather_seconds[static_cast<size_t>(c)];
    }
    bound = std::max(bound, transfers - compute);
    compute += m.compute_seconds;
  }
  // Total bound: Belady's gathers (the fewest possible with these slots) against all compute
  // but the last moment's.
  const double hideable = belady.compute_s - moments.back().compute_seconds;
  return std::max(bound, belady.transfer_s - hideable);
}

}  // namespace tierzero

#include "chunk/plan.h"

#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <random>
#include <set>

#include "core/bytes.h"

namespace tierzero {
namespace {

Moment Mo(std::vector<int> chunks, uint64_t nonmodel, uint64_t peak, double seconds,
          bool backward = false) {
  Moment m;
  m.chunks = std::move(chunks);
  m.nonmodel_bytes = nonmodel;
  m.nonmodel_peak = peak;
  m.compute_seconds = seconds;
  m.backward = backward;
  return m;
}

// A training-like trace: forward over chunks 0..n-1 one per moment, backward n-1..0.
std::vector<Moment> ForwardBackward(int n, double compute_s, uint64_t nonmodel = 0) {
  std::vector<Moment> m;
  for (int c = 0; c < n; ++c) m.push_back(Mo({c}, nonmodel, nonmodel, compute_s));
  for (int c = n - 1; c >= 0; --c) m.push_back(Mo({c}, nonmodel, nonmodel, 2 * compute_s));
  return m;
}

PlanOptions Options(int chunks, int slots, double gather_s) {
  PlanOptions o;
  o.chunk_bytes = 16 * kMiB;
  o.device_capacity = static_cast<uint64_t>(slots) * o.chunk_bytes;
  o.gather_seconds.assign(static_cast<size_t>(chunks), gather_s);
  return o;
}

// Replays a schedule's decisions and checks the invariants the executor relies on.
// `always_resident`: chunks never gathered (PlanOptions::always_resident).
void CheckDecisions(const std::vector<Moment>& moments, const Schedule& s,
                    const std::vector<bool>& always_resident = {}) {
  std::set<int> resident;
  for (size_t k = 0; k < moments.size(); ++k) {
    const MomentDecision& d = s.moments[k];
    for (int c : d.evict) {
      ASSERT_TRUE(resident.erase(c)) << "moment " << k << " evicts " << c << " which is absent";
    }
    for (int c : d.gather) ASSERT_TRUE(resident.insert(c).second) << "gathered twice: " << c;
    ASSERT_LE(static_cast<int>(resident.size()), d.slots) << "moment " << k;
    for (int c : moments[k].chunks) {
      if (static_cast<size_t>(c) < always_resident.size() && always_resident[c]) continue;
      ASSERT_TRUE(resident.count(c)) << "moment " << k << " lacks " << c;
    }
  }
}

TEST(PlanTest, SlotsAccountForNonModelBytesOfThisAndTheNextMoment) {
  std::vector<Moment> m = {Mo({0}, 0, 0, 1), Mo({1}, 0, 40 * kMiB, 1), Mo({2}, 0, 0, 1)};
  PlanOptions o = Options(3, 8, 0.1);  // 128 MiB
  o.workspace_bytes = 16 * kMiB;
  auto slots = SlotsPerMoment(m, o);
  ASSERT_TRUE(slots.ok());
  EXPECT_EQ((*slots)[0], 4) << "(128 - 40 - 16) / 16, the next moment's peak counts";
  EXPECT_EQ((*slots)[1], 4);
  EXPECT_EQ((*slots)[2], 7);
  m[1].chunks = {0, 1, 2, 3, 4};
  o.gather_seconds.assign(5, 0.1);
  auto bad = SlotsPerMoment(m, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(bad.status().message().find("moment 1 needs 5 gathered chunks"), std::string::npos)
      << bad.status().message();
}

TEST(PlanTest, PlanHidesTransfersWhenBandwidthSuffices) {
  const auto m = ForwardBackward(12, 1.0);
  const PlanOptions o = Options(12, 4, 0.5);  // gathers take half a moment
  auto on_demand = Simulate(m, o, CachePolicy::kOnDemand);
  auto lru = Simulate(m, o, CachePolicy::kLru);
  auto belady = Simulate(m, o, CachePolicy::kBelady);
  auto plan = Simulate(m, o, CachePolicy::kPlan);
  ASSERT_TRUE(on_demand.ok() && lru.ok() && belady.ok() && plan.ok());
  CheckDecisions(m, *on_demand);
  CheckDecisions(m, *lru);
  CheckDecisions(m, *plan);
  const double bound = StallLowerBound(m, o, *belady);
  EXPECT_DOUBLE_EQ(bound, 0.5) << "only the first gather cannot hide";
  EXPECT_NEAR(on_demand->stall_s, 0.5 * 23, 1e-9)
      << "every moment but the turning point (chunk 11 twice in a row) waits for its gather";
  EXPECT_LE(plan->stall_s, on_demand->stall_s / 3);
  EXPECT_LE(plan->stall_s, bound * 1.10);
  EXPECT_GT(plan->prefetch_hits, 20);
}

// Note [Prefetches within the staging slots]: with room for every chunk, the plan would start all
// gathers at the first moment; with staged ones (NVMe reads) among them it stops, in order of
// use, at the first staged one that finds the staging slots all in flight, and the transfers
// still hide.
TEST(PlanTest, PlanKeepsStagedPrefetchesWithinTheStagingSlots) {
  const int n = 12;
  const auto m = ForwardBackward(n, 1.0);
  PlanOptions o = Options(n, n, 0.1);
  auto unlimited = Simulate(m, o, CachePolicy::kPlan);
  ASSERT_TRUE(unlimited.ok());
  EXPECT_EQ(unlimited->moments[0].gather.size(), static_cast<size_t>(n));

  o.staging_slots = 3;
  o.staged.assign(n, false);
  for (int c = 0; c < n; c += 2) o.staged[static_cast<size_t>(c)] = true;  // even chunks
  auto plan = Simulate(m, o, CachePolicy::kPlan);
  ASSERT_TRUE(plan.ok());
  CheckDecisions(m, *plan);
  // Replay the model independently: the link is serial, each gather takes 0.1 s, moment k
  // starts when its chunks are in and runs 1 s (forward) or 2 s (backward).
  double link = 0, now = 0;
  std::map<int, double> done;
  std::vector<double> staged_done;
  for (size_t k = 0; k < m.size(); ++k) {
    int in_flight = 0;
    for (double t : staged_done) in_flight += t > now ? 1 : 0;
    for (int c : plan->moments[k].gather) {
      link = std::max(link, now) + 0.1;
      done[c] = link;
      if (o.staged[static_cast<size_t>(c)]) {
        staged_done.push_back(link);
        ++in_flight;
      }
    }
    EXPECT_LE(in_flight, 3) << "moment " << k;
    double start = now;
    for (int c : m[k].chunks) start = std::max(start, done[c]);
    now = start + m[k].compute_seconds;
  }
  // The first moment starts 0..5 and stops at 6, the fourth staged gather.
  EXPECT_EQ(plan->moments[0].gather, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_NEAR(plan->stall_s, 0.1, 1e-9) << "only the first gather cannot hide";
}

TEST(PlanTest, PlanApproachesTheBoundWhenTransfersDominate) {
  const auto m = ForwardBackward(12, 0.2);
  const PlanOptions o = Options(12, 4, 1.0);  // the link is the bottleneck
  auto belady = Simulate(m, o, CachePolicy::kBelady);
  auto plan = Simulate(m, o, CachePolicy::kPlan);
  auto on_demand = Simulate(m, o, CachePolicy::kOnDemand);
  ASSERT_TRUE(belady.ok() && plan.ok() && on_demand.ok());
  CheckDecisions(m, *plan);
  const double bound = StallLowerBound(m, o, *belady);
  EXPECT_GT(bound, 10.0);
  EXPECT_GE(plan->stall_s, bound - 1e-9) << "no policy beats the bound";
  EXPECT_LE(plan->stall_s, bound * 1.10);
  EXPECT_LT(plan->stall_s, on_demand->stall_s);
}

TEST(PlanTest, BeladyNeverGathersMoreThanLruOnRandomTraces) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    const int chunks = 3 + static_cast<int>(rng() % 10);
    std::vector<Moment> m;
    for (int k = 0; k < 60; ++k) {
      Moment x;
      const int n = 1 + static_cast<int>(rng() % 2);
      for (int i = 0; i < n; ++i) x.chunks.push_back(static_cast<int>(rng() % chunks));
      x.compute_seconds = 0.1 * (1 + rng() % 5);
      m.push_back(x);
    }
    PlanOptions o = Options(chunks, 2 + static_cast<int>(rng() % 3), 0.05 * (1 + rng() % 8));
    auto lru = Simulate(m, o, CachePolicy::kLru);
    auto belady = Simulate(m, o, CachePolicy::kBelady);
    auto plan = Simulate(m, o, CachePolicy::kPlan);
    ASSERT_TRUE(lru.ok() && belady.ok() && plan.ok());
    CheckDecisions(m, *lru);
    CheckDecisions(m, *belady);
    CheckDecisions(m, *plan);
    EXPECT_LE(belady->gathers, lru->gathers) << "trial " << trial;
    EXPECT_GE(plan->stall_s, StallLowerBound(m, o, *belady) - 1e-9) << "trial " << trial;
  }
}

// The plan policy as first written: each moment's look-ahead rescans every later moment from
// k + 1 (quadratic in moments). Simulate starts where the last look-ahead stopped (Note [The
// look-ahead's cursor]); its decisions must be these, moment for moment.
Schedule RescanningPlan(const std::vector<Moment>& moments, const PlanOptions& o, int slots) {
  const int K = static_cast<int>(moments.size());
  const int n = static_cast<int>(o.gather_seconds.size());
  auto flag = [](const std::vector<bool>& v, int c) {
    return static_cast<size_t>(c) < v.size() && v[static_cast<size_t>(c)];
  };
  auto next_use = [&](int c, int from) {
    for (int k = from; k < K; ++k)
      for (int x : moments[static_cast<size_t>(k)].chunks)
        if (x == c) return k;
    return std::numeric_limits<int>::max();
  };
  std::vector<int> first(static_cast<size_t>(n), std::numeric_limits<int>::max()), last(n, -1);
  for (int k = 0; k < K; ++k) {
    if (!moments[static_cast<size_t>(k)].backward) continue;
    for (int c : moments[static_cast<size_t>(k)].chunks) {
      if (!flag(o.grads_in_place, c)) continue;
      first[static_cast<size_t>(c)] = std::min(first[static_cast<size_t>(c)], k);
      last[static_cast<size_t>(c)] = std::max(last[static_cast<size_t>(c)], k);
    }
  }
  for (int c = 0; c < n; ++c)
    if (flag(o.reduced_at_end, c) && last[static_cast<size_t>(c)] >= 0)
      last[static_cast<size_t>(c)] = K;
  auto pinned = [&](int c, int k) {
    return first[static_cast<size_t>(c)] < k && last[static_cast<size_t>(c)] >= k;
  };
  Schedule s;
  s.moments.resize(static_cast<size_t>(K));
  std::map<int, double> cached;
  std::vector<double> staged_done;
  double link = 0, compute_end = 0;
  for (int k = 0; k < K; ++k) {
    MomentDecision& d = s.moments[static_cast<size_t>(k)];
    d.slots = slots;
    const double now = compute_end;
    std::set<int> needed, keep;
    for (int c : moments[static_cast<size_t>(k)].chunks)
      if (!flag(o.always_resident, c)) needed.insert(c);
    keep = needed;
    for (int c : moments[static_cast<size_t>(k)].held)
      if (!flag(o.always_resident, c)) keep.insert(c);
    auto furthest = [&](int from) {
      int victim = -1;
      for (auto& [c, t] : cached)
        if (!keep.count(c) && !pinned(c, k) &&
            (victim < 0 || next_use(c, from) > next_use(victim, from)))
          victim = c;
      return victim;
    };
    auto gather = [&](int c) {
      link = std::max(link, now) + o.gather_seconds[static_cast<size_t>(c)];
      cached[c] = link;
      if (flag(o.staged, c)) staged_done.push_back(link);
      d.gather.push_back(c);
    };
    int misses = 0;
    for (int c : needed) misses += cached.count(c) ? 0 : 1;
    while (static_cast<int>(cached.size()) + misses > slots) {
      const int v = furthest(k);
      cached.erase(v);
      d.evict.push_back(v);
    }
    for (int c : moments[static_cast<size_t>(k)].chunks)
      if (!flag(o.always_resident, c) && !cached.count(c)) gather(c);
    bool stop = false;
    for (int j = k + 1; j < K && !stop; ++j) {
      for (int c : moments[static_cast<size_t>(j)].chunks) {
        if (flag(o.always_resident, c) || cached.count(c)) continue;
        std::erase_if(staged_done, [&](double t) { return t <= now; });
        if (flag(o.staged, c) && o.staging_slots > 0 &&
            static_cast<int>(staged_done.size()) >= o.staging_slots) {
          stop = true;
          break;
        }
        if (static_cast<int>(cached.size()) >= slots) {
          const int v = furthest(k + 1);
          if (v < 0 || next_use(v, k + 1) <= j) {
            stop = true;
            break;
          }
          cached.erase(v);
          d.evict.push_back(v);
        }
        gather(c);
      }
    }
    double ready = now;
    for (int c : needed) ready = std::max(ready, cached[c]);
    d.start_s = ready;
    d.stall_s = ready - compute_end;
    compute_end = ready + moments[static_cast<size_t>(k)].compute_seconds;
  }
  return s;
}

TEST(PlanTest, PlanDecidesAsALookAheadThatRescansEveryMoment) {
  std::mt19937 rng(47);
  for (int trial = 0; trial < 200; ++trial) {
    const int chunks = 2 + static_cast<int>(rng() % 12);
    std::vector<Moment> m;
    const int K = 20 + static_cast<int>(rng() % 200);
    for (int k = 0; k < K; ++k) {
      Moment x;
      const int per = 1 + static_cast<int>(rng() % 3);
      for (int i = 0; i < per; ++i) x.chunks.push_back(static_cast<int>(rng() % chunks));
      x.compute_seconds = 0.01 * (1 + rng() % 9);
      x.backward = k >= K / 2;
      m.push_back(x);
    }
    const int slots = 3 + static_cast<int>(rng() % (chunks + 2));
    PlanOptions o = Options(chunks, slots, 0);
    for (int c = 0; c < chunks; ++c)
      o.gather_seconds[static_cast<size_t>(c)] = 0.005 * (1 + rng() % 7);
    o.staging_slots = static_cast<int>(rng() % 4);
    for (int c = 0; c < chunks; ++c) {
      o.staged.push_back(rng() % 2 == 0);
      o.always_resident.push_back(rng() % 6 == 0);
      o.grads_in_place.push_back(rng() % 4 == 0);
    }
    auto plan = Simulate(m, o, CachePolicy::kPlan);
    if (!plan.ok()) continue;  // (pinned chunks that fill every slot: refused alike)
    CheckDecisions(m, *plan, o.always_resident);
    const Schedule want = RescanningPlan(m, o, plan->moments[0].slots);
    for (size_t k = 0; k < m.size(); ++k) {
      const MomentDecision &got = plan->moments[k], &w = want.moments[k];
      ASSERT_EQ(got.gather, w.gather) << "trial " << trial << ", moment " << k;
      ASSERT_EQ(got.evict, w.evict) << "trial " << trial << ", moment " << k;
      ASSERT_EQ(got.start_s, w.start_s) << "trial " << trial << ", moment " << k;
    }
  }
}

TEST(PlanTest, UnknownChunkIsInvalidArgument) {
  std::vector<Moment> m = {Mo({5}, 0, 0, 1)};
  EXPECT_EQ(Simulate(m, Options(2, 4, 1), CachePolicy::kPlan).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tierzero

namespace tierzero {
namespace {

// The fewest gathers any eviction choice achieves, by exhaustive search (one chunk per moment,
// demand gathers only, `slots` cache entries).
int BruteForceMisses(const std::vector<int>& seq, size_t k, std::set<int> cache, int slots) {
  if (k == seq.size()) return 0;
  const int c = seq[k];
  if (cache.count(c)) return BruteForceMisses(seq, k + 1, cache, slots);
  if (static_cast<int>(cache.size()) < slots) {
    cache.insert(c);
    return 1 + BruteForceMisses(seq, k + 1, cache, slots);
  }
  int best = 1 << 30;
  for (int victim : std::set<int>(cache)) {
    std::set<int> next = cache;
    next.erase(victim);
    next.insert(c);
    best = std::min(best, 1 + BruteForceMisses(seq, k + 1, next, slots));
  }
  return best;
}

TEST(PlanTest, BeladyMissCountEqualsBruteForceOptimum) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 60; ++trial) {
    const int chunks = 3 + static_cast<int>(rng() % 3);
    const int slots = 2 + static_cast<int>(rng() % 2);
    std::vector<int> seq;
    std::vector<Moment> m;
    for (int k = 0; k < 11; ++k) {
      seq.push_back(static_cast<int>(rng() % chunks));
      m.push_back(Mo({seq.back()}, 0, 0, 1.0));
    }
    PlanOptions o;
    o.chunk_bytes = kMiB;
    o.device_capacity = static_cast<uint64_t>(slots) * kMiB;
    o.gather_seconds.assign(static_cast<size_t>(chunks), 0.1);
    auto belady = Simulate(m, o, CachePolicy::kBelady);
    ASSERT_TRUE(belady.ok());
    EXPECT_EQ(belady->gathers, BruteForceMisses(seq, 0, {}, slots)) << "trial " << trial;
  }
}

TEST(PlanTest, ChunksWithInPlaceGradientsAreNotEvictedMidBackward) {
  // Chunk 0 is used in backward at moments 3 and 5; with two slots, Belady would evict it at
  // moment 4 (its next use is furthest) and lose the gradient written at moment 3.
  std::vector<Moment> m = {Mo({0}, 0, 0, 1),       Mo({1}, 0, 0, 1),       Mo({2}, 0, 0, 1),
                           Mo({0}, 0, 0, 1, true), Mo({1}, 0, 0, 1, true), Mo({0}, 0, 0, 1, true)};
  PlanOptions o = Options(3, 2, 0.1);
  o.grads_in_place = {true, true, true};
  for (CachePolicy p :
       {CachePolicy::kOnDemand, CachePolicy::kLru, CachePolicy::kBelady, CachePolicy::kPlan}) {
    auto s = Simulate(m, o, p);
    ASSERT_TRUE(s.ok()) << CachePolicyName(p);
    CheckDecisions(m, *s);
    for (int k = 4; k <= 5; ++k) {
      for (int c : s->moments[static_cast<size_t>(k)].evict) {
        EXPECT_NE(c, 0) << CachePolicyName(p) << " evicted chunk 0 at moment " << k;
      }
    }
  }
}

}  // namespace
}  // namespace tierzero

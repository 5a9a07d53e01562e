// chunk_bench: compute-stream stall of the chunk cache policies on a synthetic 24-layer
// transformer, executed for real on HostSimDevice with throttled copies and an NVMe tier.
//
// The trace: token and position embeddings (the token embedding tied to the LM head, so it is
// used first and last), then 24 pre-LN blocks (ln1, qkv, proj, ln2, fc, fc2 with their biases;
// d_model = 512 by default), forward then backward. Each moment "computes" for
// 2 x tokens x params FLOPs (backward twice that) at --flops, as a timed wait on the compute
// stream, and reports its activation bytes to the engine. Parameter shards: half in pinned host
// memory, half on NVMe (the host budget is smaller than the model's state).
//
// For each setting (H2D bandwidth, device slots) and policy: a warm-up iteration (recording),
// then a measured iteration. Counters, in seconds of compute-stream stall (iteration wall time
// minus compute):
//   stall_s_on_demand, stall_s_lru, stall_s_plan   measured
//   stall_s_plan_first    of the plan's stall, the wait before the first moment
//   stall_s_lower_bound   the model's bound: first gathers + (transfers - hideable compute)
//   stall_s_floor         the harness's own stall: the same moments on the same compute stream,
//                         with the stream work of an Acquire whose chunks are all in place and no
//                         transfers at all (what any policy pays here for the simulation itself)
//   compute_s             compute per iteration
//   plan_above_floor_over_bound   (stall_s_plan - stall_s_floor) / stall_s_lower_bound
// and BM_Bookkeeping reports the host time of one Acquire + Release pair with every chunk
// resident (target < 2 us).
//
// Note [The simulated device gets a core of its own]
// HostSim runs each stream on a thread, so the simulated GPU shares this machine's two cores
// with the trainer's thread, the copy threads (memcpy, CRC checks of NVMe reads) and io_uring.
// When the compute stream's thread woke the H2D thread, the scheduler often ran the wakee on the
// waker's core and preempted the compute thread for the whole copy: 1-2 ms gaps at a third of
// the moments, which no policy caused and a GPU does not have. So by default (--tz_pin=1, with
// at least two CPUs) the compute stream's thread runs alone on the first CPU the process may use,
// every other thread of the process on the remaining CPUs. The device memory is faulted in up front
// (HostSimOptions::populate), as a GPU's is.
//
// The streams wait for each other by polling, every 2-20 us (--tz_poll_us), so that the compute
// stream does not pay a thread wake-up each time it signals a copy stream (Note [Stream waits
// that cost the signaller nothing], host_sim_device.cc).
//
//   build/bin/chunk_bench --benchmark_format=json [--tz_path=DIR] [--tz_pin=0|1] [--tz_poll_us=N]
#include <benchmark/benchmark.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "chunk/chunk_manager.h"
#include "core/bytes.h"
#include "core/check.h"
#include "offload/host_sim_device.h"

namespace tierzero {
namespace {

using Clock = std::chrono::steady_clock;

std::string g_path = "build";  // where the NVMe swap file goes
bool g_pin = true;             // Note [The simulated device gets a core of its own]
// Note [Stream waits that cost the signaller nothing] (host_sim_device.cc); --tz_poll_us=0: off.
double g_poll_us = 20;

// The CPUs this process may run on, as main() found them.
std::vector<int> g_cpus;

bool Pinning() { return g_pin && g_cpus.size() >= 2; }

// The compute stream's thread gets the first allowed CPU, every other thread the rest.
void PinCallingThread(bool compute) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (compute) {
    CPU_SET(g_cpus[0], &set);
  } else {
    for (size_t i = 1; i < g_cpus.size(); ++i) CPU_SET(g_cpus[i], &set);
  }
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
    std::fprintf(stderr, "chunk_bench: cannot set the CPU affinity; threads float\n");
  }
}

// Queues, on the compute stream, the pinning of its thread to the first allowed CPU.
void PinComputeStream(Device& device, StreamHandle compute) {
  if (Pinning()) TZ_CHECK_OK(device.LaunchHostFunc(compute, [] { PinCallingThread(true); }));
}

struct Model {
  std::vector<TensorDesc> tensors;
  std::vector<std::vector<int>> moments_fwd;  // tensors per forward moment
  uint64_t params_per_layer = 0;
};

Model Transformer(int layers, uint64_t d, uint64_t vocab, uint64_t ctx) {
  Model m;
  auto add = [&](const std::string& name, uint64_t n) {
    m.tensors.push_back({name, n});
    return static_cast<int>(m.tensors.size()) - 1;
  };
  const int wte = add("wte", vocab * d), wpe = add("wpe", ctx * d);
  m.moments_fwd.push_back({wte, wpe});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    std::vector<int> t = {add(p + "ln1.g", d),
                          add(p + "ln1.b", d),
                          add(p + "attn.qkv.w", 3 * d * d),
                          add(p + "attn.qkv.b", 3 * d),
                          add(p + "attn.proj.w", d * d),
                          add(p + "attn.proj.b", d),
                          add(p + "ln2.g", d),
                          add(p + "ln2.b", d),
                          add(p + "mlp.fc.w", 4 * d * d),
                          add(p + "mlp.fc.b", 4 * d),
                          add(p + "mlp.proj.w", 4 * d * d),
                          add(p + "mlp.proj.b", d)};
    m.moments_fwd.push_back(t);
  }
  m.params_per_layer = 12 * d * d + 13 * d;
  const int lnf_g = add("lnf.g", d), lnf_b = add("lnf.b", d);
  m.moments_fwd.push_back({lnf_g, lnf_b, wte});  // final LN + tied LM head
  return m;
}

struct RunResult {
  double stall_s = 0, first_s = 0, compute_s = 0, predicted_stall_s = 0, lower_bound_s = 0;
  double counter_stall_s = 0;  // the manager's own measurement (device events)
};

// Compute per moment: 2 x tokens x params FLOPs forward, twice that backward.
double MomentSeconds(const Model& model, const std::vector<int>& t, bool backward, double flops,
                     uint64_t tokens) {
  uint64_t params = 0;
  for (int i : t) params += model.tensors[static_cast<size_t>(i)].numel;
  return (backward ? 4.0 : 2.0) * static_cast<double>(tokens) * static_cast<double>(params) / flops;
}

// What the compute stream itself sees of one iteration: the begin and end of each moment's
// compute, taken on the stream's own thread (sleep overshoot counts as compute).
struct StreamTimes {
  Clock::time_point start;
  std::vector<Clock::time_point> begins, ends;
  void Clear() {
    begins.clear();
    ends.clear();
    begins.reserve(256);
    ends.reserve(256);
    start = Clock::now();
  }
  // Queues a moment's compute: a timed wait on the stream.
  void Queue(Device& device, StreamHandle stream, double seconds) {
    TZ_CHECK_OK(device.LaunchHostFunc(stream, [this, seconds] {
      begins.push_back(Clock::now());
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      ends.push_back(Clock::now());
    }));
  }
  static double Secs(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }
  double First() const { return Secs(start, begins[0]); }
  // The gaps before the first moment and between moments.
  double Stall() const {
    double s = First();
    for (size_t k = 1; k < begins.size(); ++k) s += Secs(ends[k - 1], begins[k]);
    return s;
  }
  double Compute() const {
    double s = 0;
    for (size_t k = 0; k < begins.size(); ++k) s += Secs(begins[k], ends[k]);
    return s;
  }
};

// The harness's floor: the moments' compute on a HostSim compute stream with, per moment, the
// stream work of an Acquire whose chunks are all gathered and done (its event, and the timing
// event measure_stalls adds), the caller waiting for the stream at the end as EndIteration does.
double HarnessFloor(const Model& model, double flops, uint64_t tokens) {
  HostSimOptions ho;
  ho.capacity_bytes = 64 * kMiB;
  ho.poll_stream_waits_us = g_poll_us;
  auto device = std::move(CreateHostSimDevice(ho)).value();
  double floor = 0;
  {
    auto compute = std::move(Stream::Create(*device, "compute")).value();
    PinComputeStream(*device, compute.handle());
    std::vector<Event> begin, start;
    for (size_t k = 0; k < 2 * model.moments_fwd.size(); ++k) {
      begin.push_back(std::move(Event::Create(*device)).value());
      start.push_back(std::move(Event::Create(*device)).value());
    }
    StreamTimes times;
    for (int round = 0; round < 2; ++round) {  // the first warms the stream up
      TZ_CHECK_OK(compute.Synchronize());
      times.Clear();
      size_t k = 0;
      auto moment = [&](const std::vector<int>& t, bool backward) {
        TZ_CHECK_OK(device->RecordEvent(begin[k].handle(), compute.handle()));
        TZ_CHECK_OK(device->RecordEvent(start[k].handle(), compute.handle()));
        times.Queue(*device, compute.handle(), MomentSeconds(model, t, backward, flops, tokens));
        ++k;
      };
      for (const auto& t : model.moments_fwd) moment(t, false);
      for (auto it = model.moments_fwd.rbegin(); it != model.moments_fwd.rend(); ++it) {
        moment(*it, true);
      }
      TZ_CHECK_OK(compute.Synchronize());
    }
    floor = times.Stall();
  }
  return floor;
}

// slots: gathered chunks the device has room for beside the activations; 0: every chunk.
RunResult Run(const Model& model, CachePolicy policy, double h2d_bps, int slots, double flops,
              uint64_t tokens) {
  LayoutOptions lo;
  lo.groups = model.moments_fwd;
  ChunkLayout layout = std::move(ChunkLayout::Build(model.tensors, lo)).value();
  const uint64_t shard = layout.shard_bytes();
  const uint64_t n = static_cast<uint64_t>(layout.num_chunks());
  TierBudgets budgets;
  budgets.host_bytes = n * shard + (n / 2) * shard;  // gradients + half the parameter shards
  budgets.nvme_bytes = 64 * kGiB;
  Placement placement = std::move(PlaceShards(layout, budgets)).value();

  const uint64_t act_per_layer = 2 * kMiB;
  // Room for the gathered chunks beside the activations at their peak (the end of forward).
  const uint64_t room = slots > 0 ? static_cast<uint64_t>(slots) : n;
  const uint64_t budget = room * layout.chunk_bytes() + act_per_layer * model.moments_fwd.size();
  HostSimOptions ho;
  ho.capacity_bytes = budget + 4 * layout.chunk_bytes();
  ho.h2d_bytes_per_second = h2d_bps;
  ho.populate = true;  // Note [The simulated device gets a core of its own]
  ho.poll_stream_waits_us = g_poll_us;
  auto device = std::move(CreateHostSimDevice(ho)).value();
  NvmeStoreOptions no;
  no.paths = {g_path};
  no.bytes_per_path = AlignUp(n * shard, 4096) + 16 * kMiB;
  auto nvme = std::move(NvmeStore::Open(no)).value();
  RunResult r;
  {
    auto compute = std::move(Stream::Create(*device, "compute")).value();
    PinComputeStream(*device, compute.handle());
    ChunkManagerOptions mo;
    mo.device_budget_bytes = budget;
    mo.policy = policy;
    mo.h2d_bytes_per_second = h2d_bps;
    mo.nvme_read_bytes_per_second = 1.5e9;
    mo.measure_stalls = true;
    auto store = std::move(ShardStore::Create(*device, nvme.get(),
                                              ChunkManager::StoreOptions(layout, placement, mo)))
                     .value();
    auto manager =
        std::move(ChunkManager::Create(*device, compute.handle(), *store, layout, placement, mo))
            .value();
    // Compute is a timed wait on the compute stream; the stall is what the stream itself sees.
    StreamTimes times;
    auto iteration = [&] {
      times.Clear();
      uint64_t act = 0;
      TZ_CHECK_OK(manager->BeginIteration());
      auto moment = [&](const std::vector<int>& t, Phase phase) {
        TZ_CHECK_OK(manager->Acquire(t, phase));
        times.Queue(*device, compute.handle(),
                    MomentSeconds(model, t, phase == Phase::kBackward, flops, tokens));
        TZ_CHECK_OK(manager->Release(t, phase));
      };
      for (const auto& t : model.moments_fwd) {
        moment(t, Phase::kForward);
        act += act_per_layer;
        manager->OnNonModelBytes(act);
      }
      for (auto it = model.moments_fwd.rbegin(); it != model.moments_fwd.rend(); ++it) {
        moment(*it, Phase::kBackward);
        act -= act_per_layer;
        manager->OnNonModelBytes(act);
      }
      TZ_CHECK_OK(manager->EndIteration());
    };
    iteration();  // warm-up: records and plans
    TZ_CHECK(manager->has_plan());
    iteration();
    r.stall_s = times.Stall();
    r.first_s = times.First();
    r.compute_s = times.Compute();
    if (std::getenv("CHUNK_BENCH_DEBUG") != nullptr) {
      std::fprintf(stderr, "measured gaps (%s): first %.3f ms;",
                   std::string(CachePolicyName(policy)).c_str(), r.first_s * 1e3);
      std::vector<double> gaps;
      for (size_t k = 1; k < times.begins.size(); ++k) {
        const double g = StreamTimes::Secs(times.ends[k - 1], times.begins[k]);
        gaps.push_back(g * 1e6);
        if (g > 2e-4) std::fprintf(stderr, " m%zu %.2f", k, g * 1e3);
      }
      std::sort(gaps.begin(), gaps.end());
      std::fprintf(stderr, "; gaps p50 %.0f us, p90 %.0f us\n", gaps[gaps.size() / 2],
                   gaps[gaps.size() * 9 / 10]);
    }
    r.predicted_stall_s = manager->schedule().stall_s;
    r.counter_stall_s = manager->counters().last_stall_seconds;
    if (std::getenv("CHUNK_BENCH_DEBUG") != nullptr) {
      const auto& sc = manager->schedule();
      const auto gs = manager->GatherSeconds();
      std::fprintf(stderr, "policy %s: %d chunks of %s\n",
                   std::string(CachePolicyName(policy)).c_str(), layout.num_chunks(),
                   FormatBytes(layout.chunk_bytes()).c_str());
      for (size_t k = 0; k < sc.moments.size(); ++k) {
        std::fprintf(stderr, "  m%-3zu slots %2d stall %7.3f ms compute %6.2f ms chunks", k,
                     sc.moments[k].slots, sc.moments[k].stall_s * 1e3,
                     manager->trace()[k].compute_seconds * 1e3);
        for (int c : manager->trace()[k].chunks)
          std::fprintf(stderr, " %d(%.1fms)", c, gs[static_cast<size_t>(c)] * 1e3);
        std::fprintf(stderr, " gather");
        for (int c : sc.moments[k].gather) std::fprintf(stderr, " %d", c);
        std::fprintf(stderr, "\n");
      }
    }
    // The model's bound, from Belady's gathers over the recorded trace.
    PlanOptions po;
    po.device_capacity = budget;
    po.chunk_bytes = layout.chunk_bytes();
    po.gather_seconds = manager->GatherSeconds();
    auto belady = Simulate(manager->trace(), po, CachePolicy::kBelady);
    TZ_CHECK(belady.ok()) << belady.status().ToString();
    r.lower_bound_s = StallLowerBound(manager->trace(), po, *belady);
  }
  return r;
}

// args: h2d bandwidth in MB/s; device slots for gathered chunks (0: room for every chunk).
void BM_Stalls(benchmark::State& state) {
  const double h2d = static_cast<double>(state.range(0)) * 1e6;
  const int slots = static_cast<int>(state.range(1));
  const Model model = Transformer(24, 512, 256, 1024);
  constexpr double kFlops = 2e12;
  constexpr uint64_t kTokens = 4096;
  RunResult on_demand, lru, plan;
  double floor = 0;
  for (auto _ : state) {
    on_demand = Run(model, CachePolicy::kOnDemand, h2d, slots, kFlops, kTokens);
    lru = Run(model, CachePolicy::kLru, h2d, slots, kFlops, kTokens);
    plan = Run(model, CachePolicy::kPlan, h2d, slots, kFlops, kTokens);
    floor = HarnessFloor(model, kFlops, kTokens);
  }
  state.counters["stall_s_on_demand"] = on_demand.stall_s;
  state.counters["stall_s_lru"] = lru.stall_s;
  state.counters["stall_s_plan"] = plan.stall_s;
  state.counters["stall_s_plan_first"] = plan.first_s;
  state.counters["stall_s_lower_bound"] = plan.lower_bound_s;
  state.counters["stall_s_floor"] = floor;
  state.counters["stall_s_plan_predicted"] = plan.predicted_stall_s;
  state.counters["stall_s_plan_counter"] = plan.counter_stall_s;
  state.counters["compute_s"] = plan.compute_s;
  state.counters["plan_over_on_demand"] = plan.stall_s / std::max(1e-9, on_demand.stall_s);
  // The plan's stall beyond what the harness itself costs, over the model's bound.
  state.counters["plan_above_floor_over_bound"] =
      std::max(0.0, plan.stall_s - floor) / std::max(1e-9, plan.lower_bound_s);
}

// Host time of Acquire + Release with every chunk device-resident (no copies): bookkeeping only.
void BM_Bookkeeping(benchmark::State& state) {
  const Model model = Transformer(24, 128, 256, 256);
  LayoutOptions lo;
  lo.groups = model.moments_fwd;
  ChunkLayout layout = std::move(ChunkLayout::Build(model.tensors, lo)).value();
  TierBudgets budgets;
  budgets.device_shard_bytes = 1 * kGiB;
  budgets.host_bytes = 1 * kGiB;
  Placement placement = std::move(PlaceShards(layout, budgets)).value();
  HostSimOptions ho;
  ho.capacity_bytes = 256 * kMiB;
  auto device = std::move(CreateHostSimDevice(ho)).value();
  {
    auto compute = std::move(Stream::Create(*device, "compute")).value();
    ChunkManagerOptions mo;
    mo.device_budget_bytes = 64 * kMiB;
    auto store = std::move(ShardStore::Create(*device, nullptr,
                                              ChunkManager::StoreOptions(layout, placement, mo)))
                     .value();
    auto manager =
        std::move(ChunkManager::Create(*device, compute.handle(), *store, layout, placement, mo))
            .value();
    auto forward_only = [&](int* pairs) {
      TZ_CHECK_OK(manager->BeginIteration());
      for (const auto& t : model.moments_fwd) {
        TZ_CHECK_OK(manager->Acquire(t, Phase::kForward));
        TZ_CHECK_OK(manager->Release(t, Phase::kForward));
        ++*pairs;
      }
      TZ_CHECK_OK(manager->EndIteration());
    };
    int pairs = 0;
    forward_only(&pairs);  // warm-up and plan
    pairs = 0;
    double host_s = 0;
    for (auto _ : state) {
      TZ_CHECK_OK(manager->BeginIteration());
      const auto t0 = Clock::now();
      for (const auto& t : model.moments_fwd) {
        TZ_CHECK_OK(manager->Acquire(t, Phase::kForward));
        TZ_CHECK_OK(manager->Release(t, Phase::kForward));
        ++pairs;
      }
      host_s += std::chrono::duration<double>(Clock::now() - t0).count();
      TZ_CHECK_OK(manager->EndIteration());
    }
    state.counters["us_per_acquire_release"] = host_s / pairs * 1e6;
    state.counters["tensors_per_acquire"] = 12;
  }
}

}  // namespace
}  // namespace tierzero

BENCHMARK(tierzero::BM_Stalls)
    ->Args({12000, 12})  // PCIe-like: transfers hide behind compute
    ->Args({400, 12})    // starved: transfers exceed compute
    ->Args({12000, 0})   // room for every chunk (Note [Prefetches within the staging slots])
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(tierzero::BM_Bookkeeping)->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--tz_path=", 10) == 0) tierzero::g_path = argv[i] + 10;
    if (std::strcmp(argv[i], "--tz_pin=0") == 0) tierzero::g_pin = false;
    if (std::strncmp(argv[i], "--tz_poll_us=", 13) == 0) {
      char* end = nullptr;
      tierzero::g_poll_us = std::strtod(argv[i] + 13, &end);
      if (end == argv[i] + 13 || *end != '\0') {
        std::fprintf(stderr, "chunk_bench: --tz_poll_us wants microseconds (0 = off), got '%s'\n",
                     argv[i] + 13);
        return 2;
      }
    }
  }
  std::filesystem::create_directories(tierzero::g_path);
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) tierzero::g_cpus.push_back(c);
    }
  }
  // Every thread created from here on (the streams', io_uring's) inherits the non-compute CPUs.
  if (tierzero::Pinning()) tierzero::PinCallingThread(false);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

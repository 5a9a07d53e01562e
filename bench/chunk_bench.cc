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
// For each bandwidth setting and policy: a warm-up iteration (recording), then a measured
// iteration. Counters, in seconds of compute-stream stall (iteration wall time minus compute):
//   stall_s_on_demand, stall_s_lru, stall_s_plan   measured
//   stall_s_lower_bound   the model's bound: first gathers + (transfers - hideable compute)
//   compute_s             compute per iteration
// and BM_Bookkeeping reports the host time of one Acquire + Release pair with every chunk
// resident (target < 2 us).
//
//   build/bin/chunk_bench --benchmark_format=json [--tz_path=DIR]
#include <benchmark/benchmark.h>

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
  double stall_s = 0, compute_s = 0, predicted_stall_s = 0, lower_bound_s = 0;
  double counter_stall_s = 0;  // the manager's own measurement (device events)
};

RunResult Run(const Model& model, CachePolicy policy, double h2d_bps, double flops,
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
  // Room for 12 gathered chunks beside the activations at their peak (the end of forward).
  const uint64_t budget = 12 * layout.chunk_bytes() + act_per_layer * model.moments_fwd.size();
  HostSimOptions ho;
  ho.capacity_bytes = budget + 4 * layout.chunk_bytes();
  ho.h2d_bytes_per_second = h2d_bps;
  auto device = std::move(CreateHostSimDevice(ho)).value();
  NvmeStoreOptions no;
  no.paths = {g_path};
  no.bytes_per_path = AlignUp(n * shard, 4096) + 16 * kMiB;
  auto nvme = std::move(NvmeStore::Open(no)).value();
  RunResult r;
  {
    auto compute = std::move(Stream::Create(*device, "compute")).value();
    ChunkManagerOptions mo;
    mo.device_budget_bytes = budget;
    mo.policy = policy;
    mo.h2d_bytes_per_second = h2d_bps;
    mo.nvme_read_bytes_per_second = 1.5e9;
    mo.measure_stalls = true;
    auto manager = std::move(ChunkManager::Create(*device, compute.handle(), nvme.get(), layout,
                                                  placement, mo))
                       .value();
    // Compute is a timed wait on the compute stream. The stall is what the compute stream itself
    // sees: the gaps between one moment's compute ending and the next one's starting (and before
    // the first), taken on the stream's own thread. Sleep overshoot counts as compute.
    std::vector<Clock::time_point> begins, ends;
    Clock::time_point iteration_start;
    auto iteration = [&]() -> double {
      begins.clear();
      ends.clear();
      begins.reserve(256);
      ends.reserve(256);
      iteration_start = Clock::now();
      uint64_t act = 0;
      TZ_CHECK_OK(manager->BeginIteration());
      auto moment = [&](const std::vector<int>& t, Phase phase, double seconds) {
        TZ_CHECK_OK(manager->Acquire(t, phase));
        TZ_CHECK_OK(device->LaunchHostFunc(compute.handle(), [seconds, &begins, &ends] {
          begins.push_back(Clock::now());
          std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
          ends.push_back(Clock::now());
        }));
        TZ_CHECK_OK(manager->Release(t, phase));
      };
      for (const auto& t : model.moments_fwd) {
        uint64_t params = 0;
        for (int i : t) params += model.tensors[static_cast<size_t>(i)].numel;
        moment(t, Phase::kForward, 2.0 * tokens * params / flops);
        act += act_per_layer;
        manager->OnNonModelBytes(act);
      }
      for (auto it = model.moments_fwd.rbegin(); it != model.moments_fwd.rend(); ++it) {
        uint64_t params = 0;
        for (int i : *it) params += model.tensors[static_cast<size_t>(i)].numel;
        moment(*it, Phase::kBackward, 4.0 * tokens * params / flops);
        act -= act_per_layer;
        manager->OnNonModelBytes(act);
      }
      TZ_CHECK_OK(manager->EndIteration());
      return 0.0;
    };
    iteration();  // warm-up: records and plans
    TZ_CHECK(manager->has_plan());
    iteration();
    auto secs = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    r.stall_s = secs(iteration_start, begins[0]);
    if (std::getenv("CHUNK_BENCH_DEBUG") != nullptr) {
      std::fprintf(stderr, "measured gaps (%s): first %.3f ms;",
                   std::string(CachePolicyName(policy)).c_str(), r.stall_s * 1e3);
      for (size_t k = 1; k < begins.size(); ++k) {
        const double g = secs(ends[k - 1], begins[k]);
        if (g > 2e-4) std::fprintf(stderr, " m%zu %.2f", k, g * 1e3);
      }
      std::fprintf(stderr, "\n");
    }
    for (size_t k = 0; k < begins.size(); ++k) {
      if (k > 0) r.stall_s += secs(ends[k - 1], begins[k]);
      r.compute_s += secs(begins[k], ends[k]);
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

// args: h2d bandwidth in MB/s.
void BM_Stalls(benchmark::State& state) {
  const double h2d = static_cast<double>(state.range(0)) * 1e6;
  const Model model = Transformer(24, 512, 256, 1024);
  constexpr double kFlops = 2e12;
  constexpr uint64_t kTokens = 4096;
  RunResult on_demand, lru, plan;
  for (auto _ : state) {
    on_demand = Run(model, CachePolicy::kOnDemand, h2d, kFlops, kTokens);
    lru = Run(model, CachePolicy::kLru, h2d, kFlops, kTokens);
    plan = Run(model, CachePolicy::kPlan, h2d, kFlops, kTokens);
  }
  state.counters["stall_s_on_demand"] = on_demand.stall_s;
  state.counters["stall_s_lru"] = lru.stall_s;
  state.counters["stall_s_plan"] = plan.stall_s;
  state.counters["stall_s_lower_bound"] = plan.lower_bound_s;
  state.counters["stall_s_plan_predicted"] = plan.predicted_stall_s;
  state.counters["stall_s_plan_counter"] = plan.counter_stall_s;
  state.counters["compute_s"] = plan.compute_s;
  state.counters["plan_over_on_demand"] = plan.stall_s / std::max(1e-9, on_demand.stall_s);
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
    auto manager =
        std::move(ChunkManager::Create(*device, compute.handle(), nullptr, layout, placement, mo))
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
    ->Arg(12000)  // PCIe-like: transfers hide behind compute
    ->Arg(400)    // starved: transfers exceed compute
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(tierzero::BM_Bookkeeping)->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--tz_path=", 10) == 0) tierzero::g_path = argv[i] + 10;
  }
  std::filesystem::create_directories(tierzero::g_path);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

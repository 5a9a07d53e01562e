// Where the optimizer's groups update (docs/optimizer.md): every group on the CPU, every group's
// states resident on the device, every group streamed to the device, and mixtures with NVMe
// groups, train the small GPT to the same losses and parameters bit for bit (the simulated
// device runs CpuAdam's element math on its stream), in fp32 and bf16; the assignment each run
// took is checked from the engine's counters, so a run that silently stayed on the CPU fails.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/internals.h"
#include "gpt/data.h"
#include "gpt/gpt.h"
#include "small_model.h"
#include "tierzero/engine.h"
#include "update/updater.h"

namespace tierzero {
namespace {
namespace fs = std::filesystem;

struct TrainResult {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  EngineStats stats;
  int summed_ahead = 0;  // chunks the last step's norm found summed during the backward
  int chunks = 0;
  uint64_t fetched_ahead = 0;  // CPU updates that read a device gradient fetched ahead
  int behind = 0;              // steps whose CPU groups finished behind the next forward
};

// How the loop announces its steps: not at all, with the step's own options, or (every third
// step) with a learning rate the step then does not use.
enum class Prepare { kNone, kSame, kSometimesOther };

TrainResult Train(const EngineConfig& ec, int steps, Prepare prepare = Prepare::kNone,
                  int* announced = nullptr) {
  TrainResult out;
  const gpt::GptConfig mc = testing_models::SmallModel();
  auto e = Engine::Create(ec);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return out;
  std::unique_ptr<Engine> engine = std::move(e).value();
  auto m = gpt::Gpt::Create(*engine, mc);
  EXPECT_TRUE(m.ok());
  Status fin = engine->Finalize();
  EXPECT_TRUE(fin.ok()) << fin.ToString();
  if (!fin.ok()) return out;
  auto data = std::move(gpt::Dataset::Create(gpt::DataConfig{}, mc.seq_len)).value();
  for (int s = 0; s < steps; ++s) {
    const float lr = 1e-3f * (1.0f + 0.05f * static_cast<float>(s));  // a schedule
    if (prepare != Prepare::kNone) {
      const bool other = prepare == Prepare::kSometimesOther && s % 3 == 2;
      Status ps = engine->PrepareStep({other ? lr * 0.5f : lr});
      EXPECT_TRUE(ps.ok()) << ps.ToString();
    }
    for (int micro = 0; micro < ec.grad_accumulation; ++micro) {
      const uint64_t index = static_cast<uint64_t>((s * ec.grad_accumulation + micro) * 16);
      auto l = (*m)->ForwardBackward(data->Get(false, index, 8));
      EXPECT_TRUE(l.ok()) << l.status().ToString();
      if (!l.ok()) return out;
      out.losses.push_back(*l);
    }
    auto st = engine->Step({lr});
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    if (!st.ok()) return out;
    out.behind += EngineInternals::Of(*engine).updater->behind_active();
  }
  out.params = testing_models::ReadAllParams(*engine);
  out.stats = engine->stats();
  if (announced != nullptr) *announced = EngineInternals::Of(*engine).updater->last_announced();
  out.summed_ahead = EngineInternals::Of(*engine).updater->last_summed_ahead();
  out.chunks = EngineInternals::Of(*engine).cm->layout().num_chunks();
  out.fetched_ahead = EngineInternals::Of(*engine).updater->gradients_fetched_ahead();
  return out;
}

// `got` trained bit for bit as `want` did: every micro-batch's loss and every parameter.
void ExpectSameRun(const TrainResult& got, const TrainResult& want, size_t micro_batches) {
  ASSERT_EQ(want.losses.size(), micro_batches);
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i)
    ASSERT_EQ(got.losses[i], want.losses[i]) << "micro-batch " << i;
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t p = 0; p < want.params.size(); ++p)
    ASSERT_EQ(got.params[p], want.params[p]) << "parameter " << p;
}

struct Case {
  const char* name;
  OptimizerPlacement placement;
  double fraction;
  uint64_t device_shard_budget;
  bool nvme;          // optimizer states partly on NVMe
  double model_rate;  // host_device_adam_rate
  // What the last step must have done: groups on the CPU, resident, streamed (-1: some, > 0).
  int cpu, resident, streamed;
};

class OptimizerPlacementTest : public ::testing::TestWithParam<DType> {};
INSTANTIATE_TEST_SUITE_P(Dtypes, OptimizerPlacementTest,
                         ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST_P(OptimizerPlacementTest, EveryPlacementTrainsBitIdentically) {
  testing_models::TempDir dir("tz_optim");
  const Case cases[] = {
      {"cpu", OptimizerPlacement::kCpu, 0, 0, false, 0, -1, 0, 0},
      {"all resident", OptimizerPlacement::kFraction, 1, 64 << 20, false, 0, 0, -1, 0},
      {"all streamed", OptimizerPlacement::kFraction, 1, 0, false, 0, 0, 0, -1},
      {"cpu, resident, streamed", OptimizerPlacement::kFraction, 0.75, 2 << 20, false, 0, -1, -1,
       -1},
      {"half streamed, modelled device", OptimizerPlacement::kFraction, 0.5, 0, false, 2e7, -1, 0,
       -1},
      {"NVMe on the CPU, the rest streamed", OptimizerPlacement::kFraction, 1, 0, true, 0, -1, 0,
       -1},
  };
  std::vector<TrainResult> runs;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EngineConfig ec = testing_models::SmallEngineConfig(DeviceChoice::kHost);
    ec.compute_dtype = GetParam();
    ec.optimizer = c.placement;
    ec.optimizer_device_fraction = c.fraction;
    ec.device_shard_budget = c.device_shard_budget;
    ec.host_device_adam_rate = c.model_rate;
    if (c.nvme) {
      ec.host_budget = uint64_t{4} << 20;  // some optimizer states on NVMe, some in memory
      ec.nvme_budget = uint64_t{128} << 20;
      ec.nvme_path = dir.path();
    }
    runs.push_back(Train(ec, 20));
    const EngineStats& s = runs.back().stats;
    auto check = [](int want, int got, const char* what) {
      if (want < 0) {
        EXPECT_GT(got, 0) << what;
      } else {
        EXPECT_EQ(got, want) << what;
      }
    };
    check(c.cpu, s.optimizer_cpu_groups, "groups on the CPU");
    check(c.resident, s.optimizer_resident_groups, "groups resident on the device");
    check(c.streamed, s.optimizer_streamed_groups, "groups streamed to the device");
    EXPECT_GT(s.optimizer_predicted_seconds, 0);
    EXPECT_GT(s.optimizer_phase_seconds, 0);
  }
  const TrainResult& ref = runs[0];
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (size_t r = 1; r < runs.size(); ++r) {
    SCOPED_TRACE(cases[r].name);
    ASSERT_NO_FATAL_FAILURE(ExpectSameRun(runs[r], ref, 20));
  }
}

// Note [The speculative start]: with the step's CPU updates begun during backward, on copies,
// every step's losses and parameters are those of a run without it, bit for bit: when the
// speculation is used (no clipping), and when it is rolled back because the norm clipped, an fp16
// gradient overflowed, or the step came with other options than announced.
class SpeculativeStartTest : public ::testing::TestWithParam<DType> {};
INSTANTIATE_TEST_SUITE_P(Dtypes, SpeculativeStartTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST_P(SpeculativeStartTest, IsExactWhetherUsedOrRolledBack) {
  struct SpecCase {
    const char* name;
    float clip;
    int accumulation;
    Prepare prepare;
    float loss_scale;  // fp16's first loss scale
    bool expect_used, expect_rollback;
    bool half_streamed = false;  // the other groups stream to the device meanwhile
    MomentFormat moments = MomentFormat::kF32;
  };
  // fp16: the loss scale doubles after every 2 good steps, so overflows recur through the run
  // (each a skipped step whose speculation is rolled back).
  const bool f16 = GetParam() == DType::kF16;
  const float big = 65536.0f;
  const SpecCase cases[] = {
      {"no clipping: used", 0, 1, Prepare::kSame, big, true, f16},
      {"clipping: rolled back", 0.5f, 1, Prepare::kSame, big, false, true},
      {"other options every third step", 0, 1, Prepare::kSometimesOther, big, true, true},
      {"accumulation of 2", 0, 2, Prepare::kSame, big, true, f16},
      {"half the groups streamed to the device", 0, 1, Prepare::kSame, big, true, f16, true},
      {"bf16 moments", 0, 1, Prepare::kSometimesOther, big, true, true, false, MomentFormat::kBF16},
      {"8-bit moments", 0, 1, Prepare::kSometimesOther, big, true, true, false,
       MomentFormat::kInt8},
  };
  for (const SpecCase& c : cases) {
    SCOPED_TRACE(c.name);
    EngineConfig ec = testing_models::SmallEngineConfig(DeviceChoice::kHost);
    ec.compute_dtype = GetParam();
    ec.clip_grad_norm = c.clip;
    ec.grad_accumulation = c.accumulation;
    ec.initial_loss_scale = c.loss_scale;
    ec.loss_scale_window = 2;
    ec.optimizer = c.half_streamed ? OptimizerPlacement::kFraction : OptimizerPlacement::kCpu;
    ec.optimizer_device_fraction = 0.5;
    ec.optimizer_states = c.moments;
    ec.speculative_step = SpeculativeStep::kOff;
    const TrainResult ref = Train(ec, 20, c.prepare);
    ec.speculative_step = SpeculativeStep::kOn;
    int announced = 0;
    const TrainResult spec = Train(ec, 20, c.prepare, &announced);
    // One rank: each chunk's gradient is announced as the D2H stream passes its copy, during
    // backward (not only at EndIteration).
    EXPECT_GT(announced, 0);
    EXPECT_EQ(ref.stats.speculative_steps, 0u);  // kOff
    EXPECT_EQ(ref.stats.speculative_rollbacks, 0u);
    if (c.expect_used) {
      EXPECT_GE(spec.stats.speculative_steps, 5u);
    }
    if (c.half_streamed) {
      EXPECT_GT(spec.stats.optimizer_streamed_groups, 0);
      EXPECT_GT(ref.stats.optimizer_streamed_groups, 0);
    }
    if (c.expect_rollback) {
      EXPECT_GT(spec.stats.speculative_rollbacks, 0u);
    } else {
      EXPECT_EQ(spec.stats.speculative_rollbacks, 0u);
    }
    if (f16) {
      EXPECT_GT(spec.stats.skipped_steps, 0);
    }
    EXPECT_EQ(spec.stats.skipped_steps, ref.stats.skipped_steps);
    ASSERT_NO_FATAL_FAILURE(ExpectSameRun(spec, ref, static_cast<size_t>(20 * c.accumulation)));
  }
}

// Note [The gradient norm summed as the shards become final]: the host gradient shards' squares
// summed during the last micro-batch's backward give the norm of a run summing them after it,
// bit for bit: under clipping (no speculation then), with accumulation, with speculation, with
// half the groups streamed, and through fp16's overflows (a non-finite sum skips the same steps).
TEST_P(SpeculativeStartTest, NormSummedAheadIsTheNormSummedAfter) {
  struct AheadCase {
    const char* name;
    float clip;
    int accumulation;
    SpeculativeStep speculative;
    bool half_streamed;
  };
  const AheadCase cases[] = {
      {"clipping", 0.5f, 1, SpeculativeStep::kAuto, false},
      {"clipping, accumulation of 2", 0.5f, 2, SpeculativeStep::kAuto, false},
      {"no clipping, speculation on", 0, 1, SpeculativeStep::kOn, false},
      {"half the groups streamed", 0.5f, 1, SpeculativeStep::kAuto, true},
  };
  const bool f16 = GetParam() == DType::kF16;
  for (const AheadCase& c : cases) {
    SCOPED_TRACE(c.name);
    EngineConfig ec = testing_models::SmallEngineConfig(DeviceChoice::kHost);
    ec.compute_dtype = GetParam();
    ec.clip_grad_norm = c.clip;
    ec.grad_accumulation = c.accumulation;
    ec.initial_loss_scale = 65536.0f;
    ec.loss_scale_window = 2;
    ec.optimizer = c.half_streamed ? OptimizerPlacement::kFraction : OptimizerPlacement::kCpu;
    ec.optimizer_device_fraction = 0.5;
    ec.speculative_step = c.speculative;
    TrainResult after, ahead;
    {
      ScopedTunable<std::string> mode(kNormAhead, "off");
      after = Train(ec, 12, Prepare::kSame);
    }
    {
      ScopedTunable<std::string> mode(kNormAhead, "on");
      ahead = Train(ec, 12, Prepare::kSame);
    }
    EXPECT_EQ(after.summed_ahead, 0);
    // Every chunk's host shard summed ahead in the last step (one rank: each announced during
    // the backward, or at EndIteration at the latest).
    EXPECT_GT(ahead.chunks, 1);
    EXPECT_EQ(ahead.summed_ahead, ahead.chunks);
    if (f16) {
      EXPECT_GT(ahead.stats.skipped_steps, 0);
    }
    EXPECT_EQ(ahead.stats.skipped_steps, after.stats.skipped_steps);
    ASSERT_NO_FATAL_FAILURE(ExpectSameRun(ahead, after, static_cast<size_t>(12 * c.accumulation)));
  }
}

// Note [A CPU group's device gradient fetched ahead]: with the accumulation shards on the device
// and the states in host memory, the CPU chain copies each next group's gradient over while the
// current group's Adam runs; the run is bit for bit the one copying each before its Adam, with
// every group on the CPU and with half of them updated by the device meanwhile.
TEST_P(OptimizerPlacementTest, GradientsFetchedAheadTrainBitIdentically) {
  // "on": the CPU's chain behind the next forward, as on a GPU (the fetch then runs on the
  // chain's worker thread, beside the forward's gathers).
  for (const char* behind : {"auto", "on"})
    for (const bool half_streamed : {false, true}) {
      SCOPED_TRACE(std::string(half_streamed ? "half on the device" : "all on the CPU") +
                   ", behind the forward " + behind);
      ScopedTunable<std::string> behind_mode(kUpdateBehindForward, behind);
      EngineConfig ec = testing_models::SmallEngineConfig(DeviceChoice::kHost);
      ec.compute_dtype = GetParam();
      ec.grad_accumulation = 2;
      ec.device_shard_budget = uint64_t{64} << 20;  // parameters and accumulation shards
      ec.optimizer = half_streamed ? OptimizerPlacement::kFraction : OptimizerPlacement::kCpu;
      ec.optimizer_device_fraction = half_streamed ? 0.5 : 0;
      TrainResult before, ahead;
      {
        ScopedTunable<bool> mode(kGradFetchAhead, false);
        before = Train(ec, 10);
      }
      {
        ScopedTunable<bool> mode(kGradFetchAhead, true);
        ahead = Train(ec, 10);
      }
      EXPECT_EQ(before.fetched_ahead, 0u);
      // Every CPU update of the run but none of the streamed ones read a fetched gradient.
      EXPECT_GE(ahead.fetched_ahead,
                10u * (half_streamed ? 1 : static_cast<uint64_t>(ahead.chunks)));
      if (half_streamed) {  // the device's chain ran beside the CPU's
        EXPECT_GT(ahead.stats.optimizer_streamed_groups + ahead.stats.optimizer_resident_groups, 0);
      }
      EXPECT_GT(ahead.stats.optimizer_cpu_groups, 0);
      if (std::string(behind) == "on") {
        EXPECT_GT(ahead.behind, 0);
      }
      ASSERT_NO_FATAL_FAILURE(ExpectSameRun(ahead, before, 20));
    }
}

}  // namespace
}  // namespace tierzero

// Note [The update phase behind the next forward]: with the CPU's groups updated by a worker while
// the next forward runs, every loss and parameter is that of the update inside Step, bit for bit
// (host states, NVMe states on a slowed disk, accumulation, a device split, evaluations and a
// checkpoint between steps); and a chain that fails behind the forward fails every later
// gather, step and save until a checkpoint is loaded, after which training goes on as a run that
// never failed.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/internals.h"
#include "gpt/data.h"
#include "gpt/gpt.h"
#include "offload/block_io.h"
#include "small_model.h"
#include "tierzero/engine.h"

namespace tierzero {
namespace {

struct TrainRun {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  int behind = 0;  // steps that returned with the CPU chain still running
  EngineStats stats;
};

struct Options {
  bool nvme = false;           // some optimizer states on NVMe
  int slow_reads_ms = 0;       // each NVMe read held this long (a slow disk: the worker lags)
  bool eval_and_save = false;  // an evaluation and a checkpoint after every fourth step
  double fraction = -1;        // >= 0: that device fraction, modelled device Adam
};

using testing_models::ReadAllParams;

EngineConfig Config(DType dt, int accumulation, const Options& o, const std::string& dir) {
  EngineConfig ec = testing_models::SmallEngineConfig(DeviceChoice::kHost);
  ec.compute_dtype = dt;
  ec.grad_accumulation = accumulation;
  if (o.nvme) {
    ec.host_budget = uint64_t{4} << 20;  // some optimizer states on NVMe, some in memory
    ec.nvme_budget = uint64_t{128} << 20;
    ec.nvme_path = dir;
  }
  // Every group on the CPU unless a fraction is asked for: `auto` chooses from rates measured at
  // the first step, and on a loaded machine it may stream every host group to the simulated
  // device, leaving no CPU chain to go behind the forward (seen once in CI).
  ec.optimizer = OptimizerPlacement::kCpu;
  if (o.fraction >= 0) {
    ec.optimizer = OptimizerPlacement::kFraction;
    ec.optimizer_device_fraction = o.fraction;
    ec.host_device_adam_rate = 2e7;
  }
  return ec;
}

TrainRun Train(DType dt, int accumulation, const Options& o, bool behind, int steps = 12) {
  ScopedTunable<std::string> mode(kUpdateBehindForward, behind ? "on" : "off");
  testing_models::TempDir dir("tz_tail");
  TrainRun out;
  const gpt::GptConfig mc = testing_models::SmallModel();
  auto e = Engine::Create(Config(dt, accumulation, o, dir.path()));
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return out;
  std::unique_ptr<Engine> engine = std::move(e).value();
  if (o.slow_reads_ms > 0) {
    EngineInternals::WrapNvmeIo(*engine, [&](std::unique_ptr<BlockIo> io) {
      auto f = std::make_unique<FaultInjectionBlockIo>(std::move(io));
      f->Inject({.kind = BlockIoFault::Kind::kDelay,
                 .op = IoRequest::Op::kRead,
                 .count = 1 << 30,
                 .delay_ms = o.slow_reads_ms});
      return f;
    });
  }
  auto m = gpt::Gpt::Create(*engine, mc);
  EXPECT_TRUE(m.ok());
  Status fin = engine->Finalize();
  EXPECT_TRUE(fin.ok()) << fin.ToString();
  if (!fin.ok()) return out;
  auto data = std::move(gpt::Dataset::Create(gpt::DataConfig{}, mc.seq_len)).value();
  auto& im = EngineInternals::Of(*engine);
  for (int s = 0; s < steps; ++s) {
    for (int micro = 0; micro < accumulation; ++micro) {
      const uint64_t index = static_cast<uint64_t>((s * accumulation + micro) * 16);
      auto l = (*m)->ForwardBackward(data->Get(false, index, 8));
      EXPECT_TRUE(l.ok()) << l.status().ToString();
      if (!l.ok()) return out;
      out.losses.push_back(*l);
    }
    auto st = engine->Step({1e-3f * (1.0f + 0.05f * static_cast<float>(s))});
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    if (!st.ok()) return out;
    out.behind += im.updater->behind_active();
    if (o.eval_and_save && s % 4 == 3) {
      // Forward only, gathering chunks the worker may not have updated yet; then a save, which
      // must see every update.
      auto l = (*m)->Evaluate(data->Get(true, static_cast<uint64_t>(s), 8), nullptr);
      EXPECT_TRUE(l.ok()) << l.status().ToString();
      if (l.ok()) out.losses.push_back(*l);
      Status saved = engine->SaveCheckpoint(dir.path() + "/ckpt", "");
      EXPECT_TRUE(saved.ok()) << saved.ToString();
    }
  }
  out.params = ReadAllParams(*engine);
  out.stats = engine->stats();
  return out;
}

class UpdateBehindForwardTest : public ::testing::TestWithParam<DType> {};
INSTANTIATE_TEST_SUITE_P(Dtypes, UpdateBehindForwardTest,
                         ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST_P(UpdateBehindForwardTest, TrainsBitIdenticallyToTheUpdateInsideStep) {
  struct Case {
    const char* name;
    int accumulation;
    Options o;
  };
  const Case cases[] = {
      {"host states", 1, {}},
      {"NVMe states, slow disk", 1, {.nvme = true, .slow_reads_ms = 3}},
      {"accumulation of 2, NVMe states", 2, {.nvme = true, .slow_reads_ms = 1}},
      {"half the groups streamed to the device", 1, {.fraction = 0.5}},
      {"evaluations and checkpoints between steps",
       1,
       {.nvme = true, .slow_reads_ms = 2, .eval_and_save = true}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const TrainRun inside = Train(GetParam(), c.accumulation, c.o, /*behind=*/false);
    const TrainRun behind = Train(GetParam(), c.accumulation, c.o, /*behind=*/true);
    EXPECT_EQ(inside.behind, 0);
    // Every step but those before a profiled iteration (the first planned one).
    EXPECT_GE(behind.behind, 8);
    if (c.o.slow_reads_ms > 0) {
      // The worker lagged: the forward waited for updates it needed.
      EXPECT_GT(behind.stats.update_wait_seconds, 0);
    }
    if (c.o.fraction >= 0) {
      EXPECT_GT(behind.stats.optimizer_streamed_groups, 0);
    }
    ASSERT_EQ(behind.losses.size(), inside.losses.size());
    ASSERT_GE(inside.losses.size(), 12u);
    for (size_t i = 0; i < inside.losses.size(); ++i)
      ASSERT_EQ(behind.losses[i], inside.losses[i]) << "loss " << i;
    ASSERT_EQ(behind.params.size(), inside.params.size());
    for (size_t p = 0; p < inside.params.size(); ++p)
      ASSERT_EQ(behind.params[p], inside.params[p]) << "parameter " << p;
  }
}

// A disk that fails under the worker: the failure reaches the caller at the next gather, every
// later step, iteration and save fails with it (naming the step and saying to load a
// checkpoint), and once a checkpoint is loaded training goes on bit for bit as a run that never
// failed.
TEST(UpdateBehindForward, AFailureBehindTheForwardIsStickyUntilACheckpointLoads) {
  ScopedTunable<std::string> mode(kUpdateBehindForward, "on");
  testing_models::TempDir dir("tz_tail_fault");
  const Options o{.nvme = true};
  const gpt::GptConfig mc = testing_models::SmallModel();
  auto make = [&](FaultInjectionBlockIo** faults, const std::string& nvme_dir) {
    std::unique_ptr<Engine> e =
        std::move(Engine::Create(Config(DType::kF32, 1, o, nvme_dir))).value();
    EngineInternals::WrapNvmeIo(*e, [faults](std::unique_ptr<BlockIo> io) {
      auto f = std::make_unique<FaultInjectionBlockIo>(std::move(io));
      if (faults != nullptr) *faults = f.get();
      return f;
    });
    return e;
  };
  std::filesystem::create_directories(dir.path() + "/clean");
  std::filesystem::create_directories(dir.path() + "/faulty");
  FaultInjectionBlockIo* faults = nullptr;
  std::unique_ptr<Engine> clean = make(nullptr, dir.path() + "/clean");
  std::unique_ptr<Engine> faulty = make(&faults, dir.path() + "/faulty");
  auto clean_model = std::move(gpt::Gpt::Create(*clean, mc)).value();
  auto faulty_model = std::move(gpt::Gpt::Create(*faulty, mc)).value();
  ASSERT_TRUE(clean->Finalize().ok());
  ASSERT_TRUE(faulty->Finalize().ok());
  ASSERT_NE(faults, nullptr);
  auto data = std::move(gpt::Dataset::Create(gpt::DataConfig{}, mc.seq_len)).value();
  auto step = [&](Engine& e, gpt::Gpt& m, int s) -> StatusOr<double> {
    ASSIGN_OR_RETURN(double l, m.ForwardBackward(data->Get(false, static_cast<uint64_t>(s), 8)));
    RETURN_IF_ERROR(e.Step({1e-3f}).status());
    return l;
  };
  for (int s = 0; s < 5; ++s) {
    auto a = step(*clean, *clean_model, s);
    auto b = step(*faulty, *faulty_model, s);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(*a, *b);
  }
  const std::string ckpt = dir.path() + "/ckpt";
  ASSERT_TRUE(faulty->SaveCheckpoint(ckpt, "").ok());
  // Every read of the next step's update fails (the backward's prefetch too: best effort).
  faults->Inject({.kind = BlockIoFault::Kind::kFail, .op = IoRequest::Op::kRead, .count = 1000});
  auto failed = step(*faulty, *faulty_model, 5);
  Status later = failed.ok() ? step(*faulty, *faulty_model, 6).status() : failed.status();
  ASSERT_FALSE(later.ok()) << "the failed update went unnoticed";
  {
    // The error says what to do, and its cause once (the gather and the engine's end of the
    // iteration both failed on it: models/gpt/gpt.cc).
    const std::string msg(later.message());
    EXPECT_NE(msg.find("load the last checkpoint"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("Input/output error"), msg.rfind("Input/output error")) << msg;
  }
  faults->Clear();
  // Sticky: whatever comes next fails, naming what happened and what to do.
  auto again = faulty_model->ForwardBackward(data->Get(false, 7, 8));
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("load the last checkpoint"), std::string::npos)
      << again.status().ToString();
  Status save = faulty->SaveCheckpoint(dir.path() + "/bad", "");
  EXPECT_FALSE(save.ok());
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/bad/manifest.json"));
  // Loading the checkpoint clears it; from there the run is the clean one's.
  ASSERT_TRUE(faulty->LoadCheckpoint(ckpt).ok());
  for (int s = 5; s < 9; ++s) {
    auto a = step(*clean, *clean_model, s);
    auto b = step(*faulty, *faulty_model, s);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_EQ(*a, *b) << "step " << s;
  }
  EXPECT_EQ(ReadAllParams(*clean), ReadAllParams(*faulty));
}

}  // namespace
}  // namespace tierzero

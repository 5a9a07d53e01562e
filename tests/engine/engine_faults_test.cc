// The engine on a fault-injecting device (EngineInternals::CreateOnDevice): a device failure in
// the middle of training is a clear error, the parameters, the step and the gradients are as
// they were, and once the fault clears training goes on with the losses of a run that never
// failed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "engine/internals.h"
#include "gpt/data.h"
#include "gpt/gpt.h"
#include "offload/device_wrapper.h"
#include "offload/host_sim_device.h"
#include "small_model.h"
#include "tierzero/devices.h"

namespace tierzero {
namespace {
using gpt::Batch;
using gpt::DataConfig;
using gpt::Dataset;
using gpt::Gpt;
using gpt::GptConfig;

using testing_models::SmallModel;

EngineConfig Config() { return testing_models::SmallEngineConfig(DeviceChoice::kHost); }

struct Rig {
  std::unique_ptr<Device> sim;             // outlives the engine
  FaultInjectionDevice* faults = nullptr;  // owned by the engine
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Gpt> model;
  std::unique_ptr<Dataset> data;
  ~Rig() {
    model.reset();
    engine.reset();
  }
};

void Start(Rig& r, bool faulty) {
  if (faulty) {
    HostSimOptions ho;
    ho.capacity_bytes = Config().device_budget + (uint64_t{4} << 20) + 4 * 16384 * 2;
    r.sim = std::move(CreateHostSimDevice(ho)).value();
    auto wrapper = std::make_unique<FaultInjectionDevice>(r.sim.get());
    r.faults = wrapper.get();
    auto e = EngineInternals::CreateOnDevice(Config(), nullptr, std::move(wrapper));
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    r.engine = std::move(e).value();
  } else {
    r.engine = std::move(Engine::Create(Config())).value();
  }
  r.model = std::move(Gpt::Create(*r.engine, SmallModel())).value();
  ASSERT_TRUE(r.engine->Finalize().ok());
  r.data = std::move(Dataset::Create(DataConfig{}, SmallModel().seq_len)).value();
}

double TrainStep(Rig& r, int step) {
  Batch b = r.data->Get(false, static_cast<uint64_t>(step), 8);
  auto loss = r.model->ForwardBackward(b);
  EXPECT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_TRUE(r.engine->Step({1e-3f}).ok());
  return loss.ok() ? *loss : 0;
}

std::vector<float> AllParams(Engine& e) {
  std::vector<float> all;
  for (ParamId p = 0; p < e.num_params(); ++p) {
    std::vector<float> v(static_cast<size_t>(e.numel(p)));
    EXPECT_TRUE(e.ReadParam(p, v).ok());
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

TEST(EngineFaults, DeviceFaultsMidStepAreClearErrorsAndLoseNothing) {
  Rig clean, faulty;
  Start(clean, false);
  Start(faulty, true);
  // Steps 0-2 record and plan; step 3 replays the plan.
  for (int s = 0; s < 4; ++s) EXPECT_EQ(TrainStep(clean, s), TrainStep(faulty, s)) << "step " << s;
  // Each fault hits a different part of an iteration: a gather's copy, a gradient's copy back,
  // an allocation of a gradient chunk or a slot.
  const DeviceOp ops[] = {DeviceOp::kCopyH2D, DeviceOp::kCopyD2H, DeviceOp::kAllocate};
  int step = 4;
  for (DeviceOp op : ops) {
    const std::vector<float> before = AllParams(*faulty.engine);
    const int64_t step_before = faulty.engine->step();
    faulty.faults->Inject({op, /*skip=*/2, /*count=*/1000, StatusCode::kInternal});
    Batch b = faulty.data->Get(false, static_cast<uint64_t>(step), 8);
    auto loss = faulty.model->ForwardBackward(b);
    faulty.faults->Clear();
    ASSERT_FALSE(loss.ok()) << "the fault on op " << static_cast<int>(op) << " did not surface";
    EXPECT_FALSE(loss.status().message().empty());
    EXPECT_EQ(faulty.engine->step(), step_before);
    EXPECT_EQ(AllParams(*faulty.engine), before) << "op " << static_cast<int>(op);
    // The failed micro-batch is dropped; the same step again matches the clean run.
    EXPECT_EQ(TrainStep(clean, step), TrainStep(faulty, step))
        << "after op " << static_cast<int>(op);
    ++step;
  }
  EXPECT_EQ(AllParams(*clean.engine), AllParams(*faulty.engine));
}

// Device gradient shards under accumulation (Note [Gradient shards on the device]): the
// device's fp32 add of a micro-batch failing is a clear error from that micro-batch, the step and
// the parameters stay as they were, and once the fault clears the next window trains.
TEST(EngineFaults, AFailedDeviceAccumulationIsAClearErrorAndLosesNothing) {
  EngineConfig ec = Config();
  ec.device_shard_budget = uint64_t{64} << 20;
  ec.grad_accumulation = 2;
  HostSimOptions ho;
  ho.capacity_bytes = ec.device_budget + ec.device_shard_budget + (uint64_t{8} << 20);
  std::unique_ptr<Device> sim = std::move(CreateHostSimDevice(ho)).value();
  auto wrapper = std::make_unique<FaultInjectionDevice>(sim.get());
  FaultInjectionDevice* faults = wrapper.get();
  auto e = EngineInternals::CreateOnDevice(ec, nullptr, std::move(wrapper));
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  std::unique_ptr<Engine> engine = std::move(e).value();
  std::unique_ptr<Gpt> model = std::move(Gpt::Create(*engine, SmallModel())).value();
  ASSERT_TRUE(engine->Finalize().ok());
  ASSERT_NE(engine->PlacementSummary().find("grad shards"), std::string::npos);
  auto data = std::move(Dataset::Create(DataConfig{}, SmallModel().seq_len)).value();
  // A run that never failed: the same windows, less the failed one.
  std::unique_ptr<Engine> clean_engine = std::move(Engine::Create(ec)).value();
  std::unique_ptr<Gpt> clean_model = std::move(Gpt::Create(*clean_engine, SmallModel())).value();
  ASSERT_TRUE(clean_engine->Finalize().ok());
  auto window_of = [&](Engine& en, Gpt& m, int first) -> Status {
    for (int micro = 0; micro < 2; ++micro) {
      Batch b = data->Get(false, static_cast<uint64_t>(first + micro), 8);
      TZ_RETURN_IF_ERROR(m.ForwardBackward(b).status());
    }
    return en.Step({1e-3f}).status();
  };
  auto window = [&](int first) { return window_of(*engine, *model, first); };
  for (int w = 0; w < 3; ++w) {
    ASSERT_TRUE(window(2 * w).ok()) << "window " << w;
    ASSERT_TRUE(window_of(*clean_engine, *clean_model, 2 * w).ok()) << "window " << w;
  }
  const std::vector<float> before = AllParams(*engine);
  const int64_t step_before = engine->step();
  faults->Inject({DeviceOp::kAccumulate, /*skip=*/1, /*count=*/1000, StatusCode::kInternal});
  const Status failed = window(6);
  const int injected = faults->injected();
  faults->Clear();
  ASSERT_GT(injected, 0) << "no device accumulation ran: " << engine->PlacementSummary();
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("accumulate"), std::string::npos) << failed.ToString();
  EXPECT_EQ(engine->step(), step_before);
  EXPECT_EQ(AllParams(*engine), before);
  // A window after the fault trains from none of the failed window's gradient: the parameters
  // after it are the clean run's, bit for bit.
  const Status next = window(8);
  EXPECT_TRUE(next.ok()) << next.ToString();
  EXPECT_EQ(engine->step(), step_before + 1);
  ASSERT_TRUE(window_of(*clean_engine, *clean_model, 8).ok());
  EXPECT_EQ(AllParams(*engine), AllParams(*clean_engine));
}

// An evaluation (an inference iteration) whose NVMe read fails: the swap file cut short under it
// is an error naming the file, not the loss of whatever the failed read left in the gathered
// chunk (hunt 50: `tierzero eval` printed 7.86 for 10.59, exit 0).
TEST(EngineFaults, AFailedSwapReadInAnEvaluationIsAnErrorNotALoss) {
  testing_models::TempDir dir;
  EngineConfig c = Config();
  c.host_budget = uint64_t{1536} << 10;  // less than the model's states: NVMe takes the rest
  c.nvme_budget = uint64_t{128} << 20;
  c.nvme_path = dir.path();
  auto e = Engine::Create(c);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  auto model = Gpt::Create(**e, SmallModel());
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE((*e)->Finalize().ok());
  auto data = std::move(Dataset::Create(DataConfig{}, SmallModel().seq_len)).value();
  const Batch val = data->Get(true, 0, 8);
  auto first = (*model)->Evaluate(val, nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_GT((*e)->usage().nvme, 0u) << (*e)->PlacementSummary();
  // The swap file (unnamed in the directory): found among this process's descriptors.
  int cut = 0;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (ec || target.rfind(dir.path(), 0) != 0) continue;
    cut += ::ftruncate(std::stoi(fd.path().filename().string()), 0) == 0;
  }
  ASSERT_GT(cut, 0) << "no swap file under " << dir.path();
  auto second = (*model)->Evaluate(val, nullptr);
  ASSERT_FALSE(second.ok()) << "an evaluation over a cut swap file gave the loss " << *second
                            << " (the first: " << *first << ")";
  EXPECT_TRUE(second.status().code() == StatusCode::kDataLoss ||
              second.status().code() == StatusCode::kIoError)
      << second.status().ToString();
}

// Note [Host memory within the process's limit]: a placement whose host memory is over what
// this process may use (here one and a half times it, under a host budget four times it) is
// refused by Finalize before anything is allocated, naming the limit and a budget that fits,
// instead of the kernel's SIGKILL part-way through set-up.
TEST(EngineFaults, AHostPlacementOverTheProcesssMemoryIsRefusedBeforeAllocating) {
  const HostMemory m = ReadHostMemory();
  EngineConfig c = Config();
  c.host_budget = m.limit * 4;
  c.device_shard_budget = 0;
  c.chunk_elems = 0;  // automatic
  // fp32 master, two moments and a bf16 gradient: 14 bytes an element in host memory.
  const uint64_t elems = m.limit / 14 * 3 / 2;
  constexpr int kParams = 64;
  const int64_t cols = 4096;
  const auto rows = static_cast<int64_t>(elems / kParams / static_cast<uint64_t>(cols) + 1);
  auto e = Engine::Create(c);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& engine = **e;
  for (int i = 0; i < kParams; ++i) {
    ParamSpec p;
    p.name = "w" + std::to_string(i);
    p.shape = {rows, cols};
    ASSERT_TRUE(engine.RegisterParam(std::move(p)).ok());
  }
  const Status s = engine.Finalize();
  ASSERT_EQ(s.code(), StatusCode::kOutOfMemory) << s.ToString();
  EXPECT_NE(s.message().find("more than this process may use"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(m.limit_source), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("Give host_budget (--host-budget) at most"), std::string::npos)
      << s.message();
}

}  // namespace
}  // namespace tierzero

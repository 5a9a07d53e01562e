// The engine through its public API: offload equivalence (all resident, host, NVMe), gradient
// shards on the device, fp16 loss scaling, accumulation, evaluation, config errors and API misuse.
// Checkpoints and safetensors files: checkpoint_test.cc.
#include "tierzero/engine.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpt/data.h"
#include "gpt/gpt.h"
#include "small_model.h"

namespace tierzero {
namespace {
namespace fs = std::filesystem;
using gpt::Batch;
using gpt::DataConfig;
using gpt::Dataset;
using gpt::Gpt;
using gpt::GptConfig;

using testing_models::Make;
using testing_models::SmallLlama;
using testing_models::SmallModel;
using testing_models::TempDir;
using testing_models::TestEngineConfig;
using testing_models::Train;
using testing_models::Trainer;

// All resident on the device, offloaded to host memory, offloaded to NVMe (parameters and
// optimizer states): the same math in the same order, so the same losses, bit for bit.
void CheckOffloadEquivalence(const GptConfig& mc) {
  TempDir dir;
  EngineConfig resident = TestEngineConfig();
  resident.device_shard_budget = uint64_t{64} << 20;
  EngineConfig host = TestEngineConfig();
  EngineConfig nvme = TestEngineConfig();
  nvme.host_budget = uint64_t{1536} << 10;  // less than the model's states: NVMe takes the rest
  // A bound, as the host budget is, not a reservation (Note [The NVMe space reserved is what
  // the placement puts there], setup.cc): 1 PiB asked, a few MiB reserved.
  nvme.nvme_budget = uint64_t{1} << 50;
  nvme.nvme_path = dir.path();
  std::vector<std::vector<double>> losses;
  const EngineConfig configs[] = {resident, host, nvme};
  for (int i = 0; i < 3; ++i) {
    Trainer r = Make(configs[i], mc);
    losses.push_back(Train(r, 0, 20));
    const TierUsage u = r.engine->usage();
    if (i == 0) {
      EXPECT_GT(u.device, 0u);
    }
    if (i == 2) {
      EXPECT_GT(u.nvme, 0u) << r.engine->PlacementSummary();
      EXPECT_GT(r.engine->stats().nvme_read_bytes, 0u);
    }
    EXPECT_GT(r.engine->stats().plans, 0u);
  }
  ASSERT_EQ(losses[0].size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i << " resident vs host";
    EXPECT_EQ(losses[0][i], losses[2][i]) << "step " << i << " resident vs NVMe";
  }
  EXPECT_LT(losses[0].back(), losses[0].front());
}

TEST(Engine, OffloadEquivalenceIsBitIdentical) { CheckOffloadEquivalence(SmallModel()); }

TEST(Engine, LlamaOffloadEquivalenceIsBitIdentical) { CheckOffloadEquivalence(SmallLlama()); }

// Note [Gradient shards on the device] (chunk/placement.cc): a chunk the device's Adam updates
// keeps its gradient shard in device memory, so an all-resident step moves no gradient down;
// ReadGrad brings it over and equals the host shard's bit for bit (the losses are
// CheckOffloadEquivalence's), with accumulation too. With no room in the device shard budget
// after the parameters and states, the gradients stay in host memory.
// `windows` windows of two micro-batches (batches 2w and 2w + 1), each but the last followed by
// its step (the last too with `last_step`); every micro-batch's loss (empty on a failure).
std::vector<double> AccumulatedLosses(Trainer& t, int windows, bool last_step) {
  std::vector<double> losses;
  for (int w = 0; w < windows; ++w) {
    for (int micro = 0; micro < 2; ++micro) {
      Batch b = t.data->Get(false, static_cast<uint64_t>(2 * w + micro), 8);
      auto loss = t.model->ForwardBackward(b);
      EXPECT_TRUE(loss.ok()) << loss.status().ToString();
      if (!loss.ok()) return {};
      losses.push_back(*loss);
    }
    if (w + 1 < windows || last_step) {
      const auto step = t.engine->Step({1e-3f});
      EXPECT_TRUE(step.ok());
      if (!step.ok()) return {};
    }
  }
  return losses;
}

int DeviceGradShards(Engine& e) {
  const std::string s = e.PlacementSummary();
  const size_t at = s.find("device: ");
  if (at == std::string::npos) return -1;
  const size_t end = s.find(" grad shards", at);
  const size_t start = s.rfind(' ', end - 1);
  return std::stoi(s.substr(start + 1, end - start - 1));
}

TEST(Engine, GradientShardsStayOnTheDeviceWhereItsAdamUpdates) {
  EngineConfig resident = TestEngineConfig();
  resident.device_shard_budget = uint64_t{64} << 20;
  EngineConfig host = TestEngineConfig();
  Trainer r = Make(resident), h = Make(host);
  EXPECT_GT(DeviceGradShards(*r.engine), 0) << r.engine->PlacementSummary();
  EXPECT_EQ(DeviceGradShards(*h.engine), 0) << h.engine->PlacementSummary();
  Train(r, 0, 3);
  Train(h, 0, 3);
  const uint64_t d2h = r.engine->stats().d2h_bytes;
  for (Trainer* t : {&r, &h}) {
    Batch b = t->data->Get(false, 3, 8);
    ASSERT_TRUE(t->model->ForwardBackward(b).ok());
  }
  EXPECT_EQ(r.engine->stats().d2h_bytes, d2h) << "a resident backward moved bytes down";
  for (ParamId p = 0; p < r.engine->num_params(); ++p) {
    std::vector<float> gr(static_cast<size_t>(r.engine->numel(p))), gh(gr.size());
    ASSERT_TRUE(r.engine->ReadGrad(p, gr).ok());
    ASSERT_TRUE(h.engine->ReadGrad(p, gh).ok());
    ASSERT_EQ(0, std::memcmp(gr.data(), gh.data(), gr.size() * 4)) << "parameter " << p;
  }
  // With accumulation the micro-batches are added in fp32 on the device: the same bits as the
  // host's adds, and the same losses after.
  EngineConfig acc_resident = resident, acc_host = host;
  acc_resident.grad_accumulation = acc_host.grad_accumulation = 2;
  Trainer a = Make(acc_resident), ah = Make(acc_host);
  EXPECT_GT(DeviceGradShards(*a.engine), 0) << a.engine->PlacementSummary();
  EXPECT_EQ(DeviceGradShards(*ah.engine), 0) << ah.engine->PlacementSummary();
  // (The last window's gradients are compared before its step.)
  EXPECT_EQ(AccumulatedLosses(a, 4, /*last_step=*/false),
            AccumulatedLosses(ah, 4, /*last_step=*/false));
  for (ParamId p = 0; p < a.engine->num_params(); ++p) {
    std::vector<float> ga(static_cast<size_t>(a.engine->numel(p))), gh(ga.size());
    ASSERT_TRUE(a.engine->ReadGrad(p, ga).ok());
    ASSERT_TRUE(ah.engine->ReadGrad(p, gh).ok());
    ASSERT_EQ(0, std::memcmp(ga.data(), gh.data(), ga.size() * 4)) << "accumulated, param " << p;
  }
  EngineConfig tight = resident;
  tight.device_shard_budget = 0;
  Trainer t = Make(tight);
  EXPECT_EQ(DeviceGradShards(*t.engine), 0) << t.engine->PlacementSummary();
}

// Note [Accumulating on the device for host updates]: with accumulation, chunks whose Adam runs
// from host memory (the CPU's, every group here) keep their fp32 accumulation shards on the
// device where the shard budget has room; the losses and the parameters after four steps are
// those of the same run with every gradient shard in host memory, bit for bit.
TEST(Engine, AccumulationShardsOnTheDeviceForHostUpdatesChangeNoBit) {
  EngineConfig dev = TestEngineConfig();
  dev.device_shard_budget = uint64_t{64} << 20;
  dev.optimizer = OptimizerPlacement::kCpu;
  dev.grad_accumulation = 2;
  EngineConfig host = TestEngineConfig();
  host.optimizer = OptimizerPlacement::kCpu;
  host.grad_accumulation = 2;
  Trainer a = Make(dev), h = Make(host);
  EXPECT_GT(DeviceGradShards(*a.engine), 0) << a.engine->PlacementSummary();
  EXPECT_EQ(a.engine->PlacementSummary().find("device: 0 param"), std::string::npos);
  EXPECT_EQ(DeviceGradShards(*h.engine), 0) << h.engine->PlacementSummary();
  EXPECT_EQ(AccumulatedLosses(a, 4, /*last_step=*/true),
            AccumulatedLosses(h, 4, /*last_step=*/true));
  for (ParamId p = 0; p < a.engine->num_params(); ++p) {
    std::vector<float> pa(static_cast<size_t>(a.engine->numel(p))), ph(pa.size());
    ASSERT_TRUE(a.engine->ReadParam(p, pa).ok());
    ASSERT_TRUE(h.engine->ReadParam(p, ph).ok());
    ASSERT_EQ(0, std::memcmp(pa.data(), ph.data(), pa.size() * 4)) << "param " << p;
  }
}

TEST(Engine, Fp16OverflowSkipsTheStepAndRecovers) {
  EngineConfig ec = TestEngineConfig();
  ec.compute_dtype = DType::kF16;
  ec.initial_loss_scale = 1e9f;  // fp16 gradients overflow at once
  Trainer r = Make(ec);
  std::vector<float> w0(static_cast<size_t>(r.engine->numel(2)));
  ASSERT_TRUE(r.engine->ReadParam(2, w0).ok());
  int skipped = 0, applied = 0;
  float last_scale = ec.initial_loss_scale;
  for (int s = 0; s < 40; ++s) {
    Batch b = r.data->Get(false, static_cast<uint64_t>(s), 8);
    auto l = r.model->ForwardBackward(b);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    ASSERT_TRUE(std::isfinite(*l));
    auto st = r.engine->Step({1e-3f});
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    if (!st->applied) {
      ++skipped;
      EXPECT_EQ(applied, 0) << "overflow after recovering";
      EXPECT_EQ(st->loss_scale, last_scale / 2);
      std::vector<float> w(w0.size());
      ASSERT_TRUE(r.engine->ReadParam(2, w).ok());
      EXPECT_EQ(w, w0) << "a skipped step changed the weights";
    } else {
      ++applied;
    }
    last_scale = st->loss_scale;
  }
  EXPECT_GT(skipped, 3);
  EXPECT_GT(applied, 20);
  EXPECT_EQ(r.engine->step(), applied);
  std::vector<float> w(w0.size());
  ASSERT_TRUE(r.engine->ReadParam(2, w).ok());
  EXPECT_NE(w, w0);
}

TEST(Engine, GradAccumulationAveragesMicroBatches) {
  // Two micro-batches of 8 rows accumulate to the gradient of their mean: the same first-step
  // update as one run whose gradient is the average (checked through the fp32 masters).
  // The simulated device, whatever TZ_TEST_DEVICE says: the test writes the gradients through
  // host pointers (on a GPU they are device memory), and what it checks does not depend on it.
  EngineConfig ec = testing_models::SmallEngineConfig(DeviceChoice::kHost);
  ec.compute_dtype = DType::kF32;
  ec.grad_accumulation = 2;
  ec.clip_grad_norm = 0;
  Trainer acc = Make(ec);
  for (int micro = 0; micro < 2; ++micro) {
    Batch b = acc.data->Get(false, static_cast<uint64_t>(micro), 8);
    ASSERT_TRUE(acc.model->ForwardBackward(b).ok());
  }
  std::vector<float> g(static_cast<size_t>(acc.engine->numel(2)));
  ASSERT_TRUE(acc.engine->ReadGrad(2, g).ok());
  EngineConfig single = ec;
  single.grad_accumulation = 1;
  std::vector<float> expect(g.size(), 0.0f);
  for (int micro = 0; micro < 2; ++micro) {
    Trainer one = Make(single);
    Batch b = one.data->Get(false, static_cast<uint64_t>(micro), 8);
    ASSERT_TRUE(one.model->ForwardBackward(b).ok());
    std::vector<float> gm(g.size());
    ASSERT_TRUE(one.engine->ReadGrad(2, gm).ok());
    for (size_t i = 0; i < g.size(); ++i) expect[i] += gm[i];
  }
  for (size_t i = 0; i < g.size(); ++i)
    EXPECT_NEAR(g[i], expect[i], 1e-6f + 1e-5f * std::abs(expect[i]));
  // A third micro-batch before Step is refused.
  Status s = acc.engine->BeginIteration(true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(acc.engine->Step({1e-3f}).ok());
}

TEST(Engine, EvaluationLeavesTrainingUntouched) {
  Trainer a = Make(TestEngineConfig());
  Trainer b = Make(TestEngineConfig());
  std::vector<double> la, lb;
  for (int s = 0; s < 6; ++s) {
    Batch batch = a.data->Get(false, static_cast<uint64_t>(s), 8);
    la.push_back(*a.model->ForwardBackward(batch));
    ASSERT_TRUE(a.engine->Step({1e-3f}).ok());
    Batch val = b.data->Get(true, 0, 8);
    std::vector<int32_t> pred;
    ASSERT_TRUE(b.model->Evaluate(val, &pred).ok());  // interleaved evaluation
    lb.push_back(*b.model->ForwardBackward(batch));
    ASSERT_TRUE(b.engine->Step({1e-3f}).ok());
  }
  EXPECT_EQ(la, lb);
  EXPECT_EQ(b.engine->stats().deviations, 0u);
}

TEST(Engine, ConfigErrorsNameTheField) {
  struct Case {
    std::function<void(EngineConfig&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](EngineConfig& c) { c.device_budget = 1000; }, "device_budget"},
      {[](EngineConfig& c) { c.host_budget = 1000; }, "host_budget"},
      {[](EngineConfig& c) { c.nvme_budget = 1 << 30; }, "nvme_path"},
      {[](EngineConfig& c) { c.compute_dtype = DType::kI8; }, "compute_dtype"},
      {[](EngineConfig& c) { c.beta1 = 1.0f; }, "beta1"},
      {[](EngineConfig& c) { c.beta2 = -0.1f; }, "beta2"},
      {[](EngineConfig& c) { c.eps = 0; }, "eps"},
      {[](EngineConfig& c) { c.weight_decay = -1; }, "weight_decay"},
      {[](EngineConfig& c) { c.clip_grad_norm = NAN; }, "clip_grad_norm"},
      {[](EngineConfig& c) { c.grad_accumulation = 0; }, "grad_accumulation"},
      {[](EngineConfig& c) { c.initial_loss_scale = 0.5f; }, "initial_loss_scale"},
      {[](EngineConfig& c) { c.loss_scale_window = 0; }, "loss_scale_window"},
      {[](EngineConfig& c) { c.cpu_threads = -2; }, "cpu_threads"},
      // Enumerations cast from integers out of range (one crashed in ReadParam, others ran some
      // default).
      {[](EngineConfig& c) { c.device = static_cast<DeviceChoice>(7); }, "device"},
      {[](EngineConfig& c) { c.collectives = static_cast<CollectivePath>(3); }, "collectives"},
      {[](EngineConfig& c) { c.optimizer = static_cast<OptimizerPlacement>(9); }, "optimizer"},
      {[](EngineConfig& c) { c.speculative_step = static_cast<SpeculativeStep>(3); },
       "speculative_step"},
      {[](EngineConfig& c) { c.optimizer_states = static_cast<MomentFormat>(4); },
       "optimizer_states"},
  };
  for (const Case& c : cases) {
    EngineConfig ec = TestEngineConfig();
    c.edit(ec);
    auto e = Engine::Create(ec);
    ASSERT_FALSE(e.ok()) << c.field;
    EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << c.field;
    // (Named as a config file names it: engine.FIELD.)
    EXPECT_NE(e.status().message().find("'engine." + c.field + "'"), std::string::npos)
        << e.status().ToString();
  }
}

TEST(Engine, ImpossibleBudgetsFailAtFinalizeWithWhatToRaise) {
  EngineConfig ec = TestEngineConfig();
  ec.host_budget = uint64_t{1} << 20;  // the small model's states need more, and no NVMe
  auto e = Engine::Create(ec);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(Gpt::Create(**e, SmallModel()).ok());
  Status s = (*e)->Finalize();
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory) << s.ToString();
  EXPECT_NE(s.message().find("budget"), std::string::npos) << s.ToString();

  // Activations that cannot fit the device budget: the error says what to change.
  EngineConfig tiny = TestEngineConfig();
  tiny.device_budget = uint64_t{1} << 20;
  Trainer r = Make(tiny);
  Batch b = r.data->Get(false, 0, 256);
  auto l = r.model->ForwardBackward(b);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("checkpoint activations"), std::string::npos)
      << l.status().ToString();
  // The engine is still usable with a batch that fits.
  Batch small = r.data->Get(false, 0, 2);
  auto ok = r.model->ForwardBackward(small);
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST(Engine, ApiMisuseIsAStatus) {
  auto e = Engine::Create(TestEngineConfig());
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  EXPECT_EQ(engine.Finalize().code(), StatusCode::kFailedPrecondition);  // nothing registered
  auto p = engine.RegisterParam({"w", {4, 4}, InitConstant(1), true});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(engine.RegisterParam({"w", {4}, {}, true}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.RegisterParam({"z", {4, 0}, {}, true}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine.Step({1e-3f}).status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine.Finalize().ok());
  EXPECT_EQ(engine.RegisterParam({"late", {4}, {}, true}).status().code(),
            StatusCode::kFailedPrecondition);
  const ParamId ids[] = {*p};
  const ParamId bad[] = {7};
  EXPECT_EQ(engine.Acquire(bad, Phase::kForward).status().code(), StatusCode::kInvalidArgument);
  {
    auto scope = engine.Acquire(ids, Phase::kForward);
    ASSERT_TRUE(scope.ok());
    EXPECT_NE(scope->data(*p), nullptr);
    EXPECT_EQ(scope->grad(*p), nullptr);  // forward scopes have no gradient
    // Shards change, and gradients are read, only between iterations; the values stay.
    std::vector<float> v(16, 5.0f);
    EXPECT_EQ(engine.WriteParam(*p, v).code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(engine.ReadGrad(*p, v).code(), StatusCode::kFailedPrecondition);
    ASSERT_TRUE(engine.ReadParam(*p, v).ok());  // reads of parameters may come any time
    EXPECT_EQ(v, std::vector<float>(16, 1.0f));
  }
  // Step before the accumulation window is complete is fine here (one micro-batch, no backward:
  // the gradient is zero and AdamW only decays).
  auto st = engine.Step({1e-3f});
  EXPECT_TRUE(st.ok()) << st.status().ToString();
}

// Note [An iteration aborted with scopes open]: a micro-batch aborted while its backward scope is
// still alive (the trainer's natural error path) is dropped when the scope goes, exactly as one
// aborted after (its gradient of 1000 reached the next step before); EndIteration with a scope
// open is refused and changes nothing. The weights after two steps equal a run that never had it.
TEST(Engine, AMicroBatchAbortedWithItsScopeOpenIsDropped) {
  auto run = [](int mode) {  // 0: clean; 1: aborted with the scope open; 2: EndIteration first
    EngineConfig c = testing_models::SmallEngineConfig(DeviceChoice::kHost);
    c.compute_dtype = DType::kF32;
    c.grad_accumulation = 2;
    c.clip_grad_norm = 0;
    auto e = Engine::Create(c);
    EXPECT_TRUE(e.ok());
    Engine& engine = **e;
    EXPECT_TRUE(engine.RegisterParam({"w", {64}, InitNormal(0.1f, 1)}).ok());
    EXPECT_TRUE(engine.Finalize().ok());
    const ParamId ids[] = {0};
    auto micro_batch = [&](float g) {
      { EXPECT_TRUE(engine.Acquire(ids, Phase::kForward).ok()); }
      {
        auto b = engine.Acquire(ids, Phase::kBackward);
        EXPECT_TRUE(b.ok());
        std::fill_n(static_cast<float*>(b->grad(0)), 64, g);
      }
      EXPECT_TRUE(engine.EndIteration().ok());
    };
    if (mode != 0) {
      { EXPECT_TRUE(engine.Acquire(ids, Phase::kForward).ok()); }
      auto b = engine.Acquire(ids, Phase::kBackward);
      EXPECT_TRUE(b.ok());
      std::fill_n(static_cast<float*>(b->grad(0)), 64, 1000.0f);
      if (mode == 2) {
        const Status s = engine.EndIteration();
        EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
        EXPECT_NE(s.message().find("still open"), std::string::npos) << s.ToString();
      }
      EXPECT_TRUE(engine.AbortIteration().ok());
      EXPECT_EQ(engine.Acquire(ids, Phase::kForward).status().code(),
                StatusCode::kFailedPrecondition);  // nothing more in an aborted iteration
      EXPECT_EQ(engine.BeginIteration(true).code(), StatusCode::kFailedPrecondition);
    }  // b released: the abort ends here
    for (int step = 0; step < 2; ++step) {
      micro_batch(1.0f);
      micro_batch(2.0f);
      auto r = engine.Step({0.1f});
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok()) {
        EXPECT_NEAR(r->grad_norm, 1.5 * 8, 1e-9);
      }
    }
    std::vector<float> w(64);
    EXPECT_TRUE(engine.ReadParam(0, w).ok());
    return w;
  };
  const std::vector<float> clean = run(0);
  EXPECT_EQ(run(1), clean);
  EXPECT_EQ(run(2), clean);
}

// A scope or activation buffer that outlives its engine (a struct that declares its buffers
// before its unique_ptr<Engine>) is released as nothing: the engine freed what it held.
TEST(Engine, ScopesAndBuffersMayOutliveTheirEngine) {
  auto e = Engine::Create(testing_models::SmallEngineConfig(DeviceChoice::kHost));
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE((*e)->RegisterParam({"w", {64}, InitConstant(1)}).ok());
  ASSERT_TRUE((*e)->Finalize().ok());
  const ParamId ids[] = {0};
  auto buffer = (*e)->AllocateActivation(256);
  ASSERT_TRUE(buffer.ok());
  ActivationBuffer kept = std::move(*buffer);
  auto scope = (*e)->Acquire(ids, Phase::kForward);
  ASSERT_TRUE(scope.ok());
  e->reset();
  EXPECT_TRUE(scope->Release().ok());
  kept.Reset();
  EXPECT_EQ(kept.data(), nullptr);
}

// A Finalize that failed leaves an engine that says so, rather than one that kept half its set-up
// (a retry after registering more parameters gave them the first attempt's values).
TEST(Engine, AFailedFinalizeIsNotRetried) {
  TempDir dir;
  const std::string file = dir.path() + "/not-a-directory";
  std::ofstream(file) << "x";
  EngineConfig c = testing_models::SmallEngineConfig(DeviceChoice::kHost);
  c.nvme_budget = uint64_t{64} << 20;
  c.nvme_path = file;                 // swap files cannot go there
  c.host_budget = uint64_t{1} << 20;  // and they are needed
  auto e = Engine::Create(c);
  ASSERT_TRUE(e.ok());
  for (int i = 0; i < 8; ++i)
    ASSERT_TRUE((*e)->RegisterParam({"w" + std::to_string(i), {16384}, InitConstant(1)}).ok());
  EXPECT_FALSE((*e)->Finalize().ok());
  EXPECT_EQ((*e)->RegisterParam({"x", {4}, InitConstant(1)}).status().code(),
            StatusCode::kFailedPrecondition);
  const Status again = (*e)->Finalize();
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find("create another Engine"), std::string::npos) << again.ToString();
}

// An Initializer that throws fails Finalize with its message, and the engine is not usable (hunt
// 48: the exception escaped Finalize, and the engine then trained on half-set values); a
// thread count no machine has is refused at Create (20000 hung, 100000 aborted).
TEST(Engine, AThrowingInitializerFailsFinalizeAndTooManyThreadsAreRefused) {
  auto e = Engine::Create(testing_models::SmallEngineConfig(DeviceChoice::kHost));
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE((*e)->RegisterParam({"a", {64}, InitConstant(1)}).ok());
  ASSERT_TRUE((*e)->RegisterParam({"b",
                                   {64},
                                   [](std::span<float> v) {
                                     v[0] = 5;
                                     throw std::runtime_error("the initial values file is gone");
                                   }})
                  .ok());
  const Status s = (*e)->Finalize();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("the initial values file is gone"), std::string::npos) << s.ToString();
  EXPECT_EQ((*e)->BeginIteration(true).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*e)->Step({1e-3f}).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*e)->Finalize().code(), StatusCode::kFailedPrecondition);
  for (int threads : {4097, 100000}) {
    EngineConfig c = testing_models::SmallEngineConfig(DeviceChoice::kHost);
    c.cpu_threads = threads;
    auto t = Engine::Create(c);
    ASSERT_FALSE(t.ok()) << threads;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("cpu_threads"), std::string::npos) << t.status().ToString();
  }
}

// An Acquire of what no model has is refused before any iteration begins, and the engine trains
// on as before (hunt 48: a Phase outside the enum ran as a recompute).
TEST(Engine, AnAcquireOfNoPhaseOrParameterIsRefusedAndChangesNothing) {
  Trainer a = Make(TestEngineConfig());
  Trainer b = Make(TestEngineConfig());
  const std::vector<ParamId> ids = {0};
  const std::vector<ParamId> unknown = {a.engine->num_params()};
  EXPECT_EQ(a.engine->Acquire(ids, static_cast<Phase>(7)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(a.engine->Acquire(unknown, Phase::kForward).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Train(a, 0, 3), Train(b, 0, 3));
}

// A checkpoint holds the states as of a Step: a save inside an accumulation window is refused
// (hunt 48: saved, it dropped the window's micro-batches and its resume could not Step); after
// the Step it saves.
TEST(Engine, ASaveInsideAnAccumulationWindowIsRefused) {
  TempDir dir;
  EngineConfig ec = TestEngineConfig();
  ec.grad_accumulation = 2;
  Trainer a = Make(ec);
  Train(a, 0, 1);
  ASSERT_TRUE(a.model->ForwardBackward(a.data->Get(false, 9, 4)).ok());
  const Status s = a.engine->SaveCheckpoint(dir.path() + "/ck", "{}");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("1 training iteration without Step"), std::string::npos)
      << s.ToString();
  EXPECT_FALSE(fs::exists(dir.path() + "/ck"));
  ASSERT_TRUE(a.model->ForwardBackward(a.data->Get(false, 10, 4)).ok());
  ASSERT_TRUE(a.engine->Step({1e-3f}).ok());
  EXPECT_TRUE(a.engine->SaveCheckpoint(dir.path() + "/ck", "{}").ok());
}

// A gradient kept on the device crosses no link: the profiled iteration's D2H link leaves its
// copies out (they are the D2H stream's lane 1), as the engine's counter does (hunt 39: the link
// said 5 MiB and a bandwidth where counters.d2h_bytes was 0).
TEST(Engine, GradientsKeptOnTheDeviceAreNotLinkTraffic) {
  TempDir dir;
  EngineConfig ec = TestEngineConfig();
  ec.device_shard_budget = uint64_t{64} << 20;
  Trainer r = Make(ec);
  ASSERT_GT(DeviceGradShards(*r.engine), 0) << r.engine->PlacementSummary();
  Train(r, 0, 3);
  r.engine->ProfileNextIteration();
  Train(r, 3, 5);
  const std::string path = dir.path() + "/report.json";
  ASSERT_TRUE(r.engine->WriteReport(path).ok());
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f);
  ASSERT_TRUE(j["profile"]["available"].get<bool>());
  EXPECT_EQ(j["profile"]["links"]["d2h"]["bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["profile"]["links"]["d2h"]["busy_seconds"].get<double>(), 0.0);
  int on_device = 0;
  for (const auto& e : j["profile"]["events"])
    if (e["track"] == "D2H") {
      EXPECT_EQ(e["lane"].get<int>(), 1) << e.dump();
      on_device += e["lane"].get<int>() == 1;
    }
  EXPECT_GT(on_device, 0) << "no gradient went into a device shard";
}

TEST(Engine, ReportAgreesWithTheEngineCounters) {
  // The report's numbers are the engine's: counters, tiers, layout, the profiled iteration.
  TempDir dir;
  EngineConfig ec = TestEngineConfig();
  ec.host_budget = uint64_t{1536} << 10;
  ec.nvme_budget = uint64_t{128} << 20;
  ec.nvme_path = dir.path();
  Trainer r = Make(ec);
  Train(r, 0, 3);
  r.engine->ProfileNextIteration();  // a later iteration replaces the first profile
  Train(r, 3, 5);
  const std::string path = dir.path() + "/report.json";
  ASSERT_TRUE(r.engine->WriteReport(path).ok());
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["schema"], "tierzero-report");
  EXPECT_EQ(j["version"], 2);
  const EngineStats s = r.engine->stats();
  const nlohmann::json& c = j["counters"];
  EXPECT_EQ(c["h2d_bytes"].get<uint64_t>(), s.h2d_bytes);
  EXPECT_EQ(c["d2h_bytes"].get<uint64_t>(), s.d2h_bytes);
  EXPECT_EQ(c["nvme_read_bytes"].get<uint64_t>(), s.nvme_read_bytes);
  EXPECT_EQ(c["nvme_write_bytes"].get<uint64_t>(), s.nvme_write_bytes);
  EXPECT_EQ(c["hits"].get<uint64_t>(), s.hits);
  EXPECT_EQ(c["misses"].get<uint64_t>(), s.misses);
  EXPECT_EQ(c["evictions"].get<uint64_t>(), s.evictions);
  EXPECT_EQ(c["steps"].get<int64_t>(), 5);
  EXPECT_DOUBLE_EQ(c["optimizer_seconds"].get<double>(), s.optimizer_seconds);
  const TierUsage u = r.engine->usage();
  EXPECT_EQ(j["tiers"]["host"]["used"].get<uint64_t>(), u.host);
  EXPECT_EQ(j["tiers"]["host"]["model_bytes"].get<uint64_t>() +
                j["tiers"]["host"]["fixed_bytes"].get<uint64_t>(),
            u.host);
  EXPECT_EQ(j["tiers"]["nvme"]["used"].get<uint64_t>(), u.nvme);
  EXPECT_EQ(j["tiers"]["device"]["peak"].get<uint64_t>(), u.device_peak);
  // Every sub-group's optimizer state is where the layout says, and sums to the NVMe share.
  uint64_t nvme_states = 0;
  for (const auto& g : j["optimizer"]["sub_groups"]) {
    const int k = g["chunk"];
    EXPECT_EQ(g["tier"], j["layout"]["chunks"][k]["optimizer_tier"]);
    if (g["tier"] == "nvme") nvme_states += g["bytes"].get<uint64_t>();
  }
  EXPECT_GT(nvme_states, 0u);
  EXPECT_LE(nvme_states, u.nvme);
  // The profiled iteration: the re-armed one (iteration 3 or later), as many moments as the
  // trace, transfers whose bytes are whole chunks, an optimizer step that includes its parts.
  const nlohmann::json& p = j["profile"];
  ASSERT_TRUE(p["available"].get<bool>());
  EXPECT_GE(p["iteration"].get<int64_t>(), 3);
  EXPECT_EQ(p["moments"].size(), j["moments"].size());
  const uint64_t chunk_bytes = j["layout"]["chunk_bytes"];
  for (const auto& m : p["moments"]) {
    EXPECT_EQ(m["residency"].get<std::string>().size(), j["layout"]["chunks"].size());
    EXPECT_EQ(m["device"]["chunk_bytes"].get<uint64_t>() % chunk_bytes, 0u);
  }
  uint64_t h2d = 0;
  for (const auto& e : p["events"]) {
    if (e["track"] == "H2D") h2d += e["bytes"].get<uint64_t>();
  }
  EXPECT_GT(h2d, 0u);
  EXPECT_EQ(h2d % chunk_bytes, 0u);
  EXPECT_EQ(p["links"]["h2d"]["bytes"].get<uint64_t>(), h2d);
  EXPECT_LE(h2d, s.h2d_bytes);
  const auto& b = p["breakdown"];
  EXPECT_GT(b["forward_seconds"].get<double>(), 0);
  EXPECT_GT(b["backward_seconds"].get<double>(), 0);
  EXPECT_LE(b["optimizer_compute_seconds"].get<double>(), b["optimizer_seconds"].get<double>());
  EXPECT_LE(b["optimizer_seconds"].get<double>(), s.optimizer_seconds);
}

TEST(Engine, AccumulationFreesGradientChunksDuringBackward) {
  // With accumulation every chunk's gradient goes to its own device buffer. Each is freed once its
  // copy to the host is done, not at the end of the iteration: after a backward pass over 24
  // chunks, only the last few are still on the device.
  // The simulated device, whatever TZ_TEST_DEVICE says: the test writes the gradients through
  // host pointers (on a GPU they are device memory), and what it checks does not depend on it.
  EngineConfig ec = testing_models::SmallEngineConfig(DeviceChoice::kHost);
  ec.compute_dtype = DType::kF32;
  ec.grad_accumulation = 2;
  ec.device_budget = uint64_t{4} << 20;
  auto e = Engine::Create(ec);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& engine = **e;
  constexpr int kParams = 24;
  std::vector<ParamId> ids;
  for (int i = 0; i < kParams; ++i) {
    auto id = engine.RegisterParam({"p" + std::to_string(i), {16384}, InitConstant(1.0f)});
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  ASSERT_TRUE(engine.Finalize().ok());
  const uint64_t chunk_bytes = 16384 * 4;
  for (int iteration = 0; iteration < 2; ++iteration) {  // warm-up, then the plan
    ASSERT_TRUE(engine.BeginIteration(true).ok());
    for (int i = 0; i < kParams; ++i) {
      auto scope = engine.Acquire(std::span(&ids[static_cast<size_t>(i)], 1), Phase::kForward);
      ASSERT_TRUE(scope.ok()) << scope.status().ToString();
    }
    const uint64_t after_forward = engine.usage().device;
    for (int i = kParams - 1; i >= 0; --i) {
      auto scope = engine.Acquire(std::span(&ids[static_cast<size_t>(i)], 1), Phase::kBackward);
      ASSERT_TRUE(scope.ok()) << scope.status().ToString();
      auto* g = static_cast<float*>(scope->grad(ids[static_cast<size_t>(i)]));
      ASSERT_NE(g, nullptr);
      std::fill(g, g + 16384, 0.5f);
    }
    // Gradient chunks still on the device after backward: a few whose copies are in flight, not
    // all 24 (measured: 1 with this change, 24 before it).
    const TierUsage u = engine.usage();
    EXPECT_LT(u.device, after_forward + 6 * chunk_bytes) << "iteration " << iteration;
    ASSERT_TRUE(engine.EndIteration().ok());
  }
  std::vector<float> grad(16384);
  ASSERT_TRUE(engine.ReadGrad(ids[0], grad).ok());
  EXPECT_FLOAT_EQ(grad[0], 1.0f);  // 0.5 from each of the two micro-batches
}

}  // namespace
}  // namespace tierzero

// Engine::Plan's "does not fit" against real runs: a budget the plan says is too small fails
// with the engine's OutOfMemory, and the smallest budget the plan says fits runs; the memory it
// predicts equals the run's measured peaks.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpt/gpt.h"
#include "plan_model.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

GptConfig Model() { return PlanTestModel(); }

constexpr int kBatch = 32;

Batch MakeBatch(const GptConfig& mc, int batch = kBatch) {
  Batch b;
  b.batch = batch;
  b.seq = mc.seq_len;
  for (int i = 0; i < batch * mc.seq_len; ++i) {
    b.tokens.push_back(i % mc.vocab);
    b.targets.push_back((i + 3) % mc.vocab);
    b.mask.push_back(1.0f);
  }
  return b;
}

StatusOr<PlanPrediction> PlanFor(const EngineConfig& ec, int batch = kBatch,
                                 const GptConfig& mc = Model()) {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, Gpt::Create(*engine, mc));
  TZ_ASSIGN_OR_RETURN(WarmupTrace t, model->DeriveTrace(batch));
  PlanRequest req;
  req.moments = t.moments;
  req.rates.h2d_bytes_per_s = req.rates.d2h_bytes_per_s = 1e10;
  req.rates.cpu_adam_params_per_s = 1e9;
  req.rates.device_adam_params_per_s = 1e9;
  return engine->Plan(req);
}

// Three steps of a real run; its usage after them.
StatusOr<TierUsage> RunSteps(const EngineConfig& ec, int batch = kBatch,
                             const GptConfig& mc = Model()) {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, Gpt::Create(*engine, mc));
  TZ_RETURN_IF_ERROR(engine->Finalize());
  for (int s = 0; s < 3; ++s) {
    for (int m = 0; m < ec.grad_accumulation; ++m)
      TZ_RETURN_IF_ERROR(model->ForwardBackward(MakeBatch(mc, batch)).status());
    TZ_RETURN_IF_ERROR(engine->Step({1e-3f}).status());
  }
  return engine->usage();
}

// The smallest device budget, in steps of `step` bytes from `from`, the plan says fits.
uint64_t SmallestFittingDevice(const EngineConfig& ec, int batch, const GptConfig& mc,
                               uint64_t from, uint64_t step) {
  for (uint64_t need = from;; need += step) {
    EngineConfig c = ec;
    c.device_budget = need;
    auto q = PlanFor(c, batch, mc);
    EXPECT_TRUE(q.ok()) << q.status().ToString();
    if (!q.ok() || q->fits || q->failing_tier != "device" || need > (uint64_t{1} << 30)) {
      EXPECT_TRUE(q.ok() && q->fits) << "the device budget alone does not make it fit";
      return need;
    }
  }
}

TEST(PlanFit, SuggestedDeviceBudgetRunsAndTheUnchangedOneFails) {
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  ec.host_budget = uint64_t{64} << 20;
  ec.chunk_elems = 65536;
  ec.device_budget = uint64_t{2} << 20;  // far below the activations
  auto p = PlanFor(ec);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_FALSE(p->fits);
  EXPECT_EQ(p->failing_tier, "device");
  // The smallest device budget (in 256 KiB steps) the plan says fits.
  uint64_t need = ec.device_budget;
  for (;;) {
    need += 256 << 10;
    EngineConfig c = ec;
    c.device_budget = need;
    auto q = PlanFor(c);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    if (q->fits) break;
    ASSERT_LT(need, uint64_t{64} << 20);
  }
  auto failed = RunSteps(ec);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kOutOfMemory) << failed.status().ToString();
  EngineConfig fixed = ec;
  fixed.device_budget = need;
  auto ran = RunSteps(fixed);
  ASSERT_TRUE(ran.ok()) << ran.status().ToString();
  auto predicted = PlanFor(fixed);
  ASSERT_TRUE(predicted.ok());
  EXPECT_EQ(predicted->device.peak, ran->device_peak);
  EXPECT_EQ(predicted->host.peak, ran->host);
}

// Separate gradient chunks (accumulation; a tensor used twice in forward) outlive the Release
// that reduces them by one moment (Note [A gradient chunk held past its reduction]):
// the plan counted them to their last backward moment, said a budget fitted, and the run ran out
// of device memory in its first step. Now the smallest budget the plan says fits runs (with its
// room against fragmentation: Note [Room for the device allocator's fragmentation]), its peak is
// the run's to the byte, and a capacity under that peak fails.
TEST(PlanFit, SeparateGradientChunksAreCountedAsTheRunHoldsThem) {
  for (const int accum : {2, 3}) {
    SCOPED_TRACE("grad_accumulation " + std::to_string(accum));
    EngineConfig ec;
    ec.device = DeviceChoice::kHost;
    ec.host_budget = uint64_t{256} << 20;
    ec.chunk_elems = 262144;
    ec.grad_accumulation = accum;
    // Wide blocks and one row of 16 tokens: the gradient chunks, not the activations, make the
    // peak.
    GptConfig mc = Model();
    mc.d_model = 256;
    mc.n_layer = 4;  // (the peak at a block's moment, holding the two blocks after it)
    const int batch = 1;
    const uint64_t chunk = 262144 * 4;
    const uint64_t need = SmallestFittingDevice(ec, batch, mc, uint64_t{1} << 20, chunk / 4);
    ASSERT_GT(need, uint64_t{1} << 20);
    EngineConfig fixed = ec;
    fixed.device_budget = need;
    auto ran = RunSteps(fixed, batch, mc);
    ASSERT_TRUE(ran.ok()) << ran.status().ToString();
    auto predicted = PlanFor(fixed, batch, mc);
    ASSERT_TRUE(predicted.ok());
    EXPECT_EQ(predicted->device.peak, ran->device_peak);
    EXPECT_GT(predicted->device_grads, predicted->device_activations);
    // A capacity a chunk short of the peak fails: the gradient chunks held one moment more are
    // really there.
    EngineConfig below = ec;
    below.device_budget = need - predicted->device_fragmentation_allowance - chunk;
    auto small = PlanFor(below, batch, mc);
    ASSERT_TRUE(small.ok());
    ASSERT_LT(small->device.budget, small->device.peak);
    EXPECT_EQ(RunSteps(below, batch, mc).status().code(), StatusCode::kOutOfMemory);
  }
}

TEST(PlanFit, SuggestedHostBudgetRunsAndTheUnchangedOneFails) {
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  ec.device_budget = uint64_t{64} << 20;
  ec.chunk_elems = 65536;
  ec.host_budget = uint64_t{1} << 20;  // no NVMe: the states do not fit
  auto p = PlanFor(ec);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_FALSE(p->fits);
  EXPECT_EQ(p->failing_tier, "host");
  uint64_t need = ec.host_budget;
  for (;;) {
    need += 256 << 10;
    EngineConfig c = ec;
    c.host_budget = need;
    auto q = PlanFor(c);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    if (q->fits) break;
    ASSERT_LT(need, uint64_t{1} << 30);
  }
  EXPECT_EQ(RunSteps(ec).status().code(), StatusCode::kOutOfMemory);
  EngineConfig fixed = ec;
  fixed.host_budget = need;
  auto ran = RunSteps(fixed);
  ASSERT_TRUE(ran.ok()) << ran.status().ToString();
}

TEST(PlanFit, PlanRejectsBadInputAndRunsBeforeFinalizeOnly) {
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  auto engine = Engine::Create(ec);
  ASSERT_TRUE(engine.ok());
  PlanRequest req;
  EXPECT_EQ((*engine)->Plan(req).status().code(), StatusCode::kFailedPrecondition);  // no params
  auto model = Gpt::Create(**engine, Model());
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*engine)->Plan(req).status().code(), StatusCode::kInvalidArgument);  // no moments
  req.moments.push_back({{9999}, false});
  EXPECT_EQ((*engine)->Plan(req).status().code(), StatusCode::kInvalidArgument);
  // Moments Acquire would refuse, and numbers no sum holds (a NaN was counted as 0, 1e308 made
  // the step infinite): each refused, where the model's own trace plans.
  auto t = (*model)->DeriveTrace(kBatch);
  ASSERT_TRUE(t.ok());
  req.moments = t->moments;
  ASSERT_TRUE((*engine)->Plan(req).ok());
  const std::vector<std::pair<std::string, std::function<void(PlanRequest&)>>> bad = {
      {"a parameter twice",
       [](PlanRequest& r) { r.moments[0].params.push_back(r.moments[0].params[0]); }},
      {"a backward first", [](PlanRequest& r) { r.moments[0].backward = true; }},
      {"a NaN time", [](PlanRequest& r) { r.moments[1].compute_seconds = std::nan(""); }},
      {"a negative time", [](PlanRequest& r) { r.moments[1].compute_seconds = -1; }},
      {"a time beyond any run", [](PlanRequest& r) { r.moments[1].compute_seconds = 1e308; }},
      {"an infinite step", [](PlanRequest& r) { r.step_other_s = INFINITY; }},
  };
  for (const auto& [what, edit] : bad) {
    PlanRequest r = req;
    edit(r);
    EXPECT_EQ((*engine)->Plan(r).status().code(), StatusCode::kInvalidArgument) << what;
  }
  // Note [Parameter shards on the device need its collectives]: several ranks through host
  // buffers cannot gather a shard kept on the device; plan refuses it as the run does.
  {
    EngineConfig two = ec;
    two.device_shard_budget = uint64_t{64} << 20;
    two.collectives = CollectivePath::kHost;
    auto e2 = Engine::Create(two);
    ASSERT_TRUE(e2.ok());
    ASSERT_TRUE(Gpt::Create(**e2, Model()).ok());
    PlanRequest r = req;
    r.world_size = 2;
    auto refused = (*e2)->Plan(r);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kUnsupported) << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("device_shard_budget 0"), std::string::npos)
        << refused.status().ToString();
    two.collectives = CollectivePath::kAuto;  // (the device path, where every rank can)
    auto e3 = Engine::Create(two);
    ASSERT_TRUE(e3.ok());
    ASSERT_TRUE(Gpt::Create(**e3, Model()).ok());
    EXPECT_TRUE((*e3)->Plan(r).ok());
  }
  ASSERT_TRUE((*engine)->Finalize().ok());
  EXPECT_EQ((*engine)->Plan(req).status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tierzero::gpt

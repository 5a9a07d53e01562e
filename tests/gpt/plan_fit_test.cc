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

Batch MakeBatch(const GptConfig& mc) {
  Batch b;
  b.batch = kBatch;
  b.seq = mc.seq_len;
  for (int i = 0; i < kBatch * mc.seq_len; ++i) {
    b.tokens.push_back(i % mc.vocab);
    b.targets.push_back((i + 3) % mc.vocab);
    b.mask.push_back(1.0f);
  }
  return b;
}

StatusOr<PlanPrediction> PlanFor(const EngineConfig& ec) {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, Gpt::Create(*engine, Model()));
  TZ_ASSIGN_OR_RETURN(WarmupTrace t, model->DeriveTrace(kBatch));
  PlanRequest req;
  req.moments = t.moments;
  req.rates.h2d_bytes_per_s = req.rates.d2h_bytes_per_s = 1e10;
  req.rates.cpu_adam_params_per_s = 1e9;
  req.rates.device_adam_params_per_s = 1e9;
  return engine->Plan(req);
}

// Three steps of a real run; its usage after them.
StatusOr<TierUsage> RunSteps(const EngineConfig& ec) {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, Gpt::Create(*engine, Model()));
  TZ_RETURN_IF_ERROR(engine->Finalize());
  for (int s = 0; s < 3; ++s) {
    TZ_RETURN_IF_ERROR(model->ForwardBackward(MakeBatch(Model())).status());
    TZ_RETURN_IF_ERROR(engine->Step({1e-3f}).status());
  }
  return engine->usage();
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
  // One step below the suggestion fails too: the suggestion is the smallest that runs.
  EngineConfig below = ec;
  below.device_budget = need - (256 << 10);
  EXPECT_EQ(RunSteps(below).status().code(), StatusCode::kOutOfMemory);
  EngineConfig fixed = ec;
  fixed.device_budget = need;
  auto ran = RunSteps(fixed);
  ASSERT_TRUE(ran.ok()) << ran.status().ToString();
  auto predicted = PlanFor(fixed);
  ASSERT_TRUE(predicted.ok());
  EXPECT_EQ(predicted->device.peak, ran->device_peak);
  EXPECT_EQ(predicted->host.peak, ran->host);
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
  ASSERT_TRUE((*engine)->Finalize().ok());
  EXPECT_EQ((*engine)->Plan(req).status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tierzero::gpt

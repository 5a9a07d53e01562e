// A plan in the report it predicted (WithPrediction): the rows compare the plan's numbers with a
// real run's (memory and bytes per iteration equal), a plan of another run is refused, a
// malformed one named; the collectives' model of several ranks; the rates' file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "gpt/gpt.h"
#include "plan_model.h"
#include "tierzero/engine.h"
#include "tierzero/report.h"

namespace tierzero::gpt {
namespace {

using nlohmann::json;

GptConfig Model() { return PlanTestModel(); }

constexpr int kBatch = 16;

EngineConfig Config() {
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  ec.device_budget = uint64_t{16} << 20;
  ec.host_budget = uint64_t{64} << 20;
  return ec;
}

MachineRates Rates() {
  MachineRates r;
  r.h2d_bytes_per_s = r.d2h_bytes_per_s = 1e10;
  r.cpu_adam_params_per_s = 1e9;
  r.device_adam_params_per_s = 1e9;
  return r;
}

StatusOr<PlanPrediction> PlanFor(const EngineConfig& ec, const PlanRequest& base) {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, Gpt::Create(*engine, Model()));
  TZ_ASSIGN_OR_RETURN(WarmupTrace t, model->DeriveTrace(kBatch));
  PlanRequest req = base;
  req.moments = t.moments;
  return engine->Plan(req);
}

// Four steps of a real run (the second profiled); its report.
StatusOr<std::string> RunReport(const EngineConfig& ec) {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, Gpt::Create(*engine, Model()));
  TZ_RETURN_IF_ERROR(engine->Finalize());
  Batch b;
  b.batch = kBatch;
  b.seq = Model().seq_len;
  for (int i = 0; i < kBatch * b.seq; ++i) {
    b.tokens.push_back(i % 256);
    b.targets.push_back((i + 5) % 256);
    b.mask.push_back(1.0f);
  }
  for (int s = 0; s < 4; ++s) {
    TZ_RETURN_IF_ERROR(model->ForwardBackward(b).status());
    TZ_RETURN_IF_ERROR(engine->Step({1e-3f}).status());
  }
  return engine->ReportJson();
}

const json* Row(const json& compared, const std::string& what) {
  for (const json& r : compared)
    if (r["what"] == what) return &r;
  return nullptr;
}

TEST(PlanReport, RowsCompareThePlanWithTheRun) {
  PlanRequest req;
  req.rates = Rates();
  auto plan = PlanFor(Config(), req);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_TRUE(plan->fits);
  auto report = RunReport(Config());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  auto with = WithPrediction(*report, PlanJson(*plan));
  ASSERT_TRUE(with.ok()) << with.status().ToString();
  const json r = json::parse(*with);
  ASSERT_TRUE(r.contains("prediction"));
  const json& rows = r["prediction"]["compared"];
  // Memory and the iteration's link bytes: the run's own functions, so equal.
  for (const char* what : {"device peak", "host", "H2D per iteration", "D2H per iteration",
                           "parameter shards in host memory"}) {
    const json* row = Row(rows, what);
    ASSERT_NE(row, nullptr) << what;
    EXPECT_GT((*row)["measured"].get<double>(), 0) << what;
    EXPECT_EQ((*row)["predicted"].get<double>(), (*row)["measured"].get<double>()) << what;
  }
  EXPECT_EQ((*Row(rows, "device peak"))["measured"].get<double>(),
            r["tiers"]["device"]["peak"].get<double>());
  // The step: the run's median step, measured by the engine.
  const json* step = Row(rows, "step");
  ASSERT_NE(step, nullptr);
  EXPECT_GT(r["counters"]["step_seconds_median"].get<double>(), 0);
  EXPECT_EQ((*step)["measured"], r["counters"]["step_seconds_median"]);
  EXPECT_EQ((*step)["predicted"].get<double>(), plan->step_s);
  EXPECT_EQ(Row(rows, "NVMe"), nullptr);  // nothing on either side
  // The summary and the page carry them.
  auto summary = ReportSummary(*with);
  ASSERT_TRUE(summary.ok()) << summary.status().ToString();
  EXPECT_NE(summary->find("predicted by tierzero plan / measured"), std::string::npos);
  // A `tierzero plan --json` document is read the same.
  const json doc = {{"schema", "tierzero.plan/1"}, {"prediction", json::parse(PlanJson(*plan))}};
  auto from_doc = WithPrediction(*report, doc.dump());
  ASSERT_TRUE(from_doc.ok()) << from_doc.status().ToString();
  EXPECT_EQ(json::parse(*from_doc)["prediction"], r["prediction"]);
}

// The simulated device's settings a run obeys, the plan predicts (Note [The simulated device's
// settings in a plan]): a throttled link moves the iteration's bytes no faster than it allows,
// and a modelled device Adam updates the device's groups at its rate (hunt 47: both ignored).
TEST(PlanReport, TheSimulatedDevicesThrottleAndAdamModelArePredicted) {
  PlanRequest req;
  req.rates = Rates();
  auto base = PlanFor(Config(), req);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  EngineConfig slow = Config();
  slow.host_link_bandwidth = 1e7;  // 1000x under the rates' link
  auto throttled = PlanFor(slow, req);
  ASSERT_TRUE(throttled.ok()) << throttled.status().ToString();
  ASSERT_GT(throttled->iteration_h2d_bytes, 0u);
  // The link is serial: an iteration's gathers take at least their bytes at its rate.
  EXPECT_GE(throttled->transfer_s, static_cast<double>(throttled->iteration_h2d_bytes) / 1e7);
  EXPECT_GT(throttled->step_s, base->step_s + throttled->iteration_h2d_bytes / 2e7);
  EngineConfig modelled = Config();
  modelled.host_device_adam_rate = 1e5;  // parameters per second
  modelled.optimizer = OptimizerPlacement::kFraction;
  modelled.optimizer_device_fraction = 1;
  auto device = PlanFor(modelled, req);
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  ASSERT_EQ(device->optimizer_cpu, 0);
  uint64_t params = 0;
  {
    auto engine = Engine::Create(modelled);
    ASSERT_TRUE(engine.ok());
    auto model = Gpt::Create(**engine, Model());
    ASSERT_TRUE(model.ok());
    params = (*model)->num_params();
  }
  EXPECT_GE(device->optimizer_s, 0.95 * static_cast<double>(params) / 1e5);
  // On a GPU neither applies: its plan is the rates' (the engine ignores both there).
}

// Compressed optimizer states: the plan counts the format's bytes, host and NVMe, as the run
// holds them (states on NVMe past a small host budget).
TEST(PlanReport, CompressedMomentsArePredictedAsTheRunHoldsThem) {
  const std::string dir = ::testing::TempDir() + "/tz_plan_moments_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  for (MomentFormat f : {MomentFormat::kBF16, MomentFormat::kInt8}) {
    EngineConfig ec = Config();
    ec.optimizer_states = f;
    ec.host_budget = uint64_t{6} << 20;
    ec.nvme_budget = uint64_t{256} << 20;
    ec.nvme_path = dir;
    PlanRequest req;
    req.rates = Rates();
    req.rates.nvme_read_bytes_per_s = req.rates.nvme_write_bytes_per_s = 1e9;
    auto plan = PlanFor(ec, req);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ASSERT_TRUE(plan->fits) << plan->problem;
    EXPECT_GT(plan->optimizer_groups[2], 0);  // some states on NVMe
    auto report = RunReport(ec);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    auto with = WithPrediction(*report, PlanJson(*plan));
    ASSERT_TRUE(with.ok()) << with.status().ToString();
    const json rows = json::parse(*with)["prediction"]["compared"];
    for (const char* what : {"host", "NVMe"}) {
      const json* row = Row(rows, what);
      ASSERT_NE(row, nullptr) << what;
      EXPECT_EQ((*row)["predicted"].get<double>(), (*row)["measured"].get<double>()) << what;
    }
    // Kept on the device: one allocation the device rounds to its alignment (8-bit groups are
    // 64-byte multiples: the plan was 128 bytes under the peak; hunt 51).
    ec.device_shard_budget = uint64_t{8} << 20;
    ec.host_budget = uint64_t{64} << 20;
    plan = PlanFor(ec, req);
    ASSERT_TRUE(plan.ok() && plan->fits) << plan.status().ToString();
    EXPECT_GT(plan->optimizer_groups[0], 0);  // some states on the device
    report = RunReport(ec);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    with = WithPrediction(*report, PlanJson(*plan));
    ASSERT_TRUE(with.ok()) << with.status().ToString();
    const json resident = json::parse(*with)["prediction"]["compared"];
    for (const char* what : {"device peak", "host"}) {
      const json* row = Row(resident, what);
      ASSERT_NE(row, nullptr) << what;
      EXPECT_EQ((*row)["predicted"].get<double>(), (*row)["measured"].get<double>())
          << what << " with moments of format " << static_cast<int>(f) << " on the device";
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(PlanReport, APlanOfAnotherRunOrMalformedIsRefused) {
  PlanRequest req;
  req.rates = Rates();
  auto report = RunReport(Config());
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  // Another rank count, another chunk size.
  req.world_size = 2;
  auto two = PlanFor(Config(), req);
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  auto s = WithPrediction(*report, PlanJson(*two));
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().ToString().find("--ranks"), std::string::npos) << s.status().ToString();
  req.world_size = 0;
  EngineConfig other = Config();
  other.chunk_elems = 1 << 16;
  auto small = PlanFor(other, req);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_EQ(WithPrediction(*report, PlanJson(*small)).status().code(),
            StatusCode::kFailedPrecondition);
  // A plan that does not fit has nothing to compare.
  EngineConfig tiny = Config();
  tiny.host_budget = uint64_t{1} << 20;
  auto no = PlanFor(tiny, req);
  ASSERT_TRUE(no.ok());
  ASSERT_FALSE(no->fits);
  EXPECT_EQ(WithPrediction(*report, PlanJson(*no)).status().code(),
            StatusCode::kFailedPrecondition);
  // Malformed: not JSON, another schema, a missing field (named), a field of the wrong type.
  EXPECT_EQ(WithPrediction(*report, "{").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      WithPrediction(*report, R"({"schema": "tierzero.plan/9", "prediction": {}})").status().code(),
      StatusCode::kInvalidArgument);
  auto plan = PlanFor(Config(), req);
  ASSERT_TRUE(plan.ok());
  json p = json::parse(PlanJson(*plan));
  p["memory"].erase("device");
  auto missing = WithPrediction(*report, p.dump());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().ToString().find("memory.device"), std::string::npos)
      << missing.status().ToString();
  p = json::parse(PlanJson(*plan));
  p["time"]["step_s"] = "fast";
  EXPECT_EQ(WithPrediction(*report, p.dump()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(WithPrediction("not a report", PlanJson(*plan)).ok());
}

// Note [Collectives on the cores that compute]: one all-gather per gather, one reduce-scatter
// per chunk; paid in full beside compute when the device shares the CPU, inside the gathers'
// time otherwise. Ranks on one machine share its CPU Adam.
TEST(PlanReport, CollectivesAndSharedCoresOfSeveralRanks) {
  PlanRequest req;
  req.rates = Rates();
  req.rates.comm_bytes_per_s = 2e9;
  req.rates.comm_latency_s = 20e-6;
  req.rates.device_shares_cpu = true;
  req.world_size = 2;
  EngineConfig ec = Config();
  ec.optimizer = OptimizerPlacement::kCpu;
  auto p = PlanFor(ec, req);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE(p->fits);
  const double per_collective = 20e-6 + static_cast<double>(p->chunk_bytes - p->shard_bytes) / 2e9;
  EXPECT_GE(p->collectives, 2 * p->chunks);
  EXPECT_NEAR(p->comm_s, p->collectives * per_collective, 1e-12);
  EXPECT_NEAR(p->comm_bytes, p->collectives * static_cast<double>(p->chunk_bytes - p->shard_bytes),
              0.5);
  EXPECT_NEAR(p->step_s, p->compute_s + p->param_wait_s + p->optimizer_s + p->comm_s + p->other_s,
              1e-12);
  EXPECT_TRUE(p->assumed_rates.empty());
  // A device of its own: the collectives are in the gathers, not beside compute.
  req.rates.device_shares_cpu = false;
  auto own = PlanFor(ec, req);
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->comm_s, 0);
  EXPECT_EQ(own->collectives, p->collectives);
  // Two ranks on one machine: each gets half its CPU Adam.
  req.ranks_per_node = 1;
  auto apart = PlanFor(ec, req);
  req.ranks_per_node = 2;
  auto together = PlanFor(ec, req);
  ASSERT_TRUE(apart.ok() && together.ok());
  EXPECT_NEAR(together->optimizer_s, 2 * apart->optimizer_s, 1e-9 + 1e-6 * apart->optimizer_s);
  // Unknown communicator rates are assumed, and said.
  req.rates.comm_bytes_per_s = 0;
  req.rates.comm_latency_s = 0;
  auto assumed = PlanFor(ec, req);
  ASSERT_TRUE(assumed.ok());
  EXPECT_NE(
      std::find(assumed->assumed_rates.begin(), assumed->assumed_rates.end(), "comm_latency_s"),
      assumed->assumed_rates.end());
}

TEST(PlanReport, RatesFileRoundTripsAndNamesBadFields) {
  MachineRates r = Rates();
  r.name = "a node";
  r.comm_bytes_per_s = 25e9;
  r.comm_latency_s = 8e-6;
  r.nvme_duplex_bytes_per_s = 3e9;
  auto back = MachineRatesFromJson(MachineRatesToJson(r));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->name, r.name);
  EXPECT_EQ(back->comm_latency_s, r.comm_latency_s);
  EXPECT_EQ(back->comm_bytes_per_s, r.comm_bytes_per_s);
  EXPECT_EQ(back->cpu_adam_params_per_s, r.cpu_adam_params_per_s);
  auto typo = MachineRatesFromJson(R"({"comm_latency": 1e-5})");
  EXPECT_EQ(typo.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(typo.status().ToString().find("comm_latency"), std::string::npos);
  EXPECT_FALSE(MachineRatesFromJson(R"({"comm_latency_s": -1})").ok());
}

// A warm-up trace is written only as it reads back (hunt 48: a NaN, a moment without parameters
// or a name that is not UTF-8 were written over the file, then refused when read).
TEST(PlanReport, AWarmUpTraceIsWrittenOnlyAsItReadsBack) {
  const std::string path = ::testing::TempDir() + "/tz_trace_" + std::to_string(getpid()) + ".json";
  WarmupTrace t;
  t.params = {{"w", {4, 4}, true}};
  t.moments.resize(1);
  t.moments[0].params = {0};
  t.moments[0].compute_seconds = 1e-3;
  ASSERT_TRUE(WriteWarmupTrace(t, path).ok());
  auto back = ReadWarmupTrace(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->moments[0].params, t.moments[0].params);
  auto refused = [&](const WarmupTrace& bad) {
    const Status s = WriteWarmupTrace(bad, path);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_TRUE(ReadWarmupTrace(path).ok()) << "a refused write replaced the file";
  };
  WarmupTrace nan = t;
  nan.moments[0].compute_seconds = std::nan("");
  refused(nan);
  WarmupTrace empty = t;
  empty.moments[0].params.clear();
  refused(empty);
  WarmupTrace name = t;
  name.params[0].name = "w\xff";
  refused(name);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace tierzero::gpt

// BuildReportJson (src/profiler/report_snapshot.h) from a hand-made snapshot: the figures it
// derives (link busy time as the union of overlapping spans, bandwidth, the step-time breakdown,
// free bytes per tier) against values worked out by hand here.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "profiler/report_snapshot.h"
#include "tierzero/report.h"

namespace tierzero {
namespace {

using nlohmann::json;

TimelineEvent Span(Track track, double start, double dur, uint64_t bytes, int lane = 0) {
  TimelineEvent e;
  e.track = track;
  e.name = "x";
  e.start_s = start;
  e.dur_s = dur;
  e.bytes = bytes;
  e.lane = lane;
  return e;
}

ReportSnapshot Snapshot() {
  ReportSnapshot s;
  s.config.device_budget = 1000;
  s.config.host_budget = 5000;
  s.config.nvme_budget = 9000;
  s.config.compute_dtype = "bf16";
  s.config.device = "HostSim";
  s.tiers.host_model = 3000;
  s.tiers.host_fixed = 2500;  // over the budget together: free is 0, not a wrapped number
  s.tiers.nvme_used = 4000;
  s.layout.chunk_elems = 10;  // (at least 1: the report's schema says so)
  s.plan.policy = "plan";
  s.layout.chunk_bytes = 40;
  s.layout.shard_elems = 10;
  s.layout.chunks.resize(2);
  for (auto& c : s.layout.chunks) {
    c.tensors = {"w"};
    c.used_elems = 10;
    c.param_tier = c.grad_tier = "host";
  }
  s.layout.chunks[0].optimizer_tier = "host";
  s.layout.chunks[1].optimizer_tier = "nvme";
  s.profile.available = true;
  s.profile.iteration = 3;
  s.profile.step_seconds = 2.0;
  // Forward: waited 0.25 s, computed 0.5 s; backward: computed 1.0 s; an untimed moment.
  ReportSnapshot::ProfiledMoment fwd{.device_chunk_bytes = 600,
                                     .nonmodel_bytes = 100,
                                     .stall_s = 0.1,
                                     .backward = false,
                                     .timed = true,
                                     .call_s = 0,
                                     .ready_s = 0.25,
                                     .release_s = 0.75};
  ReportSnapshot::ProfiledMoment bwd{.device_chunk_bytes = 900,
                                     .nonmodel_bytes = 300,
                                     .stall_s = 0.2,
                                     .backward = true,
                                     .timed = true,
                                     .call_s = 1,
                                     .ready_s = 1,
                                     .release_s = 2};
  ReportSnapshot::ProfiledMoment untimed{.stall_s = 0.05};
  s.profile.moments = {fwd, bwd, untimed};
  s.profile.events = {
      // NVMe reads overlap: [0, 1] and [0.5, 2] are busy 2 s together, [3, 4] one more.
      Span(Track::kNvmeRead, 0.5, 1.5, 300), Span(Track::kNvmeRead, 0, 1, 100),
      Span(Track::kNvmeRead, 3, 1, 200),
      // A span inside another adds nothing.
      Span(Track::kH2D, 0, 2, 1000), Span(Track::kH2D, 0.5, 0.5, 1000),
      // CPU Adam: lane 0 is the chunk's span, lanes 1.. its threads (not counted again).
      Span(Track::kOptimizer, 5, 0.75, 0), Span(Track::kOptimizer, 5, 0.7, 0, /*lane=*/1)};
  s.profile.events[5].chunk = 0;
  s.profile.events[6].chunk = 0;
  TimelineEvent norm = Span(Track::kOptimizer, 4.9, 0.25, 0);
  norm.name = "gradient norm";
  s.profile.events.push_back(norm);
  // The first step's rate probe: neither Adam nor a wait for NVMe.
  TimelineEvent probe = Span(Track::kOptimizer, 4.6, 0.3, 0);
  probe.name = kRateProbeSpan;
  s.profile.events.push_back(probe);
  return s;
}

TEST(ReportJsonTest, DerivedFiguresMatchHandComputedValues) {
  const json r = json::parse(BuildReportJson(Snapshot()));
  const json& links = r["profile"]["links"];
  EXPECT_DOUBLE_EQ(links["nvme_read"]["busy_seconds"].get<double>(), 3.0);
  EXPECT_EQ(links["nvme_read"]["bytes"].get<uint64_t>(), 600u);
  EXPECT_DOUBLE_EQ(links["nvme_read"]["bytes_per_second"].get<double>(), 200.0);
  EXPECT_DOUBLE_EQ(links["h2d"]["busy_seconds"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(links["d2h"]["bytes_per_second"].get<double>(), 0.0);  // no spans: no rate
  const json& b = r["profile"]["breakdown"];
  EXPECT_DOUBLE_EQ(b["forward_seconds"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(b["backward_seconds"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(b["parameter_wait_seconds"].get<double>(), 0.25);
  EXPECT_NEAR(b["stall_seconds"].get<double>(), 0.35, 1e-12);
  EXPECT_DOUBLE_EQ(b["optimizer_compute_seconds"].get<double>(), 0.75);
  EXPECT_DOUBLE_EQ(b["optimizer_rate_probe_seconds"].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(b["optimizer_io_wait_seconds"].get<double>(), 2.0 - 0.25 - 0.75 - 0.3);
  const json& m0 = r["profile"]["moments"][0];
  EXPECT_EQ(m0["device"]["free_bytes"].get<uint64_t>(), 300u);  // 1000 - 600 - 100
  EXPECT_EQ(r["profile"]["moments"][1]["device"]["free_bytes"].get<uint64_t>(), 0u);  // over
  EXPECT_EQ(m0["host"]["free_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(m0["nvme"]["free_bytes"].get<uint64_t>(), 5000u);
  EXPECT_EQ(r["optimizer"]["sub_groups"][1]["bytes"].get<uint64_t>(), 120u);  // 10 x 12 B
  EXPECT_EQ(r["optimizer"]["sub_groups"][1]["tier"].get<std::string>(), "nvme");
  EXPECT_EQ(r["profile"]["events"].size(), 9u);
}

// Note [The compute stream's idle time]: the gaps between the merged compute spans, nested
// scopes counted once, untimed moments left out.
TEST(ReportJsonTest, ComputeIdleIsTheGapsBetweenMergedSpans) {
  ReportSnapshot s = Snapshot();
  auto moment = [](double ready, double release) {
    return ReportSnapshot::ProfiledMoment{.timed = true, .ready_s = ready, .release_s = release};
  };
  // [0, 1], a scope nested in it [0.2, 0.4], a gap of 0.5, [1.5, 2], a gap of 0.25, [2.25, 3]
  // with [2.5, 4] overlapping its end, then a moment not timed (no span) and one never released.
  ReportSnapshot::ProfiledMoment open = moment(5, -1);
  s.profile.moments = {
      moment(0, 1), moment(0.2, 0.4), moment(1.5, 2), moment(2.25, 3), moment(2.5, 4), {}, open};
  const json r = json::parse(BuildReportJson(s));
  const json& b = r["profile"]["breakdown"];
  EXPECT_NEAR(b["compute_idle_seconds"].get<double>(), 0.75, 1e-12);
  EXPECT_NEAR(b["compute_span_seconds"].get<double>(), 4.0, 1e-12);  // [0, 4]
  EXPECT_NEAR(b["largest_compute_idle_seconds"].get<double>(), 0.5, 1e-12);
  EXPECT_EQ(b["largest_compute_idle_moment"].get<int64_t>(), 2);
  auto summary = ReportSummary(BuildReportJson(s));
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  EXPECT_NE(summary->find("compute stream idle between moments: 750.00 ms (18.8%"),
            std::string::npos)
      << *summary;
  EXPECT_NE(summary->find("before moment 2"), std::string::npos) << *summary;

  // One span: nothing idle, no largest gap named.
  s.profile.moments = {moment(0, 1)};
  const json one = json::parse(BuildReportJson(s));
  EXPECT_EQ(one["profile"]["breakdown"]["compute_idle_seconds"].get<double>(), 0.0);
  EXPECT_FALSE(one["profile"]["breakdown"].contains("largest_compute_idle_moment"));
}

TEST(ReportJsonTest, WithoutAProfileTheRenderingsSaySo) {
  ReportSnapshot s = Snapshot();
  s.profile = {};
  const std::string text = BuildReportJson(s);
  EXPECT_FALSE(json::parse(text)["profile"]["available"].get<bool>());
  EXPECT_TRUE(ReportSummary(text).ok());
  const Status trace = WriteChromeTrace(text, ::testing::TempDir() + "/trace.json");
  EXPECT_EQ(trace.code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tierzero

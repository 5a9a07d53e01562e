// Compressed optimizer states through the engine (engine.optimizer_states): with bf16 and 8-bit
// moments every tier and every way of updating gives the same losses bit for bit (states and
// parameters resident on the device, groups streamed to it, in host memory, on NVMe), training
// stays within reach of fp32 moments, a resume continues with the very losses of an
// uninterrupted run, a checkpoint holds the moments in the run's format and loads into a run of
// another, and the groups take the bytes the format says.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "small_model.h"
#include "tierzero/engine.h"

namespace tierzero {
namespace {

using testing_models::Make;
using testing_models::ReadAllParams;
using testing_models::TempDir;
using testing_models::Train;
using testing_models::Trainer;

EngineConfig Base() { return testing_models::SmallEngineConfig(DeviceChoice::kHost); }

class MomentFormatTest : public ::testing::TestWithParam<MomentFormat> {};
INSTANTIATE_TEST_SUITE_P(Formats, MomentFormatTest,
                         ::testing::Values(MomentFormat::kBF16, MomentFormat::kInt8),
                         [](const auto& info) {
                           return info.param == MomentFormat::kBF16 ? "bf16" : "int8";
                         });

TEST_P(MomentFormatTest, EveryTierGivesTheSameLossesAndFp32IsWithinReach) {
  TempDir dir;
  EngineConfig resident = Base();
  resident.device_shard_budget = uint64_t{64} << 20;
  EngineConfig host = Base();
  EngineConfig streamed = Base();
  streamed.optimizer = OptimizerPlacement::kFraction;
  streamed.optimizer_device_fraction = 0.5;
  EngineConfig nvme = Base();
  nvme.host_budget = uint64_t{1536} << 10;  // less than the states: NVMe takes the rest
  nvme.nvme_budget = uint64_t{128} << 20;
  nvme.nvme_path = dir.path();
  std::vector<std::vector<double>> losses;
  const EngineConfig configs[] = {resident, host, nvme, streamed};
  for (int i = 0; i < 4; ++i) {
    EngineConfig ec = configs[i];
    ec.optimizer_states = GetParam();
    Trainer r = Make(ec);
    losses.push_back(Train(r, 0, 30));
    const EngineStats st = r.engine->stats();
    if (i == 0) {
      EXPECT_GT(st.optimizer_resident_groups, 0) << r.engine->PlacementSummary();
    } else if (i == 2) {
      EXPECT_GT(r.engine->usage().nvme, 0u) << r.engine->PlacementSummary();
    } else if (i == 3) {
      EXPECT_GT(st.optimizer_streamed_groups, 0);
    }
  }
  EngineConfig fp32 = host;
  Trainer ref = Make(fp32);
  const std::vector<double> want = Train(ref, 0, 30);
  ASSERT_EQ(losses[0].size(), 30u);
  for (size_t i = 0; i < 30; ++i) {
    EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i << " resident vs host";
    EXPECT_EQ(losses[0][i], losses[2][i]) << "step " << i << " resident vs NVMe";
    EXPECT_EQ(losses[0][i], losses[3][i]) << "step " << i << " resident vs streamed";
  }
  // The same training, the moments' rounding aside: the last five losses within 2% of fp32's.
  double got = 0, ref_sum = 0;
  for (size_t i = 25; i < 30; ++i) {
    got += losses[1][i];
    ref_sum += want[i];
  }
  EXPECT_NEAR(got / ref_sum, 1.0, 0.02);
  EXPECT_LT(losses[1].back(), losses[1].front() * 0.8);
}

TEST_P(MomentFormatTest, ResumeIsExactAndCheckpointsConvertBetweenFormats) {
  TempDir dir;
  EngineConfig ec = Base();
  ec.optimizer_states = GetParam();
  ec.host_budget = uint64_t{1536} << 10;
  ec.nvme_budget = uint64_t{128} << 20;
  ec.nvme_path = dir.path() + "/nvme";
  std::filesystem::create_directories(ec.nvme_path);
  std::vector<double> straight, resumed;
  {
    Trainer r = Make(ec);
    straight = Train(r, 0, 12);
  }
  {
    Trainer r = Make(ec);
    resumed = Train(r, 0, 6);
    ASSERT_TRUE(r.engine->SaveCheckpoint(dir.path() + "/ckpt", "{}").ok());
  }
  {
    Trainer r = Make(ec);
    auto user = r.engine->LoadCheckpoint(dir.path() + "/ckpt");
    ASSERT_TRUE(user.ok()) << user.status().ToString();
    std::vector<double> rest = Train(r, 6, 12);
    resumed.insert(resumed.end(), rest.begin(), rest.end());
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i;

  // This format's checkpoint into fp32 moments, and an fp32 one into this format: both load and
  // go on training where they were (the next loss is the straight run's, near enough).
  EngineConfig other = Base();
  {
    Trainer r = Make(other);
    ASSERT_TRUE(r.engine->LoadCheckpoint(dir.path() + "/ckpt").ok());
    const std::vector<double> rest = Train(r, 6, 12);
    ASSERT_EQ(rest.size(), 6u);
    EXPECT_EQ(rest[0], straight[6]);  // the parameters are the checkpoint's, bit for bit
    EXPECT_NEAR(rest[5], straight[11], 0.02 * straight[11]);
    ASSERT_TRUE(r.engine->SaveCheckpoint(dir.path() + "/fp32", "{}").ok());
  }
  // The states files hold the moments as the run did: 12 bytes an element in fp32, 8 in bf16,
  // ~6.1 in 8-bit codes.
  auto states_bytes = [&](const std::string& d) {
    uint64_t total = 0;
    for (const auto& f : std::filesystem::directory_iterator(d))
      if (f.path().filename().string().rfind("states-", 0) == 0) total += f.file_size();
    return static_cast<double>(total);
  };
  const double ratio = states_bytes(dir.path() + "/ckpt") / states_bytes(dir.path() + "/fp32");
  EXPECT_NEAR(ratio, GetParam() == MomentFormat::kBF16 ? 8.0 / 12 : 6.13 / 12, 0.01);
  {
    Trainer r = Make(ec);
    ASSERT_TRUE(r.engine->LoadCheckpoint(dir.path() + "/fp32").ok());
    const std::vector<double> rest = Train(r, 12, 14);
    ASSERT_EQ(rest.size(), 2u);
    EXPECT_TRUE(std::isfinite(rest[1]));
  }
}

TEST_P(MomentFormatTest, TheGroupsTakeTheFormatsBytes) {
  // Everything in host memory: the host tier holds the gradients and parameter shards (2 bytes an
  // element each, bf16) and the groups, which shrink from 12 bytes an element to 8 (bf16) or
  // ~6.1 (8-bit); the fixed buffers shrink with the swap slots.
  EngineConfig fp32 = Base();
  EngineConfig packed = Base();
  packed.optimizer_states = GetParam();
  Trainer a = Make(fp32), b = Make(packed);
  const double ha = static_cast<double>(a.engine->usage().host);
  const double hb = static_cast<double>(b.engine->usage().host);
  const double per = GetParam() == MomentFormat::kBF16 ? 8.0 : 6.2;
  EXPECT_LT(hb, ha);
  // The states' share: (ha - fixed) = elems x 16 against (hb - fixed) = elems x (4 + per) at
  // most; the fixed buffers only make the ratio closer to 1.
  EXPECT_LT(hb / ha, 1.0 - (12.0 - per) / 16.0 * 0.5);
}

// Note [An engine that never steps]: a checkpoint of any format loads into an engine without
// moments (its groups on the host or on NVMe), whose parameters, evaluations and export are the
// fp32-moment engine's to the bit, in 4 bytes an element of optimizer state; what would need the
// moments is refused by name, and the refusals change nothing.
TEST(WithoutMomentsTest, LoadsEvaluatesAndExportsAsAnyFormatAndRefusesToStep) {
  TempDir dir;
  for (MomentFormat saved : {MomentFormat::kF32, MomentFormat::kInt8}) {
    SCOPED_TRACE(saved == MomentFormat::kF32 ? "an fp32 checkpoint" : "an int8 checkpoint");
    const std::string ckpt = dir.path() + (saved == MomentFormat::kF32 ? "/f32" : "/int8");
    {
      EngineConfig ec = Base();
      ec.optimizer_states = saved;
      Trainer r = Make(ec);
      Train(r, 0, 4);
      ASSERT_TRUE(r.engine->SaveCheckpoint(ckpt, "{}").ok());
    }
    EngineConfig with = Base();
    EngineConfig host = Base();
    host.optimizer_states = MomentFormat::kNone;
    EngineConfig nvme = host;
    nvme.host_budget = uint64_t{1} << 20;
    nvme.nvme_budget = uint64_t{64} << 20;
    nvme.nvme_path = dir.path();
    Trainer ref = Make(with);
    ASSERT_TRUE(ref.engine->LoadCheckpoint(ckpt).ok());
    const auto want = ReadAllParams(*ref.engine);
    gpt::Batch batch = ref.data->Get(true, 3, 8);
    auto want_loss = ref.model->Evaluate(batch, nullptr);
    ASSERT_TRUE(want_loss.ok()) << want_loss.status().ToString();
    ASSERT_TRUE(ref.engine->ExportSafetensors(dir.path() + "/want.st", DType::kF32).ok());
    for (const EngineConfig& ec : {host, nvme}) {
      Trainer r = Make(ec);
      auto user = r.engine->LoadCheckpoint(ckpt);
      ASSERT_TRUE(user.ok()) << user.status().ToString();
      if (ec.nvme_budget > 0) {
        EXPECT_GT(r.engine->usage().nvme, 0u) << r.engine->PlacementSummary();
      }
      EXPECT_EQ(ReadAllParams(*r.engine), want);
      auto loss = r.model->Evaluate(batch, nullptr);
      ASSERT_TRUE(loss.ok()) << loss.status().ToString();
      EXPECT_EQ(*loss, *want_loss);
      ASSERT_TRUE(r.engine->ExportSafetensors(dir.path() + "/got.st", DType::kF32).ok());
      std::ifstream a(dir.path() + "/want.st", std::ios::binary),
          b(dir.path() + "/got.st", std::ios::binary);
      EXPECT_TRUE(
          std::equal(std::istreambuf_iterator<char>(a), {}, std::istreambuf_iterator<char>(b), {}));
      // Refused by name, and nothing changed by the refusals.
      std::vector<float> grad(r.engine->numel(0));
      for (Status s : {r.engine->BeginIteration(true), r.engine->PrepareStep({1e-3f}),
                       r.engine->Step({1e-3f}).status(), r.engine->ReadGrad(0, grad),
                       r.engine->SaveCheckpoint(dir.path() + "/none", "{}")}) {
        EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
        EXPECT_NE(std::string(s.message()).find("without optimizer moments"), std::string::npos)
            << s.ToString();
      }
      EXPECT_FALSE(std::filesystem::exists(dir.path() + "/none"));
      EXPECT_EQ(ReadAllParams(*r.engine), want);
      auto again = r.model->Evaluate(batch, nullptr);
      ASSERT_TRUE(again.ok()) << again.status().ToString();
      EXPECT_EQ(*again, *want_loss);
    }
  }
  // The groups hold the master alone and there are no gradient shards: fp32 moments' m and v
  // take 8 bytes an element more of the host tier, and a gradient shard the compute type's
  // bytes (at least: their swap slots shrink too).
  EngineConfig fp32 = Base();
  EngineConfig none = Base();
  none.optimizer_states = MomentFormat::kNone;
  Trainer a = Make(fp32), b = Make(none);
  uint64_t elems = 0;
  for (ParamId p = 0; p < a.engine->num_params(); ++p) elems += a.engine->numel(p);
  EXPECT_GE(a.engine->usage().host - b.engine->usage().host,
            (8 + DTypeBytes(fp32.compute_dtype, 1)) * elems);
  EXPECT_NE(b.engine->PlacementSummary().find("0 grad shards"), std::string::npos)
      << b.engine->PlacementSummary();
  auto report = b.engine->ReportJson();
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const nlohmann::json parsed = nlohmann::json::parse(*report);
  for (const auto& c : parsed["layout"]["chunks"]) EXPECT_EQ(c["grad_tier"], "none");
}

}  // namespace
}  // namespace tierzero

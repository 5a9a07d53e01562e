// Gpt::DeriveTrace against the trace the engine records in a real warm-up iteration: the same
// moments, parameters, and activation bytes and peaks, with and without activation
// checkpointing, for fp32 and bf16 parameters and activations (Note [Activation types]: widened
// weights, gradients in place or in buffers).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>

#include "gpt/gpt.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

Batch RandomBatch(int B, int T, int V, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  Batch b;
  b.batch = B;
  b.seq = T;
  for (int i = 0; i < B * T; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(V)));
    b.targets.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(V)));
    b.mask.push_back(1.0f);
  }
  return b;
}

// Activation checkpointing, the compute dtype, the activations' type, the architecture.
using TraceCase = std::tuple<bool, DType, Activations, Arch>;
class GptTraceTest : public ::testing::TestWithParam<TraceCase> {};

TEST_P(GptTraceTest, DerivedTraceEqualsRecordedTrace) {
  GptConfig mc;
  mc.vocab = 37;
  mc.seq_len = 7;
  mc.d_model = 24;
  mc.n_head = 3;
  mc.n_layer = 3;
  if (std::get<3>(GetParam()) == Arch::kLlama) {
    mc = AsLlama(mc);
    mc.n_head = 4;  // heads 6 wide: rotary pairs
    mc.n_kv_head = 2;
    mc.d_ff = 40;
  }
  mc.activation_checkpointing = std::get<0>(GetParam());
  mc.activations = std::get<2>(GetParam());
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  ec.compute_dtype = std::get<1>(GetParam());
  auto engine = Engine::Create(ec);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto model = Gpt::Create(**engine, mc);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const int B = 5;
  auto derived = (*model)->DeriveTrace(B);
  ASSERT_TRUE(derived.ok()) << derived.status().ToString();
  ASSERT_TRUE((*engine)->Finalize().ok());
  EXPECT_FALSE((*engine)->RecordedTrace().ok());  // before the first iteration
  ASSERT_TRUE((*model)->ForwardBackward(RandomBatch(B, mc.seq_len, mc.vocab, 1)).ok());
  auto recorded = (*engine)->RecordedTrace();
  ASSERT_TRUE(recorded.ok()) << recorded.status().ToString();
  ASSERT_EQ(derived->params.size(), recorded->params.size());
  for (size_t i = 0; i < derived->params.size(); ++i) {
    EXPECT_EQ(derived->params[i].name, recorded->params[i].name);
    EXPECT_EQ(derived->params[i].shape, recorded->params[i].shape);
  }
  ASSERT_EQ(derived->moments.size(), static_cast<size_t>(2 * mc.n_layer + 4));
  ASSERT_EQ(derived->moments.size(), recorded->moments.size());
  for (size_t k = 0; k < derived->moments.size(); ++k) {
    const TraceMoment& d = derived->moments[k];
    const TraceMoment& r = recorded->moments[k];
    EXPECT_EQ(d.params, r.params) << "moment " << k;
    EXPECT_EQ(d.backward, r.backward) << "moment " << k;
    EXPECT_EQ(d.activation_bytes, r.activation_bytes) << "moment " << k;
    EXPECT_EQ(d.activation_peak, r.activation_peak) << "moment " << k;
    EXPECT_GT(r.compute_seconds, 0) << "moment " << k;
    EXPECT_GT(d.memory_bytes, 0) << "moment " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GptTraceTest,
    ::testing::Combine(::testing::Bool(), ::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(Activations::kF32, Activations::kBF16),
                       ::testing::Values(Arch::kGpt2, Arch::kLlama)),
    [](const auto& info) {
      return std::string(ArchName(std::get<3>(info.param))) + "_" +
             std::string(std::get<0>(info.param) ? "Checkpointed" : "Kept") + "_" +
             std::string(DTypeName(std::get<1>(info.param))) + "Params_" +
             ActivationsName(std::get<2>(info.param)) + "Activations";
    });

}  // namespace
}  // namespace tierzero::gpt

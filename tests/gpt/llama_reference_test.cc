// The Llama family through the engine against an independent fp64 reimplementation of Hugging
// Face's LlamaForCausalLM (llama_reference.h): the loss, and every gradient against central finite
// differences of the reference loss; grouped-query attention with an untied head and no biases,
// and multi-head attention with a tied head and attention biases, with and without activation
// checkpointing.
#include "llama_reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gpt/gpt.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

struct Case {
  int kv_heads;
  bool tied, bias, checkpointing;
};

class LlamaReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(LlamaReferenceTest, ForwardAndBackwardMatchFp64Reference) {
  const Case cs = GetParam();
  GptConfig mc;
  mc.vocab = 13;
  mc.seq_len = 5;
  mc.d_model = 16;  // heads 4 wide: two rotary frequencies
  mc.n_layer = 2;
  mc.n_head = 4;
  mc.seed = 3;
  mc = AsLlama(mc);
  mc.n_kv_head = cs.kv_heads;
  mc.d_ff = 12;
  mc.tie_embeddings = cs.tied;
  mc.attention_bias = cs.bias;
  mc.rope_theta = 500000.0;
  mc.norm_eps = 1e-6;
  mc.activation_checkpointing = cs.checkpointing;
  EngineConfig ec;
  ec.device = DeviceChoice::kHost;
  ec.compute_dtype = DType::kF32;
  ec.chunk_elems = 1024;  // several chunks
  auto engine = Engine::Create(ec);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto model = Gpt::Create(**engine, mc);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  ASSERT_TRUE((*engine)->Finalize().ok());
  Params params = RandomParams(**engine, 11);
  ASSERT_FALSE(params.empty());
  // Hugging Face's names, as a checkpoint holds them.
  EXPECT_EQ(params.count("model.layers.1.self_attn.k_proj.weight"), 1u);
  EXPECT_EQ(params.count("lm_head.weight"), cs.tied ? 0u : 1u);
  EXPECT_EQ(params.count("model.layers.0.self_attn.q_proj.bias"), cs.bias ? 1u : 0u);
  EXPECT_EQ(params["model.layers.0.self_attn.k_proj.weight"].size(),
            static_cast<size_t>(cs.kv_heads * 4 * 16));
  Batch batch;
  batch.batch = 2;
  batch.seq = 5;
  batch.tokens = {1, 4, 2, 9, 0, 3, 3, 12, 7, 5};
  batch.targets = {4, 2, 9, 0, 6, 3, 10, 7, 5, 11};
  batch.mask = {1, 1, 0, 1, 1, 1, 1, 1, 0, 1};
  auto loss = (*model)->ForwardBackward(batch);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  LlamaRef ref{mc.vocab, mc.seq_len,    mc.d_model,  mc.n_layer, mc.n_head, cs.kv_heads,
               mc.ffn(), mc.rope_theta, mc.norm_eps, cs.tied,    cs.bias,   params};
  const double ref_loss = ref.Loss(batch);
  EXPECT_NEAR(*loss, ref_loss, 1e-5 * std::abs(ref_loss));

  ExpectGradientsMatch(**engine, params, [&] { return ref.Loss(batch); });
}

INSTANTIATE_TEST_SUITE_P(Shapes, LlamaReferenceTest,
                         ::testing::Values(Case{2, false, false, false},
                                           Case{2, false, false, true}, Case{4, true, true, false},
                                           Case{1, false, true, true}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "kv" + std::to_string(c.kv_heads) +
                                  (c.tied ? "_tied" : "_untied") + (c.bias ? "_bias" : "") +
                                  (c.checkpointing ? "_checkpointed" : "");
                         });

}  // namespace
}  // namespace tierzero::gpt

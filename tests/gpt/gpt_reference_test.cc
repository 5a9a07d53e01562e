// The GPT through the engine against an independent fp64 reference: a straightforward forward
// pass written from the GPT-2 definition (gpt_reference.h), and its gradients by central finite
// differences.
#include "gpt_reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "gpt/gpt.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {
namespace {

TEST(GptReference, ForwardAndBackwardMatchFp64Reference) {
  GptConfig mc;
  mc.vocab = 11;
  mc.seq_len = 5;
  mc.d_model = 8;
  mc.n_layer = 2;
  mc.n_head = 2;
  mc.seed = 3;
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
  Batch batch;
  batch.batch = 2;
  batch.seq = 5;
  batch.tokens = {1, 4, 2, 9, 0, 3, 3, 10, 7, 5};
  batch.targets = {4, 2, 9, 0, 6, 3, 10, 7, 5, 8};
  batch.mask = {1, 1, 0, 1, 1, 1, 1, 1, 0, 1};
  auto loss = (*model)->ForwardBackward(batch);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  Ref ref{mc.vocab, mc.seq_len, mc.d_model, mc.n_layer, mc.n_head, params};
  const double ref_loss = ref.Loss(batch);
  EXPECT_NEAR(*loss, ref_loss, 1e-5 * std::abs(ref_loss));

  // Every gradient element against central differences of the reference loss.
  ExpectGradientsMatch(**engine, params, [&] { return ref.Loss(batch); });
}

}  // namespace
}  // namespace tierzero::gpt

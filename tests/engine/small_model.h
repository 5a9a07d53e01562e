// The small GPT and engine configuration the engine tests train (engine_test.cc,
// engine_faults_test.cc): three layers of width 64, 8 MiB of device budget, chunks of 16384.
#pragma once

#include "gpt/gpt.h"
#include "tierzero/engine.h"

namespace tierzero::testing_models {

inline gpt::GptConfig SmallModel() {
  gpt::GptConfig m;
  m.seq_len = 12;
  m.d_model = 64;
  m.n_layer = 3;
  m.n_head = 4;
  return m;
}

inline EngineConfig SmallEngineConfig(DeviceChoice device) {
  EngineConfig ec;
  ec.device = device;
  ec.device_budget = uint64_t{8} << 20;
  ec.chunk_elems = 16384;
  ec.host_budget = uint64_t{256} << 20;
  return ec;
}

}  // namespace tierzero::testing_models

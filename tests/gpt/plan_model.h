// The small GPT that the plan's tests (plan_fit_test, plan_report_test) plan and then run.
#pragma once

#include "gpt/gpt.h"

namespace tierzero::gpt {

inline GptConfig PlanTestModel() {
  GptConfig mc;
  mc.vocab = 256;
  mc.seq_len = 16;
  mc.d_model = 128;
  mc.n_head = 4;
  mc.n_layer = 3;
  return mc;
}

}  // namespace tierzero::gpt

// The small GPT and engine configuration the engine tests train (engine_test.cc,
// engine_faults_test.cc): three layers of width 64, 8 MiB of device budget, chunks of 16384.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "gpt/data.h"
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

// The simulated device, or the GPU when TZ_TEST_DEVICE=cuda (the GPU machine's run, docs/gpu.md:
// the same tests then drive the CUDA engine and the GPT's CUDA ops).
inline DeviceChoice TestDevice() {
  const char* d = std::getenv("TZ_TEST_DEVICE");
  return d != nullptr && std::string(d) == "cuda" ? DeviceChoice::kCuda : DeviceChoice::kHost;
}

// The small engine on the test device.
inline EngineConfig TestEngineConfig() { return SmallEngineConfig(TestDevice()); }

// A small Llama (grouped-query attention, untied head) of the small model's size, heads 32 wide
// (what the GPU's fused attention takes).
inline gpt::GptConfig SmallLlama() {
  gpt::GptConfig m = gpt::AsLlama(SmallModel());
  m.n_head = 2;
  m.n_kv_head = 1;
  return m;
}

// A model, its engine and its data (the tests' trainer).
struct Trainer {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<gpt::Gpt> model;
  std::unique_ptr<gpt::Dataset> data;
};

inline Trainer Make(const EngineConfig& ec, const gpt::GptConfig& mc = SmallModel()) {
  Trainer r;
  auto e = Engine::Create(ec);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  r.engine = std::move(e).value();
  auto m = gpt::Gpt::Create(*r.engine, mc);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  r.model = std::move(m).value();
  Status s = r.engine->Finalize();
  EXPECT_TRUE(s.ok()) << s.ToString();
  gpt::DataConfig dc;
  r.data = std::move(gpt::Dataset::Create(dc, mc.seq_len)).value();
  return r;
}

// Steps [from, to): one micro-batch each (batch index = step), returns the losses.
inline std::vector<double> Train(Trainer& r, int from, int to, int batch = 8) {
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    for (int micro = 0; micro < r.engine->config().grad_accumulation; ++micro) {
      gpt::Batch b = r.data->Get(false, static_cast<uint64_t>(s * 16 + micro), batch);
      auto l = r.model->ForwardBackward(b);
      EXPECT_TRUE(l.ok()) << l.status().ToString();
      if (!l.ok()) return losses;
      if (micro == 0) losses.push_back(*l);
    }
    auto st = r.engine->Step({1e-3f});
    EXPECT_TRUE(st.ok()) << st.status().ToString();
  }
  return losses;
}

// Every parameter's fp32 values, in id order (ReadParam; a failed read fails the test).
inline std::vector<std::vector<float>> ReadAllParams(Engine& e) {
  std::vector<std::vector<float>> out;
  for (ParamId p = 0; p < e.num_params(); ++p) {
    std::vector<float> v(static_cast<size_t>(e.numel(p)));
    Status s = e.ReadParam(p, v);
    EXPECT_TRUE(s.ok()) << s.ToString();
    out.push_back(std::move(v));
  }
  return out;
}

// A fresh directory under the system's temporary one (mkdtemp), removed with its contents.
class TempDir {
 public:
  explicit TempDir(const char* prefix = "tz_engine") {
    std::string t =
        (std::filesystem::temp_directory_path() / (std::string(prefix) + "_XXXXXX")).string();
    path_ = mkdtemp(t.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace tierzero::testing_models

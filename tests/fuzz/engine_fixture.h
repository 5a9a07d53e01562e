// A small engine for the fuzz targets that load files into one (checkpoints, safetensors): three
// parameters in two chunks, host only, made once per process, with a checkpoint and a safetensors
// export of its initial values to load good files from.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "tierzero/engine.h"

namespace tierzero::fuzz {

class EngineFixture {
 public:
  static EngineFixture& Get() {
    static EngineFixture* f = new EngineFixture();  // never destroyed: used until exit
    return *f;
  }

  Engine& engine() { return *engine_; }
  const std::string& checkpoint_dir() const { return ckpt_; }
  const std::string& safetensors_path() const { return st_; }

  // Every parameter's values, in registration order.
  std::vector<std::vector<float>> Values() {
    std::vector<std::vector<float>> out;
    for (size_t i = 0; i < ids_.size(); ++i) {
      std::vector<float> v(numel_[i]);
      FUZZ_CHECK(engine_->ReadParam(ids_[i], v).ok(), "ReadParam failed");
      out.push_back(std::move(v));
    }
    return out;
  }
  const std::vector<std::vector<float>>& initial() const { return initial_; }

 private:
  EngineFixture() {
    EngineConfig ec;
    ec.device = DeviceChoice::kHost;
    ec.device_budget = uint64_t{4} << 20;
    ec.host_budget = uint64_t{64} << 20;
    ec.chunk_elems = 64;
    auto e = Engine::Create(ec);
    FUZZ_CHECK(e.ok(), "engine: %s", e.status().ToString().c_str());
    engine_ = std::move(*e);
    const std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
        {"wte", {8, 4}}, {"h.0.w", {4, 6}}, {"ln.b", {6}}};
    for (size_t i = 0; i < specs.size(); ++i) {
      ParamSpec ps;
      ps.name = specs[i].first;
      ps.shape = specs[i].second;
      ps.init = InitNormal(0.5f, 7 + i);
      auto id = engine_->RegisterParam(ps);
      FUZZ_CHECK(id.ok(), "register: %s", id.status().ToString().c_str());
      ids_.push_back(*id);
      size_t n = 1;
      for (int64_t d : ps.shape) n *= static_cast<size_t>(d);
      numel_.push_back(n);
    }
    Status s = engine_->Finalize();
    FUZZ_CHECK(s.ok(), "finalize: %s", s.ToString().c_str());
    ckpt_ = ScratchDir() + "/good-checkpoint";
    s = engine_->SaveCheckpoint(ckpt_, R"({"trainer":1})");
    FUZZ_CHECK(s.ok(), "save: %s", s.ToString().c_str());
    st_ = ScratchDir() + "/good.safetensors";
    s = engine_->ExportSafetensors(st_, DType::kF32);
    FUZZ_CHECK(s.ok(), "export: %s", s.ToString().c_str());
    initial_ = Values();
    // Seeds for the corpus (tests/fuzz/README.md): the good files this engine wrote.
    if (const char* seeds = std::getenv("TZ_FUZZ_SEED_DIR")) {
      namespace fs = std::filesystem;
      fs::copy_file(ckpt_ + "/manifest.json", fs::path(seeds) / "manifest.json",
                    fs::copy_options::overwrite_existing);
      fs::copy_file(st_, fs::path(seeds) / "good.safetensors",
                    fs::copy_options::overwrite_existing);
    }
  }

  std::unique_ptr<Engine> engine_;
  std::vector<ParamId> ids_;
  std::vector<size_t> numel_;
  std::string ckpt_, st_;
  std::vector<std::vector<float>> initial_;
};

}  // namespace tierzero::fuzz

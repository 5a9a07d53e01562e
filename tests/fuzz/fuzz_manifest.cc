// Fuzz target: a checkpoint's manifest.json (Engine::LoadCheckpoint, `train --resume`). The input
// replaces the manifest of a good checkpoint whose states file stays as saved. Properties: no
// crash or exception; a manifest that is refused leaves every parameter as it was.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "engine_fixture.h"
#include "offload/crc32c.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::EngineFixture& f = fuzz::EngineFixture::Get();
  // Note [The manifest's own checksum] stops nearly every mutated manifest before its fields are
  // read: for half of the inputs (odd sizes) that carry one, it is recomputed over the mutated
  // content, so the parsing behind it is fuzzed too.
  std::string text(reinterpret_cast<const char*>(data), size);
  if (size % 2 == 1) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("manifest_crc32c")) {
      j.erase("manifest_crc32c");
      const std::string compact = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      j["manifest_crc32c"] = Crc32c(compact.data(), compact.size());
      text = j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
  }
  fuzz::WriteFile(f.checkpoint_dir() + "/manifest.json",
                  reinterpret_cast<const uint8_t*>(text.data()), text.size());
  auto loaded = f.engine().LoadCheckpoint(f.checkpoint_dir());
  if (!loaded.ok()) {
    FUZZ_CHECK(f.Values() == f.initial(), "a refused manifest changed the parameters: %s",
               loaded.status().ToString().c_str());
  } else if (f.Values() != f.initial()) {
    // The manifest names the same data another way (two same-shaped tensors swapped, say):
    // legitimate, and put back for the next input from the safetensors export.
    Status s = f.engine().LoadSafetensors(f.safetensors_path());
    FUZZ_CHECK(s.ok(), "restore: %s", s.ToString().c_str());
  }
  return 0;
}

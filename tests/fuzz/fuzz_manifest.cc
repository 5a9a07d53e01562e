// Fuzz target: a checkpoint's manifest.json (Engine::LoadCheckpoint, `train --resume`). The input
// replaces the manifest of a good checkpoint whose states file stays as saved. Properties: no
// crash or exception; a manifest that is refused leaves every parameter as it was.
#include <filesystem>
#include <string>

#include "engine_fixture.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::EngineFixture& f = fuzz::EngineFixture::Get();
  fuzz::WriteFile(f.checkpoint_dir() + "/manifest.json", data, size);
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

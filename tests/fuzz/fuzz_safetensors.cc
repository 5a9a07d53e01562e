// Fuzz target: a safetensors file (Engine::LoadSafetensors, `train --init-from`): the header
// length, the JSON header and the data. Properties: no crash or exception; a file that is refused
// leaves every parameter as it was.
#include <string>

#include "engine_fixture.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::EngineFixture& f = fuzz::EngineFixture::Get();
  const std::string path = fuzz::ScratchDir() + "/input.safetensors";
  fuzz::WriteFile(path, data, size);
  const Status s = f.engine().LoadSafetensors(path);
  if (!s.ok()) {
    FUZZ_CHECK(f.Values() == f.initial(), "a refused file changed the parameters: %s",
               s.ToString().c_str());
  } else if (f.Values() != f.initial()) {
    const Status r = f.engine().LoadSafetensors(f.safetensors_path());
    FUZZ_CHECK(r.ok(), "restore: %s", r.ToString().c_str());
  }
  return 0;
}

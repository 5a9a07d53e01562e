// Binds cuBLAS at run time (gpt/cublas_api.h).
#include "gpt/cublas_api.h"

#include <dlfcn.h>

#include <string>

namespace tierzero::gpt::cuda {
namespace {

// Note [cuBLAS loaded on first use]
// cuBLAS is opened with dlopen when the first CudaOps is made, not linked: merely loading
// libcublasLt maps about 140 MB of resident memory (its zero-initialised data is written at load),
// which every run paid, GPU or not; the default run on the simulated device peaked at about 227 MB
// instead of about 40 MB. The header still gives the types; only these functions are called.

}  // namespace

void* OpenCudaLibrary(const std::string& soname, std::string* tried) {
  for (const std::string& path : {soname, std::string(TZ_CUDA_LIBRARY_DIR "/") + soname}) {
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) return lib;
    const char* why = dlerror();
    *tried += (tried->empty() ? "" : "; ") + path + ": " + (why != nullptr ? why : "not found");
  }
  return nullptr;
}

StatusOr<const CublasApi*> LoadCublas() {
  static const StatusOr<const CublasApi*> api = []() -> StatusOr<const CublasApi*> {
    const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    std::string tried;
    void* lib = OpenCudaLibrary(soname, &tried);
    if (lib == nullptr)
      return UnavailableError("cuBLAS could not be loaded for the GPT's CUDA ops (" + tried +
                              "); put " + soname + " on the loader path (LD_LIBRARY_PATH)");
    auto* a = new CublasApi();
    const bool ok =
        Bind(lib, "cublasCreate_v2", a->Create) && Bind(lib, "cublasDestroy_v2", a->Destroy) &&
        Bind(lib, "cublasSetStream_v2", a->SetStream) &&
        Bind(lib, "cublasSetMathMode", a->SetMathMode) && Bind(lib, "cublasSgemm_v2", a->Sgemm) &&
        Bind(lib, "cublasGemmStridedBatchedEx", a->GemmStridedBatchedEx);
    if (!ok) {
      delete a;
      return UnavailableError(soname + " lacks cuBLAS functions the GPT's CUDA ops need");
    }
    return a;  // kept for the life of the process, as the library is
  }();
  return api;
}

}  // namespace tierzero::gpt::cuda

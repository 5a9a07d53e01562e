// Binds cuBLASLt at run time (gpt/cublaslt_api.h).
#include "gpt/cublaslt_api.h"

#include <dlfcn.h>

#include <string>

#include "gpt/cublas_api.h"

namespace tierzero::gpt::cuda {
StatusOr<const CublasLtApi*> LoadCublasLt() {
  static const StatusOr<const CublasLtApi*> api = []() -> StatusOr<const CublasLtApi*> {
    const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    std::string tried;
    void* lib = OpenCudaLibrary(soname, &tried);
    if (lib == nullptr)
      return UnavailableError("cuBLASLt could not be loaded for the GPT's bf16 CUDA ops (" + tried +
                              "); put " + soname +
                              " on the loader path (LD_LIBRARY_PATH), or run with "
                              "--activations fp32");
    auto* a = new CublasLtApi();
    const bool ok = Bind(lib, "cublasLtCreate", a->Create) &&
                    Bind(lib, "cublasLtDestroy", a->Destroy) &&
                    Bind(lib, "cublasLtMatmulDescCreate", a->MatmulDescCreate) &&
                    Bind(lib, "cublasLtMatmulDescDestroy", a->MatmulDescDestroy) &&
                    Bind(lib, "cublasLtMatmulDescSetAttribute", a->MatmulDescSetAttribute) &&
                    Bind(lib, "cublasLtMatrixLayoutCreate", a->MatrixLayoutCreate) &&
                    Bind(lib, "cublasLtMatrixLayoutDestroy", a->MatrixLayoutDestroy) &&
                    Bind(lib, "cublasLtMatmulPreferenceCreate", a->PreferenceCreate) &&
                    Bind(lib, "cublasLtMatmulPreferenceDestroy", a->PreferenceDestroy) &&
                    Bind(lib, "cublasLtMatmulPreferenceSetAttribute", a->PreferenceSetAttribute) &&
                    Bind(lib, "cublasLtMatmulAlgoGetHeuristic", a->AlgoGetHeuristic) &&
                    Bind(lib, "cublasLtMatmul", a->Matmul);
    if (!ok) {
      delete a;
      return UnavailableError(soname + " lacks cuBLASLt functions the GPT's bf16 CUDA ops need");
    }
    return a;  // kept for the life of the process, as the library is
  }();
  return api;
}

}  // namespace tierzero::gpt::cuda

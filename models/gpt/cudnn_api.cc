// Binds cuDNN at run time (gpt/cudnn_api.h).
#include "gpt/cudnn_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "gpt/cublas_api.h"

namespace tierzero::gpt::cuda {

std::string CudnnApi::Describe(cudnnStatus_t s) const {
  std::string out = GetErrorString(s);
  char buf[1024] = {};
  GetLastErrorString(buf, sizeof(buf));
  if (buf[0] != '\0') out += std::string(": ") + buf;
  return out;
}

StatusOr<const CudnnApi*> LoadCudnn() {
  static const StatusOr<const CudnnApi*> api = []() -> StatusOr<const CudnnApi*> {
    const char* named = std::getenv("TZ_CUDNN_LIBRARY");
    const std::string soname = named != nullptr && *named != '\0' ? named : "libcudnn.so.9";
    std::string tried;
    void* lib = OpenCudaLibrary(soname, &tried);
    if (lib == nullptr)
      return UnavailableError("cuDNN could not be loaded for the GPT's attention (" + tried +
                              "); put libcudnn.so.9 on the loader path (LD_LIBRARY_PATH: the "
                              "CUDA Toolkit's, or PyTorch's nvidia/cudnn/lib) or name it in "
                              "TZ_CUDNN_LIBRARY");
    auto* a = new CudnnApi();
    const bool ok = Bind(lib, "cudnnGetVersion", a->GetVersion) &&
                    Bind(lib, "cudnnCreate", a->Create) && Bind(lib, "cudnnDestroy", a->Destroy) &&
                    Bind(lib, "cudnnSetStream", a->SetStream) &&
                    Bind(lib, "cudnnGetErrorString", a->GetErrorString) &&
                    Bind(lib, "cudnnGetLastErrorString", a->GetLastErrorString) &&
                    Bind(lib, "cudnnBackendCreateDescriptor", a->CreateDescriptor) &&
                    Bind(lib, "cudnnBackendDestroyDescriptor", a->DestroyDescriptor) &&
                    Bind(lib, "cudnnBackendSetAttribute", a->SetAttribute) &&
                    Bind(lib, "cudnnBackendGetAttribute", a->GetAttribute) &&
                    Bind(lib, "cudnnBackendFinalize", a->Finalize) &&
                    Bind(lib, "cudnnBackendExecute", a->Execute);
    if (!ok) {
      delete a;
      return UnavailableError(soname + " lacks cuDNN 9 functions the GPT's attention needs");
    }
    a->version = a->GetVersion();
    Dl_info info{};
    a->path = dladdr(reinterpret_cast<void*>(a->GetVersion), &info) != 0 && info.dli_fname
                  ? info.dli_fname
                  : soname;
    if (a->version < 90000) {
      const std::string v = std::to_string(a->version);
      delete a;
      return UnavailableError("the GPT's cuDNN attention needs cuDNN 9; " + soname + " is " + v);
    }
    return a;  // kept for the life of the process, as the library is
  }();
  return api;
}

}  // namespace tierzero::gpt::cuda

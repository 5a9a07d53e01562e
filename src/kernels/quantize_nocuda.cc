// The build without CUDA: the GPU quantization entry points report that they are absent.
#include "kernels/quantize.h"

namespace tierzero::kernels {

namespace {
Status NoCuda() {
  return UnavailableError("tierzero was built without CUDA (nvcc not found at configure time)");
}
}  // namespace

Status QuantizeCudaAsync(const QuantLayout&, const QuantLayout::Run*, const void*, DType, void*,
                         void*) {
  return NoCuda();
}
Status DequantizeCudaAsync(const QuantLayout&, const QuantLayout::Run*, const void*, void*, DType,
                           void*) {
  return NoCuda();
}
Status DequantizeSumRequantizeCudaAsync(const QuantLayout&, const QuantLayout::Run*, const void*,
                                        int, void*, void*) {
  return NoCuda();
}
Status DequantizeSumRequantizeCudaAsync(const QuantLayout&, const QuantLayout::Run*, const void*,
                                        int, uint64_t, void*, void*) {
  return NoCuda();
}
Status DequantizeMeanCudaAsync(const QuantLayout&, const QuantLayout::Run*, const void*, int,
                               uint64_t, float, void*, DType, void*) {
  return NoCuda();
}

}  // namespace tierzero::kernels

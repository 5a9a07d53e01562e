// The composite scaled-dot-product attention graphs cuDNN fuses (Note [Attention through cuDNN]
// in gpt/cudnn_attention.cc), built with cuDNN's backend API: a descriptor builder, the tensors'
// ids, and the forward and backward graphs. Internal to gpt/cudnn_attention.cc and
// gpt/cudnn_graph.cc; included only where cuDNN's headers are (TZ_GPT_CUDNN).
#pragma once

#include <cudnn_graph.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpt/cudnn_api.h"
#include "gpt/flash_attention_cuda.h"
#include "tierzero/status.h"

namespace tierzero::gpt::cuda::sdpa {

using Dims = std::vector<int64_t>;
using Desc = cudnnBackendDescriptor_t;

// Unique ids of the tensors the caller's memory backs (the variant pack's).
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSoftmaxSum,
  kDQAccum,
  kOne,
  kFirstVirtual = 100,
};
inline Dims Contiguous(const Dims& dims) {
  Dims s(dims.size(), 1);
  for (size_t i = dims.size() - 1; i > 0; --i) s[i - 1] = s[i] * dims[i];
  return s;
}

// Builds descriptors, keeping each for the life of the builder; the first failure is kept
// (naming what was being built and cuDNN's message) and every later call does nothing.
class Builder {
 public:
  explicit Builder(const CudnnApi* api) : api_(api) {}
  ~Builder() {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api_->DestroyDescriptor(*it);
  }
  Builder(const Builder&) = delete;
  Builder& operator=(const Builder&) = delete;

  const Status& status() const { return err_; }
  const std::vector<Desc>& ops() const { return ops_; }
  // Destroyed with the builder's descriptors, before them (an execution plan over its graph).
  void Adopt(Desc d) { owned_.push_back(d); }

  Desc Make(cudnnBackendDescriptorType_t type, const char* what) {
    if (!err_.ok()) return nullptr;
    Desc d = nullptr;
    const cudnnStatus_t s = api_->CreateDescriptor(type, &d);
    if (s != CUDNN_STATUS_SUCCESS) {
      Fail(what, "create", s);
      return nullptr;
    }
    owned_.push_back(d);
    return d;
  }
  void Set(Desc d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t n,
           const void* value, const char* what) {
    if (!err_.ok()) return;
    const cudnnStatus_t s = api_->SetAttribute(d, name, type, n, value);
    if (s != CUDNN_STATUS_SUCCESS)
      Fail(what, ("attribute " + std::to_string(static_cast<int>(name))).c_str(), s);
  }
  void Finalize(Desc d, const char* what) {
    if (!err_.ok()) return;
    const cudnnStatus_t s = api_->Finalize(d);
    if (s != CUDNN_STATUS_SUCCESS) Fail(what, "finalize", s);
  }

  Desc Tensor(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type,
              bool is_virtual = false, bool by_value = false) {
    Desc t = Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    const int64_t align = 16;
    Set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor");
    Set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(dims.size()),
        dims.data(), "tensor");
    Set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(strides.size()),
        strides.data(), "tensor");
    Set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor");
    Set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor");
    if (is_virtual)
      Set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor");
    if (by_value) Set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor");
    Finalize(t, "tensor");
    return t;
  }
  // An intermediate the engine keeps on chip.
  Desc Virtual(const Dims& dims, cudnnDataType_t type) {
    return Virtual(dims, Contiguous(dims), type);
  }
  Desc Virtual(const Dims& dims, const Dims& strides, cudnnDataType_t type) {
    return Tensor(next_virtual_++, dims, strides, type, /*is_virtual=*/true);
  }
  // A float the variant pack passes by value (a host pointer).
  Desc Scalar(int64_t uid) {
    return Tensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, /*by_value=*/true);
  }

  // y = mode(x[, b[, t]]), computed in `prec`; `axis` for GEN_INDEX.
  void Pointwise(cudnnPointwiseMode_t mode, Desc x, Desc b, Desc t, Desc y,
                 cudnnDataType_t prec = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Desc pw = Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
    Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise");
    Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise");
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
      Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise");
    Finalize(pw, "pointwise");
    Desc op = Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    const char* what = "pointwise operation";
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw,
        what);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
    if (b != nullptr)
      Set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, what);
    if (t != nullptr)
      Set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, what);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
    const float one = 1.0f;
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, what);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, what);
    Op(op, what);
  }
  // c = a b over the last two axes (the leading ones batched, a's heads broadcast over b's).
  void Matmul(Desc a, Desc b, Desc c) {
    Desc mm = Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "matmul");
    Finalize(mm, "matmul");
    Desc op = Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    const char* what = "matmul operation";
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, what);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, what);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c, what);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, what);
    Op(op, what);
  }
  // y = reduce(x) over the axes where y's extent is 1 (or divides x's: a group of heads).
  void Reduce(cudnnReduceTensorOp_t mode, Desc x, Desc y) {
    Desc red = Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    Set(red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode,
        "reduction");
    Set(red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, "reduction");
    Finalize(red, "reduction");
    Desc op = Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    const char* what = "reduction operation";
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &red, what);
    Op(op, what);
  }
  // y: x seen through other dimensions and strides (a transpose, for the products).
  void Reshape(Desc x, Desc y) {
    Desc op = Make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    const char* what = "reshape operation";
    Set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, what);
    Set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, what);
    Op(op, what);
  }

 private:
  void Op(Desc op, const char* what) {
    Finalize(op, what);
    if (err_.ok()) ops_.push_back(op);
  }
  void Fail(const char* what, const char* step, cudnnStatus_t s) {
    err_ = UnavailableError(std::string("cuDNN attention graph: ") + what + " (" + step +
                            ", operation " + std::to_string(ops_.size() + 1) +
                            "): " + api_->Describe(s));
  }

  const CudnnApi* api_;
  Status err_;
  std::vector<Desc> owned_;
  std::vector<Desc> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};
// The forward's (or the backward's) tensors and operations for `s`, added to `g` in the order
// cuDNN's engines match (Note [Attention through cuDNN]).
void BuildForward(Builder& g, const FlashShape& s);
void BuildBackward(Builder& g, const FlashShape& s, bool deterministic);

}  // namespace tierzero::gpt::cuda::sdpa

// Causal attention through cuDNN's graph API (gpt/cudnn_attention.h).
//
// Note [Attention through cuDNN]
// cuDNN 9 recognises scaled-dot-product attention as a graph of plain operations and runs it as one
// fused kernel (its "flash" engines); this file builds that graph with the backend API, by hand,
// as NVIDIA's cudnn-frontend does for its composite SDPA nodes (read, not copied: the frontend is
// a header library we do not carry). The unified SDPA operation of cuDNN >= 9.13.1 takes a causal
// mask only as a subgraph from 9.21 on, so the composite graph is the one every cuDNN 9 runs.
//
// Forward (S, P are never written: the engine keeps them on chip):
//   S = Q K^T (fp32) -> S * scale -> causal mask (GEN_INDEX row, col; row >= col; else -inf)
//   M = rowmax(S), E = exp(S - M), Z = rowsum(E), stats = M + log(Z)  [B, H, T, 1] fp32
//   P = E / Z (bf16) -> O = P V
// stats is the natural-log log-sum-exp of the scaled scores, exactly the state the fused kernels
// keep (flash_attention_cuda.cu), so either forward feeds either backward.
// Backward (cuDNN's engine wants this order of operations; the frontend's note says the pattern
// is matched, so the multiply by a by-value 1.0 stays):
//   sum = rowsum(dO * O) * 1.0                  [B, H, T, 1] fp32, in our workspace
//   E = exp(mask(S * scale - stats)) = P;  dV = P^T dO (reduced over a group's query heads)
//   dS = (dO V^T - sum) * E * scale;  dK = dS^T Q;  dQ = dS K via an fp32 accumulator
//   [B, H, T, D] in our workspace (cuDNN >= 9.6 clears it itself), copied out as bf16.
// Tensors are [B, heads, T, D] views of our row-major rows: q's element (b, h, t, d) is at
// b T ld + h D + t ld + d, so the strides are {T ld, D, ld, 1}; K^T swaps the last two.
//
// Plans are built once per shape (the heuristics' engines in order, the first that finalises) and
// cached. Anything cuDNN refuses is an error from Prepare naming the step and cuDNN's message;
// the bf16 backend then runs the fused kernels for that shape and says so (gpt/backend.h,
// AttentionSummary). Repeatable by default: dQ = dS K written directly, which makes cuDNN pick
// its dP-workspace kernels (the frontend's "deterministic algorithm" on Hopper; B H T T bf16 of
// workspace); `deterministic` false takes the fp32 accumulator cuDNN adds into with atomics
// (faster, not bit-for-bit repeatable run to run).
#include "gpt/cudnn_attention.h"

#include <cudnn_graph.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "gpt/cudnn_api.h"

namespace tierzero::gpt::cuda {
namespace {

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

// The backend API's two deprecated-but-needed attributes (a handle for the graph and the plan).
constexpr auto kGraphHandle = static_cast<cudnnBackendAttributeName_t>(800);
constexpr auto kPlanHandle = static_cast<cudnnBackendAttributeName_t>(400);

Dims Contiguous(const Dims& dims) {
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

// The [B, heads, T, D] view of rows `ld` elements apart (Note [Attention through cuDNN]).
struct View {
  Dims dims, strides;
};
View Rows(int64_t batch, int64_t heads, int64_t seq, int64_t head_dim, int64_t ld) {
  return {{batch, heads, seq, head_dim}, {seq * ld, head_dim, ld, 1}};
}
View Transposed(View v) {
  std::swap(v.dims[2], v.dims[3]);
  std::swap(v.strides[2], v.strides[3]);
  return v;
}

// Scores with the causal mask: keep (row >= column), else -inf.
Desc CausalMask(Builder& g, Desc scores, const Dims& st) {
  Desc row = g.Virtual(st, CUDNN_DATA_INT32);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
  Desc col = g.Virtual(st, CUDNN_DATA_INT32);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, col, CUDNN_DATA_FLOAT, 3);
  Desc keep = g.Virtual(st, CUDNN_DATA_BOOLEAN);
  g.Pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep, CUDNN_DATA_BOOLEAN);
  Desc masked = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, g.Scalar(kNegInf), keep, masked);
  return masked;
}

void BuildForward(Builder& g, const FlashShape& s) {
  const int64_t B = s.batch, H = s.heads, Hk = s.kv_heads, T = s.seq, D = s.head_dim;
  const View q = Rows(B, H, T, D, s.ld_q), kt = Transposed(Rows(B, Hk, T, D, s.ld_k)),
             v = Rows(B, Hk, T, D, s.ld_v), o = Rows(B, H, T, D, s.ld_o);
  const Dims st{B, H, T, T}, row{B, H, T, 1};
  Desc Q = g.Tensor(kQ, q.dims, q.strides, CUDNN_DATA_BFLOAT16);
  Desc KT = g.Tensor(kK, kt.dims, kt.strides, CUDNN_DATA_BFLOAT16);
  Desc V = g.Tensor(kV, v.dims, v.strides, CUDNN_DATA_BFLOAT16);
  Desc O = g.Tensor(kO, o.dims, o.strides, CUDNN_DATA_BFLOAT16);
  Desc stats = g.Tensor(kStats, row, Contiguous(row), CUDNN_DATA_FLOAT);

  Desc scores = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Matmul(Q, KT, scores);
  Desc scaled = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, scores, g.Scalar(kScale), nullptr, scaled);
  Desc masked = CausalMask(g, scaled, st);
  Desc max = g.Virtual(row, CUDNN_DATA_FLOAT);
  g.Reduce(CUDNN_REDUCE_TENSOR_MAX, masked, max);
  Desc shifted = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, masked, max, nullptr, shifted);
  Desc e = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, e);
  Desc sum = g.Virtual(row, CUDNN_DATA_FLOAT);
  g.Reduce(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  Desc log_sum = g.Virtual(row, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, log_sum);
  g.Pointwise(CUDNN_POINTWISE_ADD, max, log_sum, nullptr, stats);
  Desc p = g.Virtual(st, CUDNN_DATA_BFLOAT16);
  g.Pointwise(CUDNN_POINTWISE_DIV, e, sum, nullptr, p);
  g.Matmul(p, V, O);
}

void BuildBackward(Builder& g, const FlashShape& s, bool deterministic) {
  const int64_t B = s.batch, H = s.heads, Hk = s.kv_heads, T = s.seq, D = s.head_dim;
  const View q = Rows(B, H, T, D, s.ld_q), k = Rows(B, Hk, T, D, s.ld_k),
             v = Rows(B, Hk, T, D, s.ld_v), o = Rows(B, H, T, D, s.ld_o);
  const View kt = Transposed(k), vt = Transposed(v);
  const Dims st{B, H, T, T}, row{B, H, T, 1}, full{B, H, T, D};
  // P^T and dS^T: the scores' transposes, [B, H, T(keys), T(queries)].
  const Dims tst = Contiguous(st);
  const Dims transposed_strides{tst[0], tst[1], 1, T};

  Desc Q = g.Tensor(kQ, q.dims, q.strides, CUDNN_DATA_BFLOAT16);
  Desc KT = g.Tensor(kK, kt.dims, kt.strides, CUDNN_DATA_BFLOAT16);
  Desc VT = g.Tensor(kV, vt.dims, vt.strides, CUDNN_DATA_BFLOAT16);
  Desc O = g.Tensor(kO, o.dims, o.strides, CUDNN_DATA_BFLOAT16);
  Desc dO = g.Tensor(kDO, o.dims, o.strides, CUDNN_DATA_BFLOAT16);
  Desc stats = g.Tensor(kStats, row, Contiguous(row), CUDNN_DATA_FLOAT);
  Desc dQ = g.Tensor(kDQ, q.dims, q.strides, CUDNN_DATA_BFLOAT16);
  Desc dK = g.Tensor(kDK, k.dims, k.strides, CUDNN_DATA_BFLOAT16);
  Desc dV = g.Tensor(kDV, v.dims, v.strides, CUDNN_DATA_BFLOAT16);
  Desc softmax_sum = g.Tensor(kSoftmaxSum, row, Contiguous(row), CUDNN_DATA_FLOAT);

  // sum = rowsum(dO * O) * 1.0
  Desc dout_o = g.Virtual(full, o.strides, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, dO, O, nullptr, dout_o);
  Desc rowdot = g.Virtual(row, CUDNN_DATA_FLOAT);
  g.Reduce(CUDNN_REDUCE_TENSOR_ADD, dout_o, rowdot);
  g.Pointwise(CUDNN_POINTWISE_MUL, rowdot, g.Scalar(kOne), nullptr, softmax_sum);

  // P = exp(mask(Q K^T * scale - stats))
  Desc scores = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Matmul(Q, KT, scores);
  Desc scaled = g.Virtual(st, CUDNN_DATA_FLOAT);
  Desc scale = g.Scalar(kScale);
  g.Pointwise(CUDNN_POINTWISE_MUL, scores, scale, nullptr, scaled);
  Desc shifted = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, scaled, stats, nullptr, shifted);
  Desc masked = CausalMask(g, shifted, st);
  Desc p = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, nullptr, p);

  // dV = P^T dO, summed over each key/value head's query heads.
  Desc pt = g.Virtual({B, H, T, T}, transposed_strides, CUDNN_DATA_BFLOAT16);
  g.Reshape(p, pt);
  if (H == Hk) {
    g.Matmul(pt, dO, dV);
  } else {
    Desc dv_full = g.Virtual(full, CUDNN_DATA_BFLOAT16);
    g.Matmul(pt, dO, dv_full);
    g.Reduce(CUDNN_REDUCE_TENSOR_ADD, dv_full, dV);
  }

  // dS = (dO V^T - sum) * P * scale
  Desc dp = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Matmul(dO, VT, dp);
  Desc centred = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_SUB, dp, softmax_sum, nullptr, centred);
  Desc ds_unscaled = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, centred, p, nullptr, ds_unscaled);
  Desc ds = g.Virtual(st, CUDNN_DATA_FLOAT);
  g.Pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, nullptr, ds);

  // dK = dS^T Q (summed over the group's query heads)
  Desc dst = g.Virtual({B, H, T, T}, transposed_strides, CUDNN_DATA_BFLOAT16);
  g.Reshape(ds, dst);
  if (H == Hk) {
    g.Matmul(dst, Q, dK);
  } else {
    Desc dk_full = g.Virtual(full, CUDNN_DATA_BFLOAT16);
    g.Matmul(dst, Q, dk_full);
    g.Reduce(CUDNN_REDUCE_TENSOR_ADD, dk_full, dK);
  }

  // dQ = dS K: written directly (the engine's dP-workspace kernels: repeatable), or through the
  // fp32 accumulator (atomics: faster, not repeatable).
  // (K's view keeps the intermediate type, as the frontend leaves it: float.)
  Desc K = g.Virtual(k.dims, k.strides, CUDNN_DATA_FLOAT);
  g.Reshape(KT, K);
  if (deterministic) {
    g.Matmul(ds, K, dQ);
  } else {
    Desc dq_accum = g.Tensor(kDQAccum, full, Contiguous(full), CUDNN_DATA_FLOAT);
    g.Matmul(ds, K, dq_accum);
    g.Pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, nullptr, nullptr, dQ);
  }
}

using ShapeKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, bool>;
ShapeKey Key(const FlashShape& s, bool backward) {
  return {s.batch, s.seq,  s.heads, s.kv_heads, s.head_dim,
          s.ld_q,  s.ld_k, s.ld_v,  s.ld_o,     backward};
}

// What cuDNN versions get wrong that the frontend refuses or works around (its support surface):
// bf16 attention on 9.10.0 and 9.10.1; a backward of one token; below 9.15.1 a backward whose
// sequence is not a multiple of 128 (the frontend adds a padding mask there; we run the kernels).
Status Supported(size_t version, const FlashShape& s, bool backward) {
  const std::string v = std::to_string(version);
  if (version >= 91000 && version < 91002)
    return UnavailableError("cuDNN " + v + " has known bf16 attention bugs (9.10.2 fixes them)");
  if (backward && s.seq == 1)
    return UnavailableError("cuDNN's backward takes sequences of 2 or more");
  if (backward && version < 91501 && s.seq % 128 != 0)
    return UnavailableError("cuDNN " + v + "'s backward needs a padding mask for a sequence of " +
                            std::to_string(s.seq) + " (not a multiple of 128) before 9.15.1");
  return Status::OK();
}
// The masked scores' fill: -inf, or the lowest float before 9.10 (which its engines preferred).
float MaskFill(size_t version) {
  return version < 91000 ? std::numeric_limits<float>::lowest()
                         : -std::numeric_limits<float>::infinity();
}

constexpr int64_t kAlign = 256;
int64_t Round(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct CudnnAttention::Impl {
  const CudnnApi* api = nullptr;
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  bool deterministic = true;

  // An execution plan and what it keeps alive (its builder owns the graph's descriptors).
  struct Plan {
    std::unique_ptr<Builder> keep;
    Desc plan = nullptr;
    int64_t workspace = 0;  // the plan's own, before our intermediates (backward)
    Status status;          // why there is no plan, when there is none
  };
  std::map<ShapeKey, Plan> plans;

  void* workspace = nullptr;
  int64_t workspace_bytes = 0;

  ~Impl() {
    if (workspace != nullptr) {
      cudaStreamSynchronize(stream);
      cudaFree(workspace);
    }
    plans.clear();  // before the handle
    if (handle != nullptr) api->Destroy(handle);
  }

  Plan Build(const FlashShape& s, bool backward) {
    Plan out;
    out.keep = std::make_unique<Builder>(api);
    Builder& g = *out.keep;
    if (backward)
      BuildBackward(g, s, deterministic);
    else
      BuildForward(g, s);
    const char* what = backward ? "backward graph" : "forward graph";
    Desc graph = g.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, what);
    g.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
          static_cast<int64_t>(g.ops().size()), g.ops().data(), what);
    api->SetAttribute(graph, kGraphHandle, CUDNN_TYPE_HANDLE, 1, &handle);  // deprecated: may fail
    g.Finalize(graph, what);
    // The heuristics' engine configurations in order (then the fallback list); the first whose
    // plan finalises.
    std::string refused;
    for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      if (!g.status().ok()) break;
      Desc heur = g.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
      g.Set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph,
            "heuristics");
      g.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics");
      g.Finalize(heur, "heuristics");
      if (!g.status().ok()) break;
      int64_t count = 0;
      if (cudnnStatus_t st = api->GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
          st != CUDNN_STATUS_SUCCESS) {
        refused += std::string(refused.empty() ? "" : "; ") + "heuristics: " + api->Describe(st);
        continue;
      }
      std::vector<Desc> configs;
      for (int64_t i = 0; i < count; ++i)
        configs.push_back(g.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration"));
      if (!g.status().ok()) break;
      int64_t got = 0;
      if (count > 0) {
        if (cudnnStatus_t st =
                api->GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, configs.data());
            st != CUDNN_STATUS_SUCCESS) {
          refused += std::string(refused.empty() ? "" : "; ") + "heuristics: " + api->Describe(st);
          continue;
        }
      }
      for (int64_t i = 0; i < got; ++i) {
        Desc plan = nullptr;
        if (api->CreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan) !=
            CUDNN_STATUS_SUCCESS)
          continue;
        api->SetAttribute(plan, kPlanHandle, CUDNN_TYPE_HANDLE, 1,
                          &handle);  // deprecated: may fail
        cudnnStatus_t st = api->SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &configs[i]);
        if (st == CUDNN_STATUS_SUCCESS) st = api->Finalize(plan);
        int64_t ws = 0;
        if (st == CUDNN_STATUS_SUCCESS)
          st = api->GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64,
                                 1, nullptr, &ws);
        if (st == CUDNN_STATUS_SUCCESS) {
          out.plan = plan;
          out.workspace = ws;
          out.status = Status::OK();
          g.Adopt(plan);
          return out;
        }
        if (refused.size() < 600)
          refused += std::string(refused.empty() ? "" : "; ") + "engine " + std::to_string(i) +
                     ": " + api->Describe(st);
        api->DestroyDescriptor(plan);
      }
    }
    out.status = !g.status().ok() ? g.status()
                                  : UnavailableError(std::string("cuDNN has no engine for the ") +
                                                     what + " of this shape" +
                                                     (refused.empty() ? "" : " (" + refused + ")"));
    return out;
  }

  StatusOr<const Plan*> Get(const FlashShape& s, bool backward) {
    TZ_RETURN_IF_ERROR(Supported(api->version, s, backward));
    const ShapeKey key = Key(s, backward);
    auto it = plans.find(key);
    if (it == plans.end()) it = plans.emplace(key, Build(s, backward)).first;
    if (!it->second.status.ok()) return it->second.status;
    return &it->second;
  }

  // The backward's workspace: the plan's own, then our intermediates: the row sums, then dQ's
  // fp32 accumulator (without the repeatable kernels).
  struct Layout {
    int64_t sum, accum, end;
  };
  Layout BackwardLayout(const Plan& plan, const FlashShape& s) const {
    const int64_t rows = s.batch * s.heads * s.seq;
    Layout l;
    l.sum = Round(plan.workspace);
    l.accum = l.sum + Round(4 * rows);
    l.end = l.accum + (deterministic ? 0 : Round(4 * rows * s.head_dim));
    return l;
  }

  StatusOr<char*> Workspace(int64_t bytes) {
    if (bytes > workspace_bytes) {
      if (workspace != nullptr) {
        // The stream may still be running a plan on the old one.
        if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess)
          return InternalError(std::string("cuDNN attention workspace: ") + cudaGetErrorString(e));
        cudaFree(workspace);
        workspace = nullptr;
        workspace_bytes = 0;
      }
      if (cudaError_t e = cudaMalloc(&workspace, static_cast<size_t>(bytes)); e != cudaSuccess) {
        cudaGetLastError();
        workspace = nullptr;
        return OutOfMemoryError("cuDNN attention workspace (" + std::to_string(bytes) +
                                " bytes of device memory): " + cudaGetErrorString(e));
      }
      workspace_bytes = bytes;
    }
    return static_cast<char*>(workspace);
  }

  Status Execute(const Plan& plan, const std::vector<int64_t>& uids, std::vector<void*> ptrs,
                 char* workspace_ptr) {
    Builder g(api);
    Desc pack = g.Make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    g.Set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
          static_cast<int64_t>(uids.size()), uids.data(), "variant pack");
    g.Set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
          static_cast<int64_t>(ptrs.size()), ptrs.data(), "variant pack");
    void* ws = workspace_ptr;
    g.Set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws, "variant pack");
    g.Finalize(pack, "variant pack");
    TZ_RETURN_IF_ERROR(g.status());
    const cudnnStatus_t st = api->Execute(handle, plan.plan, pack);
    if (st != CUDNN_STATUS_SUCCESS)
      return InternalError("cuDNN attention: execute: " + api->Describe(st));
    return Status::OK();
  }
};

CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudnnAttention::~CudnnAttention() = default;

StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(cudaStream_t stream,
                                                                 bool deterministic) {
  TZ_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  auto impl = std::make_unique<Impl>();
  impl->api = api;
  impl->stream = stream;
  impl->deterministic = deterministic;
  if (cudnnStatus_t st = api->Create(&impl->handle); st != CUDNN_STATUS_SUCCESS) {
    impl->handle = nullptr;
    return UnavailableError("cuDNN has no handle (" + api->Describe(st) + ")");
  }
  if (cudnnStatus_t st = api->SetStream(impl->handle, stream); st != CUDNN_STATUS_SUCCESS)
    return InternalError("cudnnSetStream: " + api->Describe(st));
  return std::unique_ptr<CudnnAttention>(new CudnnAttention(std::move(impl)));
}

std::string CudnnAttention::Version() const {
  const size_t v = impl_->api->version;
  return "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

Status CudnnAttention::Prepare(const FlashShape& s) {
  TZ_ASSIGN_OR_RETURN(const Impl::Plan* forward, impl_->Get(s, false));
  TZ_ASSIGN_OR_RETURN(const Impl::Plan* backward, impl_->Get(s, true));
  // The workspace now, so that a device too full for it is a refusal (the kernels then run). The
  // repeatable backward's grows as B H T^2 (256 MiB at the 1.21B GPT's batch, 4 GiB at a single
  // sequence of 8192 over 32 heads): more than a quarter of the free memory is refused too.
  const int64_t bytes = std::max(std::max<int64_t>(forward->workspace, kAlign),
                                 impl_->BackwardLayout(*backward, s).end);
  size_t free_bytes = 0, total_bytes = 0;
  if (bytes > impl_->workspace_bytes && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess &&
      static_cast<uint64_t>(bytes - impl_->workspace_bytes) > free_bytes / 4)
    return UnavailableError("cuDNN's attention wants " + std::to_string(bytes >> 20) +
                            " MiB of workspace for this shape, more than a quarter of the " +
                            std::to_string(free_bytes >> 20) + " MiB the device has free");
  return impl_->Workspace(bytes).status();
}

Status CudnnAttention::Forward(const __nv_bfloat16* q, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                               const FlashShape& s) {
  TZ_ASSIGN_OR_RETURN(const Impl::Plan* plan, impl_->Get(s, false));
  TZ_ASSIGN_OR_RETURN(char* ws, impl_->Workspace(std::max<int64_t>(plan->workspace, kAlign)));
  float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  float neg_inf = MaskFill(impl_->api->version);
  return impl_->Execute(*plan, {kQ, kK, kV, kO, kStats, kScale, kNegInf},
                        {const_cast<__nv_bfloat16*>(q), const_cast<__nv_bfloat16*>(k),
                         const_cast<__nv_bfloat16*>(v), out, lse, &scale, &neg_inf},
                        ws);
}

Status CudnnAttention::Backward(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                const __nv_bfloat16* k, const __nv_bfloat16* v,
                                const __nv_bfloat16* out, const float* lse, __nv_bfloat16* dq,
                                __nv_bfloat16* dk, __nv_bfloat16* dv, const FlashShape& s) {
  TZ_ASSIGN_OR_RETURN(const Impl::Plan* plan, impl_->Get(s, true));
  const Impl::Layout at = impl_->BackwardLayout(*plan, s);
  TZ_ASSIGN_OR_RETURN(char* ws, impl_->Workspace(at.end));
  float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  float neg_inf = MaskFill(impl_->api->version);
  float one = 1.0f;
  auto c = [](const void* p) { return const_cast<void*>(p); };
  std::vector<int64_t> uids{kQ,  kK,  kV,          kO,     kDO,     kStats, kDQ,
                            kDK, kDV, kSoftmaxSum, kScale, kNegInf, kOne};
  std::vector<void*> ptrs{c(q), c(k), c(v),        c(out), c(dout),  c(lse), dq,
                          dk,   dv,   ws + at.sum, &scale, &neg_inf, &one};
  if (!impl_->deterministic) {
    uids.push_back(kDQAccum);
    ptrs.push_back(ws + at.accum);
    // cuDNN clears the accumulator itself from 9.6 on; before, the caller does.
    if (impl_->api->version < 90600) {
      if (cudaError_t e = cudaMemsetAsync(ws + at.accum, 0, at.end - at.accum, impl_->stream);
          e != cudaSuccess)
        return InternalError(std::string("cuDNN attention: clearing dQ's accumulator: ") +
                             cudaGetErrorString(e));
    }
  }
  return impl_->Execute(*plan, uids, std::move(ptrs), ws);
}

Status BuildAttentionOperationsOnHost(const FlashShape& s, bool backward, bool deterministic,
                                      std::string_view device_json) {
  TZ_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  Builder g(api);
  if (backward)
    BuildBackward(g, s, deterministic);
  else
    BuildForward(g, s);
  // The operation graph finalises without a handle (cuDNN 9.19).
  Desc graph = g.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  g.Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
        static_cast<int64_t>(g.ops().size()), g.ops().data(), "operation graph");
  g.Finalize(graph, "operation graph");
  if (device_json.empty() || !g.status().ok()) return g.status();
  // Note [cuDNN's engines asked without a GPU]
  // From 9.8 cuDNN takes a device's properties as JSON (CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, for
  // its ahead-of-time plans), and its heuristics then say which engines take a graph on that
  // device. The engines' configurations come back only for engines whose support checks pass
  // (the pattern of the graph, its shapes and types); their plans need the GPU. The runtime-
  // compiled engines' checks need a libcuda to load, which the toolkit's stub library is. So
  // here, with no GPU, a graph an H100's engines would refuse fails (a forward whose P is fp32
  // gets none: tried), and one they take passes.
  if (api->version < 90800)
    return UnavailableError("cuDNN " + std::to_string(api->version) +
                            " takes no device properties (9.8 does)");
  Desc dp = g.Make(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device properties");
  g.Set(dp, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
        static_cast<int64_t>(device_json.size()), device_json.data(), "device properties");
  g.Finalize(dp, "device properties");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  Desc heur = g.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
  g.Set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph,
        "heuristics");
  g.Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics");
  g.Set(heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &dp,
        "heuristics");
  g.Finalize(heur, "heuristics");
  TZ_RETURN_IF_ERROR(g.status());
  int64_t count = 0;
  if (cudnnStatus_t st = api->GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                           CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
      st != CUDNN_STATUS_SUCCESS)
    return UnavailableError("cuDNN's heuristics: " + api->Describe(st));
  std::vector<Desc> configs;
  for (int64_t i = 0; i < count; ++i)
    configs.push_back(g.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration"));
  TZ_RETURN_IF_ERROR(g.status());
  int64_t got = 0;
  cudnnStatus_t st = CUDNN_STATUS_SUCCESS;
  if (count > 0)
    st = api->GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                           count, &got, configs.data());
  if (st != CUDNN_STATUS_SUCCESS || got == 0)
    return UnavailableError(std::string("no engine of the device takes the ") +
                            (backward ? "backward" : "forward") + " graph (" +
                            std::to_string(count) + " considered): " + api->Describe(st));
  return Status::OK();
}

}  // namespace tierzero::gpt::cuda

// The attention graphs cuDNN fuses (gpt/cudnn_graph.h), and the host's check of them
// (BuildAttentionOperationsOnHost, gpt/cudnn_attention.h).
#include "gpt/cudnn_graph.h"

#include <cudnn_graph.h>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpt/cudnn_api.h"
#include "gpt/cudnn_attention.h"

namespace tierzero::gpt::cuda {
namespace sdpa {
namespace {

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

}  // namespace

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
}  // namespace sdpa

Status BuildAttentionOperationsOnHost(const FlashShape& s, bool backward, bool deterministic,
                                      std::string_view device_json) {
  TZ_ASSIGN_OR_RETURN(const CudnnApi* api, LoadCudnn());
  sdpa::Builder g(api);
  if (backward)
    sdpa::BuildBackward(g, s, deterministic);
  else
    sdpa::BuildForward(g, s);
  // The operation graph finalises without a handle (cuDNN 9.19).
  sdpa::Desc graph = g.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
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
  sdpa::Desc dp = g.Make(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device properties");
  g.Set(dp, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
        static_cast<int64_t>(device_json.size()), device_json.data(), "device properties");
  g.Finalize(dp, "device properties");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  sdpa::Desc heur = g.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
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
  std::vector<sdpa::Desc> configs;
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

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
#include "gpt/cudnn_graph.h"

namespace tierzero::gpt::cuda {
namespace {

using sdpa::Builder;
using sdpa::Desc;
using sdpa::kDK, sdpa::kDO, sdpa::kDQ, sdpa::kDQAccum, sdpa::kDV, sdpa::kK, sdpa::kNegInf, sdpa::kO,
    sdpa::kOne, sdpa::kQ, sdpa::kScale, sdpa::kSoftmaxSum, sdpa::kStats, sdpa::kV;

// The backend API's two deprecated-but-needed attributes (a handle for the graph and the plan).
constexpr auto kGraphHandle = static_cast<cudnnBackendAttributeName_t>(800);
constexpr auto kPlanHandle = static_cast<cudnnBackendAttributeName_t>(400);

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

}  // namespace tierzero::gpt::cuda

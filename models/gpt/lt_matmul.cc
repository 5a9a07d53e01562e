// bf16 products through cuBLASLt (gpt/lt_matmul.h).
#include "gpt/lt_matmul.h"

#include <string>

namespace tierzero::gpt::cuda {

struct LtMatmul::Plan {
  const CublasLtApi* api = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (d != nullptr) api->MatrixLayoutDestroy(d);
    if (b != nullptr) api->MatrixLayoutDestroy(b);
    if (a != nullptr) api->MatrixLayoutDestroy(a);
    if (desc != nullptr) api->MatmulDescDestroy(desc);
  }
};

namespace {

cublasLtEpilogue_t LtEpilogue(Epilogue e) {
  switch (e) {
    case Epilogue::kNone:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::kGeluAuxBias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::kGeluAux:
      return CUBLASLT_EPILOGUE_GELU_AUX;
    case Epilogue::kDGelu:
      return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::kBGradA:
      return CUBLASLT_EPILOGUE_BGRADA;
    case Epilogue::kBGradB:
      return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool HasAux(Epilogue e) {
  return e == Epilogue::kGeluAuxBias || e == Epilogue::kGeluAux || e == Epilogue::kDGelu;
}

// A pointer's alignment in bytes, up to 256 (what cuBLASLt's MIN_ALIGNMENT preferences take:
// algorithms depend on it, and a chunk's tensors are only as aligned as their offsets).
uint32_t PtrAlignment(const void* q) {
  uint32_t align = 256;
  while (align > 2 && reinterpret_cast<uintptr_t>(q) % align != 0) align /= 2;
  return align;
}
// The alignments of A, B, D and of the epilogue's bias and aux, packed (the plan's key).
int64_t Alignments(const LtProduct& p) {
  int64_t key = 0;
  for (const void* q : {p.a, p.b, static_cast<const void*>(p.d), static_cast<const void*>(p.bias),
                        static_cast<const void*>(p.aux), p.c})
    key = key * 512 + (q != nullptr ? PtrAlignment(q) : 0);
  return key;
}

std::string Shape(const LtProduct& p) {
  return std::to_string(p.m) + " x " + std::to_string(p.n) + " x " + std::to_string(p.k) +
         (p.trans_a ? " A^T" : "") + (p.trans_b ? " B^T" : "") + ", epilogue " +
         std::to_string(static_cast<int>(p.epilogue));
}

}  // namespace

StatusOr<std::unique_ptr<LtMatmul>> LtMatmul::Create(cudaStream_t stream) {
  TZ_ASSIGN_OR_RETURN(const CublasLtApi* api, LoadCublasLt());
  std::unique_ptr<LtMatmul> lt(new LtMatmul());
  lt->api_ = api;
  lt->stream_ = stream;
  if (const cublasStatus_t s = api->Create(&lt->handle_); s != CUBLAS_STATUS_SUCCESS) {
    lt->handle_ = nullptr;
    return InternalError("cublasLtCreate failed with cuBLAS status " + std::to_string(s));
  }
  if (const cudaError_t e = cudaMalloc(&lt->workspace_, kWorkspaceBytes); e != cudaSuccess) {
    lt->workspace_ = nullptr;
    cudaGetLastError();
    return OutOfMemoryError("cuBLASLt's workspace (" + std::to_string(kWorkspaceBytes >> 20) +
                            " MiB of device memory): " + cudaGetErrorString(e));
  }
  return lt;
}

LtMatmul::~LtMatmul() {
  plans_.clear();
  if (workspace_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaFree(workspace_);
  }
  if (handle_ != nullptr) api_->Destroy(handle_);
}

StatusOr<LtMatmul::Plan*> LtMatmul::PlanFor(const LtProduct& p) {
  const Key key{p.trans_a, p.trans_b, p.m,         p.n,        p.k,      p.lda,
                p.ldb,     p.ldd,     p.beta != 0, p.epilogue, p.aux_ld, Alignments(p)};
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();
  if (unsupported_.count(key) > 0)
    return UnsupportedError("cuBLASLt has no algorithm for the bf16 product " + Shape(p) +
                            "; run with --activations fp32");
  auto plan = std::make_unique<Plan>();
  plan->api = api_;
  const CublasLtApi& A = *api_;
  auto check = [&](cublasStatus_t s, const char* what) -> Status {
    if (s == CUBLAS_STATUS_SUCCESS) return Status::OK();
    return InternalError(std::string(what) + " failed with cuBLAS status " + std::to_string(s) +
                         " for the product " + Shape(p));
  };
  TZ_RETURN_IF_ERROR(
      check(A.MatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate"));
  const cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  TZ_RETURN_IF_ERROR(
      check(A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
            "TRANSA"));
  TZ_RETURN_IF_ERROR(
      check(A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
            "TRANSB"));
  const cublasLtEpilogue_t epi = LtEpilogue(p.epilogue);
  TZ_RETURN_IF_ERROR(
      check(A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
            "EPILOGUE"));
  if (p.bias != nullptr) {
    const cudaDataType_t bt = CUDA_R_16BF;
    TZ_RETURN_IF_ERROR(check(
        A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)),
        "BIAS_DATA_TYPE"));
  }
  if (HasAux(p.epilogue)) {
    const int64_t ld = p.aux_ld;
    TZ_RETURN_IF_ERROR(check(
        A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)),
        "EPILOGUE_AUX_LD"));
  }
  // The layouts of the stored matrices: A is m x k (k x m stored when transposed), B k x n.
  TZ_RETURN_IF_ERROR(check(A.MatrixLayoutCreate(&plan->a, CUDA_R_16BF, p.trans_a ? p.k : p.m,
                                                p.trans_a ? p.m : p.k, p.lda),
                           "MatrixLayoutCreate (A)"));
  TZ_RETURN_IF_ERROR(check(A.MatrixLayoutCreate(&plan->b, CUDA_R_16BF, p.trans_b ? p.n : p.k,
                                                p.trans_b ? p.k : p.n, p.ldb),
                           "MatrixLayoutCreate (B)"));
  TZ_RETURN_IF_ERROR(check(A.MatrixLayoutCreate(&plan->d, CUDA_R_16BF, p.m, p.n, p.ldd),
                           "MatrixLayoutCreate (D)"));
  // The heuristic reads the pointers' alignment from the descriptor: set them before asking.
  TZ_RETURN_IF_ERROR(check(A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                    &p.bias, sizeof(p.bias)),
                           "BIAS_POINTER"));
  if (HasAux(p.epilogue)) {
    TZ_RETURN_IF_ERROR(
        check(A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                       &p.aux, sizeof(p.aux)),
              "EPILOGUE_AUX_POINTER"));
  }
  cublasLtMatmulPreference_t pref = nullptr;
  TZ_RETURN_IF_ERROR(check(A.PreferenceCreate(&pref), "MatmulPreferenceCreate"));
  const uint64_t ws = kWorkspaceBytes;
  cublasStatus_t s =
      A.PreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  // The operands' own alignments (the heuristic assumes 256 bytes otherwise).
  const uint32_t align_a = PtrAlignment(p.a), align_b = PtrAlignment(p.b),
                 align_d = PtrAlignment(p.d), align_c = PtrAlignment(p.c != nullptr ? p.c : p.d);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = A.PreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                 sizeof(align_a));
  if (s == CUBLAS_STATUS_SUCCESS)
    s = A.PreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                 sizeof(align_b));
  if (s == CUBLAS_STATUS_SUCCESS)
    s = A.PreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                 sizeof(align_c));
  if (s == CUBLAS_STATUS_SUCCESS)
    s = A.PreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                                 sizeof(align_d));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = A.AlgoGetHeuristic(handle_, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1,
                           &result, &found);
    // cuBLASLt says "no algorithm" either way: none found, or CUBLAS_STATUS_NOT_SUPPORTED for a
    // configuration it refuses (an epilogue, a transpose, an alignment). Both are unsupported,
    // for the caller's fallback (Supported), not an internal error that skipped it (a CUDA code
    // review, session 48).
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) {
      s = CUBLAS_STATUS_SUCCESS;
      found = 0;
    }
  }
  A.PreferenceDestroy(pref);
  TZ_RETURN_IF_ERROR(check(s, "MatmulAlgoGetHeuristic"));
  if (found == 0) unsupported_.insert(key);
  if (found == 0)
    return UnsupportedError("cuBLASLt has no algorithm for the bf16 product " + Shape(p) +
                            " (leading dimensions " + std::to_string(p.lda) + ", " +
                            std::to_string(p.ldb) + ", " + std::to_string(p.ldd) +
                            "); run with --activations fp32");
  plan->algo = result.algo;
  Plan* raw = plan.get();
  plans_.emplace(key, std::move(plan));
  return raw;
}

StatusOr<bool> LtMatmul::Supported(const LtProduct& p) {
  if (p.m == 0 || p.n == 0 || p.k == 0) return true;
  auto plan = PlanFor(p);
  if (plan.ok()) return true;
  if (plan.status().code() == StatusCode::kUnsupported) return false;
  return plan.status();
}

Status LtMatmul::Run(const LtProduct& p) {
  if (p.m == 0 || p.n == 0) return Status::OK();
  if (p.k == 0) {
    // An empty sum: D (written) and a bias gradient are zeros; nothing to add otherwise.
    cudaError_t e = cudaSuccess;
    if (p.beta == 0)
      e = cudaMemset2DAsync(p.d, static_cast<size_t>(p.ldd) * 2, 0, static_cast<size_t>(p.m) * 2,
                            static_cast<size_t>(p.n), stream_);
    else if (p.c != nullptr && p.c != p.d)  // D = C
      e = cudaMemcpy2DAsync(p.d, static_cast<size_t>(p.ldd) * 2, p.c,
                            static_cast<size_t>(p.ldd) * 2, static_cast<size_t>(p.m) * 2,
                            static_cast<size_t>(p.n), cudaMemcpyDeviceToDevice, stream_);
    if (e == cudaSuccess && p.bias != nullptr &&
        (p.epilogue == Epilogue::kBGradA || p.epilogue == Epilogue::kBGradB))
      e = cudaMemsetAsync(
          p.bias, 0, static_cast<size_t>(p.epilogue == Epilogue::kBGradA ? p.m : p.n) * 2, stream_);
    if (e != cudaSuccess)
      return InternalError(std::string("zeroing an empty product: ") + cudaGetErrorString(e));
    return Status::OK();
  }
  TZ_ASSIGN_OR_RETURN(Plan * plan, PlanFor(p));
  const CublasLtApi& A = *api_;
  // The pointers change from call to call; the shape's descriptors stay.
  cublasStatus_t s = A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                              &p.bias, sizeof(p.bias));
  if (s == CUBLAS_STATUS_SUCCESS && HasAux(p.epilogue))
    s = A.MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux,
                                 sizeof(p.aux));
  const float alpha = 1.0f, beta = p.beta;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = A.Matmul(handle_, plan->desc, &alpha, p.a, plan->a, p.b, plan->b, &beta,
                 p.c != nullptr ? p.c : p.d, plan->d, p.d, plan->d, &plan->algo, workspace_,
                 kWorkspaceBytes, stream_);
  if (s != CUBLAS_STATUS_SUCCESS)
    return InternalError("cublasLtMatmul failed with cuBLAS status " + std::to_string(s) +
                         " for the product " + Shape(p));
  return Status::OK();
}

}  // namespace tierzero::gpt::cuda

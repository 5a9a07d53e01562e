// bf16 products through cuBLASLt with fused epilogues, for the bf16 backend
// (gpt/backend_cuda_bf16.cc): bf16 operands and output, fp32 accumulation.
//
// Column-major, as cuBLAS: D (m x n, ld ldd) = op(A) op(B) + beta C, op(A) m x k, op(B) k x n,
// C being D itself or another matrix laid out as D.
// The epilogue adds a bias (length m) in forward, also applies GELU keeping its input in `aux`
// (GELU_AUX_BIAS), or in backward multiplies by GELU's derivative at `aux` (DGELU) or writes the
// bias gradient: the sums of A over k (BGRADA, length m) or of B over k (BGRADB, length n).
// Algorithms come from cuBLASLt's heuristic, told each operand's alignment, the first one for each
// shape and alignment, kept with its descriptors; the workspace is LtMatmul's own (kWorkspaceBytes
// of device memory, outside the engine's budget, as cuBLAS's own workspace is).
//
// Thread-safety: one thread (the backend's), calls enqueued on its stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <tuple>

#include "gpt/cublaslt_api.h"
#include "tierzero/status.h"

namespace tierzero::gpt::cuda {

enum class Epilogue : uint8_t { kNone, kBias, kGeluAuxBias, kGeluAux, kDGelu, kBGradA, kBGradB };

struct LtProduct {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  float beta = 0;           // 0: D written; 1: C added (D itself, or `c`)
  const void* c = nullptr;  // C, laid out as D (ldd), when it is not D (the residual stream)
  Epilogue epilogue = Epilogue::kNone;
  void* bias = nullptr;  // the bias (read) or its gradient (written)
  void* aux = nullptr;   // GELU's input: written (forward), read (DGELU)
  int64_t aux_ld = 0;
};

class LtMatmul {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  static StatusOr<std::unique_ptr<LtMatmul>> Create(cudaStream_t stream);
  ~LtMatmul();
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;

  // Enqueues the product; an error names the shape when cuBLASLt has no algorithm for it.
  Status Run(const LtProduct& p);
  // Whether cuBLASLt has an algorithm for the product (as its pointers are aligned); false is
  // remembered per shape.
  StatusOr<bool> Supported(const LtProduct& p);

 private:
  LtMatmul() = default;
  struct Plan;
  using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                         Epilogue, int64_t, int64_t>;
  StatusOr<Plan*> PlanFor(const LtProduct& p);

  const CublasLtApi* api_ = nullptr;
  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  std::set<Key> unsupported_;
};

}  // namespace tierzero::gpt::cuda

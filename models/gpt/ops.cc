#include "gpt/ops.h"

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpt/ops_internal.h"
#include "gpt/vec_kernels.h"

namespace tierzero::gpt::cpu {
namespace {

// Column sums of a rows x cols matrix added into out, each column summed over rows in order.
template <typename T>
void AddColumnSums(const T* m, T* out, int64_t rows, int64_t cols) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    const int64_t c0 = blk * kBlock, c1 = std::min(cols, c0 + kBlock);
    T acc[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = m + r * cols;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += row[c];
    }
    for (int64_t c = c0; c < c1; ++c) out[c] += acc[c - c0];
  });
}

}  // namespace

// Note [Matrix products under oneTBB]
// Debian's oneDNN threads with OpenMP, everything else here with oneTBB; the two pools on two
// cores oversubscribe, and OpenMP's spinning between the many small products of a GPT step cost
// 20-40% of the step (measured: 91 ms with both pools, 77 ms with OMP_NUM_THREADS=1). So each
// product is split into fixed blocks of 64 output rows that oneTBB runs in parallel, each a
// single-threaded sgemm. A product with few rows (a small batch through a wide layer: 72 tokens
// of a 2560-wide model are one full block and one of 8 rows) is also split into blocks of 256
// output columns, so it still spreads over the threads. The blocks depend only on the shape,
// never on the thread count, so results do not either.
extern "C" void omp_set_num_threads(int);

namespace detail {
void SgemmOnThisThread(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                       const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                       float* c, int64_t ldc) {
  omp_set_num_threads(1);  // this thread's OpenMP setting: no nested team
  const dnnl_status_t s =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  // Note [A product that fails throws]
  // Gemm returns nothing, and its callers run between a model's forward and backward with no
  // Status to carry. oneDNN fails a product only when it cannot allocate its packing buffers
  // (the host has no memory left: under `ulimit -v`, say) or when given arguments no caller
  // here makes. Either throws: oneTBB carries the exception out of the parallel blocks to the
  // calling thread, and a command's last net turns it into its failure (std::bad_alloc: out of
  // host memory; anything else: a bug), so the run's cleanup runs instead of an abort.
  if (s == dnnl_out_of_memory) throw std::bad_alloc();
  if (s != dnnl_success)
    throw std::runtime_error("dnnl_sgemm(" + std::to_string(m) + " x " + std::to_string(n) + " x " +
                             std::to_string(k) + ") failed with status " +
                             std::to_string(static_cast<int>(s)));
}

}  // namespace detail

namespace {
using detail::SgemmOnThisThread;

// The product in blocks of rows (Note [Matrix products under oneTBB]) on operands as given.
void BlockedSgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                  int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  constexpr int64_t kRows = 64;
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  const int64_t cols = row_blocks >= 4 ? n : 256;
  const int64_t col_blocks = (n + cols - 1) / cols;
  tbb::parallel_for(int64_t{0}, row_blocks * col_blocks, [&](int64_t blk) {
    const int64_t i0 = blk / col_blocks * kRows, rows = std::min(kRows, m - i0);
    const int64_t j0 = blk % col_blocks * cols, ncols = std::min(cols, n - j0);
    const float* ab = ta ? a + i0 : a + i0 * lda;
    const float* bb = tb ? b + j0 * ldb : b + j0;
    SgemmOnThisThread(ta, tb, rows, ncols, k, alpha, ab, lda, bb, ldb, beta, c + i0 * ldc + j0,
                      ldc);
  });
}

// Note [Operands with a 2 KiB stride]
// The row blocks above are small enough that oneDNN's sgemm reads its operands in place (its
// "no-copy" kernels) rather than packing them. Those kernels slow down by up to 1.8x when an
// operand's rows lie a multiple of 2 KiB apart (a leading dimension that is a multiple of 512
// floats: the wide model's 1024-wide MLP activations and c_fc weight) and the operand is read
// across its rows: measured on the 8 x 128-token products of a 256-wide block, with AVX2 kernels
// c_fc's forward ran at 160 GFLOP/s and its weight gradient at 132, c_proj's weight gradient at
// 163, against 250-270 for the same products with a padded copy of the operand, the copy's time
// included; with AVX-512 kernels 340-455 against 440-510. The rows are presumably mapped onto the
// same few cache sets. So such an operand -- any B, and A when it is transposed (A read along its
// rows is unaffected: copying it only cost time) -- is copied once per product into a buffer
// whose rows are 64 bytes further apart, provided the other side of the product has at least
// kPadMinReuse rows to amortise the copy. The copy is bounded: a larger operand is taken in
// slabs along k (the later slabs accumulate into C with beta 1), so the buffers never exceed
// kPadMaxFloats floats each. The values are the same ones, so only the rounding of the slab sums
// can differ from the unpadded product, and the slabs depend only on the shape.
constexpr int64_t kPadMinReuse = 128;
constexpr int64_t kPadMaxFloats = int64_t{1} << 21;  // 8 MiB per operand

bool NeedsPadding(int64_t ld, int64_t reuse) { return ld % 512 == 0 && reuse >= kPadMinReuse; }

// rows x cols of src (leading dimension ld) into buf with padded rows; returns the new leading
// dimension.
int64_t CopyPadded(const float* src, int64_t rows, int64_t cols, int64_t ld,
                   std::vector<float>& buf) {
  int64_t pld = (cols + 15) / 16 * 16 + 16;
  if (pld % 512 == 0) pld += 16;
  buf.resize(static_cast<size_t>(rows * pld));
  float* dst = buf.data();
  ParallelRows(rows, cols,
               [&](int64_t r) { std::copy(src + r * ld, src + r * ld + cols, dst + r * pld); });
  return pld;
}

}  // namespace

template <>
void Gemm<float>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;  // C is empty
  const bool pad_a = ta && NeedsPadding(lda, n);
  const bool pad_b = NeedsPadding(ldb, m);
  if ((!pad_a && !pad_b) || k == 0) {
    BlockedSgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // Each k-slab of A is k_slab x m (A transposed), of B k_slab x n or n x k_slab.
  const int64_t widest = std::max(pad_a ? m : 0, pad_b ? n : 0);
  const int64_t slab = std::max<int64_t>(64, kPadMaxFloats / widest / 64 * 64);
  // The calling thread's buffers, kept between products; a product started on this thread while
  // it waits inside another's blocks (oneTBB may hand it such a task) takes buffers of its own.
  thread_local std::vector<float> kept_a, kept_b;
  thread_local bool kept_in_use = false;
  std::vector<float> own_a, own_b;
  const bool nested = kept_in_use;
  std::vector<float>& a_buf = nested ? own_a : kept_a;
  std::vector<float>& b_buf = nested ? own_b : kept_b;
  kept_in_use = true;
  for (int64_t k0 = 0; k0 < k; k0 += slab) {
    const int64_t kk = std::min(slab, k - k0);
    const float* as = ta ? a + k0 * lda : a + k0;
    const float* bs = tb ? b + k0 : b + k0 * ldb;
    int64_t las = lda, lbs = ldb;
    if (pad_a) {
      las = CopyPadded(as, kk, m, lda, a_buf);
      as = a_buf.data();
    }
    if (pad_b) {
      lbs = tb ? CopyPadded(bs, n, kk, ldb, b_buf) : CopyPadded(bs, kk, n, ldb, b_buf);
      bs = b_buf.data();
    }
    BlockedSgemm(ta, tb, m, n, kk, alpha, as, las, bs, lbs, k0 == 0 ? beta : 1.0f, c, ldc);
  }
  if (!nested) kept_in_use = false;
}

template <>
void Gemm<double>(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                  int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  ParallelRows(m, n * k, [&](int64_t i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? a[p * lda + i] : a[i * lda + p];
        const double bv = tb ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      c[i * ldc + j] = alpha * acc + (beta == 0 ? 0.0 : beta * c[i * ldc + j]);
    }
  });
}

template <typename T>
void LinearForward(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t in,
                   int64_t out) {
  Gemm<T>(false, false, rows, out, in, T(1), x, in, w, out, T(0), y, out);
  if (bias != nullptr) {
    ParallelRows(rows, out, [&](int64_t r) {
      T* yr = y + r * out;
      for (int64_t j = 0; j < out; ++j) yr[j] += bias[j];
    });
  }
}

template <typename T>
void LinearBackward(const T* dy, const T* x, const T* w, T* dx, T* dw, T* dbias, int64_t rows,
                    int64_t in, int64_t out) {
  if (dx != nullptr) Gemm<T>(false, true, rows, in, out, T(1), dy, out, w, out, T(0), dx, in);
  Gemm<T>(true, false, in, out, rows, T(1), x, in, dy, out, T(1), dw, out);
  if (dbias != nullptr) AddColumnSums(dy, dbias, rows, out);
}

template <typename T>
void LayerNormForward(const T* x, const T* gamma, const T* beta, T* y, T* mean, T* rstd,
                      int64_t rows, int64_t cols) {
  ParallelRows(rows, cols, [&](int64_t r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T mu = 0;
    for (int64_t j = 0; j < cols; ++j) mu += xr[j];
    mu /= static_cast<T>(cols);
    T var = 0;
    for (int64_t j = 0; j < cols; ++j) var += (xr[j] - mu) * (xr[j] - mu);
    var /= static_cast<T>(cols);
    const T rs = T(1) / std::sqrt(var + T(1e-5));
    for (int64_t j = 0; j < cols; ++j) yr[j] = (xr[j] - mu) * rs * gamma[j] + beta[j];
    mean[r] = mu;
    rstd[r] = rs;
  });
}

template <typename T>
void LayerNormBackward(const T* dy, const T* x, const T* gamma, const T* mean, const T* rstd, T* dx,
                       T* dgamma, T* dbeta, int64_t rows, int64_t cols) {
  ParallelRows(rows, cols, [&](int64_t r) {
    const T* dyr = dy + r * cols;
    const T* xr = x + r * cols;
    T* dxr = dx + r * cols;
    const T mu = mean[r], rs = rstd[r];
    T sum_g = 0, sum_gx = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const T g = dyr[j] * gamma[j];
      sum_g += g;
      sum_gx += g * (xr[j] - mu) * rs;
    }
    sum_g /= static_cast<T>(cols);
    sum_gx /= static_cast<T>(cols);
    for (int64_t j = 0; j < cols; ++j) {
      const T xhat = (xr[j] - mu) * rs;
      dxr[j] = rs * (dyr[j] * gamma[j] - sum_g - xhat * sum_gx);
    }
  });
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t blk) {
    const int64_t c0 = blk * kBlock, c1 = std::min(cols, c0 + kBlock);
    T ag[kBlock] = {}, ab[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T* dyr = dy + r * cols;
      const T* xr = x + r * cols;
      for (int64_t c = c0; c < c1; ++c) {
        ag[c - c0] += dyr[c] * (xr[c] - mean[r]) * rstd[r];
        ab[c - c0] += dyr[c];
      }
    }
    for (int64_t c = c0; c < c1; ++c) {
      dgamma[c] += ag[c - c0];
      dbeta[c] += ab[c - c0];
    }
  });
}

namespace {
template <typename T>
constexpr T kGeluC = static_cast<T>(0.7978845608028654);  // sqrt(2 / pi)
}

template <typename T>
void GeluForward(const T* x, T* y, int64_t n) {
  ParallelRows((n + 1023) / 1024, 1024, [&](int64_t b) {
    const int64_t e = std::min(n, (b + 1) * 1024);
    for (int64_t i = b * 1024; i < e; ++i) {
      const T v = x[i];
      y[i] = T(0.5) * v * (T(1) + std::tanh(kGeluC<T> * (v + T(0.044715) * v * v * v)));
    }
  });
}

template <typename T>
void GeluBackward(const T* dy, const T* x, T* dx, int64_t n) {
  ParallelRows((n + 1023) / 1024, 1024, [&](int64_t b) {
    const int64_t e = std::min(n, (b + 1) * 1024);
    for (int64_t i = b * 1024; i < e; ++i) {
      const T v = x[i];
      const T u = kGeluC<T> * (v + T(0.044715) * v * v * v);
      const T t = std::tanh(u);
      const T du = kGeluC<T> * (T(1) + T(3) * T(0.044715) * v * v);
      dx[i] = dy[i] * (T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du);
    }
  });
}

// fp32: Note [GELU through one exponential] (vec_kernels.h); the generic versions above are
// the fp64 reference the tests compare with.
template <>
void GeluForward<float>(const float* x, float* y, int64_t n) {
  const internal::VectorKernels& k = internal::ActiveVectorKernels();
  constexpr int64_t kBlock = 4096;
  ParallelRows((n + kBlock - 1) / kBlock, kBlock, [&](int64_t b) {
    const int64_t e = std::min(n, (b + 1) * kBlock);
    k.gelu_forward(x + b * kBlock, y + b * kBlock, e - b * kBlock);
  });
}

template <>
void GeluBackward<float>(const float* dy, const float* x, float* dx, int64_t n) {
  const internal::VectorKernels& k = internal::ActiveVectorKernels();
  constexpr int64_t kBlock = 4096;
  ParallelRows((n + kBlock - 1) / kBlock, kBlock, [&](int64_t b) {
    const int64_t e = std::min(n, (b + 1) * kBlock);
    k.gelu_backward(dy + b * kBlock, x + b * kBlock, dx + b * kBlock, e - b * kBlock);
  });
}

template <typename T>
void EmbeddingForward(const int32_t* tokens, const T* wte, const T* wpe, T* x, int64_t batch,
                      int64_t seq, int64_t channels) {
  ParallelRows(batch * seq, channels, [&](int64_t r) {
    const T* te = wte + static_cast<int64_t>(tokens[r]) * channels;
    T* xr = x + r * channels;
    if (wpe == nullptr) {
      for (int64_t j = 0; j < channels; ++j) xr[j] = te[j];
      return;
    }
    const T* pe = wpe + (r % seq) * channels;
    for (int64_t j = 0; j < channels; ++j) xr[j] = te[j] + pe[j];
  });
}

template <typename T>
void EmbeddingBackward(const int32_t* tokens, const T* dx, T* dwte, T* dwpe, int64_t batch,
                       int64_t seq, int64_t channels) {
  for (int64_t r = 0; r < batch * seq; ++r) {
    const T* d = dx + r * channels;
    T* te = dwte + static_cast<int64_t>(tokens[r]) * channels;
    for (int64_t j = 0; j < channels; ++j) te[j] += d[j];
    if (dwpe == nullptr) continue;
    T* pe = dwpe + (r % seq) * channels;
    for (int64_t j = 0; j < channels; ++j) pe[j] += d[j];
  }
}

template <typename T>
double CrossEntropy(const T* logits, const int32_t* targets, const float* mask, T* dlogits,
                    int32_t* argmax, int64_t rows, int64_t vocab, double scale) {
  double count = 0;
  for (int64_t r = 0; r < rows; ++r) count += mask[r];
  std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
  const double inv = count > 0 ? 1.0 / count : 0.0;
  ParallelRows(rows, vocab, [&](int64_t r) {
    const T* l = logits + r * vocab;
    int64_t best = 0;
    T mx = l[0];
    for (int64_t j = 1; j < vocab; ++j) {
      if (l[j] > mx) {
        mx = l[j];
        best = j;
      }
    }
    if (argmax != nullptr) argmax[r] = static_cast<int32_t>(best);
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(l[j] - mx));
    const double lse = std::log(sum) + static_cast<double>(mx);
    row_loss[static_cast<size_t>(r)] = mask[r] * (lse - static_cast<double>(l[targets[r]]));
    if (dlogits != nullptr) {
      T* d = dlogits + r * vocab;
      const double w = mask[r] * inv * scale;
      for (int64_t j = 0; j < vocab; ++j) {
        const double p = std::exp(static_cast<double>(l[j]) - lse);
        d[j] = static_cast<T>(w * (p - (j == targets[r] ? 1.0 : 0.0)));
      }
    }
  });
  double loss = 0;
  for (double v : row_loss) loss += v;
  return loss * inv;
}

template <typename T>
void LinearForwardOutIn(const T* x, const T* w, const T* bias, T* y, int64_t rows, int64_t in,
                        int64_t out) {
  Gemm<T>(false, true, rows, out, in, T(1), x, in, w, in, T(0), y, out);
  if (bias != nullptr) {
    ParallelRows(rows, out, [&](int64_t r) {
      T* yr = y + r * out;
      for (int64_t j = 0; j < out; ++j) yr[j] += bias[j];
    });
  }
}

template <typename T>
void LinearBackwardOutIn(const T* dy, const T* x, const T* w, T* dx, T* dw, T* dbias, int64_t rows,
                         int64_t in, int64_t out) {
  if (dx != nullptr) Gemm<T>(false, false, rows, in, out, T(1), dy, out, w, in, T(0), dx, in);
  Gemm<T>(true, false, out, in, rows, T(1), dy, out, x, in, T(1), dw, in);
  if (dbias != nullptr) AddColumnSums(dy, dbias, rows, out);
}

template <typename T>
void Add(const T* a, const T* b, T* y, int64_t n) {
  ParallelRows((n + 4095) / 4096, 4096, [&](int64_t blk) {
    const int64_t e = std::min(n, (blk + 1) * 4096);
    for (int64_t i = blk * 4096; i < e; ++i) y[i] = a[i] + b[i];
  });
}

template <typename T>
void AddInPlace(T* y, const T* a, int64_t n) {
  ParallelRows((n + 4095) / 4096, 4096, [&](int64_t blk) {
    const int64_t e = std::min(n, (blk + 1) * 4096);
    for (int64_t i = blk * 4096; i < e; ++i) y[i] += a[i];
  });
}

#define TZ_INSTANTIATE(T)                                                                          \
  template void LinearForward<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);     \
  template void LinearBackward<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t,      \
                                  int64_t);                                                        \
  template void LinearForwardOutIn<T>(const T*, const T*, const T*, T*, int64_t, int64_t,          \
                                      int64_t);                                                    \
  template void LinearBackwardOutIn<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, \
                                       int64_t);                                                   \
  template void LayerNormForward<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t);   \
  template void LayerNormBackward<T>(const T*, const T*, const T*, const T*, const T*, T*, T*, T*, \
                                     int64_t, int64_t);                                            \
  template void GeluForward<T>(const T*, T*, int64_t);                                             \
  template void GeluBackward<T>(const T*, const T*, T*, int64_t);                                  \
  template void EmbeddingForward<T>(const int32_t*, const T*, const T*, T*, int64_t, int64_t,      \
                                    int64_t);                                                      \
  template void EmbeddingBackward<T>(const int32_t*, const T*, T*, T*, int64_t, int64_t, int64_t); \
  template double CrossEntropy<T>(const T*, const int32_t*, const float*, T*, int32_t*, int64_t,   \
                                  int64_t, double);                                                \
  template void Add<T>(const T*, const T*, T*, int64_t);                                           \
  template void AddInPlace<T>(T*, const T*, int64_t);

TZ_INSTANTIATE(float)
TZ_INSTANTIATE(double)
#undef TZ_INSTANTIATE

}  // namespace tierzero::gpt::cpu

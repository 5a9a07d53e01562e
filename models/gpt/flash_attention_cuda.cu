// Fused causal attention on bf16 tensor cores (gpt/flash_attention_cuda.h).
//
// Note [Fused causal attention]
// The batched-products attention (tensor_core_cuda.cu) writes each head's T x T scores in fp32,
// rewrites them as probabilities, rounds them to bf16, and in backward writes and reads two more
// T x T matrices: at seq 1024 that traffic, not the products, is its time, and half of every
// product is the masked triangle. These kernels follow FlashAttention-2's plan instead:
//
// - Forward, one block per (64 query rows, batch x head), four warps of 16 rows: the block's
//   queries stay in shared memory as bf16 while the key and value tiles at or before them pass
//   through (the masked tiles are never visited). A warp's scores (16 x 64, wmma bf16 products
//   with fp32 accumulation) go through an online softmax (a running maximum m and sum l per row;
//   the output accumulated so far is rescaled by exp(m_old - m_new) before the tile's p v is
//   added), so probabilities exist only per tile. What backward needs is each row's
//   log-sum-exp m + log l (B x H x T floats in place of B x H x T x T).
// - Backward recomputes each tile's probabilities as exp(s - lse) and uses
//   D = rowsum(dout . out) for the softmax gradient ds = p (dp - D) scale. To stay deterministic
//   (no atomics: every output element written once, sums in a fixed order) it runs two kernels:
//   one block per key tile accumulating dk and dv over the query tiles after it, one per query
//   tile accumulating dq over the key tiles before it; the second recomputes the scores and dp,
//   seven products per tile pair where an atomic dq would need five.
//
// The kernels read and write fp32 (the fp32-activation backend) or bf16 (the bf16 one: Note
// [Activation types]); either way operands are rounded to bf16 as the batched path rounds them (q,
// k, v, dout, and p and ds before their products); the softmax, its statistics and every
// accumulation are fp32. Tiles of 64 keep a block's shared memory under 128 KiB at head width 128:
// 110 and 111 KiB for the forward and dq kernels (two blocks of four warps per H100 SM), 120.5 KiB
// for the key-value kernel (one), which ptxas also gives 255 registers and a few bytes of spills
// there: where tuning would start. Rows and keys past seq are loaded as zeros and masked, so any
// seq works; head widths are 32, 64, 96 and 128 (one instantiation each), others take the batched
// path.
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "gpt/backend.h"
#include "gpt/flash_attention_cuda.h"
#include "gpt/kernels_cuda.cuh"

namespace tierzero::gpt::cuda {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;  // query rows and key rows per tile
constexpr int kWarps = 4;  // a warp owns 16 of a tile's rows
constexpr int kRows = 16;  // the wmma shape's M (and N, K)
constexpr int kBlockThreads = kWarps * kWarp;
constexpr int kSLd = kTile + 4;  // fp32 rows of a warp's 16 x 64 scores (wmma: a multiple of 4)
constexpr int kPLd = kTile + 8;  // bf16 rows of a warp's 16 x 64 probabilities (a multiple of 8)
constexpr int kMaxGridY = 65535;

using FragA = wmma::fragment<wmma::matrix_a, kRows, kRows, kRows, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, kRows, kRows, kRows, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, kRows, kRows, kRows, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kRows, kRows, kRows, float>;

// bf16 rows of a 64 x HD tile in shared memory: padded by 16 bytes against bank conflicts; every
// 16-row step stays 32-byte aligned as wmma requires.
template <int HD>
constexpr int kTileLd = HD + 8;

__device__ inline float ToFloat(float v) { return v; }
__device__ inline float ToFloat(bf16 v) { return __bfloat162float(v); }
template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ inline bf16 FromFloat<bf16>(float v) {
  return __float2bfloat16_rn(v);
}

// The operands of one call: q, k, v (and dq, dk, dv, strided alike) with their row strides, out
// and dout (rows of heads x HD, ld_o apart); query head h reads key/value head h / group.
template <typename T>
struct Operands {
  const T *q, *k, *v;
  T *dq, *dk, *dv;
  int64_t ld_q, ld_k, ld_v, ld_o;
  int heads, kv_heads;
  __device__ int group() const { return heads / kv_heads; }
};

// Rows [row0, row0 + 64) of one head's slice (element (t, c) at src[t * ld + c], c < HD) into
// dst as bf16; rows at or past seq as zeros. src and ld keep 16-byte alignment (C % 32 == 0).
template <int HD, typename T>
__device__ void LoadTile(const T* src, int64_t ld, int64_t row0, int64_t seq, bf16* dst) {
  if constexpr (sizeof(T) == 4) {
    constexpr int kVec = HD / 4;
    for (int i = threadIdx.x; i < kTile * kVec; i += kBlockThreads) {
      const int r = i / kVec, c = (i - r * kVec) * 4;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (row0 + r < seq) v = *reinterpret_cast<const float4*>(src + (row0 + r) * ld + c);
      __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(dst + r * kTileLd<HD> + c);
      d[0] = __floats2bfloat162_rn(v.x, v.y);
      d[1] = __floats2bfloat162_rn(v.z, v.w);
    }
  } else {  // bf16 already: eight elements (16 bytes) at a time
    constexpr int kVec = HD / 8;
    for (int i = threadIdx.x; i < kTile * kVec; i += kBlockThreads) {
      const int r = i / kVec, c = (i - r * kVec) * 8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (row0 + r < seq) v = *reinterpret_cast<const uint4*>(src + (row0 + r) * ld + c);
      *reinterpret_cast<uint4*>(dst + r * kTileLd<HD> + c) = v;
    }
  }
}

// s (16 x 64 fp32, row stride kSLd) = a b^T for a warp: a is 16 x HD and b 64 x HD, both bf16
// row-major with stride TileLd (b read as the column-major HD x 64 matrix b^T).
template <int HD>
__device__ void ScoresTile(const bf16* a, const bf16* b, float* s) {
  constexpr int ld = kTileLd<HD>;
  FragA fa[HD / kRows];
#pragma unroll
  for (int k = 0; k < HD / kRows; ++k) wmma::load_matrix_sync(fa[k], a + k * kRows, ld);
#pragma unroll
  for (int j = 0; j < kTile / kRows; ++j) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int k = 0; k < HD / kRows; ++k) {
      FragBCol fb;
      wmma::load_matrix_sync(fb, b + j * kRows * ld + k * kRows, ld);
      wmma::mma_sync(acc, fa[k], fb, acc);
    }
    wmma::store_matrix_sync(s + j * kRows, acc, kSLd, wmma::mem_row_major);
  }
}

// acc (16 x HD, in HD / 16 fragments) += p b for a warp: p is 16 x 64 bf16 (stride kPLd), b is
// 64 x HD bf16 row-major (stride TileLd).
template <int HD>
__device__ void AccumulateTile(FragC (&acc)[HD / kRows], const bf16* p, const bf16* b) {
  constexpr int ld = kTileLd<HD>;
#pragma unroll
  for (int k = 0; k < kTile / kRows; ++k) {
    FragA fa;
    wmma::load_matrix_sync(fa, p + k * kRows, kPLd);
#pragma unroll
    for (int j = 0; j < HD / kRows; ++j) {
      FragBRow fb;
      wmma::load_matrix_sync(fb, b + k * kRows * ld + j * kRows, ld);
      wmma::mma_sync(acc[j], fa, fb, acc[j]);
    }
  }
}

// Writes a warp's 16 x HD accumulator to rows row0.. of dst (stride ld; rows at or past seq
// skipped), through `stage` (16 x 16 fp32 of stride kSLd, the warp's own).
template <int HD, typename T>
__device__ void StoreRows(const FragC (&acc)[HD / kRows], float* stage, T* dst, int64_t ld,
                          int64_t row0, int64_t seq) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int j = 0; j < HD / kRows; ++j) {
    wmma::store_matrix_sync(stage, acc[j], kSLd, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < kRows * kRows; i += kWarp) {
      const int r = i / kRows, c = i % kRows;
      if (row0 + r < seq) dst[(row0 + r) * ld + j * kRows + c] = FromFloat<T>(stage[r * kSLd + c]);
    }
    __syncwarp();
  }
}

template <int HD>
constexpr size_t ForwardSmem() {
  return 3 * kTile * kTileLd<HD> * sizeof(bf16) + kWarps * kRows * kSLd * sizeof(float) +
         kWarps * kRows * kPLd * sizeof(bf16) + kWarps * kRows * (HD + 4) * sizeof(float);
}

// Grid (query tiles, batch x heads from bh0). Each lane pair (2r, 2r + 1) of a warp owns its row
// r's softmax, each lane half the tile's 64 columns.
template <int HD, typename T>
__global__ void __launch_bounds__(kBlockThreads)
    FusedForwardKernel(Operands<T> op, T* out, float* lse, int64_t seq, int64_t bh0, float scale) {
  constexpr int ld = kTileLd<HD>, kOLd = HD + 4;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* ks = qs + kTile * ld;
  bf16* vs = ks + kTile * ld;
  float* ss = reinterpret_cast<float*>(vs + kTile * ld);
  bf16* ps = reinterpret_cast<bf16*>(ss + kWarps * kRows * kSLd);
  float* os = reinterpret_cast<float*>(ps + kWarps * kRows * kPLd);

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t qt = gridDim.x - 1 - blockIdx.x;  // the longest rows start first
  const int64_t bh = bh0 + blockIdx.y, b = bh / op.heads, h = bh % op.heads, kvh = h / op.group();
  const T* qb = op.q + b * seq * op.ld_q + h * HD;
  const T* kb = op.k + b * seq * op.ld_k + kvh * HD;
  const T* vb = op.v + b * seq * op.ld_v + kvh * HD;
  float* s_w = ss + warp * kRows * kSLd;
  bf16* p_w = ps + warp * kRows * kPLd;
  float* o_w = os + warp * kRows * kOLd;
  const int r = lane / 2, half = lane % 2;
  const int64_t tq = qt * kTile + warp * kRows + r;

  LoadTile<HD, T>(qb, op.ld_q, qt * kTile, seq, qs);
  for (int i = lane; i < kRows * kOLd; i += kWarp) o_w[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t kt = 0; kt <= qt; ++kt) {
    __syncthreads();  // every warp is done with the last tile's keys and values
    LoadTile<HD, T>(kb, op.ld_k, kt * kTile, seq, ks);
    LoadTile<HD, T>(vb, op.ld_v, kt * kTile, seq, vs);
    __syncthreads();
    ScoresTile<HD>(qs + warp * kRows * ld, ks, s_w);
    __syncwarp();
    // The online softmax of row r. Column 0 of every visited tile is at or before the row's
    // query, so the pair's maximum is finite and corr is 0 on the first tile.
    const float* srow = s_w + r * kSLd + half * 32;
    const int64_t s0 = kt * kTile + half * 32;
    float x[32];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      x[c] = s0 + c <= tq ? srow[c] * scale : -INFINITY;
      mx = fmaxf(mx, x[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m, mx);
    const float corr = __expf(m - m_new);
    float sum = 0.0f;
    bf16* prow = p_w + r * kPLd + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const float p = __expf(x[c] - m_new);
      sum += p;
      prow[c] = __float2bfloat16_rn(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * corr + sum;
    m = m_new;
    float* orow = o_w + r * kOLd + half * (HD / 2);
    for (int c = 0; c < HD / 2; ++c) orow[c] *= corr;
    __syncwarp();
#pragma unroll
    for (int j = 0; j < HD / kRows; ++j) {  // o += p v, through the fp32 rows in o_w
      FragC acc;
      wmma::load_matrix_sync(acc, o_w + j * kRows, kOLd, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < kTile / kRows; ++k) {
        FragA fa;
        FragBRow fb;
        wmma::load_matrix_sync(fa, p_w + k * kRows, kPLd);
        wmma::load_matrix_sync(fb, vs + k * kRows * ld + j * kRows, ld);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(o_w + j * kRows, acc, kOLd, wmma::mem_row_major);
    }
    __syncwarp();
  }
  if (tq < seq) {
    const float inv = 1.0f / l;
    const float* orow = o_w + r * kOLd + half * (HD / 2);
    T* dst = out + (b * seq + tq) * op.ld_o + h * HD + half * (HD / 2);
    for (int c = 0; c < HD / 2; ++c) dst[c] = FromFloat<T>(orow[c] * inv);
    if (half == 0) lse[bh * seq + tq] = m + logf(l);
  }
}

// One warp per (b, t, h): rowdot[(b H + h) T + t] = dout . out over the head's columns.
template <typename T>
__global__ void RowDotKernel(const T* dout, const T* out, float* rowdot, int64_t rows, int64_t seq,
                             int64_t ld_o, int heads, int hd) {
  const int64_t i = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / kWarp;
  if (i >= rows) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t bt = i / heads, h = i % heads, b = bt / seq, t = bt % seq;
  const T* g = dout + bt * ld_o + h * hd;
  const T* o = out + bt * ld_o + h * hd;
  float d = 0.0f;
  for (int c = lane; c < hd; c += kWarp) d += ToFloat(g[c]) * ToFloat(o[c]);
  d = WarpSum(d);
  if (lane == 0) rowdot[(b * heads + h) * seq + t] = d;
}

template <int HD>
constexpr size_t BackwardKvSmem() {
  return 4 * kTile * kTileLd<HD> * sizeof(bf16) + 2 * kWarps * kRows * kSLd * sizeof(float) +
         2 * kWarps * kRows * kPLd * sizeof(bf16) + 2 * kTile * sizeof(float);
}

// Grid (key tiles, batch x key/value heads from bh0): dk and dv of 64 keys, over the query tiles
// at or after them of each query head of the group in turn (deterministic: no atomics). A warp owns
// 16 keys; its lane pair (2r, 2r + 1) key r's row of the transposed tile (p^T, ds^T), each lane
// half the 64 queries.
template <int HD, typename T>
__global__ void __launch_bounds__(kBlockThreads)
    FusedBackwardKvKernel(const T* dout, Operands<T> op, const float* lse, const float* rowdot,
                          int64_t seq, int64_t bh0, float scale) {
  constexpr int ld = kTileLd<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* dos = qs + kTile * ld;
  bf16* ks = dos + kTile * ld;
  bf16* vs = ks + kTile * ld;
  float* sts = reinterpret_cast<float*>(vs + kTile * ld);
  float* dpts = sts + kWarps * kRows * kSLd;
  bf16* pts = reinterpret_cast<bf16*>(dpts + kWarps * kRows * kSLd);
  bf16* dsts = pts + kWarps * kRows * kPLd;
  float* lse_s = reinterpret_cast<float*>(dsts + kWarps * kRows * kPLd);
  float* rd_s = lse_s + kTile;

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t kt = blockIdx.x;  // the earliest keys (the most query tiles) start first
  const int64_t nq = gridDim.x;
  const int64_t bkv = bh0 + blockIdx.y, b = bkv / op.kv_heads, kvh = bkv % op.kv_heads;
  const T* kb = op.k + b * seq * op.ld_k + kvh * HD;
  const T* vb = op.v + b * seq * op.ld_v + kvh * HD;
  float* st_w = sts + warp * kRows * kSLd;
  float* dpt_w = dpts + warp * kRows * kSLd;
  bf16* pt_w = pts + warp * kRows * kPLd;
  bf16* dst_w = dsts + warp * kRows * kPLd;
  const int r = lane / 2, half = lane % 2;
  const int64_t key = kt * kTile + warp * kRows + r;

  LoadTile<HD, T>(kb, op.ld_k, kt * kTile, seq, ks);
  LoadTile<HD, T>(vb, op.ld_v, kt * kTile, seq, vs);
  FragC dk[HD / kRows], dv[HD / kRows];
#pragma unroll
  for (int j = 0; j < HD / kRows; ++j) {
    wmma::fill_fragment(dk[j], 0.0f);
    wmma::fill_fragment(dv[j], 0.0f);
  }
  for (int64_t hq = 0; hq < op.group(); ++hq)
    for (int64_t qt = kt; qt < nq; ++qt) {
      const int64_t h = kvh * op.group() + hq, bh = b * op.heads + h;
      __syncthreads();  // every warp is done with the last query tile
      LoadTile<HD, T>(op.q + b * seq * op.ld_q + h * HD, op.ld_q, qt * kTile, seq, qs);
      LoadTile<HD, T>(dout + b * seq * op.ld_o + h * HD, op.ld_o, qt * kTile, seq, dos);
      for (int i = threadIdx.x; i < kTile; i += kBlockThreads) {
        const int64_t t = qt * kTile + i;
        lse_s[i] = t < seq ? lse[bh * seq + t] : 0.0f;
        rd_s[i] = t < seq ? rowdot[bh * seq + t] : 0.0f;
      }
      __syncthreads();
      ScoresTile<HD>(ks + warp * kRows * ld, qs, st_w);    // s^T = k q^T
      ScoresTile<HD>(vs + warp * kRows * ld, dos, dpt_w);  // dp^T = v dout^T
      __syncwarp();
#pragma unroll 8
      for (int c = 0; c < 32; ++c) {
        const int col = half * 32 + c;
        const int64_t t = qt * kTile + col;
        const bool valid = key <= t && t < seq;
        const float p = valid ? __expf(st_w[r * kSLd + col] * scale - lse_s[col]) : 0.0f;
        const float ds = p * (dpt_w[r * kSLd + col] - rd_s[col]) * scale;
        pt_w[r * kPLd + col] = __float2bfloat16_rn(p);
        dst_w[r * kPLd + col] = __float2bfloat16_rn(ds);
      }
      __syncwarp();
      AccumulateTile<HD>(dv, pt_w, dos);  // dv += p^T dout
      AccumulateTile<HD>(dk, dst_w, qs);  // dk += ds^T q
    }
  StoreRows<HD>(dk, st_w, op.dk + b * seq * op.ld_k + kvh * HD, op.ld_k, kt * kTile + warp * kRows,
                seq);
  StoreRows<HD>(dv, st_w, op.dv + b * seq * op.ld_v + kvh * HD, op.ld_v, kt * kTile + warp * kRows,
                seq);
}

template <int HD>
constexpr size_t BackwardQSmem() {
  return 4 * kTile * kTileLd<HD> * sizeof(bf16) + 2 * kWarps * kRows * kSLd * sizeof(float) +
         kWarps * kRows * kPLd * sizeof(bf16);
}

// Grid (query tiles, batch x heads from bh0): dq of 64 queries, over the key tiles at or before
// them. Lane pairs as in the forward.
template <int HD, typename T>
__global__ void __launch_bounds__(kBlockThreads)
    FusedBackwardQKernel(const T* dout, Operands<T> op, const float* lse, const float* rowdot,
                         int64_t seq, int64_t bh0, float scale) {
  constexpr int ld = kTileLd<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* dos = qs + kTile * ld;
  bf16* ks = dos + kTile * ld;
  bf16* vs = ks + kTile * ld;
  float* ss = reinterpret_cast<float*>(vs + kTile * ld);
  float* dps = ss + kWarps * kRows * kSLd;
  bf16* dss = reinterpret_cast<bf16*>(dps + kWarps * kRows * kSLd);

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t qt = gridDim.x - 1 - blockIdx.x;  // the longest rows start first
  const int64_t bh = bh0 + blockIdx.y, b = bh / op.heads, h = bh % op.heads, kvh = h / op.group();
  const T* kb = op.k + b * seq * op.ld_k + kvh * HD;
  const T* vb = op.v + b * seq * op.ld_v + kvh * HD;
  float* s_w = ss + warp * kRows * kSLd;
  float* dp_w = dps + warp * kRows * kSLd;
  bf16* ds_w = dss + warp * kRows * kPLd;
  const int r = lane / 2, half = lane % 2;
  const int64_t tq = qt * kTile + warp * kRows + r;
  const float row_lse = tq < seq ? lse[bh * seq + tq] : 0.0f;
  const float row_dot = tq < seq ? rowdot[bh * seq + tq] : 0.0f;

  LoadTile<HD, T>(op.q + b * seq * op.ld_q + h * HD, op.ld_q, qt * kTile, seq, qs);
  LoadTile<HD, T>(dout + b * seq * op.ld_o + h * HD, op.ld_o, qt * kTile, seq, dos);
  FragC dq[HD / kRows];
#pragma unroll
  for (int j = 0; j < HD / kRows; ++j) wmma::fill_fragment(dq[j], 0.0f);
  for (int64_t kt = 0; kt <= qt; ++kt) {
    __syncthreads();  // every warp is done with the last key tile (and qs, dos are loaded)
    LoadTile<HD, T>(kb, op.ld_k, kt * kTile, seq, ks);
    LoadTile<HD, T>(vb, op.ld_v, kt * kTile, seq, vs);
    __syncthreads();
    ScoresTile<HD>(qs + warp * kRows * ld, ks, s_w);    // s = q k^T
    ScoresTile<HD>(dos + warp * kRows * ld, vs, dp_w);  // dp = dout v^T
    __syncwarp();
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const int col = half * 32 + c;
      const bool valid = kt * kTile + col <= tq && tq < seq;
      const float p = valid ? __expf(s_w[r * kSLd + col] * scale - row_lse) : 0.0f;
      ds_w[r * kPLd + col] = __float2bfloat16_rn(p * (dp_w[r * kSLd + col] - row_dot) * scale);
    }
    __syncwarp();
    AccumulateTile<HD>(dq, ds_w, ks);  // dq += ds k
  }
  StoreRows<HD>(dq, s_w, op.dq + b * seq * op.ld_q + h * HD, op.ld_q, qt * kTile + warp * kRows,
                seq);
}

// Launches `kernel(args..., bh0, scale)` over (tiles, batch x heads) in slices of grid y's
// limit, its dynamic shared memory limit raised first (the default is 48 KiB; set on every call:
// it is per device, and costs microseconds against the kernels' milliseconds).
template <typename... Params, typename... Args>
cudaError_t LaunchTiles(void (*kernel)(Params...), size_t smem, int64_t tiles, int64_t bh,
                        float scale, cudaStream_t stream, Args... args) {
  if (const cudaError_t e = cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  for (int64_t bh0 = 0; bh0 < bh; bh0 += kMaxGridY) {
    const dim3 grid(static_cast<unsigned>(tiles),
                    static_cast<unsigned>(bh - bh0 < kMaxGridY ? bh - bh0 : kMaxGridY));
    kernel<<<grid, kBlockThreads, smem, stream>>>(args..., bh0, scale);
  }
  return cudaGetLastError();
}

template <int HD, typename T>
cudaError_t Forward(const Operands<T>& op, T* out, float* lse, int64_t batch, int64_t seq,
                    float scale, cudaStream_t stream) {
  return LaunchTiles(FusedForwardKernel<HD, T>, ForwardSmem<HD>(), (seq + kTile - 1) / kTile,
                     batch * op.heads, scale, stream, op, out, lse, seq);
}

template <int HD, typename T>
cudaError_t Backward(const T* dout, const Operands<T>& op, const float* lse, const float* rowdot,
                     int64_t batch, int64_t seq, float scale, cudaStream_t stream) {
  const int64_t tiles = (seq + kTile - 1) / kTile;
  if (const cudaError_t e =
          LaunchTiles(FusedBackwardKvKernel<HD, T>, BackwardKvSmem<HD>(), tiles,
                      batch * op.kv_heads, scale, stream, dout, op, lse, rowdot, seq);
      e != cudaSuccess)
    return e;
  return LaunchTiles(FusedBackwardQKernel<HD, T>, BackwardQSmem<HD>(), tiles, batch * op.heads,
                     scale, stream, dout, op, lse, rowdot, seq);
}

// The tiles load 16 bytes at a time: every matrix must start 16-byte aligned and its rows lie
// 16-byte multiples apart (the engine's allocations are 256-byte aligned; widths are multiples of
// 32 elements for every supported head width).
bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
template <typename T>
bool Rows16(int64_t ld) {
  return (ld * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

template <typename T>
cudaError_t Check(const Operands<T>& op, int64_t hd, bool backward, const T* out, const T* dout) {
  if (!FusedAttentionHeadWidth(hd) || op.kv_heads < 1 || op.heads % op.kv_heads != 0)
    return cudaErrorInvalidValue;
  for (const void* p : {static_cast<const void*>(op.q), static_cast<const void*>(op.k),
                        static_cast<const void*>(op.v), static_cast<const void*>(out)})
    if (!Aligned16(p)) return cudaErrorMisalignedAddress;
  if (backward)
    for (const void* p : {static_cast<const void*>(op.dq), static_cast<const void*>(op.dk),
                          static_cast<const void*>(op.dv), static_cast<const void*>(dout)})
      if (!Aligned16(p)) return cudaErrorMisalignedAddress;
  if (!Rows16<T>(op.ld_q) || !Rows16<T>(op.ld_k) || !Rows16<T>(op.ld_v) || !Rows16<T>(op.ld_o))
    return cudaErrorMisalignedAddress;
  return cudaSuccess;
}

template <typename T>
cudaError_t AttentionForward(const Operands<T>& op, T* out, float* lse, int64_t batch, int64_t seq,
                             int64_t hd, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (batch * seq == 0) return cudaSuccess;
  if (const cudaError_t e = Check(op, hd, false, out, out); e != cudaSuccess) return e;
  switch (hd) {
    case 32:
      return Forward<32>(op, out, lse, batch, seq, scale, stream);
    case 64:
      return Forward<64>(op, out, lse, batch, seq, scale, stream);
    case 96:
      return Forward<96>(op, out, lse, batch, seq, scale, stream);
    default:
      return Forward<128>(op, out, lse, batch, seq, scale, stream);
  }
}

template <typename T>
cudaError_t AttentionBackward(const T* dout, const Operands<T>& op, const T* out, const float* lse,
                              float* rowdot, int64_t batch, int64_t seq, int64_t hd,
                              cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (batch * seq == 0) return cudaSuccess;
  if (const cudaError_t e = Check(op, hd, true, out, dout); e != cudaSuccess) return e;
  const int64_t rows = batch * seq * op.heads;
  RowDotKernel<T><<<WarpBlocks(rows), kThreads, 0, stream>>>(dout, out, rowdot, rows, seq, op.ld_o,
                                                             op.heads, static_cast<int>(hd));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  switch (hd) {
    case 32:
      return Backward<32>(dout, op, lse, rowdot, batch, seq, scale, stream);
    case 64:
      return Backward<64>(dout, op, lse, rowdot, batch, seq, scale, stream);
    case 96:
      return Backward<96>(dout, op, lse, rowdot, batch, seq, scale, stream);
    default:
      return Backward<128>(dout, op, lse, rowdot, batch, seq, scale, stream);
  }
}

// GPT-2's fused rows: q, k, v at 0, C, 2C of 3C-wide rows.
template <typename T>
Operands<T> Fused(const T* qkv, T* dqkv, int64_t channels, int64_t heads) {
  Operands<T> op{qkv,
                 qkv + channels,
                 qkv + 2 * channels,
                 dqkv,
                 dqkv,
                 dqkv,
                 3 * channels,
                 3 * channels,
                 3 * channels,
                 channels,
                 static_cast<int>(heads),
                 static_cast<int>(heads)};
  if (dqkv != nullptr) {
    op.dk = dqkv + channels;
    op.dv = dqkv + 2 * channels;
  }
  return op;
}

template <typename T>
Operands<T> General(const T* q, const T* k, const T* v, T* dq, T* dk, T* dv, const FlashShape& s) {
  return {q,
          k,
          v,
          dq,
          dk,
          dv,
          s.ld_q,
          s.ld_k,
          s.ld_v,
          s.ld_o,
          static_cast<int>(s.heads),
          static_cast<int>(s.kv_heads)};
}

}  // namespace

cudaError_t FusedAttentionForward(const float* qkv, float* out, float* lse, int64_t batch,
                                  int64_t seq, int64_t channels, int64_t heads,
                                  cudaStream_t stream) {
  return AttentionForward(Fused<float>(qkv, nullptr, channels, heads), out, lse, batch, seq,
                          channels / heads, stream);
}
cudaError_t FusedAttentionForward(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse,
                                  int64_t batch, int64_t seq, int64_t channels, int64_t heads,
                                  cudaStream_t stream) {
  return AttentionForward(Fused<bf16>(qkv, nullptr, channels, heads), out, lse, batch, seq,
                          channels / heads, stream);
}

cudaError_t FusedAttentionBackward(const float* dout, const float* qkv, const float* out,
                                   const float* lse, float* rowdot, float* dqkv, int64_t batch,
                                   int64_t seq, int64_t channels, int64_t heads,
                                   cudaStream_t stream) {
  return AttentionBackward(dout, Fused<float>(qkv, dqkv, channels, heads), out, lse, rowdot, batch,
                           seq, channels / heads, stream);
}
cudaError_t FusedAttentionBackward(const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                                   const __nv_bfloat16* out, const float* lse, float* rowdot,
                                   __nv_bfloat16* dqkv, int64_t batch, int64_t seq,
                                   int64_t channels, int64_t heads, cudaStream_t stream) {
  return AttentionBackward(dout, Fused<bf16>(qkv, dqkv, channels, heads), out, lse, rowdot, batch,
                           seq, channels / heads, stream);
}

cudaError_t FlashAttentionForward(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                  const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                  const FlashShape& s, cudaStream_t stream) {
  return AttentionForward(General<bf16>(q, k, v, nullptr, nullptr, nullptr, s), out, lse, s.batch,
                          s.seq, s.head_dim, stream);
}
cudaError_t FlashAttentionBackward(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                   const __nv_bfloat16* k, const __nv_bfloat16* v,
                                   const __nv_bfloat16* out, const float* lse, float* rowdot,
                                   __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                                   const FlashShape& s, cudaStream_t stream) {
  return AttentionBackward(dout, General<bf16>(q, k, v, dq, dk, dv, s), out, lse, rowdot, s.batch,
                           s.seq, s.head_dim, stream);
}

}  // namespace tierzero::gpt::cuda

// Causal scaled-dot-product attention in fp64, forward and backward, written from the
// definition (with grouped-query attention: query head h reads key/value head h / (H / KV)), for
// the attention ops of every backend to be measured against. Inputs are given widened to
// double (the bf16 operands the ops see); strides as AttnDims's (ld_q, ld_k, ld_v elements
// between consecutive rows of one sequence position); outputs are dense (rows of H x hd for out
// and dq, KV x hd for dk and dv).
//   S = q k^T / sqrt(hd) with j > i masked, P = softmax(S), out = P v;
//   dv = P^T dout, dP = dout v^T, dS = P (dP - rowsum(dP P)), dq = dS k / sqrt(hd),
//   dk = dS^T q / sqrt(hd); dk and dv summed over the query heads of a group.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tierzero::gpt::testing_attention {

struct Dims {
  int64_t batch, seq, heads, kv_heads, head_dim, ld_q, ld_k, ld_v;
};

struct Result {
  std::vector<double> out, dq, dk, dv;
};

inline Result Reference(const std::vector<double>& q, const std::vector<double>& k,
                        const std::vector<double>& v, const std::vector<double>& dout,
                        const Dims& d) {
  const int64_t B = d.batch, T = d.seq, H = d.heads, hd = d.head_dim, G = H / d.kv_heads;
  const int64_t KV = d.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  Result r;
  r.out.assign(static_cast<size_t>(B * T * H * hd), 0.0);
  r.dq.assign(r.out.size(), 0.0);
  r.dk.assign(static_cast<size_t>(B * T * KV * hd), 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  std::vector<double> p(static_cast<size_t>(T)), dp(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kh = h / G;
      for (int64_t i = 0; i < T; ++i) {
        const double* qi = q.data() + (b * T + i) * d.ld_q + h * hd;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const double* kj = k.data() + (b * T + j) * d.ld_k + kh * hd;
          double s = 0;
          for (int64_t e = 0; e < hd; ++e) s += qi[e] * kj[e];
          p[static_cast<size_t>(j)] = s * scale;
          mx = std::max(mx, p[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j)
          sum += (p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx));
        for (int64_t j = 0; j <= i; ++j) p[static_cast<size_t>(j)] /= sum;
        double* oi = r.out.data() + ((b * T + i) * H + h) * hd;
        const double* doi = dout.data() + ((b * T + i) * H + h) * hd;
        for (int64_t j = 0; j <= i; ++j) {
          const double* vj = v.data() + (b * T + j) * d.ld_v + kh * hd;
          double dpj = 0;
          for (int64_t e = 0; e < hd; ++e) {
            oi[e] += p[static_cast<size_t>(j)] * vj[e];
            dpj += doi[e] * vj[e];
          }
          dp[static_cast<size_t>(j)] = dpj;
        }
        double rowdot = 0;
        for (int64_t j = 0; j <= i; ++j)
          rowdot += dp[static_cast<size_t>(j)] * p[static_cast<size_t>(j)];
        double* dqi = r.dq.data() + ((b * T + i) * H + h) * hd;
        for (int64_t j = 0; j <= i; ++j) {
          const double pj = p[static_cast<size_t>(j)];
          const double ds = pj * (dp[static_cast<size_t>(j)] - rowdot) * scale;
          const double* kj = k.data() + (b * T + j) * d.ld_k + kh * hd;
          double* dkj = r.dk.data() + ((b * T + j) * KV + kh) * hd;
          double* dvj = r.dv.data() + ((b * T + j) * KV + kh) * hd;
          for (int64_t e = 0; e < hd; ++e) {
            dqi[e] += ds * kj[e];
            dkj[e] += ds * qi[e];
            dvj[e] += pj * doi[e];
          }
        }
      }
    }
  }
  return r;
}

// ||x - ref|| / ||ref|| over the elements (x as floats widened from the op's output).
inline double RelativeError(const std::vector<float>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = static_cast<double>(x[i]) - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The largest |x - ref| against the largest |ref|.
inline double WorstErrorOfMax(const std::vector<float>& x, const std::vector<double>& ref) {
  double worst = 0, mx = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(x[i]) - ref[i]));
    mx = std::max(mx, std::fabs(ref[i]));
  }
  return worst / std::max(mx, 1e-300);
}

// A strided slice of rows (the q, k or v columns of a fused qkv matrix) made dense: rows of
// `width` elements starting at column `col` of rows `ld` apart.
template <typename T>
std::vector<T> Columns(const std::vector<T>& m, int64_t rows, int64_t ld, int64_t col,
                       int64_t width) {
  std::vector<T> out(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c)
      out[static_cast<size_t>(r * width + c)] = m[static_cast<size_t>(r * ld + col + c)];
  return out;
}

}  // namespace tierzero::gpt::testing_attention

// Rotary position embeddings' frequencies as Hugging Face's Llama computes them
// (LlamaRotaryEmbedding; rope_type "default" and "llama3"), for the CPU ops (llama_ops.cc) and
// the CUDA kernels (bf16_kernels_cuda.cu) alike. C++17, CUDA-friendly.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TZ_HOST_DEVICE __host__ __device__
#else
#define TZ_HOST_DEVICE
#endif

namespace tierzero::gpt {

struct Rope {
  double theta = 10000.0;
  // Llama 3's scaling of the low frequencies (rope_scaling {"rope_type": "llama3", "factor",
  // "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}); factor 0: none.
  double factor = 0, low_freq_factor = 1, high_freq_factor = 4, original_positions = 8192;
};

// inv_freq[j] for j < head_dim / 2, in T (HF computes it in fp32: T = float is what an fp32 HF
// model uses): theta^(-2j / head_dim), then with llama3 scaling: unchanged for wavelengths
// shorter than original / high_freq_factor, divided by `factor` for ones longer than
// original / low_freq_factor, and between the two a blend of both.
template <typename T>
TZ_HOST_DEVICE inline T RopeInverseFrequency(const Rope& r, int64_t j, int64_t head_dim) {
  const T e = static_cast<T>(2 * j) / static_cast<T>(head_dim);
  const T inv = T(1) / std::pow(static_cast<T>(r.theta), e);
  if (!(r.factor > 0)) return inv;
  const T pi = static_cast<T>(3.14159265358979323846);
  const T wavelen = T(2) * pi / inv;
  const T low_wavelen = static_cast<T>(r.original_positions / r.low_freq_factor);
  const T high_wavelen = static_cast<T>(r.original_positions / r.high_freq_factor);
  const T factor = static_cast<T>(r.factor);
  if (wavelen > low_wavelen) return inv / factor;
  if (wavelen < high_wavelen) return inv;
  const T smooth =
      (static_cast<T>(r.original_positions) / wavelen - static_cast<T>(r.low_freq_factor)) /
      static_cast<T>(r.high_freq_factor - r.low_freq_factor);
  return (T(1) - smooth) * inv / factor + smooth * inv;
}

}  // namespace tierzero::gpt

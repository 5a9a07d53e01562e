// An fp64 GPT-2 forward pass and loss written straight from the GPT-2 definition: the reference
// the engine's GPT is checked against (gpt_reference_test.cc, tests/app/eval_test.cc). Parameters
// by their engine names (wte, wpe, h.L.ln_1.weight, ...), as doubles.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gpt/gpt.h"
#include "tierzero/engine.h"

namespace tierzero::gpt {

using Params = std::map<std::string, std::vector<double>>;

// Writes random weights into every parameter of a finalized engine (normal, sd 0.4, and 1 more for
// norm parameters: larger than the 0.02 init, so every path carries signal) and returns them
// as the reference's Params. Empty on a failed write.
inline Params RandomParams(Engine& engine, uint64_t seed) {
  Params params;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 0.4);
  for (ParamId p = 0; p < engine.num_params(); ++p) {
    std::vector<float> v(static_cast<size_t>(engine.numel(p)));
    for (float& x : v)
      x = static_cast<float>(nd(rng)) +
          (engine.param(p).name.find("ln") != std::string::npos ||
                   engine.param(p).name.find("norm") != std::string::npos
               ? 1.0f
               : 0.0f);
    if (!engine.WriteParam(p, v).ok()) return {};
    params[engine.param(p).name] = std::vector<double>(v.begin(), v.end());
  }
  return params;
}

// Every gradient the engine holds against central finite differences of `loss` (the reference's,
// reading `params`): within 2e-4 of each parameter's largest numeric gradient.
// Under AddressSanitizer the central differences (two fp64 losses an element) took over 300 s
// for one Llama shape: there every tensor is checked at up to 64 elements evenly spread (its
// first and last among them); elsewhere at every element.
#if defined(__SANITIZE_ADDRESS__)
#define TZ_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TZ_TEST_UNDER_ASAN 1
#endif
#endif
#ifdef TZ_TEST_UNDER_ASAN
inline constexpr size_t kMostElementsChecked = 64;
#else
inline constexpr size_t kMostElementsChecked = ~size_t{0};
#endif

inline void ExpectGradientsMatch(Engine& engine, Params& params,
                                 const std::function<double()>& loss) {
  const double h = 1e-5;
  for (ParamId p = 0; p < engine.num_params(); ++p) {
    const std::string name = engine.param(p).name;
    std::vector<float> g(static_cast<size_t>(engine.numel(p)));
    ASSERT_TRUE(engine.ReadGrad(p, g).ok());
    std::vector<double>& w = params[name];
    std::vector<size_t> checked;
    if (w.size() <= kMostElementsChecked) {
      for (size_t i = 0; i < w.size(); ++i) checked.push_back(i);
    } else {
      for (size_t k = 0; k < kMostElementsChecked; ++k)
        checked.push_back(k * (w.size() - 1) / (kMostElementsChecked - 1));
    }
    // (The tolerance's scale counts every element's gradient, sampled or not.)
    double scale = 0;
    for (float gi : g) scale = std::max(scale, std::abs(static_cast<double>(gi)));
    std::vector<double> numeric(w.size());
    for (size_t i : checked) {
      const double keep = w[i];
      w[i] = keep + h;
      const double up = loss();
      w[i] = keep - h;
      const double down = loss();
      w[i] = keep;
      numeric[i] = (up - down) / (2 * h);
      scale = std::max(scale, std::abs(numeric[i]));
    }
    for (size_t i : checked)
      EXPECT_NEAR(g[i], numeric[i], 2e-4 * scale + 1e-7) << name << "[" << i << "]";
  }
}

struct Ref {
  int V, T, C, L, H;
  const Params& p;
  const std::vector<double>& at(const std::string& n) const { return p.at(n); }

  static void LayerNorm(std::vector<double>& x, const std::vector<double>& g,
                        const std::vector<double>& b, int C) {
    for (size_t r = 0; r < x.size() / static_cast<size_t>(C); ++r) {
      double mu = 0, var = 0;
      for (int c = 0; c < C; ++c) mu += x[r * C + c];
      mu /= C;
      for (int c = 0; c < C; ++c) var += (x[r * C + c] - mu) * (x[r * C + c] - mu);
      var /= C;
      for (int c = 0; c < C; ++c)
        x[r * C + c] = (x[r * C + c] - mu) / std::sqrt(var + 1e-5) * g[c] + b[c];
    }
  }
  // y = x W + b, W in x out.
  static std::vector<double> Linear(const std::vector<double>& x, const std::vector<double>& w,
                                    const std::vector<double>& b, int in, int out) {
    const size_t rows = x.size() / static_cast<size_t>(in);
    std::vector<double> y(rows * out);
    for (size_t r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o) {
        double s = b[o];
        for (int i = 0; i < in; ++i) s += x[r * in + i] * w[i * out + o];
        y[r * out + o] = s;
      }
    return y;
  }

  // Mean masked cross-entropy of one batch.
  double Loss(const Batch& batch) const {
    const int B = batch.batch;
    std::vector<double> x(static_cast<size_t>(B) * T * C);
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c)
          x[(b * T + t) * C + c] =
              at("wte")[batch.tokens[b * T + t] * C + c] + at("wpe")[t * C + c];
    const int hd = C / H;
    for (int l = 0; l < L; ++l) {
      const std::string p = "h." + std::to_string(l) + ".";
      std::vector<double> h = x;
      LayerNorm(h, at(p + "ln_1.weight"), at(p + "ln_1.bias"), C);
      std::vector<double> qkv =
          Linear(h, at(p + "attn.c_attn.weight"), at(p + "attn.c_attn.bias"), C, 3 * C);
      std::vector<double> att(x.size(), 0.0);
      for (int b = 0; b < B; ++b)
        for (int hh = 0; hh < H; ++hh)
          for (int t = 0; t < T; ++t) {
            std::vector<double> w(t + 1);
            double z = 0;
            for (int s = 0; s <= t; ++s) {
              double d = 0;
              for (int k = 0; k < hd; ++k)
                d += qkv[(b * T + t) * 3 * C + hh * hd + k] *
                     qkv[(b * T + s) * 3 * C + C + hh * hd + k];
              w[s] = std::exp(d / std::sqrt(static_cast<double>(hd)));
              z += w[s];
            }
            for (int s = 0; s <= t; ++s)
              for (int k = 0; k < hd; ++k)
                att[(b * T + t) * C + hh * hd + k] +=
                    w[s] / z * qkv[(b * T + s) * 3 * C + 2 * C + hh * hd + k];
          }
      std::vector<double> a =
          Linear(att, at(p + "attn.c_proj.weight"), at(p + "attn.c_proj.bias"), C, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += a[i];
      h = x;
      LayerNorm(h, at(p + "ln_2.weight"), at(p + "ln_2.bias"), C);
      std::vector<double> u =
          Linear(h, at(p + "mlp.c_fc.weight"), at(p + "mlp.c_fc.bias"), C, 4 * C);
      for (double& v : u)
        v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
      std::vector<double> m =
          Linear(u, at(p + "mlp.c_proj.weight"), at(p + "mlp.c_proj.bias"), 4 * C, C);
      for (size_t i = 0; i < x.size(); ++i) x[i] += m[i];
    }
    LayerNorm(x, at("ln_f.weight"), at("ln_f.bias"), C);
    double loss = 0, count = 0;
    for (int r = 0; r < B * T; ++r) {
      std::vector<double> logits(V);
      double mx = -1e300;
      for (int v = 0; v < V; ++v) {
        double s = 0;
        for (int c = 0; c < C; ++c) s += x[r * C + c] * at("wte")[v * C + c];
        logits[v] = s;
        mx = std::max(mx, s);
      }
      double z = 0;
      for (double v : logits) z += std::exp(v - mx);
      loss += batch.mask[r] * (std::log(z) + mx - logits[batch.targets[r]]);
      count += batch.mask[r];
    }
    return loss / count;
  }
};

}  // namespace tierzero::gpt

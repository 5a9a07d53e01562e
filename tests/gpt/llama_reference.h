// An fp64 Llama forward pass and loss written from Hugging Face's LlamaForCausalLM
// (modeling_llama): embed_tokens; per layer x += o_proj(attn(rope(q_proj(rms(x))), rope(k_proj(.)),
// v_proj(.))) with repeat_kv for grouped-query attention, then x +=
// down_proj(silu(gate_proj(rms(x))) * up_proj(rms(x))); model.norm; lm_head (or embed_tokens when
// tied). nn.Linear weights are out x in; RMSNorm is w * x / sqrt(mean(x^2) + eps); rotary
// embeddings rotate_half with inv_freq = theta^(-2j/hd) and cos/sin of t * inv_freq over both
// halves. Parameters by their HF names, as doubles. The reference the engine's Llama is checked
// against (llama_reference_test.cc, tests/app).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gpt_reference.h"

namespace tierzero::gpt {

struct LlamaRef {
  int V, T, C, L, H, KVH, F;
  double theta, eps;
  bool tied, bias;
  const Params& p;
  // Llama 3's rope_scaling (factor 0: none), as _compute_llama3_parameters.
  double factor = 0, low_freq = 1, high_freq = 4, original = 8192;
  const std::vector<double>& at(const std::string& n) const { return p.at(n); }

  double InvFreq(int j, int hd) const {
    const double inv = std::pow(theta, -2.0 * j / hd);
    if (factor == 0) return inv;
    const double wavelen = 2 * M_PI / inv;
    if (wavelen < original / high_freq) return inv;
    if (wavelen > original / low_freq) return inv / factor;
    const double smooth = (original / wavelen - low_freq) / (high_freq - low_freq);
    return (1 - smooth) * inv / factor + smooth * inv;
  }

  void Rms(std::vector<double>& x, const std::vector<double>& w) const {
    for (size_t r = 0; r < x.size() / static_cast<size_t>(C); ++r) {
      double ms = 0;
      for (int c = 0; c < C; ++c) ms += x[r * C + c] * x[r * C + c];
      ms /= C;
      for (int c = 0; c < C; ++c) x[r * C + c] = w[c] * (x[r * C + c] / std::sqrt(ms + eps));
    }
  }
  // y = x W^T (+ b), W out x in.
  std::vector<double> Proj(const std::vector<double>& x, const std::string& name, int in, int out,
                           bool with_bias) const {
    const std::vector<double>& w = at(name + ".weight");
    const size_t rows = x.size() / static_cast<size_t>(in);
    std::vector<double> y(rows * out);
    for (size_t r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o) {
        double s = with_bias ? at(name + ".bias")[o] : 0.0;
        for (int i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
        y[r * out + o] = s;
      }
    return y;
  }
  // apply_rotary_pos_emb on rows of `heads` heads.
  void Rope(std::vector<double>& x, int B, int heads) const {
    const int hd = C / H, half = hd / 2;
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < heads; ++h) {
          double* v = &x[((b * T + t) * heads + h) * hd];
          std::vector<double> y(hd);
          for (int j = 0; j < hd; ++j) {
            const double a = t * InvFreq(j % half, hd);
            const double rot = j < half ? -v[j + half] : v[j - half];  // rotate_half
            y[j] = v[j] * std::cos(a) + rot * std::sin(a);
          }
          std::copy(y.begin(), y.end(), v);
        }
  }

  double Loss(const Batch& batch) const {
    const int B = batch.batch, hd = C / H, group = H / KVH;
    std::vector<double> x(static_cast<size_t>(B) * T * C);
    for (int r = 0; r < B * T; ++r)
      for (int c = 0; c < C; ++c)
        x[r * C + c] = at("model.embed_tokens.weight")[batch.tokens[r] * C + c];
    for (int l = 0; l < L; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      std::vector<double> h = x;
      Rms(h, at(p + "input_layernorm.weight"));
      std::vector<double> q = Proj(h, p + "self_attn.q_proj", C, C, bias);
      std::vector<double> k = Proj(h, p + "self_attn.k_proj", C, KVH * hd, bias);
      std::vector<double> v = Proj(h, p + "self_attn.v_proj", C, KVH * hd, bias);
      Rope(q, B, H);
      Rope(k, B, KVH);
      std::vector<double> att(x.size(), 0.0);
      for (int b = 0; b < B; ++b)
        for (int hh = 0; hh < H; ++hh) {
          const int kh = hh / group;  // repeat_kv
          for (int t = 0; t < T; ++t) {
            std::vector<double> s(t + 1);
            double mx = -1e300;
            for (int u = 0; u <= t; ++u) {
              double d = 0;
              for (int j = 0; j < hd; ++j)
                d += q[((b * T + t) * H + hh) * hd + j] * k[((b * T + u) * KVH + kh) * hd + j];
              s[u] = d / std::sqrt(static_cast<double>(hd));
              mx = std::max(mx, s[u]);
            }
            double z = 0;
            for (double& e : s) z += (e = std::exp(e - mx));
            for (int u = 0; u <= t; ++u)
              for (int j = 0; j < hd; ++j)
                att[(b * T + t) * C + hh * hd + j] +=
                    s[u] / z * v[((b * T + u) * KVH + kh) * hd + j];
          }
        }
      std::vector<double> o = Proj(att, p + "self_attn.o_proj", C, C, bias);
      for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];
      h = x;
      Rms(h, at(p + "post_attention_layernorm.weight"));
      std::vector<double> g = Proj(h, p + "mlp.gate_proj", C, F, false);
      const std::vector<double> u = Proj(h, p + "mlp.up_proj", C, F, false);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
      const std::vector<double> m = Proj(g, p + "mlp.down_proj", F, C, false);
      for (size_t i = 0; i < x.size(); ++i) x[i] += m[i];
    }
    Rms(x, at("model.norm.weight"));
    const std::vector<double>& head = at(tied ? "model.embed_tokens.weight" : "lm_head.weight");
    double loss = 0, count = 0;
    for (int r = 0; r < B * T; ++r) {
      std::vector<double> logits(V);
      double mx = -1e300;
      for (int vv = 0; vv < V; ++vv) {
        double s = 0;
        for (int c = 0; c < C; ++c) s += x[r * C + c] * head[vv * C + c];
        logits[vv] = s;
        mx = std::max(mx, s);
      }
      double z = 0;
      for (double e : logits) z += std::exp(e - mx);
      loss += batch.mask[r] * (std::log(z) + mx - logits[batch.targets[r]]);
      count += batch.mask[r];
    }
    return loss / count;
  }
};

}  // namespace tierzero::gpt

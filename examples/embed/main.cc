// A two-layer MLP regression trained through tierzero's public API only: the smallest complete
// trainer that embeds the engine (see CMakeLists.txt for how it finds the installed library).
//
// The student y = W2 tanh(W1 x + b1) + b2 learns a fixed random teacher of the same shape. The
// engine owns the parameters (sharded, placed in tiers, fp32 masters and Adam moments) and runs
// the optimizer; the trainer computes forward and backward on what Acquire hands it. With
// DeviceChoice::kHost the "device" is simulated in host memory, so data() and grad() are host
// pointers and the arithmetic below is plain C++.
//
// Usage: embed_mlp [report.json [report.html]]: the memory placement report, and its page as
// `tierzero train` writes it (tierzero/report.h). Exits 0 when the loss fell at least 20-fold.
#include <tierzero/engine.h>
#include <tierzero/report.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace tz = tierzero;

namespace {

constexpr int kIn = 8, kHidden = 32, kOut = 4, kBatch = 64, kSteps = 300;

// y[b][o] = sum_i w[o][i] x[b][i] + bias[o]
void Affine(const float* x, const float* w, const float* bias, float* y, int rows, int in,
            int out) {
  for (int b = 0; b < rows; ++b)
    for (int o = 0; o < out; ++o) {
      float s = bias[o];
      for (int i = 0; i < in; ++i) s += w[o * in + i] * x[b * in + i];
      y[b * out + o] = s;
    }
}

// The affine layer's backward: dx = dy W (when dx is not null), dW = dy^T x, db = sum_b dy.
// dW and db are written last: grad() may share memory with the weight being read.
void AffineBackward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                    float* db, int rows, int in, int out) {
  if (dx != nullptr)
    for (int b = 0; b < rows; ++b)
      for (int i = 0; i < in; ++i) {
        float s = 0;
        for (int o = 0; o < out; ++o) s += dy[b * out + o] * w[o * in + i];
        dx[b * in + i] = s;
      }
  std::vector<float> gw(static_cast<size_t>(out) * in, 0.0f), gb(out, 0.0f);
  for (int b = 0; b < rows; ++b)
    for (int o = 0; o < out; ++o) {
      gb[o] += dy[b * out + o];
      for (int i = 0; i < in; ++i) gw[o * in + i] += dy[b * out + o] * x[b * in + i];
    }
  std::copy(gw.begin(), gw.end(), dw);
  std::copy(gb.begin(), gb.end(), db);
}

int Fail(const tz::Status& s) {
  std::fprintf(stderr, "embed_mlp: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  tz::EngineConfig config;
  config.device = tz::DeviceChoice::kHost;  // host pointers; see the header comment
  config.compute_dtype = tz::DType::kF32;
  config.weight_decay = 0.0f;
  auto engine_or = tz::Engine::Create(config);
  if (!engine_or.ok()) return Fail(engine_or.status());
  tz::Engine& engine = **engine_or;

  // Registered in the order of first use. Biases start at zero (the default initializer).
  tz::ParamId w1 = *engine.RegisterParam({"l1.weight", {kHidden, kIn}, tz::InitNormal(0.3f, 1)});
  tz::ParamId b1 = *engine.RegisterParam({"l1.bias", {kHidden}, {}, false});
  tz::ParamId w2 = *engine.RegisterParam({"l2.weight", {kOut, kHidden}, tz::InitNormal(0.2f, 2)});
  tz::ParamId b2 = *engine.RegisterParam({"l2.bias", {kOut}, {}, false});
  if (tz::Status s = engine.Finalize(); !s.ok()) return Fail(s);
  std::printf("%s\n", engine.PlacementSummary().c_str());

  // The teacher: fixed random weights of the same architecture.
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> tw1(kHidden * kIn), tb1(kHidden), tw2(kOut * kHidden), tb2(kOut);
  for (auto* v : {&tw1, &tb1, &tw2, &tb2})
    for (float& e : *v) e = 0.5f * normal(gen);

  const tz::ParamId layer1[] = {w1, b1}, layer2[] = {w2, b2};
  std::vector<float> x(kBatch * kIn), target(kBatch * kOut), th(kBatch * kHidden);
  double first_loss = 0, last_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    for (float& e : x) e = normal(gen);
    Affine(x.data(), tw1.data(), tb1.data(), th.data(), kBatch, kIn, kHidden);
    for (float& e : th) e = std::tanh(e);
    Affine(th.data(), tw2.data(), tb2.data(), target.data(), kBatch, kHidden, kOut);

    // Activations come from the engine so its plan counts them (exact, no polling).
    auto h_or = engine.AllocateActivation(sizeof(float) * kBatch * kHidden);
    auto y_or = engine.AllocateActivation(sizeof(float) * kBatch * kOut);
    if (!h_or.ok()) return Fail(h_or.status());
    if (!y_or.ok()) return Fail(y_or.status());
    float* h = h_or->as<float>();
    float* y = y_or->as<float>();

    {  // forward
      auto scope = engine.Acquire(layer1, tz::Phase::kForward);
      if (!scope.ok()) return Fail(scope.status());
      Affine(x.data(), static_cast<float*>(scope->data(w1)), static_cast<float*>(scope->data(b1)),
             h, kBatch, kIn, kHidden);
      for (int i = 0; i < kBatch * kHidden; ++i) h[i] = std::tanh(h[i]);
    }
    {
      auto scope = engine.Acquire(layer2, tz::Phase::kForward);
      if (!scope.ok()) return Fail(scope.status());
      Affine(h, static_cast<float*>(scope->data(w2)), static_cast<float*>(scope->data(b2)), y,
             kBatch, kHidden, kOut);
    }
    // Loss: mean over the batch of the squared error summed over outputs.
    double loss = 0;
    std::vector<float> dy(kBatch * kOut), dh(kBatch * kHidden);
    for (int i = 0; i < kBatch * kOut; ++i) {
      float d = y[i] - target[i];
      loss += static_cast<double>(d) * d / kBatch;
      dy[i] = 2.0f * d / kBatch;
    }
    {  // backward, in reverse order
      auto scope = engine.Acquire(layer2, tz::Phase::kBackward);
      if (!scope.ok()) return Fail(scope.status());
      AffineBackward(h, static_cast<float*>(scope->data(w2)), dy.data(), dh.data(),
                     static_cast<float*>(scope->grad(w2)), static_cast<float*>(scope->grad(b2)),
                     kBatch, kHidden, kOut);
    }
    for (int i = 0; i < kBatch * kHidden; ++i) dh[i] *= 1.0f - h[i] * h[i];
    {
      auto scope = engine.Acquire(layer1, tz::Phase::kBackward);
      if (!scope.ok()) return Fail(scope.status());
      AffineBackward(x.data(), static_cast<float*>(scope->data(w1)), dh.data(), nullptr,
                     static_cast<float*>(scope->grad(w1)), static_cast<float*>(scope->grad(b1)),
                     kBatch, kIn, kHidden);
    }
    h_or->Reset();
    y_or->Reset();
    if (tz::Status s = engine.EndIteration(); !s.ok()) return Fail(s);
    auto result = engine.Step({.lr = 1e-2f});
    if (!result.ok()) return Fail(result.status());

    if (step == 0) first_loss = loss;
    last_loss = loss;
    if (step % 50 == 0 || step == kSteps - 1)
      std::printf("step %3d  loss %.5f  grad norm %.4f\n", step, loss, result->grad_norm);
  }

  if (argc > 1) {
    if (tz::Status s = engine.WriteReport(argv[1]); !s.ok()) return Fail(s);
  }
  if (argc > 2) {
    auto report = engine.ReportJson();
    if (!report.ok()) return Fail(report.status());
    if (tz::Status s = tz::WriteHtmlReport(*report, argv[2]); !s.ok()) return Fail(s);
    auto summary = tz::ReportSummary(*report);
    if (!summary.ok()) return Fail(summary.status());
    std::fputs(summary->c_str(), stdout);
  }
  const bool learned = last_loss * 20 < first_loss;
  std::printf("loss %.5f -> %.5f: %s\n", first_loss, last_loss,
              learned ? "learned" : "did NOT learn");
  return learned ? 0 : 1;
}

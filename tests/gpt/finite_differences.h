// Central finite differences for the ops' backward checks in double precision (ops_test.cc,
// llama_ops_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace tierzero::gpt::cpu {

using Vec = std::vector<double>;

inline Vec Random(size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  Vec v(n);
  for (double& x : v) x = d(rng);
  return v;
}

inline double Dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks d(sum(w * forward()))/d(input) against the analytic gradients: forward reads the
// inputs and returns the outputs; `analytic[i]` is the gradient of inputs[i] for dy = w.
inline void CheckAgainstFiniteDifferences(const std::vector<Vec*>& inputs,
                                          const std::function<Vec()>& forward, const Vec& w,
                                          const std::vector<Vec>& analytic, const char* what) {
  const double h = 1e-5;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Vec& x = *inputs[i];
    ASSERT_EQ(analytic[i].size(), x.size()) << what << " input " << i;
    const size_t stride = std::max<size_t>(1, x.size() / 97);  // about 100 elements per input
    for (size_t j = 0; j < x.size(); j += stride) {
      const double keep = x[j];
      x[j] = keep + h;
      const double up = Dot(forward(), w);
      x[j] = keep - h;
      const double down = Dot(forward(), w);
      x[j] = keep;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(analytic[i][j], numeric, 1e-7 * std::max(1.0, std::abs(numeric)))
          << what << ": input " << i << " element " << j;
    }
  }
}

}  // namespace tierzero::gpt::cpu

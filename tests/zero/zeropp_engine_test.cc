// ZeRO++ in the engine (run under mpirun: -np 2 as 2 nodes of 1, -np 3 as 3 nodes of 1, -np 4 as
// 2 nodes of 2): qwZ's gathers within the quantization bound of the exact parameters, hpZ's later
// gathers the very values the first one computed on, qgZ's gradient mean within its documented
// bound of the exact fp64 mean, the bytes that cross nodes against plain ZeRO-3's on the same
// iteration, and hpZ bit for bit equal to a run without it over 20 steps across a save and load;
// each on the device collective path and through host buffers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "tierzero/communicator.h"
#include "tierzero/engine.h"

namespace tierzero {
namespace {

// 2 ranks per node on 4 ranks, else one per node: every test runs across nodes.
std::shared_ptr<Communicator> World() {
  static std::shared_ptr<Communicator> comm = [] {
    auto probe = Communicator::Mpi(1);
    if (!probe.ok()) {
      std::fprintf(stderr, "%s\n", probe.status().ToString().c_str());
      std::abort();
    }
    const int per_node = (*probe)->size() == 4 ? 2 : 1;
    if (per_node == 1) return *probe;
    auto c = Communicator::Mpi(per_node);
    if (!c.ok()) std::abort();
    return *c;
  }();
  return comm;
}

// Every cross-node check needs two ranks at least; run alone (the GPU machine's run, which has no
// MPI runtime, or by hand) the tests skip rather than fail.
#define REQUIRE_RANKS() \
  if (World()->size() < 2) GTEST_SKIP() << "needs 2 or more ranks: run it under mpirun -np 2"

// Every test runs on both collective paths: on the (simulated) device's comm stream, and
// through host buffers.
const CollectivePath kPaths[] = {CollectivePath::kDevice, CollectivePath::kHost};
std::string PathName(CollectivePath p) { return p == CollectivePath::kDevice ? "device" : "host"; }

EngineConfig Config(const ZeroPPConfig& z, CollectivePath path, DType dtype = DType::kF32) {
  EngineConfig c;
  c.device = DeviceChoice::kHost;
  c.collectives = path;
  c.compute_dtype = dtype;
  c.device_budget = 4 << 20;
  c.host_budget = 64 << 20;
  c.chunk_elems = 4096;  // several tensors split between shards
  c.zeropp = z;
  return c;
}

struct Model {
  std::unique_ptr<Engine> engine;
  std::vector<ParamId> ids;
};

// Tensors of awkward sizes, so shard and block boundaries fall inside them; scales that differ
// by 100x, so a block spanning two tensors would show.
Model Make(std::shared_ptr<Communicator> comm, const EngineConfig& config,
           const std::vector<int64_t>& sizes = {37 * 29, 1500, 2100, 61}) {
  Model m;
  auto e = Engine::Create(config, std::move(comm));
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return m;
  m.engine = std::move(*e);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const float stddev = i % 2 == 0 ? 0.5f : 0.005f;
    auto id = m.engine->RegisterParam(
        {"p" + std::to_string(i), {sizes[i]}, InitNormal(stddev, 11 + i), true});
    EXPECT_TRUE(id.ok());
    m.ids.push_back(*id);
  }
  Status s = m.engine->Finalize();
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (!s.ok()) m.engine.reset();
  return m;
}

// What rank r writes as element i of parameter p's gradient (scales differ between tensors).
double GradValue(int rank, int p, int64_t i) {
  return (std::sin(0.37 * static_cast<double>(i) + p) * (rank + 1) + 0.01 * rank) *
         (p % 2 == 0 ? 1.0 : 0.01);
}

double AbsMax(const std::vector<float>& v) {
  double a = 0;
  for (float x : v) a = std::max(a, std::abs(static_cast<double>(x)));
  return a;
}

struct GatherCase {
  const char* name;
  ZeroPPConfig z;
};
void PrintTo(const GatherCase& c, std::ostream* os) { *os << c.name; }
ZeroPPConfig Z(bool qwz, int qwz_bits, bool hpz, bool qgz, int qgz_bits, int block = 256) {
  ZeroPPConfig z;
  z.qwz = qwz;
  z.qwz_bits = qwz_bits;
  z.hpz = hpz;
  z.qgz = qgz;
  z.qgz_bits = qgz_bits;
  z.block_elems = block;
  return z;
}
const GatherCase kCases[] = {
    {"qwZ int8 + hpZ + qgZ int4", Z(true, 8, true, true, 4)},
    {"qwZ int4 + qgZ int8, blocks of 64", Z(true, 4, false, true, 8, 64)},
    {"hpZ alone", Z(false, 8, true, false, 4)},
    {"qgZ int4 alone, blocks of 4096", Z(false, 8, false, true, 4, 4096)},
};

class ZeroPPEngine : public ::testing::TestWithParam<std::tuple<GatherCase, CollectivePath>> {};
INSTANTIATE_TEST_SUITE_P(Cases, ZeroPPEngine,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::ValuesIn(kPaths)),
                         [](const auto& info) {
                           return std::to_string(info.index / 2) + "_" +
                                  PathName(std::get<1>(info.param));
                         });

class ZeroPPPath : public ::testing::TestWithParam<CollectivePath> {};
INSTANTIATE_TEST_SUITE_P(Paths, ZeroPPPath, ::testing::ValuesIn(kPaths),
                         [](const auto& info) { return PathName(info.param); });

// One iteration: forward gathers within the bound of the exact parameters (exact without qwZ),
// backward's gathers the same bits as forward's, the gradient mean within qgZ's bound (fp32
// exact without it).
TEST_P(ZeroPPEngine, GathersAndGradientMeanAgainstExactReferences) {
  REQUIRE_RANKS();
  auto comm = World();
  const int w = comm->size();
  const ZeroPPConfig z = std::get<0>(GetParam()).z;
  const CollectivePath path = std::get<1>(GetParam());
  SCOPED_TRACE(std::string(std::get<0>(GetParam()).name) + " on the " + PathName(path) + " path");
  Model sharded = Make(comm, Config(z, path));
  Model single = Make(Communicator::Single(), Config({}, CollectivePath::kAuto));
  ASSERT_NE(sharded.engine, nullptr);
  Engine& e = *sharded.engine;
  std::vector<std::vector<float>> forward(sharded.ids.size());
  ASSERT_TRUE(e.BeginIteration().ok());
  for (size_t k = 0; k < sharded.ids.size(); ++k) {
    const ParamId p = sharded.ids[k];
    std::vector<ParamId> one{p};
    auto fwd = e.Acquire(one, Phase::kForward);
    ASSERT_TRUE(fwd.ok()) << fwd.status().ToString();
    std::vector<float> exact(static_cast<size_t>(e.numel(p)));
    ASSERT_TRUE(single.engine->ReadParam(p, exact).ok());
    const auto* got = static_cast<const float*>(fwd->data(p));
    forward[k].assign(got, got + exact.size());
    // A block's error is at most half its scale, absmax / qmax; the tensor's absmax bounds it.
    const double qmax = z.qwz_bits == 8 ? 127 : 7;
    const double bound = z.qwz ? AbsMax(exact) / (2 * qmax) * (1 + 1e-5) : 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      ASSERT_LE(std::abs(static_cast<double>(got[i]) - exact[i]), bound)
          << "p" << p << "[" << i << "]";
    }
    ASSERT_TRUE(fwd->Release().ok());
  }
  for (size_t k = sharded.ids.size(); k-- > 0;) {
    const ParamId p = sharded.ids[k];
    std::vector<ParamId> one{p};
    auto bwd = e.Acquire(one, Phase::kBackward);
    ASSERT_TRUE(bwd.ok()) << bwd.status().ToString();
    const auto* got = static_cast<const float*>(bwd->data(p));
    ASSERT_EQ(std::memcmp(got, forward[k].data(), forward[k].size() * 4), 0)
        << "p" << p << ": backward computes on other values than forward";
    auto* g = static_cast<float*>(bwd->grad(p));
    for (int64_t i = 0; i < e.numel(p); ++i)
      g[i] = static_cast<float>(GradValue(comm->rank(), p, i));
    ASSERT_TRUE(bwd->Release().ok());
  }
  ASSERT_TRUE(e.EndIteration().ok());
  const EngineStats stats = e.stats();
  EXPECT_GT(stats.param_regather.collectives, 0u) << "backward never gathered again";
  if (z.hpz) {
    EXPECT_EQ(stats.param_regather.bytes_cross_node, 0u);
  }
  for (ParamId p : sharded.ids) {
    std::vector<float> got(static_cast<size_t>(e.numel(p)));
    ASSERT_TRUE(e.ReadGrad(p, got).ok());
    // Note [Quantized collectives] in comm/quantized.h: sum_r A_r / (qmax W), A_r the absmax of
    // rank r's input over the block (at most over the tensor), plus fp32 rounding.
    double bound_sum = 0;
    for (int r = 0; r < w; ++r) {
      double a = 0;
      for (int64_t i = 0; i < e.numel(p); ++i) a = std::max(a, std::abs(GradValue(r, p, i)));
      bound_sum += a;
    }
    const double qmax = z.qgz_bits == 8 ? 127 : 7;
    const double bound = z.qgz ? bound_sum / (qmax * w) : 0;
    for (int64_t i = 0; i < e.numel(p); ++i) {
      double mean = 0;
      for (int r = 0; r < w; ++r) mean += GradValue(r, p, i);
      mean /= w;
      ASSERT_NEAR(got[static_cast<size_t>(i)], mean, bound * (1 + 1e-5) + 1e-6 * std::abs(mean))
          << "p" << p << "[" << i << "]";
    }
  }
}

// Gradient accumulation: each micro-batch's quantized mean is added into the fp32 shard.
TEST_P(ZeroPPPath, TwoMicroBatchesAddTheirMeansWithinTwiceTheBound) {
  REQUIRE_RANKS();
  auto comm = World();
  const int w = comm->size();
  EngineConfig config = Config(Z(true, 8, true, true, 4), GetParam());
  config.grad_accumulation = 2;
  Model m = Make(comm, config);
  ASSERT_NE(m.engine, nullptr);
  Engine& e = *m.engine;
  for (int micro = 0; micro < 2; ++micro) {
    ASSERT_TRUE(e.BeginIteration().ok());
    for (ParamId p : m.ids) {
      std::vector<ParamId> one{p};
      auto f = e.Acquire(one, Phase::kForward);
      ASSERT_TRUE(f.ok() && f->Release().ok());
    }
    for (size_t k = m.ids.size(); k-- > 0;) {
      const ParamId p = m.ids[k];
      std::vector<ParamId> one{p};
      auto b = e.Acquire(one, Phase::kBackward);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      auto* g = static_cast<float*>(b->grad(p));
      for (int64_t i = 0; i < e.numel(p); ++i)
        g[i] = static_cast<float>(GradValue(comm->rank() + micro, p, i));
      ASSERT_TRUE(b->Release().ok());
    }
    ASSERT_TRUE(e.EndIteration().ok());
  }
  for (ParamId p : m.ids) {
    std::vector<float> got(static_cast<size_t>(e.numel(p)));
    ASSERT_TRUE(e.ReadGrad(p, got).ok());
    double bound = 0;  // each micro-batch's bound (Note [Quantized collectives]), added
    for (int micro = 0; micro < 2; ++micro) {
      for (int r = 0; r < w; ++r) {
        double a = 0;
        for (int64_t i = 0; i < e.numel(p); ++i)
          a = std::max(a, std::abs(GradValue(r + micro, p, i)));
        bound += a / (7.0 * w);
      }
    }
    for (int64_t i = 0; i < e.numel(p); ++i) {
      double sum = 0;
      for (int micro = 0; micro < 2; ++micro) {
        for (int r = 0; r < w; ++r) sum += GradValue(r + micro, p, i) / w;
      }
      ASSERT_NEAR(got[static_cast<size_t>(i)], sum, bound * (1 + 1e-5) + 1e-6 * std::abs(sum))
          << "p" << p << "[" << i << "]";
    }
  }
}

// Bytes of one warm-up iteration (every chunk gathered for forward and again for backward).
EngineStats OneIteration(const ZeroPPConfig& z, CollectivePath path) {
  auto comm = World();
  Model m = Make(comm, Config(z, path, DType::kBF16));
  EXPECT_NE(m.engine, nullptr);
  if (m.engine == nullptr) return {};
  Engine& e = *m.engine;
  EXPECT_TRUE(e.BeginIteration().ok());
  for (ParamId p : m.ids) {
    std::vector<ParamId> one{p};
    auto s = e.Acquire(one, Phase::kForward);
    EXPECT_TRUE(s.ok() && s->Release().ok());
  }
  for (size_t k = m.ids.size(); k-- > 0;) {
    std::vector<ParamId> one{m.ids[k]};
    auto s = e.Acquire(one, Phase::kBackward);
    EXPECT_TRUE(s.ok());
    std::memset(s->grad(m.ids[k]), 0, static_cast<size_t>(e.numel(m.ids[k])) * 2);
    EXPECT_TRUE(s->Release().ok());
  }
  EXPECT_TRUE(e.EndIteration().ok());
  return e.stats();
}

uint64_t CrossNode(const EngineStats& s) {
  return s.param_gather.bytes_cross_node + s.param_regather.bytes_cross_node +
         s.grad_reduce.bytes_cross_node;
}

TEST_P(ZeroPPPath, AllThreeCrossNodesWithAQuarterOfZero3sBytesOrLess) {
  REQUIRE_RANKS();
  const EngineStats plain = OneIteration({}, GetParam());
  const EngineStats zpp = OneIteration(Z(true, 8, true, true, 4), GetParam());
  ASSERT_GT(CrossNode(plain), 0u);
  // Plain ZeRO-3: every byte it sends is unquantized (through host buffers with each shard's
  // gather tag after it).
  const uint64_t tags = GetParam() == CollectivePath::kHost
                            ? plain.param_gather.collectives * (World()->size() - 1) * 64
                            : 0;
  EXPECT_EQ(plain.param_gather.bytes_sent, plain.param_gather.bytes_unquantized + tags);
  EXPECT_EQ(plain.grad_reduce.bytes_sent, plain.grad_reduce.bytes_unquantized);
  // The same values were moved.
  EXPECT_EQ(zpp.param_gather.bytes_unquantized, plain.param_gather.bytes_unquantized);
  EXPECT_EQ(zpp.grad_reduce.bytes_unquantized, plain.grad_reduce.bytes_unquantized);
  EXPECT_EQ(zpp.param_regather.bytes_cross_node, 0u);
  const double ratio = static_cast<double>(CrossNode(zpp)) / static_cast<double>(CrossNode(plain));
  if (World()->rank() == 0) {
    std::printf("cross-node bytes per iteration (%s path): ZeRO-3 %llu, ZeRO++ %llu (%.3f)\n",
                PathName(GetParam()).c_str(), static_cast<unsigned long long>(CrossNode(plain)),
                static_cast<unsigned long long>(CrossNode(zpp)), ratio);
  }
  EXPECT_LE(ratio, 0.27);
}

// A training loop whose gradients depend on the values backward computes on, so a stale or
// wrong secondary partition changes the parameters.
std::vector<std::vector<float>> Train(Engine& e, const std::vector<ParamId>& ids, int steps,
                                      int rank) {
  std::vector<std::vector<float>> after;
  for (int s = 0; s < steps; ++s) {
    EXPECT_TRUE(e.BeginIteration().ok());
    for (ParamId p : ids) {
      std::vector<ParamId> one{p};
      auto f = e.Acquire(one, Phase::kForward);
      EXPECT_TRUE(f.ok() && f->Release().ok());
    }
    for (size_t k = ids.size(); k-- > 0;) {
      std::vector<ParamId> one{ids[k]};
      auto b = e.Acquire(one, Phase::kBackward);
      EXPECT_TRUE(b.ok());
      if (!b.ok()) return after;
      const auto* x = static_cast<const uint16_t*>(b->data(ids[k]));
      std::vector<uint16_t> g(static_cast<size_t>(e.numel(ids[k])));
      for (size_t i = 0; i < g.size(); ++i) {
        // bf16 gradient = x / 2 + a rank's term (the bits of x decide it).
        float xf;
        const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
        std::memcpy(&xf, &bits, 4);
        const float gf = 0.5f * xf + 0.001f * static_cast<float>(rank + 1);
        uint32_t gb;
        std::memcpy(&gb, &gf, 4);
        g[i] = static_cast<uint16_t>(gb >> 16);
      }
      std::memcpy(b->grad(ids[k]), g.data(), g.size() * 2);
      EXPECT_TRUE(b->Release().ok());
    }
    EXPECT_TRUE(e.EndIteration().ok());
    auto r = e.Step({.lr = 1e-2f});
    EXPECT_TRUE(r.ok() && r->applied);
    std::vector<float> all;
    for (ParamId p : ids) {
      std::vector<float> v(static_cast<size_t>(e.numel(p)));
      EXPECT_TRUE(e.ReadParam(p, v).ok());
      all.insert(all.end(), v.begin(), v.end());
    }
    after.push_back(std::move(all));
  }
  return after;
}

TEST_P(ZeroPPPath, HpzTwentyStepsEqualARunWithoutItAcrossASaveAndLoad) {
  REQUIRE_RANKS();
  auto comm = World();
  // Chunks larger than the device budget holds at once, so backward gathers again.
  const std::vector<int64_t> sizes = {200000, 150000, 250000, 100000, 180000, 220000};
  EngineConfig base = Config({}, GetParam(), DType::kBF16);
  base.chunk_elems = 262144;
  base.device_budget = 2 << 20;
  EngineConfig hpz = base;
  hpz.zeropp.hpz = true;
  Model plain = Make(comm, base, sizes);
  ASSERT_NE(plain.engine, nullptr);
  const auto want = Train(*plain.engine, plain.ids, 20, comm->rank());
  std::string dir =
      std::filesystem::temp_directory_path() / ("tz_zeropp_hpz_ckpt_" + PathName(GetParam()));
  if (comm->rank() == 0) std::filesystem::remove_all(dir);
  ASSERT_TRUE(comm->Barrier().ok());
  std::vector<std::vector<float>> got;
  {
    Model a = Make(comm, hpz, sizes);
    ASSERT_NE(a.engine, nullptr);
    got = Train(*a.engine, a.ids, 10, comm->rank());
    ASSERT_TRUE(a.engine->SaveCheckpoint(dir).ok());
    EXPECT_GT(a.engine->stats().param_regather.collectives, 0u) << "backward never gathered";
    EXPECT_EQ(a.engine->stats().param_regather.bytes_cross_node, 0u);
  }
  Model b = Make(comm, hpz, sizes);
  ASSERT_NE(b.engine, nullptr);
  auto loaded = b.engine->LoadCheckpoint(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  auto rest = Train(*b.engine, b.ids, 10, comm->rank());
  got.insert(got.end(), rest.begin(), rest.end());
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < want.size(); ++s) {
    ASSERT_EQ(got[s].size(), want[s].size());
    ASSERT_EQ(std::memcmp(got[s].data(), want[s].data(), want[s].size() * 4), 0)
        << "the parameters after step " << s + 1 << " differ";
  }
  ASSERT_TRUE(comm->Barrier().ok());
  if (comm->rank() == 0) std::filesystem::remove_all(dir);
}

TEST(ZeroPPConfig, BadSettingsAreRefusedWithTheField) {
  ZeroPPConfig z = Z(true, 5, false, false, 4);
  auto e = Engine::Create(Config(z, CollectivePath::kDevice), World());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("zeropp.qwz_bits"), std::string::npos);
  z = Z(true, 8, false, false, 4, 32);
  e = Engine::Create(Config(z, CollectivePath::kHost), World());
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("zeropp.block_elems"), std::string::npos);
}

}  // namespace
}  // namespace tierzero

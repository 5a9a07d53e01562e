// The engine on W ranks (run under mpirun -np 2 and 4): gradients are the mean over the ranks
// (against a double-precision reference of what each rank wrote), ReadParam and the collective
// safetensors export agree with a one-rank engine of the same model, and ranks whose programs
// differ end with an error naming the ranks on every rank instead of hanging.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "tierzero/communicator.h"
#include "tierzero/engine.h"

namespace tierzero {
namespace {

std::shared_ptr<Communicator> World() {
  static std::shared_ptr<Communicator> comm = [] {
    auto c = Communicator::Mpi();
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
      std::abort();
    }
    return *c;
  }();
  return comm;
}

EngineConfig SmallConfig() {
  EngineConfig c;
  c.device = DeviceChoice::kHost;
  c.compute_dtype = DType::kF32;
  c.device_budget = 4 << 20;
  c.host_budget = 64 << 20;
  c.chunk_elems = 4096;  // several tensors split between shards
  return c;
}

// Three tensors of awkward sizes, so shard boundaries fall inside them.
struct Model {
  std::unique_ptr<Engine> engine;
  std::vector<ParamId> ids;
};

Model Make(std::shared_ptr<Communicator> comm) {
  Model m;
  auto e = Engine::Create(SmallConfig(), std::move(comm));
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  m.engine = std::move(*e);
  const std::vector<std::vector<int64_t>> shapes = {{37, 29}, {1500}, {3, 700}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto id = m.engine->RegisterParam(
        {"p" + std::to_string(i), shapes[i], InitNormal(0.5f, 11 + i), true});
    EXPECT_TRUE(id.ok());
    m.ids.push_back(*id);
  }
  EXPECT_TRUE(m.engine->Finalize().ok());
  return m;
}

// What rank r writes as element i of parameter p's gradient.
double GradValue(int rank, int p, int64_t i) {
  return std::sin(0.37 * static_cast<double>(i) + p) * (rank + 1) + 0.01 * rank;
}

TEST(EngineRanks, GradientsAreTheMeanOverRanksAndParametersMatchOneRank) {
  auto comm = World();
  const int w = comm->size();
  Model sharded = Make(comm);
  Model single = Make(Communicator::Single());
  Engine& e = *sharded.engine;
  ASSERT_TRUE(e.BeginIteration().ok());
  for (ParamId p : sharded.ids) {
    std::vector<ParamId> one{p};
    auto fwd = e.Acquire(one, Phase::kForward);
    ASSERT_TRUE(fwd.ok()) << fwd.status().ToString();
    // The gathered chunk holds every rank's shard: the whole parameter as one rank has it.
    std::vector<float> want(static_cast<size_t>(e.numel(p)));
    ASSERT_TRUE(single.engine->ReadParam(p, want).ok());
    const auto* got = static_cast<const float*>(fwd->data(p));
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(got[i], want[i]) << "p" << p << "[" << i << "]";
    ASSERT_TRUE(fwd->Release().ok());
  }
  for (size_t k = sharded.ids.size(); k-- > 0;) {
    const ParamId p = sharded.ids[k];
    std::vector<ParamId> one{p};
    auto bwd = e.Acquire(one, Phase::kBackward);
    ASSERT_TRUE(bwd.ok()) << bwd.status().ToString();
    auto* g = static_cast<float*>(bwd->grad(p));
    for (int64_t i = 0; i < e.numel(p); ++i)
      g[i] = static_cast<float>(GradValue(comm->rank(), p, i));
    ASSERT_TRUE(bwd->Release().ok());
  }
  ASSERT_TRUE(e.EndIteration().ok());
  for (ParamId p : sharded.ids) {
    std::vector<float> got(static_cast<size_t>(e.numel(p)));
    ASSERT_TRUE(e.ReadGrad(p, got).ok());
    for (int64_t i = 0; i < e.numel(p); ++i) {
      double mean = 0;
      for (int r = 0; r < w; ++r) mean += GradValue(r, p, i);
      mean /= w;
      ASSERT_NEAR(got[static_cast<size_t>(i)], mean, 1e-6 * (1 + std::abs(mean)))
          << "p" << p << "[" << i << "]";
    }
  }
  // ReadParam is collective and gathers the parameter whole.
  for (ParamId p : sharded.ids) {
    std::vector<float> a(static_cast<size_t>(e.numel(p))), b(a.size());
    ASSERT_TRUE(e.ReadParam(p, a).ok());
    ASSERT_TRUE(single.engine->ReadParam(p, b).ok());
    EXPECT_EQ(a, b);
  }
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(EngineRanks, CollectiveExportWritesWhatOneRankWrites) {
  auto comm = World();
  Model sharded = Make(comm);
  Model single = Make(Communicator::Single());
  const std::string dir = "/tmp/tz-engine-ranks-" + std::to_string(::getppid());
  const std::string a = dir + ".sharded.safetensors",
                    b = dir + ".single.rank" + std::to_string(comm->rank()) + ".safetensors";
  ASSERT_TRUE(sharded.engine->ExportSafetensors(a, DType::kF32).ok());
  ASSERT_TRUE(single.engine->ExportSafetensors(b, DType::kF32).ok());
  const std::string sa = Slurp(a), sb = Slurp(b);
  EXPECT_FALSE(sb.empty());
  EXPECT_EQ(sa, sb);
  ASSERT_TRUE(comm->Barrier().ok());
  std::remove(b.c_str());
  if (comm->rank() == 0) std::remove(a.c_str());
}

TEST(EngineRanks, RanksAcquiringDifferentParametersFailTogetherWithAMessage) {
  auto comm = World();
  Model m = Make(comm);
  Engine& e = *m.engine;
  // The last rank acquires another parameter at moment 0.
  std::vector<ParamId> one{comm->rank() == comm->size() - 1 ? m.ids[2] : m.ids[0]};
  auto scope = e.Acquire(one, Phase::kForward);
  ASSERT_FALSE(scope.ok());
  EXPECT_NE(scope.status().ToString().find("the ranks' programs differ"), std::string::npos)
      << scope.status().ToString();
  EXPECT_NE(scope.status().ToString().find("rank " + std::to_string(comm->size() - 1)),
            std::string::npos)
      << scope.status().ToString();
}

TEST(EngineRanks, ARankEndingItsIterationEarlyFailsTogetherWithAMessage) {
  auto comm = World();
  Model m = Make(comm);
  Engine& e = *m.engine;
  ASSERT_TRUE(e.BeginIteration().ok());
  {
    std::vector<ParamId> one{m.ids[0]};
    auto scope = e.Acquire(one, Phase::kForward);
    ASSERT_TRUE(scope.ok()) << scope.status().ToString();
  }
  Status s;
  if (comm->rank() == 0) {
    s = e.EndIteration();  // rank 0 stops after one moment, the others go on
  } else {
    std::vector<ParamId> one{m.ids[1]};
    s = e.Acquire(one, Phase::kForward).status();
  }
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.ToString().find("ended its iteration after 1 moments"), std::string::npos)
      << s.ToString();
}

}  // namespace
}  // namespace tierzero

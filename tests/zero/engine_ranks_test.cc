// The engine on W ranks (run under mpirun -np 2 and 4): gradients are the mean over the ranks
// (against a double-precision reference of what each rank wrote), ReadParam and the collective
// safetensors export agree with a one-rank engine of the same model, and ranks whose programs
// differ end with an error naming the ranks on every rank instead of hanging.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
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

Model Make(std::shared_ptr<Communicator> comm, const EngineConfig& config = SmallConfig()) {
  Model m;
  auto e = Engine::Create(config, std::move(comm));
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

// The gathers and reductions device to device (the default on the simulated device), with
// parameter shards resident on the device, and through host buffers.
struct PathCase {
  const char* name;
  CollectivePath path;
  uint64_t device_shard_budget;
};
const PathCase kPaths[] = {{"device", CollectivePath::kAuto, 0},
                           {"device, resident shards", CollectivePath::kDevice, 1 << 20},
                           {"host", CollectivePath::kHost, 0}};

class EngineRanksPaths : public ::testing::TestWithParam<PathCase> {};
INSTANTIATE_TEST_SUITE_P(Paths, EngineRanksPaths, ::testing::ValuesIn(kPaths),
                         [](const auto& info) { return std::to_string(info.index); });

TEST_P(EngineRanksPaths, GradientsAreTheMeanOverRanksAndParametersMatchOneRank) {
  auto comm = World();
  const int w = comm->size();
  EngineConfig config = SmallConfig();
  config.collectives = GetParam().path;
  config.device_shard_budget = GetParam().device_shard_budget;
  SCOPED_TRACE(GetParam().name);
  Model sharded = Make(comm, config);
  Model single = Make(Communicator::Single());
  Engine& e = *sharded.engine;
  if (config.device_shard_budget > 0) {
    ASSERT_EQ(e.PlacementSummary().find("device: 0 param"), std::string::npos)
        << e.PlacementSummary();
  }
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

// Note [Agreeing on an outcome]: a step only one rank fails ends on every rank at once with that
// rank's message (the collective deadline is cut to 20 s, so a wait for it would show), and a
// checkpoint one rank cannot load changes no rank's state.
TEST(EngineRanks, OneRankFailingToSaveExportOrLoadFailsEveryRankAtOnce) {
  auto comm = World();
  comm->SetTimeout(20);
  Model m = Make(comm);
  Engine& e = *m.engine;
  const int last = comm->size() - 1;
  const std::string base = "/tmp/tz-engine-ranks-fail-" + std::to_string(::getppid());
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };

  // Save: the last rank's directory cannot be created (a file is in the way).
  const std::string blocker = base + ".blocker";
  if (comm->rank() == last) std::ofstream(blocker) << "x";
  ASSERT_TRUE(comm->Barrier().ok());
  Status s = e.SaveCheckpoint(comm->rank() == last ? blocker + "/ckpt" : base + ".ckpt");
  ASSERT_FALSE(s.ok());
  if (comm->rank() != last) {
    EXPECT_NE(s.ToString().find("rank " + std::to_string(last) + " of "), std::string::npos)
        << s.ToString();
  }
  EXPECT_NE(s.ToString().find(blocker), std::string::npos) << s.ToString();

  // Export: rank 0, the writer, cannot create the file; the others take part in every gather.
  s = e.ExportSafetensors(
      comm->rank() == 0 ? blocker + "/model.safetensors" : base + ".unused.safetensors",
      DType::kF32);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.ToString().find(blocker), std::string::npos) << s.ToString();

  // Load: a good checkpoint, then rank 1's states file corrupted (with 4 ranks the last one owns
  // only padding of this small model).
  const std::string dir = base + ".good";
  ASSERT_TRUE(e.SaveCheckpoint(dir).ok());
  std::vector<float> before(1500), after(1500);
  ASSERT_TRUE(e.ReadParam(m.ids[1], before).ok());
  if (comm->rank() == 0) {
    for (const auto& f : std::filesystem::directory_iterator(dir)) {
      const std::string name = f.path().filename().string();
      if (name.find(".rank1.bin") == std::string::npos) continue;
      const auto mid = static_cast<std::streamoff>(std::filesystem::file_size(f.path()) / 2);
      ASSERT_GT(mid, 0);
      std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
      io.seekg(mid);
      const char c = static_cast<char>(io.get());
      io.seekp(mid);
      io.put(static_cast<char>(c ^ 0x5a));
    }
  }
  ASSERT_TRUE(comm->Barrier().ok());
  auto loaded = e.LoadCheckpoint(dir);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().ToString().find("checksum mismatch"), std::string::npos)
      << loaded.status().ToString();
  ASSERT_TRUE(e.ReadParam(m.ids[1], after).ok());
  EXPECT_EQ(before, after);
  EXPECT_LT(seconds(), 15.0) << "a rank waited for the collective deadline";

  ASSERT_TRUE(comm->Barrier().ok());
  comm->SetTimeout(300);
  if (comm->rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(base + ".ckpt");
    std::filesystem::remove(blocker);
  }
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
      << scope.status().ToString();  // Nothing can bring the ranks back in step: later calls say so
                                     // instead of starting collectives
  // that would wait for the deadline.
  std::vector<ParamId> same{m.ids[0]};
  auto again = e.Acquire(same, Phase::kForward);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().ToString().find("out of step"), std::string::npos)
      << again.status().ToString();
  auto step = e.Step({});
  ASSERT_FALSE(step.ok());
  EXPECT_NE(step.status().ToString().find("out of step"), std::string::npos)
      << step.status().ToString();
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

// The Updater driven without an Engine: a shard store and chunk manager on the simulated device
// with parameter shards on the device, in host memory and on NVMe and optimizer states in host
// memory and on NVMe. Each step's parameters and states are checked against AdamW written here
// from the paper in double precision (Loshchilov & Hutter: decoupled decay, bias-corrected
// moments), its norm against the gradients' own sum; a non-finite gradient changes nothing;
// the CPU chain behind the forward and the speculative start give the very bits of a plain step.
#include "update/updater.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "chunk/placement.h"
#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "offload/host_sim_device.h"
#include "offload/nvme_store.h"

namespace tierzero {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kChunkElems = 4096;
constexpr double kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kDecay = 0.1;

struct RigOptions {
  OptimizerPlacement placement = OptimizerPlacement::kCpu;
  double device_fraction = 0;
  SpeculativeStep speculative = SpeculativeStep::kOff;
  int accumulation = 1;
};

// Every part the Updater works on. It is declared before the store (whose host groups may point
// into its side buffers after a speculative commit) and shut down first, as in the engine.
struct Rig {
  std::string dir;
  std::unique_ptr<Device> device;
  std::unique_ptr<NvmeStore> nvme;
  ChunkLayout layout;
  Placement placement;
  Timeline timeline;
  AlignedBuffer param_out;
  std::shared_ptr<Communicator> comm = Communicator::Single();
  std::vector<bool> decay;
  std::unique_ptr<Updater> updater;
  std::unique_ptr<ShardStore> store;
  std::unique_ptr<ChunkManager> cm;
  Stream compute;

  ~Rig() {
    if (updater) updater->Shutdown();
    cm.reset();
    store.reset();
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

std::unique_ptr<Rig> MakeRig(const RigOptions& ro, const std::string& tag) {
  auto rig = std::make_unique<Rig>();
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  rig->dir = (fs::path(testing::TempDir()) /
              ("tz_updater_" + std::string(info->name()) + tag + std::to_string(getpid())))
                 .string();
  fs::create_directories(rig->dir);
  HostSimOptions ho;
  ho.capacity_bytes = 64 * kMiB;
  rig->device = std::move(CreateHostSimDevice(ho)).value();
  rig->compute = std::move(Stream::Create(*rig->device, "compute")).value();
  NvmeStoreOptions no;
  no.paths = {rig->dir};
  no.bytes_per_path = 64 * kMiB;
  rig->nvme = std::move(NvmeStore::Open(no)).value();
  // 12 tensors of awkward sizes; every other one decays.
  std::vector<TensorDesc> tensors;
  std::mt19937 rng(5);
  for (int i = 0; i < 12; ++i) {
    tensors.push_back({"t" + std::to_string(i), 200 + rng() % 3000});
    rig->decay.push_back(i % 2 == 0);
  }
  LayoutOptions lo;
  lo.chunk_elems = kChunkElems;
  lo.dtype = DType::kBF16;
  rig->layout = std::move(ChunkLayout::Build(tensors, lo)).value();
  const int n = rig->layout.num_chunks();
  const uint64_t shard = rig->layout.shard_bytes();
  const uint64_t group = rig->layout.shard_elems() * 12;
  // The first chunk's parameters on the device, the next half in host memory, the rest on NVMe;
  // every other chunk's optimizer states in host memory, the others on NVMe. (PlaceShards spills
  // every state before any parameter; the Updater must take any mix.)
  TZ_CHECK(n >= 4) << n << " chunks";
  Placement& p = rig->placement;
  p.chunks.resize(static_cast<size_t>(n));
  p.param_shard_bytes = p.grad_shard_bytes = shard;
  p.optim_shard_bytes = group;
  for (int c = 0; c < n; ++c) {
    ChunkPlacement& cp = p.chunks[static_cast<size_t>(c)];
    cp.param = c == 0 ? Tier::kDevice : c <= n / 2 ? Tier::kHost : Tier::kNvme;
    cp.optimizer = c % 2 == 0 ? Tier::kHost : Tier::kNvme;
    p.bytes[static_cast<int>(cp.param)] += shard;
    p.bytes[static_cast<int>(cp.optimizer)] += group;
    p.bytes[static_cast<int>(Tier::kHost)] += shard;  // the gradient
  }
  ChunkManagerOptions mo;
  mo.device_budget_bytes = 4 * rig->layout.chunk_bytes();
  mo.grad_accumulation = ro.accumulation > 1;
  ShardStoreOptions so = ChunkManager::StoreOptions(rig->layout, rig->placement, mo);
  for (const ChunkPlacement& p : rig->placement.chunks) so.optimizer_tier.push_back(p.optimizer);
  rig->store = std::move(ShardStore::Create(*rig->device, rig->nvme.get(), so)).value();
  rig->cm = std::move(ChunkManager::Create(*rig->device, rig->compute.handle(), *rig->store,
                                           rig->layout, rig->placement, mo))
                .value();
  rig->param_out = AlignedBuffer::Allocate(AlignUp(shard, kNvmeAlignment));
  std::memset(rig->param_out.data(), 0, rig->param_out.bytes());
  UpdaterParts parts;
  parts.device = rig->device.get();
  parts.store = rig->store.get();
  parts.cm = rig->cm.get();
  parts.layout = &rig->layout;
  parts.comm = rig->comm.get();
  parts.timeline = &rig->timeline;
  parts.param_out = &rig->param_out;
  parts.weight_decay = rig->decay;
  UpdaterConfig uc;
  uc.adam.beta1 = static_cast<float>(kBeta1);
  uc.adam.beta2 = static_cast<float>(kBeta2);
  uc.adam.eps = static_cast<float>(kEps);
  uc.weight_decay = static_cast<float>(kDecay);
  uc.cpu_threads = 2;
  uc.compute_dtype = DType::kBF16;
  uc.grad_accumulation = ro.accumulation;
  uc.placement = ro.placement;
  uc.device_fraction = ro.device_fraction;
  uc.speculative_step = ro.speculative;
  uc.host_budget = 256 * kMiB;
  uc.speculation_room_bytes = 64 * kMiB;
  uc.host_compute = true;
  auto u = Updater::Create(std::move(parts), uc);
  TZ_CHECK(u.ok()) << u.status().ToString();
  rig->updater = std::move(u).value();
  return rig;
}

// The whole model's state as the reference sees it: per tensor, master, m, v (double).
struct Model {
  std::vector<std::vector<double>> master, m, v;
};

// Every tensor's slice of every chunk's shard (W = 1: whole tensors).
template <typename Fn>
void ForEachSlice(const Rig& rig, Fn fn) {
  for (int c = 0; c < rig.layout.num_chunks(); ++c) {
    for (const ShardSlice& sl : rig.layout.ShardSlices(c, 0)) fn(c, sl);
  }
}

// Random masters, zero moments, into the rig's optimizer groups.
Model InitStates(Rig& rig, uint32_t seed) {
  Model model;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.5f);
  for (int t = 0; t < rig.layout.num_tensors(); ++t) {
    const uint64_t n = rig.layout.tensor(t).numel;
    std::vector<double> w(n);
    for (double& x : w) x = dist(rng);
    model.master.push_back(w);
    model.m.emplace_back(n, 0.0);
    model.v.emplace_back(n, 0.0);
  }
  const uint64_t se = rig.layout.shard_elems();
  TZ_CHECK_OK(rig.store->optimizer()->Init([&](const OptimizerGroup& g) {
    std::memset(g.master, 0, se * 4);
    std::memset(g.m, 0, se * 4);
    std::memset(g.v, 0, se * 4);
    for (const ShardSlice& sl : rig.layout.ShardSlices(g.chunk, 0)) {
      for (uint64_t i = 0; i < sl.numel; ++i) {
        g.master[sl.shard_offset + i] =
            static_cast<float>(model.master[static_cast<size_t>(sl.tensor)][sl.tensor_begin + i]);
      }
    }
    return Status::OK();
  }));
  return model;
}

// Random bf16 gradients into every gradient shard (padding zero); `poison` puts a NaN in one.
// Returns the gradients as the reference reads them (the bf16 values, widened).
std::vector<std::vector<double>> SetGrads(Rig& rig, uint32_t seed, bool poison = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<std::vector<double>> grads;
  for (int t = 0; t < rig.layout.num_tensors(); ++t)
    grads.emplace_back(rig.layout.tensor(t).numel, 0.0);
  TZ_CHECK_OK(rig.store->ZeroGrads());
  ForEachSlice(rig, [&](int c, const ShardSlice& sl) {
    auto* g = static_cast<uint16_t*>(rig.store->grad(c));
    for (uint64_t i = 0; i < sl.numel; ++i) {
      const uint16_t b = F32ToBF16Scalar(dist(rng));
      g[sl.shard_offset + i] = b;
      grads[static_cast<size_t>(sl.tensor)][sl.tensor_begin + i] = BF16ToF32Scalar(b);
    }
  });
  if (poison) static_cast<uint16_t*>(rig.store->grad(0))[3] = 0x7FC0;  // NaN
  return grads;
}

// AdamW from the paper, in double precision.
void ReferenceStep(Model& model, const std::vector<std::vector<double>>& grads, const Rig& rig,
                   int64_t t, double lr, double scale) {
  const double bc1 = 1 - std::pow(kBeta1, static_cast<double>(t));
  const double bc2 = 1 - std::pow(kBeta2, static_cast<double>(t));
  for (size_t k = 0; k < model.master.size(); ++k) {
    const double wd = rig.decay[k] ? kDecay : 0.0;
    for (size_t i = 0; i < model.master[k].size(); ++i) {
      const double g = grads[k][i] * scale;
      double& m = model.m[k][i];
      double& v = model.v[k][i];
      m = kBeta1 * m + (1 - kBeta1) * g;
      v = kBeta2 * v + (1 - kBeta2) * g * g;
      const double mhat = m / bc1, vhat = v / bc2;
      double& w = model.master[k][i];
      w = w * (1 - lr * wd) - lr * mhat / (std::sqrt(vhat) + kEps);
    }
  }
}

// The rig's states and parameters, as raw floats and bf16 bits per chunk.
struct Snapshot {
  std::vector<std::vector<float>> states;     // per chunk: master | m | v
  std::vector<std::vector<uint16_t>> params;  // per chunk: the bf16 shard
};

Snapshot Read(Rig& rig) {
  TZ_CHECK_OK(rig.updater->Await());  // a chain behind the forward may still run
  Snapshot s;
  const uint64_t se = rig.layout.shard_elems();
  for (int c = 0; c < rig.layout.num_chunks(); ++c) {
    std::vector<float> st(3 * se);
    TZ_CHECK_OK(rig.store->optimizer()->With(c, false, [&](const OptimizerGroup& g) {
      std::memcpy(st.data(), g.master, se * 4);
      std::memcpy(st.data() + se, g.m, se * 4);
      std::memcpy(st.data() + 2 * se, g.v, se * 4);
      return Status::OK();
    }));
    s.states.push_back(std::move(st));
    std::vector<uint16_t> p(se);
    TZ_CHECK_OK(rig.store->CopyParamBytes(c, 0, rig.layout.shard_bytes(), p.data(), false));
    s.params.push_back(std::move(p));
  }
  return s;
}

// The rig's states against the reference, and every parameter the bf16 rounding of its master.
void ExpectMatches(Rig& rig, const Model& model, double lr) {
  const Snapshot s = Read(rig);
  const uint64_t se = rig.layout.shard_elems();
  int bad = 0;
  ForEachSlice(rig, [&](int c, const ShardSlice& sl) {
    const auto& st = s.states[static_cast<size_t>(c)];
    const size_t k = static_cast<size_t>(sl.tensor);
    for (uint64_t i = 0; i < sl.numel && bad < 5; ++i) {
      const uint64_t at = sl.shard_offset + i;
      const double w = model.master[k][sl.tensor_begin + i];
      const double m = model.m[k][sl.tensor_begin + i];
      const double v = model.v[k][sl.tensor_begin + i];
      // fp32 arithmetic: a few ulps of each value and of the step's size; m cancels across
      // steps, so its error is a fraction of the gradients' size (~1e-3), not of its own.
      const bool ok = std::abs(st[at] - w) <= 1e-6 * std::abs(w) + 1e-4 * lr &&
                      std::abs(st[se + at] - m) <= 1e-5 * std::abs(m) + 1e-9 &&
                      std::abs(st[2 * se + at] - v) <= 1e-5 * std::abs(v) + 1e-13 &&
                      s.params[static_cast<size_t>(c)][at] == F32ToBF16Scalar(st[at]);
      if (!ok) {
        ++bad;
        ADD_FAILURE() << "tensor " << k << " element " << sl.tensor_begin + i << ": master "
                      << st[at] << " (reference " << w << "), m " << st[se + at] << " (" << m
                      << "), v " << st[2 * se + at] << " (" << v << "), parameter bits "
                      << s.params[static_cast<size_t>(c)][at];
      }
    }
  });
}

double GradNorm(const std::vector<std::vector<double>>& grads) {
  double s = 0;
  for (const auto& t : grads)
    for (double g : t) s += g * g;
  return std::sqrt(s);
}

TEST(UpdaterTest, StepsMatchAdamWFromThePaperOnEveryTier) {
  for (OptimizerPlacement p : {OptimizerPlacement::kCpu, OptimizerPlacement::kFraction}) {
    SCOPED_TRACE(p == OptimizerPlacement::kCpu ? "cpu" : "half on the device");
    RigOptions ro;
    ro.placement = p;
    ro.device_fraction = 0.5;
    auto rig = MakeRig(ro, p == OptimizerPlacement::kCpu ? "c" : "f");
    // Every tier holds something.
    int param_tiers[3] = {0, 0, 0}, state_tiers[3] = {0, 0, 0};
    for (const ChunkPlacement& c : rig->placement.chunks) {
      ++param_tiers[static_cast<int>(c.param)];
      ++state_tiers[static_cast<int>(c.optimizer)];
    }
    ASSERT_GT(param_tiers[static_cast<int>(Tier::kDevice)], 0);
    ASSERT_GT(param_tiers[static_cast<int>(Tier::kHost)], 0);
    ASSERT_GT(param_tiers[static_cast<int>(Tier::kNvme)], 0);
    ASSERT_GT(state_tiers[static_cast<int>(Tier::kHost)], 0);
    ASSERT_GT(state_tiers[static_cast<int>(Tier::kNvme)], 0);
    Model model = InitStates(*rig, 1);
    for (int t = 1; t <= 3; ++t) {
      const auto grads = SetGrads(*rig, 100 + t);
      UpdateStepInputs in;
      in.step = t;
      in.lr = 1e-2f * static_cast<float>(t);
      in.grad_scale = 0.5;
      auto r = rig->updater->Step(in);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_TRUE(r->applied);
      EXPECT_NEAR(r->grad_norm, GradNorm(grads) * 0.5, 1e-9 * GradNorm(grads));
      ReferenceStep(model, grads, *rig, t, in.lr, 0.5);
      ASSERT_TRUE(rig->updater->Await().ok());
      ExpectMatches(*rig, model, in.lr);
    }
    const UpdaterStats& st = rig->updater->stats();
    EXPECT_EQ(st.optimizer_cpu_groups + st.optimizer_resident_groups + st.optimizer_streamed_groups,
              rig->layout.num_chunks());
    if (p == OptimizerPlacement::kFraction) {
      EXPECT_GT(st.optimizer_streamed_groups + st.optimizer_resident_groups, 0);
    }
  }
}

TEST(UpdaterTest, ClipsToTheNormAndSkipsANonFiniteGradientUntouched) {
  auto rig = MakeRig({}, "");
  Model model = InitStates(*rig, 2);
  auto grads = SetGrads(*rig, 7);
  UpdateStepInputs in;
  in.step = 1;
  in.lr = 1e-2f;
  in.clip_grad_norm = 0.25 * GradNorm(grads);
  auto r = rig->updater->Step(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->applied);
  const double norm = GradNorm(grads);
  EXPECT_NEAR(r->grad_norm, norm, 1e-9 * norm);
  ReferenceStep(model, grads, *rig, 1, in.lr, in.clip_grad_norm / (r->grad_norm + 1e-6));
  ExpectMatches(*rig, model, in.lr);

  const Snapshot before = Read(*rig);
  SetGrads(*rig, 8, /*poison=*/true);
  in.step = 2;
  r = rig->updater->Step(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->applied);
  EXPECT_TRUE(std::isinf(r->grad_norm));
  const Snapshot after = Read(*rig);
  EXPECT_EQ(after.states, before.states);
  EXPECT_EQ(after.params, before.params);
}

// Three steps of a rig, returning what they left.
Snapshot ThreeSteps(Rig& rig, bool speculate, float lr_of_step3 = -1) {
  InitStates(rig, 3);
  for (int t = 1; t <= 3; ++t) {
    SetGrads(rig, 200 + t);
    const float lr = t == 3 && lr_of_step3 >= 0 ? lr_of_step3 : 1e-2f * static_cast<float>(t);
    if (speculate) {
      // As the engine calls it: announced before the last micro-batch, which then ends.
      rig.updater->Prepare({1e-2f * static_cast<float>(t)});
      TZ_CHECK_OK(rig.updater->BeginTraining(/*last_micro_batch=*/true, t - 1, 1.0f));
      rig.updater->EndIteration(/*keep=*/true);
    }
    UpdateStepInputs in;
    in.step = t;
    in.lr = lr;
    auto r = rig.updater->Step(in);
    TZ_CHECK(r.ok() && r->applied) << r.status().ToString();
    TZ_CHECK_OK(rig.updater->Await());
  }
  return Read(rig);
}

TEST(UpdaterTest, TheSpeculativeStartIsTheStepItselfOrRolledBack) {
  auto plain = MakeRig({}, "p");
  const Snapshot want = ThreeSteps(*plain, false);
  RigOptions ro;
  ro.speculative = SpeculativeStep::kOn;
  auto spec = MakeRig(ro, "s");
  const Snapshot got = ThreeSteps(*spec, true);
  EXPECT_EQ(got.states, want.states);
  EXPECT_EQ(got.params, want.params);
  // Steps 2 and 3 speculated (step 1 has no assignment yet) on the host groups.
  EXPECT_EQ(spec->updater->stats().speculative_steps, 2u);
  EXPECT_EQ(spec->updater->stats().speculative_rollbacks, 0u);
  EXPECT_GT(spec->updater->stats().speculative_groups, 0);
  EXPECT_GT(spec->updater->side_buffer_bytes(), 0u);

  // Step 3 with another learning rate than announced: its speculation is dropped.
  auto plain2 = MakeRig({}, "p2");
  const Snapshot want2 = ThreeSteps(*plain2, false, 5e-2f);
  auto spec2 = MakeRig(ro, "s2");
  const Snapshot got2 = ThreeSteps(*spec2, true, 5e-2f);
  EXPECT_EQ(got2.states, want2.states);
  EXPECT_EQ(got2.params, want2.params);
  EXPECT_EQ(spec2->updater->stats().speculative_rollbacks, 1u);
}

TEST(UpdaterTest, TheChainBehindTheForwardLeavesTheSameBits) {
  auto plain = MakeRig({}, "p");
  Snapshot want;
  {
    ScopedTunable<std::string> mode(kUpdateBehindForward, "off");
    want = ThreeSteps(*plain, false);
  }
  ScopedTunable<std::string> mode(kUpdateBehindForward, "on");
  auto behind = MakeRig({}, "b");
  InitStates(*behind, 3);
  int went_behind = 0;
  for (int t = 1; t <= 3; ++t) {
    SetGrads(*behind, 200 + t);
    UpdateStepInputs in;
    in.step = t;
    in.lr = 1e-2f * static_cast<float>(t);
    auto r = behind->updater->Step(in);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    went_behind += behind->updater->behind_active();
    ASSERT_TRUE(behind->updater->Await().ok());
  }
  EXPECT_EQ(went_behind, 3);
  const Snapshot got = Read(*behind);
  EXPECT_EQ(got.states, want.states);
  EXPECT_EQ(got.params, want.params);
  EXPECT_GT(behind->updater->wait_seconds(), 0.0);
}

TEST(UpdaterTest, CreateRefusesMissingParts) {
  UpdaterParts parts;
  auto u = Updater::Create(std::move(parts), UpdaterConfig{});
  EXPECT_EQ(u.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tierzero

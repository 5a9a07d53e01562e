// ChunkManager on HostSimDevice with all three tiers: parameters and gradients pushed through
// thousands of gathers, evictions and NVMe reads stay bit-exact under every policy, with and
// without throttled copies, through deviations from the trace and re-planning.
#include "chunk/chunk_manager.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "offload/device_wrapper.h"
#include "offload/host_sim_device.h"
#include "stream_logging_devices.h"

namespace tierzero {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kChunkElems = 8192;  // 16 KiB of bf16

struct Rig {
  std::string dir;
  std::unique_ptr<Device> sim;     // the HostSim device
  std::unique_ptr<Device> device;  // what the manager uses: sim behind a (fault, counting) wrapper
  Stream compute;
  std::unique_ptr<NvmeStore> nvme;
  ChunkLayout layout;
  std::vector<std::vector<int>> layers;  // tensor ids acquired together
  std::unique_ptr<ShardStore> store;
  std::unique_ptr<ChunkManager> manager;
  ~Rig() {
    manager.reset();
    store.reset();
    compute.Reset();
    nvme.reset();
    device.reset();
    sim.reset();
    fs::remove_all(dir);
  }
};

struct RigOptions {
  double h2d_bytes_per_second = 0;
  CachePolicy policy = CachePolicy::kPlan;
  bool accumulation = false;
  int budget_chunks = 6;
  uint64_t device_capacity = 8 * kMiB;
  bool faults = false;         // wrap the device in a FaultInjectionDevice
  bool counting = false;       // wrap it in a CountingDevice watching the compute stream
  bool order_logging = false;  // wrap it in an OrderLoggingDevice
};

std::unique_ptr<Rig> MakeRig(const RigOptions& ro) {
  auto rig = std::make_unique<Rig>();
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "_" + info->name();
  for (char& ch : name) {
    if (ch == '/') ch = '_';
  }
  rig->dir =
      (fs::path(testing::TempDir()) / ("tz_chunk_" + name + std::to_string(getpid()))).string();
  fs::create_directories(rig->dir);
  HostSimOptions ho;
  ho.capacity_bytes = ro.device_capacity;
  ho.h2d_bytes_per_second = ro.h2d_bytes_per_second;
  rig->sim = std::move(CreateHostSimDevice(ho)).value();
  if (ro.faults) {
    rig->device = std::make_unique<FaultInjectionDevice>(rig->sim.get());
  } else if (ro.counting) {
    rig->device = std::make_unique<CountingDevice>(rig->sim.get());
  } else if (ro.order_logging) {
    rig->device = std::make_unique<OrderLoggingDevice>(rig->sim.get());
  } else {
    rig->device = std::make_unique<DeviceWrapper>(rig->sim.get());
  }
  rig->compute = std::move(Stream::Create(*rig->device, "compute")).value();
  if (ro.counting) static_cast<CountingDevice&>(*rig->device).watched = rig->compute.handle();
  if (ro.order_logging) {
    static_cast<OrderLoggingDevice&>(*rig->device).compute = rig->compute.handle();
  }
  NvmeStoreOptions no;
  no.paths = {rig->dir};
  no.bytes_per_path = 64 * kMiB;
  rig->nvme = std::move(NvmeStore::Open(no)).value();

  // 10 layers of 3 tensors of awkward sizes, registered in first-use order.
  std::mt19937 rng(11);
  std::vector<TensorDesc> tensors;
  for (int l = 0; l < 10; ++l) {
    std::vector<int> layer;
    for (int i = 0; i < 3; ++i) {
      layer.push_back(static_cast<int>(tensors.size()));
      tensors.push_back({"l" + std::to_string(l) + ".t" + std::to_string(i), 300 + rng() % 5000});
    }
    rig->layers.push_back(layer);
  }
  LayoutOptions lo;
  lo.chunk_elems = kChunkElems;
  rig->layout = std::move(ChunkLayout::Build(tensors, lo)).value();
  const int n = rig->layout.num_chunks();
  const uint64_t shard = rig->layout.shard_bytes();
  // Two chunks on the device; host holds the gradients and half the parameter shards; the rest
  // of the parameters and every optimizer state go to NVMe.
  TierBudgets b;
  b.device_shard_bytes = 2 * shard;
  b.host_bytes = static_cast<uint64_t>(n) * shard + static_cast<uint64_t>(n / 2) * shard;
  b.nvme_bytes = 1 * kGiB;
  Placement placement = std::move(PlaceShards(rig->layout, b)).value();
  int tiers[3] = {0, 0, 0};
  for (const auto& c : placement.chunks) ++tiers[static_cast<int>(c.param)];
  TZ_CHECK(tiers[0] > 0 && tiers[1] > 0 && tiers[2] > 0) << "every tier must be used";
  ChunkManagerOptions mo;
  mo.device_budget_bytes = static_cast<uint64_t>(ro.budget_chunks) * rig->layout.chunk_bytes();
  mo.policy = ro.policy;
  mo.grad_accumulation = ro.accumulation;
  if (ro.h2d_bytes_per_second > 0) mo.h2d_bytes_per_second = ro.h2d_bytes_per_second;
  auto store = ShardStore::Create(*rig->device, rig->nvme.get(),
                                  ChunkManager::StoreOptions(rig->layout, placement, mo));
  TZ_CHECK(store.ok()) << store.status().ToString();
  rig->store = std::move(store).value();
  auto m = ChunkManager::Create(*rig->device, rig->compute.handle(), *rig->store, rig->layout,
                                placement, mo);
  TZ_CHECK(m.ok()) << m.status().ToString();
  rig->manager = std::move(m).value();
  return rig;
}

std::vector<uint16_t> RandomBf16(uint64_t n, std::mt19937& rng) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = static_cast<uint16_t>(rng() & 0x7F7F);  // finite patterns
  return v;
}

// A tensor's parameter values (bf16) into this rank's shard, and its gradient out of its chunk's
// gradient shard, through the shard store (W = 1: whole tensors).
Status WriteTensor(Rig& rig, int t, const void* data) {
  const TensorLoc& loc = rig.layout.tensor(t);
  const DType dt = rig.layout.dtype();
  for (const ShardSlice& sl : rig.layout.ShardSlices(loc.chunk, 0)) {
    if (sl.tensor != t) continue;
    auto* host =
        const_cast<uint8_t*>(static_cast<const uint8_t*>(data)) + DTypeBytes(dt, sl.tensor_begin);
    RETURN_IF_ERROR(rig.store->CopyParamBytes(loc.chunk, DTypeBytes(dt, sl.shard_offset),
                                              DTypeBytes(dt, sl.numel), host, /*to_shard=*/true));
  }
  return Status::OK();
}
Status ReadGrad(Rig& rig, int t, void* data) {
  const TensorLoc& loc = rig.layout.tensor(t);
  const DType gt = rig.store->grad_dtype();
  for (const ShardSlice& sl : rig.layout.ShardSlices(loc.chunk, 0)) {
    if (sl.tensor != t) continue;
    std::memcpy(static_cast<uint8_t*>(data) + DTypeBytes(gt, sl.tensor_begin),
                static_cast<uint8_t*>(rig.store->grad(loc.chunk)) + DTypeBytes(gt, sl.shard_offset),
                DTypeBytes(gt, sl.numel));
  }
  return Status::OK();
}

// Drives iterations, checking every parameter the compute stream sees and every gradient that
// lands in the host shards.
class Driver {
 public:
  explicit Driver(Rig& rig) : rig_(rig), rng_(3) {
    for (int t = 0; t < rig.layout.num_tensors(); ++t) {
      params_.push_back(RandomBf16(rig.layout.tensor(t).numel, rng_));
      TZ_CHECK_OK(WriteTensor(rig, t, params_.back().data()));
    }
    grads_.resize(params_.size());
  }

  // One iteration over `layers` (forward in order, backward in reverse). Returns checks done.
  void Iterate(const std::vector<int>& layers, bool accumulate = false) {
    ChunkManager& m = *rig_.manager;
    ASSERT_TRUE(m.BeginIteration().ok());
    std::vector<bool> used(params_.size(), false);
    for (int l : layers) {
      Moment(rig_.layers[static_cast<size_t>(l)], Phase::kForward, used);
      if (testing::Test::HasFatalFailure()) return;
    }
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      Moment(rig_.layers[static_cast<size_t>(*it)], Phase::kBackward, used);
      if (testing::Test::HasFatalFailure()) return;
    }
    Status st = m.EndIteration();
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (size_t t = 0; t < params_.size(); ++t) {
      const uint64_t n = params_[t].size();
      if (accumulate) {
        std::vector<float> got(n);
        ASSERT_TRUE(ReadGrad(rig_, static_cast<int>(t), got.data()).ok());
        for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], acc_[t][i]) << "tensor " << t;
      } else {
        std::vector<uint16_t> got(n);
        ASSERT_TRUE(ReadGrad(rig_, static_cast<int>(t), got.data()).ok());
        if (used[t]) {
          ASSERT_EQ(got, grads_[t]) << "gradient of tensor " << t;
        } else {
          ASSERT_EQ(got, std::vector<uint16_t>(n, 0)) << "unused tensor " << t << " has gradient";
        }
      }
    }
    // The "optimizer step": new parameters for a third of the tensors.
    for (size_t t = 0; t < params_.size(); t += 3) {
      params_[t] = RandomBf16(params_[t].size(), rng_);
      ASSERT_TRUE(WriteTensor(rig_, static_cast<int>(t), params_[t].data()).ok());
    }
  }

  // Runs an iteration given as acquire/release steps: {tensors, phase, acquire?}. Parameters are
  // checked at every acquire; in backward a fresh gradient is written at acquire. `extra_checks`
  // lists tensors whose parameters are re-checked (still held) after each step.
  struct Step {
    std::vector<int> tensors;
    Phase phase;
    bool acquire;
  };
  void Script(const std::vector<Step>& steps, const std::vector<int>& recheck = {}) {
    ChunkManager& m = *rig_.manager;
    ASSERT_TRUE(m.BeginIteration().ok());
    std::vector<bool> used(params_.size(), false);
    std::vector<bool> held(params_.size(), false);
    for (const Step& st : steps) {
      if (st.acquire) {
        Status s = m.Acquire(st.tensors, st.phase);
        ASSERT_TRUE(s.ok()) << s.ToString();
        for (int t : st.tensors) {
          CheckParams(t, st.phase);
          if (testing::Test::HasFatalFailure()) return;
          if (st.phase == Phase::kBackward) WriteGrad(t, used);
          held[static_cast<size_t>(t)] = true;
        }
      } else {
        ASSERT_TRUE(m.Release(st.tensors, st.phase).ok());
        for (int t : st.tensors) held[static_cast<size_t>(t)] = false;
      }
      for (int t : recheck) {
        if (held[static_cast<size_t>(t)]) CheckParams(t, Phase::kForward);
      }
    }
    Status st = m.EndIteration();
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (size_t t = 0; t < params_.size(); ++t) {
      std::vector<uint16_t> got(params_[t].size());
      ASSERT_TRUE(ReadGrad(rig_, static_cast<int>(t), got.data()).ok());
      if (used[t]) {
        ASSERT_EQ(got, grads_[t]) << "gradient of tensor " << t;
      } else {
        ASSERT_EQ(got, std::vector<uint16_t>(got.size(), 0)) << "unused tensor " << t;
      }
    }
  }

  void CheckParams(int t, Phase phase) {
    Device& d = *rig_.device;
    const StreamHandle s = rig_.compute.handle();
    const size_t i = static_cast<size_t>(t);
    std::vector<uint16_t> seen(params_[i].size());
    ASSERT_NE(rig_.manager->DevicePtr(t), nullptr) << "tensor " << t;
    ASSERT_TRUE(d.CopyAsync(seen.data(), rig_.manager->DevicePtr(t), seen.size() * 2,
                            CopyKind::kDeviceToHost, s)
                    .ok());
    ASSERT_TRUE(d.SynchronizeStream(s).ok());
    ASSERT_EQ(seen, params_[i]) << "tensor " << t << " in " << PhaseName(phase);
  }

  void WriteGrad(int t, std::vector<bool>& used) {
    Device& d = *rig_.device;
    const StreamHandle s = rig_.compute.handle();
    const size_t i = static_cast<size_t>(t);
    grads_[i] = RandomBf16(params_[i].size(), rng_);
    ASSERT_NE(rig_.manager->GradPtr(t), nullptr);
    ASSERT_TRUE(d.CopyAsync(rig_.manager->GradPtr(t), grads_[i].data(), grads_[i].size() * 2,
                            CopyKind::kHostToDevice, s)
                    .ok());
    ASSERT_TRUE(d.SynchronizeStream(s).ok());
    used[i] = true;
  }

  void StartAccumulation() {
    acc_.assign(params_.size(), {});
    for (size_t t = 0; t < params_.size(); ++t) acc_[t].assign(params_[t].size(), 0.0f);
    ASSERT_TRUE(rig_.manager->ZeroGrads().ok());
  }

 private:
  void Moment(const std::vector<int>& tensors, Phase phase, std::vector<bool>& used) {
    ChunkManager& m = *rig_.manager;
    Device& d = *rig_.device;
    const StreamHandle s = rig_.compute.handle();
    Status st = m.Acquire(tensors, phase);
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (int t : tensors) {
      const size_t i = static_cast<size_t>(t);
      std::vector<uint16_t> seen(params_[i].size());
      ASSERT_NE(m.DevicePtr(t), nullptr);
      ASSERT_TRUE(
          d.CopyAsync(seen.data(), m.DevicePtr(t), seen.size() * 2, CopyKind::kDeviceToHost, s)
              .ok());
      ASSERT_TRUE(d.SynchronizeStream(s).ok());
      ASSERT_EQ(seen, params_[i]) << "tensor " << t << " in " << PhaseName(phase);
      if (phase == Phase::kBackward) {
        grads_[i] = RandomBf16(params_[i].size(), rng_);
        ASSERT_NE(m.GradPtr(t), nullptr);
        if (!acc_.empty()) {
          // With accumulation the trainer adds into the zeroed grad chunk; here it writes once
          // per micro-batch, and the host shard accumulates in fp32.
          for (size_t k = 0; k < grads_[i].size(); ++k) acc_[i][k] += BF16ToF32Scalar(grads_[i][k]);
        }
        ASSERT_TRUE(d.CopyAsync(m.GradPtr(t), grads_[i].data(), grads_[i].size() * 2,
                                CopyKind::kHostToDevice, s)
                        .ok());
        ASSERT_TRUE(d.SynchronizeStream(s).ok());  // grads_ may be replaced next iteration
        used[i] = true;
      }
    }
    ASSERT_TRUE(m.Release(tensors, phase).ok());
  }

  Rig& rig_;
  std::mt19937 rng_;
  std::vector<std::vector<uint16_t>> params_, grads_;
  std::vector<std::vector<float>> acc_;
};

std::vector<int> AllLayers() { return {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}; }

struct PolicyCase {
  const char* name;
  CachePolicy policy;
  double h2d;
};

class ChunkManagerPolicyTest : public testing::TestWithParam<PolicyCase> {};

TEST_P(ChunkManagerPolicyTest, DataStaysBitExactThroughManyCycles) {
  RigOptions ro;
  ro.policy = GetParam().policy;
  ro.h2d_bytes_per_second = GetParam().h2d;
  auto rig = MakeRig(ro);
  Driver driver(*rig);
  for (int it = 0; it < 40; ++it) {
    // Every 9th iteration leaves the trace (a layer is skipped); the next one records again.
    std::vector<int> layers = AllLayers();
    if (it % 9 == 5) layers.erase(layers.begin() + 4);
    driver.Iterate(layers);
    if (testing::Test::HasFatalFailure()) return;
  }
  const ChunkCounters c = rig->manager->counters();
  EXPECT_GE(c.evictions + c.h2d_bytes / rig->layout.chunk_bytes(), 1000u)
      << "thousands of gather/evict cycles";
  EXPECT_GT(c.nvme_read_bytes, 0u);
  EXPECT_GE(c.deviations, 4u);
  EXPECT_GE(c.plans, 5u) << "re-planned after each deviation";
  if (GetParam().policy == CachePolicy::kPlan) {
    EXPECT_GT(c.prefetches, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, ChunkManagerPolicyTest,
                         testing::Values(PolicyCase{"plan", CachePolicy::kPlan, 0},
                                         PolicyCase{"plan_throttled", CachePolicy::kPlan, 50e6},
                                         PolicyCase{"lru", CachePolicy::kLru, 0},
                                         PolicyCase{"on_demand_throttled", CachePolicy::kOnDemand,
                                                    50e6}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ChunkManagerTest, GradientAccumulationAddsMicroBatchesInFp32) {
  RigOptions ro;
  ro.accumulation = true;
  auto rig = MakeRig(ro);
  Driver driver(*rig);
  driver.StartAccumulation();
  for (int micro = 0; micro < 3; ++micro) {
    driver.Iterate(AllLayers(), /*accumulate=*/true);
    if (testing::Test::HasFatalFailure()) return;
  }
}

// A separate gradient chunk's memory waits only for the reads of it: with accumulation every
// copy out of a gradient chunk is followed on the D2H stream by a host function (the fp32 add),
// and on CUDA a host function may wait behind other streams' ones. The event the trainer waits
// for before freeing the chunk is recorded right after the copy. Recording it after the whole
// reduction, as before, fails this.
TEST(ChunkManagerTest, AGradientChunkIsFreedAfterItsCopyNotItsHostSideAdd) {
  RigOptions ro;
  ro.accumulation = true;
  ro.order_logging = true;
  auto rig = MakeRig(ro);
  auto& dev = static_cast<OrderLoggingDevice&>(*rig->device);
  Driver driver(*rig);
  driver.StartAccumulation();
  for (int micro = 0; micro < 2; ++micro) {
    driver.Iterate(AllLayers(), /*accumulate=*/true);
    if (testing::Test::HasFatalFailure()) return;
  }
  using Op = OrderLoggingDevice::Op;
  int after_copy = 0;
  for (Op op : dev.waited_after) {
    EXPECT_NE(op, Op::kHostFunc) << "the trainer waited for an event behind a host function";
    after_copy += op == Op::kCopy;
  }
  EXPECT_GT(after_copy, 0) << "no gradient chunk's free waited for its copy";
}

TEST(ChunkManagerTest, PlanRemovesStallsUnderThrottledCopies) {
  RigOptions ro;
  ro.h2d_bytes_per_second = 20e6;  // 16 KiB chunks: 0.8 ms per host gather
  auto rig = MakeRig(ro);
  Driver driver(*rig);
  driver.Iterate(AllLayers());  // warm-up
  ASSERT_TRUE(rig->manager->has_plan());
  const Schedule& s = rig->manager->schedule();
  EXPECT_GT(s.moments.size(), 0u);
  driver.Iterate(AllLayers());
  EXPECT_GT(rig->manager->counters().hits, 0u);
}

// Note [One wait per moment]: under the plan an Acquire queues at most one event and one wait on
// the compute stream (beside zeroing new separate grad chunks in backward), and one whose chunks
// are all gathered and done queues neither.
TEST(ChunkManagerTest, PlannedAcquireQueuesAtMostOneEventAndOneWaitOnCompute) {
  for (int budget : {4, 100}) {  // evictions and prefetches; then room for every chunk
    SCOPED_TRACE("budget " + std::to_string(budget) + " chunks");
    RigOptions ro;
    ro.counting = true;
    ro.budget_chunks = budget;
    auto rig = MakeRig(ro);
    auto& counting = static_cast<CountingDevice&>(*rig->device);
    ChunkManager& m = *rig->manager;
    int idle_backward = 0;  // backward Acquires of the plan that queued no event and no wait
    for (int it = 0; it < 2; ++it) {  // warm-up, then the plan
      ASSERT_TRUE(m.BeginIteration().ok());
      auto moment = [&](const std::vector<int>& t, Phase phase) {
        const int records = counting.records, waits = counting.waits;
        const int memsets = counting.memsets, others = counting.others;
        Status s = m.Acquire(t, phase);
        ASSERT_TRUE(s.ok()) << s.ToString();
        if (it == 1) {
          EXPECT_LE(counting.records - records, 1);
          EXPECT_LE(counting.waits - waits, 1);
          EXPECT_EQ(counting.others, others);
          // Only the zeroing of a separate grad chunk (device-resident shards), in backward.
          if (phase == Phase::kForward) {
            EXPECT_EQ(counting.memsets, memsets);
          }
          if (phase == Phase::kBackward && counting.records == records && counting.waits == waits) {
            ++idle_backward;
          }
        }
        ASSERT_TRUE(m.Release(t, phase).ok());
      };
      for (const auto& t : rig->layers) {
        moment(t, Phase::kForward);
        if (HasFatalFailure()) return;
      }
      // Everything queued so far is done: chunks gathered in forward and kept need nothing.
      ASSERT_TRUE(rig->compute.Synchronize().ok());
      ASSERT_TRUE(rig->device->Synchronize().ok());
      for (auto t = rig->layers.rbegin(); t != rig->layers.rend(); ++t) {
        moment(*t, Phase::kBackward);
        if (HasFatalFailure()) return;
      }
      Status st = m.EndIteration();
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_TRUE(m.has_plan());
    }
    // With room for every chunk nothing is gathered or evicted in backward, and it is all done.
    if (budget == 100) {
      EXPECT_EQ(idle_backward, static_cast<int>(rig->layers.size()));
    }
  }
}

TEST(ChunkManagerTest, MomentThatCannotFitFailsAtWarmUpWithAClearMessage) {
  RigOptions ro;
  ro.budget_chunks = 2;  // a layer spans up to 3 chunks
  auto rig = MakeRig(ro);
  Driver driver(*rig);
  ChunkManager& m = *rig->manager;
  ASSERT_TRUE(m.BeginIteration().ok());
  m.OnNonModelBytes(5000);
  for (const auto& layer : rig->layers) {
    ASSERT_TRUE(m.Acquire(layer, Phase::kForward).ok()) << "warm-up keeps only COMPUTE chunks";
    ASSERT_TRUE(m.Release(layer, Phase::kForward).ok());
  }
  Status st = m.EndIteration();
  ASSERT_EQ(st.code(), StatusCode::kOutOfMemory) << st.ToString();
  EXPECT_NE(st.message().find("gathered chunks of 16 KiB but only"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("non-model data"), std::string::npos);
  EXPECT_NE(st.message().find("smaller chunks"), std::string::npos);
}

TEST(ChunkManagerTest, WarmUpUnderATightDeviceSucceeds) {
  // The device holds the two device-resident shards, their two gradient chunks in backward, and
  // four more chunks: far less than the model, enough for any one moment.
  RigOptions ro;
  ro.device_capacity = 8 * 16 * kKiB;
  ro.budget_chunks = 4;
  auto rig = MakeRig(ro);
  Driver driver(*rig);
  driver.Iterate(AllLayers());
  EXPECT_TRUE(rig->manager->has_plan());
  driver.Iterate(AllLayers());
}

// Forward over all layers, backward over all but `skip_bwd` tensors (never used in backward).
std::vector<Driver::Step> FwdBwd(const Rig& rig, const std::vector<int>& skip_bwd) {
  std::vector<Driver::Step> steps;
  for (const auto& layer : rig.layers) {
    steps.push_back({layer, Phase::kForward, true});
    steps.push_back({layer, Phase::kForward, false});
  }
  for (auto it = rig.layers.rbegin(); it != rig.layers.rend(); ++it) {
    std::vector<int> b;
    for (int t : *it) {
      if (std::find(skip_bwd.begin(), skip_bwd.end(), t) == skip_bwd.end()) b.push_back(t);
    }
    if (b.empty()) continue;
    steps.push_back({b, Phase::kBackward, true});
    steps.push_back({b, Phase::kBackward, false});
  }
  return steps;
}

TEST(ChunkManagerTest, TensorsWithoutBackwardUseGetZeroGradientsUnderEveryPolicy) {
  // Chunks holding a tensor with no backward use are reduced only when backward ends; the plan
  // must keep them (their other tensors' in-place gradients live in the slot) until then.
  for (CachePolicy p : {CachePolicy::kPlan, CachePolicy::kOnDemand, CachePolicy::kLru}) {
    RigOptions ro;
    ro.policy = p;
    auto rig = MakeRig(ro);
    Driver driver(*rig);
    const auto steps = FwdBwd(*rig, {1, 13, 22});
    for (int it = 0; it < 4; ++it) {
      driver.Script(steps);
      if (HasFatalFailure()) return;
    }
    EXPECT_EQ(rig->manager->counters().deviations, 0u) << CachePolicyName(p);
  }
}

TEST(ChunkManagerTest, SharedWeightIsNotOverwrittenByItsFirstGradient) {
  // Tensor 0 is used at the start and the end of forward (a tied embedding), so it has two
  // backward uses; the second must still see the weight, not the first use's gradient.
  auto rig = MakeRig({});
  Driver driver(*rig);
  std::vector<Driver::Step> steps;
  for (const auto& layer : rig->layers) {
    steps.push_back({layer, Phase::kForward, true});
    steps.push_back({layer, Phase::kForward, false});
  }
  steps.push_back({{0}, Phase::kForward, true});
  steps.push_back({{0}, Phase::kForward, false});
  steps.push_back({{0}, Phase::kBackward, true});
  steps.push_back({{0}, Phase::kBackward, false});
  for (auto it = rig->layers.rbegin(); it != rig->layers.rend(); ++it) {
    steps.push_back({*it, Phase::kBackward, true});
    steps.push_back({*it, Phase::kBackward, false});
  }
  for (int it = 0; it < 3; ++it) {
    driver.Script(steps);
    if (HasFatalFailure()) return;
  }
}

TEST(ChunkManagerTest, OuterScopesKeepTheirChunksThroughInnerMoments) {
  // Layer 0 stays acquired while layers 1..9 come and go (a tight budget forces evictions);
  // its parameters are re-read after every step.
  RigOptions ro;
  ro.budget_chunks = 7;
  auto rig = MakeRig(ro);
  Driver driver(*rig);
  std::vector<Driver::Step> steps = {{rig->layers[0], Phase::kForward, true}};
  for (size_t l = 1; l < rig->layers.size(); ++l) {
    steps.push_back({rig->layers[l], Phase::kForward, true});
    steps.push_back({rig->layers[l], Phase::kForward, false});
  }
  steps.push_back({rig->layers[0], Phase::kForward, false});
  for (int it = 0; it < 3; ++it) {
    driver.Script(steps, rig->layers[0]);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(rig->manager->counters().deviations, 0u);
}

TEST(ChunkManagerTest, FailedGatherLeavesStateAsBeforeAndRetrySucceeds) {
  RigOptions ro;
  ro.faults = true;
  auto rig = MakeRig(ro);
  auto* faults = static_cast<FaultInjectionDevice*>(rig->device.get());
  Driver driver(*rig);
  driver.Iterate(AllLayers());  // warm-up and plan
  ASSERT_FALSE(HasFatalFailure());
  ChunkManager& m = *rig->manager;
  ASSERT_TRUE(m.BeginIteration().ok());
  // Every host-to-device copy fails until the first Acquire that needs one reports it (failed
  // prefetches before that are dropped, and their chunks gathered on demand).
  faults->Inject({.op = DeviceOp::kCopyH2D, .count = 1 << 20, .code = StatusCode::kInternal});
  bool failed_once = false;
  for (const auto& layer : rig->layers) {
    const int fwd_before = m.states().forward_uses(layer[0]);
    const TensorState state_before = m.states().state(layer[0]);
    Status st = m.Acquire(layer, Phase::kForward);
    if (!st.ok()) {
      ASSERT_FALSE(failed_once);
      failed_once = true;
      EXPECT_EQ(st.code(), StatusCode::kInternal) << st.ToString();
      EXPECT_NE(st.message().find("gathering chunk"), std::string::npos) << st.message();
      EXPECT_EQ(m.states().forward_uses(layer[0]), fwd_before) << "use counts restored";
      EXPECT_EQ(m.states().state(layer[0]), state_before) << "state restored";
      faults->Clear();
      st = m.Acquire(layer, Phase::kForward);  // the same acquire works now
    }
    ASSERT_TRUE(st.ok()) << st.ToString();
    for (int t : layer) driver.CheckParams(t, Phase::kForward);
    ASSERT_TRUE(m.Release(layer, Phase::kForward).ok());
  }
  EXPECT_TRUE(failed_once) << "injected " << faults->injected();
  ASSERT_TRUE(m.EndIteration().ok());
  driver.Iterate(AllLayers());
}

TEST(ChunkManagerTest, MisuseIsReportedAndStateKept) {
  auto rig = MakeRig({});
  ChunkManager& m = *rig->manager;
  ASSERT_TRUE(m.BeginIteration().ok());
  const std::vector<int> t0 = {0};
  EXPECT_EQ(m.Release(t0, Phase::kForward).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.Acquire(t0, Phase::kBackward).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(m.Acquire(t0, Phase::kForward).ok());
  ASSERT_TRUE(m.Release(t0, Phase::kForward).ok());
  ASSERT_TRUE(m.EndIteration().ok());
}

}  // namespace
}  // namespace tierzero

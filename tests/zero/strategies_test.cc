// Each gather and reduce strategy on its own (zero/gather.h, zero/reduce.h), through a counting
// device, under mpirun: one rank tests LocalGather and LocalReduce, two ranks HostGather,
// HostReduce, DeviceGather and DeviceReduce. A gathered chunk must be every rank's shard in rank
// order (each rank's shard contents are a formula of chunk, rank and element, so every rank
// knows what the others hold), a reduced gradient shard the mean over the ranks, and each path
// must queue the copies it is meant to: the whole chunk over the host link on the host path,
// only the local shard on the device path.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <tbb/global_control.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/check.h"
#include "core/convert.h"
#include "offload/device_wrapper.h"
#include "offload/host_sim_device.h"
#include "zero/gather.h"
#include "zero/reduce.h"

namespace tierzero {
namespace {

std::shared_ptr<Communicator> World() {
  static std::shared_ptr<Communicator> comm = [] {
    auto c = Communicator::Mpi();
    return c.ok() ? *c : Communicator::Single();
  }();
  return comm;
}

// Counts the copies each kind of transfer queues.
class CountingDevice final : public DeviceWrapper {
 public:
  using DeviceWrapper::DeviceWrapper;
  int h2d = 0, d2h = 0, d2d = 0;
  uint64_t h2d_bytes = 0;
  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle s) override {
    h2d += kind == CopyKind::kHostToDevice;
    d2h += kind == CopyKind::kDeviceToHost;
    d2d += kind == CopyKind::kDeviceToDevice;
    if (kind == CopyKind::kHostToDevice) h2d_bytes += bytes;
    return DeviceWrapper::CopyAsync(dst, src, bytes, kind, s);
  }
};

constexpr uint64_t kShardElems = 3000;  // not a multiple of anything in particular

// Element i of rank r's shard of chunk c.
float ParamValue(int c, int r, uint64_t i) { return static_cast<float>(c * 1000 + r * 100) + i; }
// Element i of rank r's gradient chunk c (small integers: the mean is exact).
float GradValue(int c, int r, uint64_t i) { return static_cast<float>((i + c) % 7 + 2 * r); }

struct Rig {
  explicit Rig(std::vector<Tier> tiers, bool accumulate = false) {
    HostSimOptions ho;
    ho.capacity_bytes = 64 << 20;
    sim = std::move(CreateHostSimDevice(ho)).value();
    device = std::make_unique<CountingDevice>(sim.get());
    comm = World();
    dir = std::filesystem::temp_directory_path() / ("tz_strategies_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    NvmeStoreOptions no;
    no.paths = {dir.string()};
    no.bytes_per_path = 64 << 20;
    nvme = std::move(NvmeStore::Open(no)).value();
    ShardStoreOptions so;
    so.geometry = {static_cast<int>(tiers.size()), comm->size(), comm->rank(), kShardElems,
                   DType::kF32};
    so.param_tier = std::move(tiers);
    so.fp32_grads = accumulate;
    so.host_param_tail_bytes = kGatherTagBytes;
    store = std::move(ShardStore::Create(*device, nvme.get(), so)).value();
    compute = std::move(Stream::Create(*device, "compute")).value();
    ranks = std::make_unique<RankAgreement>(comm->size() > 1 ? comm.get() : nullptr);
    ctx = std::make_unique<TransferContext>(*device, compute.handle(), *store, *ranks);
    TZ_CHECK_OK(ctx->Init());
    ctx->moment = 1;
    AlignedBuffer shard = AlignedBuffer::Allocate(kShardElems * 4);
    for (int c = 0; c < store->num_chunks(); ++c) {
      auto* f = static_cast<float*>(shard.data());
      for (uint64_t i = 0; i < kShardElems; ++i) f[i] = ParamValue(c, comm->rank(), i);
      TZ_CHECK_OK(store->WriteParam(c, shard.data()));
    }
  }
  ~Rig() {
    (void)device->Synchronize();
    ctx.reset();
    store.reset();
    nvme.reset();
    std::filesystem::remove_all(dir);
  }

  // Gathers every chunk and checks it against every rank's shard.
  void GatherAndCheck(GatherStrategy& g) {
    const uint64_t chunk_elems = kShardElems * static_cast<uint64_t>(comm->size());
    auto dst = std::move(DeviceBuffer::Allocate(*device, chunk_elems * 4)).value();
    auto ready = std::move(Event::Create(*device)).value();
    std::vector<float> got(chunk_elems);
    for (int c = 0; c < store->num_chunks(); ++c) {
      ASSERT_TRUE(g.Enqueue(c, dst.data(), ready).ok());
      ASSERT_TRUE(ready.Synchronize().ok());
      ASSERT_TRUE(device->Synchronize().ok());
      std::memcpy(got.data(), dst.data(), chunk_elems * 4);  // HostSim memory is host memory
      for (int r = 0; r < comm->size(); ++r) {
        for (uint64_t i = 0; i < kShardElems; i += 97) {
          ASSERT_EQ(got[r * kShardElems + i], ParamValue(c, r, i))
              << "chunk " << c << " rank " << r;
        }
      }
    }
  }

  // Reduces a gradient chunk `times` times and checks the shard: the mean over ranks, times
  // `times` with accumulation.
  void ReduceAndCheck(ReduceStrategy& red, int times) {
    const uint64_t chunk_elems = kShardElems * static_cast<uint64_t>(comm->size());
    const int c = 1;
    for (int k = 0; k < times; ++k) {
      auto grad = std::move(DeviceBuffer::Allocate(*device, chunk_elems * 4)).value();
      auto* g = static_cast<float*>(grad.data());
      for (uint64_t i = 0; i < chunk_elems; ++i) g[i] = GradValue(c, comm->rank(), i);
      auto written = std::move(Event::Create(*device)).value();
      ASSERT_TRUE(device->RecordEvent(written.handle(), compute.handle()).ok());
      ASSERT_TRUE(device->StreamWaitEvent(ctx->d2h.handle(), written.handle()).ok());
      ASSERT_TRUE(red.Reduce(c, grad.data(), written).ok());
      ASSERT_TRUE(red.Finish(/*wait_all=*/true, false).ok());
      ASSERT_TRUE(device->Synchronize().ok());
    }
    const auto* shard = static_cast<const float*>(store->grad(c));
    const uint64_t base = kShardElems * static_cast<uint64_t>(comm->rank());
    for (uint64_t i = 0; i < kShardElems; ++i) {
      double mean = 0;
      for (int r = 0; r < comm->size(); ++r) mean += GradValue(c, r, base + i);
      mean /= comm->size();
      ASSERT_EQ(shard[i], static_cast<float>(mean * times)) << "element " << i;
    }
  }

  std::unique_ptr<Device> sim;
  std::unique_ptr<CountingDevice> device;
  std::shared_ptr<Communicator> comm;
  std::filesystem::path dir;
  std::unique_ptr<NvmeStore> nvme;
  std::unique_ptr<ShardStore> store;
  Stream compute;
  std::unique_ptr<RankAgreement> ranks;
  std::unique_ptr<TransferContext> ctx;
};

const uint64_t kShardBytes = kShardElems * 4;

TEST(LocalGather, EveryTierArrivesWithOneCopyEach) {
  if (World()->size() != 1) GTEST_SKIP() << "one rank";
  Rig rig({Tier::kHost, Tier::kNvme, Tier::kDevice});
  auto g = std::move(CreateLocalGather(*rig.ctx, {})).value();
  EXPECT_GT(g->staging_slots(), 0) << "an NVMe shard needs staging";
  rig.device->h2d = rig.device->d2d = 0;
  rig.device->h2d_bytes = 0;
  rig.GatherAndCheck(*g);
  EXPECT_EQ(rig.device->h2d, 2) << "host and NVMe shards: one H2D copy each";
  EXPECT_EQ(rig.device->d2d, 1) << "the device shard: one D2D copy";
  EXPECT_EQ(rig.ctx->counters.h2d_bytes, 2 * kShardBytes);
  EXPECT_EQ(rig.ctx->counters.nvme_read_bytes, kShardBytes);
}

TEST(LocalReduce, CopiesTheChunkAndAccumulatesInFp32) {
  if (World()->size() != 1) GTEST_SKIP() << "one rank";
  for (bool accumulate : {false, true}) {
    Rig rig({Tier::kHost, Tier::kHost}, accumulate);
    auto red = std::move(CreateLocalReduce(*rig.ctx, {accumulate})).value();
    rig.device->d2h = 0;
    rig.ReduceAndCheck(*red, accumulate ? 3 : 1);
    EXPECT_EQ(rig.device->d2h, accumulate ? 3 : 1);
  }
}

TEST(HostGather, TheWholeChunkCrossesTheHostLink) {
  const int w = World()->size();
  if (w < 2) GTEST_SKIP() << "several ranks";
  Rig rig({Tier::kHost, Tier::kNvme, Tier::kHost});
  auto g = std::move(CreateHostGather(*rig.ctx, *rig.comm, {})).value();
  EXPECT_TRUE(g->StagesEveryChunk());
  rig.device->h2d = 0;
  rig.GatherAndCheck(*g);
  EXPECT_EQ(rig.device->h2d, 3 * w) << "one H2D copy per rank's shard";
  EXPECT_EQ(rig.ctx->counters.h2d_bytes, 3 * w * kShardBytes);
  EXPECT_EQ(rig.ctx->counters.all_gathers, 3u);
}

TEST(HostReduce, TheMeanLandsInTheLocalShard) {
  if (World()->size() < 2) GTEST_SKIP() << "several ranks";
  for (bool accumulate : {false, true}) {
    Rig rig({Tier::kHost, Tier::kHost}, accumulate);
    auto red = std::move(CreateHostReduce(*rig.ctx, *rig.comm, {accumulate})).value();
    rig.ReduceAndCheck(*red, accumulate ? 2 : 1);
    EXPECT_EQ(rig.ctx->counters.reduce_scatters, accumulate ? 2u : 1u);
  }
}

// Device collectives on the simulated device need MPI's comm thread (TZ_MPI_COMM_THREAD=0 turns
// it off, and the engine then takes the host path).
bool DevicePathRuns() { return World()->size() > 1 && World()->asynchronous(); }

TEST(DeviceGather, OnlyTheLocalShardCrossesTheHostLink) {
  if (!DevicePathRuns()) GTEST_SKIP() << "several ranks and an asynchronous communicator";
  Rig rig({Tier::kHost, Tier::kNvme, Tier::kDevice});
  auto dc = CreateDeviceCollectives(*rig.device, rig.comm);
  ASSERT_TRUE(dc.ok()) << dc.status().ToString();
  {
    auto g = std::move(CreateDeviceGather(*rig.ctx, **dc, {})).value();
    EXPECT_TRUE(g->ReadyOffH2D());
    rig.device->h2d = rig.device->d2d = 0;
    rig.GatherAndCheck(*g);
    EXPECT_EQ(rig.device->h2d, 2) << "host and NVMe shards: one H2D copy of the local shard";
    EXPECT_EQ(rig.device->d2d, 1);
    EXPECT_EQ(rig.ctx->counters.h2d_bytes, 2 * kShardBytes);
    EXPECT_EQ(rig.ctx->counters.all_gathers, 3u);
  }
  ASSERT_TRUE((*dc)->Drain().ok());
}

TEST(DeviceReduce, ReduceScattersInPlaceAndCopiesBackTheShard) {
  if (!DevicePathRuns()) GTEST_SKIP() << "several ranks and an asynchronous communicator";
  for (bool accumulate : {false, true}) {
    Rig rig({Tier::kHost, Tier::kHost}, accumulate);
    auto dc = CreateDeviceCollectives(*rig.device, rig.comm);
    ASSERT_TRUE(dc.ok()) << dc.status().ToString();
    {
      auto red = std::move(CreateDeviceReduce(*rig.ctx, **dc, {accumulate})).value();
      rig.device->d2h = 0;
      rig.ReduceAndCheck(*red, accumulate ? 2 : 1);
      EXPECT_EQ(rig.device->d2h, accumulate ? 2 : 1) << "only the local shard comes back";
      EXPECT_EQ(rig.ctx->counters.d2h_bytes, (accumulate ? 2 : 1) * kShardBytes);
    }
    ASSERT_TRUE((*dc)->Drain().ok());
  }
}

// Gradient accumulation's fp32 add (Note [Accumulating on the host's cores]): every element
// equals its scalar sum (fp32 of the widened value, as one thread adds it) for each gradient
// dtype, across the spans the threads take and a partial last one, on 1 thread and on all.
TEST(AddToF32Parallel, EqualsTheScalarSumOnAnyNumberOfThreads) {
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (uint64_t n : {uint64_t{1000}, uint64_t{262144}, uint64_t{262144 * 3 + 4097}}) {
      std::vector<float> vals(n), base(n);
      for (uint64_t i = 0; i < n; ++i) {
        vals[i] = static_cast<float>((i * 2654435761u) % 20011) / 997.0f - 10.0f;
        base[i] = static_cast<float>(i % 97) * 0.125f - 6.0f;
      }
      std::vector<uint8_t> src(n * 4);
      ASSERT_TRUE(Convert(vals.data(), DType::kF32, src.data(), dt, n).ok());
      std::vector<float> widened(n);
      ASSERT_TRUE(Convert(src.data(), dt, widened.data(), DType::kF32, n).ok());
      std::vector<float> want(base);
      for (uint64_t i = 0; i < n; ++i) want[i] += widened[i];
      std::vector<float> all(base);
      ASSERT_TRUE(AddToF32Parallel(all.data(), src.data(), dt, n).ok());
      std::vector<float> one(base);
      {
        tbb::global_control single(tbb::global_control::max_allowed_parallelism, 1);
        ASSERT_TRUE(AddToF32Parallel(one.data(), src.data(), dt, n).ok());
      }
      ASSERT_EQ(0, std::memcmp(all.data(), want.data(), n * 4)) << DTypeName(dt) << " n " << n;
      ASSERT_EQ(0, std::memcmp(one.data(), want.data(), n * 4)) << DTypeName(dt) << " n " << n;
    }
  }
}

}  // namespace
}  // namespace tierzero

#include "chunk/placement.h"

#include <gtest/gtest.h>

#include "core/bytes.h"

namespace tierzero {
namespace {

ChunkLayout TenChunks() {
  std::vector<TensorDesc> t;
  for (int i = 0; i < 10; ++i) t.push_back({"w" + std::to_string(i), 1 << 20});
  LayoutOptions o;
  o.chunk_elems = 1 << 20;  // 2 MiB bf16 shards; optimizer 12 MiB, grads 2 MiB per chunk
  return std::move(ChunkLayout::Build(t, o)).value();
}

TEST(PlacementTest, EverythingOnHostWhenItFits) {
  ChunkLayout l = TenChunks();
  auto p = PlaceShards(l, {0, 160 * kMiB, 0});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (const auto& c : p->chunks) {
    EXPECT_EQ(c.param, Tier::kHost);
    EXPECT_EQ(c.optimizer, Tier::kHost);
  }
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kHost)], 160 * kMiB);
}

TEST(PlacementTest, OptimizerStatesGoToNvmeBeforeParameters) {
  ChunkLayout l = TenChunks();
  // Host budget for 40 MiB: grads (20) + params (20), with all optimizer states (120) on NVMe.
  auto p = PlaceShards(l, {0, 40 * kMiB, 1 * kGiB});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (const auto& c : p->chunks) {
    EXPECT_EQ(c.optimizer, Tier::kNvme);
    EXPECT_EQ(c.param, Tier::kHost);
    EXPECT_EQ(c.grad, Tier::kHost);
  }
  // 30 MiB: one more param shard than... 5 param shards must go too (grads 20 + 5 params 10).
  p = PlaceShards(l, {0, 30 * kMiB, 1 * kGiB});
  ASSERT_TRUE(p.ok());
  int nvme_params = 0;
  for (int c = 0; c < 10; ++c) nvme_params += p->chunks[c].param == Tier::kNvme;
  EXPECT_EQ(nvme_params, 5);
  EXPECT_EQ(p->chunks[9].param, Tier::kNvme) << "spilled from the last chunk backwards";
  EXPECT_EQ(p->chunks[0].param, Tier::kHost);
  // Half the optimizer states spill when host holds 100 MiB.
  p = PlaceShards(l, {0, 100 * kMiB, 1 * kGiB});
  ASSERT_TRUE(p.ok());
  int nvme_optim = 0;
  for (const auto& c : p->chunks) nvme_optim += c.optimizer == Tier::kNvme;
  EXPECT_EQ(nvme_optim, 5);
  EXPECT_LE(p->bytes[static_cast<int>(Tier::kHost)], 100 * kMiB);
  EXPECT_NE(p->Summary({0, 100 * kMiB, 1 * kGiB}).find("nvme: 0 param shards, 5 optimizer"),
            std::string::npos)
      << p->Summary({0, 100 * kMiB, 1 * kGiB});
}

TEST(PlacementTest, DeviceShardBudgetTakesParametersFirst) {
  ChunkLayout l = TenChunks();
  auto p = PlaceShards(l, {6 * kMiB, 160 * kMiB, 0});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->chunks[0].param, Tier::kDevice);
  EXPECT_EQ(p->chunks[2].param, Tier::kDevice);
  EXPECT_EQ(p->chunks[3].param, Tier::kHost);
}

// Note [Gradient shards on the device]: with device_grads, a chunk whose parameters and states
// are both on the device keeps its gradient there while the shard budget lasts, from the last
// chunk backwards; host memory then counts only the others.
TEST(PlacementTest, GradientShardsJoinTheDeviceUpdatedChunks) {
  ChunkLayout l = TenChunks();
  // Parameters 20 MiB, three chunks' states 36 MiB, then room for two of their 2 MiB gradients.
  TierBudgets b{60 * kMiB, 160 * kMiB, 0, 3, true};
  auto p = PlaceShards(l, b);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(p->chunks[c].optimizer, c >= 7 ? Tier::kDevice : Tier::kHost) << c;
    EXPECT_EQ(p->chunks[c].grad, c >= 8 ? Tier::kDevice : Tier::kHost) << c;
  }
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kDevice)], 60 * kMiB);
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kHost)], (8 * 2 + 7 * 12) * kMiB);
  b.device_grads = false;
  p = PlaceShards(l, b);
  ASSERT_TRUE(p.ok());
  for (const auto& c : p->chunks) EXPECT_EQ(c.grad, Tier::kHost);
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kHost)], (10 * 2 + 7 * 12) * kMiB);
}

// Note [Accumulating on the device for host updates]: with accumulation the fp32 accumulation
// shards take the device shard budget right after the parameters, ahead of the optimizer states,
// from the last chunk backwards; the states take what is left, on chunks whose shards are there.
TEST(PlacementTest, AccumulationShardsTakeTheDeviceBeforeTheStates) {
  ChunkLayout l = TenChunks();
  // Parameters 20 MiB, then ten 4 MiB fp32 shards (40 MiB), then room for one chunk's 12 MiB of
  // states in 80 MiB: chunk 9's. (States first, as before session 37, would have put three
  // chunks' states there and left four shards in host memory.)
  TierBudgets b{80 * kMiB, 200 * kMiB, 0, 3, true, true};
  auto p = PlaceShards(l, b, 0, 4 * kMiB);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(p->chunks[c].param, Tier::kDevice) << c;
    EXPECT_EQ(p->chunks[c].grad, Tier::kDevice) << c;
    EXPECT_EQ(p->chunks[c].optimizer, c == 9 ? Tier::kDevice : Tier::kHost) << c;
  }
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kDevice)], 72 * kMiB);
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kHost)], 9 * 12 * kMiB);
  // Room for only some shards: from the last chunk backwards, and then no states at all.
  b.device_shard_bytes = 40 * kMiB;
  p = PlaceShards(l, b, 0, 4 * kMiB);
  ASSERT_TRUE(p.ok());
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(p->chunks[c].grad, c >= 5 ? Tier::kDevice : Tier::kHost) << c;
    EXPECT_EQ(p->chunks[c].optimizer, Tier::kHost) << c;
  }
  // No device optimizer groups at all: the shards still go where there is room.
  b.device_shard_bytes = 80 * kMiB;
  b.device_optimizer_groups = 0;
  p = PlaceShards(l, b, 0, 4 * kMiB);
  ASSERT_TRUE(p.ok());
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(p->chunks[c].grad, Tier::kDevice) << c;
    EXPECT_EQ(p->chunks[c].optimizer, Tier::kHost) << c;
  }
  // Without accumulation the states come first and only the device's groups keep their shards
  // (Note [Gradient shards on the device]).
  b.device_optimizer_groups = 3;
  b.device_grads_accumulating = false;
  p = PlaceShards(l, b, 0, 4 * kMiB);
  ASSERT_TRUE(p.ok());
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(p->chunks[c].optimizer, c >= 7 ? Tier::kDevice : Tier::kHost) << c;
    EXPECT_EQ(p->chunks[c].grad, c >= 7 ? Tier::kDevice : Tier::kHost) << c;
  }
}

TEST(PlacementTest, ImpossibleBudgetIsOutOfMemoryNamingTheBudgets) {
  ChunkLayout l = TenChunks();
  auto p = PlaceShards(l, {0, 30 * kMiB, 50 * kMiB});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(p.status().message().find("160 MiB"), std::string::npos) << p.status().message();
  EXPECT_NE(p.status().message().find("NVMe budget 50 MiB"), std::string::npos);
  p = PlaceShards(l, {0, 10 * kMiB, 10 * kGiB});
  ASSERT_FALSE(p.ok()) << "gradients (20 MiB) must stay in host memory";
}

// The advice's budgets against a scan of every whole MiB: each is the least that fits with the
// other budget as the advice pairs it, and the config's host budget counts the fixed buffers.
TEST(PlacementTest, FitAdviceNamesTheLeastBudgetsThatFitInWholeMiB) {
  ChunkLayout l = TenChunks();
  const uint64_t fixed = 7 * kMiB + 123;  // not a whole MiB: the advice rounds up
  auto fits = [&](uint64_t host_budget, uint64_t nvme) {
    return host_budget > fixed && PlaceShards(l, {0, host_budget - fixed, nvme}).ok();
  };
  auto least_host = [&](uint64_t nvme) {
    for (uint64_t h = kMiB;; h += kMiB) {
      if (fits(h, nvme)) return std::to_string(h / kMiB) + "MiB";
    }
  };
  auto least_nvme = [&](uint64_t host_budget) {
    for (uint64_t v = 0;; v += kMiB) {
      if (fits(host_budget, v)) return std::to_string(v / kMiB) + "MiB";
    }
  };
  // Both budgets short of the 160 MiB; either alone can make up the rest.
  std::string a = PlacementFitAdvice(l, {0, 30 * kMiB, 50 * kMiB}, fixed);
  EXPECT_EQ(a, "its shards and states fit with host_budget (--host-budget) " +
                   least_host(50 * kMiB) + " at this NVMe budget, or nvme_budget (--nvme-budget) " +
                   least_nvme(30 * kMiB + fixed) + " at this host budget");
  // The gradients (20 MiB) must stay in host memory: no NVMe budget alone fits, and the least
  // host memory with NVMe holding the rest is said beside the host budget alone.
  a = PlacementFitAdvice(l, {0, 10 * kMiB, 50 * kMiB}, fixed);
  const std::string h = least_host(160 * kMiB);
  uint64_t h_bytes = std::stoull(h) * kMiB;
  EXPECT_EQ(a, "its shards and states fit with host_budget (--host-budget) " +
                   least_host(50 * kMiB) + " at this NVMe budget, or host_budget (--host-budget) " +
                   h + " with nvme_budget (--nvme-budget) " + least_nvme(h_bytes));
  EXPECT_TRUE(fits(h_bytes, std::stoull(least_nvme(h_bytes)) * kMiB));
}

// States on NVMe take whole blocks of the store's alignment: a placement counting their bytes
// alone said fits where the store could not allocate them.
TEST(PlacementTest, NvmeCountsWholeBlocksOfTheStoresAlignment) {
  ChunkLayout l = TenChunks();
  const uint64_t group = 12 * kMiB + 100;  // an int8 group's odd size
  TierBudgets b{0, 40 * kMiB, 0};
  b.nvme_alignment = 4096;
  // Host memory for shards: 40 MiB holds the 20 MiB of gradients and 10 MiB of the parameter
  // shards; every group's states go to NVMe, each in 12 MiB + 4 KiB.
  b.nvme_bytes = 10 * (12 * kMiB + 4096);
  auto p = PlaceShards(l, b, group);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kNvme)], 10 * (12 * kMiB + 4096));
  b.nvme_bytes -= 1;
  EXPECT_FALSE(PlaceShards(l, b, group).ok());
}

}  // namespace
}  // namespace tierzero

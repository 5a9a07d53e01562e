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

// Note [Accumulating on the device for host updates]: with accumulation the chunks updated from
// host memory keep their fp32 accumulation shards on the device too, after the device's own
// groups, from the last chunk backwards while the device shard budget lasts.
TEST(PlacementTest, AccumulationShardsOfHostUpdatedChunksJoinTheDeviceWhereThereIsRoom) {
  ChunkLayout l = TenChunks();
  // Parameters 20 MiB, three chunks' states 36 MiB, then 4 MiB gradient shards (fp32): room for
  // six of them in 80 MiB: chunks 9, 8, 7 (the device's groups), then 6, 5 and 4.
  TierBudgets b{80 * kMiB, 200 * kMiB, 0, 3, true, true};
  auto p = PlaceShards(l, b, 0, 4 * kMiB);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (int c = 0; c < 10; ++c) {
    EXPECT_EQ(p->chunks[c].optimizer, c >= 7 ? Tier::kDevice : Tier::kHost) << c;
    EXPECT_EQ(p->chunks[c].grad, c >= 4 ? Tier::kDevice : Tier::kHost) << c;
  }
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kDevice)], 80 * kMiB);
  EXPECT_EQ(p->bytes[static_cast<int>(Tier::kHost)], (4 * 4 + 7 * 12) * kMiB);
  // No device optimizer groups at all: the accumulation shards still go where there is room.
  b.device_optimizer_groups = 0;
  p = PlaceShards(l, b, 0, 4 * kMiB);
  ASSERT_TRUE(p.ok());
  for (int c = 0; c < 10; ++c) EXPECT_EQ(p->chunks[c].grad, Tier::kDevice) << c;
  // Without accumulation only the device's groups keep theirs.
  b.device_optimizer_groups = 3;
  b.device_grads_accumulating = false;
  p = PlaceShards(l, b, 0, 4 * kMiB);
  ASSERT_TRUE(p.ok());
  for (int c = 0; c < 10; ++c) EXPECT_EQ(p->chunks[c].grad, c >= 7 ? Tier::kDevice : Tier::kHost);
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

}  // namespace
}  // namespace tierzero

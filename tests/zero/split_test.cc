// Communicator::Split under mpirun (1 to 4 ranks), with nodes emulated by ranks_per_node: which
// ranks each sub-communicator holds (an all_gather of world ranks), its topology, the cross-node
// byte counters, and (run with TZ_EMULATE_CROSS_NODE_GBPS set) the emulated slow link holding
// cross-node collectives for their bytes' time and nothing else.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <vector>

#include "tierzero/communicator.h"

namespace tierzero {
namespace {

std::shared_ptr<Communicator> World(int ranks_per_node) {
  auto c = Communicator::Mpi(ranks_per_node);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : Communicator::Single();
}

std::vector<int> GatherRanks(Communicator& sub, int world_rank) {
  std::vector<int> out(static_cast<size_t>(sub.size()));
  auto req = sub.AllGather(&world_rank, out.data(), 1, DType::kF32);  // 4 bytes each
  EXPECT_TRUE(req.ok() && (*req)->Wait().ok());
  return out;
}

TEST(Split, ByNodeAndByLocalRank) {
  for (int per_node : {1, 2, 3}) {
    SCOPED_TRACE("ranks_per_node " + std::to_string(per_node));
    auto world = World(per_node);
    const Topology t = world->topology();
    const int w = t.size;
    auto node = world->Split(SplitBy::kNode);
    auto cross = world->Split(SplitBy::kLocalRank);
    ASSERT_TRUE(node.ok() && cross.ok());
    // Inside the node: its ranks in local-rank order.
    std::vector<int> want;
    for (int r = t.node * per_node; r < std::min(w, (t.node + 1) * per_node); ++r)
      want.push_back(r);
    EXPECT_EQ(GatherRanks(**node, t.rank), want);
    const Topology nt = (*node)->topology();
    EXPECT_EQ(nt.rank, t.local_rank);
    EXPECT_EQ(nt.size, t.local_size);
    EXPECT_EQ(nt.local_size, nt.size);
    EXPECT_EQ(nt.nodes, 1);
    // Across nodes: the ranks with this local rank, one per node, in node order.
    want.clear();
    for (int r = t.local_rank; r < w; r += per_node) want.push_back(r);
    EXPECT_EQ(GatherRanks(**cross, t.rank), want);
    const Topology ct = (*cross)->topology();
    EXPECT_EQ(ct.rank, t.node);
    EXPECT_EQ(ct.nodes, ct.size);
    EXPECT_EQ(ct.node, ct.rank);
    EXPECT_EQ(ct.local_size, 1);
  }
}

TEST(Split, CrossNodeBytes) {
  auto world = World(2);
  const Topology t = world->topology();
  auto node = world->Split(SplitBy::kNode);
  auto cross = world->Split(SplitBy::kLocalRank);
  ASSERT_TRUE(node.ok() && cross.ok());
  for (Communicator* c : {world.get(), node->get(), cross->get()}) {
    std::vector<float> send(1000, 1.0f), recv(1000 * static_cast<size_t>(c->size()));
    const CommStats before = c->stats();
    auto req = c->AllGather(send.data(), recv.data(), 1000, DType::kF32);
    ASSERT_TRUE(req.ok() && (*req)->Wait().ok());
    const CommStats after = c->stats();
    const uint64_t sent = after.bytes_sent - before.bytes_sent;
    const uint64_t crossed = after.bytes_cross_node - before.bytes_cross_node;
    EXPECT_EQ(sent, 4000u * static_cast<uint64_t>(c->size() - 1));
    if (c == world.get()) {
      // Each of the ranks on other nodes gets this rank's block.
      EXPECT_EQ(crossed, 4000u * static_cast<uint64_t>(t.size - t.local_size));
    } else if (c == node->get()) {
      EXPECT_EQ(crossed, 0u);
    } else {
      EXPECT_EQ(crossed, sent);
    }
  }
}

// Note [An emulated slow link] (src/comm/mpi.cc).
TEST(Split, EmulatedLinkHoldsCrossNodeCollectivesOnly) {
  const char* gbps_text = std::getenv("TZ_EMULATE_CROSS_NODE_GBPS");
  if (gbps_text == nullptr) GTEST_SKIP() << "TZ_EMULATE_CROSS_NODE_GBPS is not set";
  const double gbps = std::atof(gbps_text);
  auto world = World(1);                 // every rank a node of its own
  auto one_node = World(world->size());  // the same ranks, all on one node
  if (world->size() < 2) GTEST_SKIP() << "one rank: nothing crosses a node";
  const size_t n = 1 << 20;  // 4 MiB per rank
  std::vector<float> send(n, 1.0f), recv(n * static_cast<size_t>(world->size()));
  double held = 0, free = 0;
  // (A lambda with ASSERT returns void; time through out-parameters instead.)
  auto time_into = [&](Communicator& c, double* out) {
    ASSERT_TRUE(c.Barrier().ok());
    const auto t0 = std::chrono::steady_clock::now();
    auto req = c.AllGather(send.data(), recv.data(), n, DType::kF32);
    ASSERT_TRUE(req.ok() && (*req)->Wait().ok());
    *out = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  time_into(*world, &held);
  time_into(*one_node, &free);
  const double bytes = 4.0 * n * (world->size() - 1);
  const double floor_s = bytes / (gbps * 1e9);
  EXPECT_GE(held, floor_s) << "the cross-node all_gather finished before its bytes could cross";
  EXPECT_LT(free, floor_s / 2) << "the same all_gather inside one node was held";
}

}  // namespace
}  // namespace tierzero

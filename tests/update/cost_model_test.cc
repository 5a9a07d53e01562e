// The update phase's cost model (src/update/cost_model.h) against assignments and finish times
// worked out by hand in the comments: all on the CPU when the device link is slow, all on the
// device when the states live there, a split otherwise, the NVMe pipeline, a device that shares
// the CPU's cores, a fixed fraction, and too little device memory.
#include "update/cost_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace tierzero {
namespace {

using W = UpdateWhere;

// 100 elements: 1200 bytes of states, a 200-byte bf16 gradient and output.
UpdateGroup HostGroup() {
  UpdateGroup g;
  g.elems = 100;
  g.grad_bytes = 200;
  g.out_bytes = 200;
  return g;
}

UpdateRates Rates(double link_bytes_per_s) {
  UpdateRates r;
  r.cpu_params_per_s = 100;      // 1 s per group
  r.device_params_per_s = 1000;  // 0.1 s per group
  r.h2d_bytes_per_s = link_bytes_per_s;
  r.d2h_bytes_per_s = link_bytes_per_s;
  r.nvme_read_bytes_per_s = 1200;   // 1 s per group's states
  r.nvme_write_bytes_per_s = 1200;  // 1 s
  return r;
}

UpdateBudget Auto() {
  UpdateBudget b;
  b.device_bytes = 10000;  // 6 slots of 1600 bytes: capped at 3
  return b;
}

TEST(UpdateAssignment, AllOnTheCpuWhenTheLinkIsSlow) {
  // Streaming one group moves 1400 bytes each way at 100 B/s: 14 + 0.1 + 14 s on the device,
  // against 1 s of CPU Adam. Four groups on the CPU: 4 s.
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateAssignment p = AssignUpdates(g, Rates(100), Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kCpu));
  EXPECT_DOUBLE_EQ(p.phase_s, 4.0);
  EXPECT_DOUBLE_EQ(p.cpu_s, 4.0);
  EXPECT_DOUBLE_EQ(p.device_s, 0.0);
}

TEST(UpdateAssignment, AllOnTheDeviceWhenTheStatesLiveThere) {
  // Resident groups with their parameters on the device: upload 200 B at 10000 B/s (0.02 s), Adam
  // 0.1 s, nothing comes down. Adam is the bottleneck once the first upload is in: 0.02 + 4 x 0.1.
  // (The fourth upload waits for slot 0, free when group 0's Adam ends at 0.12.)
  std::vector<UpdateGroup> g(4, HostGroup());
  for (auto& x : g) {
    x.states_on_device = true;
    x.out_bytes = 0;
  }
  UpdateAssignment p = AssignUpdates(g, Rates(10000), Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kDeviceResident));
  EXPECT_EQ(p.slots, 3);
  EXPECT_EQ(p.slot_bytes, 200u);
  EXPECT_NEAR(p.phase_s, 0.42, 1e-12);
  EXPECT_NEAR(p.group_end_s[0], 0.12, 1e-12);
  EXPECT_NEAR(p.group_end_s[3], 0.42, 1e-12);
}

TEST(UpdateAssignment, ASplitOtherwise) {
  // A link of 1400 B/s: a streamed group takes 1 s up, 0.1 s of Adam, 1 s down.
  //   none streamed: CPU 4 s.
  //   one: CPU 3 s; device 1 + 0.1 + 1 = 2.1 s; phase 3 s.
  //   two: CPU 2 s; device: the second upload [1, 2], Adam [2, 2.1], its download waits for the
  //        first's [1.1, 2.1] and ends at 3.1; phase 3.1 s.
  // One streamed group, the first of the evenly spaced candidates.
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateAssignment p = AssignUpdates(g, Rates(1400), Auto());
  EXPECT_EQ(p.where, (std::vector<W>{W::kDeviceStreamed, W::kCpu, W::kCpu, W::kCpu}));
  EXPECT_NEAR(p.phase_s, 3.0, 1e-12);
  EXPECT_NEAR(p.device_s, 2.1, 1e-12);
  EXPECT_NEAR(p.group_end_s[0], 2.1, 1e-12);
  EXPECT_NEAR(p.group_end_s[3], 3.0, 1e-12);
  EXPECT_EQ(p.slot_bytes, 1600u);
  // Two streamed groups predict 3.1 s, as worked out above.
  UpdateAssignment two =
      Simulate(g, {W::kDeviceStreamed, W::kCpu, W::kDeviceStreamed, W::kCpu}, Rates(1400), 3);
  EXPECT_NEAR(two.phase_s, 3.1, 1e-12);
}

TEST(UpdateAssignment, BothDirectionsAtOnceShareTheDuplexRate) {
  // A link of 2800 B/s each way alone: a streamed group takes 0.5 s up, 0.1 s, 0.5 s down.
  //   two streamed: CPU 2 s; device: uploads [0, 0.5] and [0.5, 1], downloads [0.6, 1.1] and
  //   [1.1, 1.6]; phase 2 s (three: CPU 1 s, the third download ends at 2.1 s).
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateAssignment alone = AssignUpdates(g, Rates(2800), Auto());
  EXPECT_EQ(alone.where,
            (std::vector<W>{W::kDeviceStreamed, W::kCpu, W::kDeviceStreamed, W::kCpu}));
  EXPECT_NEAR(alone.phase_s, 2.0, 1e-12);
  // Both directions at once share 2800 B/s, each at 1400 once two groups stream: two then take
  // ASplitOtherwise's 3.1 s; one alone overlaps nothing (1.1 s on the device, CPU 3 s).
  UpdateRates r = Rates(2800);
  r.pcie_duplex_bytes_per_s = 2800;
  UpdateAssignment shared = AssignUpdates(g, r, Auto());
  EXPECT_EQ(shared.where, (std::vector<W>{W::kDeviceStreamed, W::kCpu, W::kCpu, W::kCpu}));
  EXPECT_NEAR(shared.phase_s, 3.0, 1e-12);
  EXPECT_NEAR(shared.device_s, 1.1, 1e-12);
  UpdateAssignment two =
      Simulate(g, {W::kDeviceStreamed, W::kCpu, W::kDeviceStreamed, W::kCpu}, r, 3);
  EXPECT_NEAR(two.phase_s, 3.1, 1e-12);
  // One slot: the next upload waits for the last download, nothing overlaps (2 x 1.1 s).
  EXPECT_NEAR(
      Simulate(g, {W::kDeviceStreamed, W::kCpu, W::kDeviceStreamed, W::kCpu}, r, 1).device_s, 2.2,
      1e-12);
  // A chain that only uploads (resident groups, parameters on the device) keeps the full rate:
  // 200 B up at 2800 B/s, then 0.1 s of Adam each, one after another: 200 / 2800 + 4 x 0.1.
  std::vector<UpdateGroup> res(4, HostGroup());
  for (auto& x : res) {
    x.states_on_device = true;
    x.out_bytes = 0;
  }
  UpdateAssignment up = Simulate(res, std::vector<W>(4, W::kDeviceResident), r, 3);
  EXPECT_NEAR(up.device_s, 200.0 / 2800 + 0.4, 1e-12);
}

TEST(UpdateAssignment, BehindTheNextForwardTheCpuChainIsCreditedTheForward) {
  // ASplitOtherwise's groups and link, the CPU's groups finishing behind a forward of F seconds:
  // the forward ends max(device + F, CPU) after the phase's start; auto minimises that less F.
  //   F = 1: none streamed max(1, 4) - 1 = 3; one max(3.1, 3) - 1 = 2.1; two max(4.1, 2) - 1 =
  //          3.1: one streamed, as inside Step.
  //   F = 2: none max(2, 4) - 2 = 2; one max(4.1, 3) - 2 = 2.1: none streamed.
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateBudget b = Auto();
  b.behind_forward_s = 1;
  UpdateAssignment one = AssignUpdates(g, Rates(1400), b);
  EXPECT_EQ(one.where, (std::vector<W>{W::kDeviceStreamed, W::kCpu, W::kCpu, W::kCpu}));
  EXPECT_NEAR(one.objective_s, 2.1, 1e-12);
  EXPECT_NEAR(one.phase_s, 3.0, 1e-12);
  b.behind_forward_s = 2;
  UpdateAssignment none = AssignUpdates(g, Rates(1400), b);
  EXPECT_EQ(none.where, std::vector<W>(4, W::kCpu));
  EXPECT_NEAR(none.objective_s, 2.0, 1e-12);
  EXPECT_NEAR(none.phase_s, 4.0, 1e-12);
  EXPECT_NE(none.reason.find("behind the next forward"), std::string::npos) << none.reason;
}

TEST(UpdateAssignment, CpuAdamBesideAStreamedChainTakesItsOwnRate) {
  // ASplitOtherwise's link, CPU Adam at half its rate while groups stream (2 s a group):
  //   none streamed: CPU 4 s (the rate alone); one: CPU 3 x 2 = 6 s, device 2.1 s; two: CPU
  //   2 x 2 = 4 s, device 3.1 s; three: CPU 2 s, device: the third download ends at 4.1 s.
  // None streams (ties: fewer).
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateRates r = Rates(1400);
  r.cpu_params_per_s_streaming = 50;
  UpdateAssignment p = AssignUpdates(g, r, Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kCpu));
  EXPECT_NEAR(p.phase_s, 4.0, 1e-12);
  UpdateAssignment one = Simulate(g, {W::kDeviceStreamed, W::kCpu, W::kCpu, W::kCpu}, r, 3);
  EXPECT_NEAR(one.cpu_s, 6.0, 1e-12);
  EXPECT_NEAR(one.phase_s, 6.0, 1e-12);
}

TEST(UpdateAssignment, CopiesBesideCpuAdamSlowByTheMeasuredFactor) {
  // A link of 2800 B/s slowed 2x while CPU Adam runs: with a group on the CPU, ASplitOtherwise's
  // 1400 B/s (one streamed: device 2.1 s, phase 3 s; three: the third download ends at 4.1 s).
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateRates r = Rates(2800);
  r.link_slowdown_beside_cpu = 2;
  UpdateAssignment one = Simulate(g, {W::kDeviceStreamed, W::kCpu, W::kCpu, W::kCpu}, r, 3);
  EXPECT_NEAR(one.device_s, 2.1, 1e-12);
  EXPECT_NEAR(one.phase_s, 3.0, 1e-12);
  // Nothing on the CPU: the link's own rate, 0.5 s a copy. The fourth upload waits for slot 0
  // (free at 1.1), runs [1.5, 2], and its download ends at 2.6: auto streams all four.
  UpdateAssignment p = AssignUpdates(g, r, Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kDeviceStreamed));
  EXPECT_NEAR(p.phase_s, 2.6, 1e-12);
  EXPECT_DOUBLE_EQ(p.cpu_s, 0.0);
}

TEST(UpdateAssignment, GroupsUpdatedAheadCostNothingAndNeverMove) {
  // As ASplitOtherwise, but two groups were updated during backward (the speculative start):
  // the CPU has 2 s left and one streamed group (2.1 s) would end later, so nothing streams;
  // and the groups done ahead stay on the CPU at no cost.
  std::vector<UpdateGroup> g(4, HostGroup());
  g[0].done_ahead = g[1].done_ahead = true;
  UpdateAssignment p = AssignUpdates(g, Rates(1400), Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kCpu));
  EXPECT_NEAR(p.phase_s, 2.0, 1e-12);
  EXPECT_EQ(p.group_end_s[0], 0.0);
  // Every group done ahead: an empty phase, even with every group asked for on the device.
  for (auto& x : g) x.done_ahead = true;
  UpdateBudget all = Auto();
  all.mode = UpdateMode::kFraction;
  all.device_fraction = 1;
  UpdateAssignment q = AssignUpdates(g, Rates(1400), all);
  EXPECT_EQ(q.where, std::vector<W>(4, W::kCpu));
  EXPECT_EQ(q.phase_s, 0.0);
}

TEST(UpdateAssignment, NvmeGroupsThroughTheSwapPipeline) {
  // Two NVMe groups: 1 s read, 1 s Adam, 1 s write each. The disk carries 4 s of I/O and the
  // last Adam follows the last read: max(4 + 1, 1 + 2 + 1) = 5 s. They never stream.
  std::vector<UpdateGroup> g(2, HostGroup());
  for (auto& x : g) x.states_on_nvme = true;
  UpdateAssignment p = AssignUpdates(g, Rates(1e9), Auto());
  EXPECT_EQ(p.where, std::vector<W>(2, W::kCpu));
  EXPECT_NEAR(p.phase_s, 5.0, 1e-12);
}

TEST(UpdateAssignment, NvmeReadsAheadAndWritesBehindLeaveThePhase) {
  // Three NVMe groups as above. The first read before the phase (prefetched during backward)
  // and the last two writes after it: the disk carries 2 reads + 1 write = 3 s inside the phase,
  // so max(3 + 1 (the last Adam), 0 + 3 (Adam) + 0) = 4 s instead of max(6 + 1, 1 + 3 + 1) = 7 s.
  std::vector<UpdateGroup> g(3, HostGroup());
  for (auto& x : g) x.states_on_nvme = true;
  EXPECT_NEAR(AssignUpdates(g, Rates(1e9), Auto()).phase_s, 7.0, 1e-12);
  g[0].read_ahead = true;
  g[1].write_behind = g[2].write_behind = true;
  UpdateAssignment p = AssignUpdates(g, Rates(1e9), Auto());
  EXPECT_NEAR(p.phase_s, 4.0, 1e-12);
  // A backward of 0.5 s reads half of the first group ahead: 0.5 + 2 s of reads and 1 s of
  // writes in the phase, max(3.5 + 1, 0.5 + 3 + 0) = 4.5 s; none of it with no time at all:
  // max(4 + 1, 1 + 3 + 0) = 5 s.
  UpdateRates short_backward = Rates(1e9);
  short_backward.nvme_read_ahead_window_s = 0.5;
  EXPECT_NEAR(AssignUpdates(g, short_backward, Auto()).phase_s, 4.5, 1e-12);
  short_backward.nvme_read_ahead_window_s = 0;
  EXPECT_NEAR(AssignUpdates(g, short_backward, Auto()).phase_s, 5.0, 1e-12);
  // Everything read ahead and written behind: Adam alone, 3 s.
  for (auto& x : g) x.read_ahead = x.write_behind = true;
  EXPECT_NEAR(AssignUpdates(g, Rates(1e9), Auto()).phase_s, 3.0, 1e-12);
}

TEST(UpdateAssignment, TheAccumulationClearLengthensTheCpuChain) {
  // Four host groups whose 400-byte fp32 accumulation shards the chain clears at 800 B/s: 0.5 s
  // each after its 1 s of Adam, 6 s in all; the group ends at 1.5, 3, 4.5, 6. Without the rate
  // the clear is not counted (4 s). Two NVMe groups: each Adam 1 + 0.5 s, the disk's 4 s of I/O,
  // max(4 + 1.5, 1 + 3 + 1) = 5.5 s.
  std::vector<UpdateGroup> g(4, HostGroup());
  for (auto& x : g) x.clear_bytes = 400;
  UpdateRates r = Rates(100);
  EXPECT_DOUBLE_EQ(AssignUpdates(g, r, Auto()).cpu_s, 4.0);
  r.host_clear_bytes_per_s = 800;
  UpdateAssignment p = AssignUpdates(g, r, Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kCpu));
  EXPECT_DOUBLE_EQ(p.cpu_s, 6.0);
  EXPECT_EQ(p.group_end_s, (std::vector<double>{1.5, 3.0, 4.5, 6.0}));
  std::vector<UpdateGroup> nvme(2, HostGroup());
  for (auto& x : nvme) x.states_on_nvme = true, x.clear_bytes = 400;
  UpdateRates rn = Rates(1e9);
  rn.host_clear_bytes_per_s = 800;
  EXPECT_NEAR(AssignUpdates(nvme, rn, Auto()).phase_s, 5.5, 1e-12);
  // MakeUpdateGroups leaves clear_bytes to the caller: 0.
  const std::vector<UpdateGroup> made =
      MakeUpdateGroups({UpdateGroupTiers{}}, 100, 400, 200, 0, false, {});
  EXPECT_EQ(made[0].clear_bytes, 0u);
}

TEST(UpdateAssignment, ADeviceOnTheCpuCoresAddsItsTimeToTheCpus) {
  // As ASplitOtherwise, but the device computes on the CPU's cores: one streamed group costs
  // 3 + 2.1 = 5.1 s > 4 s, so nothing streams.
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateRates r = Rates(1400);
  r.device_shares_cpu = true;
  UpdateAssignment p = AssignUpdates(g, r, Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kCpu));
  EXPECT_NEAR(p.phase_s, 4.0, 1e-12);
  // Nor when its measured rate says it is faster than CPU Adam on every core (a probe that
  // shared the cores: Note [Auto streams nothing to a device on the CPU's cores]); a fraction
  // asked for still streams.
  UpdateRates fast = Rates(1400);
  fast.device_shares_cpu = true;
  fast.device_params_per_s = 100 * fast.cpu_params_per_s;
  p = AssignUpdates(g, fast, Auto());
  EXPECT_EQ(p.where, std::vector<W>(4, W::kCpu));
  EXPECT_NE(p.reason.find("CPU cores"), std::string::npos) << p.reason;
  UpdateBudget half = Auto();
  half.mode = UpdateMode::kFraction;
  half.device_fraction = 0.5;
  p = AssignUpdates(g, fast, half);
  EXPECT_EQ(std::count(p.where.begin(), p.where.end(), W::kDeviceStreamed), 2);
}

TEST(UpdateAssignment, AFixedFractionIsEvenlySpaced) {
  // Half of four groups: candidates 0 and 2 stream (3.1 s, worked out in ASplitOtherwise).
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateBudget b = Auto();
  b.mode = UpdateMode::kFraction;
  b.device_fraction = 0.5;
  UpdateAssignment p = AssignUpdates(g, Rates(1400), b);
  EXPECT_EQ(p.where, (std::vector<W>{W::kDeviceStreamed, W::kCpu, W::kDeviceStreamed, W::kCpu}));
  EXPECT_NEAR(p.phase_s, 3.1, 1e-12);
  b.mode = UpdateMode::kCpu;
  EXPECT_EQ(AssignUpdates(g, Rates(1400), b).where, std::vector<W>(4, W::kCpu));
}

TEST(UpdateAssignment, TooLittleDeviceMemoryStreamsNothing) {
  // 1000 bytes hold no 1600-byte slot: nothing streams, even when asked for.
  const std::vector<UpdateGroup> g(4, HostGroup());
  UpdateBudget b;
  b.device_bytes = 1000;
  b.mode = UpdateMode::kFraction;
  b.device_fraction = 1;
  UpdateAssignment p = AssignUpdates(g, Rates(1400), b);
  EXPECT_EQ(p.where, std::vector<W>(4, W::kCpu));
  EXPECT_NE(p.reason.find("no device memory"), std::string::npos) << p.reason;
  // Resident groups without room for a gradient buffer go through the CPU: 1 s of Adam plus
  // their states down and up at 1200 B/s (1 + 1 s) = 3 s each.
  std::vector<UpdateGroup> r(1, HostGroup());
  r[0].states_on_device = true;
  b.device_bytes = 100;
  p = AssignUpdates(r, Rates(1200), b);
  EXPECT_EQ(p.where, std::vector<W>(1, W::kCpu));
  EXPECT_NEAR(p.phase_s, 3.0, 1e-12);
}

// Note [A CPU group's device gradient fetched ahead]: CPU groups whose gradient shard is on the
// device. A 200-byte gradient at 400 B/s is 0.5 s of copy to 1 s of Adam.
//   one at a time: 4 x (0.5 + 1) = 6 s.
//   fetched ahead: group 0's copy [0, 0.5], its Adam [0.5, 1.5]; group 1's copy issued at 0.5 (when
//   group 0 starts), [0.5, 1], its Adam [1.5, 2.5]; and so on: 0.5 + 4 x 1 = 4.5 s.
//   With a 2 s copy (100 B/s) the link paces the chain: copies [0, 2], [2, 4], [4, 6], [6, 8]
//   (each issued before the one before it ends), Adams start at 2, 4, 6, 8: 9 s.
TEST(UpdateAssignment, ACpuGroupsDeviceGradientComesOverDuringTheAdamBefore) {
  std::vector<UpdateGroup> g(4, HostGroup());
  for (auto& x : g) x.grad_on_device = true;
  const std::vector<W> cpu(4, W::kCpu);
  UpdateRates r = Rates(400);
  r.cpu_grad_fetch_ahead = false;
  EXPECT_NEAR(Simulate(g, cpu, r, 0).cpu_s, 6.0, 1e-12);
  r.cpu_grad_fetch_ahead = true;
  UpdateAssignment p = Simulate(g, cpu, r, 0);
  EXPECT_NEAR(p.cpu_s, 4.5, 1e-12);
  EXPECT_NEAR(p.group_end_s[0], 1.5, 1e-12);
  EXPECT_NEAR(p.group_end_s[3], 4.5, 1e-12);
  r = Rates(100);
  EXPECT_NEAR(Simulate(g, cpu, r, 0).cpu_s, 9.0, 1e-12);
  // A host gradient between them costs no copy and issues none.
  g[1].grad_on_device = false;
  r = Rates(400);
  // Group 0 [0.5, 1.5]; group 1 [1.5, 2.5]; group 2's copy issued at 0.5, ends 1.0: Adam [2.5,
  // 3.5]; group 3's copy issued at 2.5 (group 2's start): [2.5, 3], Adam [3.5, 4.5].
  EXPECT_NEAR(Simulate(g, cpu, r, 0).cpu_s, 4.5, 1e-12);
}

}  // namespace
}  // namespace tierzero

#include "chunk/tensor_state.h"

#include <gtest/gtest.h>

namespace tierzero {
namespace {

// Two chunks: chunk 0 holds tensors 0 and 1, chunk 1 holds tensor 2.
ChunkLayout TwoChunks() {
  LayoutOptions o;
  o.chunk_elems = 4096;
  return std::move(ChunkLayout::Build({{"a", 2000}, {"b", 2000}, {"c", 3000}}, o)).value();
}

TEST(StateTrackerTest, ForwardBackwardLifecycleReportsChunksOnce) {
  ChunkLayout layout = TwoChunks();
  std::vector<int> ready;
  StateTracker s(layout, [&](int c) { ready.push_back(c); });
  EXPECT_EQ(s.state(0), TensorState::kFree);
  EXPECT_EQ(s.Acquire(std::vector<int>{0}, Phase::kForward).code(), StatusCode::kFailedPrecondition)
      << "not finalized";
  s.MarkAllocated();
  ASSERT_TRUE(s.BeginIteration().ok());
  const std::vector<int> ab = {0, 1}, c = {2};
  ASSERT_TRUE(s.Acquire(ab, Phase::kForward).ok());
  EXPECT_EQ(s.state(0), TensorState::kCompute);
  EXPECT_FALSE(s.ChunkEvictable(0));
  EXPECT_TRUE(s.ChunkEvictable(1));
  ASSERT_TRUE(s.Release(ab, Phase::kForward).ok());
  EXPECT_EQ(s.state(1), TensorState::kHoldAfterFwd);
  EXPECT_TRUE(s.ChunkEvictable(0));
  ASSERT_TRUE(s.Acquire(c, Phase::kForward).ok());
  ASSERT_TRUE(s.Release(c, Phase::kForward).ok());
  // Backward in reverse order.
  ASSERT_TRUE(s.Acquire(c, Phase::kBackward).ok());
  ASSERT_TRUE(s.Release(c, Phase::kBackward).ok());
  EXPECT_EQ(ready, std::vector<int>{1});
  ASSERT_TRUE(s.Acquire(std::vector<int>{1}, Phase::kBackward).ok());
  ASSERT_TRUE(s.Release(std::vector<int>{1}, Phase::kBackward).ok());
  EXPECT_EQ(ready, std::vector<int>{1}) << "tensor a of chunk 0 is not done yet";
  ASSERT_TRUE(s.Acquire(std::vector<int>{0}, Phase::kBackward).ok());
  ASSERT_TRUE(s.Release(std::vector<int>{0}, Phase::kBackward).ok());
  EXPECT_EQ(ready, (std::vector<int>{1, 0}));
  EXPECT_TRUE(s.ChunkGradsReady(0));
  ASSERT_TRUE(s.FinishBackward().ok());
  EXPECT_EQ(ready.size(), 2u) << "nothing reported twice";
  ASSERT_TRUE(s.BeginIteration().ok());
  EXPECT_EQ(s.state(2), TensorState::kHold);
  EXPECT_FALSE(s.ChunkGradsReady(0));
}

TEST(StateTrackerTest, SharedParameterWaitsForAllBackwardUses) {
  ChunkLayout layout = TwoChunks();
  std::vector<int> ready;
  StateTracker s(layout, [&](int c) { ready.push_back(c); });
  s.MarkAllocated();
  ASSERT_TRUE(s.BeginIteration().ok());
  const std::vector<int> c = {2};
  for (int use = 0; use < 2; ++use) {  // e.g. a tied embedding: input and output
    ASSERT_TRUE(s.Acquire(c, Phase::kForward).ok());
    ASSERT_TRUE(s.Release(c, Phase::kForward).ok());
  }
  EXPECT_EQ(s.forward_uses(2), 2);
  ASSERT_TRUE(s.Acquire(c, Phase::kBackward).ok());
  ASSERT_TRUE(s.Release(c, Phase::kBackward).ok());
  EXPECT_EQ(s.state(2), TensorState::kHoldAfterFwd) << "one backward use still due";
  EXPECT_TRUE(ready.empty());
  ASSERT_TRUE(s.Acquire(c, Phase::kBackward).ok());
  ASSERT_TRUE(s.Release(c, Phase::kBackward).ok());
  EXPECT_EQ(s.state(2), TensorState::kHoldAfterBwd);
  EXPECT_EQ(ready, std::vector<int>{1});
  EXPECT_EQ(s.Acquire(c, Phase::kBackward).code(), StatusCode::kFailedPrecondition)
      << "a third backward use has no forward use to match";
}

TEST(StateTrackerTest, MisuseIsAStatusAndChangesNothing) {
  ChunkLayout layout = TwoChunks();
  StateTracker s(layout, nullptr);
  s.MarkAllocated();
  ASSERT_TRUE(s.BeginIteration().ok());
  const std::vector<int> a = {0}, ab = {0, 1}, bad = {7};
  Status st = s.Release(a, Phase::kForward);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("'a'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("not acquired"), std::string::npos);
  EXPECT_EQ(s.Acquire(a, Phase::kBackward).code(), StatusCode::kFailedPrecondition)
      << "backward before any forward use";
  EXPECT_EQ(s.Acquire(bad, Phase::kForward).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.Acquire(a, Phase::kForward).ok());
  st = s.Acquire(ab, Phase::kBackward);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << "a is in forward COMPUTE";
  EXPECT_EQ(s.state(1), TensorState::kHold) << "the failed call changed nothing";
  EXPECT_EQ(s.Release(a, Phase::kBackward).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.BeginIteration().code(), StatusCode::kFailedPrecondition) << "a scope is live";
  EXPECT_EQ(s.FinishBackward().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.Release(a, Phase::kForward).ok());
  // Nested scopes: the tensor stays in COMPUTE until the last release.
  ASSERT_TRUE(s.Acquire(a, Phase::kRecompute).ok());
  ASSERT_TRUE(s.Acquire(a, Phase::kRecompute).ok());
  ASSERT_TRUE(s.Release(a, Phase::kRecompute).ok());
  EXPECT_EQ(s.state(0), TensorState::kCompute);
  ASSERT_TRUE(s.Release(a, Phase::kRecompute).ok());
  EXPECT_EQ(s.forward_uses(0), 1) << "recompute does not count as a forward use";
}

TEST(StateTrackerTest, FinishBackwardReportsChunksWithUnusedTensors) {
  ChunkLayout layout = TwoChunks();
  std::vector<int> ready;
  StateTracker s(layout, [&](int c) { ready.push_back(c); });
  s.MarkAllocated();
  ASSERT_TRUE(s.BeginIteration().ok());
  const std::vector<int> a = {0};
  ASSERT_TRUE(s.Acquire(a, Phase::kForward).ok());
  ASSERT_TRUE(s.Release(a, Phase::kForward).ok());
  ASSERT_TRUE(s.Acquire(a, Phase::kBackward).ok());
  ASSERT_TRUE(s.Release(a, Phase::kBackward).ok());
  EXPECT_TRUE(ready.empty()) << "b (same chunk) was never used";
  ASSERT_TRUE(s.FinishBackward().ok());
  EXPECT_EQ(ready, (std::vector<int>{0, 1}));
}

}  // namespace
}  // namespace tierzero

#include "offload/slab_allocator.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

namespace tierzero {
namespace {

TEST(SlabAllocatorTest, BestFitAndMerging) {
  SlabAllocator a(1024, 64);
  auto x = a.Allocate(100);  // 128
  auto y = a.Allocate(64);
  auto z = a.Allocate(1);  // 64
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, 128u);
  EXPECT_EQ(*z, 192u);
  EXPECT_EQ(a.stat().current, 256u);
  EXPECT_EQ(a.Free(*y), 64u);
  // A 64-byte request takes the 64-byte hole (best fit), not the large tail.
  auto w = a.Allocate(50);
  ASSERT_TRUE(w);
  EXPECT_EQ(*w, 128u);
  a.Free(*x);
  a.Free(*w);
  a.Free(*z);
  EXPECT_EQ(a.largest_free_block(), 1024u) << "free neighbours must merge";
  EXPECT_FALSE(a.Allocate(2000).has_value());
  EXPECT_EQ(a.stat().num_ooms, 1u);
  EXPECT_FALSE(a.Allocate(UINT64_MAX - 10).has_value()) << "must not wrap around when aligned";
  EXPECT_EQ(a.stat().current, 0u);
}

TEST(SlabAllocatorTest, RandomAllocFreeNeverOverlaps) {
  constexpr uint64_t kCap = 1 << 20;
  SlabAllocator a(kCap, 256);
  std::mt19937 rng(42);
  std::map<uint64_t, uint64_t> live;  // offset -> rounded size
  uint64_t used = 0;
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      uint64_t bytes = 1 + rng() % 20000;
      auto off = a.Allocate(bytes);
      uint64_t rounded = (bytes + 255) / 256 * 256;
      if (!off) {
        EXPECT_LT(a.largest_free_block(), rounded);
        continue;
      }
      EXPECT_EQ(*off % 256, 0u);
      EXPECT_LE(*off + rounded, kCap);
      auto next = live.lower_bound(*off);
      if (next != live.end()) {
        ASSERT_LE(*off + rounded, next->first) << "overlap at step " << step;
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, *off) << "overlap at step " << step;
      }
      live.emplace(*off, rounded);
      used += rounded;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      EXPECT_EQ(a.Free(it->first), it->second);
      used -= it->second;
      live.erase(it);
    }
    ASSERT_EQ(a.stat().current, used);
  }
  for (auto& [off, size] : live) a.Free(off);
  EXPECT_EQ(a.largest_free_block(), kCap);
  EXPECT_EQ(a.stat().allocated, a.stat().freed);
}

TEST(SlabAllocatorDeathTest, DoubleFreeAborts) {
  SlabAllocator a(1024, 64);
  auto x = a.Allocate(64);
  a.Free(*x);
  EXPECT_DEATH(a.Free(*x), "not allocated");
}

}  // namespace
}  // namespace tierzero

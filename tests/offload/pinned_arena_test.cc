#include "offload/pinned_arena.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "core/bytes.h"
#include "offload/device_wrapper.h"
#include "offload/host_sim_device.h"

namespace tierzero {
namespace {

TEST(PinnedArenaTest, SlotsAreAlignedDisjointAndRecycled) {
  auto arena = PinnedArena::Create(nullptr, 5000, 3);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  PinnedArena& a = **arena;
  EXPECT_EQ(a.slot_bytes(), 8192u) << "rounded up to 4 KiB";
  std::vector<PinnedSlot> slots;
  for (int i = 0; i < 3; ++i) {
    auto s = a.TryAcquire();
    ASSERT_TRUE(s.has_value());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(s->data()) % kPinnedAlignment, 0u);
    std::memset(s->data(), i, s->bytes());  // writable, whole slot
    slots.push_back(std::move(*s));
  }
  EXPECT_FALSE(a.TryAcquire().has_value());
  EXPECT_EQ(a.stat().current, 3 * 8192u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(static_cast<uint8_t*>(slots[i].data())[8191], i) << "slots must not overlap";
  }
  auto timed_out = a.Acquire(std::chrono::milliseconds(20));
  EXPECT_EQ(timed_out.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(timed_out.status().message().find("3 slots"), std::string::npos);
  // A slot released on another thread wakes a waiter.
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    slots[1].Release();
  });
  auto woke = a.Acquire(std::chrono::seconds(5));
  releaser.join();
  ASSERT_TRUE(woke.ok());
  EXPECT_EQ(woke->index(), 1u);
  slots.clear();
  woke->Release();
  EXPECT_EQ(a.stat().current, 0u);
}

// Note [An abandoned slot]: a slot a failed transfer may still write into is never handed out
// again, and the arena then goes without aborting (it checked every slot was back) and without
// unmapping: the abandoned slot's memory stays writable after the arena is gone.
TEST(PinnedArenaTest, AnAbandonedSlotIsNeverReusedAndItsMemoryOutlivesTheArena) {
  auto arena = PinnedArena::Create(nullptr, 4096, 2);
  ASSERT_TRUE(arena.ok()) << arena.status().ToString();
  auto kept = (*arena)->TryAcquire();
  auto lost = (*arena)->TryAcquire();
  ASSERT_TRUE(kept.has_value() && lost.has_value());
  auto* late = static_cast<uint8_t*>(lost->data());
  lost->Abandon();
  EXPECT_FALSE(lost->valid());
  EXPECT_EQ((*arena)->stat().current, 4096u) << "an abandoned slot is not counted in use";
  kept->Release();
  auto again = (*arena)->TryAcquire();
  ASSERT_TRUE(again.has_value());
  EXPECT_NE(again->data(), static_cast<void*>(late)) << "the abandoned slot was handed out";
  EXPECT_FALSE((*arena)->TryAcquire().has_value());
  again->Release();
  arena->reset();     // no TZ_CHECK abort
  late[4095] = 0x5a;  // a late write of the abandoned transfer lands in mapped memory
  EXPECT_EQ(late[4095], 0x5a);
}

TEST(PinnedArenaTest, RejectsZeroSizes) {
  EXPECT_EQ(PinnedArena::Create(nullptr, 0, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PinnedArena::Create(nullptr, 4096, 0).status().code(), StatusCode::kInvalidArgument);
}

// Claims pinned-host support so the arena registers its memory through the fault wrapper.
class PinningDevice final : public DeviceWrapper {
 public:
  explicit PinningDevice(Device* target) : DeviceWrapper(target), info_(target->info()) {
    info_.caps.pinned_host = true;
  }
  const DeviceInfo& info() const override { return info_; }
  Status RegisterHostMemory(void* ptr, size_t bytes) override {
    ++registered;
    return Status::OK();
  }
  Status UnregisterHostMemory(void* ptr) override {
    ++unregistered;
    return Status::OK();
  }
  int registered = 0, unregistered = 0;

 private:
  DeviceInfo info_;
};

TEST(PinnedArenaTest, RegistersWithDeviceAndReportsRegistrationFailure) {
  auto sim = CreateHostSimDevice({});
  ASSERT_TRUE(sim.ok());
  PinningDevice pinning(sim->get());
  {
    auto arena = PinnedArena::Create(&pinning, kMiB, 2);
    ASSERT_TRUE(arena.ok());
    EXPECT_TRUE((*arena)->registered());
    EXPECT_EQ(pinning.registered, 1);
  }
  EXPECT_EQ(pinning.unregistered, 1);

  FaultInjectionDevice faulty(&pinning);
  faulty.Inject({.op = DeviceOp::kRegisterHost, .count = 1, .code = StatusCode::kInternal});
  auto failed = PinnedArena::Create(&faulty, kMiB, 2);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kInternal);
  EXPECT_NE(failed.status().message().find("registering the 2 MiB pinned host arena"),
            std::string::npos)
      << failed.status().message();

  // Best effort: the same failure leaves a usable, unregistered arena.
  faulty.Inject({.op = DeviceOp::kRegisterHost, .count = 1, .code = StatusCode::kInternal});
  auto unlocked = PinnedArena::Create(&faulty, kMiB, 2, PinnedArena::Pinning::kBestEffort);
  ASSERT_TRUE(unlocked.ok()) << unlocked.status().ToString();
  EXPECT_FALSE((*unlocked)->registered());
  std::optional<PinnedSlot> slot = (*unlocked)->TryAcquire();
  ASSERT_TRUE(slot.has_value());
  std::memset(slot->data(), 7, kMiB);
  const int before = pinning.unregistered;
  slot.reset();
  unlocked->reset();
  EXPECT_EQ(pinning.unregistered, before);  // nothing to unregister
}

}  // namespace
}  // namespace tierzero

// The compute gate on the simulated device: a closed gate holds the stream (work queued after it
// waits), Close with wait_reached returns only after the stream's earlier work, the events around
// a gate time the span the trainer held it, and a gate's owner going away opens it.
#include "offload/compute_gate.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "offload/host_sim_device.h"

namespace tierzero {
namespace {

std::unique_ptr<Device> Sim() {
  HostSimOptions o;
  o.capacity_bytes = 1 << 20;
  return std::move(CreateHostSimDevice(o)).value();
}

TEST(ComputeGateTest, AClosedGateHoldsTheStreamUntilOpened) {
  auto device = Sim();
  ASSERT_TRUE(device->info().caps.host_compute);
  Stream s = std::move(Stream::Create(*device, "compute")).value();
  std::atomic<bool> before{false}, after{false};
  ASSERT_TRUE(device
                  ->LaunchHostFunc(s.handle(),
                                   [&] {
                                     std::this_thread::sleep_for(std::chrono::milliseconds(20));
                                     before = true;
                                   })
                  .ok());
  ComputeGate gate(*device, s.handle());
  ASSERT_TRUE(gate.Close(/*wait_reached=*/true).ok());
  EXPECT_TRUE(before);  // the stream's earlier work is done once the gate is reached
  Event e0 = std::move(Event::Create(*device)).value();
  Event e1 = std::move(Event::Create(*device)).value();
  ASSERT_TRUE(e0.Record(s).ok());
  ASSERT_TRUE(device->LaunchHostFunc(s.handle(), [&] { after = true; }).ok());
  ASSERT_TRUE(e1.Record(s).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(after);  // held behind the gate
  gate.Open();
  ASSERT_TRUE(s.Synchronize().ok());
  EXPECT_TRUE(after);
  // A second gate held 30 ms: the events around it say so.
  ASSERT_TRUE(e0.Record(s).ok());
  ASSERT_TRUE(gate.Close(/*wait_reached=*/true).ok());
  ASSERT_TRUE(e1.Record(s).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  gate.Open();
  ASSERT_TRUE(s.Synchronize().ok());
  auto dt = device->ElapsedSeconds(e0.handle(), e1.handle());
  ASSERT_TRUE(dt.ok()) << dt.status().ToString();
  EXPECT_GE(*dt, 0.025);
}

TEST(ComputeGateTest, AGateGoingAwayOpensAndOpenWithoutOneIsNothing) {
  auto device = Sim();
  Stream s = std::move(Stream::Create(*device, "compute")).value();
  {
    ComputeGate gate(*device, s.handle());
    gate.Open();  // nothing closed: nothing happens
    ASSERT_TRUE(gate.Close(/*wait_reached=*/false).ok());
  }
  EXPECT_TRUE(s.Synchronize().ok());  // would hang on a gate left closed
}

}  // namespace
}  // namespace tierzero

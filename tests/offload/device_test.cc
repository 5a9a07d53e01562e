// Device contract tests, run against every Device implementation: HostSim always, CUDA when a
// GPU is present (skipped otherwise).
#include "offload/device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/bytes.h"
#include "core/convert.h"
#include "offload/cuda_device.h"
#include "offload/device_wrapper.h"
#include "offload/host_sim_device.h"

namespace tierzero {
namespace {

constexpr uint64_t kCapacity = 64 * kMiB;

enum class Backend { kHostSim, kHostSimPolling, kCuda };

StatusOr<std::unique_ptr<Device>> MakeDevice(Backend backend, uint64_t capacity,
                                             double h2d_bps = 0) {
  if (backend != Backend::kCuda) {
    HostSimOptions o;
    o.capacity_bytes = capacity;
    o.h2d_bytes_per_second = h2d_bps;
    // Streams that poll for each other's events (Note [Stream waits that cost the signaller
    // nothing]) must order exactly as those woken by their signaller.
    if (backend == Backend::kHostSimPolling) o.poll_stream_waits_us = 20;
    return CreateHostSimDevice(o);
  }
  CudaDeviceOptions o;
  o.capacity_bytes = capacity;
  return CreateCudaDevice(o);
}

class DeviceTest : public testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam() == Backend::kCuda && CudaDeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA GPU on this machine";
    }
    auto d = MakeDevice(GetParam(), kCapacity);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    device_ = std::move(d).value();
  }
  std::unique_ptr<Device> device_;
};

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST_P(DeviceTest, ReportsCapacityAndCaps) {
  EXPECT_EQ(device_->info().capacity_bytes, kCapacity);
  EXPECT_TRUE(device_->info().caps.async_copy);
  EXPECT_EQ(device_->memory_stat().current, 0u);
}

TEST_P(DeviceTest, OverCapacityAllocationIsOutOfMemoryAndDeviceStaysUsable) {
  auto a = DeviceBuffer::Allocate(*device_, 40 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = DeviceBuffer::Allocate(*device_, 40 * kMiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("40 MiB"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("capacity 64 MiB"), std::string::npos);
  EXPECT_EQ(device_->memory_stat().current, 40 * kMiB);
  EXPECT_EQ(device_->memory_stat().num_ooms, 1u);
  // Still usable: a fitting allocation works, and after freeing, the large one does too.
  auto c = DeviceBuffer::Allocate(*device_, 20 * kMiB);
  ASSERT_TRUE(c.ok());
  a->Reset();
  auto d = DeviceBuffer::Allocate(*device_, 40 * kMiB);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(device_->memory_stat().peak, 60 * kMiB);
}

TEST_P(DeviceTest, AllocationsAreAlignedAndDisjoint) {
  std::vector<DeviceBuffer> bufs;
  for (size_t bytes : {1, 255, 257, 4096, 100000}) {
    auto b = DeviceBuffer::Allocate(*device_, bytes);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % kDeviceAlignment, 0u);
    bufs.push_back(std::move(b).value());
  }
  for (size_t i = 0; i < bufs.size(); ++i) {
    for (size_t j = i + 1; j < bufs.size(); ++j) {
      auto* a = static_cast<uint8_t*>(bufs[i].data());
      auto* b = static_cast<uint8_t*>(bufs[j].data());
      EXPECT_TRUE(a + bufs[i].bytes() <= b || b + bufs[j].bytes() <= a);
    }
  }
  EXPECT_EQ(device_->Allocate(0).status().code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, RoundTripThroughDevice) {
  auto s = Stream::Create(*device_, "test");
  ASSERT_TRUE(s.ok());
  constexpr size_t kBytes = 3 * kMiB + 13;
  auto x = DeviceBuffer::Allocate(*device_, kBytes);
  auto y = DeviceBuffer::Allocate(*device_, kBytes);
  ASSERT_TRUE(x.ok() && y.ok());
  std::vector<uint8_t> in = RandomBytes(kBytes, 1), out(kBytes, 0);
  ASSERT_TRUE(
      device_->CopyAsync(x->data(), in.data(), kBytes, CopyKind::kHostToDevice, s->handle()).ok());
  ASSERT_TRUE(
      device_->CopyAsync(y->data(), x->data(), kBytes, CopyKind::kDeviceToDevice, s->handle())
          .ok());
  ASSERT_TRUE(
      device_->CopyAsync(out.data(), y->data(), kBytes, CopyKind::kDeviceToHost, s->handle()).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(in, out);
}

TEST_P(DeviceTest, CopiesOnOneStreamCompleteInOrder) {
  // Many rounds write different data into the same device buffer and read it back; each read
  // must see exactly the write enqueued just before it.
  auto s = Stream::Create(*device_, "ordered");
  ASSERT_TRUE(s.ok());
  constexpr size_t kBytes = 256 * kKiB;
  constexpr int kRounds = 16;
  auto x = DeviceBuffer::Allocate(*device_, kBytes);
  ASSERT_TRUE(x.ok());
  std::vector<std::vector<uint8_t>> in, out(kRounds, std::vector<uint8_t>(kBytes));
  for (int r = 0; r < kRounds; ++r) in.push_back(RandomBytes(kBytes, 100 + r));
  for (int r = 0; r < kRounds; ++r) {
    ASSERT_TRUE(
        device_->CopyAsync(x->data(), in[r].data(), kBytes, CopyKind::kHostToDevice, s->handle())
            .ok());
    ASSERT_TRUE(
        device_->MemsetAsync(static_cast<uint8_t*>(x->data()) + r, 0xAB, 1, s->handle()).ok());
    ASSERT_TRUE(
        device_->CopyAsync(out[r].data(), x->data(), kBytes, CopyKind::kDeviceToHost, s->handle())
            .ok());
  }
  ASSERT_TRUE(s->Synchronize().ok());
  for (int r = 0; r < kRounds; ++r) {
    in[r][r] = 0xAB;
    EXPECT_EQ(in[r], out[r]) << "round " << r;
  }
}

TEST_P(DeviceTest, EventOrdersAnotherStream) {
  auto producer = Stream::Create(*device_, "producer");
  auto consumer = Stream::Create(*device_, "consumer");
  auto ready = Event::Create(*device_);
  ASSERT_TRUE(producer.ok() && consumer.ok() && ready.ok());
  constexpr size_t kBytes = 16 * kMiB;
  auto x = DeviceBuffer::Allocate(*device_, kBytes);
  auto y = DeviceBuffer::Allocate(*device_, kBytes);
  ASSERT_TRUE(x.ok() && y.ok());
  std::vector<uint8_t> in = RandomBytes(kBytes, 5), out(kBytes, 0);
  // Page-locked, as the engine's host buffers are: CUDA copies pageable memory synchronously,
  // waiting for the stream first, and the producer's stream is blocked until this thread
  // releases it below (a deadlock, seen on the first GPU run).
  ASSERT_TRUE(device_->RegisterHostMemory(in.data(), kBytes).ok());
  ASSERT_TRUE(device_->RegisterHostMemory(out.data(), kBytes).ok());
  // The producer's host function blocks until released, so without the event the consumer
  // would certainly read the buffer before the producer's copy lands.
  std::atomic<bool> release{false};
  ASSERT_TRUE(device_
                  ->LaunchHostFunc(producer->handle(),
                                   [&] {
                                     while (!release.load())
                                       std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                   })
                  .ok());
  ASSERT_TRUE(
      device_->CopyAsync(x->data(), in.data(), kBytes, CopyKind::kHostToDevice, producer->handle())
          .ok());
  ASSERT_TRUE(ready->Record(*producer).ok());
  ASSERT_TRUE(device_->StreamWaitEvent(consumer->handle(), ready->handle()).ok());
  ASSERT_TRUE(
      device_
          ->CopyAsync(y->data(), x->data(), kBytes, CopyKind::kDeviceToDevice, consumer->handle())
          .ok());
  ASSERT_TRUE(
      device_->CopyAsync(out.data(), y->data(), kBytes, CopyKind::kDeviceToHost, consumer->handle())
          .ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto done = device_->EventDone(ready->handle());
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done) << "the producer is still blocked";
  release = true;
  ASSERT_TRUE(consumer->Synchronize().ok());
  EXPECT_EQ(in, out);
  EXPECT_TRUE(*device_->EventDone(ready->handle()));
  EXPECT_TRUE(device_->UnregisterHostMemory(in.data()).ok());
  EXPECT_TRUE(device_->UnregisterHostMemory(out.data()).ok());
}

TEST_P(DeviceTest, UnrecordedEventDoesNotBlock) {
  auto s = Stream::Create(*device_, "s");
  auto e = Event::Create(*device_);
  ASSERT_TRUE(s.ok() && e.ok());
  ASSERT_TRUE(device_->StreamWaitEvent(s->handle(), e->handle()).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_TRUE(*device_->EventDone(e->handle()));
  EXPECT_TRUE(e->Synchronize().ok());
}

TEST_P(DeviceTest, DestroyingAnEventWithPendingWorkIsSafe) {
  // As on CUDA: the destroy is deferred until queued records and waits are done.
  auto a = Stream::Create(*device_, "a");
  auto b = Stream::Create(*device_, "b");
  ASSERT_TRUE(a.ok() && b.ok());
  std::atomic<bool> release{false};
  ASSERT_TRUE(device_
                  ->LaunchHostFunc(a->handle(),
                                   [&] {
                                     while (!release.load())
                                       std::this_thread::sleep_for(std::chrono::milliseconds(1));
                                   })
                  .ok());
  std::atomic<int> after{0};
  for (int i = 0; i < 10; ++i) {
    auto e = Event::Create(*device_);
    ASSERT_TRUE(e.ok());
    ASSERT_TRUE(e->Record(*a).ok());
    ASSERT_TRUE(device_->StreamWaitEvent(b->handle(), e->handle()).ok());
    ASSERT_TRUE(device_->LaunchHostFunc(b->handle(), [&] { ++after; }).ok());
  }  // each event destroyed while its record and wait are still queued
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(after.load(), 0) << "stream b must still wait for stream a";
  release = true;
  ASSERT_TRUE(b->Synchronize().ok());
  EXPECT_EQ(after.load(), 10);
}

TEST_P(DeviceTest, ElapsedTimeBetweenEvents) {
  auto s = Stream::Create(*device_, "s");
  auto a = Event::Create(*device_);
  auto b = Event::Create(*device_);
  ASSERT_TRUE(s.ok() && a.ok() && b.ok());
  EXPECT_EQ(device_->ElapsedSeconds(a->handle(), b->handle()).status().code(),
            StatusCode::kFailedPrecondition);
  ASSERT_TRUE(a->Record(*s).ok());
  ASSERT_TRUE(
      device_
          ->LaunchHostFunc(s->handle(),
                           [] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); })
          .ok());
  ASSERT_TRUE(b->Record(*s).ok());
  ASSERT_TRUE(b->Synchronize().ok());
  auto t = device_->ElapsedSeconds(a->handle(), b->handle());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_GE(*t, 0.025);
  EXPECT_LT(*t, 1.0);
}

TEST_P(DeviceTest, CastMatchesHostConversionBitForBit) {
  auto s = Stream::Create(*device_, "cast");
  ASSERT_TRUE(s.ok());
  constexpr size_t kN = 100003;
  std::vector<float> in(kN);
  std::mt19937 rng(3);
  for (auto& v : in) v = BitsToFloat(static_cast<uint32_t>(rng()));
  auto f32 = DeviceBuffer::Allocate(*device_, kN * 4);
  auto h16 = DeviceBuffer::Allocate(*device_, kN * 2);
  auto back = DeviceBuffer::Allocate(*device_, kN * 4);
  ASSERT_TRUE(f32.ok() && h16.ok() && back.ok());
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> got(kN), want(kN);
    std::vector<float> got_back(kN), want_back(kN);
    ASSERT_TRUE(Convert(in.data(), DType::kF32, want.data(), t, kN).ok());
    ASSERT_TRUE(Convert(want.data(), t, want_back.data(), DType::kF32, kN).ok());
    ASSERT_TRUE(
        device_->CopyAsync(f32->data(), in.data(), kN * 4, CopyKind::kHostToDevice, s->handle())
            .ok());
    ASSERT_TRUE(device_->CastAsync(f32->data(), DType::kF32, h16->data(), t, kN, s->handle()).ok());
    ASSERT_TRUE(
        device_->CastAsync(h16->data(), t, back->data(), DType::kF32, kN, s->handle()).ok());
    ASSERT_TRUE(
        device_->CopyAsync(got.data(), h16->data(), kN * 2, CopyKind::kDeviceToHost, s->handle())
            .ok());
    ASSERT_TRUE(
        device_
            ->CopyAsync(got_back.data(), back->data(), kN * 4, CopyKind::kDeviceToHost, s->handle())
            .ok());
    ASSERT_TRUE(s->Synchronize().ok());
    EXPECT_EQ(got, want) << DTypeName(t);
    EXPECT_EQ(0, std::memcmp(got_back.data(), want_back.data(), kN * 4)) << DTypeName(t);
  }
  EXPECT_EQ(
      device_->CastAsync(f32->data(), DType::kF32, h16->data(), DType::kI8, 4, s->handle()).code(),
      StatusCode::kInvalidArgument);
}

// AccumulateAsync: acc += widen(src), one fp32 add an element, bit for bit the host's (the
// gradient accumulation of shards kept on the device), for each source dtype.
TEST_P(DeviceTest, AccumulateAddsTheWidenedSourceBitForBit) {
  auto s = Stream::Create(*device_, "accumulate");
  ASSERT_TRUE(s.ok());
  constexpr size_t kN = 70001;
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> base(kN), vals(kN);
  for (size_t i = 0; i < kN; ++i) {
    base[i] = d(rng);
    vals[i] = d(rng) * 0.01f;
  }
  auto acc = DeviceBuffer::Allocate(*device_, kN * 4);
  auto src = DeviceBuffer::Allocate(*device_, kN * 4);
  ASSERT_TRUE(acc.ok() && src.ok());
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    std::vector<uint8_t> in(kN * 4);
    ASSERT_TRUE(Convert(vals.data(), DType::kF32, in.data(), t, kN).ok());
    std::vector<float> widened(kN), want(base);
    ASSERT_TRUE(Convert(in.data(), t, widened.data(), DType::kF32, kN).ok());
    for (size_t i = 0; i < kN; ++i) want[i] += widened[i];
    for (size_t i = 0; i < kN; ++i) want[i] += widened[i];  // twice: the sum carries on
    ASSERT_TRUE(
        device_->CopyAsync(acc->data(), base.data(), kN * 4, CopyKind::kHostToDevice, s->handle())
            .ok());
    ASSERT_TRUE(device_
                    ->CopyAsync(src->data(), in.data(), DTypeBytes(t, kN), CopyKind::kHostToDevice,
                                s->handle())
                    .ok());
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(
          device_
              ->AccumulateAsync(static_cast<float*>(acc->data()), src->data(), t, kN, s->handle())
              .ok());
    }
    std::vector<float> got(kN);
    ASSERT_TRUE(
        device_->CopyAsync(got.data(), acc->data(), kN * 4, CopyKind::kDeviceToHost, s->handle())
            .ok());
    ASSERT_TRUE(s->Synchronize().ok());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), kN * 4)) << DTypeName(t);
  }
  EXPECT_EQ(device_
                ->AccumulateAsync(static_cast<float*>(acc->data()), src->data(), DType::kI8, 4,
                                  s->handle())
                .code(),
            StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, NullStreamsEventsAndFunctionsAreRejected) {
  auto s = Stream::Create(*device_, "s");
  auto x = DeviceBuffer::Allocate(*device_, 4096);
  ASSERT_TRUE(s.ok() && x.ok());
  std::vector<uint8_t> host(4096);
  EXPECT_EQ(device_->CopyAsync(x->data(), host.data(), 4096, CopyKind::kHostToDevice, {}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->RecordEvent({}, s->handle()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device_->LaunchHostFunc(s->handle(), nullptr).code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, HostFunctionsRunInStreamOrder) {
  auto s = Stream::Create(*device_, "s");
  ASSERT_TRUE(s.ok());
  std::vector<int> order;
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(device_->LaunchHostFunc(s->handle(), [&order, i] { order.push_back(i); }).ok());
  }
  ASSERT_TRUE(s->Synchronize().ok());
  std::vector<int> want(20);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(order, want);
}

// A host function that throws is the device's error, not the end of the process: on a GPU it runs
// on the CUDA driver's thread, where an escaping exception was std::terminate (review 45).
TEST_P(DeviceTest, AnExceptionInAHostFunctionIsTheDevicesErrorNotTheProcesss) {
  auto s = Stream::Create(*device_, "s");
  ASSERT_TRUE(s.ok());
  std::atomic<bool> later{false};
  ASSERT_TRUE(device_
                  ->LaunchHostFunc(s->handle(),
                                   [] {
                                     throw std::runtime_error(
                                         "pthread_create has failed: Resource temporarily "
                                         "unavailable");
                                   })
                  .ok());
  ASSERT_TRUE(device_->LaunchHostFunc(s->handle(), [&] { later = true; }).ok());
  const Status st = s->Synchronize();
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory) << st.ToString();
  EXPECT_NE(st.message().find("ulimit -u"), std::string::npos) << st.message();
  EXPECT_TRUE(later.load());
  EXPECT_EQ(device_->Synchronize().code(), StatusCode::kOutOfMemory);
}

TEST_P(DeviceTest, FaultInjectionSurfacesAsStatusAndStateSurvives) {
  FaultInjectionDevice faulty(device_.get());
  auto s = Stream::Create(faulty, "s");
  ASSERT_TRUE(s.ok());
  faulty.Inject(
      {.op = DeviceOp::kAllocate, .skip = 1, .count = 1, .code = StatusCode::kOutOfMemory});
  auto first = DeviceBuffer::Allocate(faulty, kMiB);
  ASSERT_TRUE(first.ok());
  auto second = DeviceBuffer::Allocate(faulty, kMiB);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(second.status().message().find("injected fault: allocate 1 MiB"), std::string::npos);
  EXPECT_EQ(faulty.memory_stat().current, kMiB) << "a failed allocation must not leak";

  std::vector<uint8_t> in = RandomBytes(kMiB, 9), out(kMiB, 0), poison(kMiB, 0x5A);
  ASSERT_TRUE(
      faulty.CopyAsync(first->data(), poison.data(), kMiB, CopyKind::kHostToDevice, s->handle())
          .ok());
  faulty.Inject({.op = DeviceOp::kCopyH2D, .count = 1, .code = StatusCode::kInternal});
  Status st =
      faulty.CopyAsync(first->data(), in.data(), kMiB, CopyKind::kHostToDevice, s->handle());
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("H2D"), std::string::npos);
  // The failed copy did nothing: the device still holds the earlier data.
  ASSERT_TRUE(
      faulty.CopyAsync(out.data(), first->data(), kMiB, CopyKind::kDeviceToHost, s->handle()).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(out, poison);

  faulty.Inject({.op = DeviceOp::kSynchronize, .count = 1, .code = StatusCode::kInternal});
  EXPECT_EQ(s->Synchronize().code(), StatusCode::kInternal);
  EXPECT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(faulty.injected(), 3);
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceTest,
                         testing::Values(Backend::kHostSim, Backend::kHostSimPolling,
                                         Backend::kCuda),
                         [](const auto& info) {
                           return info.param == Backend::kHostSim          ? "HostSim"
                                  : info.param == Backend::kHostSimPolling ? "HostSimPolling"
                                                                           : "Cuda";
                         });

// ---- HostSim specifics ----------------------------------------------------------------------

TEST(HostSimDeviceTest, ThrottleGivesConfiguredBandwidth) {
  constexpr double kBandwidth = 400e6;  // 400 MB/s
  constexpr size_t kBytes = 32 * kMiB;  // 84 ms at that rate; memcpy takes a few ms
  auto d = MakeDevice(Backend::kHostSim, 64 * kMiB, kBandwidth);
  ASSERT_TRUE(d.ok());
  Device& dev = **d;
  auto s1 = Stream::Create(dev, "a");
  auto s2 = Stream::Create(dev, "b");
  auto x = DeviceBuffer::Allocate(dev, kBytes);
  ASSERT_TRUE(s1.ok() && s2.ok() && x.ok());
  std::vector<uint8_t> in(kBytes, 1);
  // Warm the pages so the first-touch cost does not count.
  std::memset(x->data(), 0, kBytes);
  std::vector<double> rates;
  for (int rep = 0; rep < 3; ++rep) {
    auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(
        dev.CopyAsync(x->data(), in.data(), kBytes / 2, CopyKind::kHostToDevice, s1->handle())
            .ok());
    ASSERT_TRUE(dev.CopyAsync(static_cast<uint8_t*>(x->data()) + kBytes / 2, in.data(), kBytes / 2,
                              CopyKind::kHostToDevice, s2->handle())
                    .ok());
    ASSERT_TRUE(dev.Synchronize().ok());
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rates.push_back(kBytes / secs);
  }
  std::sort(rates.begin(), rates.end());
  // Two streams share the one H2D link: together they get the configured bandwidth, never more.
  // A loaded machine (a sanitizer's build beside other jobs) may give them less: the best of
  // three is within 10% of it, the slowest only bounded (the median missed by 11% under ASan
  // in CI, session 47).
  EXPECT_LE(rates[2], 1.1 * kBandwidth);
  EXPECT_GE(rates[2], 0.9 * kBandwidth);
  // The other direction is unthrottled.
  std::vector<uint8_t> out(kBytes);
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(
      dev.CopyAsync(out.data(), x->data(), kBytes, CopyKind::kDeviceToHost, s1->handle()).ok());
  ASSERT_TRUE(s1->Synchronize().ok());
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(kBytes / secs, 2 * kBandwidth);
}

TEST(HostSimDeviceTest, RejectsPointersOfTheWrongSide) {
  auto d = MakeDevice(Backend::kHostSim, kMiB);
  ASSERT_TRUE(d.ok());
  auto s = Stream::Create(**d, "s");
  auto x = DeviceBuffer::Allocate(**d, 4096);
  ASSERT_TRUE(s.ok() && x.ok());
  std::vector<uint8_t> host(8192);
  Status st = (*d)->CopyAsync(host.data(), x->data(), 4096, CopyKind::kHostToDevice, s->handle());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not device memory"), std::string::npos) << st.message();
  st = (*d)->CopyAsync(static_cast<uint8_t*>(x->data()) + kMiB - 100, host.data(), 4096,
                       CopyKind::kHostToDevice, s->handle());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << "overruns the end of device memory";
  EXPECT_EQ((*d)->MemsetAsync(host.data(), 0, 16, s->handle()).code(),
            StatusCode::kInvalidArgument);
}

TEST(HostSimDeviceTest, AnExceptionOnAStreamIsItsErrorNotTheProcesss) {
  // Note [An exception on a simulated stream]: work that throws (oneTBB's exception when a
  // worker it wakes cannot start, under `ulimit -u`) would end the process through
  // std::terminate on the stream's thread. It is the stream's error instead: its later work
  // runs, and every synchronisation with it says what happened.
  auto d = MakeDevice(Backend::kHostSim, kMiB);
  ASSERT_TRUE(d.ok());
  auto s = Stream::Create(**d, "s");
  ASSERT_TRUE(s.ok());
  std::atomic<bool> later{false};
  ASSERT_TRUE((*d)->LaunchHostFunc(s->handle(),
                                   [] {
                                     throw std::runtime_error(
                                         "pthread_create has failed: Resource temporarily "
                                         "unavailable");
                                   })
                  .ok());
  ASSERT_TRUE((*d)->LaunchHostFunc(s->handle(), [&] { later = true; }).ok());
  const Status st = s->Synchronize();
  EXPECT_EQ(st.code(), StatusCode::kOutOfMemory) << st.ToString();
  EXPECT_NE(st.message().find("ulimit -u"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("simulated stream s"), std::string::npos) << st.message();
  EXPECT_TRUE(later.load());
  EXPECT_EQ((*d)->Synchronize().code(), StatusCode::kOutOfMemory);
  // An event's synchronisation too, of another stream's event (a device-wide, sticky fault).
  auto other = Stream::Create(**d, "other");
  ASSERT_TRUE(other.ok());
  auto e = Event::Create(**d);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(e->Record(*other).ok());
  EXPECT_EQ(e->Synchronize().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(other->Synchronize().code(), StatusCode::kOutOfMemory);
}

TEST(HostSimDeviceTest, RejectsBadOptions) {
  HostSimOptions o;
  o.capacity_bytes = 0;
  EXPECT_EQ(CreateHostSimDevice(o).status().code(), StatusCode::kInvalidArgument);
  o.capacity_bytes = kMiB;
  o.d2h_bytes_per_second = -1;
  EXPECT_EQ(CreateHostSimDevice(o).status().code(), StatusCode::kInvalidArgument);
  o.d2h_bytes_per_second = 0;
  for (double cap : {-5.0, 1001.0, std::nan("")}) {
    o.poll_stream_waits_us = cap;
    EXPECT_EQ(CreateHostSimDevice(o).status().code(), StatusCode::kInvalidArgument) << cap;
  }
}

TEST(CudaDeviceTest, AbsentGpuIsUnavailableWithAReason) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  auto d = CreateCudaDevice({});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(d.status().message().empty());
}

}  // namespace
}  // namespace tierzero

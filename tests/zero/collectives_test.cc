// Every collective against a serial reference, for several dtypes and odd sizes. The binary runs
// under `mpirun -np 2` and `-np 4` (and alone, as one rank): every rank computes what every other
// rank sends from the same formula, so each can check its result alone. Integer-valued data makes
// the 16-bit sums exact (every partial sum is representable, in any order), so reductions are
// compared bit for bit; random fp32 data is compared within a rounding bound.
//
// The backend is MPI on host buffers, or with TZ_TEST_COMM=nccl the NCCL communicator on device
// buffers of one GPU per rank (bootstrapped over MPI): the data is copied in, the collective runs
// on the comm stream, the result is copied out. Without a GPU per rank the NCCL run skips.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/device_collectives.h"
#include "comm/nccl.h"
#include "comm/quantized.h"
#include "core/convert.h"
#include "kernels/quantize.h"
#include "offload/cuda_device.h"
#include "offload/host_sim_device.h"
#include "tierzero/communicator.h"

namespace tierzero {
namespace {

bool WantNccl() {
  const char* e = std::getenv("TZ_TEST_COMM");
  return e != nullptr && std::string(e) == "nccl";
}

std::shared_ptr<Communicator> Mpi() {
  static std::shared_ptr<Communicator> comm = [] {
    auto c = Communicator::Mpi();
    if (!c.ok()) {
      ADD_FAILURE() << c.status().ToString();
      return Communicator::Single();
    }
    return *c;
  }();
  return comm;
}

// The communicator under test, with the GPU and comm stream of the NCCL backend.
struct Backend {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Communicator> boot;  // MPI (or Single alone): NCCL's bootstrap
  std::unique_ptr<Device> gpu;
  Stream stream;
  std::string skip;  // why this backend cannot run here
};

Backend& TheBackend() {
  static Backend* b = [] {
    auto* out = new Backend();
    if (!WantNccl()) {
      out->comm = Mpi();
      out->boot = out->comm;
      return out;
    }
    // Alone (no launcher), the one-rank bootstrap: no MPI runtime needed on the GPU machine.
    std::shared_ptr<Communicator> boot =
        std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr
            ? Mpi()
            : Communicator::Single();
    out->boot = boot;
    const Topology t = boot->topology();
    if (CudaDeviceCount() < t.local_size) {
      out->skip = "NCCL needs a GPU per rank: " + std::to_string(t.local_size) +
                  " ranks on this node, " + std::to_string(CudaDeviceCount()) + " GPUs";
      return out;
    }
    CudaDeviceOptions o;
    o.ordinal = t.local_rank;
    o.capacity_bytes = 256ull << 20;
    auto dev = CreateCudaDevice(o);
    if (!dev.ok()) {
      ADD_FAILURE() << dev.status().ToString();
      out->skip = "no CUDA device";
      return out;
    }
    out->gpu = std::move(dev).value();
    auto s = Stream::Create(*out->gpu, "comm");
    if (!s.ok()) {
      ADD_FAILURE() << s.status().ToString();
      out->skip = "no stream";
      return out;
    }
    out->stream = std::move(s).value();
    NcclOptions no;
    no.device = out->gpu.get();
    no.stream = out->stream.handle();
    no.bootstrap = boot;
    no.timeout_s = 120;
    auto c = CreateNcclCommunicator(no);
    if (!c.ok()) {
      ADD_FAILURE() << c.status().ToString();
      out->skip = "no NCCL communicator";
      return out;
    }
    out->comm = *c;
    return out;
  }();
  return *b;
}

#define REQUIRE_BACKEND()                                              \
  do {                                                                 \
    if (!TheBackend().skip.empty()) GTEST_SKIP() << TheBackend().skip; \
  } while (0)

Communicator& Comm() { return *TheBackend().comm; }

using Collective = std::function<StatusOr<std::unique_ptr<CommRequest>>(const void*, void*)>;

// Runs `f(send, recv)` on the backend's buffers: the host vectors themselves for MPI; device
// copies of both (recv too, for the in-place collectives) for NCCL, recv copied back after.
// `poll` progresses the request with Test, as a caller overlapping work would.
void RunCollective(const std::vector<uint8_t>& send, std::vector<uint8_t>& recv,
                   const Collective& f, bool poll = false) {
  Backend& b = TheBackend();
  auto finish = [&](std::unique_ptr<CommRequest> req) {
    if (poll) {
      for (;;) {
        auto done = req->Test();
        ASSERT_TRUE(done.ok()) << done.status().ToString();
        if (*done) break;
      }
    }
    Status s = req->Wait();
    ASSERT_TRUE(s.ok()) << s.ToString();
  };
  if (!b.gpu) {
    auto req = f(send.data(), recv.data());
    ASSERT_TRUE(req.ok()) << req.status().ToString();
    finish(std::move(req).value());
    return;
  }
  Device& d = *b.gpu;
  auto ds = DeviceBuffer::Allocate(d, std::max<size_t>(send.size(), 1));
  auto dr = DeviceBuffer::Allocate(d, std::max<size_t>(recv.size(), 1));
  ASSERT_TRUE(ds.ok() && dr.ok());
  const StreamHandle h = b.stream.handle();
  ASSERT_TRUE(d.CopyAsync(ds->data(), send.data(), send.size(), CopyKind::kHostToDevice, h).ok());
  ASSERT_TRUE(d.CopyAsync(dr->data(), recv.data(), recv.size(), CopyKind::kHostToDevice, h).ok());
  auto req = f(ds->data(), dr->data());
  ASSERT_TRUE(req.ok()) << req.status().ToString();
  finish(std::move(req).value());
  ASSERT_TRUE(d.CopyAsync(recv.data(), dr->data(), recv.size(), CopyKind::kDeviceToHost, h).ok());
  ASSERT_TRUE(b.stream.Synchronize().ok());
}

// A small integer in [-8, 8] for (rank, block, index).
int Value(int rank, int block, size_t i) {
  return static_cast<int>(
             (static_cast<size_t>(rank) * 131 + static_cast<size_t>(block) * 71 + i * 17 + 5) %
             17) -
         8;
}

// `n` elements of dtype holding the values f(i).
template <typename F>
std::vector<uint8_t> Fill(DType dt, size_t n, F f) {
  std::vector<uint8_t> out(DTypeBytes(dt, n));
  for (size_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(f(i));
    switch (dt) {
      case DType::kF32:
        std::memcpy(out.data() + 4 * i, &v, 4);
        break;
      case DType::kBF16: {
        const uint16_t h = F32ToBF16Scalar(v);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t h = F32ToF16Scalar(v);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
      case DType::kI8:
        out[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
        break;
      case DType::kI4:
        out[i / 2] |= static_cast<uint8_t>((static_cast<int>(v) & 0xF) << (4 * (i % 2)));
        break;
    }
  }
  return out;
}

// Equal byte vectors, or which elements of dtype differ (the first few, with their bytes).
testing::AssertionResult SameElements(const std::vector<uint8_t>& got,
                                      const std::vector<uint8_t>& want, DType dt) {
  if (got == want) return testing::AssertionSuccess();
  if (got.size() != want.size())
    return testing::AssertionFailure() << got.size() << " bytes, want " << want.size();
  const size_t width = dt == DType::kF32 ? 4 : (dt == DType::kI8 || dt == DType::kI4 ? 1 : 2);
  auto hex = [&](const std::vector<uint8_t>& v, size_t e) {
    std::string s;
    char b[3];
    for (size_t k = width; k-- > 0;) {
      std::snprintf(b, sizeof b, "%02x", v[e * width + k]);
      s += b;
    }
    return s;
  };
  size_t differ = 0;
  auto r = testing::AssertionFailure();
  for (size_t e = 0; e < got.size() / width; ++e) {
    if (std::memcmp(&got[e * width], &want[e * width], width) == 0) continue;
    if (++differ <= 4)
      r << "element " << e << ": 0x" << hex(got, e) << ", want 0x" << hex(want, e) << "; ";
  }
  return r << differ << " of " << got.size() / width << " elements differ";
}

const size_t kCounts[] = {1, 7, 1000, 4099, 70001};
const DType kAll[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI8, DType::kI4};
const DType kFloats[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(Collectives, AllGatherEveryDtypeAndOddSizes) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  const int w = c.size(), me = c.rank();
  for (DType dt : kAll) {
    for (size_t n : kCounts) {
      if (dt == DType::kI4 && n % 2) continue;
      const auto send = Fill(dt, n, [&](size_t i) { return Value(me, 0, i); });
      std::vector<uint8_t> want;
      for (int r = 0; r < w; ++r) {
        const auto part = Fill(dt, n, [&](size_t i) { return Value(r, 0, i); });
        want.insert(want.end(), part.begin(), part.end());
      }
      std::vector<uint8_t> got(want.size(), 0xAB);
      RunCollective(send, got, [&](const void* s, void* r) { return c.AllGather(s, r, n, dt); });
      EXPECT_EQ(got, want) << DTypeName(dt) << " n=" << n;
    }
  }
}

TEST(Collectives, AllToAllAndBroadcast) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  const int w = c.size(), me = c.rank();
  for (DType dt : kAll) {
    for (size_t n : kCounts) {
      if (dt == DType::kI4 && n % 2) continue;
      std::vector<uint8_t> send, want;
      for (int b = 0; b < w; ++b) {
        const auto mine = Fill(dt, n, [&](size_t i) { return Value(me, b, i); });
        send.insert(send.end(), mine.begin(), mine.end());
        const auto theirs = Fill(dt, n, [&](size_t i) { return Value(b, me, i); });
        want.insert(want.end(), theirs.begin(), theirs.end());
      }
      std::vector<uint8_t> got(want.size(), 0xCD);
      RunCollective(send, got, [&](const void* s, void* r) { return c.AllToAll(s, r, n, dt); });
      EXPECT_EQ(got, want) << DTypeName(dt) << " n=" << n;

      const int root = w - 1;
      auto buf = me == root ? Fill(dt, n, [&](size_t i) { return Value(root, 9, i); })
                            : std::vector<uint8_t>(DTypeBytes(dt, n), 0);
      RunCollective(buf, buf, [&](const void*, void* r) { return c.Broadcast(r, n, dt, root); });
      EXPECT_EQ(buf, Fill(dt, n, [&](size_t i) { return Value(root, 9, i); }));
    }
  }
}

TEST(Collectives, ReduceScatterAndAllReduceAreExactOnIntegers) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  const int w = c.size(), me = c.rank();
  for (DType dt : kFloats) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax}) {
      for (size_t n : kCounts) {
        auto reduce = [&](int block, size_t i) {
          double acc = op == ReduceOp::kMax ? -1e9 : 0;
          for (int r = 0; r < w; ++r)
            acc = op == ReduceOp::kMax ? std::max(acc, double(Value(r, block, i)))
                                       : acc + Value(r, block, i);
          return op == ReduceOp::kMean ? acc / w : acc;  // w is 1, 2 or 4: exact
        };
        std::vector<uint8_t> send;
        for (int b = 0; b < w; ++b) {
          const auto part = Fill(dt, n, [&](size_t i) { return Value(me, b, i); });
          send.insert(send.end(), part.begin(), part.end());
        }
        std::vector<uint8_t> got(DTypeBytes(dt, n), 0xEE);
        RunCollective(send, got,
                      [&](const void* s, void* r) { return c.ReduceScatter(s, r, n, dt, op); });
        EXPECT_TRUE(SameElements(got, Fill(dt, n, [&](size_t i) { return reduce(me, i); }), dt))
            << "reduce_scatter " << DTypeName(dt) << " op " << int(op) << " n=" << n;

        // all_reduce of block 0, out of place and in place.
        auto src = Fill(dt, n, [&](size_t i) { return Value(me, 0, i); });
        const auto want = Fill(dt, n, [&](size_t i) { return reduce(0, i); });
        std::vector<uint8_t> out(src.size());
        RunCollective(src, out,
                      [&](const void* s, void* r) { return c.AllReduce(s, r, n, dt, op); });
        EXPECT_TRUE(SameElements(out, want, dt)) << "all_reduce " << DTypeName(dt) << " n=" << n;
        RunCollective(src, src, [&](const void*, void* r) { return c.AllReduce(r, r, n, dt, op); });
        EXPECT_TRUE(SameElements(src, want, dt))
            << "in-place all_reduce " << DTypeName(dt) << " n=" << n;
      }
    }
  }
}

TEST(Collectives, Fp32SumsOfRandomValuesWithinRounding) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  const int w = c.size(), me = c.rank();
  const size_t n = 100003;
  auto values = [&](int r) {
    std::mt19937 g(1234 + r);
    std::normal_distribution<float> d(0, 1);
    std::vector<float> v(n);
    for (float& x : v) x = d(g);
    return v;
  };
  std::vector<double> want(n, 0);
  for (int r = 0; r < w; ++r) {
    const auto v = values(r);
    for (size_t i = 0; i < n; ++i) want[i] += v[i];
  }
  auto mine = values(me);
  std::vector<uint8_t> bytes(n * sizeof(float));
  std::memcpy(bytes.data(), mine.data(), bytes.size());
  RunCollective(
      bytes, bytes,
      [&](const void*, void* r) { return c.AllReduce(r, r, n, DType::kF32, ReduceOp::kSum); },
      /*poll=*/true);
  std::memcpy(mine.data(), bytes.data(), bytes.size());
  for (size_t i = 0; i < n; ++i) {
    // w - 1 additions, each within half an ulp of its result.
    ASSERT_NEAR(mine[i], want[i], 1e-6 * w * (std::fabs(want[i]) + 4)) << i;
  }
}

TEST(Collectives, ByteCountersFollowTheBusBandwidthConvention) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  const int w = c.size();
  const CommStats before = c.stats();
  std::vector<uint8_t> send(4000 * w), recv(4000 * w);
  RunCollective(send, recv,
                [&](const void* s, void* r) { return c.AllGather(s, r, 1000, DType::kF32); });
  RunCollective(send, recv, [&](const void* s, void* r) {
    return c.ReduceScatter(s, r, 1000, DType::kF32, ReduceOp::kSum);
  });
  const CommStats after = c.stats();
  EXPECT_EQ(after.collectives - before.collectives, 2u);
  EXPECT_EQ(after.bytes_sent - before.bytes_sent, 2u * 4000u * static_cast<uint64_t>(w - 1));
}

TEST(Collectives, TopologyFromTheSplitOrTheOverride) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  if (WantNccl()) GTEST_SKIP() << "the topology comes from the MPI bootstrap";
  const Topology t = c.topology();
  EXPECT_EQ(t.rank, c.rank());
  EXPECT_EQ(t.size, c.size());
  // One machine: one node holding every rank.
  EXPECT_EQ(t.nodes, 1);
  EXPECT_EQ(t.local_size, c.size());
  EXPECT_EQ(t.local_rank, c.rank());
  auto emulated = Communicator::Mpi(/*ranks_per_node=*/1);
  ASSERT_TRUE(emulated.ok());
  const Topology e = (*emulated)->topology();
  EXPECT_EQ(e.nodes, c.size());
  EXPECT_EQ(e.node, c.rank());
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_size, 1);
}

// Note [The MPI comm thread]: collectives progress without the caller, and another thread may
// wait for one (as a device stream's host function does for a gather).
TEST(Collectives, RequestsCompleteOnTheCommThread) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  if (TheBackend().gpu) GTEST_SKIP() << "MPI only";
  const char* env = std::getenv("TZ_MPI_COMM_THREAD");
  const bool want = env == nullptr || std::string(env) != "0";
  ASSERT_EQ(c.asynchronous(), want);
  if (!want) GTEST_SKIP() << "TZ_MPI_COMM_THREAD=0";
  const int w = c.size(), me = c.rank();
  const size_t n = 1 << 20;
  const auto send = Fill(DType::kF32, n, [&](size_t i) { return Value(me, 3, i); });
  std::vector<uint8_t> got(send.size() * static_cast<size_t>(w));
  auto req = c.AllGather(send.data(), got.data(), n, DType::kF32);
  ASSERT_TRUE(req.ok()) << req.status().ToString();
  Status waited;
  std::thread other([&] { waited = (*req)->Wait(); });
  other.join();
  ASSERT_TRUE(waited.ok()) << waited.ToString();
  for (int r = 0; r < w; ++r) {
    const auto part = Fill(DType::kF32, n, [&](size_t i) { return Value(r, 3, i); });
    ASSERT_EQ(
        0, std::memcmp(got.data() + part.size() * static_cast<size_t>(r), part.data(), part.size()))
        << "rank " << r;
  }
}

// The chunk manager's device path (comm/device_collectives.h): an in-place all_gather, then an
// in-place mean reduce-scatter, queued on the collectives' stream behind a copy on another stream
// (throttled on the simulated device, so a collective that did not wait for it would see stale
// data), while the trainer's thread runs its own collectives on the communicator in between.
TEST(Collectives, DeviceCollectivesInPlaceOnTheStream) {
  REQUIRE_BACKEND();
  Backend& b = TheBackend();
  std::unique_ptr<Device> sim;
  if (!b.gpu) {
    HostSimOptions o;
    o.capacity_bytes = 64ull << 20;
    o.h2d_bytes_per_second = 5e6;
    sim = *CreateHostSimDevice(o);
  }
  Device& d = b.gpu ? *b.gpu : *sim;
  auto dc = CreateDeviceCollectives(d, b.boot);
  ASSERT_TRUE(dc.ok()) << dc.status().ToString();
  Communicator& host = *b.boot;
  const int w = host.size(), me = host.rank();
  ASSERT_EQ((*dc)->size(), w);
  ASSERT_EQ((*dc)->rank(), me);
  const DType dt = DType::kBF16;
  const size_t n = 4099;
  const size_t block = DTypeBytes(dt, n);
  auto chunk = DeviceBuffer::Allocate(d, block * static_cast<size_t>(w));
  ASSERT_TRUE(chunk.ok());
  auto* base = static_cast<uint8_t*>(chunk->data());
  auto copy = Stream::Create(d, "copy");
  auto copied = Event::Create(d), done = Event::Create(d);
  ASSERT_TRUE(copy.ok() && copied.ok() && done.ok());
  const StreamHandle cs = (*dc)->stream();

  // All-gather: my block copied into place, then gathered in place.
  const auto mine = Fill(dt, n, [&](size_t i) { return Value(me, 0, i); });
  ASSERT_TRUE(d.CopyAsync(base + block * static_cast<size_t>(me), mine.data(), block,
                          CopyKind::kHostToDevice, copy->handle())
                  .ok());
  ASSERT_TRUE(copied->Record(*copy).ok());
  ASSERT_TRUE(d.StreamWaitEvent(cs, copied->handle()).ok());
  ASSERT_TRUE((*dc)->AllGather(base + block * static_cast<size_t>(me), base, n, dt).ok());
  // The trainer's own collective meanwhile, on the communicator the collectives duplicate.
  const int32_t tag = 100 + me;
  std::vector<int32_t> tags(static_cast<size_t>(w));
  ASSERT_TRUE((*host.AllGather(&tag, tags.data(), 1, DType::kF32))->Wait().ok());
  for (int r = 0; r < w; ++r) EXPECT_EQ(tags[static_cast<size_t>(r)], 100 + r);
  std::vector<uint8_t> gathered(block * static_cast<size_t>(w));
  ASSERT_TRUE(d.RecordEvent(done->handle(), cs).ok());
  ASSERT_TRUE(d.StreamWaitEvent(copy->handle(), done->handle()).ok());
  ASSERT_TRUE(
      d.CopyAsync(gathered.data(), base, gathered.size(), CopyKind::kDeviceToHost, copy->handle())
          .ok());
  ASSERT_TRUE(copy->Synchronize().ok());
  for (int r = 0; r < w; ++r) {
    const auto part = Fill(dt, n, [&](size_t i) { return Value(r, 0, i); });
    ASSERT_EQ(0, std::memcmp(gathered.data() + block * static_cast<size_t>(r), part.data(), block))
        << "block " << r;
  }

  // Reduce-scatter (mean) in place: block `me` of every rank's chunk, averaged.
  std::vector<uint8_t> all(block * static_cast<size_t>(w));
  for (int k = 0; k < w; ++k) {
    const auto part = Fill(dt, n, [&](size_t i) { return Value(me, 1 + k, i); });
    std::memcpy(all.data() + block * static_cast<size_t>(k), part.data(), block);
  }
  ASSERT_TRUE(
      d.CopyAsync(base, all.data(), all.size(), CopyKind::kHostToDevice, copy->handle()).ok());
  ASSERT_TRUE(copied->Record(*copy).ok());
  ASSERT_TRUE(d.StreamWaitEvent(cs, copied->handle()).ok());
  uint8_t* out = base + block * static_cast<size_t>(me);
  ASSERT_TRUE((*dc)->ReduceScatter(base, out, n, dt, ReduceOp::kMean).ok());
  ASSERT_TRUE(d.RecordEvent(done->handle(), cs).ok());
  ASSERT_TRUE(d.StreamWaitEvent(copy->handle(), done->handle()).ok());
  std::vector<uint8_t> got(block);
  ASSERT_TRUE(d.CopyAsync(got.data(), out, block, CopyKind::kDeviceToHost, copy->handle()).ok());
  ASSERT_TRUE(copy->Synchronize().ok());
  ASSERT_TRUE((*dc)->Drain().ok()) << (*dc)->Check().ToString();
  // Integers in [-8, 8] over at most 4 ranks: the sum and the mean are exact in bf16.
  const auto want = Fill(dt, n, [&](size_t i) {
    double s = 0;
    for (int r = 0; r < w; ++r) s += Value(r, 1 + me, i);
    return s / w;
  });
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), block));
  EXPECT_EQ((*dc)->stats().collectives, 2u);
}

// ZeRO++'s collectives on the device stream (the simulated device's host functions under MPI;
// NCCL with the CUDA kernels on a GPU) against the host kernels run locally on what every rank
// holds: the node all_gather, qwZ's gather (every rank's dequantize(quantize(shard))), and qgZ's
// two-hop mean, all bit for bit.
void CheckQuantizedDeviceCollectives(Device& d, const std::shared_ptr<Communicator>& boot) {
  DeviceCollectivesOptions options;
  options.node_collectives = true;
  auto dc = CreateDeviceCollectives(d, boot, options);
  ASSERT_TRUE(dc.ok()) << dc.status().ToString();
  const int w = boot->size(), me = boot->rank(), l_size = (*dc)->node_size();
  ASSERT_EQ(w % l_size, 0);
  const int n_size = w / l_size, node = me / l_size;
  const DType dt = DType::kBF16;
  const uint64_t n = 1337;  // a shard: runs of 1, 300 and the rest (blocks never span them)
  const std::vector<uint64_t> runs = {1, 300, n - 301};
  const std::vector<std::vector<uint64_t>> every(static_cast<size_t>(w), runs);
  auto qw = ShardQuantization::Create({8, 64}, every);
  auto qg = ShardQuantization::Create({4, 100}, every);
  ASSERT_TRUE(qw.ok() && qg.ok());
  {
    const Status s = (*dc)->PrepareQuantized(*qw);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  {
    const Status s = (*dc)->PrepareQuantized(*qg);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const size_t block = DTypeBytes(dt, n);
  const size_t chunk_bytes = block * static_cast<size_t>(w);
  auto value = [](int r, int salt, size_t i) {
    return std::sin(0.37 * static_cast<double>(i) + 1.3 * r + salt) * (1 + static_cast<int>(i % 7));
  };
  auto chunk = DeviceBuffer::Allocate(d, chunk_bytes);
  ASSERT_TRUE(chunk.ok());
  auto* base = static_cast<uint8_t*>(chunk->data());
  const StreamHandle cs = (*dc)->stream();
  std::vector<std::vector<uint8_t>> uploaded;  // alive until the copies are done
  uploaded.reserve(3);
  auto upload = [&](std::vector<uint8_t> host, uint8_t* dst) {
    uploaded.push_back(std::move(host));
    const auto& h = uploaded.back();
    ASSERT_TRUE(d.CopyAsync(dst, h.data(), h.size(), CopyKind::kHostToDevice, cs).ok());
  };
  auto download = [&](const uint8_t* src, size_t bytes) {
    std::vector<uint8_t> host(bytes);
    EXPECT_TRUE(d.CopyAsync(host.data(), src, bytes, CopyKind::kDeviceToHost, cs).ok());
    EXPECT_TRUE(d.SynchronizeStream(cs).ok());
    EXPECT_TRUE((*dc)->Drain().ok()) << (*dc)->Check().ToString();
    return host;
  };

  // The node all_gather (hpZ's backward gathers), in place.
  const size_t part = DTypeBytes(dt, 97);
  const int l = me % l_size;
  upload(Fill(dt, 97, [&](size_t i) { return Value(me, 3, i); }), base + part * l);
  ASSERT_TRUE((*dc)->NodeAllGather(base + part * l, base, 97, dt).ok());
  const auto parts = download(base, part * static_cast<size_t>(l_size));
  for (int k = 0; k < l_size; ++k) {
    const auto want = Fill(dt, 97, [&](size_t i) { return Value(node * l_size + k, 3, i); });
    ASSERT_EQ(0, std::memcmp(parts.data() + part * k, want.data(), part)) << "node part " << k;
  }

  // qwZ: every rank's shard quantized and dequantized, gathered in place.
  auto shard_of = [&](int r) { return Fill(dt, n, [&](size_t i) { return value(r, 0, i); }); };
  upload(shard_of(me), base + block * me);
  {
    const Status s = (*dc)->QuantizedAllGather(*qw, base + block * me, base, dt);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const auto gathered = download(base, chunk_bytes);
  for (int r = 0; r < w; ++r) {
    std::vector<uint8_t> packed(qw->layout(r).bytes()), want(block);
    ASSERT_TRUE(kernels::Quantize(qw->layout(r), shard_of(r).data(), dt, packed.data()).ok());
    ASSERT_TRUE(kernels::Dequantize(qw->layout(r), packed.data(), want.data(), dt).ok());
    ASSERT_EQ(0, std::memcmp(gathered.data() + block * r, want.data(), block)) << "shard " << r;
  }

  // qgZ: this rank's shard of the mean, in place. The reference follows Note [Quantized
  // collectives]: node n' sums its ranks' copies of my shard and requantizes (one node: sums
  // straight into fp32), then the nodes' partial sums are added in node order, divided by W.
  auto grads_of = [&](int r) {
    return Fill(dt, n * static_cast<size_t>(w), [&](size_t i) { return value(r, 1, i); });
  };
  upload(grads_of(me), base);
  {
    const Status s = (*dc)->QuantizedReduceScatter(*qg, base, base + block * me, dt);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const auto reduced = download(base + block * me, block);
  const kernels::QuantLayout& mine = qg->layout(me);
  std::vector<std::vector<uint8_t>> partials;
  std::vector<float> mean(n);
  for (int np = 0; np < n_size; ++np) {
    std::vector<std::vector<uint8_t>> copies;
    std::vector<const void*> inputs;
    for (int k = 0; k < l_size; ++k) {
      copies.emplace_back(mine.bytes());
      const auto g = grads_of(np * l_size + k);
      ASSERT_TRUE(kernels::Quantize(mine, g.data() + block * me, dt, copies.back().data()).ok());
    }
    for (const auto& c : copies) inputs.push_back(c.data());
    if (n_size == 1) {
      ASSERT_TRUE(kernels::DequantizeSum(mine, inputs, mean.data()).ok());
    } else {
      partials.emplace_back(mine.bytes());
      ASSERT_TRUE(kernels::DequantizeSumRequantize(mine, inputs, partials.back().data()).ok());
    }
  }
  if (n_size > 1) {
    std::vector<const void*> inputs;
    for (const auto& p : partials) inputs.push_back(p.data());
    ASSERT_TRUE(kernels::DequantizeSum(mine, inputs, mean.data()).ok());
  }
  for (float& v : mean) v /= static_cast<float>(w);
  std::vector<uint8_t> want(block);
  ASSERT_TRUE(Convert(mean.data(), DType::kF32, want.data(), dt, n).ok());
  EXPECT_EQ(0, std::memcmp(reduced.data(), want.data(), block));
  // The mean is near the exact one (Note [Quantized collectives] bounds the error).
  std::vector<float> got(n);
  ASSERT_TRUE(Convert(reduced.data(), dt, got.data(), DType::kF32, n).ok());
  for (size_t i = 0; i < n; ++i) {
    double exact = 0;
    for (int r = 0; r < w; ++r) exact += value(r, 1, n * static_cast<size_t>(me) + i);
    EXPECT_NEAR(got[i], exact / w, 1.05) << i;  // sum_r A_r / (qmax W) <= 1, bf16 rounding
  }
}

TEST(Collectives, QuantizedDeviceCollectivesMatchTheHostKernels) {
  REQUIRE_BACKEND();
  Backend& b = TheBackend();
  if (b.gpu) {
    CheckQuantizedDeviceCollectives(*b.gpu, b.boot);
    return;
  }
  HostSimOptions o;
  o.capacity_bytes = 64ull << 20;
  auto sim = CreateHostSimDevice(o);
  ASSERT_TRUE(sim.ok());
  // The machine's topology (one node), then emulated nodes of one rank and, with four ranks,
  // two nodes of two (both hops of the reduction).
  std::vector<int> per_node = {0};
  const int w = b.boot->size();
  if (w > 1) per_node.push_back(1);
  if (w >= 4 && w % 2 == 0) per_node.push_back(w / 2);
  for (int rpn : per_node) {
    SCOPED_TRACE("ranks_per_node " + std::to_string(rpn));
    std::shared_ptr<Communicator> boot = b.boot;
    if (rpn > 0) {
      auto c = Communicator::Mpi(rpn);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      boot = *c;
    }
    CheckQuantizedDeviceCollectives(**sim, boot);
  }
}

TEST(Collectives, BadArgumentsAreStatuses) {
  REQUIRE_BACKEND();
  Communicator& c = Comm();
  std::vector<uint8_t> buf(64 * c.size());
  auto r = c.AllReduce(buf.data(), buf.data(), 8, DType::kI8, ReduceOp::kSum);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  auto g = c.AllGather(buf.data(), buf.data() + 32, 3, DType::kI4);
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  auto b = c.Broadcast(buf.data(), 4, DType::kF32, c.size());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  // Values outside the enums, and counts no buffer holds (hunt 48: accepted by the one-rank
  // communicator, which copied nothing, or crashed).
  EXPECT_EQ(c.AllGather(buf.data(), buf.data(), 4, static_cast<DType>(42)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      c.AllReduce(buf.data(), buf.data(), 4, DType::kF32, static_cast<ReduceOp>(9)).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(
      c.AllReduce(buf.data(), buf.data(), SIZE_MAX, DType::kF32, ReduceOp::kSum).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(c.AllGather(buf.data(), buf.data(), SIZE_MAX / 2, DType::kBF16).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Split(static_cast<SplitBy>(7)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(c.Barrier().ok());
}

TEST(Collectives, SingleRankIsCopies) {
  auto s = Communicator::Single();
  EXPECT_EQ(s->size(), 1);
  EXPECT_EQ(s->backend(), "single");
  std::vector<float> a = {1, 2, 3}, b(3);
  ASSERT_TRUE((*s->AllReduce(a.data(), b.data(), 3, DType::kF32, ReduceOp::kMean))->Wait().ok());
  EXPECT_EQ(a, b);
  ASSERT_TRUE((*s->AllGather(a.data(), b.data(), 3, DType::kF32))->Wait().ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ(s->stats().bytes_sent, 0u);
  // The checks every backend makes (BadArgumentsAreStatuses), here without a launcher.
  EXPECT_EQ(s->AllGather(a.data(), b.data(), 3, static_cast<DType>(42)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s->ReduceScatter(a.data(), b.data(), 3, DType::kF32, static_cast<ReduceOp>(9))
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s->AllReduce(a.data(), b.data(), SIZE_MAX, DType::kF32, ReduceOp::kSum).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s->AllGather(nullptr, b.data(), 3, DType::kF32).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Split(static_cast<SplitBy>(7)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a, std::vector<float>({1, 2, 3}));
}

}  // namespace
}  // namespace tierzero

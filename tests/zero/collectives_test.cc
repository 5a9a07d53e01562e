// Every collective against a serial reference, for several dtypes and odd sizes. The binary runs
// under `mpirun -np 2` and `-np 4` (and alone, as one rank): every rank computes what every other
// rank sends from the same formula, so each can check its result alone. Integer-valued data makes
// the 16-bit sums exact (every partial sum is representable, in any order), so reductions are
// compared bit for bit; random fp32 data is compared within a rounding bound.
//
// The backend is MPI on host buffers, or with TZ_TEST_COMM=nccl the NCCL communicator on device
// buffers of one GPU per rank (bootstrapped over MPI): the data is copied in, the collective runs
// on the comm stream, the result is copied out. Without a GPU per rank the NCCL run skips.
#include "collectives_backend.h"

namespace tierzero {
namespace {
using namespace collectives_test;

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

// Every collective of the MPI communicator against a serial reference, for several dtypes and
// odd sizes. The binary runs under `mpirun -np 2` and `-np 4` (and alone, as one rank): every rank
// computes what every other rank sends from the same formula, so each can check its result alone.
// Integer-valued data makes the 16-bit sums exact (every partial sum is representable), so
// reductions are compared bit for bit; random fp32 data is compared within a rounding bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/convert.h"
#include "tierzero/communicator.h"

namespace tierzero {
namespace {

Communicator& Comm() {
  static std::shared_ptr<Communicator> comm = [] {
    auto c = Communicator::Mpi();
    if (!c.ok()) {
      ADD_FAILURE() << c.status().ToString();
      return Communicator::Single();
    }
    return *c;
  }();
  return *comm;
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

const size_t kCounts[] = {1, 7, 1000, 4099, 70001};
const DType kAll[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI8, DType::kI4};
const DType kFloats[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(Collectives, AllGatherEveryDtypeAndOddSizes) {
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
      auto req = c.AllGather(send.data(), got.data(), n, dt);
      ASSERT_TRUE(req.ok()) << req.status().ToString();
      ASSERT_TRUE((*req)->Wait().ok());
      EXPECT_EQ(got, want) << DTypeName(dt) << " n=" << n;
    }
  }
}

TEST(Collectives, AllToAllAndBroadcast) {
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
      auto req = c.AllToAll(send.data(), got.data(), n, dt);
      ASSERT_TRUE(req.ok()) << req.status().ToString();
      ASSERT_TRUE((*req)->Wait().ok());
      EXPECT_EQ(got, want) << DTypeName(dt) << " n=" << n;

      const int root = w - 1;
      auto buf = me == root ? Fill(dt, n, [&](size_t i) { return Value(root, 9, i); })
                            : std::vector<uint8_t>(DTypeBytes(dt, n), 0);
      auto b = c.Broadcast(buf.data(), n, dt, root);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      ASSERT_TRUE((*b)->Wait().ok());
      EXPECT_EQ(buf, Fill(dt, n, [&](size_t i) { return Value(root, 9, i); }));
    }
  }
}

TEST(Collectives, ReduceScatterAndAllReduceAreExactOnIntegers) {
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
        auto rs = c.ReduceScatter(send.data(), got.data(), n, dt, op);
        ASSERT_TRUE(rs.ok()) << rs.status().ToString();
        ASSERT_TRUE((*rs)->Wait().ok());
        EXPECT_EQ(got, Fill(dt, n, [&](size_t i) { return reduce(me, i); }))
            << "reduce_scatter " << DTypeName(dt) << " op " << int(op) << " n=" << n;

        // all_reduce of block 0, out of place and in place.
        auto src = Fill(dt, n, [&](size_t i) { return Value(me, 0, i); });
        const auto want = Fill(dt, n, [&](size_t i) { return reduce(0, i); });
        std::vector<uint8_t> out(src.size());
        auto ar = c.AllReduce(src.data(), out.data(), n, dt, op);
        ASSERT_TRUE(ar.ok()) << ar.status().ToString();
        ASSERT_TRUE((*ar)->Wait().ok());
        EXPECT_EQ(out, want) << "all_reduce " << DTypeName(dt) << " n=" << n;
        auto ip = c.AllReduce(src.data(), src.data(), n, dt, op);
        ASSERT_TRUE(ip.ok()) << ip.status().ToString();
        ASSERT_TRUE((*ip)->Wait().ok());
        EXPECT_EQ(src, want) << "in-place all_reduce " << DTypeName(dt) << " n=" << n;
      }
    }
  }
}

TEST(Collectives, Fp32SumsOfRandomValuesWithinRounding) {
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
  auto req = c.AllReduce(mine.data(), mine.data(), n, DType::kF32, ReduceOp::kSum);
  ASSERT_TRUE(req.ok());
  // Progress by polling, as a caller overlapping work would.
  for (;;) {
    auto done = (*req)->Test();
    ASSERT_TRUE(done.ok()) << done.status().ToString();
    if (*done) break;
  }
  for (size_t i = 0; i < n; ++i) {
    // w - 1 additions, each within half an ulp of its result.
    ASSERT_NEAR(mine[i], want[i], 1e-6 * w * (std::fabs(want[i]) + 4)) << i;
  }
}

TEST(Collectives, ByteCountersFollowTheBusBandwidthConvention) {
  Communicator& c = Comm();
  const int w = c.size();
  const CommStats before = c.stats();
  std::vector<float> send(1000 * w), recv(1000 * w);
  ASSERT_TRUE((*c.AllGather(send.data(), recv.data(), 1000, DType::kF32))->Wait().ok());
  ASSERT_TRUE(
      (*c.ReduceScatter(send.data(), recv.data(), 1000, DType::kF32, ReduceOp::kSum))->Wait().ok());
  const CommStats after = c.stats();
  EXPECT_EQ(after.collectives - before.collectives, 2u);
  EXPECT_EQ(after.bytes_sent - before.bytes_sent, 2u * 4000u * static_cast<uint64_t>(w - 1));
}

TEST(Collectives, TopologyFromTheSplitOrTheOverride) {
  Communicator& c = Comm();
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

TEST(Collectives, BadArgumentsAreStatuses) {
  Communicator& c = Comm();
  std::vector<uint8_t> buf(64 * c.size());
  auto r = c.AllReduce(buf.data(), buf.data(), 8, DType::kI8, ReduceOp::kSum);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  auto g = c.AllGather(buf.data(), buf.data() + 32, 3, DType::kI4);
  EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
  auto b = c.Broadcast(buf.data(), 4, DType::kF32, c.size());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
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
}

}  // namespace
}  // namespace tierzero

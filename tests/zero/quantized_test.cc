// ZeRO++'s quantized collectives (comm/quantized.h) under mpirun: 1 to 4 ranks, with the nodes
// emulated as 1 node of W, W nodes of 1 (3 nodes of 1 with -np 3) and 2 nodes of 2. Shards of
// an odd length cut by tensor boundaries at different places in every shard. Every rank derives
// every rank's input from the same formula, so each checks its result alone:
//   - qwZ: the gathered chunk is dequantize(quantize(shard r)) of every rank r, bit for bit;
//   - qgZ: the mean is within the documented bound of the exact fp64 mean, and the bytes that
//     crossed nodes are the N - 1 quantized shards.
#include "comm/quantized.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/convert.h"

namespace tierzero {
namespace {

constexpr uint64_t kShard = 1001;
// Tensor sizes packed into the chunk (the last one takes the rest).
const uint64_t kTensors[] = {5, 300, 1, 777, 64, 1500};

std::vector<std::vector<uint64_t>> ShardRuns(int w) {
  std::vector<uint64_t> bounds = {0};
  for (uint64_t t : kTensors) bounds.push_back(bounds.back() + t);
  std::vector<std::vector<uint64_t>> runs(static_cast<size_t>(w));
  for (int r = 0; r < w; ++r) {
    const uint64_t lo = kShard * r, hi = lo + kShard;
    uint64_t at = lo;
    for (size_t b = 1; b <= bounds.size() && at < hi; ++b) {
      const uint64_t end = b < bounds.size() ? std::min(bounds[b], hi) : hi;
      if (end > at) {
        runs[r].push_back(end - at);
        at = end;
      }
    }
  }
  return runs;
}

// Rank r's values: tensors of very different scales.
std::vector<float> Input(int r, uint64_t n, uint32_t salt) {
  std::mt19937 rng(1000u * static_cast<uint32_t>(r) + salt);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i)
    v[i] = normal(rng) * std::ldexp(1.0f, static_cast<int>(i % 7) - 3);
  return v;
}

std::vector<uint16_t> ToBF16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  EXPECT_TRUE(Convert(v.data(), DType::kF32, out.data(), DType::kBF16, v.size()).ok());
  return out;
}
std::vector<float> FromBF16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  EXPECT_TRUE(Convert(v.data(), DType::kBF16, out.data(), DType::kF32, v.size()).ok());
  return out;
}

struct Ranks {
  std::shared_ptr<Communicator> world, node, cross;
};

Ranks Make(int per_node) {
  Ranks r;
  auto w = Communicator::Mpi(per_node);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  r.world = *w;
  r.node = *r.world->Split(SplitBy::kNode);
  r.cross = *r.world->Split(SplitBy::kLocalRank);
  return r;
}

std::vector<int> NodeSizes(int w) {
  std::vector<int> out = {1};
  if (w % 2 == 0 && w > 2) out.push_back(2);
  if (w > 1) out.push_back(w);
  return out;
}

TEST(Quantized, AllGatherIsEveryRanksDequantizedShard) {
  for (int per_node : NodeSizes(Communicator::Mpi().value()->size())) {
    Ranks rk = Make(per_node);
    const int w = rk.world->size(), me = rk.world->rank();
    for (int bits : {8, 4}) {
      SCOPED_TRACE("int" + std::to_string(bits) + ", ranks per node " + std::to_string(per_node));
      auto q = ShardQuantization::Create({bits, 64}, ShardRuns(w));
      ASSERT_TRUE(q.ok()) << q.status().ToString();
      const std::vector<uint16_t> mine = ToBF16(Input(me, kShard, 1));
      std::vector<uint16_t> got(kShard * w);
      std::vector<uint8_t> scratch;
      ASSERT_TRUE(
          QuantizedAllGather(*rk.world, *q, mine.data(), DType::kBF16, got.data(), scratch).ok());
      for (int r = 0; r < w; ++r) {
        const std::vector<uint16_t> theirs = ToBF16(Input(r, kShard, 1));
        std::vector<uint8_t> packed(q->layout(r).bytes());
        std::vector<uint16_t> want(kShard);
        ASSERT_TRUE(
            kernels::Quantize(q->layout(r), theirs.data(), DType::kBF16, packed.data()).ok());
        ASSERT_TRUE(
            kernels::Dequantize(q->layout(r), packed.data(), want.data(), DType::kBF16).ok());
        ASSERT_EQ(std::vector<uint16_t>(got.begin() + kShard * r, got.begin() + kShard * (r + 1)),
                  want)
            << "rank " << r << "'s shard";
      }
    }
  }
}

// The absmax of `x` over each element's block in `layout`.
std::vector<double> BlockAbsMax(const kernels::QuantLayout& layout, const float* x) {
  std::vector<double> out(layout.elems());
  const uint64_t b = layout.spec().block_elems;
  for (const auto& run : layout.runs()) {
    for (uint64_t first = 0; first < run.elems; first += b) {
      const uint64_t n = std::min(b, run.elems - first);
      double m = 0;
      for (uint64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(double{x[run.elem + first + i]}));
      for (uint64_t i = 0; i < n; ++i) out[run.elem + first + i] = m;
    }
  }
  return out;
}

TEST(Quantized, ReduceScatterWithinTheBoundOfTheExactMean) {
  for (int per_node : NodeSizes(Communicator::Mpi().value()->size())) {
    Ranks rk = Make(per_node);
    const int w = rk.world->size(), me = rk.world->rank();
    const int nodes = rk.cross->size();
    for (int bits : {8, 4}) {
      SCOPED_TRACE("int" + std::to_string(bits) + ", " + std::to_string(nodes) + " nodes of " +
                   std::to_string(per_node));
      auto q = ShardQuantization::Create({bits, 64}, ShardRuns(w));
      ASSERT_TRUE(q.ok());
      const std::vector<uint16_t> grad = ToBF16(Input(me, kShard * w, 7));
      std::vector<float> mean(kShard);
      std::vector<uint8_t> scratch;
      const CommStats node_before = rk.node->stats(), cross_before = rk.cross->stats();
      ASSERT_TRUE(QuantizedReduceScatter(*rk.node, *rk.cross, *q, grad.data(), DType::kBF16,
                                         mean.data(), scratch)
                      .ok());
      // Nothing that went inside the node crossed; N - 1 quantized shards did.
      EXPECT_EQ(rk.node->stats().bytes_cross_node, node_before.bytes_cross_node);
      EXPECT_EQ(rk.cross->stats().bytes_cross_node - cross_before.bytes_cross_node,
                q->slot_bytes() * static_cast<uint64_t>(nodes - 1));
      // The exact mean in fp64 and the bound: sum_r A_r / (qmax W), half that on one node.
      std::vector<double> exact(kShard, 0.0), bound(kShard, 0.0);
      const double qmax = bits == 8 ? 127 : 7;
      for (int r = 0; r < w; ++r) {
        const std::vector<float> x = FromBF16(ToBF16(Input(r, kShard * w, 7)));
        const float* part = x.data() + kShard * me;
        const std::vector<double> a = BlockAbsMax(q->layout(me), part);
        for (uint64_t i = 0; i < kShard; ++i) {
          exact[i] += part[i];
          bound[i] += a[i];
        }
      }
      double worst = 0;
      for (uint64_t i = 0; i < kShard; ++i) {
        exact[i] /= w;
        const double b = bound[i] / (qmax * w) * (nodes == 1 ? 0.5 : 1.0) * (1 + 1e-4) + 1e-7;
        const double err = std::fabs(mean[i] - exact[i]);
        ASSERT_LE(err, b) << "element " << i;
        worst = std::max(worst, err / b);
      }
      EXPECT_GT(worst, 0.05) << "the bound is far looser than the error: is anything quantized?";
    }
  }
}

TEST(Quantized, RejectsMismatchedShapes) {
  EXPECT_FALSE(ShardQuantization::Create({8, 64}, {{10}, {11}}).ok());
  EXPECT_FALSE(ShardQuantization::Create({8, 16}, {{10}}).ok());
  auto q = ShardQuantization::Create({8, 64}, {{10}, {10}, {10}});
  ASSERT_TRUE(q.ok());
  auto one = Communicator::Single();
  std::vector<float> x(30), mean(10);
  std::vector<uint8_t> scratch;
  EXPECT_EQ(QuantizedAllGather(*one, *q, x.data(), DType::kF32, x.data(), scratch).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      QuantizedReduceScatter(*one, *one, *q, x.data(), DType::kF32, mean.data(), scratch).code(),
      StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tierzero

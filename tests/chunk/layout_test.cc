#include "chunk/layout.h"

#include <gtest/gtest.h>

#include "core/bytes.h"

namespace tierzero {
namespace {

std::vector<TensorDesc> Tensors(std::initializer_list<uint64_t> sizes) {
  std::vector<TensorDesc> t;
  int i = 0;
  for (uint64_t n : sizes) t.push_back({"t" + std::to_string(i++), n});
  return t;
}

TEST(ChunkLayoutTest, PacksInOrderWithoutSpanningChunks) {
  LayoutOptions o;
  o.chunk_elems = 8192;  // bf16: 2 pages, already on the granularity for W = 1
  auto l = ChunkLayout::Build(Tensors({5000, 3000, 1000, 8192, 1}), o);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->chunk_elems(), 8192u);
  ASSERT_EQ(l->num_chunks(), 4);
  EXPECT_EQ(l->tensor(0).chunk, 0);
  EXPECT_EQ(l->tensor(1).chunk, 0);
  EXPECT_EQ(l->tensor(1).offset, 5000u);
  EXPECT_EQ(l->tensor(2).chunk, 1) << "1000 does not fit the 192 left in chunk 0";
  EXPECT_EQ(l->tensor(3).chunk, 2);
  EXPECT_EQ(l->tensor(4).chunk, 3);
  EXPECT_NEAR(l->waste_fraction(), 1.0 - 17193.0 / (4 * 8192.0), 1e-12);
  for (int t = 0; t < l->num_tensors(); ++t) {
    EXPECT_LE(l->tensor(t).offset + l->tensor(t).numel, l->chunk_elems());
  }
}

TEST(ChunkLayoutTest, ShardsAreWholePagesForAnyWorldSize) {
  for (int w : {1, 2, 3, 4, 8}) {
    for (DType d : {DType::kBF16, DType::kF32}) {
      LayoutOptions o;
      o.chunk_elems = 100000;
      o.world_size = w;
      o.dtype = d;
      auto l = ChunkLayout::Build(Tensors({1000, 99000}), o);
      ASSERT_TRUE(l.ok());
      EXPECT_GE(l->chunk_elems(), 100000u);
      EXPECT_EQ(l->chunk_elems() % static_cast<uint64_t>(w), 0u);
      EXPECT_EQ(l->shard_bytes() % 4096, 0u) << "w=" << w;
      EXPECT_EQ(l->shard_elems() * static_cast<uint64_t>(w), l->chunk_elems());
      EXPECT_LT(l->chunk_elems() - 100000u, static_cast<uint64_t>(w) * 4096) << "minimal rounding";
    }
  }
}

TEST(ChunkLayoutTest, TensorLargerThanSetChunkIsAnErrorNamingIt) {
  LayoutOptions o;
  o.chunk_elems = 4096;
  auto l = ChunkLayout::Build({{"small", 10}, {"h0.mlp.w", 10000}}, o);
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(l.status().message().find("'h0.mlp.w'"), std::string::npos) << l.status().message();
  EXPECT_NE(l.status().message().find("10000"), std::string::npos);
  EXPECT_FALSE(ChunkLayout::Build({}, {}).ok());
  EXPECT_FALSE(ChunkLayout::Build({{"zero", 0}}, {}).ok());
}

TEST(ChunkLayoutTest, AutomaticSizeFitsTheLargestTensorAndBeatsFixedSizes) {
  // A GPT-like registration: per layer 4 matrices of 3 sizes and two small vectors.
  std::vector<TensorDesc> tensors;
  std::vector<std::vector<int>> groups;
  const uint64_t d = 768;
  for (int layer = 0; layer < 12; ++layer) {
    std::vector<int> g;
    for (uint64_t n : {d, 3 * d * d, d * d, d, 4 * d * d, 4 * d * d}) {
      g.push_back(static_cast<int>(tensors.size()));
      tensors.push_back({"l" + std::to_string(layer) + "." + std::to_string(tensors.size()), n});
    }
    groups.push_back(g);
  }
  LayoutOptions o;
  o.groups = groups;
  auto best = ChunkLayout::Build(tensors, o);
  ASSERT_TRUE(best.ok());
  EXPECT_TRUE(best->automatic());
  EXPECT_GE(best->chunk_elems(), 4 * d * d);
  auto cost = [&](const ChunkLayout& l) {
    const double chunk_bytes = static_cast<double>(l.chunk_bytes());
    return l.waste_fraction() * chunk_bytes * l.num_chunks() +
           l.max_chunks_in_flight() * chunk_bytes;
  };
  for (uint64_t fixed : {4 * d * d, 5 * d * d, 8 * d * d, 12 * d * d, 24 * d * d}) {
    LayoutOptions f = o;
    f.chunk_elems = fixed;
    auto l = ChunkLayout::Build(tensors, f);
    ASSERT_TRUE(l.ok());
    EXPECT_LE(cost(*best), cost(*l) * 1.0001) << "fixed " << fixed;
  }
  EXPECT_LT(best->waste_fraction(), 0.25);
}

}  // namespace
}  // namespace tierzero

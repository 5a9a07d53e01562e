// Chunk layout: tensors packed into equal chunks in first-use order, each chunk split into W
// 4 KiB-aligned shards (DESIGN.md section 4).
//
// - Tensors are registered in first-use order and packed greedily: a tensor goes into the current
//   chunk if it fits, otherwise a new chunk starts. A tensor never spans two chunks, so one
//   Acquire of a layer touches few, consecutive chunks.
// - Capacity: every chunk holds `chunk_elems` elements, a multiple of W * (4 KiB / element size),
//   so each of the W shards is a whole number of 4 KiB pages (O_DIRECT and the pinned arena need
//   that). A requested size is rounded up to that granularity.
// - Automatic size (chunk_elems = 0): among candidate sizes from the largest tensor up, pick the
//   one minimising padding waste plus in-flight memory, where in-flight memory is the number of
//   chunks the busiest access group spans times the chunk size (see Note [Chunk size search]).
//
// Thread-safety: a ChunkLayout is immutable after Build.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "tierzero/types.h"

namespace tierzero {

struct TensorDesc {
  std::string name;
  uint64_t numel = 0;
};

struct LayoutOptions {
  // Elements per chunk; 0 chooses automatically. Default: 0.
  uint64_t chunk_elems = 0;
  // Ranks sharing each chunk (W). Default: 1.
  int world_size = 1;
  // Compute dtype of the gathered chunk (sets the 4 KiB granularity). Default: bf16.
  DType dtype = DType::kBF16;
  // Tensors acquired together (indices into the tensor list), e.g. one layer each; used by the
  // automatic search to count in-flight chunks. Empty: each tensor on its own.
  std::vector<std::vector<int>> groups;
};

struct ChunkDesc {
  std::vector<int> tensors;  // in offset order
  uint64_t used_elems = 0;
};

struct TensorLoc {
  int chunk = -1;
  uint64_t offset = 0;  // elements from the chunk start
  uint64_t numel = 0;
};

// The part of a tensor that lies in one rank's shard of its chunk.
struct ShardSlice {
  int tensor = -1;
  uint64_t tensor_begin = 0;  // the slice's first element, counted within the tensor
  uint64_t shard_offset = 0;  // and where it lies in the shard (elements)
  uint64_t numel = 0;
};

class ChunkLayout {
 public:
  // InvalidArgument for no tensors, a zero-sized tensor, world_size < 1, a non-float dtype, or a
  // tensor larger than an explicitly set chunk size (naming the tensor and both sizes).
  static StatusOr<ChunkLayout> Build(const std::vector<TensorDesc>& tensors,
                                     const LayoutOptions& options);

  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  int num_tensors() const { return static_cast<int>(locs_.size()); }
  const ChunkDesc& chunk(int c) const { return chunks_[static_cast<size_t>(c)]; }
  const TensorLoc& tensor(int t) const { return locs_[static_cast<size_t>(t)]; }
  const std::string& tensor_name(int t) const { return names_[static_cast<size_t>(t)]; }

  uint64_t chunk_elems() const { return chunk_elems_; }
  uint64_t shard_elems() const { return chunk_elems_ / static_cast<uint64_t>(world_size_); }
  int world_size() const { return world_size_; }
  DType dtype() const { return dtype_; }
  uint64_t chunk_bytes() const { return DTypeBytes(dtype_, chunk_elems_); }
  uint64_t shard_bytes() const { return DTypeBytes(dtype_, shard_elems()); }
  // The slices of chunk c's tensors in rank r's shard, in offset order; with W = 1, whole
  // tensors. Rank r's shard holds elements [r * shard_elems, (r + 1) * shard_elems) of the chunk.
  std::vector<ShardSlice> ShardSlices(int c, int rank) const;
  // Every rank's shard of chunk c as runs: its tensors' pieces and the gaps between them (padding)
  // in shard order, covering the shard ([rank][run] elements; ZeRO++'s quantization layouts).
  std::vector<std::vector<uint64_t>> ShardRuns(int c) const;
  // Elements of real tensors over elements of all chunks: 1 - waste.
  uint64_t total_tensor_elems() const { return total_tensor_elems_; }
  double waste_fraction() const;
  // Chunks the busiest group spans (1 without groups).
  int max_chunks_in_flight() const { return max_inflight_; }
  // True when the size was chosen by the search.
  bool automatic() const { return automatic_; }

  // The smallest multiple of the shard granularity that is >= elems.
  static uint64_t RoundToGranularity(uint64_t elems, int world_size, DType dtype);

 private:
  uint64_t chunk_elems_ = 0;
  int world_size_ = 1;
  DType dtype_ = DType::kBF16;
  bool automatic_ = false;
  int max_inflight_ = 1;
  uint64_t total_tensor_elems_ = 0;
  std::vector<ChunkDesc> chunks_;
  std::vector<TensorLoc> locs_;
  std::vector<std::string> names_;
};

}  // namespace tierzero

// Note [Chunk size search]
// Two costs pull the chunk size in opposite directions. Small chunks waste space at the end of
// each chunk when the next tensor does not fit (padding); large chunks make every gather move
// more than the moment needs, and the device must hold whole chunks for every tensor in use
// (in-flight memory). We score a candidate size by
//     padding bytes over all chunks + (chunks the busiest group spans) * chunk bytes
// and take the smallest score. Candidates run geometrically (x1.0625) from the largest tensor to
// 32x it (or the whole model, if smaller), each rounded to the shard granularity; packing is
// linear, so the search costs O(tensors * candidates).
#include "chunk/layout.h"

#include <algorithm>
#include <set>

#include "core/bytes.h"
#include "tierzero/types.h"

namespace tierzero {
namespace {

struct Packing {
  std::vector<ChunkDesc> chunks;
  std::vector<TensorLoc> locs;
};

Packing Pack(const std::vector<TensorDesc>& tensors, uint64_t chunk_elems) {
  Packing p;
  p.locs.resize(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    const uint64_t n = tensors[t].numel;
    if (p.chunks.empty() || p.chunks.back().used_elems + n > chunk_elems) p.chunks.emplace_back();
    ChunkDesc& c = p.chunks.back();
    p.locs[t] = {static_cast<int>(p.chunks.size() - 1), c.used_elems, n};
    c.tensors.push_back(static_cast<int>(t));
    c.used_elems += n;
  }
  return p;
}

int MaxInflight(const Packing& p, const std::vector<std::vector<int>>& groups) {
  int most = 1;
  for (const auto& g : groups) {
    std::set<int> chunks;
    for (int t : g) chunks.insert(p.locs[static_cast<size_t>(t)].chunk);
    most = std::max(most, static_cast<int>(chunks.size()));
  }
  return most;
}

}  // namespace

uint64_t ChunkLayout::RoundToGranularity(uint64_t elems, int world_size, DType dtype) {
  const uint64_t per_page = 4096 * 8 / static_cast<uint64_t>(DTypeBits(dtype));
  const uint64_t granule = per_page * static_cast<uint64_t>(world_size);
  return std::max<uint64_t>(granule, (elems + granule - 1) / granule * granule);
}

double ChunkLayout::waste_fraction() const {
  const double total = static_cast<double>(chunk_elems_) * static_cast<double>(chunks_.size());
  return total == 0 ? 0.0 : 1.0 - static_cast<double>(total_tensor_elems_) / total;
}

StatusOr<ChunkLayout> ChunkLayout::Build(const std::vector<TensorDesc>& tensors,
                                         const LayoutOptions& options) {
  if (tensors.empty()) return InvalidArgumentError("chunk layout: no tensors registered");
  if (options.world_size < 1) {
    return InvalidArgumentError("chunk layout: world_size = " + std::to_string(options.world_size) +
                                "; expected >= 1");
  }
  if (!IsFloatType(options.dtype)) {
    return InvalidArgumentError("chunk layout: compute dtype must be fp32, bf16 or fp16, not " +
                                std::string(DTypeName(options.dtype)));
  }
  uint64_t largest = 0, total = 0;
  int largest_index = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t].numel == 0) {
      return InvalidArgumentError("tensor '" + tensors[t].name + "' has no elements");
    }
    if (tensors[t].numel > largest) {
      largest = tensors[t].numel;
      largest_index = static_cast<int>(t);
    }
    total += tensors[t].numel;
  }
  for (const auto& g : options.groups) {
    for (int t : g) {
      if (t < 0 || static_cast<size_t>(t) >= tensors.size()) {
        return InvalidArgumentError("chunk layout: group names tensor index " + std::to_string(t) +
                                    " of " + std::to_string(tensors.size()));
      }
    }
  }
  const uint64_t elem_bytes_bits = static_cast<uint64_t>(DTypeBits(options.dtype));
  auto bytes = [&](uint64_t elems) { return elems * elem_bytes_bits / 8; };

  ChunkLayout layout;
  layout.world_size_ = options.world_size;
  layout.dtype_ = options.dtype;
  if (options.chunk_elems != 0) {
    if (largest > options.chunk_elems) {
      return InvalidArgumentError(
          "tensor '" + tensors[static_cast<size_t>(largest_index)].name + "' has " +
          std::to_string(largest) + " elements, more than chunk_elems = " +
          std::to_string(options.chunk_elems) + "; raise chunk_elems or set it to 0 (automatic)");
    }
    layout.chunk_elems_ =
        RoundToGranularity(options.chunk_elems, options.world_size, options.dtype);
  } else {
    layout.automatic_ = true;
    const uint64_t hi = std::max(largest, std::min(total, largest * 32));
    uint64_t best = 0;
    double best_cost = 0;
    for (double c = static_cast<double>(largest);; c *= 1.0625) {
      const uint64_t cand =
          RoundToGranularity(static_cast<uint64_t>(c), options.world_size, options.dtype);
      Packing p = Pack(tensors, cand);
      const double padding = static_cast<double>(bytes(cand * p.chunks.size() - total));
      const double inflight =
          static_cast<double>(MaxInflight(p, options.groups)) * static_cast<double>(bytes(cand));
      const double cost = padding + inflight;
      if (best == 0 || cost < best_cost) {
        best = cand;
        best_cost = cost;
      }
      if (cand >= hi) break;
    }
    layout.chunk_elems_ = best;
  }
  Packing p = Pack(tensors, layout.chunk_elems_);
  layout.chunks_ = std::move(p.chunks);
  layout.locs_ = std::move(p.locs);
  layout.max_inflight_ = MaxInflight({layout.chunks_, layout.locs_}, options.groups);
  layout.total_tensor_elems_ = total;
  for (const TensorDesc& t : tensors) layout.names_.push_back(t.name);
  return layout;
}

std::vector<ShardSlice> ChunkLayout::ShardSlices(int c, int rank) const {
  std::vector<ShardSlice> out;
  const uint64_t begin = static_cast<uint64_t>(rank) * shard_elems();
  const uint64_t end = begin + shard_elems();
  for (int t : chunk(c).tensors) {
    const TensorLoc& loc = tensor(t);
    const uint64_t lo = std::max(begin, loc.offset);
    const uint64_t hi = std::min(end, loc.offset + loc.numel);
    if (lo >= hi) continue;
    out.push_back({t, lo - loc.offset, lo - begin, hi - lo});
  }
  return out;
}

std::vector<std::vector<uint64_t>> ChunkLayout::ShardRuns(int c) const {
  std::vector<std::vector<uint64_t>> runs;
  for (int r = 0; r < world_size(); ++r) {
    std::vector<uint64_t>& mine = runs.emplace_back();
    uint64_t at = 0;
    for (const ShardSlice& sl : ShardSlices(c, r)) {
      if (sl.shard_offset > at) mine.push_back(sl.shard_offset - at);
      mine.push_back(sl.numel);
      at = sl.shard_offset + sl.numel;
    }
    if (shard_elems() > at) mine.push_back(shard_elems() - at);
  }
  return runs;
}

}  // namespace tierzero

#include "comm/collective.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/convert.h"

namespace tierzero::zero {
namespace {

const char* KindName(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
    case CollectiveKind::kBroadcast:
      return "broadcast";
  }
  return "?";
}

float Load(const void* p, size_t i, DType t) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return BF16ToF32Scalar(static_cast<const uint16_t*>(p)[i]);
    default:
      return F16ToF32Scalar(static_cast<const uint16_t*>(p)[i]);
  }
}

void Store(void* p, size_t i, DType t, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = F32ToBF16Scalar(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = F32ToF16Scalar(v);
      break;
  }
}

}  // namespace

Status CheckBroadcast(size_t count, DType dtype, int root, int size) {
  RETURN_IF_ERROR(CheckCollective(CollectiveKind::kBroadcast, count, dtype, false));
  if (root < 0 || root >= size) {
    return InvalidArgumentError("broadcast root " + std::to_string(root) + " of " +
                                std::to_string(size) + (size == 1 ? " rank" : " ranks"));
  }
  return Status::OK();
}

Status CheckCollective(CollectiveKind kind, size_t count, DType dtype, bool reduction,
                       ReduceOp op) {
  const std::string what = KindName(kind);
  // (Values outside the enums, and counts whose bytes wrap around, went through: hunt 48 found a
  // copy of nothing for DType 42 and a crash for SIZE_MAX on the one-rank communicator.)
  if (static_cast<uint8_t>(dtype) > static_cast<uint8_t>(DType::kI4))
    return InvalidArgumentError(what + ": dtype " + std::to_string(static_cast<int>(dtype)) +
                                " is no DType");
  if (count > kMaxCollectiveElems)
    return InvalidArgumentError(what + " of " + std::to_string(count) +
                                " elements: more than any buffer holds (at most 2^48)");
  if (reduction && static_cast<uint8_t>(op) > static_cast<uint8_t>(ReduceOp::kMax))
    return InvalidArgumentError(what + ": op " + std::to_string(static_cast<int>(op)) +
                                " is no ReduceOp (kSum, kMean, kMax)");
  if (reduction) {
    if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
      return InvalidArgumentError(what + " reduces fp32, bf16 or fp16, not " +
                                  std::string(DTypeName(dtype)));
    return Status::OK();
  }
  if (dtype == DType::kI4 && count % 2 != 0)
    return InvalidArgumentError(what + " of int4 needs an even count (whole bytes), got " +
                                std::to_string(count));
  return Status::OK();
}

Status CheckSplit(SplitBy by) {
  if (by == SplitBy::kNode || by == SplitBy::kLocalRank) return Status::OK();
  return InvalidArgumentError("Split by " + std::to_string(static_cast<int>(by)) +
                              ": no SplitBy (kNode, kLocalRank)");
}

uint64_t BytesSent(CollectiveKind kind, size_t count, DType dtype, int size, bool is_root) {
  const uint64_t b = DTypeBytes(dtype, count);
  const uint64_t w = static_cast<uint64_t>(size);
  switch (kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
      return b * (w - 1);  // of the W blocks, all but one leave (count is per block)
    case CollectiveKind::kAllReduce:
      return w > 1 ? 2 * b * (w - 1) / w : 0;
    case CollectiveKind::kBroadcast:
      return is_root && w > 1 ? b : 0;
  }
  return 0;
}

uint64_t CrossNodeBytes(uint64_t bytes_sent, const Topology& t) {
  if (t.size <= 1) return 0;
  return bytes_sent * static_cast<uint64_t>(t.size - t.local_size) /
         static_cast<uint64_t>(t.size - 1);
}

Topology SplitTopology(SplitBy by, int rank, int size) {
  Topology t;
  t.rank = rank;
  t.size = size;
  if (by == SplitBy::kNode) {
    t.local_rank = rank;
    t.local_size = size;
  } else {
    t.node = rank;
    t.nodes = size;
  }
  return t;
}

void ReduceInto(void* acc, const void* in, size_t n, DType dtype, ReduceOp op) {
  if (dtype == DType::kF32) {
    auto* a = static_cast<float*>(acc);
    const auto* b = static_cast<const float*>(in);
    if (op == ReduceOp::kMax) {
      for (size_t i = 0; i < n; ++i) a[i] = std::max(a[i], b[i]);
    } else {
      for (size_t i = 0; i < n; ++i) a[i] += b[i];
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float x = Load(acc, i, dtype), y = Load(in, i, dtype);
    Store(acc, i, dtype, op == ReduceOp::kMax ? std::max(x, y) : x + y);
  }
}

void DivideInPlace(void* buf, size_t n, DType dtype, double divisor) {
  const float inv = static_cast<float>(1.0 / divisor);
  for (size_t i = 0; i < n; ++i) Store(buf, i, dtype, Load(buf, i, dtype) * inv);
}

void ReduceBlocks(const void* blocks, int num_blocks, void* out, size_t n, DType dtype,
                  ReduceOp op) {
  const auto* base = static_cast<const uint8_t*>(blocks);
  const size_t stride = DTypeBytes(dtype, n);
  constexpr size_t kTile = 2048;  // fp32 accumulators on the stack, a tile at a time
  float acc[kTile];
  for (size_t t0 = 0; t0 < n; t0 += kTile) {
    const size_t m = std::min(kTile, n - t0);
    for (int b = 0; b < num_blocks; ++b) {
      const uint8_t* blk = base + static_cast<size_t>(b) * stride;
      if (dtype == DType::kF32) {
        const float* x = reinterpret_cast<const float*>(blk) + t0;
        if (b == 0) {
          std::memcpy(acc, x, m * 4);
        } else if (op == ReduceOp::kMax) {
          for (size_t i = 0; i < m; ++i) acc[i] = std::max(acc[i], x[i]);
        } else {
          for (size_t i = 0; i < m; ++i) acc[i] += x[i];
        }
      } else {
        for (size_t i = 0; i < m; ++i) {
          const float x = Load(blk, t0 + i, dtype);
          acc[i] = b == 0 ? x : (op == ReduceOp::kMax ? std::max(acc[i], x) : acc[i] + x);
        }
      }
    }
    if (op == ReduceOp::kMean) {
      const float inv = 1.0f / static_cast<float>(num_blocks);
      for (size_t i = 0; i < m; ++i) acc[i] *= inv;
    }
    if (dtype == DType::kF32) {
      std::memcpy(static_cast<float*>(out) + t0, acc, m * 4);
    } else {
      for (size_t i = 0; i < m; ++i) Store(out, t0 + i, dtype, acc[i]);
    }
  }
}

}  // namespace tierzero::zero

namespace tierzero {

Status AgreeOnStatus(Communicator& comm, const Status& local) {
  if (comm.size() == 1) return local;
  struct Outcome {
    int32_t code = 0;
    char message[508] = {};
  } mine;
  mine.code = static_cast<int32_t>(local.code());
  const std::string_view text = local.message();
  if (!text.empty())  // an OK status's message is an empty view whose data() may be null
    std::memcpy(mine.message, text.data(), std::min(text.size(), sizeof mine.message - 1));
  auto all = AllGatherValue(comm, mine);
  if (!all.ok()) return local.ok() ? all.status() : local;
  if (!local.ok()) return local;
  for (int r = 0; r < comm.size(); ++r) {
    const Outcome& o = (*all)[static_cast<size_t>(r)];
    if (o.code != 0) {
      return Status(static_cast<StatusCode>(o.code),
                    "rank " + std::to_string(r) + " of " + std::to_string(comm.size()) + ": " +
                        std::string(o.message, strnlen(o.message, sizeof o.message)));
    }
  }
  return Status::OK();
}

StatusOr<std::vector<uint8_t>> AllGatherBytes(Communicator& comm, const void* data, size_t bytes) {
  std::vector<uint8_t> out(bytes * static_cast<size_t>(comm.size()));
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   comm.AllGather(data, out.data(), bytes, DType::kI8));
  RETURN_IF_ERROR(req->Wait());
  return out;
}

}  // namespace tierzero

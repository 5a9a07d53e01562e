#include "shard/shard_store.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

#include "core/bytes.h"
#include "core/check.h"

namespace tierzero {

ShardStore::ShardStore(Device& device, NvmeStore* nvme, ShardStoreOptions options)
    : device_(device), nvme_(nvme), options_(std::move(options)) {}

ShardStore::~ShardStore() {
  (void)device_.Synchronize();
  if (nvme_ == nullptr) return;
  for (const NvmeExtent& e : nvme_shards_) {
    if (e.valid()) (void)nvme_->Free(e);
  }
}

StatusOr<std::unique_ptr<ShardStore>> ShardStore::Create(Device& device, NvmeStore* nvme,
                                                         ShardStoreOptions options) {
  const ShardGeometry& g = options.geometry;
  if (g.num_chunks < 0 || static_cast<int>(options.param_tier.size()) != g.num_chunks) {
    return InvalidArgumentError("parameter tiers for " + std::to_string(options.param_tier.size()) +
                                " chunks, the store has " + std::to_string(g.num_chunks));
  }
  if (!options.optimizer_tier.empty() &&
      static_cast<int>(options.optimizer_tier.size()) != g.num_chunks) {
    return InvalidArgumentError("optimizer tiers for " +
                                std::to_string(options.optimizer_tier.size()) +
                                " chunks, the store has " + std::to_string(g.num_chunks));
  }
  if (!options.grad_tier.empty()) {
    if (static_cast<int>(options.grad_tier.size()) != g.num_chunks) {
      return InvalidArgumentError("gradient tiers for " + std::to_string(options.grad_tier.size()) +
                                  " chunks, the store has " + std::to_string(g.num_chunks));
    }
    for (Tier t : options.grad_tier) {
      if (t == Tier::kNvme) return InvalidArgumentError("gradient shards are never on NVMe");
    }
  }
  if (g.world_size < 1 || g.rank < 0 || g.rank >= g.world_size) {
    return InvalidArgumentError("rank " + std::to_string(g.rank) + " of " +
                                std::to_string(g.world_size));
  }
  std::unique_ptr<ShardStore> s(new ShardStore(device, nvme, std::move(options)));
  RETURN_IF_ERROR(s->Init());
  return s;
}

Status ShardStore::Init() {
  const int n = num_chunks();
  const uint64_t bytes = geometry().shard_bytes();
  const uint64_t host_slot_bytes = options_.host_param_tail_bytes > 0
                                       ? AlignUp(bytes + options_.host_param_tail_bytes, 4096)
                                       : bytes;
  int host_chunks = 0, nvme_chunks = 0, device_chunks = 0;
  for (Tier t : options_.param_tier) {
    host_chunks += t == Tier::kHost;
    nvme_chunks += t == Tier::kNvme;
    device_chunks += t == Tier::kDevice;
  }
  if (nvme_chunks > 0 && nvme_ == nullptr) {
    return InvalidArgumentError(std::to_string(nvme_chunks) +
                                " parameter shards are placed on NVMe but no NVMe store is "
                                "configured; add nvme paths or raise the host budget");
  }
  int host_grads = 0;
  for (int c = 0; c < n && options_.grads; ++c) {
    if (grad_on_device(c)) {
      ++device_grad_chunks_;
    } else {
      ++host_grads;
    }
  }
  if (device_chunks > 0 || device_grad_chunks_ > 0) {
    ASSIGN_OR_RETURN(stream_, Stream::Create(device_, "shards"));
  }
  if (host_chunks > 0) {
    ASSIGN_OR_RETURN(host_arena_, PinnedArena::Create(&device_, host_slot_bytes,
                                                      static_cast<uint32_t>(host_chunks)));
  }
  if (host_grads > 0) {
    ASSIGN_OR_RETURN(grad_arena_, PinnedArena::Create(&device_, grad_bytes(),
                                                      static_cast<uint32_t>(host_grads)));
  }
  device_shards_.resize(static_cast<size_t>(n));
  host_shards_.resize(static_cast<size_t>(n));
  nvme_shards_.resize(static_cast<size_t>(n));
  grad_shards_.resize(static_cast<size_t>(n));
  device_grads_.resize(static_cast<size_t>(n));
  std::vector<uint8_t> zeros;
  for (int c = 0; c < n; ++c) {
    RETURN_IF_ERROR(InitParam(c, zeros));
    if (!options_.grads) continue;
    if (grad_on_device(c)) {
      auto buf = DeviceBuffer::Allocate(device_, grad_bytes());
      if (!buf.ok()) {
        return std::move(buf).status().WithContext("device-resident gradient shard of chunk " +
                                                   std::to_string(c));
      }
      device_grads_[static_cast<size_t>(c)] = std::move(buf).value();
      RETURN_IF_ERROR(device_.MemsetAsync(device_grads_[static_cast<size_t>(c)].data(), 0,
                                          grad_bytes(), stream_.handle()));
      continue;
    }
    auto g = grad_arena_->TryAcquire();
    TZ_CHECK(g.has_value());
    std::memset(g->data(), 0, g->bytes());
    grad_shards_[static_cast<size_t>(c)] = std::move(*g);
  }
  if (device_chunks > 0 || device_grad_chunks_ > 0) RETURN_IF_ERROR(stream_.Synchronize());
  if (!options_.optimizer_tier.empty()) {
    ASSIGN_OR_RETURN(
        optimizer_,
        OptimizerStates::Create(&device_, nvme_, geometry().shard_elems, options_.optimizer_tier,
                                options_.optimizer_format, options_.optimizer_scale_blocks));
  }
  return Status::OK();
}

// Allocates chunk c's parameter shard in its tier, zeroed (`zeros`: a buffer of zeros for NVMe
// writes, made on first use).
Status ShardStore::InitParam(int c, std::vector<uint8_t>& zeros) {
  const size_t i = static_cast<size_t>(c);
  const uint64_t bytes = geometry().shard_bytes();
  switch (param_tier(c)) {
    case Tier::kDevice: {
      auto buf = DeviceBuffer::Allocate(device_, bytes);
      if (!buf.ok()) {
        return std::move(buf).status().WithContext("device-resident shard of chunk " +
                                                   std::to_string(c));
      }
      device_shards_[i] = std::move(buf).value();
      return device_.MemsetAsync(device_shards_[i].data(), 0, bytes, stream_.handle());
    }
    case Tier::kHost: {
      auto slot = host_arena_->TryAcquire();
      TZ_CHECK(slot.has_value());
      std::memset(slot->data(), 0, slot->bytes());
      host_shards_[i] = std::move(*slot);
      return Status::OK();
    }
    case Tier::kNvme: {
      ASSIGN_OR_RETURN(nvme_shards_[i], nvme_->Allocate(bytes));
      if (zeros.empty()) zeros.assign(AlignUp(bytes, 4096) + 4096, 0);
      auto* aligned =
          reinterpret_cast<uint8_t*>(AlignUp(reinterpret_cast<uintptr_t>(zeros.data()), 4096));
      RETURN_IF_ERROR(nvme_->Write(nvme_shards_[i], aligned));
      nvme_write_bytes_.fetch_add(bytes, std::memory_order_relaxed);
      return Status::OK();
    }
  }
  return Status::OK();
}

void* ShardStore::device_param(int c) const {
  return device_shards_[static_cast<size_t>(c)].data();
}

void* ShardStore::host_param(int c) const {
  if (param_tier(c) != Tier::kHost) return nullptr;
  return host_shards_[static_cast<size_t>(c)].data();
}

const NvmeExtent& ShardStore::nvme_param(int c) const {
  return nvme_shards_[static_cast<size_t>(c)];
}

Status ShardStore::CheckChunk(int c) const {
  if (c < 0 || c >= num_chunks()) {
    return InvalidArgumentError("chunk " + std::to_string(c) + " of " +
                                std::to_string(num_chunks()));
  }
  return Status::OK();
}

Status ShardStore::CopyDevice(void* dst, const void* src, uint64_t bytes, CopyKind kind) {
  RETURN_IF_ERROR(device_.CopyAsync(dst, src, bytes, kind, stream_.handle()));
  return stream_.Synchronize();
}

Status ShardStore::WriteParam(int c, const void* src) {
  RETURN_IF_ERROR(CheckChunk(c));
  const size_t i = static_cast<size_t>(c);
  const uint64_t bytes = geometry().shard_bytes();
  switch (param_tier(c)) {
    case Tier::kDevice:
      return CopyDevice(device_shards_[i].data(), src, bytes, CopyKind::kHostToDevice);
    case Tier::kHost:
      if (src != host_shards_[i].data()) std::memcpy(host_shards_[i].data(), src, bytes);
      return Status::OK();
    case Tier::kNvme:
      if (reinterpret_cast<uintptr_t>(src) % kNvmeAlignment != 0) {
        return InvalidArgumentError("an NVMe shard is written from a 4 KiB-aligned buffer");
      }
      RETURN_IF_ERROR(nvme_->Write(nvme_shards_[i], src));
      nvme_write_bytes_.fetch_add(bytes, std::memory_order_relaxed);
      return Status::OK();
  }
  return Status::OK();
}

Status ShardStore::CopyParamBytes(int c, uint64_t offset, uint64_t len, void* host, bool to_shard) {
  RETURN_IF_ERROR(CheckChunk(c));
  const uint64_t bytes = geometry().shard_bytes();
  if (offset > bytes || len > bytes - offset) {
    return InvalidArgumentError("bytes [" + std::to_string(offset) + ", " +
                                std::to_string(offset + len) + ") of a " + std::to_string(bytes) +
                                "-byte shard");
  }
  const size_t i = static_cast<size_t>(c);
  auto copy = [&](void* shard) {
    auto* at = static_cast<uint8_t*>(shard) + offset;
    if (to_shard) {
      std::memcpy(at, host, len);
    } else {
      std::memcpy(host, at, len);
    }
  };
  switch (param_tier(c)) {
    case Tier::kDevice: {
      auto* at = static_cast<uint8_t*>(device_shards_[i].data()) + offset;
      return to_shard ? CopyDevice(at, host, len, CopyKind::kHostToDevice)
                      : CopyDevice(host, at, len, CopyKind::kDeviceToHost);
    }
    case Tier::kHost:
      copy(host_shards_[i].data());
      return Status::OK();
    case Tier::kNvme: {
      if (scratch_.data() == nullptr) {
        scratch_ = AlignedBuffer::Allocate(bytes);
        if (scratch_.data() == nullptr) return OutOfMemoryError("NVMe shard scratch buffer");
      }
      RETURN_IF_ERROR(nvme_->Read(nvme_shards_[i], scratch_.data()));
      nvme_read_bytes_.fetch_add(bytes, std::memory_order_relaxed);
      copy(scratch_.data());
      if (to_shard) {
        RETURN_IF_ERROR(nvme_->Write(nvme_shards_[i], scratch_.data()));
        nvme_write_bytes_.fetch_add(bytes, std::memory_order_relaxed);
      }
      return Status::OK();
    }
  }
  return Status::OK();
}

// Note [Clearing gradient shards on the host's cores]: with accumulation every fp32 gradient
// shard is cleared for the next window as its chunk's CPU Adam ends, inside the update phase. On
// one thread that memset ran at about 8 GB/s on the H100's host: 45 shards of 67 MB took about
// 370 ms of a 552 ms update phase at accumulation 4 (bench/RESULTS.md, gpu-speed session 30).
// Spans of 1 MiB over oneTBB's arena write at the memory's rate; zeros are zeros on any number of
// threads.
void ZeroHostParallel(void* p, uint64_t bytes) {
  constexpr uint64_t kSpan = uint64_t{1} << 20;
  auto* b = static_cast<uint8_t*>(p);
  if (bytes <= 4 * kSpan) {
    std::memset(b, 0, bytes);
    return;
  }
  tbb::parallel_for(uint64_t{0}, (bytes + kSpan - 1) / kSpan, [&](uint64_t i) {
    const uint64_t begin = i * kSpan;
    std::memset(b + begin, 0, std::min(bytes, begin + kSpan) - begin);
  });
}

Status ShardStore::ZeroGrads() {
  if (!options_.grads) return Status::OK();
  for (int c = 0; c < num_chunks(); ++c) {
    if (!grad_on_device(c)) {
      PinnedSlot& s = grad_shards_[static_cast<size_t>(c)];
      ZeroHostParallel(s.data(), s.bytes());
      continue;
    }
    RETURN_IF_ERROR(device_.MemsetAsync(grad(c), 0, grad_bytes(), stream_.handle()));
  }
  return device_grad_chunks_ > 0 ? stream_.Synchronize() : Status::OK();
}

Status ShardStore::ZeroGrad(int c) {
  if (!options_.grads) return Status::OK();
  if (grad_on_device(c)) {
    RETURN_IF_ERROR(device_.MemsetAsync(grad(c), 0, grad_bytes(), stream_.handle()));
    return stream_.Synchronize();
  }
  PinnedSlot& s = grad_shards_[static_cast<size_t>(c)];
  ZeroHostParallel(s.data(), s.bytes());
  return Status::OK();
}

Status ShardStore::ReadGradShard(int c, void* host) {
  if (!options_.grads) return FailedPreconditionError("a store without gradient shards");
  if (!grad_on_device(c)) {
    std::memcpy(host, grad(c), grad_bytes());
    return Status::OK();
  }
  return CopyDevice(host, grad(c), grad_bytes(), CopyKind::kDeviceToHost);
}

}  // namespace tierzero

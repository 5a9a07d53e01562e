#include "offload/swapper.h"

#include <chrono>
#include <string>
#include <vector>

#include "core/bytes.h"
#include "core/tunable.h"

namespace tierzero {

namespace {
TZ_TUNABLE_RANGE(double, kSwapSlotTimeoutSeconds, "TZ_SWAP_SLOT_TIMEOUT_S", 60.0,
                 "seconds to wait for a free pinned swap slot (optimizer states on NVMe) before "
                 "failing (0.001 to 1e6)",
                 1e-3, 1e6);
}  // namespace

std::chrono::milliseconds SwapSlotTimeout() { return TunableSeconds(kSwapSlotTimeoutSeconds); }

Status RunSwapPipeline(NvmeStore& store, std::span<const NvmeExtent> extents, PinnedArena& arena,
                       const std::function<Status(size_t, void*)>& compute,
                       const SwapOptions& options) {
  const size_t n = extents.size();
  if (n == 0) return Status::OK();
  if (options.buffers < 3) {
    return InvalidArgumentError("the swap pipeline needs at least 3 buffers, got " +
                                std::to_string(options.buffers));
  }
  for (const NvmeExtent& e : extents) {
    if (NvmeStore::RoundedBytes(e) > arena.slot_bytes()) {
      return InvalidArgumentError("extent of " + FormatBytes(e.bytes) +
                                  " does not fit a pinned slot of " +
                                  FormatBytes(arena.slot_bytes()));
    }
  }
  const size_t buffers = std::min<size_t>(static_cast<size_t>(options.buffers), n + 1);
  std::vector<PinnedSlot> slots;
  for (size_t b = 0; b < std::max<size_t>(buffers, 1); ++b) {
    ASSIGN_OR_RETURN(PinnedSlot slot, arena.Acquire(SwapSlotTimeout()));
    slots.push_back(std::move(slot));
  }
  const size_t nbuf = slots.size();
  // Block i lives in slot i % nbuf. Reads run `lookahead` blocks ahead; the slot a read needs was
  // last used by block i + lookahead - nbuf, whose write must be done first.
  const size_t lookahead = nbuf - 2;
  std::vector<NvmeStore::Ticket> reads(n), writes(n);
  auto submit_read = [&](size_t j) -> Status {
    if (j >= nbuf && writes[j - nbuf].valid()) {
      RETURN_IF_ERROR(writes[j - nbuf].Wait());
      writes[j - nbuf] = NvmeStore::Ticket();
    }
    ASSIGN_OR_RETURN(reads[j], store.SubmitRead(extents[j], slots[j % nbuf].data()));
    return Status::OK();
  };
  auto context = [](size_t i) { return "swap pipeline, block " + std::to_string(i); };
  for (size_t j = 0; j < std::min(lookahead, n); ++j) {
    RETURN_IF_ERROR(submit_read(j).WithContext(context(j)));
  }
  for (size_t i = 0; i < n; ++i) {
    if (i + lookahead < n)
      RETURN_IF_ERROR(submit_read(i + lookahead).WithContext(context(i + lookahead)));
    RETURN_IF_ERROR(reads[i].Wait().WithContext(context(i)));
    reads[i] = NvmeStore::Ticket();
    RETURN_IF_ERROR(compute(i, slots[i % nbuf].data()).WithContext(context(i)));
    if (options.write_back) {
      ASSIGN_OR_RETURN(writes[i], store.SubmitWrite(extents[i], slots[i % nbuf].data()));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (writes[i].valid()) RETURN_IF_ERROR(writes[i].Wait().WithContext(context(i)));
  }
  return Status::OK();
}

}  // namespace tierzero

// Tier placement of each chunk's shard state by the configured budgets (DESIGN.md section 4).
//
// Per chunk, a rank holds: the compute-dtype parameter shard (touched twice per step: gathered
// for forward and backward), its gradient shard, and the optimizer states (fp32 master, m, v:
// 12 bytes per element, touched once per step). Placement fills the device shard budget with
// parameter shards first (they are read most), keeps the rest in host memory, and when host
// memory runs out moves state to NVMe in this order: optimizer states first (from the last chunk
// backwards), then parameter shards. Up to `device_optimizer_groups` optimizer states go to the
// device shard budget that parameter shards leave, also from the last chunk backwards (those that
// would spill to NVMe first), and are updated there (docs/optimizer.md). Gradient shards stay in
// host memory, where CPU Adam reads them (for NVMe-resident optimizer states the swap pipeline
// streams master, m and v past them), except that a chunk whose parameters and states are both
// on the device may keep its gradient there too when `device_grads` says the reduce allows it
// (Note [Gradient shards on the device] in placement.cc); with accumulation as well, every
// chunk's fp32 accumulation shard takes the device shard budget after the parameter shards and
// before the optimizer states (Note [Accumulating on the device for host updates]).
//
// Thread-safety: pure function.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "chunk/layout.h"
#include "core/status.h"
#include "offload/tier.h"

namespace tierzero {

struct TierBudgets {
  uint64_t device_shard_bytes = 0;  // device memory for resident shards (not the chunk cache)
  uint64_t host_bytes = 0;          // host memory for shards, gradients and optimizer states
  uint64_t nvme_bytes = 0;          // NVMe space
  // The most optimizer states the device shard budget may hold after the parameter shards.
  int device_optimizer_groups = 0;
  // A gradient shard may live in device memory (Note [Gradient shards on the device] in
  // placement.cc): set where the reduce leaves the shard on the device.
  bool device_grads = false;
  // With device_grads and accumulation: the fp32 accumulation shards take the device shard
  // budget after the parameter shards, ahead of the optimizer states, whichever tier updates
  // their groups (Note [Accumulating on the device for host updates] in placement.cc).
  bool device_grads_accumulating = false;
  // False: no gradient shards at all (an engine that never steps: Note [An engine that never
  // steps] in src/engine/engine.cc); each chunk's grad tier is then kHost and takes 0 bytes.
  bool grad_shards = true;
  // Each state on NVMe takes whole blocks of this many bytes (the store's alignment: an int8
  // group of 1705984 bytes takes 1708032), counted so in nvme_bytes.
  uint64_t nvme_alignment = 1;
};

struct ChunkPlacement {
  Tier param = Tier::kHost;
  Tier optimizer = Tier::kHost;
  Tier grad = Tier::kHost;
};

struct Placement {
  std::vector<ChunkPlacement> chunks;
  uint64_t param_shard_bytes = 0;  // per chunk
  uint64_t grad_shard_bytes = 0;   // per chunk (0: none held, TierBudgets::grad_shards)
  uint64_t optim_shard_bytes = 0;  // per chunk (master + m + v)
  uint64_t bytes[3] = {0, 0, 0};   // per Tier, everything placed there
  // One line per tier: "host: 12 param shards, 30 optimizer states, 30 grads = 1.2 GiB of 2 GiB".
  std::string Summary(const TierBudgets& budgets) const;
};

// OutOfMemory when the state does not fit the three budgets together, naming what is needed,
// what each budget holds, and which budget to raise.
// `optimizer_group_bytes`: one chunk's optimizer states (0: fp32 master, m and v, 12 bytes an
// element); `grad_shard_bytes`: one gradient shard (0: the parameter shard's size; fp32 with
// gradient accumulation; none where budgets.grad_shards is false).
StatusOr<Placement> PlaceShards(const ChunkLayout& layout, const TierBudgets& budgets,
                                uint64_t optimizer_group_bytes = 0, uint64_t grad_shard_bytes = 0);

// For a placement that failed, the budgets with which it would fit, in the user's terms (the
// config's host_budget is `budgets.host_bytes` plus `host_fixed`, the fixed buffers): the host
// budget at the present NVMe budget, the NVMe budget at the present host budget, or where
// neither alone does, both. Each in whole MiB rounded up, as the flags take them, so a budget
// given as said fits. Empty when no budget up to everything in host memory would.
std::string PlacementFitAdvice(const ChunkLayout& layout, const TierBudgets& budgets,
                               uint64_t host_fixed, uint64_t optimizer_group_bytes = 0,
                               uint64_t grad_shard_bytes = 0);

}  // namespace tierzero

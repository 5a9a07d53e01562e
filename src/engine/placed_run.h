// What Finalize's placement decides (setup.cc), a pure function of the layout and the config that
// Engine::Plan runs too: the shards' tiers, the host memory the fixed buffers take beside them,
// and the optimizer groups' layout.
#pragma once

#include <cstdint>

#include "chunk/layout.h"
#include "chunk/placement.h"
#include "core/status.h"
#include "offload/tier.h"
#include "shard/optimizer_states.h"
#include "tierzero/engine.h"

namespace tierzero {

Status ValidateEngineConfig(const EngineConfig& config);

// What Finalize's placement decides (setup.cc): the shards' tiers, and the host memory the
// fixed buffers take beside them. Engine::Plan runs the same function.
struct PlacedRun {
  Placement placement;
  TierBudgets budgets;
  uint64_t staging_bytes = 0, swap_slot_bytes = 0;
  bool zeropp = false;  // W > 1 with a ZeRO++ option on
  uint64_t hpz_bytes = 0;
  Tier hpz_tier = Tier::kDevice;
};
// One optimizer group's layout for this run: the moments' format, and with 8-bit moments the
// scale blocks of the chunk with the most slices on any rank (Note [8-bit blocks per slice] in
// update/updater.cc).
GroupLayout OptimizerGroupLayout(const ChunkLayout& layout, MomentFormat format);

StatusOr<PlacedRun> PlaceRun(const ChunkLayout& layout, const EngineConfig& config, bool on_device,
                             int ranks_per_node);

}  // namespace tierzero

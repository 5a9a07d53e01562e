// Tier: where a shard's bytes live (DESIGN.md section 4). The placement chooses one per chunk
// and per kind of state (chunk/placement.h); the shard store keeps them there
// (shard/shard_store.h).
#pragma once

#include <cstdint>
#include <string_view>

namespace tierzero {

enum class Tier : uint8_t { kDevice, kHost, kNvme };
inline constexpr int kNumTiers = 3;

std::string_view TierName(Tier t);

}  // namespace tierzero

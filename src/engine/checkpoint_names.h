// Which states files the manifest committed in a checkpoint directory names
// (checkpoint_names.cc); IsCheckpointStatesFileName is public (tierzero/engine.h).
#pragma once

#include <optional>
#include <set>
#include <string>

namespace tierzero {

// The states files the manifest committed in `dir` names: none when there is no manifest;
// nullopt when it cannot be read or is damaged (what it names is unknown).
std::optional<std::set<std::string>> CommittedStatesFiles(const std::string& dir);

}  // namespace tierzero

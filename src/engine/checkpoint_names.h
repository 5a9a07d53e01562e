// Which states files the manifest committed in a checkpoint directory names, and committing a
// new one (checkpoint_names.cc); IsCheckpointStatesFileName is public (tierzero/engine.h).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>

#include "tierzero/files.h"
#include "tierzero/status.h"

namespace tierzero {

// The states files the manifest committed in `dir` names: none when there is no manifest;
// nullopt when it cannot be read or is damaged (what it names is unknown).
std::optional<std::set<std::string>> CommittedStatesFiles(const std::string& dir);

// Before a save writes anything: a manifest.json in `dir` is a regular file and tierzero's
// (`manifest_ours`: CommittedStatesFiles read it), and `states_name` is free or a regular file;
// FailedPrecondition naming the file otherwise (Note [A save writes only over its own files]).
Status CheckpointFilesAreOurs(const std::string& dir, const std::string& states_name,
                              bool manifest_ours);

// The most bytes a checkpoint's manifest.json may hold: what ReadManifest reads.
inline constexpr uint64_t kMaxManifestBytes = kMaxConfigBytes * 4;

// Writes `manifest` as dir/manifest.json with its own checksum (the commit point: Note [The
// manifest's own checksum], checkpoint.cc), then removes the states files it no longer names
// (earlier steps, ranks of an earlier world size): only regular files named as SaveCheckpoint
// names its own (a user's "states-notes.txt" in the directory stays). A manifest over
// kMaxManifestBytes is InvalidArgument, nothing written or removed: its load would refuse it.
Status CommitManifest(const std::string& dir, const nlohmann::json& manifest);

}  // namespace tierzero

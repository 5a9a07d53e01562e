// The names of a checkpoint's states files: which files are a checkpoint's, and which the
// manifest committed in a directory names (Note [A re-save never renames over its manifest's],
// checkpoint.cc).
#include "engine/checkpoint_names.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/file_io.h"
#include "tierzero/engine.h"

namespace tierzero {
using nlohmann::json;

// engine.h
bool IsCheckpointStatesFileName(const std::string& name) {
  size_t i = 0;
  auto digits = [&]() {
    const size_t from = i;
    while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
    return i > from;
  };
  auto literal = [&](const char* s) {
    const size_t n = std::strlen(s);
    if (name.compare(i, n, s) != 0) return false;
    i += n;
    return true;
  };
  if (!(literal("states-") && digits() && literal(".w") && digits() && literal(".rank") &&
        digits()))
    return false;
  // ".bin", or the alternate name's ".b.bin" (Note [A re-save never renames over its
  // manifest's]).
  return (literal(".bin") || literal(".b.bin")) && i == name.size();
}

// checkpoint_names.h
// Note [A save writes only over its own files]
// A checkpoint is regular files: a save wrote its manifest through a manifest.json that linked
// to a user's file, over another program's manifest.json, and into /dev/null (a save that said
// OK and could never load). Before anything is written, a manifest.json there must be a regular
// file that is a tierzero manifest, and the states file's name must be free or a regular file.
Status CheckpointFilesAreOurs(const std::string& dir, const std::string& states_name,
                              bool manifest_ours) {
  auto refuse = [&](const std::string& path, const std::string& what) {
    return FailedPreconditionError(path + " " + what +
                                   ": a checkpoint save writes only over files of its own; save "
                                   "into another directory, or move it away");
  };
  struct stat st {};
  const std::string manifest = dir + "/manifest.json";
  if (::lstat(manifest.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode))
      return refuse(manifest, "is not a regular file (a link, directory, FIFO or device)");
    if (!manifest_ours)
      return refuse(manifest,
                    "is not a tierzero checkpoint's manifest (another program's, or "
                    "damaged)");
  }
  const std::string states = dir + "/" + states_name;
  if (::lstat(states.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    return refuse(states, "is not a regular file (a link, directory, FIFO or device)");
  return Status::OK();
}

// checkpoint_names.h
std::optional<std::set<std::string>> CommittedStatesFiles(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) return std::set<std::string>{};
  auto text = ReadRegularFileBounded(path, kMaxConfigBytes * 4, "checkpoint manifest");
  if (!text.ok()) return std::nullopt;
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("files") || !j["files"].is_array()) return std::nullopt;
  if (!j.contains("format") || j["format"] != "tierzero-checkpoint") return std::nullopt;
  std::set<std::string> names;
  for (const json& f : j["files"])
    if (f.is_object() && f.contains("name") && f["name"].is_string())
      names.insert(f["name"].get<std::string>());
  return names;
}

}  // namespace tierzero

// The files of a checkpoint directory: which are a checkpoint's states files, which the manifest
// committed there names (Note [A re-save never renames over its manifest's], checkpoint.cc), and
// the commit of a new manifest, which removes the states files it no longer names.
#include "engine/checkpoint_names.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/file_io.h"
#include "core/status.h"
#include "offload/crc32c.h"
#include "tierzero/engine.h"

namespace tierzero {
namespace fs = std::filesystem;
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

// checkpoint_names.h
Status CommitManifest(const std::string& dir, const json& manifest) {
  // Note [The manifest's own checksum]
  json sealed = manifest;
  const std::string compact = manifest.dump();
  sealed["manifest_crc32c"] = Crc32c(compact.data(), compact.size());
  const std::string text = sealed.dump(1);
  // (A manifest its load refuses committed over a good one, whose states files went with it:
  // hunt 48, a 65 MiB user_state.)
  if (text.size() > kMaxManifestBytes) {
    const uint64_t user =
        manifest.contains("user_state") ? manifest["user_state"].dump().size() : 0;
    const size_t entries = manifest.contains("tensors") ? manifest["tensors"].size() : 0;
    // What takes the room: the trainer's user_state, or the tensor entries (one per tensor slice
    // and rank: hunt 48's review, 340,000 tensors on one rank).
    const std::string why =
        user * 2 > text.size()
            ? "its user_state is " + std::to_string(user) +
                  " bytes: keep a large state in a file of your own beside the checkpoint and a "
                  "small user_state"
            : "its " + std::to_string(entries) +
                  " tensor entries (one per tensor slice and rank) take most of it: register "
                  "fewer, larger tensors, or save from fewer ranks";
    return InvalidArgumentError("the checkpoint's manifest would be " +
                                std::to_string(text.size()) + " bytes, over the " +
                                std::to_string(kMaxManifestBytes) + " a load reads; " + why +
                                ". Nothing was saved (the previous checkpoint, if any, is intact)");
  }
  ASSIGN_OR_RETURN(AtomicFile mf, AtomicFile::Create(dir + "/manifest.json"));
  RETURN_IF_ERROR(mf.Write(text.data(), text.size()));
  RETURN_IF_ERROR(mf.Commit());
  RETURN_IF_ERROR(SyncDir(dir));
  std::set<std::string> named;
  for (const json& f : manifest["files"]) named.insert(f.value("name", ""));
  std::error_code ec;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (IsCheckpointStatesFileName(name) && named.count(name) == 0 &&
        fs::is_regular_file(fs::symlink_status(it->path(), ec)))
      stale.push_back(it->path());
  }
  for (const fs::path& p : stale) fs::remove(p, ec);
  return Status::OK();
}

}  // namespace tierzero

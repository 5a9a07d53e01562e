// Ranks agree on the run's configuration before they compute (train.h, AgreeOnRunConfig).
//
// Note [Ranks agree before they compute]
// mpirun's ':' syntax (and a copy of a config edited on one node) can start ranks with different
// configurations. A different width or layer count made the first gather's sizes differ and Open
// MPI ended the job with MPI_ERR_TRUNCATE and no error line; a different lr or batch ran to exit 0
// with diverging losses; different run directories left a checkpoint no rank could export. So the
// first collective of a run compares a hash of each rank's whole resolved config (every field,
// output paths included, but the two a node may set for itself: engine.nvme_path, a node's own
// disk, and engine.cpu_threads, its cores); only when they differ are the texts exchanged, so the
// error can name the fields. Every rank learns the same outcome and fails together: no rank is
// left waiting.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "train.h"

namespace tierzero::app {
using nlohmann::json;

namespace {

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

// A value as a person writes it (a float field holds a float: 0.01, not 0.009999999776482582).
std::string Shown(const json& v) {
  if (!v.is_number_float()) return v.dump();
  char b[32];
  std::snprintf(b, sizeof b, "%.7g", v.get<double>());
  return b;
}

// Fields a node may set for itself: where its NVMe swap goes, how many cores its CPU Adam uses.
bool NodeLocal(const std::string& section, const std::string& key) {
  return section == "engine" && (key == "nvme_path" || key == "cpu_threads");
}

// The config with the node-local fields left out: what every rank must agree on.
std::string Agreed(const RunConfig& cfg) {
  RunConfig c = cfg;
  c.engine.nvme_path.clear();
  c.engine.cpu_threads = 0;
  return RunConfigToJson(c);
}

// "section.field is X (rank 0: Y)" for each field where `other` differs from `base` (at most 4).
std::string Differences(const json& base, const json& other) {
  std::string out;
  int n = 0;
  for (const auto& [section, fields] : other.items()) {
    for (const auto& [key, value] : fields.items()) {
      if (NodeLocal(section, key)) continue;
      const json* then = nullptr;
      if (base.contains(section) && base[section].contains(key)) then = &base[section][key];
      if (then != nullptr && *then == value) continue;
      if (++n > 4) return out + ", ...";
      out += (out.empty() ? "" : ", ") + section + "." + key + " is " + Shown(value) +
             " (rank 0: " + (then ? Shown(*then) : "absent") + ")";
    }
  }
  return out;
}

}  // namespace

Status AgreeOnRunConfig(Communicator& comm, const RunConfig& cfg) {
  if (comm.size() <= 1) return Status::OK();
  const std::string mine = Agreed(cfg);
  struct Summary {
    uint64_t hash;
    uint64_t bytes;
  };
  TZ_ASSIGN_OR_RETURN(const std::vector<Summary> all,
                      AllGatherValue(comm, Summary{Fnv1a(mine), mine.size()}));
  const bool same =
      std::all_of(all.begin(), all.end(), [&](const Summary& s) { return s.hash == all[0].hash; });
  if (same) return Status::OK();
  // Every rank's text, padded to the longest, so each rank can name the differences.
  uint64_t longest = 0;
  for (const Summary& s : all) longest = std::max(longest, s.bytes);
  if (longest > (uint64_t{64} << 20))
    return InvalidArgumentError("the ranks were started with different configurations");
  std::string padded = mine;
  padded.resize(longest, ' ');
  TZ_ASSIGN_OR_RETURN(const std::vector<uint8_t> texts,
                      AllGatherBytes(comm, padded.data(), padded.size()));
  auto text_of = [&](size_t r) {
    return json::parse(texts.begin() + static_cast<std::ptrdiff_t>(r * longest),
                       texts.begin() + static_cast<std::ptrdiff_t>(r * longest + all[r].bytes),
                       nullptr, /*allow_exceptions=*/false);
  };
  std::string diffs;
  try {  // (texts this build wrote: objects of objects; nothing may throw out of here anyway)
    const json base = text_of(0);
    for (size_t r = 1; r < all.size(); ++r) {
      if (all[r].hash == all[0].hash) continue;
      diffs += (diffs.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": ") +
               Differences(base, text_of(r));
    }
  } catch (const json::exception&) {
    diffs = "the configs could not be compared field by field";
  }
  return InvalidArgumentError(
      "the ranks were started with different configurations (" + diffs +
      "): every rank must run the same config and flags (mpirun's ':' syntax, or a config file "
      "that differs between nodes, gave them different ones)");
}

}  // namespace tierzero::app

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
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "gpt/hf.h"
#include "train.h"

namespace tierzero::app {
using nlohmann::json;

namespace {

constexpr uint64_t kFnvBasis = 1469598103934665603ull;

// Folds `n` bytes into the FNV-1a hash `h`.
void MixFnv(uint64_t& h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = kFnvBasis;
  MixFnv(h, s.data(), s.size());
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

// Note [Ranks agree on the weights they start from]
// The config holds --init-from as a path, and each rank reads its own slices of the files: two
// machines holding different models under one name (a local copy per node) trained a model
// stitched from both and exited 0 (hunt 40). So before the configs are compared, each rank says
// whether it can read the path at all (a directory missing on one rank kept that rank on the
// built-in model, and the configs' difference was all it heard of it), and after they agree,
// the ranks compare a fingerprint of what the path holds, as they do for their data
// (Dataset::Fingerprint): each file's size, its first and last 64 KiB and eight blocks between
// (a safetensors header, its first and last tensors, and samples of the rest: two trainings or
// initialisations differ in all of them; two files equal there and different elsewhere pass).
namespace {

// Folds the sampled bytes of `path` into `h` (FNV-1a).
Status MixFileSamples(const std::string& path, uint64_t& h) {
  auto mix = [&h](const void* data, size_t n) { MixFnv(h, data, n); };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open " + path, errno, StatusCode::kNotFound);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgumentError(path + " is not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  mix(&size, sizeof size);
  constexpr uint64_t kBlock = uint64_t{64} << 10;
  std::vector<uint8_t> buf(kBlock);
  const uint64_t last = size > kBlock ? size - kBlock : 0;
  for (int i = 0; i <= 9; ++i) {
    const uint64_t at = last / 9 * static_cast<uint64_t>(i);
    const size_t want = static_cast<size_t>(std::min(kBlock, size - std::min(size, at)));
    const ssize_t got = ::pread(fd, buf.data(), want, static_cast<off_t>(at));
    if (got < 0) {
      const int e = errno;
      ::close(fd);
      return ErrnoError("cannot read " + path, e);
    }
    mix(buf.data(), static_cast<size_t>(got));
  }
  ::close(fd);
  return Status::OK();
}

// The fingerprint of what --init-from names (0 when nothing), or why this rank cannot read it.
StatusOr<uint64_t> InitFromFingerprint(const RunConfig& cfg) {
  const std::string& path = cfg.output.init_from;
  if (path.empty()) return uint64_t{0};
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    return Status(e == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError,
                  "--init-from " + path + " cannot be read: " + std::strerror(e) +
                      " (give a safetensors file or a Hugging Face model directory; with several "
                      "ranks, every rank reads it at that path)");
  }
  uint64_t h = kFnvBasis;
  if (!S_ISDIR(st.st_mode)) {
    TZ_RETURN_IF_ERROR(MixFileSamples(path, h));
    return h;
  }
  // A model directory: config.json and its safetensors files (the index's, or model.safetensors).
  TZ_ASSIGN_OR_RETURN(const gpt::HfModel hf, gpt::ReadHfDir(path, cfg.model));
  std::vector<std::string> files = hf.files;
  files.push_back(path + "/config.json");
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) TZ_RETURN_IF_ERROR(MixFileSamples(f, h));
  return h;
}

}  // namespace

Status AgreeOnRunConfig(Communicator& comm, const RunConfig& cfg) {
  if (comm.size() <= 1) {
    // One rank: only whether the path is there, before a model is built (a missing one was
    // found only where the weights load, after the built-in model's set-up had failed on it).
    struct stat st {};
    if (cfg.output.init_from.empty() || ::stat(cfg.output.init_from.c_str(), &st) == 0)
      return Status::OK();
    return InitFromFingerprint(cfg).status();
  }
  const StatusOr<uint64_t> weights = InitFromFingerprint(cfg);
  TZ_RETURN_IF_ERROR(AgreeOnStatus(comm, weights.status()));
  const std::string mine = Agreed(cfg);
  struct Summary {
    uint64_t hash;
    uint64_t bytes;
  };
  TZ_ASSIGN_OR_RETURN(const std::vector<Summary> all,
                      AllGatherValue(comm, Summary{Fnv1a(mine), mine.size()}));
  const bool same =
      std::all_of(all.begin(), all.end(), [&](const Summary& s) { return s.hash == all[0].hash; });
  if (same) {
    TZ_ASSIGN_OR_RETURN(const std::vector<uint64_t> prints, AllGatherValue(comm, *weights));
    for (size_t r = 1; r < prints.size(); ++r) {
      if (prints[r] != prints[0])
        return FailedPreconditionError(
            "the ranks start from different weights: rank " + std::to_string(r) +
            "'s --init-from " + cfg.output.init_from +
            " is not rank 0's (the same path names different files on the ranks' machines?): "
            "give every rank the same model files (nothing was trained)");
    }
    return Status::OK();
  }
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

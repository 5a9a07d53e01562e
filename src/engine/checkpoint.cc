// Checkpoints of the engine (engine.h); safetensors in safetensors.cc, the report in report.cc,
// the atomic file writing they use in core/file_io.h.
//
// Note [Checkpoint format]
// A checkpoint is a directory:
//   states-<step>.w<W>.rank<r>.bin  rank r's slices of the parameters (all of each with one rank):
//                               per slice the fp32 master (numel), then m and v in the run's
//                               optimizer_states format: fp32 or bf16 (numel each), or 8-bit
//                               codes (numel each) then m's and v's block scales
//                               (ceil(numel / 64) fp32 each, blocks from the slice's start),
//                               in registration order
//   manifest.json               format, version, step, loss scale, world size, optimizer_states
//                               (the moments' format; absent: fp32), per file its
//                               bytes and CRC32C, per slice its parameter's name and shape, the
//                               file, offset, first element (begin) and numel, and the CRC32C of
//                               its three arrays, and the trainer's user_state; and
//                               manifest_crc32c (Note [The manifest's own checksum])
// Files are written under a temporary name, fsynced and renamed; the manifest is written the same
// way last (by rank 0, once every rank has committed its file), so it is the commit point: a
// crash before its rename leaves the previous checkpoint (its manifest and the states it names)
// intact. States files no longer named are removed after. Parameters are stored per tensor
// slice, not per chunk, so a checkpoint loads into any chunk size and any number of ranks: a
// rank reads, from whichever files hold them, the slices that overlap its own (resharding).
// Version 1 (one rank, whole tensors, no "begin") still loads; version 3 is version 2 with
// compressed moments (fp32 moments are still written as version 2, which older builds read). A
// load decodes the saved moments and encodes them in the run's format: the same format and
// slicing give the same bits back, another format or slicing converts (rounded to nearest).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "comm/collective.h"
#include "core/bytes.h"
#include "core/convert.h"
#include "core/file_io.h"
#include "core/json_in.h"
#include "core/logging.h"
#include "engine/checkpoint_names.h"
#include "engine/engine_impl.h"
#include "offload/crc32c.h"

namespace tierzero {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kCheckpointVersion = 3;  // 2 when the moments are fp32

// One saved slice of a parameter (Note [Checkpoint format]).
struct SavedSlice {
  std::vector<int64_t> shape;
  std::string file;
  uint64_t offset = 0, begin = 0, numel = 0;
  uint32_t crc = 0;
};

// A manifest, every field read and checked (Note [Reading outside JSON]) before anything loads.
struct Manifest {
  int64_t step = 0;
  float loss_scale = 1.0f;
  int good_steps = 0;
  int world_size = 1;         // ranks that wrote it
  std::string compute_dtype;  // the saving run's ("" in manifests from before it was written)
  std::vector<std::pair<std::string, uint64_t>> files;  // states files and their sizes
  std::string optimizer_states;                         // the saving run's moment format
  StateFormat moments = StateFormat::kF32;
  std::string user_state;                                  // JSON text; empty when none was saved
  std::map<std::string, std::vector<SavedSlice>> tensors;  // SavedTensors
  uint32_t text_crc = 0;  // of the manifest's JSON: which save this is (its slices' CRCs in it)
};

StatusOr<Manifest> ParseManifest(const std::string& text, const std::string& path) {
  ASSIGN_OR_RETURN(const json j, ParseOutsideJson(text, path, StatusCode::kDataLoss));
  const JsonIn in(j, path, StatusCode::kDataLoss);
  if (!j.is_object())
    return DataLossError(path + " is not a tierzero checkpoint manifest (not a JSON object)");
  RETURN_IF_ERROR(in.CheckDepth(kMaxJsonDepth));
  const StatusOr<std::string> format = in.get_or<std::string>("format", "");
  if (!format.ok() || *format != "tierzero-checkpoint")
    return DataLossError(path + " is not a tierzero checkpoint manifest");
  ASSIGN_OR_RETURN(const int64_t version, in.get<int64_t>("version"));
  if (version < 1 || version > kCheckpointVersion)
    return UnsupportedError(path + " has version " + std::to_string(version) +
                            "; this build reads versions 1 to " +
                            std::to_string(kCheckpointVersion));
  // Note [The manifest's own checksum]
  // The slices' CRCs protect the states files' bytes, but not the manifest that says what they
  // are: a step, a loss scale, a tensor's name or a user state edited by hand (or damaged) loaded
  // silently and trained another run than the one saved. The manifest carries the CRC32C of its
  // compact JSON without that field (nlohmann's dump is canonical: sorted keys, shortest
  // round-trip numbers, so parsing and dumping again gives the same text); a manifest whose text
  // no longer matches is refused. Manifests written before it had the field load unchecked.
  if (j.contains("manifest_crc32c")) {
    const json& stored = j["manifest_crc32c"];
    json rest = j;
    rest.erase("manifest_crc32c");
    const std::string text_without = rest.dump();
    if (!stored.is_number_unsigned() ||
        stored.get<uint64_t>() != Crc32c(text_without.data(), text_without.size()))
      return DataLossError(
          path +
          " was changed after tierzero wrote it (its checksum does not match its content: edited "
          "by hand, or damaged); restore the checkpoint from a copy, or resume from another one");
  }
  Manifest m;
  const std::string json_text = j.dump();  // (whitespace aside: a copy an editor touched)
  m.text_crc = Crc32c(json_text.data(), json_text.size());
  ASSIGN_OR_RETURN(m.step, in.get_or<int64_t>("step", 0));
  ASSIGN_OR_RETURN(m.loss_scale, in.get_or<float>("loss_scale", 1.0f));
  if (!(m.loss_scale > 0)) return in.Error("has a loss scale that is not positive");
  ASSIGN_OR_RETURN(m.good_steps, in.get_or<int>("good_steps", 0));
  if (m.step < 0 || m.good_steps < 0 || m.step > std::numeric_limits<int32_t>::max())
    return in.Error("has a step count out of range: " + std::to_string(m.step));
  ASSIGN_OR_RETURN(m.world_size, in.get_or<int>("world_size", 1));
  ASSIGN_OR_RETURN(m.optimizer_states, in.get_or<std::string>("optimizer_states", "fp32"));
  if (m.optimizer_states == "fp32") {
    m.moments = StateFormat::kF32;
  } else if (m.optimizer_states == "bf16") {
    m.moments = StateFormat::kBF16;
  } else if (m.optimizer_states == "int8") {
    m.moments = StateFormat::kInt8;
  } else {
    return in.Error("has optimizer_states " + JsonIn::Shown(m.optimizer_states) +
                    "; this build reads fp32, bf16 and int8");
  }
  if (m.world_size < 1)
    return in.Error("has a world size below 1: " + std::to_string(m.world_size));
  ASSIGN_OR_RETURN(m.compute_dtype, in.get_or<std::string>("compute_dtype", ""));
  if (in.has("files")) {
    ASSIGN_OR_RETURN(const std::vector<JsonIn> files, in.elements("files"));
    for (const JsonIn& f : files) {
      ASSIGN_OR_RETURN(const std::string name, f.get<std::string>("name"));
      ASSIGN_OR_RETURN(const uint64_t bytes, f.get<uint64_t>("bytes"));
      if (name.empty() || name.find_first_of(std::string("/\0", 2)) != std::string::npos ||
          name == "." || name == "..")
        return f.Error("names a file outside the checkpoint: " + JsonIn::Shown(name));
      m.files.emplace_back(name, bytes);
    }
  }
  if (in.has("user_state") && !in.at("user_state")->raw().is_null())
    m.user_state = in.at("user_state")->raw().dump();
  ASSIGN_OR_RETURN(const std::vector<JsonIn> tensors, in.elements("tensors"));
  for (const JsonIn& t : tensors) {
    SavedSlice s;
    ASSIGN_OR_RETURN(const std::string name, t.get<std::string>("name"));
    ASSIGN_OR_RETURN(const std::vector<JsonIn> dims, t.elements("shape"));
    for (const JsonIn& d : dims) {
      ASSIGN_OR_RETURN(const int64_t n, d.as<int64_t>());
      s.shape.push_back(n);
    }
    ASSIGN_OR_RETURN(s.file, t.get<std::string>("file"));
    // A file of this directory: never a path that leaves it.
    if (s.file.empty() || s.file.find_first_of(std::string("/\0", 2)) != std::string::npos ||
        s.file == "." || s.file == "..")
      return t.Error("names a file outside the checkpoint: " + JsonIn::Shown(s.file));
    ASSIGN_OR_RETURN(s.offset, t.get<uint64_t>("offset"));
    ASSIGN_OR_RETURN(s.begin, t.get_or<uint64_t>("begin", 0));
    ASSIGN_OR_RETURN(s.numel, t.get<uint64_t>("numel"));
    ASSIGN_OR_RETURN(s.crc, t.get<uint32_t>("crc32c"));
    // Sizes that cannot overflow below: a slice's three arrays fit in a file.
    constexpr uint64_t kMost = uint64_t{1} << 60;
    if (s.numel > kMost / 12 || s.begin > kMost || s.offset > kMost)
      return t.Error("has an offset or size out of range");
    m.tensors[name].push_back(std::move(s));
  }
  return m;
}

StatusOr<Manifest> ReadManifest(const std::string& dir) {
  auto text =
      ReadRegularFileBounded(dir + "/manifest.json", kMaxManifestBytes, "checkpoint manifest");
  if (!text.ok()) {
    // A file named for the checkpoint (its manifest.json, a states file): the directory is meant.
    struct stat named {};
    if (::stat(dir.c_str(), &named) == 0 && !S_ISDIR(named.st_mode)) {
      const std::string parent = fs::path(dir).parent_path().string();
      return InvalidArgumentError("'" + dir + "' is " + FileKindName(named.st_mode) +
                                  ", not a checkpoint: a checkpoint is the directory holding "
                                  "manifest.json" +
                                  (parent.empty() ? "" : " ('" + parent + "'?)"));
    }
    if (text.status().code() != StatusCode::kNotFound) return text.status();
    // A run directory named for its checkpoint (`--resume runs/x` for `runs/x/checkpoint`).
    struct stat st {};
    if (::stat((dir + "/checkpoint/manifest.json").c_str(), &st) == 0 && S_ISREG(st.st_mode))
      return NotFoundError("no checkpoint in '" + dir + "', which is a run directory: its " +
                           "checkpoint is '" + dir + "/checkpoint'");
    struct stat dst {};
    if (::lstat(dir.c_str(), &dst) != 0 && errno == ENOENT)
      return NotFoundError("no checkpoint at '" + dir + "': there is no such directory");
    if (S_ISLNK(dst.st_mode) && ::stat(dir.c_str(), &st) != 0)
      return NotFoundError("no checkpoint at '" + dir +
                           "': it is a symbolic link to nothing (a dangling link)");
    return NotFoundError("no checkpoint in '" + dir +
                         "' (manifest.json missing: the directory is not a checkpoint, or its "
                         "first save did not finish)");
  }
  return ParseManifest(*text, dir + "/manifest.json");
}

// Every rank's text, rank by rank (two all_gathers: the lengths, then the padded texts).
StatusOr<std::vector<std::string>> AllGatherText(Communicator& comm, const std::string& text) {
  ASSIGN_OR_RETURN(std::vector<uint64_t> lengths,
                   AllGatherValue(comm, static_cast<uint64_t>(text.size())));
  const uint64_t most = *std::max_element(lengths.begin(), lengths.end());
  std::string padded = text;
  padded.resize(most);
  ASSIGN_OR_RETURN(std::vector<uint8_t> raw, AllGatherBytes(comm, padded.data(), most));
  std::vector<std::string> out;
  for (size_t r = 0; r < lengths.size(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(raw.data()) + r * most, lengths[r]);
  return out;
}

using SavedTensors = std::map<std::string, std::vector<SavedSlice>>;

// Writes this rank's slices of one chunk (the fp32 master, the moments as the group holds them:
// `moments(s)` is slice s's) to the states file, and their manifest entries to `tensors`.
Status WriteChunkSlices(AtomicFile& file, const std::string& states_name,
                        const std::vector<ShardSlice>& slices, const std::vector<ParamSpec>& params,
                        const float* master, const std::function<AdamBuffers(size_t)>& moments,
                        json& tensors, uint32_t& file_crc) {
  for (size_t s = 0; s < slices.size(); ++s) {
    const ShardSlice& sl = slices[s];
    const uint64_t offset = file.bytes();
    uint32_t crc = 0;
    auto put = [&](const void* p, uint64_t bytes) -> Status {
      RETURN_IF_ERROR(file.Write(p, bytes));
      crc = Crc32c(p, bytes, crc);
      file_crc = Crc32c(p, bytes, file_crc);
      return Status::OK();
    };
    RETURN_IF_ERROR(put(master + sl.shard_offset, sl.numel * 4));
    const AdamBuffers b = moments(s);
    if (b.states == StateFormat::kF32) {
      RETURN_IF_ERROR(put(b.m, sl.numel * 4));
      RETURN_IF_ERROR(put(b.v, sl.numel * 4));
    } else {
      const uint64_t w = MomentWidth(b.states);
      RETURN_IF_ERROR(put(b.m_state, sl.numel * w));
      RETURN_IF_ERROR(put(b.v_state, sl.numel * w));
      if (b.states == StateFormat::kInt8) {
        RETURN_IF_ERROR(put(b.m_scale, StateScaleCount(sl.numel) * 4));
        RETURN_IF_ERROR(put(b.v_scale, StateScaleCount(sl.numel) * 4));
      }
    }
    const ParamSpec& ps = params[static_cast<size_t>(sl.tensor)];
    tensors.push_back({{"name", ps.name},
                       {"shape", ps.shape},
                       {"file", states_name},
                       {"offset", offset},
                       {"begin", sl.tensor_begin},
                       {"numel", sl.numel},
                       {"crc32c", crc}});
  }
  return Status::OK();
}

// Every rank's file and tensor entries, in rank order (collective).
Status GatherEntries(Communicator& comm, json& files, json& tensors) {
  const std::string mine = json{{"files", files}, {"tensors", tensors}}.dump();
  ASSIGN_OR_RETURN(std::vector<std::string> parts, AllGatherText(comm, mine));
  files = json::array();
  tensors = json::array();
  for (const std::string& part : parts) {
    json j = json::parse(part, nullptr, false);
    if (j.is_discarded()) return InternalError("a rank's checkpoint entries are not JSON");
    for (json& f : j["files"]) files.push_back(std::move(f));
    for (json& t : j["tensors"]) tensors.push_back(std::move(t));
  }
  return Status::OK();
}

// "3 with another shape: a, b, c" (at most six names).
std::string NameList(const char* what, const std::vector<std::string>& names) {
  std::string s = std::to_string(names.size()) + " " + what;
  for (size_t i = 0; i < names.size() && i < 6; ++i) s += (i == 0 ? ": " : ", ") + names[i];
  if (names.size() > 6) s += ", ...";
  return s;
}

// True when the saved slices tile a tensor of `numel` elements exactly: in order of their first
// element, each starts where the one before ended, and the last ends at the tensor's end.
bool TilesExactly(const std::vector<SavedSlice>& slices, uint64_t numel) {
  std::vector<const SavedSlice*> tiles;
  for (const SavedSlice& e : slices) tiles.push_back(&e);
  std::sort(tiles.begin(), tiles.end(),
            [](const SavedSlice* a, const SavedSlice* b) { return a->begin < b->begin; });
  uint64_t covered = 0;
  for (const SavedSlice* e : tiles) {
    if (e->begin != covered || e->numel > numel - covered) return false;
    covered += e->numel;
  }
  return covered == numel;
}

// Compares the saved tensors with the registered parameters: every difference (missing, extra,
// another shape) is listed at once, so a checkpoint of another model is never loaded in part.
Status CheckSameModel(const std::string& dir, const SavedTensors& saved,
                      const std::vector<ParamSpec>& params, const std::vector<int64_t>& numel) {
  std::vector<std::string> missing, extra, reshaped;
  std::set<std::string> registered;
  for (size_t p = 0; p < params.size(); ++p) {
    const ParamSpec& ps = params[p];
    registered.insert(ps.name);
    auto it = saved.find(ps.name);
    if (it == saved.end()) {
      missing.push_back(ps.name);
      continue;
    }
    const auto other = std::find_if(it->second.begin(), it->second.end(),
                                    [&](const SavedSlice& e) { return e.shape != ps.shape; });
    if (other != it->second.end()) {
      reshaped.push_back(ps.name + " (checkpoint " + json(other->shape).dump() + ", model " +
                         json(ps.shape).dump() + ")");
      continue;
    }
    if (!TilesExactly(it->second, static_cast<uint64_t>(numel[p])))
      return DataLossError("checkpoint " + dir + ": the saved slices of '" + ps.name +
                           "' do not cover its " + std::to_string(numel[p]) +
                           " elements exactly once (the manifest is damaged)");
  }
  for (const auto& [name, slices] : saved)
    if (registered.count(name) == 0) extra.push_back(name);
  if (missing.empty() && extra.empty() && reshaped.empty()) return Status::OK();
  return InvalidArgumentError(
      "checkpoint " + dir +
      " is of another model: " + NameList("tensors of the model missing from it", missing) + "; " +
      NameList("tensors in it the model lacks", extra) + "; " +
      NameList("with another shape", reshaped) +
      " (load it into the model it was saved from; a tierzero run's config.json records that "
      "model)");
}

// A checkpoint's states files, each opened once, and a buffer for one saved slice.
class StatesReader {
 public:
  StatesReader(std::string dir, StateFormat moments) : dir_(std::move(dir)), moments_(moments) {}

  // Reads and verifies the saved slices that overlap this rank's `slices` of one chunk
  // (resharding); with `apply`, copies their overlap into the chunk's master, m and v.
  Status ChunkSlices(const std::vector<ShardSlice>& slices, const std::vector<ParamSpec>& params,
                     const SavedTensors& saved, bool apply, float* master, float* m, float* v) {
    for (const ShardSlice& sl : slices) {
      const auto found = saved.find(params[static_cast<size_t>(sl.tensor)].name);
      if (found == saved.end()) continue;  // CheckSameModel ruled it out
      for (const SavedSlice& e : found->second) {
        const uint64_t lo = std::max(e.begin, sl.tensor_begin);
        const uint64_t hi = std::min(e.begin + e.numel, sl.tensor_begin + sl.numel);
        if (lo >= hi) continue;
        RETURN_IF_ERROR(Read(e, found->first));
        if (!apply) continue;
        const uint64_t dst = sl.shard_offset + (lo - sl.tensor_begin);
        const uint64_t src = lo - e.begin;
        const uint64_t len = (hi - lo) * 4;
        std::memcpy(master + dst, master_.data() + src, len);
        std::memcpy(m + dst, m_.data() + src, len);
        std::memcpy(v + dst, v_.data() + src, len);
      }
    }
    return Status::OK();
  }

 private:
  // One saved slice's master and moments (decoded to fp32) into master_, m_ and v_, its checksum
  // verified first.
  Status Read(const SavedSlice& e, const std::string& tensor) {
    auto& f = files_[e.file];
    if (!f) f = std::make_unique<ReadFd>(dir_ + "/" + e.file);
    if (f->get() < 0) {
      if (f->status().code() != StatusCode::kNotFound) return f->status();
      return NotFoundError("checkpoint file " + dir_ + "/" + e.file + " is missing");
    }
    const uint64_t n = e.numel;
    buf_.resize(4 * n + 2 * MomentBytes(moments_, n));
    RETURN_IF_ERROR(ReadAt(f->get(), dir_ + "/" + e.file, e.offset, buf_.data(), buf_.size()));
    if (Crc32c(buf_.data(), buf_.size()) != e.crc) {
      return DataLossError("checkpoint " + dir_ + ": checksum mismatch in parameter '" + tensor +
                           "' in " + e.file + " (the file is corrupt)");
    }
    master_.resize(n);
    m_.resize(n);
    v_.resize(n);
    std::memcpy(master_.data(), buf_.data(), 4 * n);
    const uint8_t* at = buf_.data() + 4 * n;
    AdamBuffers b;
    b.n = n;
    b.states = moments_;
    if (moments_ == StateFormat::kF32) {
      std::memcpy(m_.data(), at, 4 * n);
      std::memcpy(v_.data(), at + 4 * n, 4 * n);
      return Status::OK();
    }
    const uint64_t w = MomentWidth(moments_);
    // Copied out: the file's layout aligns nothing.
    codes_.assign(at, at + 2 * w * n);
    b.m_state = codes_.data();
    b.v_state = codes_.data() + w * n;
    if (moments_ == StateFormat::kInt8) {
      const uint64_t k = StateScaleCount(n);
      scales_.resize(2 * k);
      std::memcpy(scales_.data(), at + 2 * w * n, 8 * k);
      b.m_scale = scales_.data();
      b.v_scale = scales_.data() + k;
    }
    DecodeMoments(b, m_.data(), v_.data());
    return Status::OK();
  }

  std::string dir_;
  StateFormat moments_;
  std::map<std::string, std::unique_ptr<ReadFd>> files_;
  std::vector<uint8_t> buf_, codes_;
  std::vector<float> master_, m_, v_, scales_;
};

}  // namespace

StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& dir) {
  ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir));
  return CheckpointInfo{.step = m.step, .world_size = m.world_size, .user_state = m.user_state};
}

Status Engine::SaveCheckpoint(const std::string& dir, const std::string& user_state) const {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("SaveCheckpoint before Finalize");
  RETURN_IF_ERROR(RefuseWithoutMoments("SaveCheckpoint"));
  if (im.in_iteration) return FailedPreconditionError("SaveCheckpoint inside an iteration");
  // Never a half-updated model (Note [The update phase behind the next forward]). A rank whose
  // update failed (its NVMe), or whose model is out of step, says so to the others, which would
  // wait for it in the save's agreement below otherwise (Note [Agreeing on an outcome]).
  Status ready = im.cm->out_of_step();
  if (ready.ok()) ready = im.updater->Await();
  // A checkpoint holds the states as of the last Step, not the gradients of training iterations
  // since: one saved mid-window dropped its micro-batches, and its resume could not Step (hunt
  // 48). (After the checks above: a failed Step leaves its iterations counted, and its cause is
  // what to say.)
  if (ready.ok() && im.iterations_since_step > 0)
    ready = FailedPreconditionError(
        "SaveCheckpoint after " + std::to_string(im.iterations_since_step) +
        (im.iterations_since_step == 1 ? " training iteration" : " training iterations") +
        " without Step (grad_accumulation " + std::to_string(im.cfg.grad_accumulation) +
        "): their gradients would be lost, since a checkpoint holds the states as of a Step; "
        "save after Step");
  RETURN_IF_ERROR(AgreeOnStatus(*im.comm, ready));
  json user;
  const int rank = im.comm->rank();
  // The world size is in the name: a re-save of the same step on another number of ranks never
  // overwrites a file the committed manifest names.
  // Note [A re-save never renames over its manifest's]
  // Nor does a re-save of the same step on as many ranks: a run resumed from a checkpoint that
  // saves into it again before it trains a step (a copy into another run directory whose
  // --checkpoint is the one it resumed, maybe with other optimizer states) renamed its new
  // states file over the one the committed manifest names, before its own manifest was
  // committed: a failure or a kill between the two left the only checkpoint damaged. Such a save
  // takes the alternate name, "....rank<r>.b.bin", which that manifest does not name (one name
  // per rank and step in a manifest: one of the two is always free); a later save's clean-up
  // removes whichever the new manifest does not name.
  const std::string base_name = "states-" + std::to_string(im.step) + ".w" +
                                std::to_string(im.world()) + ".rank" + std::to_string(rank);
  const std::optional<std::set<std::string>> committed_names = CommittedStatesFiles(dir);
  const std::string states_name = committed_names && committed_names->count(base_name + ".bin") != 0
                                      ? base_name + ".b.bin"
                                      : base_name + ".bin";
  // This rank's slices in registration order; states read chunk by chunk (a chunk's tensors
  // are consecutive parameters, so each chunk's state is read once).
  json tensors = json::array();
  uint32_t file_crc = 0;
  uint64_t states_bytes = 0;
  Status written = [&]() -> Status {
    // Checked as the load reads it (strictly, one level below the manifest's depth limit: it
    // sits in the manifest), before anything is written: a user_state the load would refuse
    // replaced a good checkpoint with one that could not be read.
    if (!user_state.empty()) {
      ASSIGN_OR_RETURN(user,
                       ParseOutsideJson(user_state, "user_state", StatusCode::kInvalidArgument,
                                        /*allow_comments=*/false, kMaxJsonDepth - 1));
      // (As the manifest holds it: compact. CommitManifest checks the whole manifest.)
      if (const uint64_t bytes = user.dump().size(); bytes > kMaxManifestBytes)
        return InvalidArgumentError(
            "user_state is " + std::to_string(bytes) + " bytes as JSON; a checkpoint's " +
            "manifest, which holds it, is at most " + std::to_string(kMaxManifestBytes) +
            " bytes: keep a large state in a file of your own beside the checkpoint");
    }
    RETURN_IF_ERROR(CheckpointFilesAreOurs(dir, states_name, committed_names.has_value()));
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return IoError("creating checkpoint directory " + dir + ": " + ec.message());
    ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(dir + "/" + states_name));
    for (int c = 0; c < im.layout.num_chunks(); ++c) {
      RETURN_IF_ERROR(
          im.optimizer().With(c, /*write_back=*/false, [&](const OptimizerGroup& g) -> Status {
            return WriteChunkSlices(
                file, states_name, im.slices[static_cast<size_t>(c)], im.params, g.master,
                [&](size_t s) { return im.SliceMoments(g, s); }, tensors, file_crc);
          }));
    }
    states_bytes = file.bytes();
    return file.Commit();
  }();
  // Until the save is committed on every rank, this rank's new states file goes again on any
  // failure (another rank's write, the gather, the manifest), unless a manifest names it after
  // all (one committed whose directory sync then failed), so no file of a failed save stays on a
  // full disk beside the checkpoint that is still whole.
  struct Uncommitted {
    const std::string path, dir, name;
    bool armed;
    ~Uncommitted() {
      if (!armed) return;
      if (auto names = CommittedStatesFiles(dir); names && names->count(name) == 0)
        ::unlink(path.c_str());
    }
  } uncommitted{dir + "/" + states_name, dir, states_name, written.ok()};
  // Note [Agreeing on an outcome]: a rank that failed does not leave the others waiting.
  RETURN_IF_ERROR(AgreeOnStatus(*im.comm, written));
  json files =
      json::array({{{"name", states_name}, {"bytes", states_bytes}, {"crc32c", file_crc}}});
  // Every rank's file is committed once its entries arrive; rank 0 writes the manifest.
  if (im.world() > 1) RETURN_IF_ERROR(GatherEntries(*im.comm, files, tensors));
  // Rank 0 commits the manifest; every rank returns once it has (or with rank 0's error).
  Status committed = Status::OK();
  // Note [A checkpoint directory the ranks share]: rank 0's manifest names every rank's file, so
  // each must be where rank 0 sees it; ranks on machines with a directory of the same name but
  // not one file system wrote files the manifest could never load.
  if (rank == 0 && im.world() > 1) {
    for (const json& f : files) {
      const std::string path = dir + "/" + f.value("name", "");
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0 ||
          static_cast<uint64_t>(st.st_size) != f.value("bytes", uint64_t{0}))
        committed = FailedPreconditionError(
            "the checkpoint directory " + dir +
            " is not one directory the ranks share: rank 0 does not see " + path +
            " as another rank wrote it; give --checkpoint a directory on a file system every "
            "rank mounts (the previous checkpoint there, if any, is intact)");
    }
  }
  if (rank == 0 && committed.ok()) {
    committed = CommitManifest(
        dir, {{"format", "tierzero-checkpoint"},
              {"version", im.cfg.optimizer_states == MomentFormat::kF32 ? 2 : kCheckpointVersion},
              {"step", im.step},
              {"loss_scale", im.loss_scale},
              {"good_steps", im.good_steps},
              {"compute_dtype", std::string(DTypeName(im.cfg.compute_dtype))},
              // The moments' format in the states files (Note [Checkpoint format]).
              {"optimizer_states",
               std::string(StateFormatName(static_cast<StateFormat>(im.cfg.optimizer_states)))},
              {"world_size", im.comm->size()},
              {"files", files},
              {"tensors", tensors},
              {"user_state", user}});
  }
  RETURN_IF_ERROR(AgreeOnStatus(*im.comm, committed));
  uncommitted.armed = false;
  TZ_LOG(kInfo, kEngine) << "checkpoint at step " << im.step << " written to " << dir << " ("
                         << FormatBytes(states_bytes) << " from this rank)";
  return Status::OK();
}

StatusOr<std::string> Engine::LoadCheckpoint(const std::string& dir) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("LoadCheckpoint before Finalize");
  if (im.in_iteration) return FailedPreconditionError("LoadCheckpoint inside an iteration");
  RETURN_IF_ERROR(im.cm->out_of_step());
  // A failed update's error stays until this load succeeds: the load replaces what it left.
  (void)im.updater->Await();
  im.updater->Discard();  // it started from the states replaced here
  // Every rank reads the manifest and verifies what it will load; the ranks agree on the outcome
  // before any of them changes state, and again after (Note [Agreeing on an outcome]).
  // Everything is read and verified before any state changes: a bad checkpoint leaves the engine
  // as it was. Chunk by chunk, so NVMe-resident state is never held whole in memory; a second
  // pass writes.
  Manifest manifest;
  std::optional<StatesReader> reader;
  auto run_pass = [&](bool apply) -> Status {
    for (int c = 0; c < im.layout.num_chunks(); ++c) {
      RETURN_IF_ERROR(im.WithChunkState(
          c, /*write_back=*/apply, [&](float* master, float* m, float* v) -> Status {
            RETURN_IF_ERROR(reader->ChunkSlices(im.slices[static_cast<size_t>(c)], im.params,
                                                manifest.tensors, apply, master, m, v));
            return apply ? im.UploadChunk(c, master) : Status::OK();
          }));
    }
    return Status::OK();
  };
  // Note [A checkpoint saved while it is read]: a run saving into `dir` writes its new states
  // files, then the manifest, then removes the old files, so a reader of the old manifest can
  // find a file gone before it opened it. The manifest then names another step: read again from
  // it (the files opened stay readable to the apply pass below however they are renamed or
  // removed). A file missing under an unchanged manifest is a damaged checkpoint.
  Status verified;
  for (int attempt = 0; attempt < 3; ++attempt) {
    verified = [&]() -> Status {
      ASSIGN_OR_RETURN(manifest, ReadManifest(dir));
      // Each states file is the size its manifest says: one cut short or appended to is damaged
      // (a missing one is NotFound, read again below).
      for (const auto& [name, bytes] : manifest.files) {
        struct stat st {};
        const std::string path = dir + "/" + name;
        if (::stat(path.c_str(), &st) != 0)
          return ErrnoError("the checkpoint's states file " + path, errno,
                            errno == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError);
        if (S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) != bytes)
          return DataLossError("the checkpoint's states file " + path + " is " +
                               std::to_string(st.st_size) + " bytes; its manifest says " +
                               std::to_string(bytes) +
                               " (cut short or appended to): the checkpoint is damaged; restore "
                               "it from a copy, or resume from another one");
      }
      reader.emplace(dir, manifest.moments);
      RETURN_IF_ERROR(CheckSameModel(dir, manifest.tensors, im.params, im.numel));
      return run_pass(/*apply=*/false);
    }();
    if (verified.ok() || verified.code() != StatusCode::kNotFound) break;
    const StatusOr<Manifest> now = ReadManifest(dir);
    if (!now.ok() || (now->step == manifest.step && now->user_state == manifest.user_state)) break;
    TZ_LOG(kInfo, kEngine) << "checkpoint " << dir << " was saved again while it was read (step "
                           << manifest.step << " -> " << now->step << "): reading it again";
    if (attempt == 2)
      verified = std::move(verified).WithContext(
          "the checkpoint kept changing while it was read (a run is saving into it: read it "
          "when that run has stopped, or a copy)");
  }
  RETURN_IF_ERROR(AgreeOnStatus(*im.comm, verified));
  if (im.comm->size() > 1) {
    // The ranks verified the same save: one read between two saves would split them, as would
    // copies of two runs' saves at one step on machines without a shared file system (hunt 40:
    // a mixed model trained). The manifest holds every slice's CRC: its CRC tells them apart.
    struct Read {
      int64_t step;
      uint64_t manifest_crc;  // (64 bits: no padding in what is gathered)
    } mine{manifest.step, manifest.text_crc};
    ASSIGN_OR_RETURN(const auto all, AllGatherValue(*im.comm, mine));
    for (const Read& r : all) {
      if (r.step != mine.step || r.manifest_crc != mine.manifest_crc)
        return FailedPreconditionError(
            "the ranks read different saves of the checkpoint " + dir +
            " (a run is saving into it, or the ranks see different directories of that name: "
            "machines without a shared file system): load it when that run has stopped, or "
            "a copy, from a directory every rank mounts");
    }
  }
  Status loaded = AgreeOnStatus(*im.comm, run_pass(/*apply=*/true));
  if (!loaded.ok()) {
    // Verified, then failed while writing (a disk error): the states are partly the
    // checkpoint's on some rank, so the engine takes no more work.
    im.cm->MarkOutOfStep(loaded);
    return loaded;
  }
  im.step = manifest.step;
  im.loss_scale = manifest.loss_scale;
  im.good_steps = manifest.good_steps;
  // The loss scale is fp16's: a checkpoint of another compute type resumed in fp16 starts at the
  // initial scale (its own 1 would flush small fp16 gradients to zero for a thousand steps), and
  // an fp16 checkpoint resumed in bf16 or fp32 leaves its scale behind.
  const bool saved_f16 = manifest.compute_dtype == DTypeName(DType::kF16);
  const bool now_f16 = im.cfg.compute_dtype == DType::kF16;
  if (!manifest.compute_dtype.empty() && saved_f16 != now_f16) {
    im.loss_scale = now_f16 ? im.cfg.initial_loss_scale : 1.0f;
    im.good_steps = 0;
  }
  im.iterations_since_step = 0;
  RETURN_IF_ERROR(im.cm->ZeroGrads());
  im.updater->ClearError();
  const std::string_view mine = StateFormatName(static_cast<StateFormat>(im.cfg.optimizer_states));
  if (manifest.optimizer_states != mine && im.cfg.optimizer_states != MomentFormat::kNone) {
    TZ_LOG(kInfo, kEngine) << "checkpoint " << dir << ": moments saved by a run with "
                           << manifest.optimizer_states << " optimizer states, now held as "
                           << mine;
  }
  TZ_LOG(kInfo, kEngine) << "checkpoint " << dir << " loaded at step " << im.step;
  return manifest.user_state;
}

}  // namespace tierzero

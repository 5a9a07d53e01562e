// safetensors import and export of the engine's parameters (engine.h).
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/collective.h"
#include "core/bytes.h"
#include "core/convert.h"
#include "core/file_io.h"
#include "core/json_in.h"
#include "core/logging.h"
#include "engine/engine_impl.h"
#include "tierzero/utf8.h"

namespace tierzero {
using nlohmann::json;

namespace {

// The most bytes a safetensors header may hold, written or read: the safetensors library's own
// limit (100 MB), so every file written here is one transformers reads.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

const char* SafetensorsDType(DType d) {
  return d == DType::kF32 ? "F32" : d == DType::kBF16 ? "BF16" : "F16";
}

// Note [What an export refuses before writing]
// A safetensors header is a JSON object keyed by tensor name, with "__metadata__" its own key:
// two parameters a TensorNames callback maps to one name, or a tensor named "__metadata__",
// silently lost a tensor (the file said OK and held one fewer). Names and metadata must be
// UTF-8 (a JSON writer throws on anything else), and the metadata may not replace the keys the
// export writes (format, producer, step). All are refused before any file is opened; a weight
// beyond fp16's range is found as the chunks stream, and its refusal leaves no file either.
template <typename Files, typename NameOf>
Status CheckExportNames(const Files& files, const NameOf& name_of,
                        const std::map<std::string, std::string>& metadata) {
  std::map<std::string, size_t> seen;
  for (const auto& file : files) {
    for (size_t t : file.tensors) {
      const std::string name = name_of(t);
      if (name.empty() || name == "__metadata__" || FirstInvalidUtf8(name) >= 0)
        return InvalidArgumentError(
            "safetensors export: tensor name '" +
            name.substr(0, static_cast<size_t>(std::max<int64_t>(0, FirstInvalidUtf8(name)))) +
            "' cannot be written: " +
            (name.empty()             ? std::string("it is empty")
             : name == "__metadata__" ? std::string("it is the header's own key")
                                      : std::string("it is not UTF-8")));
      if (!seen.emplace(name, t).second)
        return InvalidArgumentError("safetensors export: two parameters are both named tensor '" +
                                    name + "': each tensor needs a name of its own");
    }
  }
  for (const auto& [key, value] : metadata) {
    if (FirstInvalidUtf8(key) >= 0 || FirstInvalidUtf8(value) >= 0)
      return InvalidArgumentError("safetensors export: a metadata key or value is not UTF-8");
    if (key == "format" || key == "producer" || key == "step")
      return InvalidArgumentError("safetensors export: metadata key '" + key +
                                  "' is the export's own (format, producer, step): name it "
                                  "otherwise");
  }
  return Status::OK();
}

// fp16 holds magnitudes up to 65504 (anything from 65520 on rounds to infinity): a weight beyond
// it would be written as inf, and the file refused as damaged when read.
Status FitsFp16(const float* x, int64_t n, const std::string& name) {
  float largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::fabs(x[i]));
  if (largest < 65520.f) return Status::OK();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", static_cast<double>(largest));
  return InvalidArgumentError("tensor '" + name + "' holds a value of magnitude " + buf +
                              ", beyond fp16's largest (65504): it would be written as "
                              "infinity; export in bf16 or fp32 (--dtype bf16)");
}

}  // namespace

// Writes `files`, each atomically. `names` maps a parameter's name to its tensor's.
Status Engine::Impl::ExportFiles(const std::vector<ExportFile>& files, DType dtype,
                                 const TensorNames& names, bool producer,
                                 const std::map<std::string, std::string>& metadata) {
  Impl& im = *this;
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
    return InvalidArgumentError("safetensors export writes fp32, bf16 or fp16, not " +
                                std::string(DTypeName(dtype)));
  auto name_of = [&](size_t t) { return names ? names(im.params[t].name) : im.params[t].name; };
  RETURN_IF_ERROR(CheckExportNames(files, name_of, metadata));
  const bool writer = im.comm->rank() == 0;
  std::vector<AtomicFile> out_files;
  std::vector<int> file_of(im.params.size(), -1);
  Status wrote = Status::OK();
  if (writer) {
    wrote = [&]() -> Status {
      for (size_t f = 0; f < files.size(); ++f) {
        json header = json::object();
        uint64_t offset = 0;
        for (size_t t : files[f].tensors) {
          const uint64_t bytes = DTypeBytes(dtype, static_cast<uint64_t>(im.numel[t]));
          header[name_of(t)] = {{"dtype", SafetensorsDType(dtype)},
                                {"shape", im.params[t].shape},
                                {"data_offsets", {offset, offset + bytes}}};
          offset += bytes;
          file_of[t] = static_cast<int>(f);
        }
        header["__metadata__"] = {{"format", "pt"}};
        if (producer) {
          header["__metadata__"]["producer"] = "tierzero";
          header["__metadata__"]["step"] = std::to_string(im.step);
          for (const auto& [key, value] : metadata) header["__metadata__"][key] = value;
        }
        std::string h = header.dump();
        while ((h.size() + 8) % 8 != 0) h.push_back(' ');
        // (A header its reader refuses was written, and the export reported done: hunt 48.)
        if (h.size() > kMaxSafetensorsHeaderBytes)
          return InvalidArgumentError(
              "safetensors export: the header of " + files[f].path + " would be " +
              std::to_string(h.size()) + " bytes, over the " +
              std::to_string(kMaxSafetensorsHeaderBytes) +
              " a reader takes (the metadata given is too large): nothing was written");
        ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(files[f].path));
        const uint64_t hlen = h.size();
        RETURN_IF_ERROR(file.Write(&hlen, 8));  // little-endian u64
        RETURN_IF_ERROR(file.Write(h.data(), h.size()));
        out_files.push_back(std::move(file));
      }
      return Status::OK();
    }();
  }
  // Every rank contributes its shards chunk by chunk. A failed write stops the writing, not the
  // gathers the other ranks take part in (Note [Agreeing on an outcome]).
  std::vector<uint8_t> out;
  std::vector<float> full;
  for (int c = 0; c < im.layout.num_chunks(); ++c) {
    RETURN_IF_ERROR(im.GatherChunkMaster(c, full));
    if (!writer || !wrote.ok()) continue;
    for (int t : im.layout.chunk(c).tensors) {
      const TensorLoc& loc = im.layout.tensor(t);
      const int f = file_of[static_cast<size_t>(t)];
      if (f < 0) continue;
      out.resize(DTypeBytes(dtype, loc.numel));
      if (dtype == DType::kF16) wrote = FitsFp16(full.data() + loc.offset, loc.numel, name_of(t));
      if (wrote.ok())
        wrote = Convert(full.data() + loc.offset, DType::kF32, out.data(), dtype, loc.numel);
      if (wrote.ok()) wrote = out_files[static_cast<size_t>(f)].Write(out.data(), out.size());
      if (!wrote.ok()) break;
    }
  }
  if (writer && wrote.ok()) {
    for (size_t f = 0; f < out_files.size() && wrote.ok(); ++f) {
      wrote = out_files[f].Commit();
      if (!wrote.ok() && f > 0)
        wrote = std::move(wrote).WithContext(std::to_string(f) + " of the " +
                                             std::to_string(files.size()) +
                                             " files were written before this one");
    }
  }
  return AgreeOnStatus(*im.comm, wrote);
}

// The tensors in the order the chunks hold them.
std::vector<size_t> Engine::Impl::GatherOrder() const {
  const Impl& im = *this;
  std::vector<size_t> order;
  for (int c = 0; c < im.layout.num_chunks(); ++c)
    for (int t : im.layout.chunk(c).tensors) order.push_back(static_cast<size_t>(t));
  return order;
}

Status Engine::ExportSafetensors(const std::string& path, DType dtype,
                                 const std::map<std::string, std::string>& metadata) const {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("ExportSafetensors before Finalize");
  RETURN_IF_ERROR(im.cm->out_of_step());
  RETURN_IF_ERROR(im.updater->Await());
  if (dtype != DType::kF32 && dtype != DType::kBF16)
    return InvalidArgumentError("safetensors export writes fp32 or bf16, not " +
                                std::string(DTypeName(dtype)));
  return im.ExportFiles({Impl::ExportFile{path, im.GatherOrder()}}, dtype, nullptr, true, metadata);
}

StatusOr<std::vector<Engine::SafetensorsShard>> Engine::ExportSafetensorsShards(
    const std::string& dir, const std::string& stem, DType dtype, const TensorNames& names,
    uint64_t max_shard_bytes,
    const std::function<void(const std::vector<SafetensorsShard>&)>& planned) const {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("ExportSafetensorsShards before Finalize");
  // (A file name within dir: not hidden, not elsewhere.)
  if (stem.empty() || stem.find('/') != std::string::npos || stem == "." || stem == "..")
    return InvalidArgumentError("ExportSafetensorsShards: the stem '" + stem +
                                "' is not a file name (the files are dir/STEM.safetensors)");
  RETURN_IF_ERROR(im.cm->out_of_step());
  RETURN_IF_ERROR(im.updater->Await());
  // Shards in gather order: a new file when the next tensor would pass the limit (a tensor
  // larger than the limit is a file of its own).
  std::vector<std::vector<size_t>> groups(1);
  std::vector<uint64_t> sizes(1, 0);
  for (size_t t : im.GatherOrder()) {
    const uint64_t bytes = DTypeBytes(dtype, static_cast<uint64_t>(im.numel[t]));
    if (max_shard_bytes > 0 && !groups.back().empty() && sizes.back() + bytes > max_shard_bytes) {
      groups.emplace_back();
      sizes.push_back(0);
    }
    groups.back().push_back(t);
    sizes.back() += bytes;
  }
  std::vector<SafetensorsShard> shards;
  std::vector<Impl::ExportFile> files;
  char buf[64];
  for (size_t i = 0; i < groups.size(); ++i) {
    SafetensorsShard sh;
    if (groups.size() == 1) {
      sh.file = stem + ".safetensors";
    } else {
      std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", i + 1, groups.size());
      sh.file = stem + buf;
    }
    for (size_t t : groups[i])
      sh.tensors.push_back(names ? names(im.params[t].name) : im.params[t].name);
    sh.bytes = sizes[i];
    files.push_back({dir + "/" + sh.file, groups[i]});
    shards.push_back(std::move(sh));
  }
  if (planned) planned(shards);
  RETURN_IF_ERROR(im.ExportFiles(files, dtype, names, /*producer=*/false));
  return shards;
}

// Note [Safetensors entries checked whole]
// A safetensors file is outside data: before any parameter changes, every entry of its header (not
// only the ones the model needs) must have a dtype, a shape of sizes and a pair of data offsets
// inside the data section, begin <= end, with exactly the bytes its shape needs for the dtypes we
// read, and no two tensors may overlap (the format forbids each). So a malformed file fails whole
// and never leaves a model half loaded.
namespace {

struct SafetensorsEntry {
  std::string dtype_name;  // as the file says: "F32", "BF16", "F16" load
  bool loads = false;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // in the data section
};

struct SafetensorsHeader {
  uint64_t base = 0;  // the data section's offset in the file
  std::map<std::string, SafetensorsEntry> entries;
};

// One header entry, checked whole (Note [Safetensors entries checked whole]).
StatusOr<SafetensorsEntry> ParseEntry(const std::string& path, const std::string& name,
                                      const json& e, uint64_t data_bytes) {
  auto bad = [&](const std::string& why) {
    return DataLossError(path + ": safetensors tensor '" + name + "' " + why);
  };
  // Read through JsonIn (Note [Reading outside JSON]): errors name the tensor and the field.
  const JsonIn in(e, path + ": safetensors tensor '" + name + "'", StatusCode::kDataLoss);
  SafetensorsEntry en;
  ASSIGN_OR_RETURN(en.dtype_name, in.get<std::string>("dtype"));
  const std::string& dt = en.dtype_name;
  en.dtype = dt == "F32" ? DType::kF32 : dt == "BF16" ? DType::kBF16 : DType::kF16;
  en.loads = dt == "F32" || dt == "BF16" || dt == "F16";
  ASSIGN_OR_RETURN(const std::vector<JsonIn> dims, in.elements("shape"));
  for (const JsonIn& d : dims) {
    ASSIGN_OR_RETURN(const int64_t n, d.as<int64_t>());
    if (n < 0) return d.Error("is a negative size");
    en.shape.push_back(n);
  }
  ASSIGN_OR_RETURN(const std::vector<JsonIn> off, in.elements("data_offsets"));
  if (off.size() != 2) return in.Error("has data_offsets that are not a [begin, end] pair");
  ASSIGN_OR_RETURN(en.begin, off[0].as<uint64_t>());
  ASSIGN_OR_RETURN(en.end, off[1].as<uint64_t>());
  if (en.begin > en.end)
    return bad("has data offsets [" + std::to_string(en.begin) + ", " + std::to_string(en.end) +
               "] that end before they begin");
  if (en.end > data_bytes)
    return bad("has data offsets [" + std::to_string(en.begin) + ", " + std::to_string(en.end) +
               "] outside the data section of " + std::to_string(data_bytes) + " bytes");
  if (!en.loads) return en;
  // (A dimension 0 anywhere makes no elements, whatever the others.)
  uint64_t n = std::count(en.shape.begin(), en.shape.end(), 0) > 0 ? 0 : 1;
  for (int64_t d : en.shape) {
    if (n == 0) break;
    if (n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d))
      return bad("has a shape too large: " + json(en.shape).dump());
    n *= static_cast<uint64_t>(d);
  }
  // (Checked before the bytes, whose product could wrap around.)
  if (n > data_bytes)
    return bad("has a shape of " + std::to_string(n) + " elements, more than the " +
               std::to_string(data_bytes) + " bytes of the data section hold");
  if (en.end - en.begin != DTypeBytes(en.dtype, n))
    return bad("has " + std::to_string(en.end - en.begin) + " bytes for " + std::to_string(n) +
               " " + dt + " elements");
  return en;
}

// The header of a safetensors file as JSON (an object), and its length.
StatusOr<json> ReadHeaderJson(int fd, const std::string& path, uint64_t* header_bytes) {
  struct stat st {};
  ::fstat(fd, &st);
  uint64_t hlen = 0;
  if (st.st_size < 8) return DataLossError(path + " is not a safetensors file (too short)");
  RETURN_IF_ERROR(ReadAt(fd, path, 0, &hlen, 8));
  if (hlen > static_cast<uint64_t>(st.st_size) - 8 || hlen > kMaxSafetensorsHeaderBytes) {
    // A model repository cloned without git-lfs holds pointers where its weights go: said as
    // such, with what to do (it read "header length 2336927755350992246"; hunt 51).
    constexpr std::string_view kLfs = "version https://git-lfs";
    char head[kLfs.size()] = {};
    if (static_cast<uint64_t>(st.st_size) >= kLfs.size() &&
        ReadAt(fd, path, 0, head, kLfs.size()).ok() && std::string_view(head, kLfs.size()) == kLfs)
      return DataLossError(path +
                           " is a Git LFS pointer, not the weights it names: the repository was "
                           "cloned without git-lfs. Run `git lfs pull` in it, or download the "
                           "file itself");
    return DataLossError(path + " is not a safetensors file (header length " +
                         std::to_string(hlen) + ")");
  }
  std::string h(hlen, '\0');
  RETURN_IF_ERROR(ReadAt(fd, path, 8, h.data(), hlen));
  auto parsed = ParseOutsideJson(h, path + "'s safetensors header", StatusCode::kDataLoss);
  if (!parsed.ok()) return parsed.status();
  json header = std::move(parsed).value();
  if (!header.is_object())
    return DataLossError(path + ": the safetensors header is not valid JSON");
  RETURN_IF_ERROR(JsonIn(header, path, StatusCode::kDataLoss).CheckDepth(kMaxJsonDepth));
  *header_bytes = hlen;
  return header;
}

// The header of a safetensors file, every entry checked and no two overlapping.
StatusOr<SafetensorsHeader> ReadHeader(int fd, const std::string& path) {
  uint64_t hlen = 0;
  ASSIGN_OR_RETURN(const json header, ReadHeaderJson(fd, path, &hlen));
  struct stat st {};
  ::fstat(fd, &st);
  SafetensorsHeader out;
  out.base = 8 + hlen;
  const uint64_t data_bytes = static_cast<uint64_t>(st.st_size) - out.base;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") continue;
    ASSIGN_OR_RETURN(SafetensorsEntry en, ParseEntry(path, item.key(), item.value(), data_bytes));
    ranges.emplace_back(en.begin, en.end);
    out.entries[item.key()] = std::move(en);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      return DataLossError(path + ": two safetensors tensors overlap (bytes " +
                           std::to_string(ranges[i].first) + " and " +
                           std::to_string(ranges[i - 1].second) + " of the data section)");
  // The tensors lie end to end from the data section's start to the file's end (the format's
  // rule): a header whose offsets leave a hole was read one element off, silently.
  uint64_t covered = 0, gap_end = data_bytes;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered) {
      gap_end = begin;
      break;
    }
    covered = end;
  }
  if (covered != data_bytes)
    return DataLossError(path + ": bytes " + std::to_string(covered) + ".." +
                         std::to_string(gap_end) + " of the " + std::to_string(data_bytes) +
                         "-byte data section hold no tensor (a safetensors file's tensors lie end "
                         "to end from its start to the file's end): the file was edited or "
                         "damaged");
  return out;
}

}  // namespace

StatusOr<std::map<std::string, std::string>> ReadSafetensorsMetadata(const std::string& path) {
  ReadFd fd(path, "safetensors file");
  RETURN_IF_ERROR(fd.status());
  uint64_t hlen = 0;
  ASSIGN_OR_RETURN(const json header, ReadHeaderJson(fd.get(), path, &hlen));
  std::map<std::string, std::string> out;
  const auto it = header.find("__metadata__");
  if (it == header.end() || !it->is_object()) return out;
  for (const auto& [key, value] : it->items())
    if (value.is_string()) out[key] = value.get<std::string>();
  return out;
}

StatusOr<std::map<std::string, std::vector<int64_t>>> ReadSafetensorsShapes(
    const std::string& path) {
  ReadFd fd(path, "safetensors file");
  RETURN_IF_ERROR(fd.status());
  ASSIGN_OR_RETURN(const SafetensorsHeader h, ReadHeader(fd.get(), path));
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& [name, entry] : h.entries) out[name] = entry.shape;
  return out;
}

StatusOr<bool> SafetensorsTensorsEqual(const std::vector<std::string>& files, const std::string& a,
                                       const std::string& b) {
  struct Found {
    size_t file = 0;
    uint64_t base = 0;
    SafetensorsEntry entry;
  };
  std::vector<std::unique_ptr<ReadFd>> fds;
  std::optional<Found> fa, fb;
  for (size_t f = 0; f < files.size(); ++f) {
    fds.push_back(std::make_unique<ReadFd>(files[f], "safetensors file"));
    RETURN_IF_ERROR(fds.back()->status());
    ASSIGN_OR_RETURN(SafetensorsHeader h, ReadHeader(fds.back()->get(), files[f]));
    for (auto [name, found] : {std::pair{&a, &fa}, std::pair{&b, &fb}}) {
      auto it = h.entries.find(*name);
      if (it != h.entries.end()) *found = Found{f, h.base, it->second};
    }
  }
  for (auto [name, found] : {std::pair{&a, &fa}, std::pair{&b, &fb}}) {
    if (!found->has_value())
      return NotFoundError("the safetensors files have no tensor '" + *name + "'");
    if (!(*found)->entry.loads)
      return UnsupportedError(files[(*found)->file] + ": tensor '" + *name + "' is " +
                              (*found)->entry.dtype_name + "; F32, BF16 and F16 are read");
  }
  if (fa->entry.shape != fb->entry.shape) return false;
  const uint64_t n = (fa->entry.end - fa->entry.begin) / DTypeBytes(fa->entry.dtype, 1);
  constexpr uint64_t kBlock = uint64_t{1} << 20;  // elements
  std::vector<uint8_t> raw;
  std::vector<float> va, vb;
  for (uint64_t at = 0; at < n; at += kBlock) {
    const uint64_t k = std::min(kBlock, n - at);
    for (auto [found, out] : {std::pair{&fa, &va}, std::pair{&fb, &vb}}) {
      const Found& fd = **found;
      const uint64_t elem = DTypeBytes(fd.entry.dtype, 1);
      raw.resize(k * elem);
      RETURN_IF_ERROR(ReadAt(fds[fd.file]->get(), files[fd.file],
                             fd.base + fd.entry.begin + at * elem, raw.data(), raw.size()));
      out->resize(k);
      RETURN_IF_ERROR(Convert(raw.data(), fd.entry.dtype, out->data(), DType::kF32, k));
    }
    // As torch.equal compares (transformers' test for a tie): -0.0 equals 0.0, NaN nothing.
    for (uint64_t i = 0; i < k; ++i)
      if (!(va[i] == vb[i])) return false;
  }
  return true;
}

Status Engine::LoadSafetensors(const std::string& path) {
  return LoadSafetensors(std::vector<std::string>{path}, nullptr, nullptr);
}

Status Engine::LoadSafetensors(const std::vector<std::string>& files, const TensorNames& names,
                               std::vector<std::string>* skipped,
                               std::vector<std::string>* non_finite_tensors) {
  Impl& im = *impl_;
  if (!im.finalized) return FailedPreconditionError("LoadSafetensors before Finalize");
  if (files.empty()) return InvalidArgumentError("LoadSafetensors of no file");
  RETURN_IF_ERROR(im.updater->Await());
  // Every file's every entry is checked before anything loads (Note [Safetensors entries checked
  // whole]); a tensor in two files is an error.
  std::vector<std::unique_ptr<ReadFd>> fds;
  std::vector<SafetensorsHeader> headers;
  std::map<std::string, size_t> where;
  for (size_t f = 0; f < files.size(); ++f) {
    fds.push_back(std::make_unique<ReadFd>(files[f], "safetensors file"));
    if (fds.back()->get() < 0) return fds.back()->status();
    ASSIGN_OR_RETURN(SafetensorsHeader h, ReadHeader(fds.back()->get(), files[f]));
    for (const auto& [name, e] : h.entries) {
      auto [it, fresh] = where.emplace(name, f);
      if (!fresh)
        return DataLossError("tensor '" + name + "' is in both " + files[it->second] + " and " +
                             files[f]);
    }
    headers.push_back(std::move(h));
  }
  const std::string set =
      files.size() == 1 ? files[0]
                        : "the " + std::to_string(files.size()) + " files (" + files[0] + ", ...)";
  auto name_of = [&](const ParamSpec& ps) { return names ? names(ps.name) : ps.name; };
  std::map<std::string, bool> used;
  for (const ParamSpec& ps : im.params) {
    const std::string n = name_of(ps);
    auto w = where.find(n);
    if (w == where.end())
      return NotFoundError(set + (files.size() == 1 ? " has" : " have") + " no tensor '" + n + "'");
    const SafetensorsEntry& e = headers[w->second].entries.at(n);
    if (!e.loads)
      return UnsupportedError(files[w->second] + ": tensor '" + n + "' is " + e.dtype_name +
                              "; F32, BF16 and F16 load");
    if (e.shape != ps.shape)
      return InvalidArgumentError(files[w->second] + ": tensor '" + n + "' has shape " +
                                  json(e.shape).dump() + ", the model registers " +
                                  json(ps.shape).dump());
    used[n] = true;
  }
  if (skipped != nullptr) {
    skipped->clear();
    for (const auto& [n, f] : where)
      if (!used.count(n)) skipped->push_back(n);
  }
  if (non_finite_tensors != nullptr) non_finite_tensors->clear();
  std::vector<uint8_t> raw;
  std::vector<float> values;
  for (size_t t = 0; t < im.params.size(); ++t) {
    const std::string n = name_of(im.params[t]);
    const size_t f = where.at(n);
    const SafetensorsEntry& e = headers[f].entries.at(n);
    const uint64_t count = static_cast<uint64_t>(im.numel[t]);
    raw.resize(e.end - e.begin);
    values.resize(count);
    RETURN_IF_ERROR(
        ReadAt(fds[f]->get(), files[f], headers[f].base + e.begin, raw.data(), raw.size()));
    RETURN_IF_ERROR(Convert(raw.data(), e.dtype, values.data(), DType::kF32, count));
    const size_t non_finite = static_cast<size_t>(
        std::count_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); }));
    if (non_finite > 0 && non_finite_tensors != nullptr) {
      non_finite_tensors->push_back(n + " (" + std::to_string(non_finite) + " of " +
                                    std::to_string(count) + ")");
    } else if (non_finite > 0) {
      TZ_LOG(kWarn, kEngine) << files[f] << ": tensor '" << n << "' holds " << non_finite
                             << " NaN or infinite values (loaded as they are)";
    }
    RETURN_IF_ERROR(WriteParam(static_cast<ParamId>(t), values));
  }
  TZ_LOG(kInfo, kEngine) << "parameters loaded from " << set;
  return Status::OK();
}

}  // namespace tierzero

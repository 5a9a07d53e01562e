// Checkpoints and safetensors files through the engine's public API: a resume continues with the
// same losses, a corrupt, edited, absent or foreign checkpoint is a clear error that loads
// nothing, a re-save never replaces what its manifest names, and exports round-trip.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "gpt/gpt.h"
#include "small_model.h"
#include "tierzero/engine.h"

namespace tierzero {
namespace {
namespace fs = std::filesystem;
using gpt::GptConfig;

using testing_models::Make;
using testing_models::SmallLlama;
using testing_models::SmallModel;
using testing_models::TempDir;
using testing_models::TestEngineConfig;
using testing_models::Train;
using testing_models::Trainer;

TEST(Engine, LlamaResumeContinuesWithTheSameLosses) {
  TempDir dir;
  EngineConfig ec = TestEngineConfig();
  std::vector<double> straight, resumed;
  {
    Trainer r = Make(ec, SmallLlama());
    straight = Train(r, 0, 12);
  }
  {
    Trainer r = Make(ec, SmallLlama());
    resumed = Train(r, 0, 6);
    ASSERT_TRUE(r.engine->SaveCheckpoint(dir.path() + "/ckpt", R"({"step": 6})").ok());
  }
  {
    Trainer r = Make(ec, SmallLlama());
    ASSERT_TRUE(r.engine->LoadCheckpoint(dir.path() + "/ckpt").ok());
    std::vector<double> rest = Train(r, 6, 12);
    resumed.insert(resumed.end(), rest.begin(), rest.end());
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i;
}

TEST(Engine, ResumeContinuesWithTheSameLosses) {
  TempDir dir;
  EngineConfig ec = TestEngineConfig();
  ec.host_budget = uint64_t{1536} << 10;
  ec.nvme_budget = uint64_t{128} << 20;
  ec.nvme_path = dir.path() + "/nvme";
  fs::create_directories(ec.nvme_path);
  std::vector<double> straight;
  {
    Trainer r = Make(ec);
    straight = Train(r, 0, 16);
  }
  std::vector<double> resumed;
  {
    Trainer r = Make(ec);
    resumed = Train(r, 0, 8);
    ASSERT_TRUE(r.engine->SaveCheckpoint(dir.path() + "/ckpt", R"({"step": 8})").ok());
  }
  {
    // A different chunk size: checkpoints are per tensor.
    EngineConfig ec2 = ec;
    ec2.chunk_elems = 32768;
    ec2.host_budget = uint64_t{3} << 20;
    Trainer r = Make(ec2);
    auto user = r.engine->LoadCheckpoint(dir.path() + "/ckpt");
    ASSERT_TRUE(user.ok()) << user.status().ToString();
    EXPECT_EQ(*user, R"({"step":8})");
    EXPECT_EQ(r.engine->step(), 8);
    std::vector<double> rest = Train(r, 8, 16);
    resumed.insert(resumed.end(), rest.begin(), rest.end());
  }
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_EQ(resumed[i], straight[i]) << "step " << i;
}

TEST(Engine, CheckpointCorruptionAndAbsenceAreClearErrors) {
  TempDir dir;
  Trainer r = Make(TestEngineConfig());
  Train(r, 0, 2);
  auto missing = r.engine->LoadCheckpoint(dir.path() + "/nothing");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no such directory"), std::string::npos);
  std::filesystem::create_directories(dir.path() + "/empty");
  auto empty = r.engine->LoadCheckpoint(dir.path() + "/empty");
  EXPECT_EQ(empty.status().code(), StatusCode::kNotFound);
  EXPECT_NE(empty.status().message().find("manifest.json missing"), std::string::npos);
  ASSERT_TRUE(r.engine->SaveCheckpoint(dir.path() + "/ckpt").ok());
  std::vector<float> before(static_cast<size_t>(r.engine->numel(0)));
  ASSERT_TRUE(r.engine->ReadParam(0, before).ok());
  // Flip a byte in the states file.
  std::string states;
  for (const auto& e : fs::directory_iterator(dir.path() + "/ckpt"))
    if (e.path().filename().string().rfind("states-", 0) == 0) states = e.path().string();
  ASSERT_FALSE(states.empty());
  {
    std::fstream f(states, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  Train(r, 2, 3);  // change the state so a partial load would show
  std::vector<float> mid(before.size());
  ASSERT_TRUE(r.engine->ReadParam(0, mid).ok());
  auto bad = r.engine->LoadCheckpoint(dir.path() + "/ckpt");
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss) << bad.status().ToString();
  std::vector<float> after(before.size());
  ASSERT_TRUE(r.engine->ReadParam(0, after).ok());
  EXPECT_EQ(after, mid) << "a failed load changed the parameters";
}

// Note [The manifest's own checksum]: a manifest edited after it was written (its step, a
// tensor's name, the user state) and a states file appended to are refused, nothing loaded; the
// same manifest re-serialised with its content unchanged still loads.
TEST(Engine, EditedManifestsAndResizedStatesFilesAreRefused) {
  TempDir dir;
  Trainer r = Make(TestEngineConfig());
  Train(r, 0, 2);
  const std::string ckpt = dir.path() + "/ckpt";
  ASSERT_TRUE(r.engine->SaveCheckpoint(ckpt, R"({"step": 2})").ok());
  std::string original;
  {
    std::ifstream in(ckpt + "/manifest.json");
    original.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto write = [&](const std::string& text) {
    std::ofstream(ckpt + "/manifest.json", std::ios::trunc) << text;
  };
  Train(r, 2, 3);
  std::vector<float> mid(static_cast<size_t>(r.engine->numel(0)));
  ASSERT_TRUE(r.engine->ReadParam(0, mid).ok());
  const nlohmann::json m = nlohmann::json::parse(original);
  ASSERT_TRUE(m.contains("manifest_crc32c"));
  const std::vector<std::function<void(nlohmann::json&)>> edits = {
      [](nlohmann::json& j) { j["step"] = 1; },
      [](nlohmann::json& j) { j["user_state"]["step"] = 1; },
      [](nlohmann::json& j) { j["loss_scale"] = 1024.0; },
      [](nlohmann::json& j) { std::swap(j["tensors"][0]["name"], j["tensors"][1]["name"]); },
      [](nlohmann::json& j) { j["files"][0]["bytes"] = 1; },
  };
  for (size_t e = 0; e < edits.size(); ++e) {
    nlohmann::json edited = m;
    edits[e](edited);
    write(edited.dump(2));
    auto bad = r.engine->LoadCheckpoint(ckpt);
    EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss) << "edit " << e;
    EXPECT_NE(bad.status().message().find("was changed after tierzero wrote it"), std::string::npos)
        << bad.status().ToString();
  }
  std::vector<float> after(mid.size());
  ASSERT_TRUE(r.engine->ReadParam(0, after).ok());
  EXPECT_EQ(after, mid) << "a refused manifest changed the parameters";
  // Re-indented and re-ordered by another tool, the same content still loads.
  write(m.dump(4));
  auto same = r.engine->LoadCheckpoint(ckpt);
  ASSERT_TRUE(same.ok()) << same.status().ToString();
  EXPECT_EQ(*same, R"({"step":2})");
  // A states file appended to is damaged, though every slice's bytes are intact.
  std::string states;
  for (const auto& f : fs::directory_iterator(ckpt))
    if (f.path().filename().string().rfind("states-", 0) == 0) states = f.path().string();
  std::ofstream(states, std::ios::app) << "junk";
  auto appended = r.engine->LoadCheckpoint(ckpt);
  EXPECT_EQ(appended.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(appended.status().message().find("appended to"), std::string::npos)
      << appended.status().ToString();
}

// The loss scale is fp16's: a bf16 checkpoint resumed in fp16 starts at the initial scale, and
// an fp16 checkpoint resumed in bf16 leaves its scale behind.
TEST(Engine, ALossScaleIsTakenOnlyFromAnFp16Checkpoint) {
  TempDir dir;
  EngineConfig bf16 = TestEngineConfig();
  bf16.compute_dtype = DType::kBF16;
  EngineConfig fp16 = bf16;
  fp16.compute_dtype = DType::kF16;
  fp16.initial_loss_scale = 4096.0f;
  {
    Trainer r = Make(bf16);
    Train(r, 0, 2);
    ASSERT_TRUE(r.engine->SaveCheckpoint(dir.path() + "/bf16").ok());
  }
  {
    Trainer r = Make(fp16);
    ASSERT_TRUE(r.engine->LoadCheckpoint(dir.path() + "/bf16").ok());
    EXPECT_EQ(r.engine->loss_scale(), 4096.0f);
    ASSERT_TRUE(r.engine->SaveCheckpoint(dir.path() + "/fp16").ok());
  }
  {
    Trainer r = Make(fp16);
    ASSERT_TRUE(r.engine->LoadCheckpoint(dir.path() + "/fp16").ok());
    EXPECT_EQ(r.engine->loss_scale(), 4096.0f);  // fp16 to fp16: the saved scale
  }
  {
    Trainer r = Make(bf16);
    ASSERT_TRUE(r.engine->LoadCheckpoint(dir.path() + "/fp16").ok());
    EXPECT_EQ(r.engine->loss_scale(), 1.0f);
  }
}

// Sets or clears a file's immutable flag (a rename over it then fails, as a kill or a full disk
// at that moment would stop it); false where the file system or the process cannot.
bool SetImmutable(const std::string& path, bool on) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  int flags = 0;
  bool done = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  if (done) {
    flags = on ? (flags | FS_IMMUTABLE_FL) : (flags & ~FS_IMMUTABLE_FL);
    done = ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
  }
  ::close(fd);
  return done;
}

// Note [A re-save never renames over its manifest's] (engine/checkpoint.cc): a run resumed from
// a checkpoint that saves the same step into it again (other optimizer states) and fails at the
// manifest's commit leaves that checkpoint whole, and no file of its own.
TEST(Engine, AReSaveOfTheSameStepNeverReplacesWhatItsManifestNames) {
  TempDir dir;
  const std::string ckpt = dir.path() + "/ckpt";
  auto states_files = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(ckpt))
      if (e.path().filename().string().rfind("states-", 0) == 0)
        names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  std::vector<float> saved;
  {
    Trainer r = Make(TestEngineConfig());
    Train(r, 0, 2);
    ASSERT_TRUE(r.engine->SaveCheckpoint(ckpt).ok());
    saved.resize(static_cast<size_t>(r.engine->numel(0)));
    ASSERT_TRUE(r.engine->ReadParam(0, saved).ok());
  }
  EXPECT_EQ(states_files(), std::vector<std::string>{"states-2.w1.rank0.bin"});
  const std::string manifest = ckpt + "/manifest.json";
  if (!SetImmutable(manifest, true)) GTEST_SKIP() << "no immutable files here (root, ext4/tmpfs)";
  Status resaved;
  {
    EngineConfig bf16_states = TestEngineConfig();
    bf16_states.optimizer_states = MomentFormat::kBF16;
    Trainer r = Make(bf16_states);
    Status loaded = r.engine->LoadCheckpoint(ckpt).status();
    if (loaded.ok()) resaved = r.engine->SaveCheckpoint(ckpt);
    ASSERT_TRUE(SetImmutable(manifest, false));
    ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  }
  EXPECT_FALSE(resaved.ok()) << "the manifest's commit did not fail";
  EXPECT_EQ(states_files(), std::vector<std::string>{"states-2.w1.rank0.bin"});
  Trainer r = Make(TestEngineConfig());
  ASSERT_TRUE(r.engine->LoadCheckpoint(ckpt).ok());
  std::vector<float> loaded(saved.size());
  ASSERT_TRUE(r.engine->ReadParam(0, loaded).ok());
  EXPECT_EQ(loaded, saved);
  // Committed re-saves alternate between the two names; each loads.
  ASSERT_TRUE(r.engine->SaveCheckpoint(ckpt).ok());
  EXPECT_EQ(states_files(), std::vector<std::string>{"states-2.w1.rank0.b.bin"});
  ASSERT_TRUE(r.engine->LoadCheckpoint(ckpt).ok());
  ASSERT_TRUE(r.engine->SaveCheckpoint(ckpt).ok());
  EXPECT_EQ(states_files(), std::vector<std::string>{"states-2.w1.rank0.bin"});
  ASSERT_TRUE(r.engine->LoadCheckpoint(ckpt).ok());
  EXPECT_TRUE(IsCheckpointStatesFileName("states-2.w1.rank0.b.bin"));
  EXPECT_FALSE(IsCheckpointStatesFileName("states-2.w1.rank0.c.bin"));
}

TEST(Engine, CheckpointOfAnotherModelIsRefusedWithEveryDifferenceAndNothingLoaded) {
  TempDir dir;
  Trainer three = Make(TestEngineConfig());  // 3 blocks, 64 wide
  Train(three, 0, 2);
  ASSERT_TRUE(three.engine->SaveCheckpoint(dir.path() + "/ckpt").ok());
  // Fewer blocks: the checkpoint's extra tensors are named, nothing is loaded.
  GptConfig two = SmallModel();
  two.n_layer = 2;
  Trainer fewer = Make(TestEngineConfig(), two);
  std::vector<float> before(static_cast<size_t>(fewer.engine->numel(0)));
  ASSERT_TRUE(fewer.engine->ReadParam(0, before).ok());
  auto bad = fewer.engine->LoadCheckpoint(dir.path() + "/ckpt");
  ASSERT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().ToString();
  const std::string m(bad.status().message());
  EXPECT_NE(m.find("another model"), std::string::npos) << m;
  EXPECT_NE(m.find("12 tensors in it the model lacks"), std::string::npos) << m;
  EXPECT_NE(m.find("h.2.attn.c_attn.bias"), std::string::npos) << m;
  std::vector<float> after(before.size());
  ASSERT_TRUE(fewer.engine->ReadParam(0, after).ok());
  EXPECT_EQ(after, before) << "a refused load changed the parameters";
  // More blocks and another width: missing tensors and other shapes, all in one message.
  GptConfig wider = SmallModel();
  wider.n_layer = 4;
  wider.d_model = 32;
  Trainer other = Make(TestEngineConfig(), wider);
  auto bad2 = other.engine->LoadCheckpoint(dir.path() + "/ckpt");
  ASSERT_EQ(bad2.status().code(), StatusCode::kInvalidArgument) << bad2.status().ToString();
  const std::string m2(bad2.status().message());
  EXPECT_NE(m2.find("12 tensors of the model missing from it"), std::string::npos) << m2;
  EXPECT_NE(m2.find("with another shape: wte (checkpoint [256,64], model [256,32])"),
            std::string::npos)
      << m2;
}

// Rewrites a safetensors file's header with `edit` (the data section is kept as it is).
void EditSafetensors(const std::string& in, const std::string& out,
                     const std::function<void(nlohmann::json&)>& edit,
                     const std::string& appended = "") {
  std::ifstream f(in, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, hlen));
  edit(header);
  const std::string h = header.dump();
  const uint64_t n = h.size();
  std::ofstream o(out, std::ios::binary | std::ios::trunc);
  o.write(reinterpret_cast<const char*>(&n), 8);
  o << h << bytes.substr(8 + hlen) << appended;
}

TEST(Engine, MalformedSafetensorsFailWholeAndLoadNothing) {
  TempDir dir;
  Trainer a = Make(TestEngineConfig());
  Train(a, 0, 2);
  const std::string good = dir.path() + "/m.safetensors";
  ASSERT_TRUE(a.engine->ExportSafetensors(good, DType::kF32).ok());
  Trainer b = Make(TestEngineConfig());
  std::vector<float> before(static_cast<size_t>(b.engine->numel(0)));
  ASSERT_TRUE(b.engine->ReadParam(0, before).ok());
  // The last tensor in file order is edited, so a loader that checks as it goes would already
  // have loaded the others.
  auto last = [](nlohmann::json& h) {
    std::string name;
    uint64_t end = 0;
    for (auto& [k, v] : h.items())
      if (k != "__metadata__" && v["data_offsets"][1].get<uint64_t>() >= end) {
        end = v["data_offsets"][1].get<uint64_t>();
        name = k;
      }
    return name;
  };
  const std::vector<std::pair<std::string, std::function<void(nlohmann::json&)>>> cases = {
      {"negative offset", [&](nlohmann::json& h) { h[last(h)]["data_offsets"][0] = -4; }},
      {"end before begin",
       [&](nlohmann::json& h) {
         auto& o = h[last(h)]["data_offsets"];
         o = {o[1], o[0]};
       }},
      {"past the data section",
       [&](nlohmann::json& h) {
         auto& o = h[last(h)]["data_offsets"];
         o = {o[0].get<uint64_t>() + 64, o[1].get<uint64_t>() + 64};
       }},
      {"wrapping around",
       [&](nlohmann::json& h) {
         h[last(h)]["data_offsets"] = {uint64_t{0xFFFFFFFFFFFFFFF0ull}, uint64_t{16}};
       }},
      {"overlapping another tensor",
       [&](nlohmann::json& h) {
         h["extra"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
       }},
      {"a shape of strings", [&](nlohmann::json& h) { h[last(h)]["shape"] = {"x"}; }},
      {"no dtype", [&](nlohmann::json& h) { h[last(h)].erase("dtype"); }},
      {"an entry that is no object", [&](nlohmann::json& h) { h["junk"] = 7; }},
  };
  // Offsets each in range, right-sized and apart, that leave bytes no tensor holds: every tensor
  // moved on by 4 bytes (4 bytes appended), or bytes after the last (the format's tensors lie
  // end to end; the first was read one element off).
  auto shift = [](nlohmann::json& h) {
    for (auto& [k, v] : h.items())
      if (k != "__metadata__")
        v["data_offsets"] = {v["data_offsets"][0].get<uint64_t>() + 4,
                             v["data_offsets"][1].get<uint64_t>() + 4};
  };
  const std::vector<std::tuple<std::string, std::function<void(nlohmann::json&)>, std::string>>
      holes = {{"every tensor 4 bytes on", shift, std::string(4, '\0')},
               {"bytes after the last tensor", [](nlohmann::json&) {}, std::string(8, '\0')}};
  for (const auto& [what, edit, appended] : holes) {
    const std::string bad = dir.path() + "/hole.safetensors";
    EditSafetensors(good, bad, edit, appended);
    Status s = b.engine->LoadSafetensors(bad);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << what << ": " << s.ToString();
    EXPECT_NE(s.message().find("hold no tensor"), std::string::npos) << s.ToString();
  }
  for (const auto& [what, edit] : cases) {
    const std::string bad = dir.path() + "/bad.safetensors";
    EditSafetensors(good, bad, edit);
    Status s = b.engine->LoadSafetensors(bad);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << what << ": " << s.ToString();
    std::vector<float> after(before.size());
    ASSERT_TRUE(b.engine->ReadParam(0, after).ok());
    EXPECT_EQ(after, before) << what << ": a refused load changed the parameters";
  }
  // The unedited file loads; so does one with empty tensors of no bytes beside the model's, a
  // dimension 0 first or last (no elements either way, however large the others).
  EditSafetensors(good, dir.path() + "/same.safetensors", [](nlohmann::json&) {});
  EXPECT_TRUE(b.engine->LoadSafetensors(dir.path() + "/same.safetensors").ok());
  EditSafetensors(good, dir.path() + "/empty.safetensors", [&](nlohmann::json& h) {
    const uint64_t end = h[last(h)]["data_offsets"][1].get<uint64_t>();
    const uint64_t big = uint64_t{1} << 32;
    h["empty.first"] = {{"dtype", "F32"}, {"shape", {0, big, big}}, {"data_offsets", {end, end}}};
    h["empty.last"] = {{"dtype", "F32"}, {"shape", {big, big, 0}}, {"data_offsets", {end, end}}};
  });
  const Status empty = b.engine->LoadSafetensors(dir.path() + "/empty.safetensors");
  EXPECT_TRUE(empty.ok()) << empty.ToString();
}

// Note [What an export refuses before writing]: what a safetensors file cannot hold as asked is
// refused before any file is written (a file that said OK had silently lost a tensor, or held
// infinities in fp16).
TEST(Engine, AnExportRefusesWhatTheFileCannotHold) {
  TempDir dir;
  {
    auto e = Engine::Create(TestEngineConfig());
    ASSERT_TRUE(e.ok());
    EXPECT_EQ((*e)->RegisterParam({"bad\xff", {4}, InitConstant(0)}).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ((*e)->RegisterParam({"__metadata__", {4}, InitConstant(0)}).status().code(),
              StatusCode::kInvalidArgument);
  }
  Trainer a = Make(TestEngineConfig());
  Train(a, 0, 1);
  Engine& e = *a.engine;
  auto refused = [&](const StatusOr<std::vector<Engine::SafetensorsShard>>& r,
                     const std::string& says) {
    ASSERT_FALSE(r.ok()) << says;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().ToString();
    EXPECT_TRUE(fs::is_empty(dir.path())) << says << ": a refused export wrote a file";
  };
  refused(
      e.ExportSafetensorsShards(
          dir.path(), "m", DType::kF32, [](const std::string&) { return std::string("same"); }, 0),
      "two parameters");
  refused(e.ExportSafetensorsShards(
              dir.path(), "m", DType::kF32,
              [](const std::string& n) { return n == "wte" ? "__metadata__" : n; }, 0),
          "the header's own key");
  refused(e.ExportSafetensorsShards(dir.path(), "../m", DType::kF32, nullptr, 0), "stem");
  refused(e.ExportSafetensorsShards(dir.path(), "", DType::kF32, nullptr, 0), "stem");
  EXPECT_EQ(e.ExportSafetensors(dir.path() + "/m.safetensors", DType::kF32, {{"step", "9"}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(e.ExportSafetensors(dir.path() + "/m.safetensors", DType::kF32, {{"k", "\xff"}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(fs::is_empty(dir.path()));
  // A weight beyond fp16's range: refused in fp16, named with its magnitude; written in bf16.
  std::vector<float> w(static_cast<size_t>(e.numel(0)), 0.5f);
  w[3] = -1e5f;
  ASSERT_TRUE(e.WriteParam(0, w).ok());
  refused(e.ExportSafetensorsShards(dir.path(), "m", DType::kF16, nullptr, 0), "100000");
  // Metadata larger than a reader takes (hunt 48: written, then unreadable).
  EXPECT_EQ(e.ExportSafetensors(dir.path() + "/m.safetensors", DType::kF32,
                                {{"big", std::string(100'000'000, 'x')}})
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(fs::is_empty(dir.path()));
  w[3] = 65504.f;  // fp16's largest: written as it is
  ASSERT_TRUE(e.WriteParam(0, w).ok());
  EXPECT_TRUE(e.ExportSafetensorsShards(dir.path(), "m", DType::kF16, nullptr, 0).ok());
}

TEST(Engine, SafetensorsRoundTrip) {
  TempDir dir;
  Trainer a = Make(TestEngineConfig());
  Train(a, 0, 3);
  ASSERT_TRUE(a.engine->ExportSafetensors(dir.path() + "/m.safetensors", DType::kF32).ok());
  ASSERT_TRUE(a.engine->ExportSafetensors(dir.path() + "/m16.safetensors", DType::kBF16).ok());
  EngineConfig other = TestEngineConfig();
  other.chunk_elems = 65536;
  Trainer b = Make(other);
  ASSERT_TRUE(b.engine->LoadSafetensors(dir.path() + "/m.safetensors").ok());
  Trainer c = Make(other);
  ASSERT_TRUE(c.engine->LoadSafetensors(dir.path() + "/m16.safetensors").ok());
  for (ParamId p = 0; p < a.engine->num_params(); ++p) {
    std::vector<float> x(static_cast<size_t>(a.engine->numel(p))), y(x.size()), z(x.size());
    ASSERT_TRUE(a.engine->ReadParam(p, x).ok());
    ASSERT_TRUE(b.engine->ReadParam(p, y).ok());
    ASSERT_TRUE(c.engine->ReadParam(p, z).ok());
    EXPECT_EQ(x, y) << a.engine->param(p).name;
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_NEAR(z[i], x[i], std::abs(x[i]) / 128 + 1e-30) << a.engine->param(p).name;
  }
  // A model of another shape refuses the file, naming the tensor.
  GptConfig wider = SmallModel();
  wider.d_model = 32;
  Trainer d = Make(other, wider);
  Status s = d.engine->LoadSafetensors(dir.path() + "/m.safetensors");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("wte"), std::string::npos) << s.ToString();
}

// Note [A save writes only over its own files], and a user_state the load would refuse: refused
// before anything is written, the directory as it was.
TEST(Engine, ASaveWritesOnlyOverItsOwnFiles) {
  TempDir dir;
  Trainer a = Make(TestEngineConfig());
  Train(a, 0, 1);
  const std::string user_file = dir.path() + "/notes.txt";
  std::ofstream(user_file) << "precious";
  auto refused = [&](const std::string& ck, const std::string& user_state,
                     const std::string& says) {
    const Status s = a.engine->SaveCheckpoint(ck, user_state);
    EXPECT_FALSE(s.ok()) << says;
    EXPECT_NE(s.message().find(says), std::string::npos) << s.ToString();
  };
  // Another program's manifest.json; one that links to a user's file; one that is a FIFO.
  const std::string foreign = dir.path() + "/foreign";
  fs::create_directories(foreign);
  std::ofstream(foreign + "/manifest.json") << R"({"my": "precious"})";
  refused(foreign, "", "is not a tierzero checkpoint's manifest");
  const std::string linked = dir.path() + "/linked";
  fs::create_directories(linked);
  fs::create_symlink(user_file, linked + "/manifest.json");
  refused(linked, "", "is not a regular file");
  std::string kept;
  std::getline(std::ifstream(user_file), kept);
  EXPECT_EQ(kept, "precious");
  const std::string fifo = dir.path() + "/fifo";
  fs::create_directories(fifo);
  ASSERT_EQ(::mkfifo((fifo + "/manifest.json").c_str(), 0600), 0);
  refused(fifo, "", "is not a regular file");
  for (const std::string& d : {foreign, linked, fifo})
    for (const auto& e : fs::directory_iterator(d))
      EXPECT_EQ(e.path().filename(), "manifest.json") << "a refused save left " << e.path();
  // A user_state the load would refuse, over a good checkpoint: refused, the checkpoint kept.
  const std::string good = dir.path() + "/good";
  ASSERT_TRUE(a.engine->SaveCheckpoint(good, R"({"n": 1})").ok());
  Train(a, 1, 2);
  refused(good, std::string(64, '[') + std::string(64, ']'), "deeper than 63 levels");
  refused(good, std::string(100000, '[') + std::string(100000, ']'), "deeper than 63 levels");
  refused(good, R"({"a": 1, "a": 2})", "twice");
  refused(good, R"({"seed": 18446744073709551617})", "beyond what 64 bits hold");
  // Larger than a manifest may be (hunt 48: saved, then refused by its own load, the good
  // checkpoint's states file removed): refused at once, or at the manifest with the states
  // file it wrote removed.
  const std::string huge(uint64_t{64} << 20, 'x');
  refused(good, "\"" + huge + "\"", "a checkpoint's manifest, which holds it, is at most");
  refused(good, "\"" + huge.substr(0, huge.size() - 16) + "\"", "a load reads");
  int states_files = 0;
  for (const auto& e : fs::directory_iterator(good))
    states_files += IsCheckpointStatesFileName(e.path().filename().string());
  EXPECT_EQ(states_files, 1) << "a refused save left its states file, or removed the good one's";
  Trainer b = Make(TestEngineConfig());
  auto loaded = b.engine->LoadCheckpoint(good);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(*loaded, R"({"n":1})");
  // 63 levels are the most it keeps, and they come back.
  const std::string deep = std::string(63, '[') + std::string(63, ']');
  ASSERT_TRUE(a.engine->SaveCheckpoint(good, deep).ok());
  loaded = b.engine->LoadCheckpoint(good);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(*loaded, deep);
}

}  // namespace
}  // namespace tierzero

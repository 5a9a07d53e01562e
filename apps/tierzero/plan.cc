// `tierzero plan`: will the run of a config fit, where will each byte live, how fast will it
// train (docs/plan.md). The GPT's trace is derived from its configuration (Gpt::DeriveTrace),
// its compute measured on a one-block model of the same shape, the machine's rates measured by
// a short calibration run and cached; Engine::Plan does the rest with the run's own code.
#include "plan.h"

#include <glob.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "plan_args.h"
#include "plan_check.h"
#include "plan_comm.h"
#include "plan_search.h"
#include "plan_trace.h"
#include "rates_cache.h"
#include "resume.h"
#include "run_dir.h"
#include "signals.h"
#include "tierzero/bytes.h"
#include "tierzero/devices.h"
#include "tierzero/files.h"
#include "tierzero/report.h"

namespace tierzero::app {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Whether the run a plan predicts computes on a GPU: its device, or `auto` where this machine has
// one (as train decides).
bool OnGpu(const RunConfig& cfg) {
  return cfg.engine.device == DeviceChoice::kCuda ||
         (cfg.engine.device == DeviceChoice::kAuto && GpuCount() > 0);
}

// A float of the report (the engine wrote it: trusted JSON).
double Number(const json& j, std::initializer_list<const char*> path) {
  const json* at = &j;
  for (const char* k : path) {
    if (!at->is_object() || !at->contains(k)) return 0;
    at = &(*at)[k];
  }
  return at->is_number() ? at->get<double>() : 0;
}

// Note [Calibrated on the device that runs]
// The rates a plan uses are measured on the device the planned run computes on: a tiny training
// run on the simulated device, or on the GPU when the run would take it (device cuda, or auto
// with a GPU here), whose report carries the rates the engine measures at its first step and
// refines after (CPU Adam, the host link, device Adam, NVMe); and then, in MeasureCompute, a
// block of the planned model timed on that device. Rates calibrated on the simulated device told
// a GPU run's plan the CPU's compute and memcpy's link, a step time off by orders of magnitude.
// The two are cached apart (RatesCachePath), and a cache of the other kind is measured again.
StatusOr<MachineRates> Calibrate(const RunConfig& cfg, bool gpu, bool* elsewhere) {
  // A directory of its own (mkdtemp), the only one removed after: a user's RUN_DIR/calibration
  // is never touched. On the disk its NVMe tier will use: under the run directory, or where that
  // does not exist yet, under its deepest existing parent, so that a plan makes no directory of
  // the run's (it made them and removed them after, and of three plans at once the one that made
  // runs/default found the others' calibrations in it: an empty runs/default was left).
  fs::path where = fs::path(cfg.output.run_dir).lexically_normal();
  std::error_code ec;
  while (!where.empty() && !fs::exists(where, ec) && where != where.parent_path())
    where = where.parent_path();
  std::string base = where.empty() ? fs::current_path(ec).string() : where.string();
  if (ec || base.empty()) base = TmpDirectory();  // (a working directory removed meanwhile)
  auto make_under = [](const std::string& under) {
    std::string made = under + "/.calibration-XXXXXX";
    if (::mkdtemp(made.data()) == nullptr) return std::make_pair(std::string(), errno);
    return std::make_pair(made, 0);
  };
  // Its swap reserves kSwap on the disk: where the run's has less room, the calibration runs
  // under $TMPDIR, as where nothing may be written (it refused with advice of the run's budgets,
  // which changed nothing: hunt 49).
  constexpr uint64_t kSwap = uint64_t{256} << 20;
  if (struct statvfs vfs{};
      ::statvfs(base.c_str(), &vfs) == 0 &&
      static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < kSwap + (kSwap / 4)) {
    const std::string other = TmpDirectory();
    struct statvfs there {};
    if (::statvfs(other.c_str(), &there) == 0 &&
        static_cast<uint64_t>(there.f_bavail) * there.f_frsize >= kSwap + (kSwap / 4)) {
      std::printf(
          "  (%s has under %s free for the calibration's swap; it runs under %s, whose disk may "
          "not be the run's NVMe disk)\n",
          cfg.output.run_dir.c_str(), FormatBytes(kSwap + kSwap / 4).c_str(), other.c_str());
      base = other;
      *elsewhere = true;
    }
  }
  auto [made, err] = make_under(base);
  if (!*elsewhere &&
      (err == EACCES || err == EROFS || err == EPERM || err == ENOSPC || err == EDQUOT)) {
    // A plan made where nothing may be written (a read-only working directory, another user's):
    // the calibration runs under $TMPDIR instead, on what may be another disk than the run's.
    std::printf(
        "  (nothing can be written under %s: %s; the calibration runs under %s, whose disk may "
        "not be the run's NVMe disk)\n",
        base.c_str(), std::strerror(err), TmpDirectory().c_str());
    base = TmpDirectory();
    *elsewhere = true;
    std::tie(made, err) = make_under(base);
  }
  if (err != 0) return ErrnoError("creating a calibration directory under " + base, err);
  std::printf("calibrating this machine's rates on its %s (a short run under %s) ...\n",
              gpu ? "GPU" : "simulated device", base.c_str());
  std::fflush(stdout);
  const std::string dir = made;
  RemoveTreeOnSignalExit(dir);  // a signal's exit does not run the destructor below
  struct RemoveAfter {
    std::string dir;
    ~RemoveAfter() {
      std::error_code e;
      fs::remove_all(dir, e);
      KeepTreeOnSignalExit(dir);
    }
  } remove_after{dir};
  fs::create_directories(dir + "/nvme", ec);
  if (ec) return IoError("creating " + dir + "/nvme: " + ec.message());
  EngineConfig ec2;
  ec2.device = gpu ? DeviceChoice::kCuda : DeviceChoice::kHost;
  ec2.device_budget = uint64_t{64} << 20;
  // States of 3.2M parameters (51 MB, past the L3 cache), half of them on NVMe.
  ec2.host_budget = uint64_t{40} << 20;
  ec2.nvme_budget = kSwap;
  ec2.nvme_path = dir + "/nvme";
  ec2.cpu_threads = cfg.engine.cpu_threads;
  gpt::GptConfig mc;
  mc.vocab = 256;
  mc.seq_len = 16;
  mc.d_model = 256;
  mc.n_layer = 4;
  mc.n_head = 4;
  std::string report;
  {
    TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec2));
    TZ_ASSIGN_OR_RETURN(auto model, gpt::Gpt::Create(*engine, mc));
    TZ_RETURN_IF_ERROR(engine->Finalize());
    gpt::Batch b;
    b.batch = 4;
    b.seq = mc.seq_len;
    for (int64_t i = 0; i < int64_t{b.batch} * b.seq; ++i) {
      b.tokens.push_back(i % mc.vocab);
      b.targets.push_back((i + 1) % mc.vocab);
      b.mask.push_back(1.0f);
    }
    for (int s = 0; s < 20; ++s) {
      TZ_RETURN_IF_ERROR(model->ForwardBackward(b).status());
      TZ_RETURN_IF_ERROR(engine->Step({1e-4f}).status());
    }
    TZ_ASSIGN_OR_RETURN(report, engine->ReportJson());
  }
  const json r = json::parse(report, nullptr, false);
  auto rate = [&](const char* k) { return Number(r, {"optimizer", "update_phase", "rates", k}); };
  MachineRates m;
  m.name = gpu ? kCachedGpu : kCachedCpu;
  m.cpu_adam_params_per_s = rate("cpu_adam_params_per_second");
  m.device_adam_params_per_s = rate("device_adam_params_per_second");
  m.h2d_bytes_per_s = rate("h2d_bytes_per_second");
  m.d2h_bytes_per_s = rate("d2h_bytes_per_second");
  m.nvme_read_bytes_per_s = rate("nvme_read_bytes_per_second");
  m.nvme_write_bytes_per_s = rate("nvme_write_bytes_per_second");
  m.nvme_duplex_bytes_per_s = rate("nvme_duplex_bytes_per_second");
  // The run's probe clears its own small buffer, which may sit in the cache; gradient shards do
  // not: 256 MiB cleared as the engine clears them (1 MiB spans over oneTBB's arena), once to
  // fault it in, then the median of three.
  {
    constexpr size_t kBytes = size_t{256} << 20, kSpan = size_t{1} << 20;
    std::vector<uint8_t> buf(kBytes, 1);
    std::vector<double> t;
    for (int round = 0; round < 3; ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      tbb::parallel_for(size_t{0}, kBytes / kSpan,
                        [&](size_t i) { std::memset(buf.data() + i * kSpan, 0, kSpan); });
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    m.host_clear_bytes_per_s = static_cast<double>(kBytes) / std::max(t[1], 1e-9);
  }
  m.device_shares_cpu = !gpu;
  if (m.cpu_adam_params_per_s <= 0 || m.h2d_bytes_per_s <= 0 || m.nvme_read_bytes_per_s <= 0)
    return InternalError("the calibration run's report has no measured rates");
  // A measurement gone wrong (a timer of zero) is not cached to spoil every later plan.
  if (Status s = ValidateMachineRates(m); !s.ok())
    return std::move(s).WithContext("the calibration measured unusable rates");
  return m;
}

// The rates a plan uses: a --rates file as given, else this machine's (cached, or calibrated on
// the device the run computes on: Note [Calibrated on the device that runs]).
StatusOr<MachineRates> LoadRates(const PlanArgs& a, const RunConfig& cfg, bool gpu) {
  if (!a.rates_path.empty() && !a.calibrate) {
    TZ_ASSIGN_OR_RETURN(const std::string text, ReadTextFile(a.rates_path, "rates file"));
    auto r = MachineRatesFromJson(text);
    if (!r.ok()) return r.status().WithContext(a.rates_path);
    return r;
  }
  const std::string cache = a.rates_path.empty() ? RatesCachePath(gpu) : a.rates_path;
  const std::optional<MachineRates> cached = CachedRates(cache);
  // A cache written by the communicator's calibration alone has no machine rates yet; one
  // measured on the other kind of device (TZ_RATES_FILE names one file for both) is measured
  // again.
  if (!a.calibrate && cached && cached->cpu_adam_params_per_s > 0 &&
      cached->device_shares_cpu == !gpu)
    return *cached;
  bool elsewhere = false;
  StatusOr<MachineRates> calibrated = Calibrate(cfg, gpu, &elsewhere);
  // The calibration is a run of its own (its budgets, its swap under the run directory), not
  // the planned run: its failure said as the run's (a full disk's "lower the NVMe budget") gave
  // advice that changed nothing (hunt 49).
  if (!calibrated.ok()) {
    const std::string where =
        elsewhere ? TmpDirectory() + " ($TMPDIR)" : "the run directory " + cfg.output.run_dir;
    return Status(calibrated.status().code(),
                  "measuring this machine's rates (a short run of its own, with up to 256 MiB "
                  "of swap under " +
                      where + "): " + std::string(calibrated.status().message()) + "; give " +
                      (elsewhere ? "TMPDIR" : "--run-dir") +
                      " a directory on a disk with room, or the rates with --rates FILE (a "
                      "calibration elsewhere writes them: TZ_RATES_FILE)");
  }
  MachineRates r = std::move(*calibrated);
  if (cached) {  // the communicator's, measured under mpirun, stay
    r.comm_bytes_per_s = cached->comm_bytes_per_s;
    r.comm_latency_s = cached->comm_latency_s;
  }
  // (NVMe rates measured under $TMPDIR, often memory, would tell every later plan a disk far
  // faster than the run's: this plan uses them, and says so; none is cached. Review 42.)
  if (elsewhere)
    std::printf("  (the rates are not cached: measured away from the run's disk)\n");
  else
    CacheRates(cache, r);
  return r;
}

// `mpirun -np N tierzero plan --calibrate`: the communicator's rates, merged into the cache.
int CalibrateComm(const PlanArgs& a, Communicator& comm) {
  const bool lead = comm.rank() == 0;
  auto fail = [&](const Status& s) {
    std::fprintf(stderr, "rank %d of %d: error: %s\n", comm.rank(), comm.size(),
                 s.ToString().c_str());
    comm.Abort(1);
  };
  if (!a.calibrate) {
    if (lead) {
      std::fprintf(stderr,
                   "error: under mpirun, tierzero plan only measures the communicator: "
                   "`mpirun -np %d tierzero plan --calibrate`; plan a run of several ranks "
                   "without mpirun: `tierzero plan --ranks %d ...`\n",
                   comm.size(), comm.size());
    }
    return 1;
  }
  if (lead) {
    std::printf("calibrating the communicator (%s, %d ranks) ...\n", comm.backend().c_str(),
                comm.size());
    std::fflush(stdout);
  }
  auto m = MeasureComm(comm);
  if (!m.ok()) fail(m.status().WithContext("timing the ranks' collectives"));
  if (!lead) return 0;
  // Merged into this machine's rates for each device its runs may take (the communicator is the
  // same for both).
  std::vector<std::string> caches;
  if (!a.rates_path.empty()) {
    caches.push_back(a.rates_path);
  } else {
    caches.push_back(RatesCachePath(false));
    if (GpuCount() > 0 && RatesCachePath(true) != caches[0]) caches.push_back(RatesCachePath(true));
  }
  std::printf("  collectives: %.1f us each + %.2f GB/s received\n", m->first * 1e6,
              m->second / 1e9);
  bool own = true;
  for (const std::string& cache : caches) {
    MachineRates r = CachedRates(cache).value_or(MachineRates{});
    if (r.name.empty()) r.name = kCachedComm;
    r.comm_latency_s = m->first;
    r.comm_bytes_per_s = m->second;
    CacheRates(cache, r);
    own = own && r.cpu_adam_params_per_s > 0;
  }
  if (!own)
    std::printf(
        "  (the machine's own rates are measured by the next `tierzero plan`, "
        "without mpirun)\n");
  return 0;
}

// The compute of each kind of moment, measured on a one-block GPT of the planned shape with
// every parameter resident: embedding, block, head forward; head, block, embedding backward;
// and the rest of a step beyond the moments and the update phase (the trainer's own work, the
// iteration's end, the gradient norm). Ranks that share this machine share its cores: the
// block is timed with the cores one rank gets (Note [Compute on a shared machine], docs/plan.md).
StatusOr<ComputeTimes> MeasureCompute(const RunConfig& cfg, int ranks_here, bool gpu) {
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  tbb::global_control threads(tbb::global_control::max_allowed_parallelism,
                              static_cast<size_t>(std::max(1, cores / std::max(1, ranks_here))));
  gpt::GptConfig mc = cfg.model;
  mc.n_layer = 1;
  EngineConfig ec;
  ec.device = gpu ? DeviceChoice::kCuda : DeviceChoice::kHost;
  ec.compute_dtype = cfg.engine.compute_dtype;
  ec.cpu_threads = cfg.engine.cpu_threads;
  const uint64_t C = static_cast<uint64_t>(mc.d_model);
  const auto block = static_cast<uint64_t>(mc.block_matmul_params());
  const uint64_t positions = mc.arch == gpt::Arch::kGpt2 ? static_cast<uint64_t>(mc.seq_len) : 0;
  const uint64_t kMaxTimed = uint64_t{1} << 29;
  // A vocabulary larger than the block (Llama 3's 128256 x 4096 is 525M parameters, the block
  // 218M) is timed at the block's size, and the head's moments scaled by the ratio: its product
  // and softmax are linear in the vocabulary.
  double head_scale = 1;
  if (static_cast<uint64_t>(mc.vocab) * C > block) {
    const int vocab = static_cast<int>(std::max<uint64_t>(256, block / C / 256 * 256));
    if (vocab < mc.vocab) {
      head_scale = static_cast<double>(mc.vocab) / vocab;
      mc.vocab = vocab;
    }
  }
  const uint64_t params = (static_cast<uint64_t>(mc.vocab) + positions) * C + block;
  if (params > kMaxTimed) {
    return FailedPreconditionError(
        "a block of this model is too large to time here; give the device's rates with --rates "
        "(device_flops_per_s, device_memory_bytes_per_s)");
  }
  ec.device_shard_budget = params * 4 + (uint64_t{64} << 20);
  // (A cap, not an allocation: the fixed buffers of chunks this large are several of them.)
  ec.host_budget = params * 64 + (uint64_t{1} << 30);
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(auto model, gpt::Gpt::Create(*engine, mc));
  TZ_ASSIGN_OR_RETURN(const WarmupTrace t, model->DeriveTrace(cfg.train.batch_size));
  uint64_t act = 0;
  for (const TraceMoment& m : t.moments) act = std::max(act, m.activation_peak);
  engine.reset();
  // The timing run holds a micro-batch's activations in the device's memory (this machine's, on
  // the simulated device): more than half of it is refused (a batch of a million rows reached 24
  // GB and the OOM killer), with the flag that skips the measurement.
  const uint64_t memory = gpu ? GpuFreeBytes(0) : ReadHostMemory().limit;
  if (act > memory / 2)
    return OutOfMemoryError("timing a micro-batch of " + std::to_string(cfg.train.batch_size) +
                            " rows needs " + FormatBytes(act) + " of activations, more than half " +
                            (gpu ? "of the GPU's free memory (" : "of this machine's memory (") +
                            FormatBytes(memory) +
                            "); plan a smaller batch, or give the rates of the machine that "
                            "will run it (--rates)");
  ec.device_budget = act + (uint64_t{16} << 20);
  TZ_ASSIGN_OR_RETURN(engine, Engine::Create(ec));
  TZ_ASSIGN_OR_RETURN(model, gpt::Gpt::Create(*engine, mc));
  TZ_RETURN_IF_ERROR(engine->Finalize());
  gpt::Batch b;
  b.batch = cfg.train.batch_size;
  b.seq = mc.seq_len;
  for (int i = 0; i < b.batch * b.seq; ++i) {
    b.tokens.push_back((i * 7) % mc.vocab);
    b.targets.push_back((i * 7 + 1) % mc.vocab);
    b.mask.push_back(1.0f);
  }
  std::vector<std::vector<double>> samples(6);
  std::vector<double> other;
  for (int s = 0; s < 7; ++s) {
    if (s >= 2) engine->ProfileNextIteration();
    const auto t0 = std::chrono::steady_clock::now();
    TZ_RETURN_IF_ERROR(model->ForwardBackward(b).status());
    TZ_RETURN_IF_ERROR(engine->Step({1e-4f}).status());
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < 2) continue;
    TZ_ASSIGN_OR_RETURN(const std::string report, engine->ReportJson());
    const json r = json::parse(report, nullptr, false);
    const json& ms = r["profile"]["moments"];
    if (!ms.is_array() || ms.size() != 6)
      return InternalError("the timing run's profile has no moments");
    double sum = 0;
    for (size_t k = 0; k < 6; ++k) {
      // The moment's compute and its Acquire's own cost (its chunks resident here): a run pays
      // that per moment, so it scales with the moments of the planned model, not the step.
      samples[k].push_back(Number(ms[k], {"compute_seconds"}) + Number(ms[k], {"wait_seconds"}));
      sum += samples[k].back();
    }
    other.push_back(wall - sum - Number(r, {"optimizer", "update_phase", "measured_seconds"}));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  ComputeTimes out;
  for (auto& v : samples) out.kinds.push_back(median(v));
  out.kinds[2] *= head_scale;  // the head, forward and backward
  out.kinds[3] *= head_scale;
  out.other_s = std::max(0.0, median(other));
  return out;
}

// The GPT's trace with each moment's measured compute (by its kind).
void SetCompute(WarmupTrace& t, const std::vector<double>& kinds, int layers) {
  const int K = static_cast<int>(t.moments.size());
  for (int k = 0; k < K; ++k) {
    int kind;
    if (k == 0)
      kind = 0;
    else if (k <= layers)
      kind = 1;
    else if (k == layers + 1)
      kind = 2;
    else if (k == layers + 2)
      kind = 3;
    else if (k < K - 1)
      kind = 4;
    else
      kind = 5;
    t.moments[static_cast<size_t>(k)].compute_seconds = kinds[static_cast<size_t>(kind)];
  }
}

}  // namespace

bool Planner::TimedFor(const RunConfig& cfg) const {
  RunConfig a = cfg, b = timed;
  a.model.n_layer = b.model.n_layer;
  a.model.seed = b.model.seed;
  return ModelJson(a) == ModelJson(b) && a.train.batch_size == b.train.batch_size &&
         a.engine.compute_dtype == b.engine.compute_dtype;
}

// One plan of a config: the GPT (or the trace file's parameters) registered on an engine that
// never finalizes.
StatusOr<PlanPrediction> Planner::Run(const RunConfig& cfg, int ranks) const {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(cfg.engine));
  PlanRequest req;
  req.rates = rates;
  req.world_size = ranks;
  req.step_other_s = other_s;
  req.ranks_per_node = ranks_per_node;
  double tokens = 0;
  if (file_trace != nullptr) {
    for (const WarmupTrace::Param& p : file_trace->params)
      TZ_RETURN_IF_ERROR(
          engine->RegisterParam({p.name, p.shape, nullptr, p.weight_decay}).status());
    req.moments = file_trace->moments;
  } else {
    TZ_ASSIGN_OR_RETURN(auto model, gpt::Gpt::Create(*engine, cfg.model));
    TZ_ASSIGN_OR_RETURN(WarmupTrace t, model->DeriveTrace(cfg.train.batch_size));
    if (!kinds.empty() && TimedFor(cfg)) SetCompute(t, kinds, cfg.model.n_layer);
    req.moments = std::move(t.moments);
    tokens = static_cast<double>(cfg.train.batch_size) * cfg.model.seq_len *
             cfg.engine.grad_accumulation * ranks;
  }
  TZ_ASSIGN_OR_RETURN(PlanPrediction p, engine->Plan(req));
  p.tokens_per_step = tokens;
  return p;
}

namespace {

int Fail(const Status& s) {
  std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int Plan(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "-h" || a == "--help") {
      std::fputs(kPlanHelp, stdout);
      return 0;
    }
  }
  // A signal ends it at once with a message: it may wait on an input (a FIFO with no writer, as
  // `cat` would) or time a block, and has nothing to save; what it was writing is removed.
  GracefulInterrupts interrupts(
      /*during_setup=*/true,
      "during the plan: it stops now (what it was writing is removed; nothing else changed)");
  auto pa = ParsePlanArgs(args);
  if (!pa.ok()) return Fail(pa.status());
  // Note [Data on standard output] (run_dir.h): the plan's text then goes to standard error.
  const std::string json_to = pa->json_path.empty() ? "" : TakeStdoutForData(pa->json_path);
  if (Status s = CheckTraceFlags(pa->trace_path, pa->rest, pa->largest); !s.ok()) return Fail(s);
  std::string config_path;
  // The run `train --resume CK` continues: its run's config, as train takes it, and the model
  // its checkpoint records (a plan of the built-in default was printed as the run's; hunt 47).
  const StatusOr<std::vector<std::string>> with_config = WithResumedRunsConfig(pa->rest);
  if (!with_config.ok()) return Fail(with_config.status());
  auto cfg = LoadRunConfig(*with_config, &config_path, /*checkpoints_model=*/false, "plan");
  if (!cfg.ok()) return Fail(cfg.status());
  if (!cfg->output.resume.empty()) {
    if (auto info = ReadCheckpointInfo(cfg->output.resume); info.ok()) {
      if (Status s = CheckSameModel(info->user_state, *cfg, cfg->output.resume); !s.ok())
        return Fail(s);
    }
  }
  // The config's ranks.ranks_per_node, unless the flag says otherwise.
  if (pa->ranks_per_node == 0) pa->ranks_per_node = cfg->ranks.ranks_per_node;
  // Budgets sized to this machine are shared by the ranks a machine holds, as train shares them
  // (ShareMachineBudgets): a plan of N ranks gave each the whole machine (review 40).
  if (cfg->machine_budgets && pa->ranks > 1) {
    const uint64_t per_node = static_cast<uint64_t>(
        pa->ranks_per_node > 0 ? std::min(pa->ranks_per_node, pa->ranks) : pa->ranks);
    EngineConfig& e = cfg->engine;
    const int gpus = GpuCount();
    const bool cuda =
        e.device == DeviceChoice::kCuda || (e.device == DeviceChoice::kAuto && gpus > 0);
    const uint64_t per_device = cuda ? (per_node + static_cast<uint64_t>(std::max(1, gpus)) - 1) /
                                           static_cast<uint64_t>(std::max(1, gpus))
                                     : per_node;
    ApplyShare(ShareOf(e, per_node, per_device),
               DeviceCollectivesChosen(e, cuda, static_cast<int>(per_node), /*asynchronous=*/true),
               e);
  }
  if (!pa->json_path.empty()) {
    // The plan is written over none of the files it reads, nor into a running run's directory
    // (said first: the more telling refusal of a path both refuse).
    // (Its data and its rates cache too: with --overwrite they were replaced by the plan.)
    std::vector<InputPath> inputs = {{"config", config_path, false},
                                     {"warm-up trace", pa->trace_path, false},
                                     {"rates file", pa->rates_path, false},
                                     {"rates cache", RatesCachePath(false), false},
                                     {"rates cache", RatesCachePath(true), false},
                                     {"text (--text)", cfg->data.text_path, false}};
    if (!cfg->data.token_path.empty()) {
      // The path as named too: a file whose name has brackets ("shard[1].bin") is that file
      // (TokenShards::Open reads it), and a glob matches it not (it was replaced: hunt 52).
      inputs.push_back({"data (--data)", cfg->data.token_path});
      glob_t g{};
      if (::glob(cfg->data.token_path.c_str(), 0, nullptr, &g) == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i) inputs.push_back({"data (--data)", g.gl_pathv[i]});
      ::globfree(&g);
    }
    if (Status s = CheckNotAnInput(pa->json_path, "--json", inputs); !s.ok()) return Fail(s);
    // A path no plan can be written to is refused now, not after the calibration.
    if (Status s = CheckOutputPath(pa->json_path, "--json"); !s.ok()) return Fail(s);
    if (Status s = CheckOutputDirectory(pa->json_path, "--json"); !s.ok()) return Fail(s);
    if (Status s = CheckNotReplacedUnasked(pa->json_path, "--json", "plan", pa->overwrite); !s.ok())
      return Fail(s);
  }
  {
    auto comm = RunCommunicator(cfg->ranks);
    if (!comm.ok()) return Fail(comm.status());
    if ((*comm)->size() > 1) return CalibrateComm(*pa, **comm);
  }
  // The data as train opens it: a plan of a run train would refuse at set-up (rows too short
  // for the addition task, a vocabulary its tokens exceed, a missing --text) said "fits" and
  // exited 0 (hunt 39).
  // (Data not on this machine is said, not refused: a run is often planned elsewhere.)
  if (pa->trace_path.empty()) {
    auto data = gpt::Dataset::Create(cfg->data, cfg->model.seq_len, cfg->model.vocab);
    if (!data.ok() && data.status().code() == StatusCode::kNotFound)
      std::fprintf(stderr, "note: the run's data is not here (%s); `tierzero train` needs it\n",
                   std::string(data.status().message()).c_str());
    else if (!data.ok())
      return Fail(std::move(data).status().WithContext(
          "the run's data (`tierzero train` would refuse this config at set-up)"));
  }
  // As train defaults it (the plan writes nothing there).
  if (cfg->engine.nvme_path.empty()) cfg->engine.nvme_path = cfg->output.run_dir + "/nvme";
  if (Status s = CheckPlannable(*cfg); !s.ok()) return Fail(s);
  WarmupTrace file_trace;
  if (!pa->trace_path.empty()) {
    auto t = ReadWarmupTrace(pa->trace_path);
    if (!t.ok()) return Fail(t.status());
    file_trace = std::move(t).value();
  }
  const bool gpu = OnGpu(*cfg);
  // (Also with --rates: the plan builds the model's trace on the run's device, whose activation
  // types it decides.)
  if (cfg->engine.device == DeviceChoice::kCuda && GpuCount() == 0) {
    return Fail(UnavailableError(
        "the run's device is 'cuda' but this machine has no usable GPU: run `tierzero plan` on "
        "the machine with the GPU (it calibrates there), or plan a run on the simulated device "
        "(--device host)"));
  }
  auto rates = LoadRates(*pa, *cfg, gpu);
  if (!rates.ok()) return Fail(rates.status().WithContext("the machine's rates"));
  Planner pl{pa->ranks_per_node,
             *rates,
             {},
             0.0,
             pa->trace_path.empty() ? nullptr : &file_trace,
             *cfg,
             {}};
  // This machine computes the model (its rates were measured here, on the run's device): time a
  // block of it there (Note [Calibrated on the device that runs]).
  const bool measured_here = pa->rates_path.empty() || pa->calibrate;
  if (pa->trace_path.empty() && (rates->device_shares_cpu || (gpu && measured_here))) {
    const int here = pa->ranks_per_node > 0 ? std::min(pa->ranks_per_node, pa->ranks) : pa->ranks;
    auto times = MeasureCompute(*cfg, here, gpu && !rates->device_shares_cpu);
    // (Rates whose device shares this CPU (the simulated device) are timed here whatever
    // --rates gives: the GPU's rates only stand in for a GPU's compute.)
    if (!times.ok() && times.status().code() == StatusCode::kFailedPrecondition &&
        rates->device_shares_cpu)
      return Fail(FailedPreconditionError(
          "timing the model's compute: a block of this model is too large to time on this CPU, "
          "which the simulated device computes on (the rates say device_shares_cpu); plan it "
          "for a GPU (--device cuda with that GPU's --rates, device_shares_cpu false), or give "
          "a warm-up trace of it (--trace FILE)"));
    if (!times.ok()) return Fail(times.status().WithContext("timing the model's compute"));
    pl.kinds = times->kinds;
    pl.other_s = times->other_s;
    pl.timed = *cfg;
    pl.time_compute = [here, gpu, shares = rates->device_shares_cpu](const RunConfig& c) {
      return MeasureCompute(c, here, gpu && !shares);
    };
  }
  auto p = pl.Run(*cfg, pa->ranks);
  if (!p.ok()) return Fail(p.status());
  if (pa->trace_path.empty()) {
    std::printf("tierzero plan: %s %d layers x %d wide, batch %d x %d tokens, %s compute\n",
                gpt::ModelName(cfg->model), cfg->model.n_layer, cfg->model.d_model,
                cfg->train.batch_size, cfg->model.seq_len,
                std::string(DTypeName(cfg->engine.compute_dtype)).c_str());
  } else {
    std::printf("tierzero plan: %zu parameters, %zu moments from %s\n", file_trace.params.size(),
                file_trace.moments.size(), pa->trace_path.c_str());
    // Note [A trace plans its own model]: a config's model section is not what is planned.
    if (ModelJson(*cfg) != ModelJson(DefaultRunConfig()) ||
        cfg->train.batch_size != DefaultRunConfig().train.batch_size)
      std::printf(
          "  (the model and batch are the trace's: the config's model section and "
          "train.batch_size are not used)\n");
  }
  std::printf(
      "  budgets: device %s, host %s, NVMe %s\n\n", FormatBytes(cfg->engine.device_budget).c_str(),
      FormatBytes(cfg->engine.host_budget).c_str(), FormatBytes(cfg->engine.nvme_budget).c_str());
  std::fputs(PlanTable(*p).c_str(), stdout);
  // Compute neither timed here nor given: a step time without it would pass for a prediction.
  if (pl.kinds.empty() && !(rates->device_flops_per_s > 0) && !TraceTimed(file_trace))
    std::printf(
        "  (the step's compute is not in it: the rates file gives no device_flops_per_s "
        "and the model is not timed here; add the device's FLOP/s and memory bytes/s to "
        "%s, or plan on that machine)\n",
        pa->rates_path.empty() ? "the rates" : pa->rates_path.c_str());
  if (std::find(p->assumed_rates.begin(), p->assumed_rates.end(), "comm_latency_s") !=
      p->assumed_rates.end()) {
    std::printf("  (measure the communicator once: mpirun -np %d tierzero plan --calibrate)\n",
                std::max(2, std::min(pa->ranks, pa->ranks_per_node > 0 ? pa->ranks_per_node : 8)));
  }
  json out = {{"schema", "tierzero.plan/1"},
              {"prediction", json::parse(PlanJson(*p), nullptr, false)}};
  // The config planned: `train --plan` and `report --plan` refuse the plan of another (Note [A
  // plan of another run], plan_check.cc). A trace's plan is of the trace's model at its batch,
  // not of a config's: it records the engine's settings alone, and train checks its layout.
  out["config"] = json::parse(RunConfigToJson(*cfg), nullptr, false);
  if (!pa->trace_path.empty()) {
    for (const char* section : {"model", "train", "data", "output"}) out["config"].erase(section);
    out["trace"] = pa->trace_path;
  }
  if (p->fits && pa->trace_path.empty()) {
    WarnNvmeSpace(*cfg, p->model_state_bytes[2], pa->ranks, pa->ranks_per_node, out);
    WarnHostMemory(*cfg, *p, pa->ranks, pa->ranks_per_node, out);
  }
  if (!p->fits && pa->advice) Advise(pl, *cfg, pa->ranks, out);
  if (pa->largest) {
    if (Status s = Largest(pl, *cfg, pa->ranks, out); !s.ok()) return Fail(s);
  } else if (pa->trace_path.empty() && pa->advice) {
    const int most = LargestModel(pl, *cfg, pa->ranks);
    if (most > 0) {
      std::printf("\nlargest model of this shape that fits these budgets: %d layer%s\n", most,
                  most == 1 ? "" : "s");
    } else {
      std::printf(
          "\nnot one layer of this width fits these budgets (tierzero plan --largest "
          "searches other widths)\n");
    }
    out["largest_n_layer"] = most;
  }
  if (!pa->json_path.empty()) {
    if (Status s = WriteTextFile(json_to, out.dump(1) + "\n"); !s.ok()) return Fail(s);
    std::printf("  json: %s\n", pa->json_path.c_str());
  }
  return 0;
}

}  // namespace tierzero::app

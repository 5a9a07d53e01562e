// `tierzero plan`'s searches (plan_search.h): each a sequence of whole plans (Planner::Run), so
// every answer is a config the engine's own placement and plan accept.
#include "plan_search.h"

#include <sys/resource.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>

#include "tierzero/bytes.h"
#include "tierzero/devices.h"

namespace tierzero::app {

using json = nlohmann::json;

namespace {

bool Fits(const Planner& pl, const RunConfig& cfg, int ranks) {
  auto p = pl.Run(cfg, ranks);
  return p.ok() && p->fits;
}

// The smallest budget of `field` (MiB steps, doubling then bisecting) with which the plan fits,
// or 0 when none up to 1 TiB does (or when none at all, 0, fits: an NVMe budget).
uint64_t SmallestBudget(const Planner& pl, RunConfig cfg, uint64_t EngineConfig::*field,
                        int ranks) {
  auto fits = [&](uint64_t v) {
    cfg.engine.*field = v;
    return Fits(pl, cfg, ranks);
  };
  uint64_t lo = cfg.engine.*field, hi = std::max<uint64_t>(lo, 1u << 20);
  // None at all (an NVMe budget of 0) may fit: the search began at 1 MiB, and advised a budget
  // of 1 MiB that holds nothing (hunt 49).
  if (lo == 0 && fits(0)) return 0;
  while (!fits(hi)) {
    lo = hi;
    hi *= 2;
    if (hi > (uint64_t{1} << 40)) return 0;
  }
  const uint64_t mib = uint64_t{1} << 20;
  while (hi - lo > mib) {
    const uint64_t mid = lo + (hi - lo) / 2 / mib * mib;
    if (mid <= lo) break;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi;
}

// The largest value of `*field` (a member of `cfg`) in [1, now) (halving) with which the plan
// fits, or 0. (`cfg` by reference: a copy left `field` changing the caller's config, so every
// trial planned the size as it was, and no --batch-size or --seq-len was ever advised: hunt 49.)
int LargestSmaller(const Planner& pl, RunConfig& cfg, int* field, int ranks) {
  for (int v = *field / 2; v >= 1; v /= 2) {
    *field = v;
    if (Fits(pl, cfg, ranks)) return v;
  }
  return 0;
}

const char* MomentName(MomentFormat f) {
  return f == MomentFormat::kF32 ? "fp32" : f == MomentFormat::kBF16 ? "bf16" : "int8";
}

// Device and host budgets raised together: for each device budget from the present one (doubling
// up to 1 TiB), the smallest host budget that fits with it; the pair that adds the fewest bytes.
bool SmallestPair(const Planner& pl, const RunConfig& cfg, int ranks, uint64_t* device,
                  uint64_t* host) {
  uint64_t best = 0;
  bool found = false;
  const uint64_t now_d = cfg.engine.device_budget, now_h = cfg.engine.host_budget;
  for (uint64_t d = std::max<uint64_t>(now_d, 1u << 20); d <= (uint64_t{1} << 40); d *= 2) {
    RunConfig c = cfg;
    c.engine.device_budget = d;
    const uint64_t h = SmallestBudget(pl, c, &EngineConfig::host_budget, ranks);
    if (h == 0) continue;
    const uint64_t added = (d - now_d) + (h > now_h ? h - now_h : 0);
    if (!found || added < best) {
      found = true;
      best = added;
      *device = d;
      *host = std::max(h, now_h);
    }
    if (found && d - now_d > best) break;  // a larger device budget alone adds more
  }
  if (!found) return false;
  // The doubling overshoots the device (4 -> 32 MiB where 21 fit): the smallest device budget
  // with that host budget, then the smallest host budget with that device budget.
  RunConfig c = cfg;
  c.engine.host_budget = *host;
  const uint64_t d = SmallestBudget(pl, c, &EngineConfig::device_budget, ranks);
  if (d > 0 && d < *device) {
    *device = std::max(d, now_d);
    c = cfg;
    c.engine.device_budget = *device;
    const uint64_t h = SmallestBudget(pl, c, &EngineConfig::host_budget, ranks);
    if (h > 0) *host = std::max(h, now_h);
  }
  return true;
}

}  // namespace

void Advise(const Planner& pl, const RunConfig& cfg, int ranks, json& out) {
  std::printf("\nwhat would make it fit (each alone):\n");
  json changes = json::array();
  struct Budget {
    const char* name;
    const char* flag;
    uint64_t EngineConfig::*field;
  } budgets[] = {{"device_budget", "--device-budget", &EngineConfig::device_budget},
                 {"host_budget", "--host-budget", &EngineConfig::host_budget},
                 {"nvme_budget", "--nvme-budget", &EngineConfig::nvme_budget}};
  // A host budget past what this process may use is said to be (train would refuse it here; the
  // run may be planned for another machine, so it is still given).
  const HostMemory machine = ReadHostMemory();
  auto beyond = [&](uint64_t host) {
    return host <= machine.limit
               ? std::string()
               : "; more than the " + FormatBytes(machine.limit) + " this process may use here";
  };
  bool a_budget = false;
  uint64_t least_host = 0;  // the least host budget said so far (0: none)
  for (const Budget& b : budgets) {
    const uint64_t now = cfg.engine.*b.field;
    const uint64_t need = SmallestBudget(pl, cfg, b.field, ranks);
    if (need == 0 || need <= now) continue;
    a_budget = true;
    if (b.field == &EngineConfig::host_budget) least_host = need;
    // (Whole MiB rounded up: the search starts from the config's budget, not a whole MiB.)
    std::printf("  %s %s (now %s: +%s%s)\n", b.flag, FormatWholeMiB(need).c_str(),
                FormatBytes(now).c_str(), FormatBytes(need - now).c_str(),
                b.field == &EngineConfig::host_budget ? beyond(need).c_str() : "");
    changes.push_back({{"field", std::string("engine.") + b.name}, {"value", need}, {"now", now}});
  }
  // The fewest ranks that fit: doubling to the first that does, then bisecting below it
  // (7 fits where the powers of two said 8).
  for (int r = ranks * 2, below = ranks; r <= 64; below = r, r *= 2) {
    if (!Fits(pl, cfg, r)) continue;
    while (r - below > 1) {
      const int mid = below + (r - below) / 2;
      (Fits(pl, cfg, mid) ? r : below) = mid;
    }
    std::printf("  %d ranks (mpirun -np %d tierzero train ...)\n", r, r);
    changes.push_back({{"field", "ranks"}, {"value", r}, {"now", ranks}});
    break;
  }
  const bool gpt = pl.file_trace == nullptr;
  if (gpt && !cfg.model.activation_checkpointing) {
    RunConfig c = cfg;
    c.model.activation_checkpointing = true;
    if (Fits(pl, c, ranks)) {
      std::printf("  --checkpoint-activations\n");
      changes.push_back(
          {{"field", "model.activation_checkpointing"}, {"value", true}, {"now", false}});
    }
  }
  for (MomentFormat f : {MomentFormat::kBF16, MomentFormat::kInt8}) {
    if (static_cast<int>(f) <= static_cast<int>(cfg.engine.optimizer_states)) continue;
    RunConfig c = cfg;
    c.engine.optimizer_states = f;
    if (Fits(pl, c, ranks)) {
      std::printf("  --optimizer-states %s (Adam's moments in %s bytes an element)\n",
                  MomentName(f), f == MomentFormat::kBF16 ? "4" : "~2.1");
      changes.push_back({{"field", "engine.optimizer_states"},
                         {"value", MomentName(f)},
                         {"now", MomentName(cfg.engine.optimizer_states)}});
      break;
    }
  }
  if (gpt) {
    RunConfig c = cfg;
    if (const int b = LargestSmaller(pl, c, &c.train.batch_size, ranks); b > 0) {
      std::printf("  --batch-size %d (now %d)\n", b, cfg.train.batch_size);
      changes.push_back(
          {{"field", "train.batch_size"}, {"value", b}, {"now", cfg.train.batch_size}});
    }
    c = cfg;
    // (Not for the addition task, whose rows are as long as its digits make them.)
    if (const int t =
            cfg.data.kind == "addition" ? 0 : LargestSmaller(pl, c, &c.model.seq_len, ranks);
        t > 0) {
      std::printf("  --seq-len %d (now %d)\n", t, cfg.model.seq_len);
      changes.push_back({{"field", "model.seq_len"}, {"value", t}, {"now", cfg.model.seq_len}});
    }
  }
  if (changes.empty()) std::printf("  (no single change up to 1 TiB a budget or 64 ranks)\n");
  bool together = false;
  if (!a_budget) {
    // No budget alone: the smallest device and host budgets together.
    uint64_t d = 0, h = 0;
    if (SmallestPair(pl, cfg, ranks, &d, &h)) {
      together = true;
      least_host = h;
      std::printf("together:\n  --device-budget %s --host-budget %s (now %s and %s%s)\n",
                  FormatWholeMiB(d).c_str(), FormatWholeMiB(h).c_str(),
                  FormatBytes(cfg.engine.device_budget).c_str(),
                  FormatBytes(cfg.engine.host_budget).c_str(), beyond(h).c_str());
      changes.push_back({{"field", "engine.device_budget+engine.host_budget"},
                         {"value", {d, h}},
                         {"now", {cfg.engine.device_budget, cfg.engine.host_budget}}});
    }
  }
  // NVMe holding what host memory does not: the least host budget (with the device budget it
  // needs) at an unbounded NVMe budget, then the least NVMe budget with those. Said where it
  // needs less host memory than the budgets above, which keep the present NVMe budget (a host
  // budget alone of 19.2 GiB where 3.7 GiB and 16.3 GiB of NVMe fit).
  {
    RunConfig c = cfg;
    c.engine.nvme_budget = std::max<uint64_t>(cfg.engine.nvme_budget, uint64_t{1} << 40);
    uint64_t d = 0, h = 0;
    // (Not when it changes the NVMe budget alone: said above.)
    if (SmallestPair(pl, c, ranks, &d, &h) && (least_host == 0 || h < least_host) &&
        (h > cfg.engine.host_budget || d != cfg.engine.device_budget)) {
      c.engine.device_budget = d;
      c.engine.host_budget = h;
      c.engine.nvme_budget = cfg.engine.nvme_budget;
      const uint64_t v = SmallestBudget(pl, c, &EngineConfig::nvme_budget, ranks);
      if (v > cfg.engine.nvme_budget) {
        const bool device = d != cfg.engine.device_budget;
        std::printf("%s  %s--host-budget %s --nvme-budget %s (NVMe holding the rest%s)\n",
                    together ? "" : "together:\n",
                    device ? ("--device-budget " + FormatWholeMiB(d) + " ").c_str() : "",
                    FormatWholeMiB(h).c_str(), FormatWholeMiB(v).c_str(), beyond(h).c_str());
        changes.push_back(
            {{"field", "engine.device_budget+engine.host_budget+engine.nvme_budget"},
             {"value", {d, h, v}},
             {"now", {cfg.engine.device_budget, cfg.engine.host_budget, cfg.engine.nvme_budget}}});
      }
    }
  }
  out["advice"] = changes;
}

namespace {

int LargestLayers(const Planner& pl, const RunConfig& cfg, int ranks, int most) {
  auto fits = [&](int layers) {
    RunConfig c = cfg;
    c.model.n_layer = layers;
    return Fits(pl, c, ranks);
  };
  if (!fits(1)) return 0;
  int lo = 1, hi = 2;
  while (hi <= most && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  hi = std::min(hi, most + 1);
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

// The GPT's parameter count (registered on an engine that never finalizes).
StatusOr<int64_t> CountParams(const RunConfig& cfg) {
  TZ_ASSIGN_OR_RETURN(auto engine, Engine::Create(cfg.engine));
  TZ_ASSIGN_OR_RETURN(auto model, gpt::Gpt::Create(*engine, cfg.model));
  return model->num_params();
}

}  // namespace

int LargestModel(const Planner& pl, const RunConfig& cfg, int ranks) {
  return LargestLayers(pl, cfg, ranks, 4096);
}

Status Largest(const Planner& pl, const RunConfig& cfg, int ranks, json& out) {
  if (pl.file_trace != nullptr) {
    return InvalidArgumentError("--largest searches the built-in GPT's shapes; not with --trace");
  }
  constexpr int kWidths[] = {128,  256,  384,  512,  768,  1024, 1536, 2048,
                             2560, 3072, 4096, 5120, 6144, 8192, 12288};
  RunConfig best = cfg;
  int64_t best_params = 0;
  // The largest model of width w (heads 64 wide) that fits: its parameters, or 0.
  auto consider = [&](int w, int heads) -> int64_t {
    RunConfig c = cfg;
    c.model.d_model = w;
    c.model.n_head = heads;
    // Grouped key/value heads in the config's proportion, as a divisor of the heads (the nearest:
    // 7 heads at a half are 7, not 1 said nowhere but the JSON; hunt 48).
    c.model.n_kv_head = 0;
    if (cfg.model.n_kv_head > 0 && cfg.model.n_head > 0) {
      const double want =
          static_cast<double>(heads) * cfg.model.n_kv_head / static_cast<double>(cfg.model.n_head);
      int nearest = 1;
      for (int d = 1; d <= heads; ++d) {
        if (heads % d == 0 && std::abs(d - want) <= std::abs(nearest - want)) nearest = d;
      }
      c.model.n_kv_head = nearest;
    }
    c.model.d_ff = 0;  // the architecture's own width for it
    // At most d_model / 64 layers (GPT-3's shapes keep under it: 96 layers at 12288): past it a
    // deeper, narrower model holds the same bytes with more activations and less arithmetic.
    const int layers = LargestLayers(pl, c, ranks, std::max(2, w / 64));
    if (layers == 0) return 0;
    c.model.n_layer = layers;
    auto n = CountParams(c);
    if (!n.ok()) return 0;
    if (*n > best_params) {
      best_params = *n;
      best = c;
    }
    return *n;
  };
  // The widths of the list first; then every multiple of 64 between the best one's neighbours
  // (3 x 192 fitted where the list's 128 and 256 gave 2 x 128).
  int misses = 0, best_at = -1;
  const int count = static_cast<int>(std::size(kWidths));
  for (int i = 0; i < count; ++i) {
    const int64_t before = best_params;
    if (consider(kWidths[i], kWidths[i] / 64) == 0) {
      if (best_params > 0 && ++misses >= 2) break;  // wider ones fit no better
      continue;
    }
    if (best_params > before) best_at = i;
  }
  // The config planned, when it fits, whatever its shape: the answer is never smaller.
  if (Fits(pl, cfg, ranks)) {
    if (auto n = CountParams(cfg); n.ok() && *n > best_params) {
      best_params = *n;
      best = cfg;
    }
  }
  if (best_at >= 0) {
    const int lo = best_at > 0 ? kWidths[best_at - 1] : 64;
    const int hi = best_at + 1 < count ? kWidths[best_at + 1] : kWidths[best_at];
    for (int w = lo + 64; w < hi; w += 64) {
      if (w != kWidths[best_at] && w >= 128) consider(w, w / 64);
    }
  }
  if (best_params == 0) {
    std::printf("\nlargest model: none of these widths (128 to 12288) fits with one layer\n");
    out["largest"] = nullptr;
    return Status::OK();
  }
  // Its compute timed for its own shape: the config's blocks are another width's.
  Planner timed = pl;
  std::string untimed;
  if (!pl.kinds.empty() && !pl.TimedFor(best) && pl.time_compute) {
    StatusOr<ComputeTimes> t = pl.time_compute(best);
    if (t.ok()) {
      timed.kinds = t->kinds;
      timed.other_s = t->other_s;
      timed.timed = best;
    } else {
      untimed = std::string(t.status().message());
    }
  }
  TZ_ASSIGN_OR_RETURN(PlanPrediction p, timed.Run(best, ranks));
  const MomentFormat f = cfg.engine.optimizer_states;
  std::printf(
      "\nlargest model these budgets train (batch %d x %d tokens, %s moments, %s compute%s):\n"
      "  %s %d layers x %d wide, %d heads%s: %.3g B parameters\n\n",
      cfg.train.batch_size, cfg.model.seq_len, MomentName(f),
      std::string(DTypeName(cfg.engine.compute_dtype)).c_str(),
      cfg.model.activation_checkpointing ? ", activation checkpointing" : "",
      gpt::ModelName(best.model), best.model.n_layer, best.model.d_model, best.model.n_head,
      best.model.kv_heads() != best.model.n_head
          ? (" (" + std::to_string(best.model.kv_heads()) +
             (best.model.kv_heads() == 1 ? " key/value head" : " key/value heads") +
             ": --kv-heads " + std::to_string(best.model.kv_heads()) + ")")
                .c_str()
          : "",
      static_cast<double>(best_params) / 1e9);
  std::fputs(PlanTable(p).c_str(), stdout);
  if (!untimed.empty())
    std::printf("  (its compute is not in the step: a block of it could not be timed here: %s)\n",
                untimed.c_str());
  out["largest"] = {{"d_model", best.model.d_model},
                    {"n_layer", best.model.n_layer},
                    {"n_head", best.model.n_head},
                    {"n_kv_head", best.model.kv_heads()},
                    {"parameters", best_params},
                    {"optimizer_states", MomentName(f)},
                    {"prediction", json::parse(PlanJson(p), nullptr, false)}};
  // (Its step without its compute, and why, where a block of it could not be timed here.)
  if (!untimed.empty()) out["largest"]["compute_not_timed"] = untimed;
  return Status::OK();
}

// plan_search.h
void WarnNvmeSpace(const RunConfig& cfg, uint64_t nvme_placed, int ranks, int ranks_per_node,
                   nlohmann::json& out) {
  // train reserves what its placement puts on NVMe when it opens the tier (Note [The NVMe space
  // reserved is what the placement puts there], src/engine/setup.cc), and refuses to start
  // where the disk has less free: said here, not only at the start of the run.
  if (nvme_placed == 0) return;
  // (The path itself, or the nearest directory above it that is there: train makes it.)
  std::string at = cfg.engine.nvme_path.empty() ? "." : cfg.engine.nvme_path;
  struct statvfs vfs {};
  while (::statvfs(at.c_str(), &vfs) != 0) {
    if (at == "/" || at == ".") {
      vfs = {};
      break;
    }
    const size_t slash = at.find_last_of('/');
    at = slash == std::string::npos ? "." : slash == 0 ? "/" : at.substr(0, slash);
  }
  const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  // Each rank on this machine reserves its own there (nvme_path/rankR).
  const uint64_t here = static_cast<uint64_t>(
      std::max(1, ranks_per_node > 0 ? std::min(ranks_per_node, ranks) : ranks));
  const uint64_t need = nvme_placed > UINT64_MAX / here ? UINT64_MAX : nvme_placed * here;
  if (vfs.f_frsize > 0 && free_bytes < need) {
    std::printf(
        "  but: train reserves what the placement puts on NVMe (%s%s) under %s when it starts, "
        "and only %s is free there: it would refuse to start. Free space there, give --nvme-path "
        "a disk with the room, or raise the host budget so less goes to NVMe\n",
        FormatBytes(need).c_str(),
        here > 1 ? (", " + std::to_string(here) + " ranks' together").c_str() : "",
        cfg.engine.nvme_path.c_str(), FormatBytes(free_bytes).c_str());
    out["nvme_free_bytes"] = free_bytes;
  }
}

// plan_search.h
void WarnHostMemory(const RunConfig& cfg, const PlanPrediction& p, int ranks, int ranks_per_node,
                    nlohmann::json& out) {
  // Train refuses what this machine cannot hold (Note [Host memory within the process's limit],
  // src/engine/setup.cc): the host tier and fixed buffers, and on the simulated device its
  // resident shards and its budget, of every rank here. Said here too, so plan and train agree.
  const bool sim = cfg.engine.device == DeviceChoice::kHost ||
                   (cfg.engine.device == DeviceChoice::kAuto && GpuCount() == 0);
  const uint64_t here = static_cast<uint64_t>(
      std::max(1, ranks_per_node > 0 ? std::min(ranks_per_node, ranks) : ranks));
  // (As train counts it: the device budget as far as every chunk gathered fills it.)
  const uint64_t all_chunks = static_cast<uint64_t>(p.chunks) * p.chunk_bytes;
  // The simulated device's memory is host memory: at least its predicted peak, activations
  // included (train's count leaves them out, not knowing them at set-up; a run the plan said
  // fit was ended by the OOM killer in a 700 MiB cgroup, its 900 MiB of activations uncounted:
  // hunt 49).
  const uint64_t sim_part =
      sim ? std::max(p.device_resident + std::min(cfg.engine.device_budget, all_chunks),
                     p.device.peak)
          : 0;
  const uint64_t rank_need = p.host.peak + sim_part;
  const uint64_t need = rank_need > UINT64_MAX / here ? UINT64_MAX : rank_need * here;
  // An address-space or data limit (`ulimit -v`, `-d`) is met by what is mapped, as train counts
  // it (Note [Host memory within the process's limit], src/engine/setup.cc): the host tier, the
  // simulated device's whole capacity, and 512 MiB for the process (plan said a run fit that
  // train then refused: hunt 49).
  for (const auto& [resource, flag] : {std::pair{RLIMIT_AS, "-v"}, std::pair{RLIMIT_DATA, "-d"}}) {
    struct rlimit lim {};
    if (::getrlimit(resource, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) continue;
    const uint64_t capacity = sim ? cfg.engine.device_budget + cfg.engine.device_shard_budget +
                                        4 * p.chunk_bytes + (uint64_t{1} << 20)
                                  : 0;
    const uint64_t mapped = p.host.peak + capacity + (uint64_t{512} << 20);
    if (mapped <= static_cast<uint64_t>(lim.rlim_cur)) continue;
    std::printf(
        "  but: the run maps at least %s (host memory%s, and 512 MiB for the process), more than "
        "this process's limit of %s (ulimit %s): train would refuse it here: raise the limit, or "
        "give smaller budgets\n",
        FormatBytes(mapped).c_str(), sim ? ", the simulated device's whole capacity" : "",
        FormatBytes(static_cast<uint64_t>(lim.rlim_cur)).c_str(), flag);
    out["address_space_limit_bytes"] = static_cast<uint64_t>(lim.rlim_cur);
    break;
  }
  const HostMemory m = ReadHostMemory();
  if (need <= m.limit) return;
  std::printf(
      "  but: the run needs at least %s of host memory here (the host tier and its fixed buffers "
      "%s%s%s), more than this process may use: %s (%s). train would refuse it on this machine: "
      "lower --host-budget%s, or plan for the machine that will run it\n",
      FormatBytes(need).c_str(), FormatBytes(p.host.peak).c_str(),
      sim ? (", the simulated device's memory " + FormatBytes(sim_part)).c_str() : "",
      here > 1 ? (" a rank, " + std::to_string(here) + " ranks").c_str() : "",
      FormatBytes(m.limit).c_str(), m.limit_source.c_str(), sim ? " or --device-budget" : "");
  out["host_memory_limit_bytes"] = m.limit;
}

}  // namespace tierzero::app

// The engine's config checked field by field before anything is allocated
// (ValidateEngineConfig): every error names the field, its value and what is accepted.
#include <cmath>
#include <cstdio>
#include <string>

#include "core/bytes.h"
#include "engine/engine_impl.h"

namespace tierzero {

Status ValidateEngineConfig(const EngineConfig& c) {
  // Named as a config file names them (engine.device_budget; zeropp.qwz_bits): the CLI's
  // config sections, EngineConfig's fields.
  auto bad = [](std::string_view field, const std::string& value, std::string_view range) {
    const std::string name =
        field.substr(0, 7) == "zeropp." ? std::string(field) : "engine." + std::string(field);
    return InvalidArgumentError("config field '" + name + "' is " + value +
                                "; accepted: " + std::string(range));
  };
  // The enumerations: a value cast from an integer out of range fell into some default branch
  // (a device of 7 ran on the host), or crashed (moment format 3 in ReadParam).
  const struct {
    const char* field;
    int value, last;
    const char* accepted;
  } enums[] = {
      {"device", static_cast<int>(c.device), static_cast<int>(DeviceChoice::kHost),
       "kAuto, kCuda or kHost"},
      {"collectives", static_cast<int>(c.collectives), static_cast<int>(CollectivePath::kDevice),
       "kAuto, kHost or kDevice"},
      {"optimizer", static_cast<int>(c.optimizer), static_cast<int>(OptimizerPlacement::kFraction),
       "kAuto, kCpu or kFraction"},
      {"speculative_step", static_cast<int>(c.speculative_step),
       static_cast<int>(SpeculativeStep::kOff), "kAuto, kOn or kOff"},
      {"optimizer_states", static_cast<int>(c.optimizer_states),
       static_cast<int>(MomentFormat::kNone), "kF32, kBF16, kInt8 or kNone"},
  };
  for (const auto& e : enums)
    if (e.value > e.last) return bad(e.field, std::to_string(e.value), e.accepted);
  // The value exactly, in bytes: rounded, 1048575 bytes read "1 MiB; accepted: at least 1 MiB".
  auto exact = [](uint64_t b) { return std::to_string(b) + " bytes"; };
  if (c.device_budget < (uint64_t{1} << 20))
    return bad("device_budget", exact(c.device_budget), "at least 1 MiB (1048576 bytes)");
  if (c.host_budget < (uint64_t{1} << 20))
    return bad("host_budget", exact(c.host_budget), "at least 1 MiB (1048576 bytes)");
  // Budgets beyond any machine are refused rather than summed into a wrapped 64-bit figure (a
  // device budget of 2^64 - 1 became a 1 MiB device): 1 EiB leaves every sum of them room.
  constexpr uint64_t kMostBudget = uint64_t{1} << 60;
  for (const auto& [field, value] :
       {std::pair<std::string_view, uint64_t>{"device_budget", c.device_budget},
        {"device_shard_budget", c.device_shard_budget},
        {"host_budget", c.host_budget},
        {"nvme_budget", c.nvme_budget}}) {
    if (value > kMostBudget)
      return bad(field, std::to_string(value) + " bytes", "at most 2^60 bytes (1 EiB)");
  }
  // A chunk's states (16 bytes an element and more) must not wrap either: 2^36 elements is a
  // chunk of 256 GiB of fp32, larger than any device.
  if (c.chunk_elems > (uint64_t{1} << 36))
    return bad("chunk_elems", std::to_string(c.chunk_elems), "0 (automatic) up to 2^36");
  if (c.nvme_budget > 0 && c.nvme_path.empty())
    return bad("nvme_path", "empty", "a directory for the swap files when nvme_budget > 0");
  if (!IsFloatType(c.compute_dtype))
    return bad("compute_dtype", std::string(DTypeName(c.compute_dtype)), "bf16, fp16 or fp32");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return bad("beta1", std::to_string(c.beta1), "[0, 1)");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return bad("beta2", std::to_string(c.beta2), "[0, 1)");
  if (!(c.eps > 0 && std::isfinite(c.eps))) return bad("eps", std::to_string(c.eps), "(0, inf)");
  if (!(c.weight_decay >= 0 && std::isfinite(c.weight_decay)))
    return bad("weight_decay", std::to_string(c.weight_decay), "[0, inf)");
  if (!(c.clip_grad_norm >= 0 && std::isfinite(c.clip_grad_norm)))
    return bad("clip_grad_norm", std::to_string(c.clip_grad_norm), "0 (off) or a positive norm");
  if (c.grad_accumulation < 1 || c.grad_accumulation > 4096)
    return bad("grad_accumulation", std::to_string(c.grad_accumulation), "1..4096");
  if (!(c.initial_loss_scale >= 1 && std::isfinite(c.initial_loss_scale)))
    return bad("initial_loss_scale", std::to_string(c.initial_loss_scale), "[1, inf)");
  if (c.loss_scale_window < 1)
    return bad("loss_scale_window", std::to_string(c.loss_scale_window), "at least 1");
  // (Unbounded, 20000 threads hung the first Step and 100000 aborted in pthread_create: hunt 48.
  // The run config's bound, docs/config.md.)
  if (c.cpu_threads < 0 || c.cpu_threads > 4096)
    return bad("cpu_threads", std::to_string(c.cpu_threads), "0 (all) to 4096");
  if (!(c.optimizer_device_fraction >= 0 && c.optimizer_device_fraction <= 1))
    return bad("optimizer_device_fraction", std::to_string(c.optimizer_device_fraction), "[0, 1]");
  // A model rate below one a second would make one update or copy take longer than any run
  // (and, near 1e-300, overflow the clock: no throttle at all); %g shows the value as given.
  auto shown = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    return std::string(b);
  };
  // (Floors a study can use: 1 byte/s made the step-0 evaluation's first copy take days, a run
  // no signal could stop but by its second one; hunt 51.)
  if (!(c.host_device_adam_rate == 0 || c.host_device_adam_rate >= 1e4) ||
      !std::isfinite(c.host_device_adam_rate))
    return bad("host_device_adam_rate", shown(c.host_device_adam_rate),
               "0 (off) or at least 1e4 parameters/s");
  if (!(c.host_link_bandwidth == 0 || c.host_link_bandwidth >= 1e6) ||
      !std::isfinite(c.host_link_bandwidth))
    return bad("host_link_bandwidth", shown(c.host_link_bandwidth),
               "0 (unthrottled) or at least 1e6 bytes/s (1 MB/s)");
  if (c.zeropp.qwz_bits != 4 && c.zeropp.qwz_bits != 8)
    return bad("zeropp.qwz_bits", std::to_string(c.zeropp.qwz_bits), "4 or 8");
  if (c.zeropp.qgz_bits != 4 && c.zeropp.qgz_bits != 8)
    return bad("zeropp.qgz_bits", std::to_string(c.zeropp.qgz_bits), "4 or 8");
  if (c.zeropp.block_elems < 64 || c.zeropp.block_elems > 4096)
    return bad("zeropp.block_elems", std::to_string(c.zeropp.block_elems), "64..4096");
  return Status::OK();
}

}  // namespace tierzero

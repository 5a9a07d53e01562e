#include "chunk/placement.h"

#include <algorithm>

#include "core/bytes.h"

namespace tierzero {

StatusOr<Placement> PlaceShards(const ChunkLayout& layout, const TierBudgets& budgets,
                                uint64_t optimizer_group_bytes, uint64_t grad_shard_bytes) {
  Placement p;
  const int n = layout.num_chunks();
  p.chunks.resize(static_cast<size_t>(n));
  p.param_shard_bytes = layout.shard_bytes();
  p.grad_shard_bytes = !budgets.grad_shards   ? 0
                       : grad_shard_bytes > 0 ? grad_shard_bytes
                                              : layout.shard_bytes();
  p.optim_shard_bytes = optimizer_group_bytes > 0
                            ? optimizer_group_bytes
                            : layout.shard_elems() * 3 * 4;  // fp32 master, m, v
  const uint64_t total =
      static_cast<uint64_t>(n) * (p.param_shard_bytes + p.grad_shard_bytes + p.optim_shard_bytes);

  // Parameter shards on the device while its shard budget lasts, in first-use order.
  uint64_t device = 0;
  for (auto& c : p.chunks) {
    if (device + p.param_shard_bytes <= budgets.device_shard_bytes) {
      c.param = Tier::kDevice;
      device += p.param_shard_bytes;
    }
  }
  // Note [Accumulating on the device for host updates]
  // With accumulation every micro-batch's gradient is added to an fp32 shard. In host memory
  // that add is the host's: on an H100 machine 1.21B elements a micro-batch (2.6 GB of bf16 read,
  // 10 GB of fp32 read and written) stretched each 72 ms backward to 167 ms, and offloaded at
  // accumulation 4 a step took 1.27 s against 0.47 s all resident (bench/RESULTS.md, gpu-speed
  // sessions 30 and 37). So with accumulation the fp32 shards take the device shard budget right
  // after the parameters, ahead of the optimizer states, from the last chunk backwards: the
  // micro-batches are added there and a gradient crosses the link once a step, when its group
  // updates (a streamed group reads it in place; the CPU's copies it over first). Per byte of
  // device memory a shard there saves more than a group's states do: 4 bytes an element save
  // `accumulation` adds of about 12 bytes of host traffic each, where 12 bytes of states save one
  // CPU Adam of about 30 (session 37 placed the states first: 27 groups' states took 8 GiB and
  // 71 of 73 shards stayed in host memory). The states then go where room is left; they land on
  // chunks whose shards are already there, both going from the last chunk backwards. Without
  // accumulation a shard stays in host memory unless its chunk updates on the device (Note
  // [Gradient shards on the device]), where the backward's copy down overlaps the compute.
  const bool device_grads = budgets.device_grads && budgets.grad_shards;
  const bool accumulating = device_grads && budgets.device_grads_accumulating;
  if (accumulating) {
    for (int c = n - 1; c >= 0; --c) {
      if (device + p.grad_shard_bytes > budgets.device_shard_bytes) break;
      p.chunks[static_cast<size_t>(c)].grad = Tier::kDevice;
      device += p.grad_shard_bytes;
    }
  }
  // Optimizer states in what is left, from the last chunk backwards.
  int on_device = 0;
  for (int c = n - 1; c >= 0 && on_device < budgets.device_optimizer_groups; --c) {
    if (device + p.optim_shard_bytes > budgets.device_shard_bytes) break;
    p.chunks[static_cast<size_t>(c)].optimizer = Tier::kDevice;
    device += p.optim_shard_bytes;
    ++on_device;
  }
  // Note [Gradient shards on the device]
  // A chunk whose parameters and optimizer states are both device-resident is updated by the
  // device's Adam, which otherwise reads the gradient back across the link: on an H100 the
  // 2.4 GB gradient of a 1.21B model went down after the backward, its norm was summed on the
  // host (37 ms) and it came back up for Adam (48 ms of a 254 ms step; bench/RESULTS.md,
  // gpu-speed). Such a chunk keeps its gradient shard in device memory when the device shard
  // budget has room after the parameters and the states, from the last chunk backwards as the
  // states are placed. Only where the reduce leaves the shard on the device (one rank, or device
  // collectives); with accumulation the micro-batches are added there (Device::AccumulateAsync).
  // Gradient shards of the chunks `take` names on the device, from the last chunk backwards
  // while the budget lasts.
  auto grads_on_device = [&](auto take) {
    for (int c = n - 1; c >= 0; --c) {
      ChunkPlacement& cp = p.chunks[static_cast<size_t>(c)];
      if (cp.grad == Tier::kDevice || !take(cp)) continue;
      if (device + p.grad_shard_bytes > budgets.device_shard_bytes) break;
      cp.grad = Tier::kDevice;
      device += p.grad_shard_bytes;
    }
  };
  if (device_grads) {
    grads_on_device([](const ChunkPlacement& cp) {
      return cp.param == Tier::kDevice && cp.optimizer == Tier::kDevice;
    });
  }
  uint64_t host = 0;
  for (const auto& c : p.chunks) {
    if (c.grad == Tier::kHost) host += p.grad_shard_bytes;
    if (c.optimizer == Tier::kHost) host += p.optim_shard_bytes;
    if (c.param == Tier::kHost) host += p.param_shard_bytes;
  }
  uint64_t nvme = 0;
  const uint64_t align = std::max<uint64_t>(budgets.nvme_alignment, 1);
  auto on_nvme = [align](uint64_t bytes) { return (bytes + align - 1) / align * align; };
  // Spill optimizer states, then parameter shards, from the last chunk backwards.
  for (int c = n - 1; c >= 0 && host > budgets.host_bytes; --c) {
    if (p.chunks[static_cast<size_t>(c)].optimizer != Tier::kHost) continue;
    p.chunks[static_cast<size_t>(c)].optimizer = Tier::kNvme;
    host -= p.optim_shard_bytes;
    nvme += on_nvme(p.optim_shard_bytes);
  }
  for (int c = n - 1; c >= 0 && host > budgets.host_bytes; --c) {
    ChunkPlacement& cp = p.chunks[static_cast<size_t>(c)];
    if (cp.param != Tier::kHost) continue;
    cp.param = Tier::kNvme;
    host -= p.param_shard_bytes;
    nvme += on_nvme(p.param_shard_bytes);
  }
  if (host > budgets.host_bytes || nvme > budgets.nvme_bytes) {
    uint64_t grads = 0;
    for (const auto& c : p.chunks) grads += c.grad == Tier::kHost ? p.grad_shard_bytes : 0;
    // What stays in host memory with everything else on NVMe (the gradients of the chunks the
    // host updates) is the host budget's alone to hold: more NVMe does not help then.
    const bool host_short = host > budgets.host_bytes;
    return OutOfMemoryError(
        "model state of " + FormatBytes(total) + " per rank (" + std::to_string(n) +
        " chunks) does not fit: device shard budget " + FormatBytes(budgets.device_shard_bytes) +
        ", host budget for shards " + FormatBytes(budgets.host_bytes) +
        (p.grad_shard_bytes > 0
             ? " (at least " + FormatBytes(grads) + " for the gradients in host memory)"
             : std::string()) +
        ", NVMe budget " + FormatBytes(budgets.nvme_bytes) + " (" + FormatBytes(nvme) +
        " needed once host memory is full); " +
        (host_short ? "what must stay in host memory (" + FormatBytes(host) +
                          ") is more than the host budget, which NVMe cannot relieve: raise the "
                          "host budget (or the device shard budget), or use more ranks"
                    : std::string("raise the NVMe or host budget, or use more ranks")));
  }
  p.bytes[static_cast<int>(Tier::kDevice)] = device;
  p.bytes[static_cast<int>(Tier::kHost)] = host;
  p.bytes[static_cast<int>(Tier::kNvme)] = nvme;
  return p;
}

namespace {

// The smallest value in (lo, hi] at which `fits` holds, a multiple of 1 MiB, given that it holds
// at `hi` and not at `lo`; the placement is monotone in each budget.
template <typename Fits>
uint64_t SmallestFitting(uint64_t lo, uint64_t hi, Fits fits) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  lo = lo / kMiB * kMiB;
  hi = (hi + kMiB - 1) / kMiB * kMiB;
  while (hi - lo > kMiB) {
    const uint64_t mid = lo + (hi - lo) / 2 / kMiB * kMiB;
    (fits(mid) ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace

std::string PlacementFitAdvice(const ChunkLayout& layout, const TierBudgets& budgets,
                               uint64_t host_fixed, uint64_t optimizer_group_bytes,
                               uint64_t grad_shard_bytes) {
  // In the user's terms: `host` is the config's host_budget, the fixed buffers included.
  auto fits = [&](uint64_t host, uint64_t nvme) {
    if (host <= host_fixed) return false;
    TierBudgets b = budgets;
    b.host_bytes = host - host_fixed;
    b.nvme_bytes = nvme;
    return PlaceShards(layout, b, optimizer_group_bytes, grad_shard_bytes).ok();
  };
  // Everything in host memory, or on NVMe, is the most either budget could need.
  const uint64_t n = static_cast<uint64_t>(layout.num_chunks());
  const uint64_t all =
      host_fixed +
      n * (layout.shard_bytes() + (grad_shard_bytes > 0 ? grad_shard_bytes : layout.shard_bytes()) +
           (optimizer_group_bytes > 0 ? optimizer_group_bytes : layout.shard_elems() * 12) +
           2 * std::max<uint64_t>(budgets.nvme_alignment, 1)) +
      (uint64_t{1} << 20);
  const uint64_t host = host_fixed + budgets.host_bytes, nvme = budgets.nvme_bytes;
  std::string host_alone, nvme_alone;
  if (host < all && fits(all, nvme)) {
    host_alone =
        "host_budget (--host-budget) " +
        FormatWholeMiB(SmallestFitting(host, all, [&](uint64_t h) { return fits(h, nvme); })) +
        " at this NVMe budget";
  }
  if (nvme < all && fits(host, all)) {
    nvme_alone =
        "nvme_budget (--nvme-budget) " +
        FormatWholeMiB(SmallestFitting(nvme, all, [&](uint64_t v) { return fits(host, v); })) +
        " at this host budget";
  }
  // The least host memory with NVMe holding the rest, and that NVMe budget: said too where it
  // needs less host memory than the host budget alone (this machine may not have that much).
  std::string both;
  if (nvme_alone.empty() && nvme < all && fits(all, all)) {
    const uint64_t h = SmallestFitting(host, all, [&](uint64_t v) { return fits(v, all); });
    // (At that host budget the present NVMe budget may do: the host budget alone said it.)
    if (!fits(h, nvme)) {
      const uint64_t v = SmallestFitting(nvme, all, [&](uint64_t x) { return fits(h, x); });
      both = "host_budget (--host-budget) " + FormatWholeMiB(h) +
             " with nvme_budget (--nvme-budget) " + FormatWholeMiB(v);
    }
  }
  std::string out;
  for (const std::string* o : {&host_alone, &nvme_alone, &both}) {
    if (o->empty()) continue;
    out += (out.empty() ? "its shards and states fit with " : ", or ") + *o;
  }
  return out;
}

std::string Placement::Summary(const TierBudgets& budgets) const {
  const uint64_t budget[3] = {budgets.device_shard_bytes, budgets.host_bytes, budgets.nvme_bytes};
  std::string out;
  for (int t = 0; t < 3; ++t) {
    int params = 0, optim = 0, grads = 0;
    for (const auto& c : chunks) {
      params += static_cast<int>(c.param) == t;
      optim += static_cast<int>(c.optimizer) == t;
      grads += static_cast<int>(c.grad) == t;
    }
    out += std::string(TierName(static_cast<Tier>(t))) + ": " + std::to_string(params) +
           " param shards, " + std::to_string(optim) + " optimizer states, " +
           std::to_string(grad_shard_bytes > 0 ? grads : 0) +
           " grad shards = " + FormatBytes(bytes[t]) + " of " + FormatBytes(budget[t]) + "\n";
  }
  return out;
}

}  // namespace tierzero

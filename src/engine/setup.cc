// Engine::Finalize: the parameters laid out in chunks and placed in tiers, the device and its
// compute stream, the NVMe tier, the ranks' collective path, the shard store, the chunk manager
// and the optimizer, and the parameters' initial values.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

#include "comm/collective.h"
#include "comm/device_collectives.h"
#include "comm/nccl.h"
#include "core/bytes.h"
#include "core/convert.h"
#include "core/logging.h"
#include "core/tunable.h"
#include "engine/engine_impl.h"
#include "offload/cuda_device.h"
#include "offload/host_sim_device.h"
#include "tierzero/devices.h"
#include "zero/zeropp.h"

namespace tierzero {

namespace {

// The chunk manager's ZeRO++ options from the config (without the shard runs and hpZ's tier).
ZeroPPOptions ZeroPPOptionsOf(const ZeroPPConfig& z) {
  ZeroPPOptions o;
  o.qwz = z.qwz;
  o.qwz_spec = {z.qwz_bits, static_cast<uint32_t>(z.block_elems)};
  o.hpz = z.hpz;
  o.qgz = z.qgz;
  o.qgz_spec = {z.qgz_bits, static_cast<uint32_t>(z.block_elems)};
  return o;
}

}  // namespace

Status Engine::Finalize() {
  Impl& im = *impl_;
  if (im.finalized) return FailedPreconditionError("Finalize called twice");
  if (!im.finalize_failed.empty())
    return FailedPreconditionError("Finalize failed before (" + im.finalize_failed +
                                   "): an engine is finalized once; create another Engine");
  if (im.params.empty()) return FailedPreconditionError("Finalize with no parameters registered");
  // (An Initializer that threw escaped Finalize and left an engine that trained on half-set
  // values: hunt 48.)
  Status s = CatchingExceptions([&] { return im.Finalize(); });
  if (!s.ok()) {
    // (Also one that failed setting the initial values: the engine is not half-usable.)
    im.finalized = false;
    im.finalize_failed = s.ToString();
  }
  return s;
}

Status Engine::Impl::Finalize() {
  Impl& im = *this;
  const EngineConfig& cfg = im.cfg;
  std::vector<TensorDesc> tensors;
  for (size_t i = 0; i < im.params.size(); ++i)
    tensors.push_back({im.params[i].name, static_cast<uint64_t>(im.numel[i])});
  LayoutOptions lo;
  lo.chunk_elems = cfg.chunk_elems;
  lo.world_size = im.comm->size();
  lo.dtype = cfg.compute_dtype;
  auto layout = ChunkLayout::Build(tensors, lo);
  if (!layout.ok()) return std::move(layout).status().WithContext("laying out the parameters");
  im.layout = std::move(layout).value();
  for (int c = 0; c < im.layout.num_chunks(); ++c)
    im.slices.push_back(im.layout.ShardSlices(c, im.comm->rank()));
  const bool cuda = im.device != nullptr
                        ? im.device->info().kind == DeviceKind::kCuda
                        : cfg.device == DeviceChoice::kCuda ||
                              (cfg.device == DeviceChoice::kAuto && CudaDeviceCount() > 0);
  ASSIGN_OR_RETURN(const bool on_device, im.ChooseCollectivePath(cuda));
  im.zeropp = im.world() > 1 && cfg.zeropp.any();
  RETURN_IF_ERROR(im.Place(on_device));
  RETURN_IF_ERROR(im.CheckHostMemory(cuda));
  // With several ranks they agree on the outcome of opening the device: what follows starts
  // collectives (MPI_Comm_dup, NCCL's setup) that a rank which failed here would never join.
  Status local = im.OpenDevice(cuda);
  if (im.world() > 1) local = AgreeOnStatus(*im.comm, local);
  RETURN_IF_ERROR(local);
  RETURN_IF_ERROR(im.CreateShards(on_device));
  RETURN_IF_ERROR(im.CreateOptimizer());
  im.finalized = true;
  return im.InitialValues();
}

// Where the ranks' collectives run. Every rank must take the same path (the device path
// duplicates the communicator, a collective call), so they agree on it.
StatusOr<bool> Engine::Impl::ChooseCollectivePath(bool cuda) {
  if (world() == 1) return false;
  // NCCL wants a GPU per rank of a node. The simulated device's stream runs MPI on its own
  // thread: the communicator must progress on its own (asynchronous()).
  const bool nccl = cuda && NcclLoadable().ok() && CudaDeviceCount() >= comm->topology().local_size;
  const bool on_device =
      cfg.collectives == CollectivePath::kDevice ||
      (cfg.collectives == CollectivePath::kAuto && (cuda ? nccl : comm->asynchronous()));
  ASSIGN_OR_RETURN(std::vector<int32_t> all,
                   AllGatherValue(*comm, static_cast<int32_t>(on_device)));
  const bool everywhere = std::all_of(all.begin(), all.end(), [](int32_t v) { return v != 0; });
  if (on_device && !everywhere) {
    // Which ranks cannot, and the reason of their kind (on the simulated device, a communicator
    // without its own progress: TZ_MPI_COMM_THREAD=0 on that rank; hunt 49 read of NCCL there).
    std::string which;
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r] == 0) which += (which.empty() ? "" : ", ") + std::to_string(r);
    TZ_LOG(kWarn, kEngine) << "rank(s) " << which << " cannot run collectives on the device ("
                           << (cuda ? "NCCL cannot load there, or a node has fewer GPUs than ranks"
                                    : "their communicator has no thread of its own: "
                                      "TZ_MPI_COMM_THREAD=0 there?")
                           << "): gathers and reductions go through host buffers on every rank "
                              "(ranks.collectives: host)";
  }
  return everywhere;
}

// For measuring what the device's gradient shards buy, and the bit-for-bit check against them.
TZ_TUNABLE(bool, kDeviceGrads, "TZ_DEVICE_GRADS", true,
           "keep the gradient shards of chunks the device's Adam updates in device memory");

static_assert(static_cast<int>(MomentFormat::kF32) == static_cast<int>(StateFormat::kF32) &&
              static_cast<int>(MomentFormat::kBF16) == static_cast<int>(StateFormat::kBF16) &&
              static_cast<int>(MomentFormat::kInt8) == static_cast<int>(StateFormat::kInt8) &&
              static_cast<int>(MomentFormat::kNone) == static_cast<int>(StateFormat::kNone));

GroupLayout OptimizerGroupLayout(const ChunkLayout& layout, MomentFormat format) {
  GroupLayout g;
  g.shard_elems = layout.shard_elems();
  g.format = static_cast<StateFormat>(format);
  if (g.format == StateFormat::kInt8) {
    size_t most = 0;
    for (int c = 0; c < layout.num_chunks(); ++c) {
      for (int r = 0; r < layout.world_size(); ++r)
        most = std::max(most, layout.ShardSlices(c, r).size());
    }
    g.scale_blocks = StateScaleCount(g.shard_elems) + most;
  }
  return g;
}

// The shards' tiers, within the budgets less the fixed host overheads (Note [Host memory
// accounting] in docs/config.md): NVMe staging for parameter reads, the optimizer's swap
// buffers, and one upload buffer. (With W > 1 staging slots hold a whole gathered chunk.)
// A pure function of the layout and the config: Engine::Plan runs it too.
StatusOr<PlacedRun> PlaceRun(const ChunkLayout& layout, const EngineConfig& cfg, bool on_device,
                             int ranks_per_node) {
  PlacedRun r;
  const int world = layout.world_size();
  r.zeropp = world > 1 && cfg.zeropp.any();
  const uint64_t chunk_bytes = layout.chunk_bytes();
  const uint64_t shard_bytes = layout.shard_bytes();
  r.staging_bytes =
      std::max<uint64_t>(2 * chunk_bytes, std::min<uint64_t>(8 * chunk_bytes, 64u << 20));
  const GroupLayout group = OptimizerGroupLayout(layout, cfg.optimizer_states);
  r.swap_slot_bytes = OptimizerStates::SwapSlotBytes(group);
  uint64_t fixed =
      r.staging_bytes + 3 * r.swap_slot_bytes + AlignUp(shard_bytes, kNvmeAlignment) +
      (world > 1 && !on_device ? 4 * AlignUp(chunk_bytes + shard_bytes, kNvmeAlignment) : 0);
  uint64_t device_shard_budget = cfg.device_shard_budget;
  if (r.zeropp && on_device && cfg.zeropp.hpz) {
    // hpZ's secondary partition: device memory when the device shard budget holds it, else
    // pinned host memory (Note [A secondary partition that is never stale] in zeropp_device.cc).
    r.hpz_bytes = HpzBytes(layout.num_chunks(), chunk_bytes, ranks_per_node);
    r.hpz_tier = device_shard_budget >= r.hpz_bytes ? Tier::kDevice : Tier::kHost;
    if (r.hpz_tier == Tier::kDevice) {
      device_shard_budget -= r.hpz_bytes;
    } else {
      fixed += AlignUp(r.hpz_bytes, kPinnedAlignment);
    }
  } else if (r.zeropp) {
    // Through host buffers ZeRO++'s staging and reduce slots replace the plain ones, and hpZ's
    // secondary partition is pinned host memory (zeropp_host.cc).
    ShardGeometry g;
    g.num_chunks = layout.num_chunks();
    g.world_size = layout.world_size();
    g.shard_elems = layout.shard_elems();
    g.dtype = layout.dtype();
    ZeroPPOptions zo = ZeroPPOptionsOf(cfg.zeropp);
    for (int c = 0; c < layout.num_chunks(); ++c) zo.shard_runs.push_back(layout.ShardRuns(c));
    ASSIGN_OR_RETURN(ZeroPPHostSlots z, ZeroPPHostSlotBytes(g, ranks_per_node, zo));
    r.hpz_bytes = z.hpz;
    r.hpz_tier = Tier::kHost;
    if (z.gather_slot > 0 && r.staging_bytes < 2 * z.gather_slot) {
      fixed += 2 * z.gather_slot - r.staging_bytes;
      r.staging_bytes = 2 * z.gather_slot;
    }
    if (z.reduce_slot > 0) {
      fixed -= 4 * AlignUp(chunk_bytes + shard_bytes, kNvmeAlignment);
      fixed += kZeroPPReduceSlots * AlignUp(z.reduce_slot, kPinnedAlignment);
    }
    fixed += AlignUp(r.hpz_bytes, kPinnedAlignment);
  }
  r.budgets = TierBudgets{device_shard_budget,
                          cfg.host_budget > fixed ? cfg.host_budget - fixed : 0, cfg.nvme_budget};
  r.budgets.nvme_alignment = kNvmeAlignment;  // as the store allocates
  // Optimizer states the device shard budget may keep (docs/optimizer.md).
  const int n = layout.num_chunks();
  switch (cfg.optimizer) {
    case OptimizerPlacement::kAuto:
      r.budgets.device_optimizer_groups = n;
      break;
    case OptimizerPlacement::kCpu:
      r.budgets.device_optimizer_groups = 0;
      break;
    case OptimizerPlacement::kFraction:
      r.budgets.device_optimizer_groups =
          static_cast<int>(std::llround(cfg.optimizer_device_fraction * n));
      break;
  }
  // The reduce leaves a shard on the device with one rank or device collectives, and ZeRO++'s
  // device reduce too; through host buffers it arrives in host memory.
  r.budgets.device_grads = kDeviceGrads.Get() && (world == 1 || on_device);
  r.budgets.device_grads_accumulating = cfg.grad_accumulation > 1;
  // Gradient shards: the compute dtype, fp32 with accumulation (ChunkManager::StoreOptions);
  // none in an engine that never steps (Note [An engine that never steps] in engine.cc).
  r.budgets.grad_shards = cfg.optimizer_states != MomentFormat::kNone;
  const uint64_t grad_bytes =
      !r.budgets.grad_shards ? 0
                             : DTypeBytes(cfg.grad_accumulation > 1 ? DType::kF32 : layout.dtype(),
                                          layout.shard_elems());
  if (cfg.host_budget <= fixed) {
    // The least budgets that place, as for a placement that fails (a host budget just above the
    // fixed buffers holds no shard yet).
    const std::string fit = PlacementFitAdvice(layout, r.budgets, fixed, group.bytes(), grad_bytes);
    return OutOfMemoryError("host_budget " + FormatBytes(cfg.host_budget) +
                            " does not cover the fixed buffers for chunks of " +
                            FormatBytes(chunk_bytes) + " (" + FormatBytes(fixed) +
                            (r.hpz_bytes > 0 && r.hpz_tier == Tier::kHost
                                 ? ", hpZ's secondary partition included"
                                 : "") +
                            "); raise host_budget (" + (fit.empty() ? "--host-budget" : fit) +
                            "), or lower chunk_elems (a chunk holds at least the largest tensor)");
  }
  auto p = PlaceShards(layout, r.budgets, group.bytes(), grad_bytes);
  if (!p.ok()) {
    Status s = std::move(p).status();
    if (s.code() == StatusCode::kOutOfMemory) {
      const std::string fit =
          PlacementFitAdvice(layout, r.budgets, fixed, group.bytes(), grad_bytes);
      if (!fit.empty()) s = OutOfMemoryError(std::string(s.message()) + "; " + fit);
    }
    return s.WithContext("placing the shards");
  }
  r.placement = std::move(p).value();
  // Note [Parameter shards on the device need its collectives]
  // Gathered through host buffers, a chunk's shards are read from host memory: one on the device
  // has no path there (ChunkManager refuses it). Refused here, where Engine::Plan places the run
  // too: `plan --ranks 2` said such a run fits, which mpirun's train then refused (hunt 51).
  if (world > 1 && !on_device) {
    for (const ChunkPlacement& c : r.placement.chunks) {
      if (c.param != Tier::kDevice) continue;
      return UnsupportedError(
          std::string("device_shard_budget ") + FormatBytes(cfg.device_shard_budget) +
          " keeps parameter shards on the device, and with several ranks their collectives run "
          "through host buffers here (" +
          (cfg.collectives == CollectivePath::kHost
               ? "ranks.collectives \"host\""
               : "ranks.collectives \"auto\", and a rank cannot run them on the device: "
                 "TZ_MPI_COMM_THREAD=0 there, or on a GPU NCCL not loadable or fewer GPUs than "
                 "ranks on a node") +
          "), which read every shard from host memory: give device_shard_budget 0 (the device "
          "then holds gathered chunks only, within device_budget), or let the collectives run "
          "on the device (ranks.collectives \"device\" or \"auto\")");
    }
  }
  return r;
}

Status Engine::Impl::Place(bool on_device) {
  ASSIGN_OR_RETURN(PlacedRun r, PlaceRun(layout, cfg, on_device, comm->topology().local_size));
  placement = std::move(r.placement);
  budgets = r.budgets;
  staging_bytes = r.staging_bytes;
  swap_slot_bytes = r.swap_slot_bytes;
  hpz_bytes = r.hpz_bytes;
  hpz_tier = r.hpz_tier;
  return Status::OK();
}

namespace {

// What the ranks sharing one memory limit have in common: the machine (its host name and this
// boot of its kernel, so two machines cloned with one name differ) and the limiting cgroup, by
// its directory and its inode (containers on the host's network share a host name, and each sees
// its own cgroup at the same path; the inode is the cgroup's own).
std::string MemoryScopeKey(const HostMemory& hm) {
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  std::string key = std::string(host) + "\n";
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char boot[64] = {};
    if (std::fgets(boot, sizeof boot, f) != nullptr) key += boot;
    std::fclose(f);
  }
  // (By its inode alone where it can be read: one cgroup seen at two mount paths is one.)
  struct stat st {};
  if (!hm.limit_scope.empty() && ::stat(hm.limit_scope.c_str(), &st) == 0)
    return key + "\n" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  return key + "\n" + hm.limit_scope;
}

}  // namespace

// Note [Host memory within the process's limit]
// Past the memory a process may use (Note [The memory a process may use], src/core) the kernel
// ends it with SIGKILL: no message, no save. Before anything is allocated the placement says
// what the run will hold in host memory: the host tier's shards and states and the fixed buffers
// the host budget sets aside (Note [Host memory accounting] in docs/config.md); on the simulated
// device also the device's memory, which is host memory: the shards and states placed there,
// and device_budget as far as its chunk cache can fill it (every chunk gathered), as a GPU's
// would (the scale run's device used 2.04 of its 2 GiB + margin; its activations come on top,
// unknown before the warm-up: a lower bound, so nothing that fits is refused). When that is over
// the limit Finalize refuses the run, with budgets that fit, leaving a margin (a tenth of the
// limit, at least 256 MiB and four chunks) for the process's code, the allocator and what the
// budgets leave out. Ranks on one machine and in one cgroup (MemoryScopeKey) add theirs
// together. A run over what is available now but under the limit is only warned of: other
// processes may free it, and swap may take it.
Status Engine::Impl::CheckHostMemory(bool cuda) {
  const HostMemory hm = ReadHostMemory();
  const uint64_t host_tier = placement.bytes[static_cast<int>(Tier::kHost)];
  const uint64_t fixed =
      cfg.host_budget > budgets.host_bytes ? cfg.host_budget - budgets.host_bytes : 0;
  const bool sim = device != nullptr ? device->info().caps.host_compute : !cuda;
  // (The device's budget as far as its chunk cache can fill it: every chunk gathered; a budget
  // far above the model, as a GPU run's config carried to export or eval here, is not held.)
  const uint64_t all_chunks = static_cast<uint64_t>(layout.num_chunks()) * layout.chunk_bytes();
  const uint64_t sim_cache = sim ? std::min(cfg.device_budget, all_chunks) : 0;
  const uint64_t sim_device =
      sim ? placement.bytes[static_cast<int>(Tier::kDevice)] + sim_cache : 0;
  const uint64_t need = host_tier + fixed + sim_device;
  uint64_t together = need;
  uint64_t sharing = 1;
  if (world() > 1) {
    const uint64_t key = std::hash<std::string>{}(MemoryScopeKey(hm));
    ASSIGN_OR_RETURN(const std::vector<uint64_t> keys, AllGatherValue(*comm, key));
    ASSIGN_OR_RETURN(const std::vector<uint64_t> needs, AllGatherValue(*comm, need));
    together = 0;
    sharing = 0;
    for (size_t r = 0; r < keys.size(); ++r) {
      if (keys[r] != key) continue;
      together += needs[r];
      ++sharing;
    }
  }
  Status s = Status::OK();
  if (together > hm.limit) {
    std::string what = "the host tier's shards and states " + FormatBytes(host_tier) +
                       ", the fixed buffers " + FormatBytes(fixed);
    if (sim) {
      what += ", and the simulated device's memory, host memory too: its shards and states " +
              FormatBytes(sim_device - sim_cache) + " and the chunks device_budget holds " +
              FormatBytes(sim_cache);
    }
    if (sharing > 1) {
      what += "; " + std::to_string(sharing) + " ranks on this machine: " + FormatBytes(together) +
              " together";
    }
    // Budgets that fit: the host budget what the limit leaves beside the simulated device's part
    // and a margin for what the budgets leave out, shared by the ranks. The margin: a 100M
    // parameter GPT on the simulated device peaked 200 MiB over its host and device budgets
    // (code, allocator, the device's margin of four chunks, the CPU's scratch).
    const uint64_t mib = uint64_t{1} << 20;
    const uint64_t margin = std::max(hm.limit / 10, 256 * mib + 4 * layout.chunk_bytes());
    const uint64_t room = hm.limit > margin ? hm.limit - margin : 0;
    const uint64_t others = sim_device * sharing;
    const uint64_t host_fits = room > others ? (room - others) / sharing / mib * mib : 0;
    std::string advice;
    if (host_fits > fixed) {
      // (In whole MiB, as a flag takes it: "20.19 GiB" is no size the flags read.)
      advice = "Give host_budget (--host-budget) at most " + std::to_string(host_fits >> 20) +
               "MiB" + (sharing > 1 ? " a rank" : "") +
               " (what does not fit goes to NVMe: nvme_budget, --nvme-budget, must hold it)";
      if (sim) advice += ", or smaller device budgets";
    } else {
      advice = std::string("Give smaller budgets (") +
               (sim ? "device_budget, device_shard_budget and " : "") +
               "host_budget; what does not fit goes to NVMe: nvme_budget must hold it)";
    }
    s = OutOfMemoryError("this run needs at least " + FormatBytes(need) + " of host memory (" +
                         what + "), more than this process may use: " + FormatBytes(hm.limit) +
                         " (" + hm.limit_source +
                         "); past it the kernel would end the process without a word. " + advice +
                         ", or run where more memory is allowed");
  }
  // An address-space or data limit (`ulimit -v`, `ulimit -d`) is met by what is reserved, not
  // touched: the simulated device maps its whole capacity at once. Under the limit by less than the
  // process's own needs, the run crashed in its first product (an mmap the math library did not
  // check: hunt 41), so that margin is kept here too.
  for (const auto& [resource, flag] : {std::pair{RLIMIT_AS, "-v"}, std::pair{RLIMIT_DATA, "-d"}}) {
    struct rlimit lim {};
    if (!s.ok() || ::getrlimit(resource, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) continue;
    const uint64_t capacity =
        sim ? cfg.device_budget + cfg.device_shard_budget + 4 * layout.chunk_bytes() + (1 << 20)
            : 0;
    const uint64_t reserved = host_tier + fixed + capacity + (uint64_t{512} << 20);
    if (reserved > static_cast<uint64_t>(lim.rlim_cur))
      s = OutOfMemoryError(
          "this run maps at least " + FormatBytes(reserved) +
          " (host memory, the simulated device's whole capacity, and 512 MiB for the process "
          "itself), more than its limit of " +
          FormatBytes(static_cast<uint64_t>(lim.rlim_cur)) + " (ulimit " + flag +
          "): raise the limit, or give smaller budgets");
  }
  if (world() > 1) return AgreeOnStatus(*comm, s);
  if (s.ok() && together > hm.available) {
    TZ_LOG(kWarn, kEngine) << "this run needs at least " << FormatBytes(together)
                           << " of host memory and " << FormatBytes(hm.available)
                           << " is available now (of " << FormatBytes(hm.limit) << ", "
                           << hm.limit_source << "): other processes hold the rest";
  }
  return s;
}

// The device (unless one was given: CreateEngineOnDevice), its compute stream and the NVMe tier.
Status Engine::Impl::OpenDevice(bool cuda) {
  const uint64_t margin = 4 * layout.chunk_bytes() + (uint64_t{1} << 20);
  if (device != nullptr) {
    // Given by the caller.
  } else if (cuda) {
    CudaDeviceOptions o;
    // A GPU per rank of a node (NCCL refuses two ranks on one device).
    o.ordinal = comm->topology().local_rank % std::max(1, CudaDeviceCount());
    o.capacity_bytes = cfg.device_budget + cfg.device_shard_budget + margin;
    ASSIGN_OR_RETURN(device, CreateCudaDevice(o));
  } else {
    HostSimOptions o;
    o.capacity_bytes = cfg.device_budget + cfg.device_shard_budget + margin;
    o.h2d_bytes_per_second = cfg.host_link_bandwidth;
    o.d2h_bytes_per_second = cfg.host_link_bandwidth;
    ASSIGN_OR_RETURN(device, CreateHostSimDevice(o));
  }
  host_compute = device->info().caps.host_compute;
  ASSIGN_OR_RETURN(compute, Stream::Create(*device, "compute"));
  if (host_compute) gate = std::make_unique<ComputeGate>(*device, compute.handle());
  if (placement.bytes[static_cast<int>(Tier::kNvme)] == 0) return Status::OK();
  // Note [The NVMe space reserved is what the placement puts there]
  // The store reserves its whole size when it opens (its file fallocated), and every extent it
  // holds is allocated once, here in the set-up, as the placement says: the shards and optimizer
  // states it puts on NVMe, each aligned as the store aligns it, none freed before the end. So
  // the store is sized to those bytes, not to the budget: a budget of 1 TiB (a bound the user
  // gives, as the host budget is) for a model of 10 GiB on NVMe reserved 1 TiB of disk, and an
  // export or evaluation of a run, which takes its budget, reserved it again under $TMPDIR.
  NvmeStoreOptions no;
  no.paths = {cfg.nvme_path};
  no.bytes_per_path = std::min(cfg.nvme_budget, placement.bytes[static_cast<int>(Tier::kNvme)]);
  no.wrap_io = nvme_wrap_io;
  auto store = NvmeStore::Open(no);
  if (!store.ok()) {
    return std::move(store).status().WithContext(
        "opening the NVMe tier under '" + cfg.nvme_path +
        "' (check the directory exists, is writable and has the room the placement puts "
        "there)");
  }
  nvme = std::move(store).value();
  return Status::OK();
}

// The device collectives (W > 1 on the device path), the shard store with every shard of this
// rank, and the chunk manager that gathers from it.
Status Engine::Impl::CreateShards(bool on_device) {
  ChunkManagerOptions co;
  co.device_budget_bytes = cfg.device_budget;
  co.grad_accumulation = cfg.grad_accumulation > 1;
  co.staging_bytes = staging_bytes;
  if (world() > 1) co.comm = comm.get();
  if (on_device) {
    DeviceCollectivesOptions dco;
    dco.node_collectives = zeropp;
    auto dc = CreateDeviceCollectives(*device, comm, dco);
    if (!dc.ok()) {
      // A config the collectives refuse (ZeRO++'s nodes of unequal size) is refused on the host
      // path too: the hint is for a device that cannot run them (hunt 40).
      const StatusCode code = dc.status().code();
      const bool config =
          code == StatusCode::kInvalidArgument || code == StatusCode::kFailedPrecondition;
      return std::move(dc).status().WithContext(
          config ? "starting the collectives on the device"
                 : "starting the collectives on the device (ranks.collectives: host avoids them)");
    }
    device_comm = std::move(dc).value();
    co.device_comm = device_comm.get();
  }
  if (cfg.host_link_bandwidth > 0) co.h2d_bytes_per_second = cfg.host_link_bandwidth;
  if (zeropp) {
    co.zeropp = ZeroPPOptionsOf(cfg.zeropp);
    co.zeropp.hpz_tier = hpz_tier;
  }
  ShardStoreOptions so = ChunkManager::StoreOptions(layout, placement, co);
  for (const ChunkPlacement& p : placement.chunks) so.optimizer_tier.push_back(p.optimizer);
  const GroupLayout group = OptimizerGroupLayout(layout, cfg.optimizer_states);
  so.optimizer_format = group.format;
  so.optimizer_scale_blocks = group.scale_blocks;
  auto s = ShardStore::Create(*device, nvme.get(), std::move(so));
  if (!s.ok()) return std::move(s).status().WithContext("allocating the shards");
  store = std::move(s).value();
  auto m = ChunkManager::Create(*device, compute.handle(), *store, layout, placement, co);
  if (!m.ok()) return std::move(m).status().WithContext("creating the chunk manager");
  cm = std::move(m).value();
  // The first planned iteration is profiled for the report.
  cm->ProfileNextIteration(&timeline, [this] { timeline.Begin(); });
  return Status::OK();
}

// The optimizer's update (src/update), and the buffer a non-host parameter shard is written
// from.
Status Engine::Impl::CreateOptimizer() {
  upload = AlignedBuffer::Allocate(AlignUp(layout.shard_bytes(), kNvmeAlignment));
  if (upload.data() == nullptr) return OutOfMemoryError("the parameter upload buffer");
  std::memset(upload.data(), 0, upload.bytes());  // padding stays zero
  UpdaterParts parts;
  parts.device = device.get();
  parts.store = store.get();
  parts.cm = cm.get();
  parts.layout = &layout;
  parts.comm = comm.get();
  parts.timeline = &timeline;
  parts.param_out = &upload;
  for (const ParamSpec& p : params) parts.weight_decay.push_back(p.weight_decay);
  UpdaterConfig uc;
  uc.adam.beta1 = cfg.beta1;
  uc.adam.beta2 = cfg.beta2;
  uc.adam.eps = cfg.eps;
  uc.weight_decay = cfg.weight_decay;
  uc.cpu_threads = cfg.cpu_threads;
  uc.compute_dtype = cfg.compute_dtype;
  uc.grad_accumulation = cfg.grad_accumulation;
  uc.placement = cfg.optimizer;
  uc.device_fraction = cfg.optimizer_device_fraction;
  uc.host_device_adam_rate = cfg.host_device_adam_rate;
  uc.speculative_step = cfg.speculative_step;
  uc.host_budget = cfg.host_budget;
  // The host budget's room after placement and the fixed buffers (Note [Host memory accounting]
  // in docs/config.md): the fixed ones are the budget less budgets.host_bytes.
  const uint64_t placed = placement.bytes[static_cast<int>(Tier::kHost)];
  uc.speculation_room_bytes = budgets.host_bytes > placed ? budgets.host_bytes - placed : 0;
  uc.host_compute = host_compute;
  uc.states = static_cast<StateFormat>(cfg.optimizer_states);
  ASSIGN_OR_RETURN(updater, Updater::Create(std::move(parts), uc));
  return Status::OK();
}

// Initial values, chunk by chunk (NVMe-resident state is never held whole in memory).
Status Engine::Impl::InitialValues() {
  const uint64_t shard_elems = layout.shard_elems();
  Status s = optimizer().Init([&](const OptimizerGroup& g) -> Status {
    std::memset(g.master, 0, optimizer().group_bytes());  // master, moments, scales
    (void)shard_elems;
    std::vector<float> whole;
    for (const ShardSlice& sl : slices[static_cast<size_t>(g.chunk)]) {
      const ParamSpec& ps = params[static_cast<size_t>(sl.tensor)];
      if (!ps.init) continue;
      const uint64_t n = layout.tensor(sl.tensor).numel;
      if (sl.numel == n) {
        ps.init(std::span<float>(g.master + sl.shard_offset, sl.numel));
        continue;
      }
      // A tensor split between ranks: its initial values are a function of the whole tensor.
      whole.resize(n);
      ps.init(whole);
      std::memcpy(g.master + sl.shard_offset, whole.data() + sl.tensor_begin, sl.numel * 4);
    }
    return UploadChunk(g.chunk, g.master);
  });
  RETURN_IF_ERROR(s);
  TZ_LOG(kInfo, kEngine) << params.size() << " parameters initialised";
  return Status::OK();
}

}  // namespace tierzero

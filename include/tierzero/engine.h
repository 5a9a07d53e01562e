// tierzero's public API: the engine a trainer embeds (DESIGN.md section 9).
//
//   auto engine = Engine::Create(config);                       // StatusOr<unique_ptr<Engine>>
//   ParamId w = *engine->RegisterParam({"h0.attn.w", {768, 2304}, InitNormal(0.02f, seed)});
//   engine->Finalize();                                         // layout, shard, place, allocate
//   for (each step) {
//     for (each micro-batch) {
//       { auto scope = engine->Acquire(layer_params, Phase::kForward);  // gathered on the device
//         const void* w_dev = scope->data(w); ... forward ... }         // released at scope end
//       { auto scope = engine->Acquire(layer_params, Phase::kBackward);
//         ... backward: dW goes to scope->grad(w) ... }
//       engine->EndIteration();
//     }
//     engine->Step({.lr = lr});                                 // clip, Adam, loss scale
//   }
//
// Parameters live in chunks whose shards the engine places on the device, in pinned host memory
// or on NVMe by the configured budgets; fp32 master weights and Adam moments live in host memory
// or on NVMe. The first iteration records which parameters each Acquire needs; later iterations
// prefetch by the plan made from it (docs/architecture.md).
//
// Data types. Gathered parameters and gradients are in the compute dtype (bf16 by default;
// fp16 or fp32 selectable). data(p) holds numel elements in row-major order.
//
// Gradients. In backward, grad(p) is where dW goes: the first backward use of p in an iteration
// writes it (overwriting whatever is there: it may be the weight itself, so finish reading the
// weight first), later backward uses of the same parameter (shared weights) add to it.
//
// Device memory. On a GPU, data(p), grad(p) and activation buffers are CUDA device pointers and
// work is ordered on compute_stream(). Without a GPU the device is simulated in host memory
// (host_compute() is true): pointers are host pointers and the trainer computes on the CPU on
// the thread that called Acquire; every Acquire returns once its parameters are in place.
//
// Several ranks (ZeRO-3; docs/zero.md). Engine::Create with a communicator of W ranks: every
// rank holds 1/W of every chunk's parameters, gradients and optimizer states, and every rank
// runs the same program: the same RegisterParam calls, iterations, Acquires and Steps, in the
// same order, each on its own data (data parallel: gradients are averaged over the ranks).
// ReadParam, ReadGrad, SaveCheckpoint, LoadCheckpoint, ExportSafetensors and Step are
// collective (every rank calls them); WriteParam and LoadSafetensors expect the same values on
// every rank. A rank whose program differs gets an error naming the ranks, not a hang.
//
// Thread-safety: an Engine is driven by one thread at a time; none of its calls are concurrent
// with each other. Scopes and activation buffers belong to that thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tierzero/communicator.h"
#include "tierzero/plan.h"
#include "tierzero/status.h"
#include "tierzero/types.h"

namespace tierzero {

// The library's version, "major.minor.patch".
const char* Version();

// Where the engine's device is: a GPU, or host memory standing in for one (HostSim), or a GPU
// when one is present and the simulated device otherwise.
enum class DeviceChoice : uint8_t { kAuto, kCuda, kHost };
// Where the ranks' gathers and gradient reductions run (W > 1; docs/zero.md).
//   kDevice: device to device; only the local shard crosses the host link. NCCL on a GPU (each
//            rank needs its own), MPI in host functions of a device stream on the simulated one.
//   kHost:   through pinned host buffers over the communicator (MPI); no device-resident shards.
//   kAuto:   kDevice, unless the device is a GPU and some rank cannot load NCCL or shares its
//            node's GPUs with more ranks than there are.
enum class CollectivePath : uint8_t { kAuto, kHost, kDevice };

// ZeRO++ (Wang et al., 2023; docs/zero.md, "ZeRO++"): three ways to cut the bytes the ranks'
// collectives move between nodes, each on or off. With several ranks on the device collective
// path; ignored with one rank.
struct ZeroPPConfig {
  // qwZ: weight gathers block-quantized to qwz_bits (8 or 4) with one scale per block.
  bool qwz = false;
  int qwz_bits = 8;
  // hpZ: each rank keeps 1/L of every gathered chunk (L ranks per node), so the gathers after
  // forward stay inside the node. Its memory comes from device_shard_budget when that has room,
  // else from the host budget (pinned).
  bool hpz = false;
  // qgZ: gradients reduced with a two-hop quantized all-to-all at qgz_bits (4 or 8).
  bool qgz = false;
  int qgz_bits = 4;
  // Elements per quantization block (64..4096); a block never spans two tensors.
  int block_elems = 256;

  bool any() const { return qwz || hpz || qgz; }
};

// Where the optimizer's groups (a chunk's shard each) update (docs/optimizer.md).
enum class OptimizerPlacement : uint8_t {
  // A cost model from rates measured at the first step: states kept on the device by
  // device_shard_budget update there; of the rest, as many stream into device memory idle during
  // the update phase as end it soonest; the others update on the CPU.
  kAuto,
  kCpu,       // every group on the CPU (states resident on the device still update there)
  kFraction,  // optimizer_device_fraction of the groups on the device, for comparison
};

// Whether a step's CPU updates may start during its last micro-batch's backward, before the
// global gradient norm is known (docs/optimizer.md, "The speculative start"). It needs the
// step's options in advance (Engine::PrepareStep); a step that clips, overflows or is called
// with other options discards the speculative updates, which never touched the live states.
enum class SpeculativeStep : uint8_t {
  // When the model's compute does not run on the CPU (a GPU) and the previous step neither
  // clipped nor was skipped.
  kAuto,
  kOn,  // whenever PrepareStep was called (tests, comparisons)
  kOff,
};

// How the optimizer's moments (Adam's m and v) are stored, on every tier they live on
// (docs/optimizer.md, "Compressed optimizer states"); the fp32 master weights stay fp32.
enum class MomentFormat : uint8_t {
  kF32,   // 8 bytes an element: as torch.optim.AdamW
  kBF16,  // 4 bytes an element, rounded stochastically
  kInt8,  // ~2.1 bytes an element: 8-bit codes in blocks of 64 with a scale per block
  // None: the engine holds the fp32 masters alone, no gradient shards, and never steps (Note [An
  // engine that never steps] in src/engine/engine.cc): for evaluating or exporting a checkpoint,
  // whose moments it does not read. Training iterations, Step, ReadGrad and SaveCheckpoint are
  // refused.
  kNone,
};

// Every field has a default; Engine::Create validates them (InvalidArgument naming the field,
// the value and the accepted range). docs/config.md documents the same fields as JSON.
struct EngineConfig {
  DeviceChoice device = DeviceChoice::kAuto;
  // Device memory for gathered chunks and activations (the plan's capacity). Default: 256 MiB.
  uint64_t device_budget = uint64_t{256} << 20;
  // Device memory for parameter shards that stay resident. Default: 0.
  uint64_t device_shard_budget = 0;
  // Host memory for parameter shards, gradients and optimizer states. Default: 2 GiB.
  uint64_t host_budget = uint64_t{2} << 30;
  // NVMe space (swap files under nvme_path) for what does not fit the host budget. Default: 0.
  // Every budget is at most 2^60 bytes (1 EiB; Engine::Create refuses more).
  uint64_t nvme_budget = 0;
  std::string nvme_path;
  // Elements per chunk; 0 chooses automatically, at most 2^36; rounded up to whole 4 KiB of every
  // rank's shard (docs/chunks.md). Default: 0.
  uint64_t chunk_elems = 0;
  // Gathered parameters and gradients: bf16, fp16 (dynamic loss scaling) or fp32.
  DType compute_dtype = DType::kBF16;
  // AdamW. Defaults: 0.9, 0.95, 1e-8, 0.1 (applied to parameters registered with weight_decay).
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  // Clip gradients to this global L2 norm; 0 turns clipping off. Default: 1.0.
  float clip_grad_norm = 1.0f;
  // Micro-batches per step (their gradients are summed, then divided by this). Default: 1.
  int grad_accumulation = 1;
  // fp16 only: the first loss scale, and good steps before it doubles. Defaults: 65536, 1000.
  float initial_loss_scale = 65536.0f;
  int loss_scale_window = 1000;
  // CPU threads for the optimizer, 0..4096; 0 uses every hardware thread. Default: 0.
  int cpu_threads = 0;
  // Where optimizer groups update (OptimizerPlacement). Default: kAuto.
  OptimizerPlacement optimizer = OptimizerPlacement::kAuto;
  // kFraction: the share of groups updated on the device, in [0, 1]. Default: 0.
  double optimizer_device_fraction = 0;
  // The speculative start. Default: kAuto.
  SpeculativeStep speculative_step = SpeculativeStep::kAuto;
  // How m and v are stored (MomentFormat), on every tier. Default: kF32.
  MomentFormat optimizer_states = MomentFormat::kF32;
  // Simulated device only: model device Adam at this many parameters/s instead of the stream
  // thread's own speed (a model for studying schedules; docs/optimizer.md). Default: 0 (off).
  double host_device_adam_rate = 0;
  // Simulated device only: host<->device copy bandwidth in bytes/s, 0 for memcpy speed.
  double host_link_bandwidth = 0;
  // Several ranks: where gathers and reductions run (CollectivePath). Default: kAuto.
  CollectivePath collectives = CollectivePath::kAuto;
  // Several ranks: ZeRO++ (ZeroPPConfig). Default: all off.
  ZeroPPConfig zeropp;
};

class Engine;

// Fills a parameter's initial values (fp32, numel elements, row-major). One that throws fails
// Finalize with the exception's message as its Status (the engine is then not usable).
using Initializer = std::function<void(std::span<float> values)>;
// N(0, stddev^2) from a counter-based generator: the value of element i depends only on
// (seed, i), never on chunking or thread count.
Initializer InitNormal(float stddev, uint64_t seed);
Initializer InitConstant(float value);

struct ParamSpec {
  std::string name;            // unique; used by checkpoints and exports
  std::vector<int64_t> shape;  // every dimension >= 1
  Initializer init;            // default: zeros
  bool weight_decay = true;    // AdamW decay applies (conventionally off for biases and norms)
};

// Device memory for non-model data (activations, workspaces), counted exactly so the plan knows
// what is left for chunks at every moment. Move-only; freed on destruction.
class ActivationBuffer {
 public:
  ActivationBuffer() = default;
  ActivationBuffer(ActivationBuffer&& o) noexcept;
  ActivationBuffer& operator=(ActivationBuffer&& o) noexcept;
  ActivationBuffer(const ActivationBuffer&) = delete;
  ActivationBuffer& operator=(const ActivationBuffer&) = delete;
  ~ActivationBuffer();
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void Reset();

 private:
  friend class Engine;
  class Owner;
  ActivationBuffer(Owner* owner, std::weak_ptr<const void> alive, void* data, uint64_t bytes)
      : owner_(owner), alive_(std::move(alive)), data_(data), bytes_(bytes) {}
  Owner* owner_ = nullptr;
  std::weak_ptr<const void> alive_;  // expired once the engine is gone
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
};

// Acquired parameters; released when destroyed (or by Release, which reports errors). A scope
// (or an ActivationBuffer) may outlive its Engine: the engine freed what it held, and releasing
// it then does nothing. AbortIteration with scopes still open finishes when the last of them is
// released (Note [An iteration aborted with scopes open], engine.cc).
class ParamScope {
 public:
  ParamScope(ParamScope&& o) noexcept;
  ParamScope& operator=(ParamScope&&) = delete;
  ParamScope(const ParamScope&) = delete;
  ~ParamScope();
  // Parameter values on the device; nullptr for a parameter not in this scope.
  void* data(ParamId p) const;
  // Where p's gradient goes (backward scopes only; nullptr otherwise).
  void* grad(ParamId p) const;
  Status Release();

 private:
  friend class Engine;
  ParamScope(Engine* engine, std::weak_ptr<const void> alive, std::vector<ParamId> params,
             Phase phase)
      : engine_(engine), alive_(std::move(alive)), params_(std::move(params)), phase_(phase) {}
  Engine* engine_ = nullptr;
  std::weak_ptr<const void> alive_;  // expired once the engine is gone
  std::vector<ParamId> params_;
  Phase phase_;
};

struct StepOptions {
  float lr = 1e-3f;  // this step's learning rate (the trainer's schedule)
};

struct StepResult {
  bool applied = false;  // false: a non-finite gradient skipped the step (fp16: scale halved)
  double grad_norm = 0;  // global L2 norm of the (unscaled, averaged) gradient, before clipping
  float loss_scale = 1;  // the scale for the next step's loss
  int64_t step = 0;      // optimizer steps applied so far
  double seconds = 0;    // wall time of the step (reductions, norm, Adam, uploads)
};

// Bytes in use per tier, now and at their peak.
struct TierUsage {
  uint64_t device = 0, device_peak = 0;
  uint64_t host = 0;
  uint64_t nvme = 0;
  uint64_t device_capacity = 0, host_budget = 0, nvme_budget = 0;
};

// Counters since Finalize.
struct EngineStats {
  uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
  uint64_t hits = 0, misses = 0, prefetches = 0, evictions = 0, plans = 0, deviations = 0;
  double acquire_wait_seconds = 0;  // the caller waited in Acquire for parameters
  // The caller waited for the update phase's CPU groups, which finish behind the next forward
  // (docs/optimizer.md): a gather waiting for its chunk's update, the first backward for the
  // rest. Not in acquire_wait_seconds.
  double update_wait_seconds = 0;
  double optimizer_seconds = 0;  // in Step
  double optimizer_nvme_seconds = 0;
  // The update phase's assignment at the last step: groups on the CPU, resident on the device,
  // streamed to the device; its predicted and measured seconds.
  int optimizer_cpu_groups = 0, optimizer_resident_groups = 0, optimizer_streamed_groups = 0;
  double optimizer_predicted_seconds = 0, optimizer_phase_seconds = 0;
  // The speculative start: groups whose speculative update the last step used; steps that used
  // one; steps that discarded theirs (clipping, a non-finite gradient, other options).
  int speculative_groups = 0;
  uint64_t speculative_steps = 0, speculative_rollbacks = 0;
  // Several ranks: collectives this rank started, the bytes it sent (NCCL tests' convention),
  // and the seconds its thread spent in them.
  uint64_t collectives = 0, comm_bytes = 0;
  double comm_seconds = 0;
  // Several ranks: the gathers of parameters (a chunk's first of an iteration, its later ones)
  // and the gradient reductions.
  WireBytes param_gather, param_regather, grad_reduce;
  int64_t steps = 0, skipped_steps = 0;
  // The median of the seconds between the ends of consecutive Steps, over the last 256: a
  // whole step as the trainer runs it (its own work, evaluations included). 0 before two steps.
  double step_seconds_median = 0;
};

// What a checkpoint's manifest says, read without loading its states (Engine::LoadCheckpoint
// loads them): NotFound for a directory without a manifest, DataLoss for a damaged one.
struct CheckpointInfo {
  int64_t step = 0;        // optimizer steps applied when it was saved
  int world_size = 1;      // ranks that saved it (it loads into any number)
  std::string user_state;  // the trainer's JSON; empty when none was saved
};
StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& dir);
// Whether a file name is one a checkpoint gives its states files,
// "states-<step>.w<world>.rank<r>.bin" (or "...rank<r>.b.bin": Note [A re-save never renames
// over its manifest's], engine/checkpoint.cc): a save removes only such files of earlier saves.
bool IsCheckpointStatesFileName(const std::string& name);

// Device memory is handed out in multiples of this many bytes (a model deriving its trace rounds
// each activation as the engine does: Gpt::DeriveTrace).
inline constexpr uint64_t kDeviceAllocationAlignment = 256;
inline constexpr uint64_t DeviceAllocationBytes(uint64_t bytes) {
  return (bytes + kDeviceAllocationAlignment - 1) / kDeviceAllocationAlignment *
         kDeviceAllocationAlignment;
}

class Engine {
 public:
  // InvalidArgument naming the field for a bad config; Unavailable when a GPU was asked for and
  // there is none.
  static StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config,
                                                  std::shared_ptr<Communicator> comm = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a parameter; call in the order of first use (forward order). Before Finalize.
  // Its name is unique, UTF-8 (it is written into JSON: manifests, reports, safetensors) and not
  // "__metadata__"; InvalidArgument otherwise.
  StatusOr<ParamId> RegisterParam(ParamSpec spec);
  // Lays parameters out in chunks, places the shards by the budgets (OutOfMemory naming the
  // tier and what to raise when they do not fit), allocates, and initialises every parameter.
  Status Finalize();
  // Predicts the run from the registered parameters and a training iteration's trace, without
  // allocating (tierzero/plan.h, docs/plan.md). Before Finalize. A run that would not fit is a
  // prediction with fits false and the engine's own error, not an error.
  StatusOr<PlanPrediction> Plan(const PlanRequest& request) const;
  // The training iteration the current chunk plan was made from, with every parameter, as a
  // trace a later Plan (or `tierzero plan --trace`) reads. FailedPrecondition before a plan.
  StatusOr<WarmupTrace> RecordedTrace() const;

  // A training iteration (one micro-batch: forward, then backward) or an evaluation (forward
  // only; the gradients and the plan are untouched). An Acquire outside an iteration begins a
  // training one.
  Status BeginIteration(bool train = true);
  StatusOr<ParamScope> Acquire(std::span<const ParamId> params, Phase phase);
  // Ends the iteration: the last gradients are reduced (and accumulated).
  Status EndIteration();
  // Ends an iteration that failed part-way (the trainer's error path): it does not count as a
  // micro-batch, and its partial gradients never reach an optimizer step (with accumulation the
  // whole accumulation window is dropped, since the partial gradient is already summed in).
  Status AbortIteration();
  // Ends an open iteration, then: global gradient norm, non-finite check (fp16: loss scale
  // update), clipping, AdamW on every shard wherever its state lives, and the new compute-dtype
  // parameters written to their shards. A skipped step changes no state but the loss scale.
  // FailedPrecondition before grad_accumulation iterations have ended since the last step.
  StatusOr<StepResult> Step(const StepOptions& options);
  // Optional: the options the next Step will be called with, given before its last micro-batch
  // begins, so that micro-batch's backward may start the CPU's updates as each chunk's gradient
  // completes (EngineConfig::speculative_step). A Step with other options, one that clips or
  // one with a non-finite gradient updates as if this had not been called: exactly the same.
  Status PrepareStep(const StepOptions& options);

  // Non-model device memory. The device hands memory out in multiples of
  // kDeviceAllocationAlignment: an activation of n bytes takes DeviceAllocationBytes(n) of the
  // budget, and activation_bytes() (the trace, the report) counts that.
  StatusOr<ActivationBuffer> AllocateActivation(uint64_t bytes);
  uint64_t activation_bytes() const;

  // Whether the trainer computes on the CPU (the simulated device); before Finalize, whether it
  // will (the device the configuration picks).
  bool host_compute() const;
  void* compute_stream() const;  // cudaStream_t on a GPU, nullptr otherwise
  DType compute_dtype() const;
  float loss_scale() const;  // multiply the loss (its gradient) by this before backward
  const EngineConfig& config() const;
  int num_params() const;
  // p must be a registered id (0..num_params() - 1): another ends the process with a message.
  const ParamSpec& param(ParamId p) const;
  int64_t numel(ParamId p) const;
  int64_t step() const;  // optimizer steps applied

  // fp32 master values of a parameter (between iterations).
  Status ReadParam(ParamId p, std::span<float> out);
  // The gradient the last training iterations left for a parameter, as fp32: what Step would
  // use before unscaling, averaging and clipping (between iterations, before Step).
  Status ReadGrad(ParamId p, std::span<float> out);
  // Replaces a parameter's master values (and its compute-dtype copy); Adam state is kept.
  Status WriteParam(ParamId p, std::span<const float> values);

  // Checkpoints: a directory with this rank's states (fp32 master, m, v per parameter, with
  // CRC32C checksums), written atomically (each file to a temporary name, fsync, rename; the
  // manifest last), and `user_state` (the trainer's own JSON: data position, RNG) stored in the
  // manifest. LoadCheckpoint restores everything (matching parameters by name and shape; the
  // chunk size may differ) and returns user_state. DataLoss for a checksum mismatch, NotFound
  // for a directory without a manifest. A save is between Steps: inside an iteration, or after
  // training iterations not yet stepped (an accumulation window), it is FailedPrecondition; a
  // manifest over 64 MiB (a user_state that large, or some 300,000 tensor slices) is
  // InvalidArgument: it would not load.
  Status SaveCheckpoint(const std::string& dir, const std::string& user_state = "") const;
  StatusOr<std::string> LoadCheckpoint(const std::string& dir);
  // A consolidated safetensors file of the master weights as fp32 or bf16, and loading
  // parameters (by name) from one: missing or mis-shaped tensors are errors.
  // `metadata` joins the file's __metadata__ (beside format, producer and step, which it may not
  // replace; keys and values UTF-8, else InvalidArgument before anything is written).
  Status ExportSafetensors(const std::string& path, DType dtype,
                           const std::map<std::string, std::string>& metadata = {}) const;
  Status LoadSafetensors(const std::string& path);

  // The general forms. `names` gives a parameter's tensor name in the files (null: its own).
  // Loading reads every file's header, checked whole, before any parameter changes; each
  // parameter's tensor (F32, BF16 or F16) is read from whichever file holds it, converted and
  // written, one tensor at a time (a checkpoint larger than host memory loads); tensors the
  // model does not name are skipped and counted in `skipped` (may be null). Tensors holding NaN
  // or infinite values load as they are, named with their count in `non_finite` (may be null:
  // then a warning is logged), "name (N of M)": a trainer refuses to start from them.
  using TensorNames = std::function<std::string(const std::string& param_name)>;
  Status LoadSafetensors(const std::vector<std::string>& files, const TensorNames& names,
                         std::vector<std::string>* skipped = nullptr,
                         std::vector<std::string>* non_finite = nullptr);
  // Writes the master weights in `dtype` (fp32, bf16, fp16) as files of at most about
  // `max_shard_bytes` of tensors each (0: one file), dir/`stem`.safetensors when one file, else
  // dir/`stem`-0000i-of-0000n.safetensors (Hugging Face's names); returns each file's name
  // (within dir) with the tensors it holds; metadata {"format": "pt"} as transformers writes. Each
  // file is written atomically (Note [Writing outputs]); a failure leaves the files already
  // written and says which. `planned`, when given, is told the files before any is written (a
  // caller that must remove them if the process ends part way registers them there).
  // Refused, leaving no file (InvalidArgument): a stem that is no file name, two
  // parameters `names` maps to one tensor name, a name that is empty, not UTF-8 or
  // "__metadata__", and in fp16 a weight beyond its range (65504: it would be written as inf).
  struct SafetensorsShard {
    std::string file;
    std::vector<std::string> tensors;
    uint64_t bytes = 0;
  };
  StatusOr<std::vector<SafetensorsShard>> ExportSafetensorsShards(
      const std::string& dir, const std::string& stem, DType dtype, const TensorNames& names,
      uint64_t max_shard_bytes,
      const std::function<void(const std::vector<SafetensorsShard>&)>& planned = nullptr) const;

  TierUsage usage() const;
  EngineStats stats() const;
  // A human summary: a line of the layout, then a line per tier (device, host, nvme) of what is
  // placed there against its budget; no trailing newline.
  std::string PlacementSummary() const;
  // The memory placement report (JSON; docs/report.md), as text or written atomically to a file.
  StatusOr<std::string> ReportJson() const;
  Status WriteReport(const std::string& path) const;
  // Profiles the next training iteration that runs the plan, and the Step after it, for the
  // report (its timeline, residency and breakdown). The first planned iteration is profiled
  // without asking; a later profile replaces the earlier one.
  void ProfileNextIteration();

 private:
  friend class ParamScope;
  friend struct EngineInternals;  // src/engine/engine_impl.h: tests' ways in
  void* ScopeData(ParamId p) const;
  void* ScopeGrad(ParamId p) const;
  Status ScopeRelease(std::span<const ParamId> params, Phase phase);
  Status RefuseWithoutMoments(const char* what) const;  // MomentFormat::kNone
  Engine();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A safetensors file's __metadata__ (its string values), read from its header without loading
// a tensor: what ExportSafetensors recorded (tierzero's "tierzero.model"), or none. DataLoss for a
// file that is no safetensors file.
StatusOr<std::map<std::string, std::string>> ReadSafetensorsMetadata(const std::string& path);

// A safetensors file's tensors and their shapes, from its header checked whole as a load checks
// it (each entry's dtype, shape and bytes, none overlapping, the data section covered to the
// file's end), without reading a tensor: a file cut short or a header that lies is DataLoss
// before a model the size of its weights is allocated.
StatusOr<std::map<std::string, std::vector<int64_t>>> ReadSafetensorsShapes(
    const std::string& path);

// Whether tensors `a` and `b` of safetensors `files` (either in any of them) hold the same
// values: the same shape and, converted to fp32, equal element for element (as torch.equal: -0.0
// equals 0.0, a NaN equals nothing). Read a block
// at a time (a vocabulary's embedding may be gigabytes). NotFound when the files hold no `a` or
// no `b`; DataLoss for a damaged file; Unsupported for a type other than F32, BF16 and F16.
StatusOr<bool> SafetensorsTensorsEqual(const std::vector<std::string>& files, const std::string& a,
                                       const std::string& b);

}  // namespace tierzero

// The speculative start (docs/optimizer.md): a step's CPU updates begun during its last
// micro-batch's backward, before the global gradient norm is known, and used by the step only
// when it turns out to be the update the step would have made.
#include <cmath>
#include <cstring>
#include <system_error>

#include "core/bytes.h"
#include "core/logging.h"
#include "update/updater.h"

namespace tierzero {

// Note [The speculative start]
// SuperOffload's observation: the CPU idles through backward while the GPU computes, and a
// group's update needs only its own gradient, the step's options and the gradient scale, which
// is known before the global norm unless the norm clips or is not finite. So during the last
// micro-batch's backward a worker thread takes each chunk as its gradient shard becomes final
// (ChunkManager::SetGradFinalCallback: the D2H stream passing the chunk's last copy; with host
// collectives, at EndIteration) and, for groups the plan updates on the CPU from host memory,
// runs the same AdamW the step would run with grad_scale = 1 / (loss scale x accumulation),
// i.e. without clipping, on a COPY of the states, its parameters into a side buffer.
//
// Why the rollback is exact: nothing live is written before the step decides. The live master,
// m, v and parameter shard are read, never written, by the speculative phase_. At Step, when
// the gradients are finite, the norm does not clip (clip = 1 exactly, so grad_scale is the same
// float), and the options are those PrepareStep announced (lr; the step count and loss scale
// cannot change in between), each speculated group is committed: its side buffer BECOMES the
// group's states (OptimizerStates::SwapHost, a pointer swap; the old memory becomes a side
// buffer) and its parameters are copied into the shard. The result is bit for bit the update
// the step would have made: the same CpuAdam kernel on the same inputs in the same order
// (tests/engine/optimizer_placement_test.cc checks 20 steps against a run without it). In every
// other case the side buffers are simply dropped, and the step updates as if nothing had run
// ("rollback" costs nothing but the wasted work).
//
// Memory: the side buffers (a group's states and its parameter shard each) come from the host
// budget's room left after placement, counted in the host tier's usage; as many groups
// speculate as fit (none when nothing fits: a log line says so). Groups whose states are on NVMe
// or the device do not speculate (their overlap is Note [Optimizer I/O around the step] and the
// device's own phase).

// Note [The gradient norm summed as the shards become final]
// Step needs the global gradient norm before any update (it decides clipping), and summing the
// squares of the gradient shards in host memory was a pass over them after the backward: on an
// H100 machine 2.6 GB of bf16, 36 ms of a 375 ms offloaded step (bench/RESULTS.md, gpu-speed
// session 37), with the host's cores idle through the backward before it. So in the last
// micro-batch the speculative start's worker (below) also sums each host gradient shard's slices
// as the shard becomes final, whether or not it may speculate (under clipping it may not), and
// Step adds those sums in chunk and slice order as it always did: the same CpuAdam::SumSquares on
// the same bytes, so the norm is bit for bit the one summed after the backward. Shards on the
// device keep their device sums (DeviceSliceSums). On a GPU only (`TZ_NORM_AHEAD`, auto): on the
// simulated device the backward computes on the cores the sums would take. Sums belong to the
// step whose last micro-batch made them: a new training iteration or a discarded window drops
// them, and Step uses them once.
TZ_TUNABLE_CHOICE(kNormAhead, "TZ_NORM_AHEAD", "auto",
                  "sum the host gradient shards' squares during the last micro-batch's backward, "
                  "as each shard becomes final: auto (on a GPU), on, off",
                  "auto", "on", "off", "1", "0", "true", "false");

Status Updater::SumChunkAhead(int c) {
  const size_t i = static_cast<size_t>(c);
  if (spec_.summed[i] || store_->grad_on_device(c)) return Status::OK();
  RETURN_IF_ERROR(HostSliceSums(c, spec_.sums[i]));
  spec_.summed[i] = true;
  return Status::OK();
}

void Updater::Prepare(const StepOptions& options) {
  spec_.prepared = true;
  spec_.options = options;
}

// Side buffers for up to `want` groups, within the host budget's room.
int Updater::SpeculationSlots(int want) {
  const uint64_t per = optimizer().group_bytes() + AlignUp(layout_.shard_bytes(), 64);
  const int have = static_cast<int>(spec_.free.size());
  if (have >= want) return have;
  const uint64_t room = cfg_.speculation_room_bytes > spec_.pool_bytes
                            ? cfg_.speculation_room_bytes - spec_.pool_bytes
                            : 0;
  const int more = static_cast<int>(std::min<uint64_t>(want - have, room / per));
  for (int k = 0; k < more; ++k) {
    // Page-locked like the host groups they replace at a commit (a later step may stream that
    // group to the device with asynchronous copies).
    SideBuffer states{AlignedBuffer::Allocate(optimizer().group_bytes()), nullptr};
    SideBuffer out{AlignedBuffer::Allocate(AlignUp(layout_.shard_bytes(), 64)), nullptr};
    if (states.buf.data() == nullptr || out.buf.data() == nullptr) break;
    if (device_->RegisterHostMemory(states.buf.data(), states.buf.bytes()).ok()) {
      states.device = device_;  // else still correct, only the copies are synchronous
    }
    spec_.free.push_back({states.buf.data(), static_cast<uint8_t*>(out.buf.data())});
    side_memory_.push_back(std::move(states));
    side_memory_.push_back(std::move(out));
    spec_.pool_bytes += per;
  }
  return static_cast<int>(spec_.free.size());
}

// At the start of a training iteration: is it the step's last micro-batch, and may it start
// the step's CPU updates?
Status Updater::BeginTraining(bool last_micro_batch, int64_t step, float loss_scale) {
  // Results a failed Step left behind belong to no step now.
  if (!spec_.done.empty() && !spec_.queue) Discard();
  if (!spec_.queue) spec_.summed.clear();  // sums of an earlier window
  if (spec_.queue || !last_micro_batch) return Status::OK();
  const std::string ahead_mode = kNormAhead.Get();
  const bool sum_ahead = ahead_mode == "on" || ahead_mode == "1" || ahead_mode == "true" ||
                         (ahead_mode == "auto" && !cfg_.host_compute);
  bool speculate = spec_.prepared && cfg_.speculative_step != SpeculativeStep::kOff &&
                   !(cfg_.speculative_step == SpeculativeStep::kAuto &&
                     (cfg_.host_compute || !spec_.last_clean));
  const int nc = layout_.num_chunks();
  if (static_cast<int>(phase_.assignment.where.size()) != nc) speculate = false;  // no plan yet
  spec_.eligible.assign(static_cast<size_t>(nc), false);
  int want = 0;
  for (int c = 0; speculate && c < nc; ++c) {
    const bool e = phase_.assignment.where[static_cast<size_t>(c)] == UpdateWhere::kCpu &&
                   optimizer().tier(c) == Tier::kHost;
    spec_.eligible[static_cast<size_t>(c)] = e;
    want += e;
  }
  if (want == 0) speculate = false;
  if (speculate && SpeculationSlots(want) == 0) {
    if (!spec_.told_no_room) {
      TZ_LOG(kInfo, kEngine) << "speculative start: no host budget left for a group's copy ("
                             << FormatBytes(optimizer().group_bytes() + layout_.shard_bytes())
                             << "); the step's updates start after backward";
      spec_.told_no_room = true;
    }
    speculate = false;
  }
  if (!speculate) spec_.eligible.assign(static_cast<size_t>(nc), false);
  if (!speculate && !sum_ahead) return Status::OK();
  spec_.sum_ahead = sum_ahead;
  spec_.summed.assign(static_cast<size_t>(nc), false);
  spec_.sums.resize(static_cast<size_t>(nc));
  const double inv = 1.0 / (static_cast<double>(loss_scale) * cfg_.grad_accumulation);
  spec_.so = AdamStepOptions{};
  spec_.so.step = step + 1;
  spec_.so.lr = spec_.options.lr;
  spec_.so.grad_scale = static_cast<float>(inv * 1.0);  // as Step computes it when clip == 1
  spec_.taken.assign(static_cast<size_t>(nc), false);
  spec_.error = Status::OK();
  spec_.queue = std::make_shared<Speculation::Queue>();
  std::shared_ptr<Speculation::Queue> q = spec_.queue;
  cm_->SetGradFinalCallback([q](int c) {
    {
      MutexLock lock(q->mu);
      q->ready.push_back(c);
      ++q->announced;
    }
    q->cv.NotifyAll();
  });
  try {
    spec_.worker = std::thread([this, q] {
      // (An exception here would end the process: oneTBB's under `ulimit -u`, say.)
      try {
        SpeculationWorker(*q);
      } catch (...) {
        spec_.error = StatusOfCurrentException().WithContext("the speculative start");
      }
    });
  } catch (const std::system_error& e) {
    cm_->SetGradFinalCallback(nullptr);
    spec_.queue.reset();
    TZ_LOG_ONCE(kWarn, kEngine) << "speculative start: no worker thread (" << e.what()
                                << "); the step's updates start after backward while threads "
                                   "are short (this user's limit on processes and threads, "
                                   "ulimit -u, or a container's pids limit?)";
  }
  return Status::OK();
}

// The worker: each chunk as its gradient becomes final, while side buffers last. An exception
// escaping a chunk's work (oneTBB's inside CPU Adam when a worker it wakes cannot start) is its
// error (CatchingExceptions): the slot in hand goes back to the pool as after any error.
void Updater::SpeculationWorker(Speculation::Queue& q) {
  for (;;) {
    int c = -1;
    {
      MutexLock lock(q.mu);
      q.cv.Wait(lock, [&]() TZ_REQUIRES(q.mu) { return !q.ready.empty() || q.closed; });
      if (q.ready.empty()) return;  // closed, and nothing left
      c = q.ready.front();
      q.ready.pop_front();
    }
    const size_t i = static_cast<size_t>(c);
    if (c < 0 || c >= layout_.num_chunks() || !spec_.error.ok()) continue;
    if (spec_.sum_ahead) {
      Status s = CatchingExceptions([&] { return SumChunkAhead(c); });
      if (!s.ok()) {
        spec_.error =
            std::move(s).WithContext("summing the gradient of chunk " + std::to_string(c));
        continue;
      }
    }
    if (!spec_.eligible[i] || spec_.taken[i] || spec_.free.empty()) continue;
    spec_.taken[i] = true;
    Speculation::Slot slot = spec_.free.back();
    spec_.free.pop_back();
    const OptimizerGroup live = optimizer().Resident(c);
    std::memcpy(slot.states, live.master, optimizer().group_bytes());
    // The shard's padding zero, as the step leaves it: a side buffer last held another chunk's
    // parameters, whose tensors may reach where this chunk's padding begins.
    std::memset(slot.out, 0, layout_.shard_bytes());
    Status s = CatchingExceptions(
        [&] { return AdamInto(optimizer().layout().At(c, slot.states), slot.out, spec_.so); });
    if (!s.ok()) {
      spec_.error =
          std::move(s).WithContext("the speculative update of chunk " + std::to_string(c));
      spec_.free.push_back(slot);
      continue;
    }
    spec_.done.push_back({c, slot});
  }
}

// Closes the queue (every chunk is final after EndIteration: those no callback announced are
// announced here), waits for the worker, and keeps its results for the Step or drops them.
void Updater::EndSpeculation(bool keep) {
  if (!spec_.queue) return;
  cm_->SetGradFinalCallback(nullptr);
  {
    MutexLock lock(spec_.queue->mu);
    spec_.last_announced = spec_.queue->announced;
    if (keep) {
      for (int c = layout_.num_chunks() - 1; c >= 0; --c) spec_.queue->ready.push_back(c);
    }
    spec_.queue->closed = true;
  }
  spec_.queue->cv.NotifyAll();
  spec_.worker.join();
  spec_.queue.reset();
  if (!spec_.error.ok()) {
    TZ_LOG(kWarn, kEngine) << "speculative start: " << spec_.error.ToString()
                           << "; the step updates after backward";
    keep = false;
  }
  if (!keep) Discard();
}

// Drops the speculative results (the live states were never written) and the sums.
void Updater::Discard() {
  if (spec_.queue) EndSpeculation(/*keep=*/false);  // joins; comes back here
  for (auto& [c, slot] : spec_.done) spec_.free.push_back(slot);
  spec_.done.clear();
  spec_.summed.clear();
}

// At Step, once the norm is known: commits the speculative updates when they are the step's own
// (`exact`), else drops them. Returns the chunks committed (the phase skips them).
StatusOr<std::vector<bool>> Updater::CommitSpeculation(bool exact) {
  std::vector<bool> committed(static_cast<size_t>(layout_.num_chunks()), false);
  const bool had = !spec_.done.empty();
  spec_.prepared = false;
  if (!exact) {
    if (had) ++stats_.speculative_rollbacks;
    Discard();
    stats_.speculative_groups = 0;
    return committed;
  }
  // Each group's parameters are written first and its states swapped in only then, so a
  // failed write (an NVMe parameter shard) leaves that group and the rest uncommitted, their
  // side buffers back in the pool; the step then fails as a failed update phase does.
  std::vector<std::pair<int, Speculation::Slot>> done = std::move(spec_.done);
  spec_.done.clear();
  int n = 0;
  for (size_t k = 0; k < done.size(); ++k) {
    const auto [c, slot] = done[k];
    void* host = store_->host_param(c);
    Status wrote = Status::OK();
    if (host != nullptr) {
      std::memcpy(host, slot.out, layout_.shard_bytes());
    } else {
      wrote = store_->WriteParam(c, slot.out);
    }
    if (!wrote.ok()) {
      for (size_t j = k; j < done.size(); ++j) spec_.free.push_back(done[j].second);
      return std::move(wrote).WithContext("committing the speculative update of chunk " +
                                          std::to_string(c));
    }
    void* old = optimizer().SwapHost(c, slot.states);
    spec_.free.push_back({old, slot.out});
    committed[static_cast<size_t>(c)] = true;
    ++n;
  }
  stats_.speculative_groups = n;
  if (n > 0) ++stats_.speculative_steps;
  return committed;
}

}  // namespace tierzero

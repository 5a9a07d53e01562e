// The update phase's CPU chain behind the next forward: a worker thread updates the CPU's groups
// while Step has returned and the trainer's next forward runs, each chunk's gather waiting for
// that chunk's own update (docs/optimizer.md).
#include <algorithm>
#include <chrono>
#include <system_error>

#include "core/logging.h"
#include "update/updater.h"

namespace tierzero {

// Note [The update phase behind the next forward]
// Nothing in the next forward needs a chunk's new parameters before that chunk's first gather,
// and nothing before the next backward needs its gradient shard or its optimizer states. So Step
// returns once the norm is known, the plan made and the device's groups done (their buffers are
// the next iteration's memory), and a worker updates the CPU's groups in the order
// OptimizerStates::ForEach takes them (host groups, then the NVMe pipeline, each in chunk order:
// the order the forward gathers them in) while the forward runs. One rank only (on several, a
// failure behind one rank's forward would first have to be agreed on by all before each
// collective that follows). What keeps it exact:
// - Parameters: the chunk manager asks this fence before every gather of chunk c (Await: the
//   worker has written c's shard). On one rank a planned prefetch of a chunk not yet current is
//   put off to the next Acquire or Release (it then takes a slot the plan counted as taken since
//   its planned moment, so the plan's memory bound holds); on several ranks it waits, because
//   every rank's gathers must be the same collectives in the same order.
// - Gradients and states: the first backward Acquire, EndIteration, AbortIteration, Step, and
//   every entry point that reads or writes shards or states (checkpoints, ReadParam, reports)
//   wait for the whole chain first (Updater::Await). With accumulation the worker clears each
//   group's gradient shard after its update (Step cleared them all after the phase before).
// - A failed chain (a disk error) leaves some shards updated and some not. Its error is sticky:
//   every later gather, step and checkpoint fails with it, so a half-updated model is never
//   trained on or saved; loading a checkpoint clears it.
// The phase's time is then measured from its start to the later chain's end, as before; the
// step's time is what shrinks, by as much of the forward as the CPU chain overlaps. The profiled
// step keeps the phase inside Step (its timeline shows the phase as one span), and
// TZ_UPDATE_BEHIND_FORWARD=off turns the overlap off for comparisons. On the simulated device the
// CPU Adam rate is not sampled from a phase behind the forward (its calls share the cores with
// the forward's compute there).

bool Updater::Behind::Ready(int c) {
  if (!sticky.ok()) return false;  // the gather then fails with it
  if (!active) return true;
  MutexLock lock(mu);
  return done[static_cast<size_t>(c)] != 0;
}

Status Updater::Behind::Await(int c) {
  if (!sticky.ok()) return sticky;
  if (!active) return Status::OK();
  const auto t0 = std::chrono::steady_clock::now();
  MutexLock lock(mu);
  cv.Wait(lock, [&]() TZ_REQUIRES(mu) { return done[static_cast<size_t>(c)] != 0 || finished; });
  wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (done[static_cast<size_t>(c)] != 0) return Status::OK();
  // Finished without this chunk: the chain failed before it.
  return status.ok()
             ? InternalError("the update phase ended without updating chunk " + std::to_string(c))
             : status;
}

void Updater::Behind::MarkDone(int c) {
  {
    MutexLock lock(mu);
    done[static_cast<size_t>(c)] = 1;
  }
  cv.NotifyAll();
}

StatusOr<bool> Updater::LaunchBehind(const AdamStepOptions& so) {
  const size_t n = static_cast<size_t>(layout_.num_chunks());
  {
    MutexLock lock(tail_.mu);
    // Current from the start: the device's groups (done before Step returns) and those the
    // speculative start updated.
    tail_.done.assign(n, 1);
    for (size_t i = 0; i < n; ++i) tail_.done[i] = CpuChainTakes(static_cast<int>(i)) ? 0 : 1;
    tail_.finished = false;
    tail_.status = Status::OK();
  }
  tail_.counters_at_launch = optimizer().counters();
  tail_.step = so.step;
  tail_.cpu_end_s = tail_.adam_s = tail_.clear_s = 0;
  tail_.adam_elems = tail_.clear_bytes = 0;
  tail_.active = true;
  try {
    tail_.worker = std::thread([this, so] {
      double adam_s = 0;
      uint64_t adam_elems = 0;
      // (An exception here would end the process: oneTBB's, when a worker it wakes for CPU
      // Adam cannot start under `ulimit -u`. It fails the step as an error does.)
      Status s;
      try {
        s = RunCpuChain(so, /*prof=*/false, /*mark=*/true, adam_s, adam_elems);
      } catch (...) {
        s = StatusOfCurrentException().WithContext("the update phase behind the forward");
      }
      tail_.adam_s = adam_s;
      tail_.adam_elems = adam_elems;
      tail_.cpu_end_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - phase_.t0).count();
      {
        MutexLock lock(tail_.mu);
        tail_.status = std::move(s);
        tail_.finished = true;
      }
      tail_.cv.NotifyAll();
    });
  } catch (const std::system_error& e) {
    // No thread: the caller runs the chain inside Step, as without the overlap.
    tail_.active = false;
    // (Said once: under `ulimit -u` it is so at every step, and one line a step buried the log.)
    TZ_LOG_ONCE(kWarn, kEngine)
        << "update phase: no worker thread (" << e.what()
        << "); the CPU's groups update inside Step while threads are "
           "short (this user's limit on processes and threads, ulimit -u, or a "
           "container's pids limit?)";
    return false;
  }
  return true;
}

Status Updater::Await() {
  if (tail_.active) {
    const auto t0 = std::chrono::steady_clock::now();
    tail_.worker.join();
    tail_.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tail_.active = false;
    Status s;
    {
      MutexLock lock(tail_.mu);
      s = tail_.status;
    }
    // On the simulated device the chain's Adam calls shared the cores with the forward: no
    // sample of the CPU Adam rate (on a GPU the forward computes on the device).
    FinishPhase(std::max(tail_.cpu_end_s, tail_.device_end_s), tail_.adam_s, tail_.adam_elems,
                /*rate_sample=*/!cfg_.host_compute);
    // The clears on real shards correct the probe's rate (whose buffer may sit in the cache).
    if (!cfg_.host_compute && tail_.clear_bytes > 0 && tail_.clear_s > 0) {
      phase_.rates.host_clear_bytes_per_s = AddSample(
          phase_.clear_rate_samples, static_cast<double>(tail_.clear_bytes) / tail_.clear_s);
    }
    if (cfg_.grad_accumulation > 1) {
      // The groups the worker did not take (the device's, the speculative start's).
      for (int c = 0; c < layout_.num_chunks(); ++c) {
        if (CpuChainTakes(c)) continue;
        Status z = store_->ZeroGrad(c);
        if (!z.ok() && s.ok()) s = std::move(z);
      }
    }
    if (!s.ok()) {
      tail_.sticky = std::move(s).WithContext(
          "the optimizer update of step " + std::to_string(tail_.step) +
          " failed behind the next forward, leaving the parameters partly updated; load the "
          "last checkpoint to go on");
      TZ_LOG(kError, kEngine) << tail_.sticky.ToString();
    }
  }
  return tail_.sticky;
}

}  // namespace tierzero

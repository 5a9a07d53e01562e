// RankAgreement: how W ranks sharing every chunk stay in step, and what happens when they
// cannot (DESIGN.md section 6).
//
// - At every Acquire the ranks compare their moment (a hash of the tensors and the phase), or
//   the end of their iteration, and whether they left the trace (AgreeOnMoment): a difference
//   is an error naming both ranks and what each did, instead of a hang or a chunk made of
//   different chunks' shards; a deviation on any rank sends every rank on demand.
// - After a recording iteration the plan's inputs become the maximum over the ranks
//   (AgreeOnMaximum), so every rank computes the same plan and starts the same collectives.
// - A failure inside a stream (an NVMe read, a device collective) reaches only its rank, but
//   what it left in a gathered chunk reached every rank: at the end of the iteration the ranks
//   agree on the outcome (AgreeOnOutcome; Note [Agreeing on an outcome] in comm/collective.h).
// - Once a collective failed or the programs differed, the ranks are out of step for good:
//   nothing in flight can be cancelled, so every later call that would start a collective
//   fails with OutOfStep() and the trainer restarts from its last checkpoint.
//
// With one rank (comm null) only the error state is used.
//
// Thread-safety: LoseStep, OutOfStep and SetAsyncError from any thread (stream host functions
// report through them); the Agree* calls from the trainer's thread only.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "core/mutex.h"
#include "core/status.h"
#include "tierzero/communicator.h"

namespace tierzero {

// FNV-1a over a moment's tensors and phase (tensors, not chunks: ranks acquiring different
// tensors of one chunk would reduce it at different times).
uint64_t MomentHash(std::span<const int> tensors, bool backward);

class RankAgreement {
 public:
  // `comm` (null with one rank) must outlive the agreement.
  explicit RankAgreement(Communicator* comm) : comm_(comm) {}

  int rank() const { return comm_ != nullptr ? comm_->rank() : 0; }
  int size() const { return comm_ != nullptr ? comm_->size() : 1; }

  // Moment k (hash: MomentHash), or the end of the iteration after k moments when `end`. Fails
  // (out of step) when any rank differs; sets *off_trace when any rank left the trace. Adds the
  // seconds spent to *comm_seconds.
  Status AgreeOnMoment(int k, uint64_t hash, bool end, bool inference, bool* off_trace,
                       double* comm_seconds);
  // Every element becomes its maximum over the ranks.
  Status AgreeOnMaximum(std::vector<double>& values);
  // The end of an iteration: OK when no rank had an asynchronous error; otherwise every rank
  // fails with the first rank's error, out of step, and the errors are cleared.
  Status AgreeOnOutcome();

  // Records that the ranks are out of step because of `s`, and returns `s`.
  Status LoseStep(Status s);
  // OK, or why the ranks are out of step.
  Status OutOfStep() const;
  // The first failure inside a stream host function in this iteration.
  void SetAsyncError(Status s);
  // Returns the asynchronous error, if any, and clears it.
  Status TakeAsyncError();

 private:
  Communicator* comm_;
  mutable Mutex mu_;
  Status async_error_ TZ_GUARDED_BY(mu_);
  Status out_of_step_ TZ_GUARDED_BY(mu_);
};

}  // namespace tierzero

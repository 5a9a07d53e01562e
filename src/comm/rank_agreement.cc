#include "comm/rank_agreement.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "comm/collective.h"
#include "core/mutex.h"

namespace tierzero {

namespace {
struct MomentTag {
  int32_t moment = 0;
  int32_t end = 0;  // 1: the rank is ending its iteration
  int32_t off_trace = 0;
  int32_t inference = 0;
  uint64_t hash = 0;
};

std::string Describe(int r, const MomentTag& t) {
  std::string what = t.end ? "ended its iteration after " + std::to_string(t.moment) + " moments"
                           : "began moment " + std::to_string(t.moment);
  return "rank " + std::to_string(r) + " " + what + (t.inference ? " (evaluation)" : "");
}
}  // namespace

uint64_t MomentHash(std::span<const int> tensors, bool backward) {
  uint64_t h = 1469598103934665603ull ^ (backward ? 0x9e3779b97f4a7c15ull : 0);
  for (int t : tensors) {
    h ^= static_cast<uint64_t>(t) + 0x100;
    h *= 1099511628211ull;
  }
  return h;
}

Status RankAgreement::AgreeOnMoment(int k, uint64_t hash, bool end, bool inference, bool* off_trace,
                                    double* comm_seconds) {
  MomentTag mine;
  mine.moment = k;
  mine.end = end ? 1 : 0;
  mine.off_trace = *off_trace ? 1 : 0;
  mine.inference = inference ? 1 : 0;
  mine.hash = hash;
  const auto t0 = std::chrono::steady_clock::now();
  auto gathered = AllGatherValue(*comm_, mine);
  if (!gathered.ok()) return LoseStep(gathered.status());
  const std::vector<MomentTag>& all = *gathered;
  *comm_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const MomentTag& t = all[static_cast<size_t>(r)];
    if (t.moment != mine.moment || t.end != mine.end || t.hash != mine.hash ||
        t.inference != mine.inference) {
      std::string msg =
          "the ranks' programs differ: " + Describe(rank(), mine) + ", " + Describe(r, t);
      if (!t.end && !mine.end && t.moment == mine.moment)
        msg += ", with different parameters or phase";
      return LoseStep(FailedPreconditionError(
          msg +
          "; every rank must run the same iterations, acquiring the same parameters in "
          "the same order"));
    }
    if (t.off_trace) *off_trace = true;
  }
  return Status::OK();
}

Status RankAgreement::AgreeOnMaximum(std::vector<double>& values) {
  ASSIGN_OR_RETURN(std::vector<uint8_t> raw,
                   AllGatherBytes(*comm_, values.data(), values.size() * 8));
  std::vector<double> most = values;
  for (int r = 0; r < comm_->size(); ++r) {
    const auto* theirs = reinterpret_cast<const double*>(raw.data()) + r * values.size();
    for (size_t i = 0; i < values.size(); ++i) most[i] = std::max(most[i], theirs[i]);
  }
  values = std::move(most);
  return Status::OK();
}

Status RankAgreement::AgreeOnOutcome() {
  Status mine;
  {
    MutexLock lock(mu_);
    mine = async_error_;
  }
  Status agreed = AgreeOnStatus(*comm_, mine);
  if (agreed.ok()) return agreed;
  {
    MutexLock lock(mu_);
    async_error_ = Status::OK();
  }
  return LoseStep(std::move(agreed));
}

Status RankAgreement::LoseStep(Status s) {
  MutexLock lock(mu_);
  if (out_of_step_.ok()) {
    out_of_step_ = FailedPreconditionError(
        "the ranks are out of step since an earlier failure (" + std::string(s.message()) +
        "); every rank must stop: restart from the last checkpoint");
  }
  return s;
}

Status RankAgreement::OutOfStep() const {
  MutexLock lock(mu_);
  return out_of_step_;
}

void RankAgreement::SetAsyncError(Status s) {
  MutexLock lock(mu_);
  if (async_error_.ok()) async_error_ = std::move(s);
}

Status RankAgreement::TakeAsyncError() {
  MutexLock lock(mu_);
  Status s = std::move(async_error_);
  async_error_ = Status::OK();
  return s;
}

}  // namespace tierzero

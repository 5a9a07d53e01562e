#include "zero/transfer.h"

namespace tierzero {

Status TransferSpans::QueueStart(Device& device, StreamHandle stream,
                                 const std::shared_ptr<double>& start) {
  Observer* o = observer_;
  return device.LaunchHostFunc(stream, [o, start] { *start = o->Now(); });
}

Status TransferSpans::QueueSpan(Device& device, StreamHandle stream, Track track, std::string name,
                                int moment, int chunk, uint64_t bytes,
                                const std::shared_ptr<double>& start, int lane) {
  Observer* o = observer_;
  return device.LaunchHostFunc(
      stream, [o, track, name = std::move(name), chunk, bytes, start, moment, lane] {
        o->OnSpan({track, name, *start, o->Now() - *start, moment, chunk, bytes, lane});
      });
}

StatusOr<GatherTimer::Timing*> GatherTimer::Start(Device& device, StreamHandle stream, Tier tier) {
  if (!recording_) return nullptr;
  if (used_ == timing_.size()) {
    Timing t;
    ASSIGN_OR_RETURN(t.start, Event::Create(device));
    ASSIGN_OR_RETURN(t.end, Event::Create(device));
    timing_.push_back(std::move(t));
  }
  Timing* timing = &timing_[used_++];
  timing->tier = tier;
  RETURN_IF_ERROR(device.RecordEvent(timing->start.handle(), stream));
  return timing;
}

void GatherTimer::AddCallerSeconds(Tier tier, double seconds) {
  if (!recording_) return;
  caller_seconds_[static_cast<int>(tier)] += seconds;
  ++caller_gathers_[static_cast<int>(tier)];
}

void GatherTimer::Finish(Device& device, double measured[kNumTiers]) {
  double sum[kNumTiers] = {0, 0, 0};
  int count[kNumTiers] = {0, 0, 0};
  for (size_t g = 0; g < used_; ++g) {
    auto t = device.ElapsedSeconds(timing_[g].start.handle(), timing_[g].end.handle());
    if (!t.ok()) continue;
    const int tier = static_cast<int>(timing_[g].tier);
    sum[tier] += *t;
    ++count[tier];
  }
  for (int tier = 0; tier < kNumTiers; ++tier) {
    if (count[tier] > 0) measured[tier] = sum[tier] / count[tier];
    // W > 1: the all_gather (and NVMe read) the caller did before the H2D copies.
    if (caller_gathers_[tier] > 0) {
      measured[tier] += caller_seconds_[tier] / caller_gathers_[tier];
    }
    caller_seconds_[tier] = 0;
    caller_gathers_[tier] = 0;
  }
  used_ = 0;
}

Status TransferContext::Init() {
  ASSIGN_OR_RETURN(h2d, Stream::Create(device, "h2d"));
  ASSIGN_OR_RETURN(d2h, Stream::Create(device, "d2h"));
  return Status::OK();
}

Status TransferContext::MarkGradSourceRead() {
  if (grad_source_read == nullptr) return Status::OK();
  RETURN_IF_ERROR(grad_source_read->Record(d2h));
  grad_source_recorded = true;
  return Status::OK();
}

}  // namespace tierzero

// The one-process communicator: every collective is a copy (a reduction over one rank is the
// rank's own data; the mean divides by 1).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/collective.h"
#include "core/status.h"

namespace tierzero {

void Communicator::Abort(int exit_code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(exit_code);
}

namespace {

class SingleRank final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Topology topology() const override { return {}; }
  std::string backend() const override { return "single"; }

  StatusOr<std::unique_ptr<CommRequest>> AllGather(const void* send, void* recv, size_t count,
                                                   DType dtype) override {
    return Copy(zero::CollectiveKind::kAllGather, send, recv, count, dtype, false);
  }
  StatusOr<std::unique_ptr<CommRequest>> ReduceScatter(const void* send, void* recv, size_t count,
                                                       DType dtype, ReduceOp op) override {
    return Copy(zero::CollectiveKind::kReduceScatter, send, recv, count, dtype, true, op);
  }
  StatusOr<std::unique_ptr<CommRequest>> AllReduce(const void* send, void* recv, size_t count,
                                                   DType dtype, ReduceOp op) override {
    return Copy(zero::CollectiveKind::kAllReduce, send, recv, count, dtype, true, op);
  }
  StatusOr<std::unique_ptr<CommRequest>> AllToAll(const void* send, void* recv, size_t count,
                                                  DType dtype) override {
    return Copy(zero::CollectiveKind::kAllToAll, send, recv, count, dtype, false);
  }
  StatusOr<std::unique_ptr<CommRequest>> Broadcast(void* buf, size_t count, DType dtype,
                                                   int root) override {
    RETURN_IF_ERROR(zero::CheckBroadcast(count, dtype, root, 1));
    (void)buf;
    ++stats_.collectives;
    return std::unique_ptr<CommRequest>(new zero::DoneRequest());
  }
  Status Barrier() override { return Status::OK(); }
  CommStats stats() const override { return stats_; }
  StatusOr<std::shared_ptr<Communicator>> Duplicate() override { return Communicator::Single(); }
  StatusOr<std::shared_ptr<Communicator>> Split(SplitBy by) override {
    RETURN_IF_ERROR(zero::CheckSplit(by));
    return Communicator::Single();
  }

 private:
  StatusOr<std::unique_ptr<CommRequest>> Copy(zero::CollectiveKind kind, const void* send,
                                              void* recv, size_t count, DType dtype, bool reduction,
                                              ReduceOp op = ReduceOp::kSum) {
    RETURN_IF_ERROR(zero::CheckCollective(kind, count, dtype, reduction, op));
    const uint64_t bytes = DTypeBytes(dtype, count);
    if (bytes > 0 && (send == nullptr || recv == nullptr))
      return InvalidArgumentError("a collective of " + std::to_string(count) +
                                  " elements with a null buffer");
    if (send != recv) std::memmove(recv, send, bytes);
    ++stats_.collectives;
    return std::unique_ptr<CommRequest>(new zero::DoneRequest());
  }
  CommStats stats_;
};

}  // namespace

std::shared_ptr<Communicator> Communicator::Single() {
  // Each caller gets its own (the byte counters are per communicator).
  return std::make_shared<SingleRank>();
}

}  // namespace tierzero

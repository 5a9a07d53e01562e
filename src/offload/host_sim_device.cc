#include "offload/host_sim_device.h"

#include <sys/mman.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "core/bytes.h"
#include "core/check.h"
#include "core/convert.h"
#include "core/logging.h"
#include "core/mutex.h"
#include "offload/slab_allocator.h"
#include "tierzero/types.h"

namespace tierzero {
namespace {

using Clock = std::chrono::steady_clock;

// Note [Wake only waiters that are done]
// A stream thread that notified its condition variable after every operation woke any thread
// blocked in Drain (a trainer synchronizing at the end of an iteration) once per operation, only
// for it to find its target not reached and sleep again. On two cores each such futex round trip
// cost the stream 10-20 us, and chunk_bench's compute stream ~40 us per moment. So Drain
// registers the smallest target it waits for and the stream notifies only on reaching it; an
// event notifies only when a thread waits on it.

// Note [Stream waits that cost the signaller nothing]
// A stream that records an event another stream waits on had to wake that stream's sleeping
// thread: a futex wake and an inter-processor interrupt, 14 us at the median (27 us at p90) on
// this VM, paid by the recording stream's thread. chunk_bench's compute stream signals the copy
// streams at every moment (its gathers start when their moment begins), so 30-40 us of every
// moment's gap was this wake, which a GPU, whose streams signal each other in hardware, does not
// have. With HostSimOptions::poll_stream_waits_us the waiting stream polls instead (napping, with
// a 1 us timer slack, from 2 us up to that cap between looks) and a record wakes only host threads
// waiting in SynchronizeEvent. The cost moves to the waiter's core (a copy stream waiting for a
// moment to begin looks every 20 us for the whole moment, on the core it shares with the
// trainer's thread), and a stream wait ends up to the cap (plus the timer's wake-up) after its
// event; every policy a benchmark compares pays it. The 1 us slack holds only while polling: the
// thread's other timed sleeps (the throttle of its copies) keep its own.

// One in-order queue executed by its own thread.
// The first error any stream of a device kept (Note [An exception on a simulated stream]): a
// device-wide fault, as a CUDA context's sticky error, which an event's synchronisation returns.
struct SimFault {
  void Keep(const Status& s) {
    MutexLock lock(mu);
    if (first.ok()) first = s;
  }
  Status Get() {
    MutexLock lock(mu);
    return first;
  }
  Mutex mu;
  Status first TZ_GUARDED_BY(mu);
};

class SimStream {
 public:
  SimStream(std::string name, SimFault* fault)
      : name_(std::move(name)), fault_(fault), worker_([this] { Run(); }) {}
  ~SimStream() {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    work_cv_.NotifyOne();
    worker_.join();
  }

  void Enqueue(std::function<void()> fn) {
    {
      MutexLock lock(mu_);
      queue_.push_back(std::move(fn));
      ++enqueued_;
    }
    work_cv_.NotifyOne();
  }

  // Waits until everything enqueued before the call has run.
  void Drain() {
    MutexLock lock(mu_);
    const uint64_t target = enqueued_;
    while (completed_ < target) {
      wake_at_ = std::min(wake_at_, target);
      done_cv_.Wait(lock);
    }
  }

  const std::string& name() const { return name_; }
  // The first exception its work threw (Note [An exception on a simulated stream]), or OK.
  Status error() {
    MutexLock lock(mu_);
    return error_;
  }

 private:
  void Run() {
    MutexLock lock(mu_);
    for (;;) {
      work_cv_.Wait(lock, [&]() TZ_REQUIRES(mu_) { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      lock.Unlock();
      // Note [An exception on a simulated stream]
      // Work on a stream must not throw (Device::LaunchHostFunc), and the callers that run
      // oneTBB there catch its exceptions themselves; one that escapes anyway would end the
      // process through std::terminate on this thread. It is kept instead, as a GPU keeps a
      // kernel's fault: the stream's later work still runs, and synchronising the stream or the
      // device returns the error from then on, as does synchronising any other stream or event
      // of the device (a CUDA context's error is sticky: every later call returns it).
      Status failed;
      try {
        fn();
      } catch (...) {
        failed = StatusOfCurrentException().WithContext("work on the simulated stream " + name_);
      }
      if (!failed.ok()) fault_->Keep(failed);
      lock.Lock();
      if (!failed.ok() && error_.ok()) error_ = std::move(failed);
      ++completed_;
      // Note [Wake only waiters that are done]
      if (completed_ >= wake_at_) {
        wake_at_ = kNobody;
        done_cv_.NotifyAll();
      }
    }
  }

  std::string name_;
  SimFault* const fault_;  // the device's, which outlives its streams
  Mutex mu_;
  CondVar work_cv_;
  CondVar done_cv_;
  static constexpr uint64_t kNobody = ~uint64_t{0};
  uint64_t wake_at_ TZ_GUARDED_BY(mu_) = kNobody;  // the smallest target a Drain waits for
  std::deque<std::function<void()>> queue_ TZ_GUARDED_BY(mu_);
  uint64_t enqueued_ TZ_GUARDED_BY(mu_) = 0;
  uint64_t completed_ TZ_GUARDED_BY(mu_) = 0;
  bool stopping_ TZ_GUARDED_BY(mu_) = false;
  Status error_ TZ_GUARDED_BY(mu_);
  std::thread worker_;  // last: starts after the members it uses exist
};

// Record k of an event completes when the work before it on its stream is done.
struct SimEvent {
  Mutex mu;
  CondVar cv;
  uint64_t records TZ_GUARDED_BY(mu) = 0;    // records issued
  uint64_t completed TZ_GUARDED_BY(mu) = 0;  // highest record completed
  int waiters TZ_GUARDED_BY(mu) = 0;         // threads in Wait
  // Waits (lock held on mu) until record `target` has completed.
  void Wait(MutexLock& lock, uint64_t target) TZ_REQUIRES(mu) {
    ++waiters;
    cv.Wait(lock, [&]() TZ_REQUIRES(mu) { return completed >= target; });
    --waiters;
  }
  Clock::time_point completed_at TZ_GUARDED_BY(mu){};
  // Polls until record `target` has completed, without counting as a waiter (Note [Stream
  // waits that cost the signaller nothing]).
  void Poll(uint64_t target, double max_nap_us) {
    double nap_us = std::min(2.0, max_nap_us);
    int slack = -1;  // the thread's own timer slack, restored on return (set only to nap)
    for (;;) {
      {
        MutexLock lock(mu);
        if (completed >= target) break;
      }
      if (slack < 0) {
        slack = prctl(PR_GET_TIMERSLACK, 0UL, 0UL, 0UL, 0UL);
        prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);  // 1 us, not the default 50 us
      }
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(nap_us));
      nap_us = std::min(2 * nap_us, max_nap_us);
    }
    if (slack >= 0) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack), 0UL, 0UL, 0UL);
  }
};

// A direction of the simulated interconnect.
struct Link {
  Mutex mu;
  double bytes_per_second = 0;
  Clock::time_point next_free TZ_GUARDED_BY(mu){};
};

class HostSimDevice final : public Device {
 public:
  HostSimDevice(DeviceInfo info, const HostSimOptions& options, uint8_t* slab)
      : info_(std::move(info)),
        slab_(slab),
        memory_(slab, info_.capacity_bytes, kDeviceAlignment, "device '" + info_.name + "'"),
        poll_us_(options.poll_stream_waits_us) {
    links_[0].bytes_per_second = options.h2d_bytes_per_second;
    links_[1].bytes_per_second = options.d2h_bytes_per_second;
    links_[2].bytes_per_second = options.d2d_bytes_per_second;
  }

  ~HostSimDevice() override {
    {
      MutexLock lock(mu_);
      TZ_CHECK(streams_.empty()) << streams_.size() << " stream(s) outlive the device";
    }
    ::munmap(slab_, info_.capacity_bytes);
  }

  const DeviceInfo& info() const override { return info_; }

  StatusOr<void*> Allocate(size_t bytes) override { return memory_.Allocate(bytes); }
  void Free(void* ptr) override { memory_.Free(ptr); }
  MemoryStat memory_stat() const override { return memory_.stat(); }
  uint64_t largest_free_block() const override { return memory_.largest_free_block(); }

  StatusOr<StreamHandle> CreateStream(std::string_view name) override {
    auto* s = new SimStream(std::string(name), &fault_);
    MutexLock lock(mu_);
    streams_.insert(s);
    return StreamHandle{s};
  }

  void DestroyStream(StreamHandle handle) override {
    auto* s = static_cast<SimStream*>(handle.impl);
    if (s == nullptr) return;
    {
      MutexLock lock(mu_);
      TZ_CHECK(streams_.erase(s) == 1) << "DestroyStream of an unknown stream";
    }
    delete s;  // drains the queue, then joins
  }

  Status SynchronizeStream(StreamHandle handle) override {
    RETURN_IF_ERROR(CheckStream(handle));
    static_cast<SimStream*>(handle.impl)->Drain();
    if (Status e = static_cast<SimStream*>(handle.impl)->error(); !e.ok()) return e;
    return fault_.Get();  // another stream's, kept device-wide
  }

  Status Synchronize() override {
    std::vector<SimStream*> streams;
    {
      MutexLock lock(mu_);
      streams.assign(streams_.begin(), streams_.end());
    }
    Status first;
    for (SimStream* s : streams) {
      s->Drain();
      if (Status e = s->error(); !e.ok() && first.ok()) first = std::move(e);
    }
    return first.ok() ? fault_.Get() : first;  // (a stream destroyed since kept its error here)
  }

  // An event handle points at a shared_ptr holder; queued records and waits keep their own
  // reference, so destroying an event with work pending is safe and deferred, as on CUDA.
  StatusOr<EventHandle> CreateEvent() override {
    return EventHandle{new std::shared_ptr<SimEvent>(std::make_shared<SimEvent>())};
  }

  void DestroyEvent(EventHandle handle) override {
    delete static_cast<std::shared_ptr<SimEvent>*>(handle.impl);
  }

  Status RecordEvent(EventHandle event, StreamHandle stream) override {
    RETURN_IF_ERROR(CheckStream(stream));
    if (event.impl == nullptr) return InvalidArgumentError("RecordEvent on a null event");
    std::shared_ptr<SimEvent> e = Ev(event);
    // Count and queue the record under the event's lock, so a StreamWaitEvent from another
    // thread can never queue a wait for this record ahead of the record itself.
    MutexLock event_lock(e->mu);
    const uint64_t target = ++e->records;
    static_cast<SimStream*>(stream.impl)->Enqueue([e, target] {
      MutexLock lock(e->mu);
      if (target > e->completed) {
        e->completed = target;
        e->completed_at = Clock::now();
      }
      if (e->waiters > 0) e->cv.NotifyAll();  // Note [Wake only waiters that are done]
    });
    return Status::OK();
  }

  Status StreamWaitEvent(StreamHandle stream, EventHandle event) override {
    RETURN_IF_ERROR(CheckStream(stream));
    if (event.impl == nullptr) return InvalidArgumentError("StreamWaitEvent on a null event");
    std::shared_ptr<SimEvent> e = Ev(event);
    MutexLock event_lock(e->mu);
    const uint64_t target = e->records;
    if (target == 0) return Status::OK();
    if (poll_us_ > 0) {
      static_cast<SimStream*>(stream.impl)->Enqueue([e, target, cap = poll_us_] {
        e->Poll(target, cap);
      });
      return Status::OK();
    }
    static_cast<SimStream*>(stream.impl)->Enqueue([e, target] {
      MutexLock lock(e->mu);
      e->Wait(lock, target);
    });
    return Status::OK();
  }

  Status SynchronizeEvent(EventHandle event) override {
    if (event.impl == nullptr) return InvalidArgumentError("SynchronizeEvent on a null event");
    std::shared_ptr<SimEvent> e = Ev(event);
    {
      MutexLock lock(e->mu);
      const uint64_t target = e->records;
      e->Wait(lock, target);
    }
    return fault_.Get();
  }

  StatusOr<bool> EventDone(EventHandle event) override {
    if (event.impl == nullptr) return InvalidArgumentError("EventDone on a null event");
    std::shared_ptr<SimEvent> e = Ev(event);
    MutexLock lock(e->mu);
    return e->completed >= e->records;
  }

  StatusOr<double> ElapsedSeconds(EventHandle start, EventHandle end) override {
    if (start.impl == nullptr || end.impl == nullptr) {
      return InvalidArgumentError("ElapsedSeconds on a null event");
    }
    SimEvent* a = Ev(start).get();
    SimEvent* b = Ev(end).get();
    Clock::time_point ta, tb;
    for (auto [e, t] : {std::pair{a, &ta}, std::pair{b, &tb}}) {
      MutexLock lock(e->mu);
      if (e->records == 0 || e->completed < e->records) {
        return FailedPreconditionError("ElapsedSeconds needs two recorded, completed events");
      }
      *t = e->completed_at;
    }
    return std::chrono::duration<double>(tb - ta).count();
  }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   StreamHandle stream) override {
    RETURN_IF_ERROR(CheckStream(stream));
    if (bytes == 0) return Status::OK();
    if (dst == nullptr || src == nullptr)
      return InvalidArgumentError("CopyAsync with a null pointer");
    const bool dst_dev = kind != CopyKind::kDeviceToHost;
    const bool src_dev = kind != CopyKind::kHostToDevice;
    if (dst_dev) RETURN_IF_ERROR(CheckDeviceRange(dst, bytes, "destination"));
    if (src_dev) RETURN_IF_ERROR(CheckDeviceRange(src, bytes, "source"));
    if (!dst_dev) RETURN_IF_ERROR(CheckHostRange(dst, bytes, "destination"));
    if (!src_dev) RETURN_IF_ERROR(CheckHostRange(src, bytes, "source"));
    Link* link = &links_[static_cast<int>(kind)];
    static_cast<SimStream*>(stream.impl)->Enqueue([=] {
      const Clock::time_point begin = Clock::now();
      std::memcpy(dst, src, bytes);
      if (link->bytes_per_second > 0) {
        Clock::time_point finish;
        {
          MutexLock lock(link->mu);
          const Clock::time_point start = std::max(begin, link->next_free);
          // (At most 1e9 s: a longer wait overflows the clock's nanoseconds.)
          finish =
              start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                          std::min(1e9, bytes / link->bytes_per_second)));
          link->next_free = finish;
        }
        std::this_thread::sleep_until(finish);
      }
    });
    return Status::OK();
  }

  Status MemsetAsync(void* dst, uint8_t value, size_t bytes, StreamHandle stream) override {
    RETURN_IF_ERROR(CheckStream(stream));
    if (bytes == 0) return Status::OK();
    RETURN_IF_ERROR(CheckDeviceRange(dst, bytes, "destination"));
    static_cast<SimStream*>(stream.impl)->Enqueue([=] { std::memset(dst, value, bytes); });
    return Status::OK();
  }

  Status CastAsync(const void* src, DType src_type, void* dst, DType dst_type, size_t n,
                   StreamHandle stream) override {
    RETURN_IF_ERROR(CheckStream(stream));
    if (!IsFloatType(src_type) || !IsFloatType(dst_type)) {
      return InvalidArgumentError("CastAsync supports fp32, bf16 and fp16, not " +
                                  std::string(DTypeName(src_type)) + " -> " +
                                  std::string(DTypeName(dst_type)));
    }
    if (n == 0) return Status::OK();
    RETURN_IF_ERROR(CheckDeviceRange(src, DTypeBytes(src_type, n), "source"));
    RETURN_IF_ERROR(CheckDeviceRange(dst, DTypeBytes(dst_type, n), "destination"));
    static_cast<SimStream*>(stream.impl)->Enqueue([=] {
      // Arguments were validated above; Convert cannot fail for float types.
      TZ_CHECK_OK(Convert(src, src_type, dst, dst_type, n));
    });
    return Status::OK();
  }

  Status AccumulateAsync(float* acc, const void* src, DType src_type, size_t n,
                         StreamHandle stream) override {
    RETURN_IF_ERROR(CheckStream(stream));
    if (!IsFloatType(src_type)) {
      return InvalidArgumentError("AccumulateAsync supports fp32, bf16 and fp16, not " +
                                  std::string(DTypeName(src_type)));
    }
    if (n == 0) return Status::OK();
    RETURN_IF_ERROR(CheckDeviceRange(src, DTypeBytes(src_type, n), "source"));
    RETURN_IF_ERROR(CheckDeviceRange(acc, DTypeBytes(DType::kF32, n), "accumulator"));
    static_cast<SimStream*>(stream.impl)->Enqueue([=] {
      // Arguments were validated above; the add cannot fail for float types.
      TZ_CHECK_OK(AddToF32(acc, src, src_type, n));
    });
    return Status::OK();
  }

  Status LaunchHostFunc(StreamHandle stream, std::function<void()> fn) override {
    RETURN_IF_ERROR(CheckStream(stream));
    if (!fn) return InvalidArgumentError("LaunchHostFunc with an empty function");
    static_cast<SimStream*>(stream.impl)->Enqueue(std::move(fn));
    return Status::OK();
  }

  Status RegisterHostMemory(void* ptr, size_t bytes) override { return Status::OK(); }
  Status UnregisterHostMemory(void* ptr) override { return Status::OK(); }

 private:
  static const std::shared_ptr<SimEvent>& Ev(EventHandle h) {
    return *static_cast<std::shared_ptr<SimEvent>*>(h.impl);
  }

  Status CheckStream(StreamHandle handle) const {
    if (handle.impl == nullptr) return InvalidArgumentError("null stream");
    return Status::OK();
  }

  bool InSlab(const void* p, size_t bytes) const {
    auto* b = static_cast<const uint8_t*>(p);
    return b >= slab_ && b <= slab_ + info_.capacity_bytes &&
           bytes <= static_cast<size_t>(slab_ + info_.capacity_bytes - b);
  }

  Status CheckDeviceRange(const void* p, size_t bytes, const char* what) const {
    if (!InSlab(p, bytes)) {
      std::ostringstream os;
      os << "the " << what << " [" << p << ", +" << bytes << ") is not device memory of '"
         << info_.name << "'";
      return InvalidArgumentError(os.str());
    }
    return Status::OK();
  }

  Status CheckHostRange(const void* p, size_t bytes, const char* what) const {
    auto* b = static_cast<const uint8_t*>(p);
    if (b + bytes > slab_ && b < slab_ + info_.capacity_bytes) {
      std::ostringstream os;
      os << "the " << what << " [" << p << ", +" << bytes << ") is device memory, but the copy "
         << "kind says host";
      return InvalidArgumentError(os.str());
    }
    return Status::OK();
  }

  const DeviceInfo info_;
  uint8_t* const slab_;
  mutable Mutex mu_;
  DeviceSlab memory_;  // the device memory, handed out from slab_
  std::set<SimStream*> streams_ TZ_GUARDED_BY(mu_);
  SimFault fault_;        // Note [An exception on a simulated stream]
  Link links_[3];         // indexed by CopyKind
  const double poll_us_;  // Note [Stream waits that cost the signaller nothing]
};

}  // namespace

StatusOr<std::unique_ptr<Device>> CreateHostSimDevice(const HostSimOptions& options) {
  if (options.capacity_bytes == 0) {
    return InvalidArgumentError("HostSim device capacity must be > 0");
  }
  for (double bw :
       {options.h2d_bytes_per_second, options.d2h_bytes_per_second, options.d2d_bytes_per_second}) {
    if (!(bw >= 0)) {
      return InvalidArgumentError("HostSim bandwidth must be >= 0 bytes/s (0 = unthrottled), got " +
                                  std::to_string(bw));
    }
  }
  if (!(options.poll_stream_waits_us >= 0 && options.poll_stream_waits_us <= 1000)) {
    return InvalidArgumentError(
        "HostSim poll_stream_waits_us must be in [0, 1000] (0 = wake stream waiters), got " +
        std::to_string(options.poll_stream_waits_us));
  }
  const uint64_t capacity = AlignUp(options.capacity_bytes, kDeviceAlignment);
  void* slab = ::mmap(
      nullptr, capacity, PROT_READ | PROT_WRITE,
      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (options.populate ? MAP_POPULATE : 0), -1, 0);
  if (slab == MAP_FAILED) {
    // (The simulated device's memory is this process's address space: a budget past what the
    // system maps, 100 TiB, was refused with no word of what to change; hunt 49.)
    return ErrnoError("cannot reserve " + FormatBytes(capacity) +
                          " of address space for the simulated device (its budget and a margin): "
                          "give a device budget (engine.device_budget, --device-budget) the "
                          "system can map",
                      errno, StatusCode::kOutOfMemory);
  }
  DeviceInfo info;
  info.kind = DeviceKind::kHostSim;
  info.name = options.name;
  info.capacity_bytes = capacity;
  info.caps.async_copy = true;
  info.caps.pinned_host = false;
  info.caps.event_timing = true;
  info.caps.host_compute = true;
  info.caps.throttled = options.h2d_bytes_per_second > 0 || options.d2h_bytes_per_second > 0 ||
                        options.d2d_bytes_per_second > 0;
  TZ_LOG(kInfo, kOffload) << "HostSim device '" << info.name << "': " << FormatBytes(capacity)
                          << (info.caps.throttled ? ", throttled" : "");
  return std::unique_ptr<Device>(
      new HostSimDevice(std::move(info), options, static_cast<uint8_t*>(slab)));
}

}  // namespace tierzero

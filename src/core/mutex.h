// Mutex, MutexLock and CondVar: std::mutex, a scoped lock and std::condition_variable with
// clang's thread-safety annotations, so the state a mutex guards is declared beside it and
// checked at compile time:
//
//   Mutex mu_;
//   CondVar cv_;
//   int pending_ TZ_GUARDED_BY(mu_) = 0;
//   void Done() {
//     MutexLock lock(mu_);
//     if (--pending_ == 0) cv_.NotifyAll();
//   }
//   void Drain() {
//     MutexLock lock(mu_);
//     cv_.Wait(lock, [&]() TZ_REQUIRES(mu_) { return pending_ == 0; });
//   }
//   bool ReapLocked() TZ_REQUIRES(mu_);  // called with mu_ held
//
// clang builds (the lint and fuzz presets) compile with -Werror=thread-safety: touching
// pending_ without holding mu_ does not compile there. GCC ignores the annotations.
//
// Note [Predicates under the lock]
// clang analyses a lambda as a function of its own, holding nothing. A condition variable calls
// its predicate with the mutex held, so a predicate that reads guarded state says so:
// `[&]() TZ_REQUIRES(mu_) { ... }`.
//
// Thread-safety: as std::mutex and std::condition_variable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define TZ_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define TZ_THREAD_ANNOTATION(x)
#endif

#define TZ_CAPABILITY(name) TZ_THREAD_ANNOTATION(capability(name))
#define TZ_SCOPED_CAPABILITY TZ_THREAD_ANNOTATION(scoped_lockable)
#define TZ_GUARDED_BY(mu) TZ_THREAD_ANNOTATION(guarded_by(mu))
#define TZ_PT_GUARDED_BY(mu) TZ_THREAD_ANNOTATION(pt_guarded_by(mu))
#define TZ_REQUIRES(...) TZ_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define TZ_ACQUIRE(...) TZ_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define TZ_RELEASE(...) TZ_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TZ_TRY_ACQUIRE(...) TZ_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))

namespace tierzero {

class TZ_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void Lock() TZ_ACQUIRE() { mu_.lock(); }
  void Unlock() TZ_RELEASE() { mu_.unlock(); }
  // True when it took the mutex (then Unlock it); false when another thread holds it.
  bool TryLock() TZ_TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class MutexLock;
  std::mutex mu_;
};

// Holds a Mutex for its scope; Unlock/Lock release and retake it inside the scope.
class TZ_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) TZ_ACQUIRE(mu) : lock_(mu.mu_) {}
  ~MutexLock() TZ_RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  void Unlock() TZ_RELEASE() { lock_.unlock(); }
  void Lock() TZ_ACQUIRE() { lock_.lock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

class CondVar {
 public:
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }
  // Waits (the lock released meanwhile) until notified, or spuriously.
  void Wait(MutexLock& lock) { cv_.wait(lock.lock_); }
  // Waits until pred() holds; pred runs with the lock held (Note [Predicates under the lock]).
  template <typename Pred>
  void Wait(MutexLock& lock, Pred pred) {
    cv_.wait(lock.lock_, pred);
  }
  // The same with a timeout: false when it passed with pred() still false.
  template <typename Rep, typename Period, typename Pred>
  bool WaitFor(MutexLock& lock, const std::chrono::duration<Rep, Period>& timeout, Pred pred) {
    return cv_.wait_for(lock.lock_, timeout, pred);
  }
  // Without a predicate: false on timeout.
  template <typename Rep, typename Period>
  bool WaitFor(MutexLock& lock, const std::chrono::duration<Rep, Period>& timeout) {
    return cv_.wait_for(lock.lock_, timeout) == std::cv_status::no_timeout;
  }

 private:
  std::condition_variable cv_;
};

}  // namespace tierzero

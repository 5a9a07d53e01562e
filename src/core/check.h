// TZ_CHECK: invariants whose failure is a bug in tierzero, not in the environment. A failed
// check prints the condition, the call site and the streamed message, then aborts. Environment
// failures (out of memory, I/O errors, a rank gone) are returned as Status instead.
#pragma once

#include <sstream>

namespace tierzero::internal {

class CheckFailure {
 public:
  CheckFailure(const char* condition, const char* file, int line);
  [[noreturn]] ~CheckFailure();
  std::ostringstream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Lets `cond ? (void)0 : Voidify() & stream` type-check.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace tierzero::internal

#define TZ_CHECK(cond)                       \
  (cond) ? (void)0                           \
         : ::tierzero::internal::Voidify() & \
               ::tierzero::internal::CheckFailure(#cond, __FILE__, __LINE__).stream()

#define TZ_CHECK_OK(expr)                                           \
  do {                                                              \
    ::tierzero::Status tz_check_status_ = (expr);                   \
    TZ_CHECK(tz_check_status_.ok()) << tz_check_status_.ToString(); \
  } while (0)

#ifdef NDEBUG
#define TZ_DCHECK(cond) \
  while (false) TZ_CHECK(cond)
#else
#define TZ_DCHECK(cond) TZ_CHECK(cond)
#endif

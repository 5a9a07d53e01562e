// Note [A reserve for running out]: under an address-space limit, a JSON document built until
// memory runs out unwinds to a catch (its destructor allocates as it unwinds) instead of
// std::terminate. The reference is the same program without the reserve, which aborts.
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <string>

#include "gtest/gtest.h"
#include "tierzero/status.h"

namespace tierzero {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;  // (its runtime reserves terabytes of address space)
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// This process's mapped address space now (/proc/self/statm's first field, in pages).
size_t MappedBytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0;
  f >> pages;
  return pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// In a child (a death test's): limit the address space to what is mapped plus a little, build a
// document of nested arrays until an allocation fails, and exit 0 from the catch, 3 if nothing
// failed. Arrays of arrays: each destroyed one flattens its children onto a heap vector.
[[noreturn]] void BuildUntilOutOfMemory(bool reserve) {
  if (reserve) InstallMemoryReserve(size_t{32} << 20, 2);
  const rlim_t limit = MappedBytes() + (rlim_t{48} << 20);
  struct rlimit rl {
    limit, limit
  };
  if (::setrlimit(RLIMIT_AS, &rl) != 0) std::_Exit(4);
  try {
    nlohmann::json doc = nlohmann::json::array();
    for (int i = 0; i < (1 << 30); ++i) {
      nlohmann::json row = nlohmann::json::array();
      for (int j = 0; j < 64; ++j) row.push_back(nlohmann::json::array({i, j, "moment"}));
      doc.push_back(std::move(row));
    }
  } catch (const std::bad_alloc&) {
    // The error path allocates too: a message.
    const std::string message = "memory ran out after " + std::to_string(MappedBytes()) + " bytes";
    std::_Exit(reserve && MemoryReserveDrawn() == 0 ? 5 : message.empty() ? 6 : 0);
  }
  std::_Exit(3);
}

TEST(MemoryReserveDeathTest, UnwindingAJsonDocumentUnderALimitReachesTheCatch) {
  if (kSanitized) GTEST_SKIP() << "an address-space limit cannot run under a sanitizer";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(BuildUntilOutOfMemory(/*reserve=*/true), ::testing::ExitedWithCode(0), "");
}

// The test's reference: without the reserve the same program ends in std::terminate (a
// destructor's allocation failed while the first bad_alloc unwound). If this stops failing (a
// JSON library whose destructor does not allocate), the test above proves less.
TEST(MemoryReserveDeathTest, WithoutTheReserveTheSameProgramAborts) {
  if (kSanitized) GTEST_SKIP() << "an address-space limit cannot run under a sanitizer";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(BuildUntilOutOfMemory(/*reserve=*/false), ::testing::KilledBySignal(SIGABRT), "");
}

}  // namespace
}  // namespace tierzero

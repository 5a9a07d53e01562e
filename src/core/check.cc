#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace tierzero::internal {

CheckFailure::CheckFailure(const char* condition, const char* file, int line) {
  stream_ << "tierzero: check failed at " << file << ":" << line << ": " << condition << " ";
}

CheckFailure::~CheckFailure() {
  std::string text = stream_.str();
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace tierzero::internal

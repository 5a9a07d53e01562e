// Fuzz target: human values from the environment and the command line: byte sizes
// (ParseByteSize: budgets, "--device-budget 12MiB") and every tunable's parser (TZ_* variables).
// Properties: no crash; a size that parses is a whole number of bytes that prints and parses
// back to itself in plain digits.
#include <string>

#include "core/bytes.h"
#include "core/tunable.h"
#include "fuzz_common.h"

using namespace tierzero;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = fuzz::AsText(data, size);
  auto bytes = ParseByteSize(text);
  if (bytes.ok()) {
    auto again = ParseByteSize(std::to_string(*bytes));
    FUZZ_CHECK(again.ok() && *again == *bytes, "%llu does not parse back",
               static_cast<unsigned long long>(*bytes));
    (void)FormatBytes(*bytes);
  }
  (void)internal::ParseTunable(text, static_cast<bool*>(nullptr));
  (void)internal::ParseTunable(text, static_cast<int64_t*>(nullptr));
  (void)internal::ParseTunable(text, static_cast<double*>(nullptr));
  (void)internal::ParseTunable(text, static_cast<std::string*>(nullptr));
  (void)internal::ParseTunable(text, static_cast<ByteSize*>(nullptr));
  return 0;
}

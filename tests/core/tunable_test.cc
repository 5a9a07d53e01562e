#include "core/tunable.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <tuple>

#include "core/bytes.h"

namespace tierzero {
namespace {

TZ_TUNABLE(int64_t, kTestDepth, "TZ_TEST_TUNABLE_DEPTH", 32, "test tunable");
TZ_TUNABLE(int64_t, kTestBadEnv, "TZ_TEST_TUNABLE_BAD", 5, "test tunable with a bad env value");
TZ_TUNABLE(ByteSize, kTestSize, "TZ_TEST_TUNABLE_SIZE", ByteSize{kMiB}, "test size tunable");
TZ_TUNABLE(bool, kTestFlag, "TZ_TEST_TUNABLE_FLAG", false, "test flag");
TZ_TUNABLE(double, kTestRate, "TZ_TEST_TUNABLE_RATE", 1.5, "test double");
TZ_TUNABLE_CHOICE(kTestChoice, "TZ_TEST_TUNABLE_CHOICE", "auto", "test choice", "auto", "on",
                  "off");

TEST(TunableTest, DefaultWhenUnset) {
  unsetenv("TZ_TEST_TUNABLE_DEPTH");
  EXPECT_EQ(kTestDepth.Get(), 32);
  EXPECT_EQ(kTestRate.Get(), 1.5);
}

TEST(TunableTest, EnvironmentOverridesDefaultAndSetOverridesBoth) {
  setenv("TZ_TEST_TUNABLE_SIZE", "2GiB", 1);
  setenv("TZ_TEST_TUNABLE_FLAG", "true", 1);
  EXPECT_EQ(kTestSize.Get().bytes, 2 * kGiB);
  EXPECT_TRUE(kTestFlag.Get());
  {
    ScopedTunable<ByteSize> scoped(kTestSize, ByteSize{4096});
    EXPECT_EQ(kTestSize.Get().bytes, 4096u);
  }
  EXPECT_EQ(kTestSize.Get().bytes, 2 * kGiB);
  EXPECT_EQ(kTestSize.ValueString(), "2 GiB");
  EXPECT_EQ(kTestSize.DefaultString(), "1 MiB");
}

TEST(TunableTest, BadEnvironmentValueFallsBackAndIsReported) {
  setenv("TZ_TEST_TUNABLE_BAD", "lots", 1);
  EXPECT_EQ(kTestBadEnv.Get(), 5);
  Status st = ValidateTunables();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("TZ_TEST_TUNABLE_BAD"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("'lots'"), std::string::npos) << st.message();
  unsetenv("TZ_TEST_TUNABLE_BAD");
  EXPECT_TRUE(ValidateTunables().ok());
}

TEST(TunableTest, AChoiceOutsideItsValuesIsRefusedAndFallsBack) {
  setenv("TZ_TEST_TUNABLE_CHOICE", "of", 1);
  EXPECT_EQ(kTestChoice.Get(), "auto");
  Status st = ValidateTunables();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("TZ_TEST_TUNABLE_CHOICE: is \"of\"; accepted: auto, on, off"),
            std::string::npos)
      << st.message();
  setenv("TZ_TEST_TUNABLE_CHOICE", "off", 1);
  EXPECT_TRUE(ValidateTunables().ok());
  unsetenv("TZ_TEST_TUNABLE_CHOICE");
}

TEST(TunableTest, TheLoggingVariablesAreCheckedToo) {
  for (const auto& [var, bad, good] :
       {std::tuple<const char*, const char*, const char*>{"TZ_LOG_LEVEL", "INFO", "info"},
        {"TZ_LOG_SUBSYS", "bogus", "^nvme,adam"}}) {
    setenv(var, bad, 1);
    Status st = ValidateTunables();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << var;
    EXPECT_NE(st.message().find(var), std::string::npos) << st.message();
    setenv(var, good, 1);
    EXPECT_TRUE(ValidateTunables().ok()) << var;
    unsetenv(var);
  }
}

TEST(TunableTest, ANumberIsDecimalAsWritten) {
  double* tag = nullptr;
  EXPECT_TRUE(internal::ParseTunable("2.5", tag).ok());
  EXPECT_TRUE(internal::ParseTunable("-1e3", tag).ok());
  for (const char* bad : {" 5", "5 ", "0x10", "", "inf", "nan", "1e999"})
    EXPECT_FALSE(internal::ParseTunable(bad, tag).ok()) << "'" << bad << "'";
}

TEST(TunableTest, RegistryListsTunables) {
  bool found = false;
  for (const TunableBase* t : AllTunables()) {
    if (std::string(t->env_name()) == "TZ_TEST_TUNABLE_DEPTH") found = true;
  }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace tierzero

#include "core/status.h"

#include <gtest/gtest.h>

#include "core/check.h"

namespace tierzero {
namespace {

Status FailsWith(StatusCode code) { return Status(code, "inner failure"); }

Status PassesThrough(StatusCode code) {
  RETURN_IF_ERROR(FailsWith(code));
  return Status::OK();
}

StatusOr<int> MaybeValue(bool ok) {
  if (!ok) return OutOfMemoryError("no room for the value");
  return 42;
}

StatusOr<int> AddOne(bool ok) {
  ASSIGN_OR_RETURN(int v, MaybeValue(ok));
  return v + 1;
}

Status AssignExisting(bool ok, int* out) {
  int v = 0;
  ASSIGN_OR_RETURN(v, MaybeValue(ok));
  *out = v;
  return Status::OK();
}

TEST(StatusTest, OkIsDefaultAndPrintsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_TRUE(s.message().empty());
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = IoError("read of /x failed");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), "read of /x failed");
  EXPECT_EQ(s.ToString(), "IoError: read of /x failed");
}

TEST(StatusTest, ContextIsPrepended) {
  Status s = NotFoundError("no such file").WithContext("loading checkpoint 'c1'");
  EXPECT_EQ(s.message(), "loading checkpoint 'c1': no such file");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_TRUE(Status::OK().WithContext("ignored").ok());
}

TEST(StatusTest, CopiesAreIndependent) {
  Status a = InternalError("a");
  Status b = a;
  b = std::move(b).WithContext("ctx");
  EXPECT_EQ(a.message(), "a");
  EXPECT_EQ(b.message(), "ctx: a");
}

TEST(StatusTest, ReturnIfErrorPropagatesAndRecordsCallSite) {
  Status s = PassesThrough(StatusCode::kDataLoss);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.ToString().find("status_test.cc:"), std::string::npos) << s.ToString();
  EXPECT_TRUE(
      PassesThrough(StatusCode::kOk == StatusCode::kOk ? StatusCode::kInternal : StatusCode::kOk)
          .code() == StatusCode::kInternal);
}

TEST(StatusTest, AssignOrReturnDeclaresAndAssigns) {
  auto good = AddOne(true);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, 43);
  auto bad = AddOne(false);
  EXPECT_EQ(bad.status().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(bad.status().message(), "no room for the value");
  int out = 0;
  EXPECT_TRUE(AssignExisting(true, &out).ok());
  EXPECT_EQ(out, 42);
  EXPECT_EQ(AssignExisting(false, &out).code(), StatusCode::kOutOfMemory);
}

TEST(StatusTest, StatusOrHoldsMoveOnlyValues) {
  StatusOr<std::unique_ptr<int>> v = std::make_unique<int>(7);
  ASSERT_TRUE(v.ok());
  std::unique_ptr<int> p = std::move(v).value();
  EXPECT_EQ(*p, 7);
}

TEST(StatusTest, ErrnoErrorNamesErrno) {
  Status s = ErrnoError("open /nope", ENOENT);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("No such file"), std::string::npos);
  EXPECT_NE(s.message().find("errno 2"), std::string::npos);
}

TEST(StatusDeathTest, ValueOfErrorAborts) {
  StatusOr<int> v = InvalidArgumentError("bad");
  EXPECT_DEATH((void)v.value(), "InvalidArgument: bad");
}

TEST(StatusDeathTest, CheckFailureAbortsWithMessage) {
  int x = 3;
  EXPECT_DEATH(TZ_CHECK(x == 4) << "x was " << x, "check failed.*x == 4.*x was 3");
}

TEST(StatusTest, EveryCodeHasAName) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kUnsupported); ++c) {
    EXPECT_NE(StatusCodeName(static_cast<StatusCode>(c)), "Unknown") << c;
  }
}

}  // namespace
}  // namespace tierzero

// JsonIn (Note [Reading outside JSON]) and the UTF-8 check: outside data never throws, and every
// error names the source and the field.
#include "core/json_in.h"

#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "tierzero/utf8.h"

namespace tierzero {
namespace {

using nlohmann::json;

std::string Message(const Status& s) { return std::string(s.message()); }

TEST(JsonIn, ReadsFieldsOfTheRightType) {
  const json j = json::parse(R"({"a": {"n": 3, "x": 1.5, "s": "hi", "b": true, "l": [1, 2]}})");
  const JsonIn in(j, "f.json");
  auto a = in.at("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a->get<int>("n"), 3);
  EXPECT_EQ(*a->get<uint64_t>("n"), 3u);
  EXPECT_EQ(*a->get<double>("n"), 3.0);
  EXPECT_EQ(*a->get<double>("x"), 1.5);
  EXPECT_EQ(*a->get<std::string>("s"), "hi");
  EXPECT_TRUE(*a->get<bool>("b"));
  EXPECT_EQ(*a->get_or<int>("missing", 7), 7);
  auto l = a->elements("l");
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->size(), 2u);
  EXPECT_EQ(*(*l)[1].as<int>(), 2);
}

TEST(JsonIn, ErrorsNameTheSourceTheFieldAndTheValue) {
  const json j = json::parse(R"({"a": {"n": "3", "l": [1, "two"]}})");
  const JsonIn in(j, "f.json", StatusCode::kDataLoss);
  const auto n = in.at("a")->get<int>("n");
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(Message(n.status()), "f.json: a.n must be an integer, not \"3\"");
  // A wrong type is an error even where a missing field has a default.
  EXPECT_FALSE(in.at("a")->get_or<int>("n", 1).ok());
  EXPECT_EQ(Message(in.at("a")->get<int>("m").status()), "f.json: a.m is missing");
  const auto l = in.at("a")->elements("l");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(Message((*l)[1].as<int>().status()), "f.json: a.l[1] must be an integer, not \"two\"");
  EXPECT_EQ(Message(in.at("a")->elements("n").status()), "f.json: a.n must be an array, not \"3\"");
  EXPECT_EQ(Message(in.elements().status()), "f.json must be an array, not an object of 1 members");
}

TEST(JsonIn, IntegersOutOfTheTypesRangeAreRefused) {
  const json j =
      json::parse(R"({"big": 18446744073709551615, "neg": -1, "i64": 9223372036854775807})");
  const JsonIn in(j, "f");
  EXPECT_FALSE(in.get<int>("big").ok());
  EXPECT_FALSE(in.get<int64_t>("big").ok());
  EXPECT_EQ(*in.get<uint64_t>("big"), UINT64_MAX);
  EXPECT_FALSE(in.get<uint64_t>("neg").ok());
  EXPECT_FALSE(in.get<uint32_t>("neg").ok());
  EXPECT_EQ(*in.get<int>("neg"), -1);
  EXPECT_FALSE(in.get<int32_t>("i64").ok());
  EXPECT_EQ(*in.get<int64_t>("i64"), INT64_MAX);
}

TEST(JsonIn, NonFiniteAndOutOfRangeFloatsAreRefused) {
  json j = json::object();
  j["inf"] = std::numeric_limits<double>::infinity();
  j["big"] = 1e300;
  const JsonIn in(j, "f");
  EXPECT_FALSE(in.get<double>("inf").ok());
  EXPECT_TRUE(in.get<double>("big").ok());
  EXPECT_FALSE(in.get<float>("big").ok());
}

TEST(JsonIn, DeepNestingIsRefusedWithoutRecursing) {
  // A million levels parse (nlohmann's parser does not recurse); printing them would overflow
  // the stack, so outside data is checked first, and messages never print containers.
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  const json j = json::parse(deep, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  const JsonIn in(j, "deep.json");
  EXPECT_EQ(Message(in.CheckDepth(kMaxJsonDepth)),
            "deep.json nests arrays and objects deeper than 64 levels");
  EXPECT_EQ(Message(in.as<int>().status()),
            "deep.json must be an integer, not an array of 1 elements");
  const json shallow = json::parse(R"({"a": [[1], {"b": 2}]})");
  EXPECT_TRUE(JsonIn(shallow, "s").CheckDepth(3).ok());
  EXPECT_FALSE(JsonIn(shallow, "s").CheckDepth(2).ok());
}

// A whole number 64 bits do not hold is refused where it is (it would be read as a double, another
// value); numbers with a fraction or exponent, -0 and the largest unsigned are read.
TEST(JsonIn, WholeNumbersBeyond64BitsAreRefusedWhereTheyAre) {
  for (const char* good :
       {R"({"a": 1e5})", R"({"a": -0})", R"({"a": 0.5})", R"({"a": 18446744073709551615})",
        R"({"a": -9223372036854775808})", R"([1.5e300, -2E-3])"}) {
    auto j = ParseOutsideJson(good, "t");
    EXPECT_TRUE(j.ok()) << good << ": " << j.status().ToString();
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"a": 18446744073709551616})", "(at a)"},
      {R"({"a": {"b": [1, -9223372036854775809]}})", "(at a.b[1])"},
      {R"([99999999999999999999999])", "(at [0])"},
  };
  for (const auto& [text, where] : bad) {
    auto j = ParseOutsideJson(text, "t");
    ASSERT_FALSE(j.ok()) << text;
    EXPECT_NE(j.status().message().find("beyond what 64 bits hold"), std::string::npos)
        << j.status().ToString();
    EXPECT_NE(j.status().message().find(where), std::string::npos) << j.status().ToString();
  }
}

// A number a double reads as 0, and a NUL the parser took as the text's end (what followed it
// unread): refused, where and what (hunt 51). 0 written as 0, and denormals, are numbers.
TEST(JsonIn, NumbersReadAsZeroAndNulBytesAreRefused) {
  for (const char* good : {R"({"a": 0.0})", R"({"a": 0e-400})", R"({"a": -0.000})",
                           R"({"a": 4.9e-324})", R"({"a": 1e-300})"}) {
    auto j = ParseOutsideJson(good, "t");
    EXPECT_TRUE(j.ok()) << good << ": " << j.status().ToString();
  }
  for (const char* tiny : {R"({"a": {"b": 1e-400}})", R"({"a": {"b": -2.5E-999}})"}) {
    auto j = ParseOutsideJson(tiny, "t");
    ASSERT_FALSE(j.ok()) << tiny;
    EXPECT_NE(j.status().message().find("too small for a double"), std::string::npos)
        << j.status().ToString();
    EXPECT_NE(j.status().message().find("(at a.b)"), std::string::npos) << j.status().ToString();
  }
  const std::string nul("{\"a\": 1}\0{\"junk", 14);
  auto j = ParseOutsideJson(nul, "t");
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("NUL byte at offset 8"), std::string::npos)
      << j.status().ToString();
}

TEST(JsonIn, ANonObjectHasNoMembers) {
  const json j = json::parse("[1]");
  const JsonIn in(j, "f");
  EXPECT_FALSE(in.has("a"));
  EXPECT_FALSE(in.at("a").ok());
  EXPECT_FALSE(in.get_or<int>("a", 1).ok());
}

TEST(Utf8, AcceptsValidTextAndFindsTheFirstBadByte) {
  EXPECT_EQ(FirstInvalidUtf8(""), -1);
  EXPECT_EQ(FirstInvalidUtf8("plain ascii"), -1);
  EXPECT_EQ(FirstInvalidUtf8("\xc3\xa9t\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x98\x80"), -1);
  EXPECT_EQ(FirstInvalidUtf8("ab\x8e"), 2);            // a continuation byte alone
  EXPECT_EQ(FirstInvalidUtf8("a\xc3"), 1);             // cut short
  EXPECT_EQ(FirstInvalidUtf8("\xc0\xaf"), 0);          // overlong '/'
  EXPECT_EQ(FirstInvalidUtf8("\xe0\x80\xaf"), 0);      // overlong, 3 bytes
  EXPECT_EQ(FirstInvalidUtf8("\xed\xa0\x80"), 0);      // a surrogate (U+D800)
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), 0);  // past U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8("\xf5\x80\x80\x80"), 0);
  EXPECT_EQ(FirstInvalidUtf8("x\xe6\x97"), 1);
}

TEST(Utf8, AgreesWithTheJsonWriter) {
  // Every string the check accepts can be written as JSON; every one it refuses cannot.
  for (const std::string s :
       {"ok", "\xc3\xa9", "\xed\x9f\xbf", "\xee\x80\x80", "\xf0\x90\x80\x80", "\xf4\x8f\xbf\xbf",
        "\xed\xa0\x80", "\xc1\xbf", "\xf0\x8f\xbf\xbf", "\xff"}) {
    bool writes = true;
    try {
      (void)json(s).dump();
    } catch (const json::exception&) {
      writes = false;
    }
    EXPECT_EQ(FirstInvalidUtf8(s) < 0, writes)
        << json(s).dump(-1, ' ', true, json::error_handler_t::replace);
  }
}

// A message quoting what could not be parsed stays text: bytes that are not UTF-8 (a damaged
// safetensors header) and control characters are written \xNN; valid UTF-8 is kept.
TEST(JsonIn, ParseErrorsQuoteBinaryBytesEscaped) {
  auto bad = ParseOutsideJson(std::string("{\"a\": \xff\xfe\x01}", 10), "header");
  ASSERT_FALSE(bad.ok());
  const std::string m(bad.status().message());
  EXPECT_EQ(FirstInvalidUtf8(m), -1) << m;
  EXPECT_NE(m.find("\\xff"), std::string::npos) << m;
  // (A key holding a control character, written \u0001 in the file, is quoted so.)
  auto twice = ParseOutsideJson("{\"caf\xc3\xa9\\u0001\": 1, \"caf\xc3\xa9\\u0001\": 2}", "config");
  ASSERT_FALSE(twice.ok());
  const std::string t(twice.status().message());
  EXPECT_NE(t.find("caf\xc3\xa9\\x01"), std::string::npos) << t;
}

}  // namespace
}  // namespace tierzero

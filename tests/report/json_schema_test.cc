// CheckAgainstSchema (src/profiler/json_schema.h): each keyword's verdict and the field its error
// names, worked out by hand from the JSON Schema 2020-12 text; and the embedded report schema uses
// no keyword the checker would pass over. render_test.sh compares its verdicts on a real report's
// mutations with python3-jsonschema's.
#include "profiler/json_schema.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace tierzero {
namespace {

using nlohmann::json;

std::string Why(const json& value, const json& schema) {
  Status s = CheckAgainstSchema(value, schema);
  if (s.ok()) return "ok";
  return std::string(s.code() == StatusCode::kInternal ? "internal: " : "") +
         std::string(s.message());
}

TEST(JsonSchemaTest, Types) {
  const json s = {{"type", "integer"}};
  EXPECT_EQ(Why(3, s), "ok");
  EXPECT_EQ(Why(-3, s), "ok");
  EXPECT_EQ(Why(2.0, s), "ok");  // 2020-12: a number with no fraction is an integer
  EXPECT_EQ(Why(2.5, s), "the report is 2.5, not an integer");
  EXPECT_EQ(Why(true, s), "the report is true, not an integer");
  EXPECT_EQ(Why("3", s), "the report is \"3\", not an integer");
  EXPECT_EQ(Why(2.5, {{"type", "number"}}), "ok");
  EXPECT_EQ(Why(nullptr, {{"type", "number"}}), "the report is null, not a number");
  EXPECT_EQ(Why(json::array(), {{"type", "object"}}),
            "the report is an array of 0 elements, not an object");
  EXPECT_EQ(Why(json::object(), {{"type", "array"}}),
            "the report is an object of 0 members, not an array");
  EXPECT_EQ(Why(1, {{"type", "boolean"}}), "the report is 1, not true or false");
  EXPECT_EQ(Why(nullptr, {{"type", json::array({"string", "null"})}}), "ok");
  EXPECT_EQ(Why(1, {{"type", json::array({"string", "null"})}}),
            "the report is 1, not a string or null");
}

TEST(JsonSchemaTest, ConstEnumAndBounds) {
  EXPECT_EQ(Why(2, {{"const", 2}}), "ok");
  EXPECT_EQ(Why(2.0, {{"const", 2}}), "ok");  // the same number
  EXPECT_EQ(Why(true, {{"const", 1}}), "the report is true; it must be 1");
  EXPECT_EQ(Why("x", {{"const", "tierzero-report"}}),
            "the report is \"x\"; it must be \"tierzero-report\"");
  const json e = {{"enum", {"device", "host"}}};
  EXPECT_EQ(Why("host", e), "ok");
  EXPECT_EQ(Why("nvme", e), "the report is \"nvme\"; it must be one of \"device\", \"host\"");
  const json b = {{"minimum", 0}, {"maximum", 1}};
  EXPECT_EQ(Why(0, b), "ok");
  EXPECT_EQ(Why(1.0, b), "ok");
  EXPECT_EQ(Why(-1e-9, b), "the report is -1e-09, below its least, 0");
  EXPECT_EQ(Why(1.5, b), "the report is 1.5, above its most, 1");
  EXPECT_EQ(Why("7", b), "ok");  // bounds only speak of numbers
}

TEST(JsonSchemaTest, ObjectsAndArrays) {
  const json s = json::parse(R"({
    "type": "object", "required": ["a", "b"],
    "properties": {
      "a": {"type": "array", "minItems": 1, "items": {"type": "string"}},
      "b": {"type": "object", "additionalProperties": false}},
    "additionalProperties": {"type": "integer"}})");
  EXPECT_EQ(Why({{"a", {"x"}}, {"b", json::object()}, {"c", 4}}, s), "ok");
  EXPECT_EQ(Why({{"a", {"x"}}}, s), "b is missing");
  EXPECT_EQ(Why({{"a", json::array()}, {"b", json::object()}}, s),
            "a has 0 elements; it needs at least 1");
  EXPECT_EQ(Why({{"a", {"x", 7}}, {"b", json::object()}}, s), "a[1] is 7, not a string");
  EXPECT_EQ(Why({{"a", {"x"}}, {"b", {{"q\n", 1}}}}, s), "b has a field \"q\\n\" it may not have");
  EXPECT_EQ(Why({{"a", {"x"}}, {"b", json::object()}, {"c", "four"}}, s),
            "c is \"four\", not an integer");
  // Members a schema does not name, with no additionalProperties, are anything.
  EXPECT_EQ(Why({{"z", nullptr}}, {{"properties", {{"a", {{"type", "string"}}}}}}), "ok");
}

TEST(JsonSchemaTest, PatternAndRefs) {
  const json root = {{"$defs", {{"bytes", {{"type", "integer"}, {"minimum", 0}}}}},
                     {"properties",
                      {{"n", {{"$ref", "#/$defs/bytes"}}},
                       {"r", {{"type", "string"}, {"pattern", "^[DHN]*$"}}},
                       {"d", {{"pattern", "^[a-c0-9_]*$"}}}}}};
  EXPECT_EQ(Why({{"n", 5}, {"r", "DDHN"}, {"d", "a1_c"}}, root), "ok");
  EXPECT_EQ(Why({{"r", ""}}, root), "ok");
  EXPECT_EQ(Why({{"n", -5}}, root), "n is -5, below its least, 0");
  EXPECT_EQ(Why({{"r", "DDXN"}}, root), "r is \"DDXN\", which does not match ^[DHN]*$");
  EXPECT_EQ(Why({{"d", "abd"}}, root), "d is \"abd\", which does not match ^[a-c0-9_]*$");
  // A residency string of a million chunks: no recursion per character.
  EXPECT_EQ(Why({{"r", std::string(1 << 20, 'D')}}, root), "ok");
  EXPECT_EQ(Why({{"n", 1}}, {{"properties", {{"n", {{"$ref", "#/$defs/none"}}}}}}),
            "internal: the schema has no $defs/none");
}

TEST(JsonSchemaTest, OneOfNamesTheFormMeant) {
  const json s = json::parse(R"({"oneOf": [
    {"type": "object", "required": ["available"], "properties": {"available": {"const": false}},
     "additionalProperties": false},
    {"type": "object", "required": ["available", "links"],
     "properties": {"available": {"const": true}, "links": {"type": "object"}}}]})");
  EXPECT_EQ(Why({{"available", false}}, s), "ok");
  EXPECT_EQ(Why({{"available", true}, {"links", json::object()}}, s), "ok");
  EXPECT_EQ(Why({{"available", true}}, s), "links is missing");
  EXPECT_EQ(Why({{"available", false}, {"links", 1}}, s),
            "the report has a field \"links\" it may not have");
  EXPECT_EQ(Why({{"available", "yes"}}, s),
            "the report matches none of its 2 forms (the first: available is \"yes\"; it must be "
            "false)");
  const json both = json::parse(R"({"oneOf": [{"type": "integer"}, {"minimum": 0}]})");
  EXPECT_EQ(Why(-1, both), "ok");
  EXPECT_EQ(Why(1, both), "the report matches more than one of its 2 forms");
}

TEST(JsonSchemaTest, UnknownKeywordsAreInternal) {
  EXPECT_EQ(Why(1, {{"maxItems", 3}}),
            "internal: the schema uses the keyword maxItems, not checked here");
  EXPECT_EQ(Why("a", {{"pattern", "^a+$"}}),
            "internal: the schema's pattern ^a+$ is not of the one form checked here, ^[...]*$");
  EXPECT_EQ(CheckSchemaKeywords(json::parse(R"({"properties": {"a": {"oneOf": [{"if": true}]}}})"))
                .message(),
            "the schema/properties/a/oneOf/0/if: the keyword if is not checked here");
  EXPECT_TRUE(CheckSchemaKeywords({{"properties", {{"a", {{"type", "string"}}}}}}).ok());
}

TEST(JsonSchemaTest, TheReportSchemaIsAllChecked) {
  const json& schema = ReportSchema();
  ASSERT_TRUE(schema.is_object());
  EXPECT_EQ(schema.value("title", ""), "tierzero memory placement report, version 2");
  Status s = CheckSchemaKeywords(schema);
  EXPECT_TRUE(s.ok()) << s.ToString();
}

}  // namespace
}  // namespace tierzero

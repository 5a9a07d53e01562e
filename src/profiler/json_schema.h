// Checking a JSON value against a JSON Schema (draft 2020-12): the subset of keywords the
// report's schema (docs/report.schema.json) uses.
//
// Note [A report checked against its schema]
// `tierzero report` renders a report.json a user may have edited, or that another tool wrote. The
// HTML page's script reads some hundred fields; the summary read fewer, and the page was checked
// only against those, so a report missing `layout`, `config` or `profile.links` was written as a
// page whose script threw (a blank page) while the command exited 0. The schema already says what
// every consumer may rely on: each report is now checked against it, embedded in the binary,
// before anything renders, and a field that breaks it is named ("profile.links is missing").
//
// The checker knows the keywords the schema uses: type, const, enum, minimum, maximum,
// required, properties, additionalProperties, items, minItems, oneOf, $ref (to "#/$defs/..."),
// pattern (only "^[...]*$": one character class repeated, checked without std::regex, which
// recurses once per character) and the annotations ($schema, $id, title, description, $defs). A
// schema with any other keyword is an InternalError, so the schema cannot grow a rule nobody checks
// (tests/report/json_schema_test.cc checks the embedded schema uses none).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/status.h"

namespace tierzero {

// OK when `value` follows `schema`; otherwise InvalidArgument naming the first field that does
// not ("profile.links is missing", "layout.chunks[2].tensors is 7, not an array"), or
// InternalError when the schema uses a keyword this checker does not know.
Status CheckAgainstSchema(const nlohmann::json& value, const nlohmann::json& schema);

// OK when every keyword anywhere in `schema` is one CheckAgainstSchema checks (and its one form of
// pattern); otherwise InternalError naming where. CheckAgainstSchema only meets the keywords on
// the paths a value takes.
Status CheckSchemaKeywords(const nlohmann::json& schema);

// The report's schema, docs/report.schema.json, as this build embeds it.
const nlohmann::json& ReportSchema();

}  // namespace tierzero

// tierzero/files.h's check of outside JSON (Note [Outside JSON parsed strictly], core/json_in.h),
// for code on the public API (the CLI, the GPT), which does not see nlohmann's SAX interface.
#include "core/json_in.h"
#include "tierzero/files.h"

namespace tierzero {

Status CheckOutsideJson(std::string_view text, const std::string& source, bool allow_comments) {
  if (std::string nul = json_in_internal::NulInText(text); !nul.empty())
    return InvalidArgumentError(source + nul);
  json_in_internal::StrictSax sax(kMaxJsonDepth);
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(text, &sax, nlohmann::json::input_format_t::json,
                                   /*strict=*/true, allow_comments);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(source +
                                " is not valid JSON: " + json_in_internal::Printable(e.what()));
  }
  if (ok) return Status::OK();
  return InvalidArgumentError(source + " " +
                              (sax.error().empty() ? "is not valid JSON" : sax.error()));
}

}  // namespace tierzero

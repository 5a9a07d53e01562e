// Fuzz target: `tierzero report R.json` (the summary, the Chrome trace and the HTML page of a
// report file). Properties: no crash or exception; a report whose summary is accepted renders a
// page whose data cannot close its <script> element.
#include <cctype>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "fuzz_common.h"
#include "tierzero/report.h"

using namespace tierzero;

namespace {
// Occurrences of `what` (lower case) in `s`, ignoring case (HTML tags are case-insensitive).
size_t Count(std::string s, const std::string& what) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  size_t n = 0;
  for (size_t at = 0; (at = s.find(what, at)) != std::string::npos; at += what.size()) ++n;
  return n;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(fuzz::AsText(data, size));
  const bool summary = ReportSummary(text).ok();
  (void)WriteChromeTrace(text, fuzz::ScratchDir() + "/trace.json");
  const std::string page = fuzz::ScratchDir() + "/report.html";
  std::remove(page.c_str());
  const Status html = WriteHtmlReport(text, page);
  FUZZ_CHECK(html.ok() == summary, "the page and the summary disagree on a report: %s",
             html.ToString().c_str());
  if (html.ok()) {
    // The page's own script elements and comments, and no more: the report's data can neither
    // end a script early nor open a comment (which can keep the page's </script> from closing).
    static const std::string minimal_page = [] {
      const std::string minimal =
          R"({"schema":"tierzero-report","version":2,"tiers":{"device":{"peak":0,"capacity":0},)"
          R"("host":{"used":0,"budget":0},"nvme":{"used":0,"budget":0}},"counters":{)"
          R"("h2d_bytes":0,"d2h_bytes":0,"nvme_read_bytes":0,"nvme_write_bytes":0},)"
          R"("profile":{"available":false}})";
      const std::string path = fuzz::ScratchDir() + "/minimal.html";
      FUZZ_CHECK(WriteHtmlReport(minimal, path).ok(), "the minimal report does not render");
      return ReadAll(path);
    }();
    const std::string got = ReadAll(page);
    for (const char* tag : {"</script", "<!--"})
      FUZZ_CHECK(Count(got, tag) == Count(minimal_page, tag), "the report's data holds %s", tag);
  }
  return 0;
}

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
      // The fewest fields the report's schema allows (Note [A report checked against its
      // schema], src/profiler/json_schema.h).
      const std::string minimal =
          R"({"schema":"tierzero-report","version":2,"config":{"compute_dtype":"bf16",)"
          R"("device":"hostsim","device_budget":0,"device_shard_budget":0,"grad_accumulation":1,)"
          R"("host_budget":0,"nvme_budget":0},"counters":{"acquire_wait_seconds":0,"d2h_bytes":0,)"
          R"("deviations":0,"evictions":0,"h2d_bytes":0,"hits":0,"misses":0,"nvme_read_bytes":0,)"
          R"("nvme_write_bytes":0,"optimizer_nvme_seconds":0,"optimizer_seconds":0,"plans":0,)"
          R"("prefetches":0,"skipped_steps":0,"stall_seconds":0,"steps":0},"layout":{)"
          R"("chunk_bytes":4,"chunk_elems":1,"chunks":[{"grad_tier":"host","optimizer_tier":)"
          R"("host","param_tier":"host","tensors":["w"],"used_elems":1}],"waste_fraction":0},)"
          R"("moments":[],"optimizer":{"sub_groups":[{"bytes":12,"chunk":0,"tier":"host"}]},)"
          R"("plan":{"planned":false,"policy":"lru","predicted_stall_seconds":0},)"
          R"("profile":{"available":false},"tiers":{"device":{"capacity":0,"current":0,"peak":0,)"
          R"("resident_shard_bytes":0},"host":{"budget":0,"fixed_bytes":0,"model_bytes":0,)"
          R"("used":0},"nvme":{"budget":0,"used":0}}})";
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

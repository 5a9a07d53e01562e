#include "report.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "plan_check.h"
#include "run_dir.h"
#include "signals.h"
#include "tierzero/files.h"
#include "tierzero/report.h"
#include "train.h"

namespace tierzero::app {

int ReportCommand(const std::vector<std::string>& args) {
  // (Under mpirun every rank wrote the same page: they raced, one refused the other's file.)
  if (int rc = RefuseUnderLauncher("report", "it renders one run's report"); rc != 0) return rc;
  // A signal ends it at once with a message: it may wait on an input (a FIFO with no writer, as
  // `cat` would) and has nothing to save; what it was writing is removed (signals.h).
  GracefulInterrupts interrupts(
      /*during_setup=*/true,
      "during the report: it stops now (what it was writing is removed; its inputs are "
      "unchanged)");
  std::string input, html, trace, plan;
  bool overwrite = false;  // an existing -o or --trace file may be replaced
  for (size_t i = 0; i < args.size(); ++i) {
    // An option's value missing (at the end) or empty (an unset shell variable): not "unknown
    // argument", and not a page silently not written.
    for (const char* takes : {"-o", "--output", "--trace", "--plan"}) {
      if (args[i] != takes) continue;
      if (i + 1 >= args.size() || args[i + 1].empty()) {
        std::fprintf(stderr, "error: %s needs a value%s\n", takes,
                     i + 1 < args.size() ? " (it is empty: an unset shell variable?)" : "");
        return 1;
      }
    }
    if ((args[i] == "-o" || args[i] == "--output") && i + 1 < args.size()) {
      html = args[++i];
    } else if (args[i] == "--trace" && i + 1 < args.size()) {
      trace = args[++i];
    } else if (args[i] == "--plan" && i + 1 < args.size()) {
      plan = args[++i];
    } else if (args[i] == "--overwrite") {
      overwrite = true;
    } else if (args[i] == "-h" || args[i] == "--help") {
      std::printf(
          "usage: tierzero report REPORT.json [-o report.html] [--trace trace.json]\n"
          "                       [--plan plan.json] [--overwrite]\n"
          "  prints the summary; -o writes the HTML page (self-contained), --trace the Chrome\n"
          "  trace of the profiled iteration (open it in Perfetto or chrome://tracing);\n"
          "  --plan shows a `tierzero plan --json` prediction of the run beside what it "
          "measured\n"
          "  (-o and --output are the same); an existing -o or --trace file is replaced only\n"
          "  with --overwrite\n");
      return 0;
    } else if (input.empty() && args[i] == "--" && i + 1 < args.size()) {
      input = args[++i];  // (a report whose path begins with '-')
    } else if (input.empty() && !args[i].empty() && args[i][0] != '-') {
      input = args[i];
    } else {
      std::fprintf(stderr, "error: unknown argument '%s' (tierzero report --help%s)\n",
                   args[i].c_str(),
                   args[i].find('/') != std::string::npos
                       ? "; a path that begins with '-': write ./ before it, or -- before it"
                       : "");
      return 1;
    }
  }
  if (input.empty()) {
    std::fprintf(stderr, "error: no report given (tierzero report REPORT.json -o report.html)\n");
    return 1;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  };
  // Note [Data on standard output] (run_dir.h): the summary then goes to standard error.
  const std::string html_to = TakeStdoutForData(html), trace_to = TakeStdoutForData(trace);
  for (const auto& [flag, out] :
       {std::pair<const char*, std::string>{"-o", html}, {"--trace", trace}}) {
    if (out.empty()) continue;
    if (Status s = CheckOutputPath(out, flag); !s.ok()) return fail(s);
    if (Status s = CheckOutputDirectory(out, flag); !s.ok()) return fail(s);
  }
  // Neither output is an input, nor the other output.
  const std::vector<InputPath> inputs = {{"report", input, false}, {"plan", plan, false}};
  for (const auto& [flag, out] :
       {std::pair<const char*, std::string>{"-o", html}, {"--trace", trace}}) {
    if (out.empty()) continue;
    if (Status s = CheckNotAnInput(out, flag, inputs); !s.ok()) return fail(s);
  }
  if (!html.empty() && !trace.empty() &&
      !CheckNotAnInput(trace, "--trace", {{"HTML page (-o)", html, false}}).ok())
    return fail(InvalidArgumentError("--trace " + trace + " and -o " + html +
                                     " name the same file: give each output its own"));
  // A file report did not make is replaced only when asked (docs/outputs.md).
  for (const auto& [flag, out] :
       {std::pair<const char*, std::string>{"-o", html}, {"--trace", trace}}) {
    if (Status s = CheckNotReplacedUnasked(out, flag, "report", overwrite); !s.ok()) return fail(s);
  }
  auto text = ReadReportFile(input);
  if (!text.ok()) return fail(text.status());
  if (!plan.empty()) {
    auto plan_text = ReadTextFile(plan, "plan file");
    if (!plan_text.ok()) return fail(plan_text.status());
    if (Status s = CheckPlanOfReport(*text, *plan_text); !s.ok())
      return fail(std::move(s).WithContext("--plan " + plan));
    auto with = WithPrediction(*text, *plan_text);
    if (!with.ok()) return fail(std::move(with).status().WithContext(plan));
    text = std::move(with);
  }
  auto summary = ReportSummary(*text);
  if (!summary.ok()) return fail(std::move(summary).status().WithContext(input));
  // Both outputs are rendered before either is written: a report that cannot be traced (no
  // profiled iteration, malformed events) is refused with the page's file as it was.
  std::string page_text, trace_text;
  if (!trace.empty()) {
    auto t = RenderChromeTrace(*text);
    if (t.status().code() == StatusCode::kFailedPrecondition)
      return fail(FailedPreconditionError(
          input +
          " has no profiled iteration (its run ended before it): no trace can be drawn; "
          "leave --trace out"));
    if (!t.ok()) return fail(std::move(t).status().WithContext(input));
    trace_text = std::move(t).value();
  }
  if (!html.empty()) {
    auto p = RenderHtmlReport(*text);
    if (!p.ok()) return fail(std::move(p).status().WithContext(input));
    page_text = std::move(p).value();
  }
  std::fputs(summary->c_str(), stdout);
  if (!html.empty()) {
    if (Status s = WriteTextFile(html_to, page_text); !s.ok())
      return fail(s.WithContext("writing the page " + html));
    std::printf("html: %s\n", html.c_str());
  }
  if (!trace.empty()) {
    if (Status s = WriteTextFile(trace_to, trace_text); !s.ok())
      return fail(
          s.WithContext("writing the trace " + trace +
                        (html.empty() ? std::string() : " (the page " + html + " is written)")));
    std::printf("trace: %s\n", trace.c_str());
  }
  return 0;
}

}  // namespace tierzero::app

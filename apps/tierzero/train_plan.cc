// TrainRun's plan (train_run.h): the --plan a run is given, or the one a resumed run's config
// records, read and checked against the run before it trains (its config, then the engine's
// layout), so the report shows its prediction beside the run's figures.
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "plan_check.h"
#include "tierzero/files.h"
#include "tierzero/report.h"
#include "train.h"
#include "train_run.h"

namespace tierzero::app {
using nlohmann::json;

bool TrainRun::RecordedPlan() const {
  return !out_.resume.empty() && cfg_.given.count("output.plan") == 0;
}

Status TrainRun::ReadPlan() {
  // A plan of another config: refused before the engine is built or a weight loads (its layout
  // is compared with the engine's in CheckPlanLayout).
  // Note [A plan the resumed run recorded, gone]: a resume in place takes the plan its run's
  // config.json records (output.plan); moved or removed since, it blocked the resume with an
  // error that named neither that file nor a way on (hunt 49). The plan only sets a prediction
  // beside the run's figures: the run goes on without it, saying so. One given as --plan is
  // this command's, and still refused.
  bool plan_gone = false;
  const bool recorded_plan = RecordedPlan();
  if (!out_.plan.empty() && lead_ && recorded_plan) {
    struct stat st {};
    plan_gone = ::stat(out_.plan.c_str(), &st) != 0 && errno == ENOENT;
    if (plan_gone) {
      std::printf(
          "note: the plan %s the run's config records (output.plan) is not there: the report "
          "leaves the prediction out (--plan FILE gives one)\n",
          out_.plan.c_str());
    }
  }
  // Note [A plan the resumed run recorded, of another config]: a resume that changes what the
  // plan was made for (its budgets, its batch, its ranks), or finds the file unreadable now, was
  // refused for a --plan it never gave, and `--plan none` was a file name (hunt 51, review 51).
  // As when it is gone: said, and left out.
  auto leave_out = [&](const std::string& why) {
    std::printf(
        "note: the plan %s the run's config records (output.plan) %s: the report leaves "
        "the prediction out (--plan FILE gives one)\n",
        out_.plan.c_str(), why.c_str());
    plan_text_.clear();
  };
  if (!out_.plan.empty() && lead_ && !plan_gone) {
    StatusOr<std::string> text = ReadTextFile(out_.plan, "plan file");
    // Outside JSON: its depth bounded before anything recurses over it (a plan nested 500000
    // deep overflowed the stack in CheckPlanConfig's copy).
    Status readable = text.ok() ? CheckOutsideJson(*text, "--plan " + out_.plan) : text.status();
    if (!readable.ok() && recorded_plan) {
      leave_out("cannot be read now (" + std::string(readable.message()) + ")");
    } else {
      TZ_RETURN_IF_ERROR(readable);
      plan_text_ = std::move(text).value();
    }
  }
  if (!plan_text_.empty() && lead_) {
    const json plan = json::parse(plan_text_, nullptr, /*allow_exceptions=*/false);
    if (!plan.is_object()) {
      // (WithPrediction, below, says what it is.)
    } else if (plan.contains("config")) {
      Status checked = CheckPlanConfig(plan["config"], cfg_, /*of_trace=*/IsATracesPlan(plan));
      if (!checked.ok() && recorded_plan) {
        // (What differs: the check's first parenthesis, "(engine.host_budget ... here)".)
        std::string what(checked.message());
        if (const size_t open = what.find('('), close = what.find(')');
            open != std::string::npos && close != std::string::npos && close > open)
          what = what.substr(open + 1, close - open - 1);
        leave_out("was made for another config (" + what + ")");
      } else {
        TZ_RETURN_IF_ERROR(std::move(checked).WithContext("--plan " + out_.plan));
      }
    } else {
      // (Also the prediction object alone, which WithPrediction takes from a library's caller.)
      // An older tierzero's plan records no config: its layout alone would be checked, and a
      // plan of another batch shown as this run's prediction (hunt 41). Refused when given; a
      // resume whose run recorded it (its config.json) goes on without it, saying so.
      const std::string why =
          "--plan " + out_.plan +
          " records no config (an older tierzero wrote it), so it cannot be checked to be this "
          "run's";
      if (out_.resume.empty())
        return FailedPreconditionError(
            why + ": make it again with tierzero plan (this run's config and options) --json FILE");
      std::printf("note: %s: the report leaves it out (tierzero plan ... --json FILE makes one)\n",
                  why.c_str());
      plan_text_.clear();
    }
  }
  return Status::OK();
}

Status TrainRun::CheckPlanLayout() {
  const bool recorded_plan = RecordedPlan();
  if (!plan_text_.empty() && lead_) {
    // Refused now, not after the run: a plan (read above) unreadable or of another config; one
    // the resumed run recorded of another layout or rank count is left out, said.
    TZ_ASSIGN_OR_RETURN(const std::string report, engine_->ReportJson());
    if (auto s = WithPrediction(report, plan_text_); !s.ok()) {
      if (!recorded_plan) return s.status().WithContext("--plan " + out_.plan);
      std::printf(
          "note: the plan %s the run's config records (output.plan) is not this run's "
          "(%s): the report leaves the prediction out (--plan FILE gives one)\n",
          out_.plan.c_str(), std::string(s.status().message()).c_str());
      plan_text_.clear();
    }
  }
  return Status::OK();
}

}  // namespace tierzero::app

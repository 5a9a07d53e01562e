// What `tierzero train` prints while it runs: on a terminal one progress line rewritten in place
// (step, loss, tokens/s, elapsed and remaining time); otherwise a line every `log_every` steps,
// the run's first and last steps and every skipped step (docs/config.md, "Output").
//
// Thread-safety: used by the training loop's thread only.
#pragma once

#include <chrono>
#include <string>

namespace tierzero::app {

struct StepLine {
  int step = 0;  // 1-based, the step just finished
  double loss = 0, lr = 0, tokens_per_s = 0, step_s = 0;
  std::string memory;    // "dev 3.1/12.0 MiB host 15.9 MiB nvme 20.4 MiB"
  bool skipped = false;  // non-finite gradient: the update was not applied
};

class Progress {
 public:
  // `log_every` 0: the default (about 20 lines over the run, at a round step count); `tty`: the
  // output is a terminal (the line is rewritten in place). With `quiet`, no step lines at all.
  Progress(int start_step, int total_steps, int log_every, bool quiet, bool tty);

  // The default `log_every` for a run of `steps`: 1, 2, 5, 10, 20, 50, ... at about steps / 20.
  static int DefaultLogEvery(int steps);

  void Step(const StepLine& line);
  // A line of its own (an evaluation, a message): the progress line is ended first.
  void Line(const std::string& text);
  // Ends the progress line (before the closing summary).
  void Finish();

 private:
  std::string Times(int step) const;

  int start_, total_, log_every_;
  bool quiet_, tty_;
  bool line_open_ = false;  // a progress line is on the terminal without its newline
  std::chrono::steady_clock::time_point t0_;
  double first_step_s_ = 0;  // the first step's (warm-up) time, left out of the remaining time
  std::chrono::steady_clock::time_point last_draw_;  // the terminal's line, last drawn
};

}  // namespace tierzero::app

// progress.h
#include "progress.h"

#include <algorithm>
#include <cstdio>

namespace tierzero::app {
namespace {

std::string Clock(double s) {
  if (!(s >= 0) || s > 99 * 3600.0) return "--:--";
  const long t = static_cast<long>(s + 0.5);
  char b[32];
  if (t >= 3600) {
    std::snprintf(b, sizeof b, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
  } else {
    std::snprintf(b, sizeof b, "%ld:%02ld", t / 60, t % 60);
  }
  return b;
}

}  // namespace

Progress::Progress(int start_step, int total_steps, int log_every, bool quiet, bool tty)
    : start_(start_step),
      total_(total_steps),
      log_every_(log_every > 0 ? log_every : DefaultLogEvery(total_steps)),
      quiet_(quiet),
      tty_(tty),
      t0_(std::chrono::steady_clock::now()) {}

int Progress::DefaultLogEvery(int steps) {
  const double want = std::max(1.0, steps / 20.0);
  for (long scale = 1;; scale *= 10) {
    for (long m : {1, 2, 5}) {
      if (m * scale >= want) return static_cast<int>(std::min<long>(m * scale, 1 << 30));
    }
  }
}

std::string Progress::Times(int step) const {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const int done = step - start_;
  std::string s = Clock(elapsed) + " elapsed";
  if (step < total_ && done > 0) {
    // The first step plans and warms up: the steps after it say what the rest will take.
    const double per = done > 1 ? (elapsed - first_step_s_) / (done - 1) : elapsed;
    s += ", " + Clock(per * (total_ - step)) + " left";
  }
  return s;
}

void Progress::Step(const StepLine& l) {
  if (l.step == start_ + 1)
    first_step_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  if (quiet_) return;
  char head[160];
  std::snprintf(head, sizeof head, "step %5d/%d | loss %.4f | lr %.2e | %6.0f tok/s | %5.0f ms",
                l.step, total_, l.loss, l.lr, l.tokens_per_s, l.step_s * 1e3);
  const std::string tail = l.skipped ? " (skipped: non-finite gradient)" : "";
  const bool periodic = l.step == start_ + 1 || l.step == total_ || l.step % log_every_ == 0;
  if (tty_) {
    // Rewritten in place: a carriage return, the line, and erase-to-end-of-line.
    std::printf("\r%s | %s | %s%s\x1b[K", head, Times(l.step).c_str(), l.memory.c_str(),
                tail.c_str());
    line_open_ = true;
    if (l.skipped) {  // a skipped step stays on the screen
      std::printf("\n");
      line_open_ = false;
    }
  } else if (periodic || l.skipped) {
    std::printf("%s | %s | %s%s\n", head, Times(l.step).c_str(), l.memory.c_str(), tail.c_str());
  }
  std::fflush(stdout);
}

void Progress::Line(const std::string& text) {
  if (line_open_) {
    // The progress line stays (it showed the last step), the message goes under it.
    std::printf("\n");
    line_open_ = false;
  }
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
}

void Progress::Finish() {
  if (line_open_) std::printf("\n");
  line_open_ = false;
  std::fflush(stdout);
}

}  // namespace tierzero::app

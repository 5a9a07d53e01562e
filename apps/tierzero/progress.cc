// progress.h
#include "progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

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

// Columns of the terminal on standard output (0: unknown).
int TerminalWidth() {
  struct winsize ws {};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) != 0) return 0;
  return ws.ws_col;
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
    // At most ten redraws a second (a step of a millisecond would flood the terminal), but the
    // run's first and last steps and a skipped one always.
    const auto now = std::chrono::steady_clock::now();
    const bool due = now - last_draw_ >= std::chrono::milliseconds(100);
    if (!due && l.step != start_ + 1 && l.step != total_ && !l.skipped) return;
    last_draw_ = now;
    // Rewritten in place: a carriage return, the line cut to the terminal's width (a wrapped
    // line cannot be rewritten by a carriage return), and erase-to-end-of-line.
    char shortened[160];
    std::snprintf(shortened, sizeof shortened, "step %d/%d | loss %.4f | %.0f tok/s | ", l.step,
                  total_, l.loss, l.tokens_per_s);
    std::string line = shortened + Times(l.step) + " | " + l.memory + tail;
    const int width = TerminalWidth();
    if (width > 1 && static_cast<int>(line.size()) >= width) line.resize(width - 1);
    std::printf("\r%s\x1b[K", line.c_str());
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

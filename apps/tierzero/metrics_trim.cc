// The metrics file of a run resumed in place, trimmed to its checkpoint's step (train.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tierzero/files.h"
#include "train.h"

namespace tierzero::app {
using nlohmann::json;

namespace {

// Appends each of `lines` that `kept` (the kept lines it could equal, parsed) lacks.
Status AppendUnwritten(const std::string& path, const std::vector<json>& kept,
                       const std::vector<json>& lines) {
  std::string text;
  int n = 0;
  for (const json& m : lines) {
    if (std::find(kept.begin(), kept.end(), m) != kept.end()) continue;
    text += m.dump() + "\n";
    ++n;
  }
  if (n == 0) return Status::OK();
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("opening the metrics file " + path, errno);
  if (const int err = WriteAll(fd, text); err != 0) {
    ::close(fd);
    return ErrnoError("writing the metrics file " + path, err);
  }
  if (::close(fd) != 0) return ErrnoError("writing the metrics file " + path, errno);
  std::printf("  metrics: wrote %d line%s the checkpoint's run could not write into %s\n", n,
              n == 1 ? "" : "s", path.c_str());
  return Status::OK();
}

Status Appended(Status s, bool* appended) {
  if (s.ok() && appended != nullptr) *appended = true;
  return s;
}

}  // namespace

// train.h
Status TrimMetrics(const std::string& path, int step, const std::vector<std::string>& unwritten,
                   bool* appended) {
  if (appended != nullptr) *appended = false;
  // Only a file can be trimmed: a device, a FIFO or the process's stdout is not read back.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT && step > 0) {
    std::printf(
        "  note: the metrics file %s does not exist (a new one, or removed); it starts at step "
        "%d (the lines of steps 1 to %d are not in it)\n",
        path.c_str(), step + 1, step);
    return Status::OK();
  }
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || path.rfind("/dev/", 0) == 0 ||
      path.rfind("/proc/", 0) == 0)
    return Status::OK();
  // The lines to add (of this step and before), and the earliest step among them: only kept
  // lines from there on could be one of them.
  std::vector<json> add;
  int64_t add_from = std::numeric_limits<int64_t>::max();
  for (const std::string& l : unwritten) {
    json m = json::parse(l, nullptr, /*allow_exceptions=*/false);
    if (!m.is_object() || !m.contains("step") || !m["step"].is_number_integer()) continue;
    const int64_t at = m["step"].get<int64_t>();
    if (at < 0 || at > step) continue;
    add_from = std::min(add_from, at);
    add.push_back(std::move(m));
  }
  std::vector<json> kept_tail;  // kept lines of steps add_from..
  // One pass, line by line: where the first dropped line starts, and whether any line after it
  // is kept. The usual case (lines of later steps and a torn last line) is a tail: the file is
  // cut there (ftruncate), however long the run was. Only lines dropped among kept ones make
  // the file be rewritten whole (bounded at 256 MiB).
  auto is_kept = [step](const std::string& line) {
    const json m = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!m.is_object() || !m.contains("step") || !m["step"].is_number_integer()) return false;
    if (m["step"].is_number_unsigned())
      return m["step"].get<uint64_t>() <= static_cast<uint64_t>(step);
    const int64_t at = m["step"].get<int64_t>();
    return at >= 0 && at <= step;
  };
  int dropped = 0;
  int64_t first_drop = -1;
  bool kept_after_drop = false;
  int64_t last_step = 0;  // the latest training step a kept line records
  auto note_missing = [&] {
    if (last_step < step)
      std::printf(
          "  note: the metrics file %s holds training steps up to %lld, the checkpoint is "
          "at step %d: the lines of steps %lld to %d are missing (lines the run could not "
          "write, a copy of the run with nothing trained, or the file cut or replaced)\n",
          path.c_str(), static_cast<long long>(last_step), step,
          static_cast<long long>(last_step + 1), step);
  };
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) return IoError("cannot read the metrics file " + path + " to trim it");
    int64_t offset = 0;
    std::string line;
    while (std::getline(in, line)) {
      const int64_t consumed = static_cast<int64_t>(line.size()) + (in.eof() ? 0 : 1);
      if (is_kept(line)) {
        kept_after_drop = kept_after_drop || first_drop >= 0;
        json m = json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (m.contains("loss")) last_step = std::max(last_step, m["step"].get<int64_t>());
        if (m["step"].get<int64_t>() >= add_from) kept_tail.push_back(std::move(m));
      } else {
        if (first_drop < 0) first_drop = offset;
        ++dropped;
      }
      offset += consumed;
    }
  }
  for (const json& m : add)
    if (m.contains("loss")) last_step = std::max(last_step, m["step"].get<int64_t>());
  note_missing();
  if (dropped == 0) {
    // A last line kept without its newline (edited by hand) would fuse with the next step's.
    const int fd = ::open(path.c_str(), O_RDWR | O_APPEND | O_CLOEXEC);
    if (fd < 0) return ErrnoError("opening the metrics file " + path, errno);
    char last = '\n';
    if (st.st_size > 0 && ::pread(fd, &last, 1, st.st_size - 1) == 1 && last != '\n' &&
        ::write(fd, "\n", 1) != 1) {
      const int err = errno;
      ::close(fd);
      return ErrnoError("writing the metrics file " + path, err);
    }
    ::close(fd);
    return Appended(AppendUnwritten(path, kept_tail, add), appended);
  }
  std::printf(
      "  metrics: dropped %d line%s from %s (written after the checkpoint of step %d, or torn)\n",
      dropped, dropped == 1 ? "" : "s", path.c_str(), step);
  if (!kept_after_drop) {
    if (::truncate(path.c_str(), static_cast<off_t>(first_drop)) != 0)
      return ErrnoError("trimming the metrics file " + path, errno);
    return Appended(AppendUnwritten(path, kept_tail, add), appended);
  }
  TZ_ASSIGN_OR_RETURN(const std::string text,
                      ReadFileBounded(path, kMaxReportBytes, "metrics file"));
  std::istringstream in(text);
  std::string kept, line;
  while (std::getline(in, line)) {
    if (is_kept(line)) kept += line + "\n";
  }
  // This run holds the file's lock (LockMetrics): the rewrite replaces it all the same.
  TZ_RETURN_IF_ERROR(WriteFileAtomically(path, kept, /*replace_own_locked=*/true));
  return Appended(AppendUnwritten(path, kept_tail, add), appended);
}

}  // namespace tierzero::app

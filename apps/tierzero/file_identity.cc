// file_identity.h: where a path leads, and an output that is no input.
#include "file_identity.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "run_dir.h"
#include "tierzero/files.h"

namespace tierzero::app {
namespace fs = std::filesystem;

namespace {

// Whether names that differ only in case are one name in `dir` (FAT, exFAT, a casefolded ext4
// directory): a file of its own made there, and looked up with its name's case swapped.
bool CaseInsensitiveDir(const fs::path& dir) {
  std::string made = (dir / ".tz-case-probe-XXXXXX").string();
  const int fd = ::mkstemp(made.data());
  if (fd < 0) return false;
  ::close(fd);
  RemoveOnSignalExit(made);  // (a signal's exit meanwhile leaves no probe behind)
  std::string swapped = made;
  for (size_t i = made.size() - 6; i < made.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(made[i]);
    swapped[i] =
        std::isupper(c) ? static_cast<char>(std::tolower(c)) : static_cast<char>(std::toupper(c));
  }
  struct stat a {
  }, b{};
  const bool same = swapped != made && ::stat(made.c_str(), &a) == 0 &&
                    ::stat(swapped.c_str(), &b) == 0 && a.st_dev == b.st_dev &&
                    a.st_ino == b.st_ino;
  ::unlink(made.c_str());
  KeepOnSignalExit(made);
  return same;
}

}  // namespace

FileId Identify(const std::string& p) {
  FileId id;
  std::error_code ec;
  id.path = fs::weakly_canonical(fs::absolute(p, ec), ec).lexically_normal();
  if (ec) id.path = fs::absolute(p, ec).lexically_normal();
  struct stat st {};
  if (::stat(p.c_str(), &st) == 0) {
    id.exists = true;
    id.mode = st.st_mode;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
  }
  return id;
}

bool Same(const FileId& a, const FileId& b) {
  if (a.exists && b.exists) return a.dev == b.dev && a.ino == b.ino;
  if (a.path == b.path) return true;
  // Two outputs not yet there whose names differ only in case ("R.json", "r.json"): one file
  // where the directory ignores case, which the run found only at its end, calling its own
  // report another process's (hunt 42).
  if (a.exists || b.exists || a.path.parent_path() != b.path.parent_path()) return false;
  const std::string x = a.path.filename().string(), y = b.path.filename().string();
  if (x.size() != y.size() ||
      !std::equal(x.begin(), x.end(), y.begin(), [](unsigned char p, unsigned char q) {
        return std::tolower(p) == std::tolower(q);
      }))
    return false;
  return CaseInsensitiveDir(a.path.parent_path());
}

bool Inside(const FileId& file, const FileId& dir) {
  const std::string d = dir.path.string(), f = file.path.string();
  if (f.size() <= d.size() || f.compare(0, d.size(), d) != 0) return false;
  return d.back() == '/' || f[d.size()] == '/';
}

Status CheckNotAnInput(const std::string& output, const std::string& what,
                       const std::vector<InputPath>& inputs) {
  const FileId out = Identify(output);
  if (out.exists && S_ISCHR(out.mode)) return Status::OK();  // /dev/null, /dev/stdout
  for (const InputPath& in : inputs) {
    if (in.path.empty()) continue;
    const FileId id = Identify(in.path);
    if (Same(out, id))
      return InvalidArgumentError(what + " " + output + " is the " + in.what +
                                  " this command reads: writing it would destroy its input");
    if (in.directory && Inside(out, id))
      return InvalidArgumentError(what + " " + output + " lies inside the " + in.what + " " +
                                  in.path + " this command reads: write it elsewhere");
  }
  // A running run's directory (docs/outputs.md): a plan or page written there replaced its
  // metrics or its config.json as it ran.
  std::string parent = fs::path(output).parent_path().string();
  if (parent.empty()) parent = ".";
  if (LockedByAnother(parent))
    return FailedPreconditionError(what + " " + output +
                                   " lies in the directory of a tierzero run that is running; "
                                   "write it elsewhere");
  return Status::OK();
}

}  // namespace tierzero::app

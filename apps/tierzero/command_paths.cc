// The paths the commands other than train's run are given (run_dir.h): a checkpoint argument
// that names something else, and an output that is the process's standard output.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "run_dir.h"
#include "tierzero/files.h"

namespace tierzero::app {
namespace fs = std::filesystem;

// run_dir.h
std::string TakeStdoutForData(const std::string& path) {
  if (StandardStreamFd(path) != STDOUT_FILENO) return path;
  static int data_fd = -1;
  if (data_fd < 0) {
    std::fflush(stdout);
    const int fd = ::fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
    if (fd < 0 || ::dup2(STDERR_FILENO, STDOUT_FILENO) < 0) return path;  // (as before)
    data_fd = fd;
  }
  return "/dev/fd/" + std::to_string(data_fd);
}

// run_dir.h
Status CheckCheckpointArgument(const std::string& path, const std::string& flag) {
  struct stat st {};
  if (path.empty() || ::stat(path.c_str(), &st) != 0) return Status::OK();
  if (S_ISDIR(st.st_mode)) {
    // A run directory named for its checkpoint: said first, before what follows from it.
    const std::string inner = (fs::path(path) / "checkpoint").string();
    if (::stat((path + "/manifest.json").c_str(), &st) != 0 &&
        ::stat((inner + "/manifest.json").c_str(), &st) == 0)
      return InvalidArgumentError(
          flag + " '" + path + "' is a run directory, not a checkpoint: its checkpoint is " +
          inner + " (" + (flag.rfind("--", 0) == 0 ? flag + " " : std::string("give ")) + inner +
          ")");
    return Status::OK();
  }
  const std::string parent = fs::path(path).parent_path().string();
  return InvalidArgumentError(flag + " '" + path + "' is " + FileKindName(st.st_mode) +
                              ", not a checkpoint: a checkpoint is the directory holding "
                              "manifest.json" +
                              (parent.empty() ? "" : " (" + flag + " " + parent + "?)"));
}

}  // namespace tierzero::app

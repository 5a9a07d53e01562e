// Where a path leads, and whether two paths lead to one file: what keeps a command's outputs off
// its inputs and off each other (docs/outputs.md).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tierzero/status.h"

namespace tierzero::app {

// Where a path leads: the file's identity when it exists (links followed), and its absolute path
// with the links of its existing part resolved either way.
struct FileId {
  bool exists = false;
  mode_t mode = 0;
  dev_t dev = 0;
  ino_t ino = 0;
  std::filesystem::path path;
};

FileId Identify(const std::string& p);
// The same file: by identity where both exist; else by path, or by names that differ only in
// case in a directory that ignores case.
bool Same(const FileId& a, const FileId& b);
// `file` lies under the directory `dir` (not equal to it).
bool Inside(const FileId& file, const FileId& dir);

// A path a command reads: a file, or a directory whose files it reads.
struct InputPath {
  std::string what, path;
  bool directory = false;
};
// `output` (named `what` in the error) is none of `inputs` and lies inside none of the input
// directories: InvalidArgument otherwise (an export overwrote a file of the checkpoint it read);
// nor does it lie in the directory of a run that is running (FailedPrecondition).
Status CheckNotAnInput(const std::string& output, const std::string& what,
                       const std::vector<InputPath>& inputs);

}  // namespace tierzero::app

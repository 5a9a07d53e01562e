// The files a trainer reads and writes on a user's behalf: outputs that never destroy what
// tierzero did not create (a device, a FIFO, a link, a user's file beside the output), bounded
// reads of files from outside, and the structural check of outside JSON (docs/outputs.md).
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tierzero/status.h"

namespace tierzero {

// Writes `text` to `path` (Note [Writing outputs], src/core/file_io.h; docs/outputs.md): a
// regular file or a new one whole or not at all, through a symbolic link to its target, streamed
// into a character device, a FIFO whose reader waits, or the process's own descriptor
// (/dev/stdout, /dev/fd/N); a directory, block device, socket or dangling link is refused with
// InvalidArgument. Durable once this returns OK. A regular file that a process holds locked
// (flock: the metrics file of a run in progress) is not replaced: FailedPrecondition, unless
// `replace_own_locked` says the lock is this process's own (a run rewriting its metrics file).
Status WriteFileAtomically(const std::string& path, const std::string& text,
                           bool replace_own_locked = false);

// A regular file's identity, as a string: device, inode, size and modification time ("" when
// there is none, or for a stream or a device, which are written where they point).
std::string FileStamp(const std::string& path);

// WriteFileAtomically, only over the file FileStamp(path) read as `stamp` (or over nothing, if
// nothing is there at the end): FailedPrecondition when another file is there, which is kept.
// The check and the replace are one step where the file system can exchange two names (ext4,
// XFS, Btrfs, tmpfs): a file another process writes at the same moment is never lost.
Status WriteFileAtomicallyIfUnchanged(const std::string& path, const std::string& text,
                                      const std::string& stamp);

// Writes `text` to a new regular file `path`, whole or not at all, never over anything:
// AlreadyExists when something is there, or appears there while it is written (it is kept).
Status WriteNewFile(const std::string& path, const std::string& text);

// OK when `path` names something an output may be written to (the table above: nothing yet, a
// regular file, a link to one, a character device, a FIFO, a descriptor of the process);
// InvalidArgument naming `what` and what the path is otherwise. Lets a command refuse a bad output
// before it works, not after.
Status CheckOutputPath(const std::string& path, const std::string& what);
// OK unless `path` names an existing regular file (itself or through a link) and `overwrite` is
// false: then FailedPrecondition naming `what`, that `command` replaces no file unasked, and
// --overwrite. A command's output never replaces a file it did not make unasked: a user's notes,
// another run's weights (docs/outputs.md). A device, FIFO or descriptor is written to, not
// replaced: OK.
Status CheckNotReplacedUnasked(const std::string& path, const std::string& what,
                               const std::string& command, bool overwrite);
// OK when `path` exists or its directory does (NotFound naming the directory otherwise): for a
// command whose output's directory is not made for it (export -o, report -o), checked before it
// works.
Status CheckOutputDirectory(const std::string& path, const std::string& what);

// An output written as it goes (a metrics file, line by line), by the same rules: a regular file
// is created or opened for appending (`append`) or from empty; a device or FIFO is streamed into
// (a FIFO's reader must be waiting: FailedPrecondition otherwise); /dev/stdout, /dev/fd/N are the
// process's own descriptors, duplicated. A regular file another open file description holds
// locked (flock: a running run's metrics) is FailedPrecondition, neither truncated nor appended
// to, unless the caller holds that lock itself (`own_locked`, as AtomicFile's
// replace_own_locked). Returns the descriptor (the caller closes it).
StatusOr<int> OpenOutputStream(const std::string& path, bool append, const std::string& what,
                               bool own_locked = false);

// Writes all of `text` to `fd`, retrying short writes and EINTR: 0, or the errno of the write
// that failed (ENOSPC for a full disk). The one write-all loop for descriptors the caller owns.
int WriteAll(int fd, std::string_view text);

// The whole of a file from outside, at most `max_bytes`; `what` names it in errors ("config
// file"). NotFound when it does not exist; InvalidArgument for a directory, a block device or a
// socket, or a file larger than `max_bytes` (a regular file's size is checked before reading, so
// a huge sparse file costs nothing; a FIFO or a character device such as /dev/zero is read up to
// the bound). Never throws.
StatusOr<std::string> ReadFileBounded(const std::string& path, uint64_t max_bytes,
                                      const std::string& what);

// The bounds of what tierzero reads whole: configs, plans and rates; reports and traces.
inline constexpr uint64_t kMaxConfigBytes = uint64_t{16} << 20;
inline constexpr uint64_t kMaxReportBytes = uint64_t{256} << 20;

// The descriptor a path names directly (/dev/stdin 0, /dev/stdout 1, /dev/stderr 2, /dev/fd/N,
// /proc/self/fd/N and /proc/thread-self/fd/N: N; in any spelling of an absolute path, such as
// /dev//stdout), or -1: outputs written into the process's own streams.
int StandardStreamFd(const std::string& path);

// Removes the temporary file of every output still being written (not yet renamed into place):
// for a process about to end on a signal without unwinding (the CLI's signal thread), so an
// interrupted export or save leaves no hidden partial file beside its output. Not
// async-signal-safe: call it from a thread, never from a signal handler. The process must end
// next: from then on, any thread that registers or creates a temporary waits for that end.
void RemovePendingTemporaries();
// A file RemovePendingTemporaries removes too, until Keep: an output the process made and must
// not leave behind if it ends on a signal before it is complete (a run's config.json before its
// first step). A directory is removed only if empty once the files registered in it are.
void RemoveOnSignalExit(const std::string& path);
void KeepOnSignalExit(const std::string& path);
// RemoveOnSignalExit for the file open as `fd`: removed only if `path` still names that file
// (a file put at that name since is another's).
void RemoveOnSignalExitIfSame(const std::string& path, int fd);
// RemoveOnSignalExit for a directory that another process may take meanwhile: kept when it, or
// a directory above it, holds a file named `lock_name` that another process holds locked
// (flock) at the exit.
void RemoveOnSignalExitUnlessLocked(const std::string& dir, const std::string& lock_name);
// A directory of the process's own, removed whole with everything in it when the process ends on
// a signal (a scratch directory, a calibration's run), until Keep.
void RemoveTreeOnSignalExit(const std::string& dir);
void KeepTreeOnSignalExit(const std::string& dir);

// What kind of file an st_mode is, in words: "a directory", "a FIFO", "a character device"...
const char* FileKindName(unsigned mode);

// OK when `text` is JSON that nests at most 64 levels and names no key twice in an object
// (Note [Outside JSON parsed strictly], src/core/json_in.h); otherwise InvalidArgument naming
// `source` and the problem. `allow_comments`: // and /* */ comments are accepted.
Status CheckOutsideJson(std::string_view text, const std::string& source,
                        bool allow_comments = false);

}  // namespace tierzero

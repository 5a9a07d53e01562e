// AtomicFile: a file appears whole or not at all, and a failed write leaves no temporary file.
#include "core/file_io.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace tierzero {
namespace {

namespace fs = std::filesystem;

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tz-file-io-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  size_t Entries() const {
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++n;
    return n;
  }
  fs::path dir_;
};

TEST_F(AtomicFileTest, CommitReplacesTheFileWhole) {
  const std::string path = (dir_ / "a.json").string();
  {
    auto old = AtomicFile::Create(path);
    ASSERT_TRUE(old.ok());
    ASSERT_TRUE(old->Write("old", 3).ok());
    ASSERT_TRUE(old->Commit().ok());
  }
  auto f = AtomicFile::Create(path);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->Write("new text", 8).ok());
  EXPECT_EQ(*ReadWholeFile(path), "old");  // not yet
  ASSERT_TRUE(f->Commit().ok());
  EXPECT_EQ(*ReadWholeFile(path), "new text");
  EXPECT_EQ(Entries(), 1u);
}

TEST_F(AtomicFileTest, ANewFileIsNeverWrittenOverAnything) {
  const std::string path = (dir_ / "kept.json").string();
  ASSERT_TRUE(WriteNewFile(path, "first").ok());
  EXPECT_EQ(*ReadWholeFile(path), "first");
  const Status again = WriteNewFile(path, "second");
  EXPECT_EQ(again.code(), StatusCode::kAlreadyExists) << again.ToString();
  EXPECT_EQ(*ReadWholeFile(path), "first");
  // Something appearing while the file is written is kept too.
  auto f = AtomicFile::Create((dir_ / "late.json").string());
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->Write("mine", 4).ok());
  { std::ofstream((dir_ / "late.json").string()) << "theirs"; }
  EXPECT_EQ(f->CommitNew().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(*ReadWholeFile((dir_ / "late.json").string()), "theirs");
  EXPECT_EQ(Entries(), 2u);  // no temporary left
}

// Note [An output checked is the output replaced]: a command's output, checked before it works,
// is committed only over what the check saw: nothing (a file another process wrote there since
// is kept, and the commit fails), or the very file --overwrite was asked to replace; once (a
// later write of the path replaces as ever).
TEST_F(AtomicFileTest, AnOutputReplacesOnlyWhatItsCheckSaw) {
  const std::string path = (dir_ / "out.st").string();
  ASSERT_TRUE(CheckNotReplacedUnasked(path, "-o", "export", false).ok());
  { std::ofstream(path) << "another's, written meanwhile"; }
  Status s = WriteFileAtomically(path, "mine");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_EQ(*ReadWholeFile(path), "another's, written meanwhile");
  EXPECT_EQ(Entries(), 1u);  // no temporary left
  // --overwrite of the file there: replaced, unless another replaced it meanwhile.
  ASSERT_TRUE(CheckNotReplacedUnasked(path, "-o", "export", true).ok());
  ASSERT_TRUE(WriteFileAtomically(path, "mine").ok());
  EXPECT_EQ(*ReadWholeFile(path), "mine");
  ASSERT_TRUE(CheckNotReplacedUnasked(path, "-o", "export", true).ok());
  fs::remove(path);
  { std::ofstream(path) << "a third's, and longer"; }
  EXPECT_EQ(WriteFileAtomically(path, "mine again").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*ReadWholeFile(path), "a third's, and longer");
  // Unchecked (or checked once and committed): replaced as ever.
  ASSERT_TRUE(WriteFileAtomically(path, "plain").ok());
  EXPECT_EQ(*ReadWholeFile(path), "plain");
}

// Note [A file another tierzero process holds]: a file held locked (a running run's metrics) is
// not replaced, whether the lock was there before the write or came during it; the lock's owner
// replaces its own file when it says so.
TEST_F(AtomicFileTest, AFileHeldLockedIsNotReplaced) {
  const std::string path = (dir_ / "metrics.jsonl").string();
  ASSERT_TRUE(WriteFileAtomically(path, "lines\n").ok());
  const int held = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  const Status s = WriteFileAtomically(path, "other");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("holds it locked"), std::string::npos) << s.ToString();
  EXPECT_EQ(*ReadWholeFile(path), "lines\n");
  EXPECT_EQ(Entries(), 1u);
  ASSERT_TRUE(WriteFileAtomically(path, "mine\n", /*replace_own_locked=*/true).ok());
  EXPECT_EQ(*ReadWholeFile(path), "mine\n");
  ::close(held);
  // Locked while the temporary is written: refused at the commit.
  auto f = AtomicFile::Create(path);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->Write("late", 4).ok());
  const int late = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_EQ(::flock(late, LOCK_EX | LOCK_NB), 0);
  EXPECT_EQ(f->Commit().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*ReadWholeFile(path), "mine\n");
  EXPECT_EQ(Entries(), 1u);
  // Nor truncated or appended to as a stream (hunt 48: OpenOutputStream truncated it).
  for (bool append : {false, true}) {
    auto fd = OpenOutputStream(path, append, "the metrics file");
    EXPECT_EQ(fd.status().code(), StatusCode::kFailedPrecondition) << append;
    if (fd.ok()) ::close(*fd);
  }
  EXPECT_EQ(*ReadWholeFile(path), "mine\n");
  ::close(late);
  ASSERT_TRUE(WriteFileAtomically(path, "free").ok());  // no lock: replaced
  EXPECT_EQ(*ReadWholeFile(path), "free");
}

// Other spellings of the standard streams are the process's own descriptors (hunt 48: they
// followed the link and replaced the file the shell redirected into), and the signal-exit
// registries hold absolute paths (a chdir then removed a user's file of the same name).
TEST_F(AtomicFileTest, StreamSpellingsAndRegisteredPathsAreOneEach) {
  for (const char* p : {"/dev/stdout", "/dev//stdout", "/dev/./stdout", "/dev/fd//1",
                        "/proc/thread-self/fd/1", "/proc/self/fd/1"})
    EXPECT_EQ(StandardStreamFd(p), STDOUT_FILENO) << p;
  EXPECT_EQ(StandardStreamFd("/dev/stdin"), STDIN_FILENO);
  EXPECT_EQ(StandardStreamFd("dev/stdout"), -1);
  const fs::path a = dir_ / "a", b = dir_ / "b";
  fs::create_directories(a);
  fs::create_directories(b);
  for (const fs::path& d : {a, b}) std::ofstream(d / "config.json") << "mine";
  std::ofstream(b / "other.json") << "mine";
  // In a child: RemovePendingTemporaries ends the process's registry (it is a signal's exit).
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    fs::current_path(a);
    RemoveOnSignalExit("config.json");
    KeepOnSignalExit("./config.json");  // another spelling of the same path cancels it
    RemoveOnSignalExit("other.json");
    fs::current_path(b);
    RemovePendingTemporaries();
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(fs::exists(a / "config.json"));
  EXPECT_TRUE(fs::exists(b / "config.json"));
  EXPECT_TRUE(fs::exists(b / "other.json")) << "a chdir removed another directory's file";
}

// A file the user may not write is not replaced through the directory's permission (as `cp`
// would not write it): checked as an unprivileged user in a child process where the test runs
// as root (root writes it, as `cp` does).
TEST_F(AtomicFileTest, AFileTheUserMayNotWriteIsKept) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to become another user";
  // World-writable, not sticky: without the check, nobody could rename over root's file.
  ASSERT_EQ(::chmod(dir_.c_str(), 0777), 0);
  const std::string path = (dir_ / "ro.json").string();
  ASSERT_TRUE(WriteFileAtomically(path, "theirs").ok());
  ASSERT_EQ(::chmod(path.c_str(), 0444), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    // The test directory beneath a directory nobody may not enter (a fresh root's private
    // TMPDIR): nothing to test there.
    struct stat st {};
    if (::stat(dir_.c_str(), &st) != 0 || ::access(dir_.c_str(), W_OK | X_OK) != 0) ::_exit(4);
    const Status s = WriteFileAtomically(path, "mine");
    const bool said = s.message().find("may not write") != std::string_view::npos;
    ::_exit(s.code() == StatusCode::kInvalidArgument && said ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 4) GTEST_SKIP() << "the test directory is not reachable by nobody";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: could not become nobody; 1: not refused as expected";
  EXPECT_EQ(*ReadWholeFile(path), "theirs");
  ASSERT_TRUE(WriteFileAtomically(path, "root's").ok());  // root may
  EXPECT_EQ(*ReadWholeFile(path), "root's");
}

// A new file in a directory the user may not write is refused before the work (hunt 48: the
// check passed, and the write failed at the end naming its temporary).
TEST_F(AtomicFileTest, ADirectoryTheUserMayNotWriteIsSaidFirst) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to become another user";
  const fs::path ro = dir_ / "ro";
  fs::create_directories(ro);
  ASSERT_EQ(::chmod(dir_.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(ro.c_str(), 0555), 0);
  const std::string path = (ro / "new.json").string();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    if (::access(ro.c_str(), X_OK) != 0) ::_exit(4);
    const Status s = CheckOutputDirectory(path, "the plan");
    ::_exit(!s.ok() && s.message().find("may not make files in") != std::string_view::npos ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 4) GTEST_SKIP() << "the test directory is not reachable by nobody";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: could not become nobody; 1: not refused as expected";
  EXPECT_TRUE(CheckOutputDirectory(path, "the plan").ok());  // root may
}

// A path ending in '/' names a directory, whether or not one is there: refused before anything
// is made (a run made the directory and failed at its end).
TEST_F(AtomicFileTest, APathEndingInASlashIsRefused) {
  const std::string path = (dir_ / "out.report").string() + "/";
  EXPECT_EQ(CheckOutputPath(path, "--report").code(), StatusCode::kInvalidArgument);
  EXPECT_NE(CheckOutputPath(path, "--report").message().find("ends in '/'"), std::string::npos);
  EXPECT_EQ(WriteFileAtomically(path, "x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Entries(), 0u);
}

// Note [A replace that checks what it replaces]: a file replaces only what was stamped (or
// nothing); another file written there meanwhile, or appearing where nothing was, is kept.
TEST_F(AtomicFileTest, AReplaceOnlyOverWhatWasStamped) {
  const std::string path = (dir_ / "report.json").string();
  ASSERT_TRUE(WriteFileAtomically(path, "before").ok());
  const std::string stamp = FileStamp(path);
  ASSERT_FALSE(stamp.empty());
  ASSERT_TRUE(WriteFileAtomicallyIfUnchanged(path, "mine", stamp).ok());
  EXPECT_EQ(*ReadWholeFile(path), "mine");
  EXPECT_EQ(Entries(), 1u);
  // Written by another meanwhile (a new file at the name): kept.
  const std::string now = FileStamp(path);
  ASSERT_TRUE(WriteFileAtomically(path, "theirs").ok());
  const Status s = WriteFileAtomicallyIfUnchanged(path, "late", now);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_EQ(*ReadWholeFile(path), "theirs");
  EXPECT_EQ(Entries(), 1u);
  // Nothing there when stamped, something there at the end: kept.
  const std::string fresh = (dir_ / "new.json").string();
  const std::string none = FileStamp(fresh);
  EXPECT_TRUE(none.empty());
  auto f = AtomicFile::Create(fresh);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->Write("late", 4).ok());
  ASSERT_TRUE(WriteFileAtomically(fresh, "appeared").ok());
  EXPECT_EQ(f->CommitIfUnchanged(none).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*ReadWholeFile(fresh), "appeared");
  // Written by another between the check and the exchange: exchanged back, theirs kept, and
  // nothing of ours left beside it.
  static std::string g_path;
  g_path = path;
  const std::string before = FileStamp(path);
  AtomicFile::before_exchange_for_test = [](const std::string& target) {
    ASSERT_EQ(target, g_path);
    ASSERT_TRUE(WriteFileAtomically(target, "raced").ok());
  };
  const Status raced = WriteFileAtomicallyIfUnchanged(path, "ours", before);
  AtomicFile::before_exchange_for_test = nullptr;
  EXPECT_EQ(raced.code(), StatusCode::kFailedPrecondition) << raced.ToString();
  EXPECT_EQ(*ReadWholeFile(path), "raced");
  // Removed between the check and the exchange: written anew.
  AtomicFile::before_exchange_for_test = [](const std::string& target) {
    ASSERT_EQ(::unlink(target.c_str()), 0);
  };
  EXPECT_TRUE(WriteFileAtomicallyIfUnchanged(path, "anew", FileStamp(path)).ok());
  AtomicFile::before_exchange_for_test = nullptr;
  EXPECT_EQ(*ReadWholeFile(path), "anew");
  // Not a regular file where nothing was stamped: kept (a directory, here).
  const std::string dir_there = (dir_ / "d.json").string();
  auto g = AtomicFile::Create(dir_there);
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g->Write("x", 1).ok());
  fs::create_directory(dir_there);
  EXPECT_EQ(g->CommitIfUnchanged("").code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::is_directory(dir_there));
  fs::remove(dir_there);
  // Removed meanwhile: written anew.
  ASSERT_EQ(::unlink(fresh.c_str()), 0);
  ASSERT_TRUE(WriteFileAtomicallyIfUnchanged(fresh, "anew", "1:2:3:4.5").ok());
  EXPECT_EQ(*ReadWholeFile(fresh), "anew");
  EXPECT_EQ(Entries(), 2u);  // nothing left beside them
}

TEST_F(AtomicFileTest, AnUncommittedFileLeavesNothing) {
  const std::string path = (dir_ / "b.json").string();
  {
    auto f = AtomicFile::Create(path);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(f->Write("partial", 7).ok());
  }  // an error path returns before Commit
  EXPECT_EQ(Entries(), 0u);
}

TEST_F(AtomicFileTest, ADirectoryIsRefusedAndLeftAsItWas) {
  const fs::path target = dir_ / "c.json";
  fs::create_directories(target / "inside");
  auto f = AtomicFile::Create(target.string());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(std::string(f.status().message()).find("is a directory"), std::string::npos)
      << f.status().ToString();
  EXPECT_TRUE(fs::is_directory(target / "inside"));
  EXPECT_EQ(Entries(), 1u);
}

TEST_F(AtomicFileTest, AFailedRenameIsAnErrorNamingTheFile) {
  const fs::path sub = dir_ / "sub";
  fs::create_directories(sub);
  auto f = AtomicFile::Create((sub / "c.json").string());
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->Write("x", 1).ok());
  // Move the directory away: the temporary file goes with it, and the rename's source is gone.
  fs::rename(sub, dir_ / "moved");
  const Status s = f->Commit();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("c.json"), std::string::npos) << s.ToString();
  EXPECT_FALSE(fs::exists(sub / "c.json"));
}

TEST_F(AtomicFileTest, AMissingDirectoryIsAClearError) {
  auto f = AtomicFile::Create((dir_ / "no" / "such" / "d.json").string());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(std::string(f.status().message()).find("d.json"), std::string::npos);
}

// Note [Writing outputs]: what the path names decides how it is written, and nothing tierzero did
// not create is replaced.
TEST_F(AtomicFileTest, ATemporaryNameNeverTruncatesAUsersFile) {
  const fs::path target = dir_ / "model.safetensors";
  std::ofstream(target.string() + ".tmp") << "the user's own file";
  ASSERT_TRUE(WriteFileAtomically(target.string(), "weights").ok());
  EXPECT_EQ(*ReadWholeFile(target.string() + ".tmp"), "the user's own file");
  EXPECT_EQ(*ReadWholeFile(target.string()), "weights");
  EXPECT_EQ(Entries(), 2u);
}

TEST_F(AtomicFileTest, ASymlinkIsWrittenThroughAndStaysALink) {
  const fs::path real = dir_ / "real.json", link = dir_ / "link.json";
  std::ofstream(real) << "old";
  fs::create_symlink(real, link);
  ASSERT_TRUE(WriteFileAtomically(link.string(), "new").ok());
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(*ReadWholeFile(real.string()), "new");
  // A dangling link is refused: nothing is created anywhere.
  const fs::path dangling = dir_ / "dangling.json";
  fs::create_symlink(dir_ / "missing.json", dangling);
  const Status s = WriteFileAtomically(dangling.string(), "x");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_FALSE(fs::exists(dir_ / "missing.json"));
  EXPECT_TRUE(fs::is_symlink(dangling));
}

TEST_F(AtomicFileTest, ACharacterDeviceIsStreamedIntoNotReplaced) {
  struct stat before {};
  ASSERT_EQ(::stat("/dev/null", &before), 0);
  ASSERT_TRUE(WriteFileAtomically("/dev/null", "discarded").ok());
  struct stat after {};
  ASSERT_EQ(::stat("/dev/null", &after), 0);
  EXPECT_TRUE(S_ISCHR(after.st_mode));
  EXPECT_EQ(before.st_ino, after.st_ino);
  // A full device: the write's error, not a silent success.
  EXPECT_FALSE(WriteFileAtomically("/dev/full", "x").ok());
}

TEST_F(AtomicFileTest, AFifoIsStreamedToItsReaderAndRefusedWithoutOne) {
  const fs::path fifo = dir_ / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No reader: refused at once, not a hang, and the FIFO stays a FIFO.
  const Status none = WriteFileAtomically(fifo.string(), "x");
  EXPECT_EQ(none.code(), StatusCode::kInvalidArgument) << none.ToString();
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  ASSERT_TRUE(WriteFileAtomically(fifo.string(), "through the pipe").ok());
  char buf[64] = {};
  EXPECT_EQ(::read(reader, buf, sizeof buf), 16);
  EXPECT_EQ(std::string(buf), "through the pipe");
  ::close(reader);
  struct stat st {};
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
}

TEST_F(AtomicFileTest, AReplacedFileKeepsItsPermissions) {
  const fs::path target = dir_ / "private.json";
  std::ofstream(target) << "old";
  fs::permissions(target, fs::perms::owner_read | fs::perms::owner_write);
  ASSERT_TRUE(WriteFileAtomically(target.string(), "new").ok());
  EXPECT_EQ(fs::status(target).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
}

TEST_F(AtomicFileTest, ReadsAreBoundedAndRefuseWhatIsNotAFile) {
  // A directory: an error naming it, not an exception.
  const auto dir = ReadFileBounded(dir_.string(), 1024, "config file");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(std::string(dir.status().message()).find("is a directory"), std::string::npos);
  // An endless device is read only to the bound.
  const auto zero = ReadFileBounded("/dev/zero", 1 << 20, "config file");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(std::string(zero.status().message()).find("at most"), std::string::npos);
  // A huge sparse file is refused by its size, without reading it.
  const fs::path sparse = dir_ / "sparse";
  { std::ofstream(sparse.string()); }
  fs::resize_file(sparse, uint64_t{1} << 40);
  const auto big = ReadFileBounded(sparse.string(), 1 << 20, "text file");
  ASSERT_FALSE(big.ok());
  EXPECT_NE(std::string(big.status().message()).find("1099511627776 bytes"), std::string::npos)
      << big.status().ToString();
  EXPECT_EQ(ReadFileBounded((dir_ / "missing").string(), 10, "x").status().code(),
            StatusCode::kNotFound);
  std::ofstream(dir_ / "small") << "abc";
  EXPECT_EQ(*ReadFileBounded((dir_ / "small").string(), 3, "x"), "abc");
}

}  // namespace
}  // namespace tierzero

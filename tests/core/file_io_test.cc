// AtomicFile: a file appears whole or not at all, and a failed write leaves no temporary file.
#include "core/file_io.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
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

TEST_F(AtomicFileTest, AnUncommittedFileLeavesNothing) {
  const std::string path = (dir_ / "b.json").string();
  {
    auto f = AtomicFile::Create(path);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(f->Write("partial", 7).ok());
  }  // an error path returns before Commit
  EXPECT_EQ(Entries(), 0u);
}

TEST_F(AtomicFileTest, AFailedRenameLeavesNoTemporaryFile) {
  // The target is a directory that is not empty: rename(2) fails with EISDIR or ENOTEMPTY.
  const fs::path target = dir_ / "c.json";
  fs::create_directories(target / "inside");
  auto f = AtomicFile::Create(target.string());
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->Write("x", 1).ok());
  const Status s = f->Commit();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("c.json"), std::string::npos) << s.ToString();
  EXPECT_FALSE(fs::exists(target.string() + ".tmp"));
  EXPECT_TRUE(fs::is_directory(target / "inside"));
}

TEST_F(AtomicFileTest, AMissingDirectoryIsAClearError) {
  auto f = AtomicFile::Create((dir_ / "no" / "such" / "d.json").string());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(std::string(f.status().message()).find("d.json.tmp"), std::string::npos);
}

}  // namespace
}  // namespace tierzero

// ReadHostMemory and ReadTaskLimit against trees written here: /proc and /sys/fs/cgroup as cgroup
// v1, v2, hybrid and container mounts lay them out (Note [The memory a process may use]).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "tierzero/devices.h"

namespace tierzero {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

class HostMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tz_host_memory_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    // 16 GiB of memory, 12 GiB available.
    Write("/proc/meminfo",
          "MemTotal:       16777216 kB\nMemFree:         1000000 kB\n"
          "MemAvailable:   12582912 kB\nBuffers:  1 kB\n");
  }
  void TearDown() override { fs::remove_all(root_); }

  void Write(const std::string& path, const std::string& text) {
    fs::create_directories(fs::path(root_ + path).parent_path());
    std::ofstream(root_ + path) << text;
  }
  // A cgroup directory with its memory files (v2 names, or v1's).
  void Cgroup(const std::string& dir, bool v2, const std::string& limit, uint64_t usage = 0,
              uint64_t inactive_file = 0) {
    fs::create_directories(root_ + dir);
    Write(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"), limit + "\n");
    Write(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"), std::to_string(usage));
    Write(dir + "/memory.stat",
          std::string(v2 ? "anon 5\ninactive_file " : "cache 5\ntotal_inactive_file ") +
              std::to_string(inactive_file) + "\n");
  }

  std::string root_;
};

TEST_F(HostMemoryTest, WithoutCgroupsTheMachinesMemoryIsTheLimit) {
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.physical, 16 * kGiB);
  EXPECT_EQ(m.limit, 16 * kGiB);
  EXPECT_EQ(m.available, 12 * kGiB);
  EXPECT_EQ(m.limit_source, "physical memory");
  EXPECT_EQ(m.limit_scope, "");
}

TEST_F(HostMemoryTest, AContainersCgroupV2LimitAndWhatItHolds) {
  // A container with its own cgroup namespace: "0::/" and the tree mounted at /sys/fs/cgroup.
  Write("/proc/self/cgroup", "0::/\n");
  Write("/proc/self/mountinfo",
        "22 1 0:21 / / rw - overlay overlay rw\n"
        "30 22 0:26 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw,nsdelegate\n");
  Cgroup("/sys/fs/cgroup", /*v2=*/true, std::to_string(2 * kGiB), 900 * kMiB, 100 * kMiB);
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, 2 * kGiB);
  EXPECT_EQ(m.limit_source, "/sys/fs/cgroup/memory.max");
  EXPECT_EQ(m.limit_scope, "/sys/fs/cgroup");
  // The limit less what the cgroup holds other than inactive page cache.
  EXPECT_EQ(m.available, 2 * kGiB - 800 * kMiB);
}

TEST_F(HostMemoryTest, TheSmallestLimitOnTheWayUpTheTree) {
  // A batch job's step inside the job: the job's limit binds, the step's is "max".
  Write("/proc/self/cgroup", "0::/job_7/step_0\n");
  Write("/proc/self/mountinfo", "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  Cgroup("/sys/fs/cgroup", true, "max");
  Cgroup("/sys/fs/cgroup/job_7", true, std::to_string(3 * kGiB), kGiB);
  Cgroup("/sys/fs/cgroup/job_7/step_0", true, "max", kGiB);
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, 3 * kGiB);
  EXPECT_EQ(m.limit_source, "/sys/fs/cgroup/job_7/memory.max");
  EXPECT_EQ(m.available, 2 * kGiB);
}

TEST_F(HostMemoryTest, CgroupV1MemoryControllerAmongOthers) {
  // Hybrid: v1 controllers plus an empty v2 tree (no memory.max there).
  Write("/proc/self/cgroup",
        "12:cpu,cpuacct:/user\n4:memory:/user/session\n1:name=systemd:/user\n0::/user\n");
  Write("/proc/self/mountinfo",
        "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n");
  fs::create_directories(root_ + "/sys/fs/cgroup/unified/user");
  Cgroup("/sys/fs/cgroup/memory", false, "9223372036854771712");  // v1's "no limit"
  Cgroup("/sys/fs/cgroup/memory/user", false, "9223372036854771712");
  Cgroup("/sys/fs/cgroup/memory/user/session", false, std::to_string(kGiB), 300 * kMiB);
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, kGiB);
  EXPECT_EQ(m.limit_source, "/sys/fs/cgroup/memory/user/session/memory.limit_in_bytes");
  EXPECT_EQ(m.available, kGiB - 300 * kMiB);
}

TEST_F(HostMemoryTest, AContainerWithoutACgroupNamespaceSeesItsOwnCgroupAtTheMount) {
  // Docker without cgroupns: /proc/self/cgroup names the host's path; the mount's root is it.
  Write("/proc/self/cgroup", "9:memory:/docker/abc123\n");
  Write("/proc/self/mountinfo",
        "40 31 0:32 /docker/abc123 /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n");
  Cgroup("/sys/fs/cgroup/memory", false, std::to_string(512 * kMiB));
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, 512 * kMiB);
  EXPECT_EQ(m.limit_source, "/sys/fs/cgroup/memory/memory.limit_in_bytes");
}

TEST_F(HostMemoryTest, ALimitAbovePhysicalMemoryAndUnreadableFilesDoNotLimit) {
  Write("/proc/self/cgroup", "0::/big\n0::\n");
  Write("/proc/self/mountinfo",
        "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\nnot a mountinfo line\n");
  Cgroup("/sys/fs/cgroup/big", true, std::to_string(64 * kGiB));
  Write("/sys/fs/cgroup/memory.max", "garbage\n");
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, 16 * kGiB);
  EXPECT_EQ(m.limit_source, "physical memory");
}

TEST_F(HostMemoryTest, ValuesThatAreNotADecimalCountAreNoLimit) {
  // "1e9" and "12abc" are not a limit of 1 or 12 bytes; -1 and a value past 2^64 are not a limit.
  Write("/proc/self/cgroup", "0::/a/b/c/d/e\n");
  Write("/proc/self/mountinfo", "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  Cgroup("/sys/fs/cgroup/a", true, "1e9");
  Cgroup("/sys/fs/cgroup/a/b", true, "12abc");
  Cgroup("/sys/fs/cgroup/a/b/c", true, "-1");
  Cgroup("/sys/fs/cgroup/a/b/c/d", true, "99999999999999999999");
  Cgroup("/sys/fs/cgroup/a/b/c/d/e", true, " 8589934592 \n");  // 8 GiB: spaces are fine
  HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, 8 * kGiB);
  EXPECT_EQ(m.limit_source, "/sys/fs/cgroup/a/b/c/d/e/memory.max");
  Write("/sys/fs/cgroup/a/b/c/d/e/pids.max", "7x\n");
  EXPECT_TRUE(ReadTaskLimit(root_).source.empty());
  Write("/sys/fs/cgroup/a/b/c/d/e/pids.max", "0\n");  // no new task at all
  EXPECT_EQ(ReadTaskLimit(root_).limit, 0u);
  EXPECT_EQ(ReadTaskLimit(root_).source, "/sys/fs/cgroup/a/b/c/d/e/pids.max");
  // A MemTotal whose bytes pass 2^64 is not the machine's memory (it was: wrapped); nor one in
  // another unit, nor a malformed one. The machine's own count (sysconf) stands instead.
  const uint64_t pages = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                         static_cast<uint64_t>(::sysconf(_SC_PAGE_SIZE));
  for (const char* total : {"18014398509481985 kB", "16777216 MB", "16777216 kB x", "0x1000 kB"}) {
    Write("/proc/meminfo", std::string("MemTotal: ") + total + "\nMemAvailable: 1024 kB\n");
    m = ReadHostMemory(root_);
    EXPECT_EQ(m.physical, pages) << total;
    EXPECT_EQ(m.available, std::min<uint64_t>(kMiB, pages)) << total;
  }
}

TEST_F(HostMemoryTest, SpecialFilesAreNotRead) {
  // Under a root given to the library: a FIFO where memory.max is (its open or read would block
  // for ever), a link to /dev/zero (its read would never end) and a directory are no limit.
  Write("/proc/self/cgroup", "0::/fifo/zero/dir\n");
  Write("/proc/self/mountinfo", "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  fs::create_directories(root_ + "/sys/fs/cgroup/fifo/zero/dir/memory.max");
  ASSERT_EQ(::mkfifo((root_ + "/sys/fs/cgroup/fifo/memory.max").c_str(), 0600), 0);
  fs::create_symlink("/dev/zero", root_ + "/sys/fs/cgroup/fifo/zero/memory.max");
  fs::create_symlink("/dev/zero", root_ + "/sys/fs/cgroup/fifo/zero/pids.max");
  ASSERT_EQ(::mkfifo((root_ + "/sys/fs/cgroup/fifo/pids.max").c_str(), 0600), 0);
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, 16 * kGiB);
  EXPECT_EQ(m.limit_source, "physical memory");
  EXPECT_TRUE(ReadTaskLimit(root_).source.empty());
}

TEST_F(HostMemoryTest, ACgroupOutsideTheMountsViewIsNotTheMountRootsLimit) {
  // The mount shows another cgroup's subtree (its root "/docker/other"): its limit is not this
  // process's, and is not taken for it.
  Write("/proc/self/cgroup", "9:memory:/user/me\n0::/../elsewhere\n");
  Write("/proc/self/mountinfo",
        "40 31 0:32 /docker/other /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
        "41 31 0:33 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n");
  Cgroup("/sys/fs/cgroup/memory", false, std::to_string(512 * kMiB));
  Cgroup("/sys/fs/cgroup/unified", true, std::to_string(256 * kMiB));
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, 16 * kGiB);
  EXPECT_EQ(m.limit_source, "physical memory");
}

TEST_F(HostMemoryTest, AMountPointWithAnEscapedSpace) {
  Write("/proc/self/cgroup", "0::/a\n");
  Write("/proc/self/mountinfo", "30 22 0:26 / /cg\\040root rw - cgroup2 cgroup2 rw\n");
  Cgroup("/cg root/a", true, std::to_string(kGiB));
  const HostMemory m = ReadHostMemory(root_);
  EXPECT_EQ(m.limit, kGiB);
  EXPECT_EQ(m.limit_source, "/cg root/a/memory.max");
}

// Note [A container's pids limit]: the smallest room (pids.max less pids.current) on the way up.
TEST_F(HostMemoryTest, APidsLimitsRoomIsTheSmallestOnTheWayUp) {
  Write("/proc/self/cgroup", "0::/pod/ctr\n");
  Write("/proc/self/mountinfo", "30 22 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  EXPECT_TRUE(ReadTaskLimit(root_).source.empty());  // no pids files: no limit
  Write("/sys/fs/cgroup/pids.max", "max\n");
  Write("/sys/fs/cgroup/pod/pids.max", "100\n");
  Write("/sys/fs/cgroup/pod/pids.current", "90\n");  // 10 left, though ctr's own limit is lower
  Write("/sys/fs/cgroup/pod/ctr/pids.max", "40\n");
  Write("/sys/fs/cgroup/pod/ctr/pids.current", "12\n");
  TaskLimit t = ReadTaskLimit(root_);
  EXPECT_EQ(t.source, "/sys/fs/cgroup/pod/pids.max");
  EXPECT_EQ(t.limit, 100u);
  EXPECT_EQ(t.room, 10u);
  Write("/sys/fs/cgroup/pod/ctr/pids.current", "45\n");  // over (the limit lowered later): none
  t = ReadTaskLimit(root_);
  EXPECT_EQ(t.source, "/sys/fs/cgroup/pod/ctr/pids.max");
  EXPECT_EQ(t.room, 0u);
  EXPECT_EQ(t.current, 45u);
}

TEST_F(HostMemoryTest, APidsLimitInCgroupV1sPidsHierarchyNotTheMemoryOnes) {
  Write("/proc/self/cgroup", "5:pids:/docker/x\n4:memory:/docker/x\n0::/\n");
  Write("/proc/self/mountinfo",
        "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "36 31 0:33 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n");
  Write("/sys/fs/cgroup/memory/docker/x/pids.max", "3\n");  // not the pids hierarchy: not read
  Write("/sys/fs/cgroup/pids/docker/x/pids.max", "64\n");
  Write("/sys/fs/cgroup/pids/docker/x/pids.current", "4\n");
  const TaskLimit t = ReadTaskLimit(root_);
  EXPECT_EQ(t.source, "/sys/fs/cgroup/pids/docker/x/pids.max");
  EXPECT_EQ(t.room, 60u);
}

TEST(HostMemoryMachineTest, ThisMachinesFiguresAreConsistent) {
  const HostMemory m = ReadHostMemory();
  EXPECT_GT(m.physical, 64 * kMiB);
  EXPECT_LE(m.limit, m.physical);
  EXPECT_LE(m.available, m.limit);
  EXPECT_FALSE(m.limit_source.empty());
}

}  // namespace
}  // namespace tierzero

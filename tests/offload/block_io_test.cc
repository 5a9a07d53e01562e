// The io_uring backend of BlockIo where the kernel cancels a request: under a user's limit on
// processes and threads it cannot start the io-wq worker a buffered write needs, and completes
// the request with ECANCELED (Note [A request io_uring cancels runs here], block_io.cc).
#include "offload/block_io.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace tierzero {
namespace {

// Child exit codes.
constexpr int kPassed = 0, kSkipped = 77, kNoUring = 78;

// In a child process: a ring over a fresh file, then no thread may start for this user (root's
// limit is not enforced, so a root child becomes `nobody` first), then 16 writes of 64 KiB and
// the reads of them back. Each must transfer its bytes, and the bytes read must be those written.
int WriteAndReadUnderNoThreads() {
  char path[] = "/tmp/tz_block_io_XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) return kSkipped;
  ::unlink(path);
  BlockIoOptions options;
  options.queue_depth = 8;
  auto io = CreateUringBlockIo({fd}, options);
  if (!io.ok()) return kNoUring;
  if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return kSkipped;
  const rlimit none{1, 1};
  if (::setrlimit(RLIMIT_NPROC, &none) != 0) return kSkipped;
  constexpr uint32_t kLen = 64 << 10;
  constexpr int kRequests = 16;
  std::vector<unsigned char> out(kLen * kRequests), in(kLen * kRequests, 0);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<unsigned char>(i * 7 + i / 4096);
  for (const IoRequest::Op op : {IoRequest::Op::kWrite, IoRequest::Op::kRead}) {
    std::atomic<int> done{0}, bad{0};
    std::vector<IoRequest> reqs(kRequests);
    for (int r = 0; r < kRequests; ++r) {
      IoRequest& q = reqs[static_cast<size_t>(r)];
      q.op = op;
      q.offset = uint64_t{kLen} * static_cast<uint64_t>(r);
      q.buf = (op == IoRequest::Op::kWrite ? out.data() : in.data()) + q.offset;
      q.len = kLen;
      q.done = [&](int64_t res) {
        if (res != kLen) bad.fetch_add(1);
        done.fetch_add(1);
      };
      if (!(*io)->Submit(&q).ok()) return 1;
    }
    while (done.load() < kRequests) std::this_thread::yield();
    if (bad.load() != 0) return 2;
  }
  return std::memcmp(out.data(), in.data(), out.size()) == 0 ? kPassed : 3;
}

TEST(UringBlockIoTest, RequestsTheKernelCancelsForWantOfThreadsStillTransfer) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) ::_exit(WriteAndReadUnderNoThreads());
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child ended on signal " << WTERMSIG(status);
  if (WEXITSTATUS(status) == kSkipped) GTEST_SKIP() << "cannot limit this user's threads here";
  if (WEXITSTATUS(status) == kNoUring) GTEST_SKIP() << "no io_uring here";
  EXPECT_EQ(WEXITSTATUS(status), kPassed)
      << "1: a request was not queued; 2: a request did not transfer its bytes (ECANCELED); "
         "3: the bytes read back differ";
}

}  // namespace
}  // namespace tierzero

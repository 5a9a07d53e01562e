// NvmeStore, BlockIo backends, CRC32C and the swap pipeline, on real files under the test
// temporary directory (ext4 on CI: O_DIRECT and io_uring both work there).
#include "offload/nvme_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "core/bytes.h"
#include "core/check.h"
#include "offload/crc32c.h"
#include "offload/pinned_arena.h"
#include "offload/swapper.h"
#include "tierzero/files.h"

namespace tierzero {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    path_ = fs::path(testing::TempDir()) / ("tz_nvme_" + name + "_" + std::to_string(getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string Sub(const std::string& name) const {
    fs::create_directories(path_ / name);
    return (path_ / name).string();
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

// 4 KiB-aligned heap buffer.
struct AlignedBuf {
  explicit AlignedBuf(size_t bytes) : size(AlignUp(bytes == 0 ? 1 : bytes, 4096)) {
    data = static_cast<uint8_t*>(std::aligned_alloc(4096, size));
  }
  ~AlignedBuf() { std::free(data); }
  AlignedBuf(AlignedBuf&& o) noexcept : data(o.data), size(o.size) { o.data = nullptr; }
  uint8_t* data;
  size_t size;
};

void Fill(uint8_t* p, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    uint32_t v = rng();
    std::memcpy(p + i, &v, 4);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

struct Mode {
  const char* name;
  IoBackend backend;
  bool direct;
  int paths;
};

class NvmeStoreTest : public testing::TestWithParam<Mode> {
 protected:
  NvmeStoreOptions Options(const TempDir& dir, uint64_t bytes_per_path = 192 * kMiB) {
    NvmeStoreOptions o;
    for (int p = 0; p < GetParam().paths; ++p) o.paths.push_back(dir.Sub("d" + std::to_string(p)));
    o.bytes_per_path = bytes_per_path;
    o.backend = GetParam().backend;
    o.direct_io = GetParam().direct;
    o.stripe_min_bytes = kMiB;
    o.block_bytes = 256 * kKiB;  // several requests per extent
    return o;
  }
};

TEST_P(NvmeStoreTest, HundredsOfConcurrentRoundTripsAreBitExact) {
  TempDir dir;
  auto store = NvmeStore::Open(Options(dir));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  NvmeStore& s = **store;
  if (GetParam().backend == IoBackend::kThreadPool) {
    EXPECT_EQ(s.backend_name(), "threadpool");
  }
  if (!GetParam().direct) {
    EXPECT_FALSE(s.direct_io());
  }
  std::mt19937 rng(1);
  std::vector<NvmeExtent> extents;
  std::vector<AlignedBuf> in, out;
  for (int i = 0; i < 300; ++i) {
    // Sizes from 1 byte to ~1.5 MiB: below and above a block, a page and the stripe threshold.
    const uint64_t bytes = 1 + rng() % (i % 3 == 0 ? 1536 * kKiB : 20000);
    auto e = s.Allocate(bytes);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    extents.push_back(*e);
    in.emplace_back(bytes);
    out.emplace_back(bytes);
    Fill(in.back().data, in.back().size, static_cast<uint32_t>(i));
  }
  std::vector<NvmeStore::Ticket> tickets;
  for (size_t i = 0; i < extents.size(); ++i) {
    auto t = s.SubmitWrite(extents[i], in[i].data);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tickets.push_back(std::move(t).value());
  }
  for (auto& t : tickets) ASSERT_TRUE(t.Wait().ok());
  tickets.clear();
  for (size_t i = 0; i < extents.size(); ++i) {
    std::memset(out[i].data, 0xCD, out[i].size);
    auto t = s.SubmitRead(extents[i], out[i].data);
    ASSERT_TRUE(t.ok());
    tickets.push_back(std::move(t).value());
  }
  for (auto& t : tickets) ASSERT_TRUE(t.Wait().ok());
  for (size_t i = 0; i < extents.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(in[i].data, out[i].data, extents[i].bytes)) << "extent " << i;
  }
  const NvmeStats st = s.stats();
  EXPECT_GE(st.bytes_written, st.space.current);
  EXPECT_EQ(st.errors, 0u);
}

TEST_P(NvmeStoreTest, RandomAllocFreeNeverOverlaps) {
  // Every live extent holds its own pattern; an overlap would corrupt a neighbour.
  TempDir dir;
  auto store = NvmeStore::Open(Options(dir, 16 * kMiB));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  NvmeStore& s = **store;
  std::mt19937 rng(2);
  std::map<uint64_t, std::pair<NvmeExtent, uint32_t>> live;
  AlignedBuf buf(2 * kMiB), check(2 * kMiB);
  for (int step = 0; step < 400; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t bytes = 1 + rng() % (rng() % 4 == 0 ? 2 * kMiB : 64 * kKiB);
      auto e = s.Allocate(bytes);
      if (!e.ok()) {
        ASSERT_EQ(e.status().code(), StatusCode::kOutOfMemory);
        continue;
      }
      Fill(buf.data, bytes, static_cast<uint32_t>(step));
      ASSERT_TRUE(s.Write(*e, buf.data).ok());
      live.emplace(e->id, std::make_pair(*e, static_cast<uint32_t>(step)));
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(s.Free(it->second.first).ok());
      live.erase(it);
    }
  }
  for (auto& [id, entry] : live) {
    Fill(buf.data, entry.first.bytes, entry.second);
    ASSERT_TRUE(s.Read(entry.first, check.data).ok());
    ASSERT_EQ(0, std::memcmp(buf.data, check.data, entry.first.bytes)) << "extent " << id;
  }
  for (auto& [id, entry] : live) ASSERT_TRUE(s.Free(entry.first).ok());
  EXPECT_EQ(s.stats().space.current, 0u);
  EXPECT_EQ(s.Free(NvmeExtent{999999, 1}).code(), StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, NvmeStoreTest,
                         testing::Values(Mode{"uring_direct", IoBackend::kIoUring, true, 1},
                                         Mode{"uring_direct_striped", IoBackend::kIoUring, true, 3},
                                         Mode{"threadpool_fallback", IoBackend::kThreadPool, true,
                                              2},
                                         Mode{"buffered_fallback", IoBackend::kAuto, false, 1}),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- Faults and errors -------------------------------------------------------------------------

struct FaultyStore {
  std::unique_ptr<NvmeStore> store;
  FaultInjectionBlockIo* faults = nullptr;
};

FaultyStore OpenFaulty(const TempDir& dir, bool checksums = true, int queue_depth = 32,
                       IoBackend backend = IoBackend::kAuto) {
  FaultyStore fs;
  NvmeStoreOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = 32 * kMiB;
  o.block_bytes = 64 * kKiB;
  o.queue_depth = queue_depth;
  o.backend = backend;
  o.checksums = checksums;
  o.wrap_io = [&fs](std::unique_ptr<BlockIo> io) -> std::unique_ptr<BlockIo> {
    auto wrapped = std::make_unique<FaultInjectionBlockIo>(std::move(io));
    fs.faults = wrapped.get();
    return wrapped;
  };
  auto s = NvmeStore::Open(o);
  TZ_CHECK(s.ok()) << s.status().ToString();
  fs.store = std::move(s).value();
  return fs;
}

TEST(NvmeFaultTest, ShortTransfersAreResubmitted) {
  TempDir dir;
  FaultyStore f = OpenFaulty(dir);
  f.faults->Inject(
      {.kind = BlockIoFault::Kind::kShorten, .op = IoRequest::Op::kWrite, .count = 40});
  f.faults->Inject({.kind = BlockIoFault::Kind::kShorten, .op = IoRequest::Op::kRead, .count = 40});
  auto e = f.store->Allocate(kMiB + 12345);
  ASSERT_TRUE(e.ok());
  AlignedBuf in(e->bytes), out(e->bytes);
  Fill(in.data, in.size, 3);
  ASSERT_TRUE(f.store->Write(*e, in.data).ok());
  ASSERT_TRUE(f.store->Read(*e, out.data).ok());
  EXPECT_EQ(0, std::memcmp(in.data, out.data, e->bytes));
  EXPECT_GE(f.store->stats().short_transfers, 20u);
  EXPECT_EQ(f.faults->injected(), 80) << "every 64 KiB request of both directions was shortened";
}

TEST(NvmeFaultTest, ShortTransfersOfMoreRequestsThanTheQueueDepthDoNotDeadlock) {
  // 32 requests through a queue of depth 2: the submitter is blocked on the in-flight limit
  // while completions resubmit remainders. A resubmission must reuse its permit.
  for (IoBackend backend : {IoBackend::kIoUring, IoBackend::kThreadPool}) {
    TempDir dir;
    FaultyStore f = OpenFaulty(dir, /*checksums=*/true, /*queue_depth=*/2, backend);
    f.faults->Inject(
        {.kind = BlockIoFault::Kind::kShorten, .op = IoRequest::Op::kWrite, .count = 64});
    f.faults->Inject(
        {.kind = BlockIoFault::Kind::kShorten, .op = IoRequest::Op::kRead, .count = 64});
    auto& s = f.store;
    auto e = s->Allocate(2 * kMiB);
    ASSERT_TRUE(e.ok());
    AlignedBuf in(e->bytes), out(e->bytes);
    Fill(in.data, in.size, 12);
    ASSERT_TRUE(s->Write(*e, in.data).ok());
    ASSERT_TRUE(s->Read(*e, out.data).ok());
    EXPECT_EQ(0, std::memcmp(in.data, out.data, e->bytes));
    EXPECT_GE(s->stats().short_transfers, 64u);
  }
}

// EINTR and EAGAIN (a pread interrupted on NFS or FUSE) are no disk error: the request is
// resubmitted, a few times at most; one that keeps failing so is an error naming it.
TEST(NvmeFaultTest, InterruptedTransfersAreResubmitted) {
  for (IoBackend backend : {IoBackend::kIoUring, IoBackend::kThreadPool}) {
    TempDir dir;
    FaultyStore f = OpenFaulty(dir, /*checksums=*/true, /*queue_depth=*/4, backend);
    f.faults->Inject({.kind = BlockIoFault::Kind::kFail,
                      .op = IoRequest::Op::kWrite,
                      .count = 6,
                      .error_code = EAGAIN});
    f.faults->Inject({.kind = BlockIoFault::Kind::kFail,
                      .op = IoRequest::Op::kRead,
                      .count = 6,
                      .error_code = EINTR});
    auto e = f.store->Allocate(kMiB);
    ASSERT_TRUE(e.ok());
    AlignedBuf in(e->bytes), out(e->bytes);
    Fill(in.data, in.size, 5);
    ASSERT_TRUE(f.store->Write(*e, in.data).ok());
    ASSERT_TRUE(f.store->Read(*e, out.data).ok());
    EXPECT_EQ(0, std::memcmp(in.data, out.data, e->bytes));
    EXPECT_EQ(f.faults->injected(), 12);
    // Interrupted without end: an error, not a loop.
    f.faults->Inject({.kind = BlockIoFault::Kind::kFail,
                      .op = IoRequest::Op::kRead,
                      .count = 1 << 20,
                      .error_code = EINTR});
    Status st = f.store->Read(*e, out.data);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("Interrupted"), std::string::npos) << st.ToString();
    f.faults->Clear();
    ASSERT_TRUE(f.store->Read(*e, out.data).ok());
    EXPECT_EQ(0, std::memcmp(in.data, out.data, e->bytes));
  }
}

TEST(NvmeFaultTest, IoErrorSurfacesWithContextAndStoreStaysUsable) {
  TempDir dir;
  FaultyStore f = OpenFaulty(dir);
  auto e = f.store->Allocate(300 * kKiB);
  ASSERT_TRUE(e.ok());
  AlignedBuf in(e->bytes), out(e->bytes);
  Fill(in.data, in.size, 4);
  ASSERT_TRUE(f.store->Write(*e, in.data).ok());
  f.faults->Inject({.kind = BlockIoFault::Kind::kFail, .op = IoRequest::Op::kRead, .skip = 2});
  Status st = f.store->Read(*e, out.data);
  ASSERT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find("read from " + dir.path()), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("offset"), std::string::npos);
  EXPECT_NE(st.message().find("length 65536"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("errno 5"), std::string::npos) << st.message();
  // The failed read changed nothing on disk; the next read works.
  ASSERT_TRUE(f.store->Read(*e, out.data).ok());
  EXPECT_EQ(0, std::memcmp(in.data, out.data, e->bytes));
  // A failed write is reported too, and a rewrite repairs the extent.
  f.faults->Inject(
      {.kind = BlockIoFault::Kind::kFail, .op = IoRequest::Op::kWrite, .error_code = ENOSPC});
  Status w = f.store->Write(*e, in.data);
  EXPECT_EQ(w.code(), StatusCode::kIoError);
  EXPECT_NE(w.message().find("No space left"), std::string::npos) << w.message();
  EXPECT_EQ(f.store->Read(*e, out.data).code(), StatusCode::kDataLoss)
      << "after a failed write the extent has no valid checksum";
  ASSERT_TRUE(f.store->Write(*e, in.data).ok());
  ASSERT_TRUE(f.store->Read(*e, out.data).ok());
}

TEST(NvmeFaultTest, DelayedCompletionsStillComplete) {
  TempDir dir;
  FaultyStore f = OpenFaulty(dir);
  f.faults->Inject({.kind = BlockIoFault::Kind::kDelay,
                    .op = IoRequest::Op::kWrite,
                    .count = 3,
                    .delay_ms = 30});
  auto e = f.store->Allocate(200 * kKiB);
  ASSERT_TRUE(e.ok());
  AlignedBuf in(e->bytes);
  Fill(in.data, in.size, 5);
  auto t = f.store->SubmitWrite(*e, in.data);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->Done());
  EXPECT_TRUE(t->Wait().ok());
  EXPECT_TRUE(t->Done());
}

TEST(NvmeStoreErrorsTest, PreallocationThatCannotFitFailsAtOpen) {
  TempDir dir;
  NvmeStoreOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = uint64_t{1} << 50;  // 1 PiB
  auto s = NvmeStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(s.status().message().find("needs 1 PiB at " + dir.path()), std::string::npos)
      << s.status().message();
  EXPECT_NE(s.status().message().find("free there"), std::string::npos);
  o.paths = {dir.path() + "/no/such/dir/file"};
  o.bytes_per_path = kMiB;
  EXPECT_FALSE(NvmeStore::Open(o).ok());
  // The kernel's file systems store nothing: said as not a disk, not as "only 0 B is free".
  for (const char* kernels : {"/proc/self", "/sys"}) {
    o.paths = {kernels};
    s = NvmeStore::Open(o);
    ASSERT_FALSE(s.ok()) << kernels;
    EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition) << s.status().message();
    EXPECT_NE(s.status().message().find("not on a disk"), std::string::npos)
        << s.status().message();
  }
}

TEST(NvmeStoreErrorsTest, TheSwapFileIsReservedWhereTheFileSystemHasNoFallocate) {
  // ext2 has no fallocate: glibc's fallback writes a byte into every block, which the O_DIRECT
  // descriptor refused, and the swap file stayed sparse, its space unreserved (a disk filling
  // later failed a swap write mid-run). The space is taken at open now. Needs root and a loop
  // device for an ext2 image; skipped elsewhere.
  if (::geteuid() != 0 || !fs::exists("/sbin/mkfs.ext2")) GTEST_SKIP() << "needs root, mkfs.ext2";
  TempDir dir;
  const std::string img = dir.path() + "/ext2.img", mnt = dir.path() + "/mnt";
  {
    std::ofstream(img).close();
    fs::resize_file(img, 64 * kMiB);
  }
  fs::create_directories(mnt);
  if (std::system(("/sbin/mkfs.ext2 -q -F " + img + " >/dev/null 2>&1").c_str()) != 0 ||
      std::system(("mount -o loop " + img + " " + mnt + " >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "no loop device can be mounted here";
  struct Unmount {
    std::string mnt;
    // Lazily: io_uring drops its registered files in the background after the ring is gone.
    ~Unmount() { (void)std::system(("umount -l " + mnt + " >/dev/null 2>&1").c_str()); }
  } unmount{mnt};
  auto free_now = [&] {
    struct statvfs v {};
    EXPECT_EQ(::statvfs(mnt.c_str(), &v), 0);
    return static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  };
  const uint64_t before = free_now();
  NvmeStoreOptions o;
  o.paths = {mnt};
  o.bytes_per_path = 16 * kMiB;
  o.direct_io = true;
  auto s = NvmeStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const uint64_t after = free_now();
  EXPECT_GE(before - std::min(before, after), 16 * kMiB)
      << "the swap file took " << (before - std::min(before, after)) << " bytes of the disk";
}

TEST(NvmeStoreErrorsTest, FullStoreIsOutOfMemoryNamingTheSpace) {
  TempDir dir;
  NvmeStoreOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = kMiB;
  auto s = NvmeStore::Open(o);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE((*s)->Allocate(768 * kKiB).ok());
  auto e = (*s)->Allocate(512 * kKiB);
  ASSERT_EQ(e.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(e.status().message().find("256 KiB free"), std::string::npos) << e.status().message();
}

TEST(NvmeStoreErrorsTest, CrcMismatchIsDataLossNamingTheExtent) {
  TempDir dir;
  const std::string file = dir.path() + "/swap.bin";
  NvmeStoreOptions o;
  o.paths = {file};
  o.bytes_per_path = kMiB;
  o.checksums = true;
  auto s = NvmeStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto e = (*s)->Allocate(100000);
  ASSERT_TRUE(e.ok());
  AlignedBuf in(e->bytes), out(e->bytes);
  Fill(in.data, in.size, 6);
  ASSERT_TRUE((*s)->Write(*e, in.data).ok());
  ASSERT_TRUE((*s)->Read(*e, out.data).ok()) << "an intact extent verifies";
  // Flip one byte of every page of the swap file behind the store's back.
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  for (off_t off = 100; off < static_cast<off_t>(kMiB); off += 4096) {
    uint8_t b;
    ASSERT_EQ(::pread(fd, &b, 1, off), 1);
    b ^= 0x40;
    ASSERT_EQ(::pwrite(fd, &b, 1, off), 1);
  }
  ::fsync(fd);
  ::close(fd);
  Status st = (*s)->Read(*e, out.data);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("extent " + std::to_string(e->id)), std::string::npos)
      << st.message();
  auto never_written = (*s)->Allocate(4096);
  ASSERT_TRUE(never_written.ok());
  EXPECT_EQ((*s)->Read(*never_written, out.data).code(), StatusCode::kDataLoss);
  s->reset();
  EXPECT_FALSE(fs::exists(file)) << "a swap file the store created is removed at close";
}

// A swap file of its own at a named path is removed at close, or on a signal's exit, only if
// the name still is that file: one put there meanwhile is someone else's and stays.
TEST(NvmeStoreErrorsTest, AFileReplacingTheSwapFileIsNeverRemoved) {
  TempDir dir;
  const std::string file = dir.path() + "/swap.bin";
  NvmeStoreOptions o;
  o.paths = {file};
  o.bytes_per_path = kMiB;
  auto s = NvmeStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(fs::exists(file));
  ASSERT_EQ(::unlink(file.c_str()), 0);
  { std::ofstream(file) << "the user's"; }
  // A signal's exit (in a child: RemovePendingTemporaries ends the process's file registry).
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    RemovePendingTemporaries();
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(fs::exists(file)) << "removed by a signal's exit";
  s->reset();
  EXPECT_TRUE(fs::exists(file)) << "removed at close";
  std::ifstream in(file);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "the user's");
}

TEST(NvmeStoreErrorsTest, MisalignedBufferIsRejected) {
  TempDir dir;
  NvmeStoreOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = kMiB;
  auto s = NvmeStore::Open(o);
  ASSERT_TRUE(s.ok());
  auto e = (*s)->Allocate(4096);
  AlignedBuf buf(8192);
  EXPECT_EQ((*s)->SubmitWrite(*e, buf.data + 8).status().code(), StatusCode::kInvalidArgument);
}

TEST(NvmeStoreTest2, FixedBuffersFromThePinnedArena) {
  TempDir dir;
  NvmeStoreOptions o;
  o.paths = {dir.path()};
  o.bytes_per_path = 8 * kMiB;
  o.backend = IoBackend::kIoUring;
  auto s = NvmeStore::Open(o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto arena = PinnedArena::Create(nullptr, kMiB, 2);
  ASSERT_TRUE(arena.ok());
  ASSERT_TRUE((*s)->RegisterBuffers({{(*arena)->base(), (*arena)->total_bytes()}}).ok());
  auto a = (*arena)->TryAcquire(), b = (*arena)->TryAcquire();
  auto e = (*s)->Allocate(kMiB);
  ASSERT_TRUE(e.ok());
  Fill(static_cast<uint8_t*>(a->data()), kMiB, 7);
  ASSERT_TRUE((*s)->Write(*e, a->data()).ok());
  ASSERT_TRUE((*s)->Read(*e, b->data()).ok());
  EXPECT_EQ(0, std::memcmp(a->data(), b->data(), kMiB));
}

// ---- CRC32C ------------------------------------------------------------------------------------

TEST(Crc32cTest, KnownValueAndPathsAgree) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(internal::Crc32cTable("123456789", 9, 0), 0xE3069283u);
  std::vector<uint8_t> data(200000);
  Fill(data.data(), data.size(), 8);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{4096}, size_t{24575},
                   size_t{24576}, size_t{24577}, size_t{100003}, size_t{200000}}) {
    const uint32_t want = internal::Crc32cTable(data.data(), n, 0);
    EXPECT_EQ(Crc32c(data.data(), n), want) << n;
    // Continuing a CRC over two parts equals the CRC of the whole.
    EXPECT_EQ(Crc32c(data.data() + n / 3, n - n / 3, Crc32c(data.data(), n / 3)), want) << n;
  }
}

// ---- Swap pipeline -----------------------------------------------------------------------------

TEST(SwapperTest, PipelineEqualsSerialReadComputeWrite) {
  TempDir dir;
  NvmeStoreOptions o;
  o.paths = {dir.Sub("a"), dir.Sub("b")};
  o.bytes_per_path = 32 * kMiB;
  o.stripe_min_bytes = 256 * kKiB;
  auto s = NvmeStore::Open(o);
  ASSERT_TRUE(s.ok());
  constexpr size_t kBlocks = 23;
  std::vector<NvmeExtent> pipelined, serial;
  AlignedBuf buf(kMiB);
  for (size_t i = 0; i < kBlocks; ++i) {
    const uint64_t bytes = 4 * (1000 + 37000 * (i % 7));  // floats; the last block is ragged
    for (auto* list : {&pipelined, &serial}) {
      auto e = (*s)->Allocate(bytes);
      ASSERT_TRUE(e.ok());
      Fill(buf.data, bytes, static_cast<uint32_t>(i));
      ASSERT_TRUE((*s)->Write(*e, buf.data).ok());
      list->push_back(*e);
    }
  }
  // compute: x = x * 0.5 + block index, on the floats of the block.
  auto compute = [&](std::span<const NvmeExtent> ex, size_t i, void* data) {
    auto* f = static_cast<float*>(data);
    for (size_t k = 0; k < ex[i].bytes / 4; ++k) f[k] = f[k] * 0.5f + static_cast<float>(i);
    return Status::OK();
  };
  auto arena = PinnedArena::Create(nullptr, kMiB, 4);
  ASSERT_TRUE(arena.ok());
  for (int buffers : {3, 4}) {
    ASSERT_TRUE(RunSwapPipeline(**s, pipelined, **arena,
                                [&](size_t i, void* d) { return compute(pipelined, i, d); },
                                {.buffers = buffers})
                    .ok());
  }
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < kBlocks; ++i) {
      ASSERT_TRUE((*s)->Read(serial[i], buf.data).ok());
      ASSERT_TRUE(compute(serial, i, buf.data).ok());
      ASSERT_TRUE((*s)->Write(serial[i], buf.data).ok());
    }
  }
  AlignedBuf a(kMiB), b(kMiB);
  for (size_t i = 0; i < kBlocks; ++i) {
    ASSERT_TRUE((*s)->Read(pipelined[i], a.data).ok());
    ASSERT_TRUE((*s)->Read(serial[i], b.data).ok());
    ASSERT_EQ(0, std::memcmp(a.data, b.data, pipelined[i].bytes)) << "block " << i;
  }
  // A failing compute stops the pipeline and names the block; later blocks are untouched.
  ASSERT_TRUE((*s)->Read(pipelined[10], a.data).ok());
  Status st = RunSwapPipeline(**s, pipelined, **arena, [&](size_t i, void* d) {
    return i == 7 ? InternalError("boom") : compute(pipelined, i, d);
  });
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("block 7"), std::string::npos) << st.message();
  ASSERT_TRUE((*s)->Read(pipelined[10], b.data).ok());
  EXPECT_EQ(0, std::memcmp(a.data, b.data, pipelined[10].bytes));
  EXPECT_EQ((*arena)->stat().current, 0u) << "slots are returned";
}

}  // namespace
}  // namespace tierzero

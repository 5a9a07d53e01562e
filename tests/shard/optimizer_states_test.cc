// OptimizerStates' NVMe groups read ahead (Prefetch) and written behind (ForEach with
// write_behind): the same states as the synchronous pipeline, never a stale read, and a failed
// write behind reported by the next call that waits for it (Note [Optimizer I/O around the step]).
#include "shard/optimizer_states.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "offload/block_io.h"

namespace tierzero {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kElems = 16384;  // 192 KiB of states per group: three 64 KiB requests

class TempDir {
 public:
  TempDir() {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::path(testing::TempDir()) /
            ("tz_optstates_" + std::string(info->name()) + "_" + std::to_string(getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

struct Store {
  std::unique_ptr<NvmeStore> nvme;
  FaultInjectionBlockIo* faults = nullptr;
  std::unique_ptr<OptimizerStates> states;
};

Store Open(const TempDir& dir, const std::string& sub, std::vector<Tier> tiers) {
  Store s;
  fs::create_directories(fs::path(dir.path()) / sub);
  NvmeStoreOptions o;
  o.paths = {(fs::path(dir.path()) / sub).string()};
  o.bytes_per_path = 16 << 20;
  o.block_bytes = 64 << 10;
  o.wrap_io = [&s](std::unique_ptr<BlockIo> io) -> std::unique_ptr<BlockIo> {
    auto w = std::make_unique<FaultInjectionBlockIo>(std::move(io));
    s.faults = w.get();
    return w;
  };
  auto n = NvmeStore::Open(o);
  EXPECT_TRUE(n.ok()) << n.status().ToString();
  s.nvme = std::move(n).value();
  auto st = OptimizerStates::Create(nullptr, s.nvme.get(), kElems, std::move(tiers));
  EXPECT_TRUE(st.ok()) << st.status().ToString();
  s.states = std::move(st).value();
  return s;
}

// Group c's element i after `round` updates: a value no other (chunk, i, round) has.
Status Fill(const OptimizerGroup& g) {
  for (uint64_t i = 0; i < kElems; ++i) {
    g.master[i] = static_cast<float>(g.chunk * 100000 + i);
    g.m[i] = 0.5f * static_cast<float>(i);
    g.v[i] = static_cast<float>(g.chunk);
  }
  return Status::OK();
}
Status Update(const OptimizerGroup& g, int round) {
  for (uint64_t i = 0; i < kElems; ++i) {
    g.master[i] = g.master[i] * 1.0001f + static_cast<float>(round);
    g.m[i] += static_cast<float>(g.chunk + round);
    g.v[i] = g.v[i] * 0.5f + 1.0f;
  }
  return Status::OK();
}

std::vector<float> Snapshot(OptimizerStates& s) {
  std::vector<float> all;
  Status st = s.ForEach(
      [&](const OptimizerGroup& g) {
        all.insert(all.end(), g.master, g.master + 3 * kElems);
        return Status::OK();
      },
      /*write_back=*/false);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return all;
}

const std::vector<Tier> kTiers = {Tier::kHost, Tier::kNvme, Tier::kNvme, Tier::kHost,
                                  Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme};

TEST(OptimizerStatesTest, ReadAheadAndWrittenBehindMatchTheSynchronousPipeline) {
  TempDir dir;
  Store a = Open(dir, "a", kTiers), b = Open(dir, "b", kTiers);
  ASSERT_TRUE(a.states->Init(Fill).ok());
  ASSERT_TRUE(b.states->Init(Fill).ok());
  for (int round = 1; round <= 6; ++round) {
    // a: reads started ahead (all but the first round, whose writes are still in flight when
    // the next Prefetch comes, exercise both), writes left behind; b: neither.
    auto staged = a.states->Prefetch();
    ASSERT_TRUE(staged.ok()) << staged.status().ToString();
    EXPECT_LE(*staged, 3) << "only the three swap slots";
    if (round > 1) {
      EXPECT_GE(*staged, 1);
    }
    auto fn = [round](const OptimizerGroup& g) { return Update(g, round); };
    ASSERT_TRUE(a.states->ForEach(fn, true, {}, /*write_behind=*/true).ok());
    ASSERT_TRUE(b.states->ForEach(fn, true).ok());
    if (round == 3) {
      // Another access between the phases: With settles first, so it reads the new states,
      // and what it writes is what the next phase reads.
      ASSERT_TRUE(a.states->Prefetch().ok());
      for (Store* s : {&a, &b}) {
        ASSERT_TRUE(
            s->states->With(1, true, [](const OptimizerGroup& g) { return Update(g, 99); }).ok());
      }
    }
  }
  ASSERT_TRUE(a.states->Settle().ok());
  const std::vector<float> sa = Snapshot(*a.states), sb = Snapshot(*b.states);
  ASSERT_EQ(sa.size(), sb.size());
  EXPECT_EQ(0, std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(float)));
  EXPECT_EQ(a.states->staged(), 0);
}

TEST(OptimizerStatesTest, StagedReadsOfOtherGroupsAreDropped) {
  TempDir dir;
  Store a = Open(dir, "a", kTiers), b = Open(dir, "b", kTiers);
  ASSERT_TRUE(a.states->Init(Fill).ok());
  ASSERT_TRUE(b.states->Init(Fill).ok());
  // Staged: chunks 1, 2, 4. The phase then walks only chunks 4..7.
  ASSERT_EQ(*a.states->Prefetch(), 3);
  auto later = [](int c) { return c >= 4; };
  auto fn = [](const OptimizerGroup& g) { return Update(g, 7); };
  ASSERT_TRUE(a.states->ForEach(fn, true, later, /*write_behind=*/true).ok());
  ASSERT_TRUE(b.states->ForEach(fn, true, later).ok());
  // A selection staged, then every group walked: the staged prefix is used.
  auto first = [](int c) { return c < 3; };
  ASSERT_TRUE(a.states->Prefetch(first).ok());
  ASSERT_TRUE(a.states->ForEach(fn, true, {}, /*write_behind=*/true).ok());
  ASSERT_TRUE(b.states->ForEach(fn, true).ok());
  const std::vector<float> sa = Snapshot(*a.states), sb = Snapshot(*b.states);
  EXPECT_EQ(0, std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(float)));
}

TEST(OptimizerStatesTest, AWriteBehindThatFailsOnceIsWrittenAgain) {
  TempDir dir;
  Store a = Open(dir, "a", {Tier::kNvme, Tier::kNvme, Tier::kNvme});
  Store b = Open(dir, "b", {Tier::kNvme, Tier::kNvme, Tier::kNvme});
  ASSERT_TRUE(a.states->Init(Fill).ok());
  ASSERT_TRUE(b.states->Init(Fill).ok());
  // Three groups staged, so the phase needs no slot and waits for no write: all three are
  // behind it when it returns. One request of chunk 1's write fails (chunk 0's three go first).
  ASSERT_EQ(*a.states->Prefetch(), 3);
  a.faults->Inject(
      {.kind = BlockIoFault::Kind::kFail, .op = IoRequest::Op::kWrite, .skip = 3, .count = 1});
  auto fn = [](const OptimizerGroup& g) { return Update(g, 1); };
  ASSERT_TRUE(a.states->ForEach(fn, true, {}, /*write_behind=*/true).ok());
  ASSERT_TRUE(b.states->ForEach(fn, true).ok());
  ASSERT_TRUE(a.states->Settle().ok());
  EXPECT_EQ(a.faults->injected(), 1);
  const std::vector<float> sa = Snapshot(*a.states), sb = Snapshot(*b.states);
  EXPECT_EQ(0, std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(float)));
}

TEST(OptimizerStatesTest, AWriteBehindThatFailsTwiceIsReportedByEveryLaterAccess) {
  TempDir dir;
  Store a = Open(dir, "a", {Tier::kNvme, Tier::kNvme, Tier::kNvme});
  ASSERT_TRUE(a.states->Init(Fill).ok());
  ASSERT_EQ(*a.states->Prefetch(), 3);
  // Every write of chunk 1 and after fails (the disk is gone).
  a.faults->Inject(
      {.kind = BlockIoFault::Kind::kFail, .op = IoRequest::Op::kWrite, .skip = 3, .count = 1000});
  ASSERT_TRUE(a.states
                  ->ForEach([](const OptimizerGroup& g) { return Update(g, 1); }, true, {},
                            /*write_behind=*/true)
                  .ok());
  const Status s = a.states->Settle();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.ToString().find("chunk 1's optimizer states behind the step"), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.ToString().find("resume from the last checkpoint"), std::string::npos);
  // The group is lost: every later access says so, not only the call that saw it.
  for (const Status& later :
       {a.states->Settle(),
        a.states->With(0, false, [](const OptimizerGroup&) { return Status::OK(); }),
        a.states->ForEach([](const OptimizerGroup&) { return Status::OK(); }, false),
        a.states->Prefetch().status()}) {
    EXPECT_NE(later.ToString().find("chunk 1's optimizer states"), std::string::npos)
        << later.ToString();
  }
}

}  // namespace
}  // namespace tierzero

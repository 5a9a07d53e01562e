// Token files (models/gpt/token_data.h): llm.c shards (GPT-2's uint16, Llama 3's uint32) and raw
// uint16 read alike, every window a run
// of the file's tokens in its split (Note [Token splits]), evaluation windows where the spec puts
// them, and each bad file refused with what is wrong.
#include "gpt/token_data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gpt/data.h"

namespace tierzero::gpt {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("tz-tokens-" + std::to_string(::getpid()));
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// Token i of a file is (base + 7 i) mod vocab: any window says where it came from.
std::vector<uint16_t> Tokens(uint64_t n, int base, int vocab) {
  std::vector<uint16_t> t(n);
  for (uint64_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>((base + 7 * i) % vocab);
  return t;
}

void WriteRaw(const std::string& path, const std::vector<uint16_t>& t) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * 2));
}

void WriteShard(const std::string& path, const std::vector<uint16_t>& t, int32_t magic = 20240520,
                int32_t version = 1, int64_t count = -1) {
  std::vector<int32_t> h(256, 0);
  h[0] = magic;
  h[1] = version;
  h[2] = static_cast<int32_t>(count < 0 ? static_cast<int64_t>(t.size()) : count);
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(h.data()), 1024);
  f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * 2));
}

// A Llama 3 shard of llm.c (magic 20240801, version 7): uint32 tokens.
void WriteShard32(const std::string& path, const std::vector<uint32_t>& t, int32_t version = 7,
                  int64_t count = -1) {
  std::vector<int32_t> h(256, 0);
  h[0] = 20240801;
  h[1] = version;
  h[2] = static_cast<int32_t>(count < 0 ? static_cast<int64_t>(t.size()) : count);
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(h.data()), 1024);
  f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * 4));
}

// Token i is (base + 40503 i) mod vocab: ids over the whole of a vocabulary past 65536.
std::vector<uint32_t> WideTokens(uint64_t n, uint32_t base, uint32_t vocab) {
  std::vector<uint32_t> t(n);
  for (uint64_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>((base + 40503 * i) % vocab);
  return t;
}

// The position in `t` where `window` (seq + 1 tokens: tokens then the last target) starts, or -1.
int64_t Find(const std::vector<uint16_t>& t, const std::vector<int32_t>& window) {
  for (size_t s = 0; s + window.size() <= t.size(); ++s) {
    bool same = true;
    for (size_t k = 0; k < window.size() && same; ++k) same = t[s + k] == window[k];
    if (same) return static_cast<int64_t>(s);
  }
  return -1;
}

TEST(TokenData, ShardsAndRawFilesGiveWindowsOfTheirSplit) {
  TempDir dir;
  const int vocab = 50257, seq = 16;
  const std::vector<uint16_t> a = Tokens(3000, 1, vocab), b = Tokens(2000, 5000, vocab),
                              v = Tokens(1000, 40000, vocab);
  WriteShard(dir / "d_train_000.bin", a);
  WriteShard(dir / "d_train_001.bin", b);
  WriteRaw(dir / "d_val_000.bin", v);  // sorted last: the validation file
  auto s = TokenShards::Open(dir / "d_*.bin", vocab, seq + 1);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->files(), 3u);
  EXPECT_EQ((*s)->tokens(), 6000u);
  EXPECT_EQ((*s)->split_tokens(false), 5000u);
  EXPECT_EQ((*s)->split_tokens(true), 1000u);
  std::vector<int32_t> tok(seq), tgt(seq);
  int in_a = 0, in_b = 0;
  for (uint64_t key = 0; key < 400; ++key) {
    for (const bool validation : {false, true}) {
      ASSERT_TRUE((*s)->Window(validation, key * 2654435761u, seq, tok.data(), tgt.data()).ok());
      for (int t = 0; t + 1 < seq; ++t) ASSERT_EQ(tgt[t], tok[t + 1]);
      std::vector<int32_t> window(tok);
      window.push_back(tgt.back());
      if (validation) {
        EXPECT_GE(Find(v, window), 0) << "a validation window not from the last file";
      } else {
        const bool from_a = Find(a, window) >= 0, from_b = Find(b, window) >= 0;
        EXPECT_TRUE(from_a || from_b) << "a training window from no training file";
        in_a += from_a;
        in_b += from_b;
      }
    }
  }
  EXPECT_GT(in_a, in_b) << "windows are drawn in proportion to the files' lengths";
  EXPECT_GT(in_b, 0);

  // One file: its first 90% trains, its last 10% validates.
  auto one = TokenShards::Open(dir / "d_train_000.bin", vocab, seq + 1);
  ASSERT_TRUE(one.ok());
  for (uint64_t key = 0; key < 200; ++key) {
    ASSERT_TRUE((*one)->Window(true, key * 7919, seq, tok.data(), tgt.data()).ok());
    std::vector<int32_t> window(tok);
    window.push_back(tgt.back());
    EXPECT_GE(Find(a, window), 2700) << "validation from the first 90%";
    ASSERT_TRUE((*one)->Window(false, key * 7919, seq, tok.data(), tgt.data()).ok());
    window.assign(tok.begin(), tok.end());
    window.push_back(tgt.back());
    const int64_t at = Find(a, window);
    EXPECT_TRUE(at >= 0 && at + seq + 1 <= 2700) << "training beyond the first 90%: " << at;
  }
}

TEST(TokenData, EvaluationWindowsStartAtMultiplesOfTheirLength) {
  TempDir dir;
  const std::vector<uint16_t> a = Tokens(41, 3, 100), b = Tokens(10, 60, 100);
  WriteRaw(dir / "e_0.bin", a);
  WriteShard(dir / "e_1.bin", b);
  auto s = TokenShards::Open(dir / "e_*.bin", 100, 0);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  // 41 tokens: windows of 4 + 1 at 0, 4, ..., 36 (10); 10 tokens: at 0 and 4 (2).
  ASSERT_EQ((*s)->NumEvalWindows(4), 12u);
  std::vector<int32_t> tok(4), tgt(4);
  for (uint64_t w = 0; w < 12; ++w) {
    ASSERT_TRUE((*s)->EvalWindow(w, 4, tok.data(), tgt.data()).ok());
    const std::vector<uint16_t>& f = w < 10 ? a : b;
    const size_t start = (w < 10 ? w : w - 10) * 4;
    for (size_t t = 0; t < 4; ++t) {
      EXPECT_EQ(tok[t], f[start + t]) << w;
      EXPECT_EQ(tgt[t], f[start + t + 1]) << w;
    }
  }
}

// The fingerprint a checkpoint records is of what the run opened: a file grown or cut under the
// run afterwards does not change it (a resume then compares what it opens with what was read);
// opened again, the changed file's differs.
TEST(TokenData, TheFingerprintIsOfTheFilesAsOpened) {
  TempDir dir;
  const std::vector<uint16_t> a = Tokens(100000, 3, 100);
  WriteRaw(dir / "f.bin", a);
  auto s = TokenShards::Open(dir / "f.bin", 100, 0);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  const uint64_t opened = (*s)->Fingerprint();
  {
    std::ofstream f(dir / "f.bin", std::ios::binary | std::ios::app);
    const std::vector<uint16_t> more = Tokens(5000, 11, 100);
    f.write(reinterpret_cast<const char*>(more.data()), 2 * 5000);
  }
  EXPECT_EQ((*s)->Fingerprint(), opened);
  auto grown = TokenShards::Open(dir / "f.bin", 100, 0);
  ASSERT_TRUE(grown.ok());
  EXPECT_NE((*grown)->Fingerprint(), opened);
  ::truncate((dir / "f.bin").c_str(), 2 * 100000);  // back to what was opened first
  auto same = TokenShards::Open(dir / "f.bin", 100, 0);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ((*same)->Fingerprint(), opened);
  ::truncate((dir / "f.bin").c_str(), 2 * 1000);
  EXPECT_EQ((*s)->Fingerprint(), opened);
}

// Note [Token widths]: Llama 3's shards read as their uint32 ids, every id of a 128256 vocabulary
// (past 65535, where 16-bit files cannot go), beside 16-bit files in one glob; the evaluation
// windows are the ids as written.
TEST(TokenData, Llama3ShardsReadTheirThirtyTwoBitIds) {
  TempDir dir;
  const uint32_t vocab = 128256;
  const std::vector<uint32_t> a = WideTokens(3001, 7, vocab);
  const std::vector<uint16_t> b = Tokens(801, 3, 50000);
  WriteShard32(dir / "w_0.bin", a);
  WriteShard(dir / "w_1.bin", b);
  auto s = TokenShards::Open(dir / "w_*.bin", static_cast<int>(vocab), 0);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ((*s)->tokens(), 3802u);
  EXPECT_NE((*s)->Describe(false).find("llm.c shards (uint16 and uint32)"), std::string::npos)
      << (*s)->Describe(false);
  EXPECT_NE((*s)->Describe(false).find("16-bit ids in the uint16 files"), std::string::npos);
  const int seq = 100;
  ASSERT_EQ((*s)->NumEvalWindows(seq), 30u + 8u);
  std::vector<int32_t> tok(seq), tgt(seq);
  uint32_t largest = 0;
  for (uint64_t w = 0; w < 38; ++w) {
    ASSERT_TRUE((*s)->EvalWindow(w, seq, tok.data(), tgt.data()).ok()) << w;
    const size_t start = (w < 30 ? w : w - 30) * seq;
    for (size_t t = 0; t < static_cast<size_t>(seq); ++t) {
      const uint32_t want = w < 30 ? a[start + t] : b[start + t];
      const uint32_t next = w < 30 ? a[start + t + 1] : b[start + t + 1];
      ASSERT_EQ(static_cast<uint32_t>(tok[t]), want) << w << " " << t;
      ASSERT_EQ(static_cast<uint32_t>(tgt[t]), next) << w << " " << t;
      largest = std::max(largest, want);
    }
  }
  EXPECT_GT(largest, 120000u) << "ids past 65535 read as written";
  // Alone, and split 90/10 for training: every window a run of the file's ids.
  auto one = TokenShards::Open(dir / "w_0.bin", static_cast<int>(vocab), 17);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_NE((*one)->Describe().find("llm.c Llama 3 shards (uint32)"), std::string::npos);
  EXPECT_EQ((*one)->Describe().find("16-bit"), std::string::npos) << (*one)->Describe();
  tok.resize(16);
  tgt.resize(16);
  for (uint64_t key = 0; key < 100; ++key) {
    ASSERT_TRUE((*one)->Window(false, key * 7919, 16, tok.data(), tgt.data()).ok());
    size_t at = 0;
    while (at < a.size() && a[at] != static_cast<uint32_t>(tok[0])) ++at;
    ASSERT_LT(at + 16, 2700u);
    for (size_t t = 0; t < 16; ++t) ASSERT_EQ(static_cast<uint32_t>(tgt[t]), a[at + t + 1]);
  }
}

// A 32-bit shard's bad ids, header and size, and 32-bit ids written raw: each refused, naming
// the id as the file holds it, or what the file looks like and how to write it.
TEST(TokenData, BadThirtyTwoBitFilesAreRefusedWithWhatIsWrong) {
  TempDir dir;
  auto error = [&](const std::string& pattern, int vocab, uint64_t scan = uint64_t{4} << 30) {
    auto s = TokenShards::Open(pattern, vocab, 17, scan);
    return s.ok() ? std::string("(opened)") : s.status().ToString();
  };
  std::vector<uint32_t> t = WideTokens(1000, 0, 70000);
  t[321] = 70000;
  WriteShard32(dir / "id.bin", t);
  EXPECT_NE(error(dir / "id.bin", 70000).find("token id 70000 at position 321"), std::string::npos)
      << error(dir / "id.bin", 70000);
  EXPECT_EQ(error(dir / "id.bin", 70001), "(opened)");
  t[321] = 3000000000u;  // past INT32_MAX: named as written, not as a negative int
  WriteShard32(dir / "huge.bin", t);
  EXPECT_NE(error(dir / "huge.bin", 70001).find("token id 3000000000 at position 321"),
            std::string::npos)
      << error(dir / "huge.bin", 70001);
  // Past the bytes checked at open: refused as the window holding it is read.
  auto lazy = TokenShards::Open(dir / "huge.bin", 70001, 0, /*scan_at_open=*/400);
  ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
  std::vector<int32_t> tok(16), tgt(16);
  const Status read = (*lazy)->EvalWindow(321 / 16, 16, tok.data(), tgt.data());
  EXPECT_NE(read.ToString().find("token id 3000000000 at position 321"), std::string::npos)
      << read.ToString();
  EXPECT_TRUE((*lazy)->EvalWindow(0, 16, tok.data(), tgt.data()).ok());
  WriteShard32(dir / "v1.bin", WideTokens(100, 0, 300), 1);
  EXPECT_NE(error(dir / "v1.bin", 300).find("Llama 3 shard (magic 20240801) of version 1"),
            std::string::npos)
      << error(dir / "v1.bin", 300);
  WriteShard32(dir / "short.bin", WideTokens(100, 0, 300), 7, 101);
  EXPECT_NE(error(dir / "short.bin", 300).find("truncated"), std::string::npos);
  WriteShard32(dir / "cut.bin", WideTokens(100, 0, 300));
  fs::resize_file(dir / "cut.bin", 800);
  EXPECT_NE(error(dir / "cut.bin", 300).find("cut short"), std::string::npos);
  // 32-bit ids written raw (np.int32(ids).tofile): every second 16-bit value is 0.
  {
    const std::vector<uint32_t> raw = WideTokens(500, 1, 50000);
    std::ofstream f(dir / "raw32.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(raw.data()), static_cast<std::streamsize>(4 * 500));
  }
  EXPECT_NE(error(dir / "raw32.bin", 50257).find("looks like 32-bit token ids"), std::string::npos)
      << error(dir / "raw32.bin", 50257);
  // Note [Files that are not tokens]: text named by --data, NumPy's .npy, an Arrow file.
  {
    std::string text;
    while (text.size() < 3000) text += "The quick brown fox — naïve café.\n\tjumps over it. ";
    text.resize(3000);
    std::ofstream(dir / "book.txt", std::ios::binary) << text;
    std::string npy = "\x93NUMPY\x01";
    npy += std::string(2000, ' ');
    std::ofstream(dir / "ids.npy", std::ios::binary) << npy;
    std::ofstream(dir / "cache.arrow", std::ios::binary) << "ARROW1" + std::string(2000, 'x');
  }
  EXPECT_NE(error(dir / "book.txt", 50257).find("looks like text"), std::string::npos)
      << error(dir / "book.txt", 50257);
  EXPECT_NE(error(dir / "ids.npy", 50257).find("NumPy .npy"), std::string::npos);
  EXPECT_NE(error(dir / "cache.arrow", 50257).find("Arrow file"), std::string::npos);
  // Ids whose bytes are all printable for a while, then not: tokens. A short file: too short to
  // say, read as tokens.
  std::vector<uint16_t> printable(2000);
  for (size_t i = 0; i < printable.size(); ++i)
    printable[i] = static_cast<uint16_t>(i < 500 ? 0x4142 + (i % 20) : 5 + i % 40000);
  WriteRaw(dir / "printable.bin", printable);
  EXPECT_EQ(error(dir / "printable.bin", 50257), "(opened)");
  std::ofstream(dir / "short.txt", std::ios::binary) << std::string(200, 'a');
  EXPECT_EQ(error(dir / "short.txt", 50257).find("looks like text"), std::string::npos);
  // For a vocabulary past 65536 (Llama 3's 128256), 32-bit ids have upper halves of 0 and 1.
  {
    std::vector<uint32_t> wide = WideTokens(5000, 3, 128256);
    std::ofstream f(dir / "raw32big.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(wide.data()), static_cast<std::streamsize>(4 * 5000));
  }
  EXPECT_NE(error(dir / "raw32big.bin", 128256).find("looks like 32-bit token ids"),
            std::string::npos)
      << error(dir / "raw32big.bin", 128256);
  // 16-bit files with zeros at some odd positions, or all zeros, or short: read as uint16.
  std::vector<uint16_t> zeros = Tokens(1000, 1, 300);
  for (size_t i = 1; i < 900; i += 2) zeros[i] = 0;
  WriteRaw(dir / "some_zeros.bin", zeros);
  EXPECT_EQ(error(dir / "some_zeros.bin", 300), "(opened)");
  WriteRaw(dir / "all_zeros.bin", std::vector<uint16_t>(1000, 0));
  EXPECT_EQ(error(dir / "all_zeros.bin", 300), "(opened)");
}

TEST(TokenData, BadFilesAreRefusedWithWhatIsWrong) {
  TempDir dir;
  auto error = [&](const std::string& pattern, int vocab) {
    auto s = TokenShards::Open(pattern, vocab, 17);
    return s.ok() ? std::string("(opened)") : s.status().ToString();
  };
  std::vector<uint16_t> t = Tokens(1000, 0, 300);
  t[123] = 300;
  WriteRaw(dir / "id.bin", t);
  EXPECT_NE(error(dir / "id.bin", 300).find("token id 300 at position 123"), std::string::npos);
  EXPECT_EQ(error(dir / "id.bin", 301), "(opened)");
  WriteShard(dir / "short.bin", Tokens(100, 0, 300), 20240520, 1, 200);
  EXPECT_NE(error(dir / "short.bin", 300).find("truncated"), std::string::npos);
  // Cut short inside its 1024-byte header: not raw tokens (the header's bytes read as ids).
  WriteShard(dir / "cut.bin", Tokens(100, 0, 300));
  fs::resize_file(dir / "cut.bin", 1000);
  EXPECT_NE(error(dir / "cut.bin", 70000).find("cut short"), std::string::npos)
      << error(dir / "cut.bin", 70000);
  WriteShard(dir / "v2.bin", Tokens(100, 0, 300), 20240520, 2);
  EXPECT_NE(error(dir / "v2.bin", 300).find("version 2"), std::string::npos);
  std::ofstream(dir / "odd.bin") << "abc";
  EXPECT_NE(error(dir / "odd.bin", 300).find("odd"), std::string::npos);
  EXPECT_NE(error(dir / "none*.bin", 300).find("NotFound"), std::string::npos);
  EXPECT_NE(error(dir / "nodir/*.bin", 300).find("the directory"), std::string::npos);
  fs::create_directories(dir / "adir.bin");
  EXPECT_NE(error(dir / "adir.bin", 300).find("not a regular file"), std::string::npos);
  WriteRaw(dir / "tiny.bin", Tokens(30, 0, 300));  // 27 train, 3 validate: no window of 17
  EXPECT_NE(error(dir / "tiny.bin", 300).find("validation split"), std::string::npos);
  // A file that shrinks under the run: a read error (DataLoss), not a SIGBUS.
  WriteRaw(dir / "shrinks.bin", Tokens(1000, 0, 300));
  auto shrinking = TokenShards::Open(dir / "shrinks.bin", 300, 17);
  ASSERT_TRUE(shrinking.ok());
  fs::resize_file(dir / "shrinks.bin", 0);
  std::vector<int32_t> tok(16), tgt(16);
  const Status read = (*shrinking)->Window(false, 5, 16, tok.data(), tgt.data());
  EXPECT_EQ(read.code(), StatusCode::kDataLoss) << read.ToString();
  // Note [A token file written under the run]: one rewritten in place at its size reads to the
  // end, but what it reads is other data: DataLoss too (it read on, exit 0: hunt 52). Its
  // modification time set a second later, as a write then would.
  WriteRaw(dir / "rewritten.bin", Tokens(1000, 0, 300));
  auto rewritten = TokenShards::Open(dir / "rewritten.bin", 300, 17);
  ASSERT_TRUE(rewritten.ok());
  ASSERT_TRUE((*rewritten)->Window(false, 5, 16, tok.data(), tgt.data()).ok());
  {
    std::fstream f(dir / "rewritten.bin", std::ios::binary | std::ios::in | std::ios::out);
    const std::vector<uint16_t> other = Tokens(1000, 5, 300);
    f.write(reinterpret_cast<const char*>(other.data()), 2000);
  }
  fs::last_write_time(dir / "rewritten.bin",
                      fs::last_write_time(dir / "rewritten.bin") + std::chrono::seconds(1));
  const Status stale = (*rewritten)->Window(false, 5, 16, tok.data(), tgt.data());
  EXPECT_EQ(stale.code(), StatusCode::kDataLoss) << stale.ToString();
  EXPECT_NE(stale.ToString().find("changed while in use (written"), std::string::npos)
      << stale.ToString();
  // One file under two names as the validation file and a training one: the run would
  // validate on what it trains on (hunt 52). An evaluation scores what it is given.
  fs::create_directories(dir / "linked");
  WriteRaw(dir / "linked/a_train.bin", Tokens(1000, 0, 300));
  fs::create_hard_link(dir / "linked/a_train.bin", dir / "linked/b_val.bin");
  EXPECT_NE(error(dir / "linked/*.bin", 300).find("are one file"), std::string::npos);
  EXPECT_TRUE(TokenShards::Open(dir / "linked/*.bin", 300, 0).ok());
  fs::remove(dir / "linked/b_val.bin");
  fs::create_symlink("a_train.bin", dir / "linked/b_val.bin");
  EXPECT_NE(error(dir / "linked/*.bin", 300).find("are one file"), std::string::npos);
  // Ids past the bytes checked at open are checked as each window is read: every window holding
  // the bad id is refused, naming it, every other one read.
  auto lazy = TokenShards::Open(dir / "id.bin", 300, 17, /*scan_at_open=*/200);
  ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
  int refused = 0;
  for (uint64_t w = 0; w < (*lazy)->NumEvalWindows(16); ++w) {
    const Status s = (*lazy)->EvalWindow(w, 16, tok.data(), tgt.data());
    const bool holds = w * 16 <= 123 && 123 <= w * 16 + 16;
    EXPECT_EQ(s.ok(), !holds) << w << ": " << s.ToString();
    if (!s.ok()) {
      ++refused;
      EXPECT_NE(s.ToString().find("token id 300 at position 123"), std::string::npos);
    }
  }
  EXPECT_EQ(refused, 1);
  int windows_refused = 0;
  for (uint64_t key = 0; key < 2000; ++key)
    windows_refused += !(*lazy)->Window(false, key, 16, tok.data(), tgt.data()).ok();
  EXPECT_GT(windows_refused, 0);
  // Through the dataset: kind "tokens" with the model's vocabulary.
  DataConfig c;
  c.kind = "tokens";
  c.token_path = dir / "id.bin";
  EXPECT_FALSE(Dataset::Create(c, 16, 300).ok());
  auto d = Dataset::Create(c, 16, 301);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  const Batch b = (*d)->Get(false, 3, 4);
  EXPECT_EQ(b.tokens.size(), 64u);
  EXPECT_FALSE((*d)->has_accuracy());
}

}  // namespace
}  // namespace tierzero::gpt

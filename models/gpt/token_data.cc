// Tokenized data files (token_data.h, Note [Token splits]).
#include "gpt/token_data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "tierzero/files.h"

namespace tierzero::gpt {
namespace {

// llm.c's data shards (Note [Token widths]): GPT-2's, uint16 tokens; Llama 3's, uint32.
constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int32_t kShard32Magic = 20240801;
constexpr int32_t kShard32Version = 7;
constexpr uint64_t kShardHeaderBytes = 256 * sizeof(int32_t);
// A token file larger than this is refused before it is scanned (a huge sparse file would take
// minutes): 2^40 bytes is half a trillion tokens in one file.
constexpr uint64_t kMaxTokenFileBytes = uint64_t{1} << 40;

Status ErrnoStatus(const std::string& what, int err) {
  return Status(err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError,
                what + ": " + std::strerror(err));
}

}  // namespace

TokenShards::~TokenShards() {
  for (File& f : files_) {
    if (f.fd >= 0) ::close(f.fd);
  }
}

static int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// Reads exactly `bytes` at `offset`; false on a short read (the file shrank) or an error.
static bool ReadExactly(int fd, uint64_t offset, void* data, size_t bytes) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t r = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    offset += static_cast<uint64_t>(r);
    bytes -= static_cast<size_t>(r);
  }
  return true;
}

// Note [Token widths]: tokens are 16-bit (GPT-2's shards, raw files) or 32-bit (Llama 3's
// shards). Read widens either into int32: a 32-bit id past INT32_MAX becomes negative, which
// CheckIds refuses (naming it as the file holds it), as it refuses every id >= vocab.
Status TokenShards::Read(const File& f, uint64_t first, uint64_t n, int32_t* out) const {
  alignas(4) uint16_t buf[8192];
  const uint64_t per = sizeof buf / f.width;
  while (n > 0) {
    const uint64_t k = std::min<uint64_t>(n, per);
    if (!ReadExactly(f.fd, f.offset + f.width * first, buf, static_cast<size_t>(f.width * k)))
      return DataLossError("the token file '" + f.path +
                           "' changed while in use: it no longer "
                           "holds the " +
                           std::to_string(f.count) +
                           " tokens it had when the run "
                           "opened it (regenerate data only between runs)");
    if (f.width == 2) {
      for (uint64_t i = 0; i < k; ++i) out[i] = buf[i];
    } else {
      std::memcpy(out, buf, static_cast<size_t>(4 * k));  // little-endian uint32 -> int32 bits
    }
    out += k;
    first += k;
    n -= k;
  }
  // Note [A token file written under the run]
  // A file regenerated in place at its size (a tokenizer run again over train.bin) reads to
  // the end: the run trained and validated on other data from then on, exit 0, and a resume
  // was told its data differs from what the run read (hunt 52). The file's modification time,
  // taken after the reads, says whether it was written since it opened (a write before the
  // read, or during it, has set it by then): any change is refused, as a shrink is.
  struct stat st {};
  if (::fstat(f.fd, &st) == 0 &&
      (static_cast<uint64_t>(st.st_size) != f.bytes || MtimeNs(st) != f.mtime_ns))
    return DataLossError("the token file '" + f.path +
                         "' changed while in use (written, appended to or touched: its size or "
                         "modification time is not what it was when the run opened it), so what "
                         "it reads may not be the data it began with; regenerate data only "
                         "between runs");
  return Status::OK();
}

// Note [Token widths]: a raw file is uint16 (nanoGPT's). 32-bit ids written raw
// (`np.int32(ids).tofile(...)`, the default integer of many scripts) would read as an id and a
// zero, alternately: a model trained on them learns nothing, without a word. Every second 16-bit
// value of the file's start being 0 (or, for a vocabulary past 65536, at most the upper half of
// its largest id), while others are not, says it is such a file: no tokenizer writes id 0 at
// every other position of 64 or more (a toy task's data may: it is refused, said as such).
//
// Note [Files that are not tokens]
// Any file of an even size reads as raw uint16 tokens, and its ids pass a vocabulary above
// 32767 as often as not: a text file named by --data instead of --text trained on pairs of
// letters (hunt 50's own), as would NumPy's .npy (a header, then ids perhaps 64-bit) or an Arrow
// file (Hugging Face datasets' cache). Each is told by its start and refused, saying what to
// write: NumPy's and Arrow's magic bytes, and text: no NUL, no control character but
// whitespace, valid UTF-8, over the first 256 bytes or more (token ids below 256, or whose
// bytes are control characters, break such a run within a few tokens).
Status TokenShards::RefuseNotRawTokens(const File& f, int vocab) {
  std::vector<uint8_t> head(static_cast<size_t>(std::min<uint64_t>(f.bytes, 131072)));
  if (!ReadExactly(f.fd, 0, head.data(), head.size()))
    return IoError("reading the token file '" + f.path + "' failed");
  const std::string how =
      ": save the ids raw as uint16 (`ids.astype(np.uint16).tofile(PATH)`, ids below 65536) or "
      "as an llm.c shard (docs/data.md)";
  auto starts = [&](const char* magic, size_t n) {
    return head.size() >= n && std::memcmp(head.data(), magic, n) == 0;
  };
  if (starts("\x93NUMPY", 6))
    return InvalidArgumentError("the token file '" + f.path +
                                "' is a NumPy .npy file, whose header is not tokens" + how);
  if (starts("ARROW1", 6))
    return InvalidArgumentError("the token file '" + f.path +
                                "' is an Arrow file (a datasets cache?), not raw tokens" + how);
  if (head.size() >= 256) {
    bool text = true;
    for (size_t i = 0; i < head.size() && text;) {
      const uint8_t c = head[i];
      if (c < 0x80) {
        text = c >= 0x20 ? c != 0x7f : (c >= 0x09 && c <= 0x0d);
        ++i;
        continue;
      }
      // A UTF-8 sequence: its length from the lead byte, continuation bytes 10xxxxxx (one cut
      // by the sample's end is taken as text).
      const size_t n = c >= 0xf5 ? 0 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
      text = n > 0;
      for (size_t k = 1; k < n && text && i + k < head.size(); ++k)
        text = (head[i + k] & 0xc0) == 0x80;
      i += std::max<size_t>(n, 1);
    }
    if (text)
      return InvalidArgumentError(
          "the token file '" + f.path + "' looks like text, not token ids (its first " +
          std::to_string(head.size()) +
          " bytes are UTF-8 text): train on a text file with --text FILE (its bytes are the "
          "tokens), or tokenize it first (docs/data.md)");
  }
  if (f.count < 128 || f.bytes % 4 != 0) return Status::OK();  // (odd: refused by the caller)
  // (The upper halves of ids below the vocabulary: 0, or up to 1 for Llama 3's 128256, the
  // vocabularies 32-bit ids are written for.)
  const uint32_t top = static_cast<uint32_t>(std::max(vocab, 1) - 1) >> 16;
  const size_t n = std::min<size_t>(head.size() / 2, 65536);
  bool upper_small = true, lower_nonzero = false;
  for (size_t i = 0; i + 1 < n && upper_small; i += 2) {
    uint16_t lo = 0, hi = 0;
    std::memcpy(&lo, &head[2 * i], 2);
    std::memcpy(&hi, &head[2 * i + 2], 2);
    upper_small = hi <= top;
    lower_nonzero = lower_nonzero || lo != 0;
  }
  if (!upper_small || !lower_nonzero) return Status::OK();
  return InvalidArgumentError(
      "the token file '" + f.path +
      "' looks like 32-bit token ids: raw token files are uint16, and every second 16-bit "
      "value of its first " +
      std::to_string(n) +
      " is what the upper half of an id below the vocabulary would be (a 16-bit file whose "
      "every second id is 0 looks the same). Write the ids as uint16 (`ids.astype(np.uint16)`, "
      "for ids below 65536), or as an llm.c Llama 3 shard: a header of 256 int32 (magic "
      "20240801, version 7, the token count), then the uint32 ids (docs/data.md)");
}

StatusOr<std::unique_ptr<TokenShards>> TokenShards::Open(const std::string& pattern, int vocab,
                                                         uint64_t min_tokens, uint64_t scan_at_open,
                                                         bool vocab_fixed) {
  if (pattern.empty()) return InvalidArgumentError("data kind 'tokens' needs a path (--data)");
  if (pattern.back() == '/')
    return InvalidArgumentError("--data '" + pattern +
                                "' ends in '/': name a token file, or a glob of them "
                                "(\"shards/*.bin\"), without the trailing slash");
  std::vector<std::string> paths;
  glob_t g{};
  // A path that exists is that file, brackets and all ("shard[1].bin"); else a glob.
  struct stat named {};
  const bool literal = ::stat(pattern.c_str(), &named) == 0;
  // (glob's error callback takes no context: the first error is kept in a thread's own.)
  static thread_local std::pair<std::string, int> glob_error;
  glob_error = {"", 0};
  auto on_error = [](const char* at, int err) {
    if (glob_error.second == 0) glob_error = {at, err};
    return 1;
  };
  const int rc = literal ? 0 : ::glob(pattern.c_str(), GLOB_ERR, on_error, &g);
  if (literal) paths.push_back(pattern);
  if (rc == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && paths.empty()))
    return NotFoundError("no token file matches '" + pattern + "' (--data)");
  if (rc == GLOB_ABORTED && (glob_error.second == ENOENT || glob_error.second == ENOTDIR))
    return NotFoundError("no token file matches '" + pattern + "' (--data): the directory '" +
                         glob_error.first + "' does not exist");
  if (rc == GLOB_ABORTED)
    return ErrnoStatus("listing the token files of '" + pattern +
                           "' (--data): reading the "
                           "directory '" +
                           glob_error.first + "'",
                       glob_error.second);
  if (rc != 0) return IoError("listing the token files of '" + pattern + "' failed");
  std::sort(paths.begin(), paths.end());

  std::unique_ptr<TokenShards> s(new TokenShards());
  s->pattern_ = pattern;
  s->vocab_ = vocab;
  s->vocab_fixed_ = vocab_fixed;
  uint64_t scanned = 0;  // bytes whose ids were checked (scan_at_open)
  for (const std::string& path : paths) {
    File f;
    f.path = path;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE))
      return ErrnoStatus("cannot open the token file '" + path + "' (" +
                             std::to_string(paths.size()) +
                             " files match, each kept open: raise the limit of open files, "
                             "`ulimit -n`, or join shards)",
                         errno);
    if (fd < 0) {
      const int err = errno;
      struct stat sst {};
      if (err == ENXIO && ::stat(path.c_str(), &sst) == 0 && S_ISSOCK(sst.st_mode))
        return InvalidArgumentError("the token file '" + path + "' is a socket, not a file");
      return ErrnoStatus("cannot open the token file '" + path + "'", err);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return InvalidArgumentError("the token file '" + path + "' is " + FileKindName(st.st_mode) +
                                  ", not a regular file (token files are read by position)");
    }
    const uint64_t bytes = static_cast<uint64_t>(st.st_size);
    if (bytes > kMaxTokenFileBytes) {
      ::close(fd);
      return InvalidArgumentError("the token file '" + path + "' is " + std::to_string(bytes) +
                                  " bytes; a token file is at most 2^40 bytes (split it)");
    }
    if (bytes < 2) {
      ::close(fd);
      return InvalidArgumentError("the token file '" + path + "' holds no token");
    }
    // Blocking reads from here (O_NONBLOCK only kept a FIFO from stalling the open).
    const int fl = ::fcntl(fd, F_GETFL);
    if (fl >= 0) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    f.fd = fd;
    f.bytes = bytes;
    f.dev = static_cast<uint64_t>(st.st_dev);
    f.ino = static_cast<uint64_t>(st.st_ino);
    f.mtime_ns = MtimeNs(st);
    s->files_.push_back(f);  // closed by the destructor from here on
    File& file = s->files_.back();
    int32_t header[3] = {0, 0, 0};
    if (bytes >= kShardHeaderBytes && !ReadExactly(fd, 0, header, sizeof header))
      return IoError("reading the token file '" + path + "' failed");
    // A shard cut short inside its header: raw tokens to the size test below, which read the
    // header's bytes as tokens (hunt 46). Its magic says what it is.
    if (bytes < kShardHeaderBytes && bytes >= 4) {
      if (!ReadExactly(fd, 0, header, 4))
        return IoError("reading the token file '" + path + "' failed");
      if (header[0] == kShardMagic || header[0] == kShard32Magic)
        return InvalidArgumentError("the token file '" + path +
                                    "' is an llm.c shard cut short: " + std::to_string(bytes) +
                                    " bytes, inside its " + std::to_string(kShardHeaderBytes) +
                                    "-byte header (truncated?)");
    }
    if (header[0] == kShardMagic || header[0] == kShard32Magic) {
      const bool wide = header[0] == kShard32Magic;
      const int32_t version = wide ? kShard32Version : kShardVersion;
      if (header[1] != version)
        return InvalidArgumentError(
            "the token file '" + path + "' is an llm.c " + (wide ? "Llama 3" : "GPT-2") +
            " shard (magic " + std::to_string(header[0]) + ") of version " +
            std::to_string(header[1]) + "; version " + std::to_string(version) + " (" +
            (wide ? "uint32" : "uint16") + " tokens) reads");
      file.width = wide ? 4 : 2;
      const uint64_t want =
          kShardHeaderBytes + file.width * static_cast<uint64_t>(std::max(header[2], 0));
      if (header[2] <= 0)
        return InvalidArgumentError(
            "the token file '" + path + "' is an llm.c shard whose header says " +
            std::to_string(header[2]) + " tokens: a shard holds at least one (damaged?)");
      if (want != bytes)
        return InvalidArgumentError("the token file '" + path +
                                    "' is an llm.c shard whose header says " +
                                    std::to_string(header[2]) + " tokens (" + std::to_string(want) +
                                    " bytes) but it is " + std::to_string(bytes) + " bytes" +
                                    (bytes < want ? " (truncated?)"
                                                  : " (bytes after its tokens: not a shard "
                                                    "llm.c wrote, or two files joined?)"));
      file.shard = true;
      file.offset = kShardHeaderBytes;
      file.count = static_cast<uint64_t>(header[2]);
    } else {
      // (What it is said first, whatever its size: a text file's is as often odd as not.)
      file.count = bytes / 2;
      TZ_RETURN_IF_ERROR(RefuseNotRawTokens(file, vocab));
      if (bytes % 2 != 0)
        return InvalidArgumentError(
            "the token file '" + path +
            "' is neither an llm.c shard (its "
            "first int32 is neither 20240520 nor 20240801) nor raw uint16 tokens (its size, " +
            std::to_string(bytes) + " bytes, is odd)");
    }
    // Every id inside the vocabulary (Note [Token splits]): the first scan_at_open bytes here,
    // read sequentially (a second or so per few GB), and each window as it is read.
    if (s->Checked(file)) {
      std::vector<int32_t> chunk(1 << 20);
      for (uint64_t first = 0; first < file.count && scanned < scan_at_open;
           first += chunk.size()) {
        const uint64_t n =
            std::min<uint64_t>({chunk.size(), file.count - first,
                                (scan_at_open - scanned + file.width - 1) / file.width});
        TZ_RETURN_IF_ERROR(s->Read(file, first, n, chunk.data()));
        TZ_RETURN_IF_ERROR(s->CheckIds(file, first, n, chunk.data(), /*at_open=*/true));
        scanned += file.width * n;
      }
    }
  }
  // Note [Token splits]
  // One file under two names (a hard link, a symbolic one: the Hugging Face cache links a
  // snapshot's files to shared blobs) as the validation file and a training one: the run
  // validated on what it trained on, its validation loss a training loss, without a word (hunt
  // 52). Refused for a run; an evaluation (min_tokens 0) scores what it is given.
  if (min_tokens > 0 && s->files_.size() > 1) {
    const File& val = s->files_.back();
    for (size_t i = 0; i + 1 < s->files_.size(); ++i) {
      const File& f = s->files_[i];
      if (f.dev == val.dev && f.ino == val.ino)
        return InvalidArgumentError(
            "the token files '" + f.path + "' and '" + val.path + "' are one file (a link): '" +
            val.path +
            "', the last in sorted order, validates and the others train, so the run "
            "would validate on what it trains on; give the validation shard a file of its own");
    }
  }
  for (size_t i = 0; i < s->files_.size(); ++i) s->all_.push_back({i, 0, s->files_[i].count});
  if (s->files_.size() > 1) {
    for (size_t i = 0; i + 1 < s->files_.size(); ++i)
      s->train_.push_back({i, 0, s->files_[i].count});
    s->val_.push_back({s->files_.size() - 1, 0, s->files_.back().count});
  } else {
    const uint64_t n = s->files_[0].count, split = n * 9 / 10;
    s->train_.push_back({0, 0, split});
    s->val_.push_back({0, split, n});
  }
  for (bool validation : {false, true}) {
    if (min_tokens == 0) break;  // windows of the whole files only (`tierzero eval`)
    uint64_t longest = 0;
    for (const Span& sp : s->split(validation)) longest = std::max(longest, sp.end - sp.begin);
    if (longest < min_tokens)
      return InvalidArgumentError(
          "the " + std::string(validation ? "validation" : "training") + " split of '" + pattern +
          "' has no run of " + std::to_string(min_tokens) + " tokens (seq_len + 1); " +
          (s->files_.size() > 1 ? "the last file validates, the others train"
                                : "one file: its first 90% trains, its last 10% validates"));
  }
  s->fingerprint_ = s->ComputeFingerprint();
  return s;
}

Status TokenShards::Window(bool validation, uint64_t key, int seq, int32_t* tokens,
                           int32_t* targets) const {
  const uint64_t len = static_cast<uint64_t>(seq) + 1;
  uint64_t starts = 0;
  for (const Span& sp : split(validation))
    starts += sp.end - sp.begin >= len ? sp.end - sp.begin - len + 1 : 0;
  uint64_t at = key % starts;
  for (const Span& sp : split(validation)) {
    const uint64_t here = sp.end - sp.begin >= len ? sp.end - sp.begin - len + 1 : 0;
    if (at >= here) {
      at -= here;
      continue;
    }
    return ReadWindow(files_[sp.file], sp.begin + at, seq, tokens, targets);
  }
  return InternalError("no window in the token split");
}

uint64_t TokenShards::NumEvalWindows(int seq, bool validation) const {
  uint64_t n = 0;
  for (const Span& sp : EvalSpans(validation))
    n += sp.end > sp.begin ? (sp.end - sp.begin - 1) / static_cast<uint64_t>(seq) : 0;
  return n;
}

Status TokenShards::EvalWindow(uint64_t index, int seq, int32_t* tokens, int32_t* targets,
                               bool validation) const {
  for (const Span& sp : EvalSpans(validation)) {
    const uint64_t here =
        sp.end > sp.begin ? (sp.end - sp.begin - 1) / static_cast<uint64_t>(seq) : 0;
    if (index >= here) {
      index -= here;
      continue;
    }
    return ReadWindow(files_[sp.file], sp.begin + index * static_cast<uint64_t>(seq), seq, tokens,
                      targets);
  }
  return InternalError("evaluation window " + std::to_string(index) + " is past the files");
}

Status TokenShards::CheckIds(const File& f, uint64_t first, uint64_t n, const int32_t* ids,
                             bool at_open) const {
  for (uint64_t k = 0; k < n; ++k) {
    if (ids[k] < 0 || ids[k] >= vocab_)
      return InvalidArgumentError(
          "the token file '" + f.path + "' holds token id " +
          std::to_string(static_cast<uint32_t>(ids[k])) + " at position " +
          std::to_string(first + k) + ", outside the model's vocabulary of " +
          std::to_string(vocab_) +
          (at_open && vocab_fixed_
               ? " (the data was tokenized for another vocabulary than the model's, which is "
                 "its own: score data tokenized with the tokenizer the model was trained with)"
           : at_open ? " (the data was tokenized for another vocabulary: set model.vocab (--vocab) "
                       "to the tokenizer's size, or, for a model directory's fixed vocabulary, "
                       "tokenize the data with its own tokenizer)"
                     : " (found as the run read it: the file was changed under the run, or, "
                       "past the part checked when the files opened, the data was tokenized for "
                       "another vocabulary or is damaged there)"));
  }
  return Status::OK();
}

Status TokenShards::ReadWindow(const File& f, uint64_t first, int seq, int32_t* tokens,
                               int32_t* targets) const {
  std::vector<int32_t> w(static_cast<size_t>(seq) + 1);
  TZ_RETURN_IF_ERROR(Read(f, first, w.size(), w.data()));
  if (Checked(f)) TZ_RETURN_IF_ERROR(CheckIds(f, first, w.size(), w.data(), /*at_open=*/false));
  std::copy(w.begin(), w.end() - 1, tokens);
  std::copy(w.begin() + 1, w.end(), targets);
  return Status::OK();
}

uint64_t TokenShards::tokens() const {
  uint64_t n = 0;
  for (const File& f : files_) n += f.count;
  return n;
}

uint64_t TokenShards::split_tokens(bool validation) const {
  uint64_t n = 0;
  for (const Span& sp : split(validation)) n += sp.end - sp.begin;
  return n;
}

uint64_t TokenShards::ComputeFingerprint() const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  };
  std::vector<uint8_t> buf(size_t{64} << 10);
  for (const File& f : files_) {
    const uint64_t size = f.bytes;
    mix(&size, sizeof size);
    for (const uint64_t at : {uint64_t{0}, size > buf.size() ? size - buf.size() : uint64_t{0}}) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - at));
      const ssize_t got = ::pread(f.fd, buf.data(), want, static_cast<off_t>(at));
      if (got > 0) mix(buf.data(), static_cast<size_t>(got));
    }
  }
  return h;
}

std::string TokenShards::DescribeValidation() const {
  const std::string n = " (" + std::to_string(split_tokens(true)) + " tokens)";
  return files_.size() > 1 ? "the last file, '" + files_.back().path + "'" + n
                           : "the last 10% of '" + files_[0].path + "'" + n;
}

std::string TokenShards::Describe(bool split) const {
  auto all = [&](auto pred) { return std::all_of(files_.begin(), files_.end(), pred); };
  const bool shards = all([](const File& f) { return f.shard; });
  const bool narrow = all([](const File& f) { return f.width == 2; });
  const bool wide = all([](const File& f) { return f.width == 4; });
  const std::string kind = shards ? (wide     ? ", llm.c Llama 3 shards (uint32)"
                                     : narrow ? ", llm.c shards"
                                              : ", llm.c shards (uint16 and uint32)")
                                  : (narrow ? ", uint16" : ", uint16 and uint32");
  return "tokens '" + pattern_ + "' (" + std::to_string(files_.size()) + " file" +
         (files_.size() == 1 ? "" : "s") + kind + ": " +
         (split ? std::to_string(split_tokens(false)) + " tokens train, " +
                      std::to_string(split_tokens(true)) + " validate"
                : std::to_string(tokens()) + " tokens") +
         // 16-bit files cannot hold a larger vocabulary's upper ids (a tokenizer writing them
         // wrapped them modulo 65536: the data is not that tokenizer's).
         (vocab_ > 65536 && !wide
              ? "; 16-bit ids" + std::string(narrow ? "" : " in the uint16 files") +
                    ": the vocabulary's tokens 65536.." + std::to_string(vocab_ - 1) +
                    " cannot appear"
              : std::string()) +
         ")";
}

}  // namespace tierzero::gpt

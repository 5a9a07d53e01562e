// A small mutation driver for the fuzz targets when they are not built with libFuzzer (GCC
// builds, the ASan preset, CI): it replays the seed corpus and the kept regression inputs, then
// runs a bounded number of mutated inputs, deterministic for a given --seed. See
// tests/fuzz/README.md. With TZ_FUZZ (clang) the same targets link libFuzzer instead, which
// adds coverage guidance; this driver is the floor that runs everywhere.
//
//   fuzz_manifest [--runs N] [--seconds S] [--seed K] [--timeout S] [--max-len B] PATH...
//
// PATHs are files or directories of inputs. A crash, abort, sanitizer report or an input that
// runs longer than --timeout leaves that input in fuzz-crash-<target>-<pid>.bin (in
// $TZ_FUZZ_ARTIFACTS, else the working directory) and ends the process with a failure.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));
extern "C" void __sanitizer_set_death_callback(void (*)(void)) __attribute__((weak));

namespace {

namespace fs = std::filesystem;

// The input being run, for the crash handlers (written with write(2) only).
std::vector<uint8_t> g_current;
char g_artifact[4096];
volatile sig_atomic_t g_saved = 0;

void SaveCurrent() {
  if (g_saved) return;
  g_saved = 1;
  const int fd = ::open(g_artifact, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    size_t off = 0;
    while (off < g_current.size()) {
      const ssize_t w = ::write(fd, g_current.data() + off, g_current.size() - off);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    ::close(fd);
  }
  const char msg[] = "\nfuzz driver: the failing input is in ";
  (void)!::write(2, msg, sizeof msg - 1);
  (void)!::write(2, g_artifact, std::strlen(g_artifact));
  (void)!::write(2, "\n", 1);
}

// The handlers these replaced (a sanitizer's, which prints the report): put back after saving.
struct sigaction g_previous[NSIG];

void OnCrash(int sig) {
  SaveCurrent();
  sigaction(sig, &g_previous[sig], nullptr);
  // A fault happens again when this returns, now under the previous handler with its real
  // address; abort() and the like are raised again.
  if (sig != SIGSEGV && sig != SIGBUS && sig != SIGILL && sig != SIGFPE) std::raise(sig);
}

void OnTimeout(int) {
  const char msg[] = "\nfuzz driver: an input ran past --timeout (a hang)\n";
  (void)!::write(2, msg, sizeof msg - 1);
  SaveCurrent();
  ::_exit(70);
}

// Tokens that tend to break parsers of JSON, numbers and sizes.
const char* const kTokens[] = {"{",
                               "}",
                               "[",
                               "]",
                               "\"",
                               ":",
                               ",",
                               "null",
                               "true",
                               "false",
                               "-",
                               "-1",
                               "0",
                               "1",
                               "1e400",
                               "-1e400",
                               "1e-400",
                               "NaN",
                               "Infinity",
                               "18446744073709551615",
                               "18446744073709551616",
                               "9223372036854775807",
                               "-9223372036854775808",
                               "4294967295",
                               "4294967296",
                               "2147483648",
                               "1.5",
                               "\"\"",
                               "\\u0000",
                               "\\ud800",
                               "\\",
                               "\xff",
                               "\xc3\x28",
                               "\n",
                               "\r\n",
                               " ",
                               "/",
                               "../",
                               "KiB",
                               "MiB",
                               "GiB",
                               "TiB",
                               "e",
                               ".",
                               "{}",
                               "[]",
                               "\"a\":",
                               "\0"};

class Mutator {
 public:
  Mutator(uint64_t seed, size_t max_len) : rng_(seed), max_len_(max_len) {}

  std::vector<uint8_t> Mutate(const std::vector<uint8_t>& in,
                              const std::vector<std::vector<uint8_t>>& pool) {
    std::vector<uint8_t> s = in;
    const int ops = 1 + static_cast<int>(Below(8));
    for (int i = 0; i < ops; ++i) One(s, pool);
    if (s.size() > max_len_) s.resize(max_len_);
    return s;
  }

 private:
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  void One(std::vector<uint8_t>& s, const std::vector<std::vector<uint8_t>>& pool) {
    const size_t at = static_cast<size_t>(Below(s.size() + 1));
    switch (Below(8)) {
      case 0:  // flip a bit
        if (!s.empty()) s[at % s.size()] ^= static_cast<uint8_t>(1u << Below(8));
        break;
      case 1:  // a random byte
        if (!s.empty()) s[at % s.size()] = static_cast<uint8_t>(rng_());
        break;
      case 2:  // insert a random byte
        s.insert(s.begin() + static_cast<std::ptrdiff_t>(at), static_cast<uint8_t>(rng_()));
        break;
      case 3: {  // erase a range
        if (s.empty()) break;
        const size_t n =
            1 + static_cast<size_t>(Below(std::min<size_t>(s.size() - at % s.size(), 16)));
        const size_t b = at % s.size();
        s.erase(s.begin() + static_cast<std::ptrdiff_t>(b),
                s.begin() + static_cast<std::ptrdiff_t>(std::min(s.size(), b + n)));
        break;
      }
      case 4:
      case 5: {  // insert a token, or replace a digit run with one
        const char* t = kTokens[Below(sizeof kTokens / sizeof *kTokens)];
        const size_t len = t[0] == '\0' ? 1 : std::strlen(t);
        size_t b = at, e = at;
        if (Below(2) == 0) {
          while (e < s.size() && (std::isdigit(s[e]) || s[e] == '.' || s[e] == '-')) ++e;
        }
        s.erase(s.begin() + static_cast<std::ptrdiff_t>(b),
                s.begin() + static_cast<std::ptrdiff_t>(e));
        s.insert(s.begin() + static_cast<std::ptrdiff_t>(b), t, t + len);
        break;
      }
      case 6: {  // duplicate a range
        if (s.empty()) break;
        const size_t b = at % s.size();
        const size_t n = 1 + static_cast<size_t>(Below(std::min<size_t>(s.size() - b, 64)));
        std::vector<uint8_t> piece(s.begin() + static_cast<std::ptrdiff_t>(b),
                                   s.begin() + static_cast<std::ptrdiff_t>(b + n));
        const size_t to = static_cast<size_t>(Below(s.size() + 1));
        s.insert(s.begin() + static_cast<std::ptrdiff_t>(to), piece.begin(), piece.end());
        break;
      }
      default: {  // splice in part of another input
        if (pool.empty()) break;
        const auto& o = pool[Below(pool.size())];
        if (o.empty()) break;
        const size_t b = static_cast<size_t>(Below(o.size()));
        const size_t n = 1 + static_cast<size_t>(Below(std::min<size_t>(o.size() - b, 256)));
        s.insert(s.begin() + static_cast<std::ptrdiff_t>(at),
                 o.begin() + static_cast<std::ptrdiff_t>(b),
                 o.begin() + static_cast<std::ptrdiff_t>(b + n));
        break;
      }
    }
  }

  std::mt19937_64 rng_;
  size_t max_len_;
};

std::vector<uint8_t> ReadBytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  return {s.begin(), s.end()};
}

void Run(const std::vector<uint8_t>& input, unsigned timeout_s) {
  g_current = input;
  ::alarm(timeout_s);
  LLVMFuzzerTestOneInput(g_current.data(), g_current.size());
  ::alarm(0);
}

int Usage() {
  std::fprintf(stderr,
               "usage: %s [--runs N] [--seconds S] [--seed K] [--timeout S] [--max-len B] "
               "PATH...\n",
               program_invocation_short_name);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  uint64_t runs = 0, seed = 1;
  double seconds = 0;
  unsigned timeout_s = 30;
  size_t max_len = 64 << 10;
  std::vector<fs::path> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--runs" && (v = next())) {
      runs = std::strtoull(v, nullptr, 10);
    } else if (a == "--seconds" && (v = next())) {
      seconds = std::strtod(v, nullptr);
    } else if (a == "--seed" && (v = next())) {
      seed = std::strtoull(v, nullptr, 10);
    } else if (a == "--timeout" && (v = next())) {
      timeout_s = static_cast<unsigned>(std::strtoul(v, nullptr, 10));
    } else if (a == "--max-len" && (v = next())) {
      max_len = std::strtoull(v, nullptr, 10);
    } else if (!a.empty() && a[0] != '-') {
      paths.emplace_back(a);
    } else {
      return Usage();
    }
  }
  const char* dir = std::getenv("TZ_FUZZ_ARTIFACTS");
  std::snprintf(g_artifact, sizeof g_artifact, "%s/fuzz-crash-%s-%d.bin", dir ? dir : ".",
                program_invocation_short_name, static_cast<int>(::getpid()));
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) {
    struct sigaction sa {};
    sa.sa_handler = OnCrash;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, &g_previous[sig]);
  }
  std::signal(SIGALRM, OnTimeout);
  if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(SaveCurrent);

  std::vector<std::vector<uint8_t>> pool;
  for (const fs::path& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(p, ec))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());  // the same order, so the same mutations
      for (const fs::path& f : files) pool.push_back(ReadBytes(f));
    } else if (fs::is_regular_file(p, ec)) {
      pool.push_back(ReadBytes(p));
    } else {
      std::fprintf(stderr, "fuzz driver: no such input %s\n", p.c_str());
      return 2;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  for (const auto& in : pool) Run(in, timeout_s);
  const size_t replayed = pool.size();
  if (pool.empty()) pool.push_back({});
  Mutator mutator(seed, max_len);
  uint64_t done = 0;
  for (; done < runs; ++done) {
    if (seconds > 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds)
      break;
    const auto& base = pool[done % pool.size()];
    std::vector<uint8_t> m = mutator.Mutate(base, pool);
    Run(m, timeout_s);
    // Every 16th mutated input joins the pool, so mutations compound over a run.
    if (done % 16 == 0 && pool.size() < 4096) pool.push_back(std::move(m));
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: replayed %zu inputs, ran %llu mutated inputs in %.1f s: no crash, no hang\n",
              program_invocation_short_name, replayed, static_cast<unsigned long long>(done), took);
  return 0;
}

// tierzero: the command-line front end.
//
// Commands available in this build:
//   tierzero train       train the built-in GPT (apps/tierzero/train.h, docs/config.md)
//   tierzero plan        predict a run: fit, memory per tier, bytes per link, step time (plan.h)
//   tierzero export      a checkpoint to a consolidated safetensors file
//   tierzero eval        a model's mean next-token loss over token files
//   tierzero report      a memory placement report to HTML and a Chrome trace, and its summary
//   tierzero devices     what tierzero can run on here: CPU SIMD level, CUDA GPUs, HostSim
//   tierzero tunables    every TZ_* environment tunable with its value and default
//   tierzero --help | --version
#include <fcntl.h>
#include <oneapi/tbb/global_control.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "gpt/backend.h"
#include "plan.h"
#include "report.h"
#include "signals.h"
#include "tierzero/bytes.h"
#include "tierzero/devices.h"
#include "tierzero/tunables.h"
#include "train.h"

namespace tierzero {
namespace {

constexpr const char* kUsage = R"(tierzero — train models far larger than GPU memory

usage: tierzero <command> [options]

commands:
  train       train the built-in GPT (no arguments: the default run; train --help for options)
  plan        predict a run before it starts: will it fit, memory per tier, step time
  export      write a checkpoint as one safetensors file (export --help)
  eval        a model's loss and perplexity over token files (eval --help)
  report      summarise a memory report; write its HTML page and Chrome trace (report --help)
  devices     show what tierzero can run on here (CPU SIMD level, CUDA GPUs, host-simulated device)
  tunables    list the TZ_* environment tunables with their current values and defaults

options:
  -h, --help     show this help
  --version      print the version
  (a command's options take their value as --name VALUE or --name=VALUE)

environment:
  TZ_LOG_LEVEL   error|warn|info|debug|trace (default warn)
  TZ_LOG_SUBSYS  comma list of subsystems to log, or ^list to exclude (default all)
  TZ_SIMD        force a CPU SIMD path: auto|scalar|avx2|avx512 (default auto)

exit status:
  0      done; also a run that a signal stopped after its checkpoint was saved
  1      an error: the message says what was wrong and what to do
  2      the command cannot run as asked: an unknown command, a TZ_* tunable that cannot be
         used, or export, eval or report started by mpirun
  128+N  signal N ended the process before its run began, or a second signal 3 s after the first
)";

int Devices() {
  auto listing = ListDevices();
  if (!listing.ok()) {
    std::fprintf(stderr, "error: %s\n", listing.status().ToString().c_str());
    return 1;
  }
  const CpuInfo& cpu = listing->cpu;
  std::printf("CPU SIMD: detected %s, active %s (avx2=%d avx512=%d avx512_bf16=%d)\n",
              SimdLevelName(cpu.detected).data(), SimdLevelName(cpu.active).data(), cpu.avx2,
              cpu.avx512, cpu.avx512_bf16);
  std::printf("CUDA GPUs: %zu\n", listing->gpus.size());
  for (const GpuInfo& g : listing->gpus) {
    if (g.problem.empty()) {
      std::printf("  [%d] %s\n", g.ordinal, g.name.c_str());
    } else {
      std::printf("  [%d] unusable: %s\n", g.ordinal, g.problem.c_str());
    }
  }
  if (listing->gpus.empty()) std::printf("  (%s)\n", listing->no_gpu_reason.c_str());
  // (Its capacity is each run's: the library's own default, which a run never has, was shown as
  // the default: figures hunt 47.)
  std::printf(
      "HostSim device: available (each run's capacity: engine.device_budget + "
      "device_shard_budget + a margin of four chunks and 1 MiB, in host memory)\n");
  const HostMemory m = ReadHostMemory();
  std::printf("Host memory: %s physical, %s available now", FormatBytes(m.physical).c_str(),
              FormatBytes(m.available).c_str());
  if (m.limit < m.physical)
    std::printf("; this process may use %s (%s)", FormatBytes(m.limit).c_str(),
                m.limit_source.c_str());
  std::printf("\n");
  return 0;
}

int Tunables() {
  std::vector<TunableInfo> all = ListTunables();
  for (TunableInfo& t : gpt::GptTunables()) all.push_back(std::move(t));  // (their note)
  for (const TunableInfo& t : all) {
    std::printf("%-28s = %-12s (default %s)\n    %s\n", t.name.c_str(), t.value.c_str(),
                t.default_value.c_str(), t.help.c_str());
  }
  return 0;
}

// A command whose result is what it prints (a plan, a loss, a summary): a result that could not
// be written (stdout redirected to a full disk, or /dev/full) fails the command, so `tierzero
// eval ... > loss.txt && next` does not go on with an empty file. A pipe whose reader has gone
// (`| head -3`) is the reader's choice, not an error.
int ResultWritten(int rc) {
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return rc;
  struct stat st {};
  if (::fstat(STDOUT_FILENO, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode))) return rc;
  std::fprintf(stderr,
               "error: the result could not be written to standard output (a full disk, or a "
               "file that takes no writes?): it is lost; write it where there is room\n");
  return rc == 0 ? 1 : rc;
}

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  std::string_view cmd = argv[1];
  // (The help and the version are results too: lost on a full disk, they were exit 0.)
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::fputs(kUsage, stdout);
    return ResultWritten(0);
  }
  if (cmd == "--version") {
    std::printf("tierzero %s\n", TZ_VERSION);
    return ResultWritten(0);
  }
  Status tunables = ValidateTunables();
  if (Status gpt = gpt::ValidateGptTunables(); !gpt.ok())
    tunables = tunables.ok() ? gpt
                             : InvalidArgumentError(std::string(tunables.message()) + "; " +
                                                    std::string(gpt.message()));
  if (Status st = tunables; !st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.ToString().c_str());
    return 2;
  }
  // Note [Options written --name=value]
  // GNU's long-option form, `--lr=3e-4`, as most CLIs take it, is the option and its value
  // (every one was "unknown option '--lr=3e-4'"; hunt 51). Up to a "--", after which arguments
  // are names, not options; split at the first '=', so a value may hold one.
  // An option that takes no value, given one, is said as such (it read "unknown option '1'").
  static const std::set<std::string> kNoValue = {"--quiet",
                                                 "--overwrite",
                                                 "--checkpoint-activations",
                                                 "--no-checkpoint-activations",
                                                 "--no-advice",
                                                 "--calibrate",
                                                 "--largest",
                                                 "--help",
                                                 "--version"};
  std::vector<std::string> rest;
  bool names = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    names = names || a == "--";
    if (!names && a.rfind("--", 0) == 0 && eq != std::string::npos && eq > 2) {
      if (kNoValue.count(a.substr(0, eq)) != 0) {
        std::fprintf(stderr, "error: InvalidArgument: %s takes no value ('%s'): give %s alone\n",
                     a.substr(0, eq).c_str(), a.c_str(), a.substr(0, eq).c_str());
        return 1;
      }
      rest.push_back(a.substr(0, eq));
      rest.push_back(a.substr(eq + 1));
    } else {
      rest.push_back(a);
    }
  }
  // A run's or an export's lines are not its result (its files are); its help is.
  const bool asks_help = std::any_of(
      rest.begin(), rest.end(), [](const std::string& a) { return a == "-h" || a == "--help"; });
  if (cmd == "train") return asks_help ? ResultWritten(app::Train(rest)) : app::Train(rest);
  if (cmd == "export") return asks_help ? ResultWritten(app::Export(rest)) : app::Export(rest);
  if (cmd == "plan") return ResultWritten(app::Plan(rest));
  if (cmd == "eval") return ResultWritten(app::Eval(rest));
  if (cmd == "report") return ResultWritten(app::ReportCommand(rest));
  if (cmd == "devices") return ResultWritten(Devices());
  if (cmd == "tunables") return ResultWritten(Tunables());
  std::fprintf(stderr, "error: unknown command '%s'\n\n%s", argv[1], kUsage);
  return 2;
}

// Note [The process's stack and address space]
// With a small stack limit (`ulimit -s 64`) the main thread's 64 KiB file-read buffer overran its
// stack and the process died of SIGSEGV; under a small address-space limit (`ulimit -v 150000`)
// the allocator crashed inside OpenMP's start (jemalloc could not map a thread's arena). Neither
// was a message. So before any thread starts, the soft limits are raised toward the hard ones
// (8 MiB of stack, as most systems give; all the address space allowed), threads get stacks of
// at least 8 MiB whatever the limit the C library sized its default from, and a process whose
// hard limits stay under what tierzero needs (a 1 MiB stack, 1 GiB of address space) is refused
// with what to raise.
Status FitProcessLimits() {
  constexpr rlim_t kStack = rlim_t{8} << 20, kLeastStack = rlim_t{1} << 20;
  constexpr rlim_t kLeastAddressSpace = rlim_t{1} << 30;
  if (struct rlimit rl{};
      ::getrlimit(RLIMIT_STACK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < kStack) {
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? kStack : std::min(rl.rlim_max, kStack);
    (void)::setrlimit(RLIMIT_STACK, &rl);
    if (::getrlimit(RLIMIT_STACK, &rl) == 0 && rl.rlim_cur < kLeastStack)
      return FailedPreconditionError(
          "the stack size limit (ulimit -s) is " + FormatBytes(rl.rlim_cur) +
          ", and its hard limit (ulimit -Hs) too: under the 1 MiB tierzero needs, and only root "
          "may raise a hard limit: start tierzero from a shell whose hard limit allows it (a new "
          "login), or ask an administrator (limits.conf)");
  }
  if (pthread_attr_t a; ::pthread_getattr_default_np(&a) == 0) {
    size_t size = 0;
    if (::pthread_attr_getstacksize(&a, &size) == 0 && size < kStack &&
        ::pthread_attr_setstacksize(&a, kStack) == 0)
      (void)::pthread_setattr_default_np(&a);
    ::pthread_attr_destroy(&a);
  }
  // (The open-file limit was raised toward its hard limit before; under 64 a run that trained
  // to its end could not open its checkpoint: hunt 41.)
  if (struct rlimit rl{};
      ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < 64)
    return FailedPreconditionError("the open-file limit is " + std::to_string(rl.rlim_cur) +
                                   " (ulimit -n), under the 64 tierzero needs: raise it (ulimit "
                                   "-n 1024)");
  // (The data segment's limit, `ulimit -d`, counts mapped memory too since Linux 4.7.)
  for (const auto& [resource, flag] : {std::pair{RLIMIT_AS, "-v"}, std::pair{RLIMIT_DATA, "-d"}}) {
    struct rlimit rl {};
    if (::getrlimit(resource, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) continue;
    if (rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      (void)::setrlimit(resource, &rl);
      (void)::getrlimit(resource, &rl);
    }
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < kLeastAddressSpace)
      return FailedPreconditionError((flag[1] == 'v'
                                          ? std::string("the address space is limited to ")
                                          : std::string("the data segment is limited to ")) +
                                     FormatBytes(rl.rlim_cur) + " (ulimit " + flag +
                                     "), under the 1 GiB tierzero needs for its threads, "
                                     "allocator and math libraries: raise it (ulimit " +
                                     flag + " unlimited)");
  }
  return Status::OK();
}

// Note [The stack before the libraries start]
// Under a stack limit of some 16 KiB the process died of SIGSEGV before main, most runs: the
// allocator's initialisation (jemalloc, on libstdc++'s first allocation in its static
// constructors) took more stack than that. Functions in the executable's .preinit_array run
// before any shared library's initialisers, so there the soft limit is raised toward the hard
// one (as FitProcessLimits does later), and a hard limit under what tierzero needs is said with
// write(2) alone (no allocation is possible yet) and the process ends with status 1. What runs
// before even that, the dynamic loader mapping the libraries, is beyond any code of ours: with a
// large environment (which the stack holds too) a limit this small can still fail there.
void FitStackBeforeLibraries(int, char**, char**) {
  constexpr rlim_t kStack = rlim_t{8} << 20, kLeastStack = rlim_t{1} << 20;
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_STACK, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= kStack)
    return;
  rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? kStack : std::min(rl.rlim_max, kStack);
  (void)::setrlimit(RLIMIT_STACK, &rl);
  if (::getrlimit(RLIMIT_STACK, &rl) == 0 && rl.rlim_cur < kLeastStack) {
    static const char kSay[] =
        "error: the stack size limit (ulimit -s) and its hard limit (ulimit -Hs) are under the "
        "1 MiB tierzero needs, and only root may raise a hard limit: start tierzero from a shell "
        "whose hard limit allows it (a new login), or ask an administrator (limits.conf)\n";
    (void)!::write(2, kSay, sizeof kSay - 1);
    ::_exit(1);
  }
}
[[gnu::section(".preinit_array"),
  gnu::used]] void (*const kFitStackFirst)(int, char**, char**) = &FitStackBeforeLibraries;

// Note [Threads within the user's process limit]
// Under a limit on the user's processes and threads (`ulimit -u`, a container's pids limit),
// oneTBB starts its workers in a chain, each from the one before, and a worker that cannot start
// one throws on oneTBB's own thread, where nothing catches it: std::terminate (on a 16-core host
// a 16-thread arena aborted under limits of 3 to 14; review 42). Our own threads catch it
// (Note [An exception on a simulated stream], the update phase's), not oneTBB's. So where such
// a limit is set, before any thread starts, as many threads as the machine has CPUs (and the
// run's own beside them) are started and counted, and oneTBB is held to what started less that
// headroom: it then never asks for a thread the limit refuses (other processes of the user may
// still take theirs meanwhile).
// A container's pids limit (cgroup pids.max) refuses threads the same way, and getrlimit does
// not show it: it is read from the cgroup files (Note [A container's pids limit],
// src/core/host_memory.cc), and either limit set starts the probe.
//
// Note [Threads within the address space]
// Each of oneTBB's workers reserves its stack (thread_stack_size, 4 MiB), address space that a
// limit on it (`ulimit -v`, or `-d`) counts, and a worker that cannot map one throws on oneTBB's
// own thread as above: std::terminate. engine.cpu_threads may ask for more threads than the CPUs
// (up to 4096): 512 under `ulimit -v 2000000` aborted after the step-0 evaluation (hunt 50). So
// under such a limit oneTBB is held to the workers whose stacks take at most an eighth of it;
// the rest is the run's (its budgets are checked against the same limit). Under both limits the
// smaller of the two caps holds, one control said with the limit that set it.
int AddressSpaceThreadCap() {
  uint64_t limit = UINT64_MAX;
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    struct rlimit rl {};
    if (::getrlimit(resource, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
      limit = std::min<uint64_t>(limit, rl.rlim_cur);
  }
  if (limit == UINT64_MAX) return INT_MAX;
  const uint64_t stack =
      tbb::global_control::active_value(tbb::global_control::thread_stack_size) + (64 << 10);
  return static_cast<int>(std::clamp<uint64_t>(limit / 8 / stack + 1, 1, INT_MAX));
}

void FitThreadLimit() {
  // (A limit this high is a distribution's default, not a constraint: no probe.)
  constexpr uint64_t kNoConstraint = uint64_t{1} << 16;
  const int cpus = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // One cap, the smaller of the two notes', and said with the limit that set it.
  int cap = AddressSpaceThreadCap();
  std::string why =
      "this process's address space (ulimit -v or -d) holds the stacks of few threads";
  const auto hold = [&] {
    if (cap == INT_MAX) return;
    static tbb::global_control limit(tbb::global_control::max_allowed_parallelism,
                                     static_cast<size_t>(cap));
    if (cap < cpus)
      std::fprintf(stderr, "note: %s, so the CPU's parallel work runs on %d thread%s\n",
                   why.c_str(), cap, cap == 1 ? "" : "s");
  };
  std::string what;  // the limit that leads to the probe, as the note names it
  if (struct rlimit rl{}; ::getrlimit(RLIMIT_NPROC, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    if (rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      (void)::setrlimit(RLIMIT_NPROC, &rl);
      (void)::getrlimit(RLIMIT_NPROC, &rl);
    }
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < kNoConstraint)
      what = "ulimit -u " + std::to_string(rl.rlim_cur);
  }
  if (const TaskLimit pids = ReadTaskLimit(); !pids.source.empty() && pids.room < kNoConstraint)
    what = (what.empty() ? "" : what + "; ") + "the cgroup's pids limit, " + pids.source + " " +
           std::to_string(pids.limit) + " with " + std::to_string(pids.current) + " taken";
  if (what.empty()) return hold();
  // The run's own threads beside oneTBB's: the signal thread, the simulated device's streams,
  // NVMe completions and io_uring's workers, the update phase and the speculative start. The
  // count tried is more than any arena here takes (CPU Adam's is engine.cpu_threads, which may
  // exceed the CPUs), on small stacks so an address-space limit does not count.
  constexpr int kHeadroom = 12;
  const int want = std::max(256, 2 * cpus) + kHeadroom;
  struct Gate {
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    bool release = false;
  } gate;
  auto wait = [](void* g) -> void* {
    auto* x = static_cast<Gate*>(g);
    pthread_mutex_lock(&x->mu);
    while (!x->release) pthread_cond_wait(&x->cv, &x->mu);
    pthread_mutex_unlock(&x->mu);
    return nullptr;
  };
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 64 << 10);
  std::vector<pthread_t> started;
  for (int i = 0; i < want; ++i) {
    pthread_t t;
    if (pthread_create(&t, &attr, wait, &gate) != 0) break;
    started.push_back(t);
  }
  pthread_attr_destroy(&attr);
  pthread_mutex_lock(&gate.mu);
  gate.release = true;
  pthread_cond_broadcast(&gate.cv);
  pthread_mutex_unlock(&gate.mu);
  for (pthread_t t : started) pthread_join(t, nullptr);
  const int could = static_cast<int>(started.size());
  // (oneTBB counts the calling thread in its parallelism: workers are one fewer.)
  if (const int threads = std::max(1, could - kHeadroom + 1); could < want && threads < cap) {
    cap = threads;
    why = "this process may start few more threads (" + what + "): " + std::to_string(could) +
          " could start";
  }
  hold();
}

}  // namespace
}  // namespace tierzero

int main(int argc, char** argv) {
  // A closed standard descriptor would be the number the next open() gets (a run's lock file, a
  // checkpoint), and what is printed would go there: each points at /dev/null instead.
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int null_fd = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
      if (null_fd >= 0 && null_fd != fd) ::close(null_fd);  // (fd was taken meanwhile)
    }
  }
  // A reader of stdout that goes away (`| head`, `| tee` ended by the same Ctrl-C) must not end a
  // run before it saves: writes to the broken pipe fail with EPIPE instead, and the run goes on
  // without its console (docs/signals.md).
  ::signal(SIGPIPE, SIG_IGN);
  // A file past the process's size limit (`ulimit -f`: a checkpoint, an export, the NVMe swap
  // file) raises SIGXFSZ, whose default ends the process with a core and no word, its temporary
  // left behind. Ignored, the write fails with EFBIG and takes the path of any failed write: an
  // error naming the file, its temporary removed, the last checkpoint as it was.
  ::signal(SIGXFSZ, SIG_IGN);
  // A glob of token shards keeps a descriptor per file (models/gpt/token_data.h), and a data set
  // of a thousand shards meets the usual soft limit of 1024 open files: it is raised toward the
  // hard limit, as `ulimit -n` would (at most 65536).
  if (struct rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    const rlim_t want = rl.rlim_max == RLIM_INFINITY ? 65536 : std::min<rlim_t>(rl.rlim_max, 65536);
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
      rl.rlim_cur = want;
      (void)::setrlimit(RLIMIT_NOFILE, &rl);
    }
  }
  // Note [The process's stack and address space]: before any thread of ours starts.
  if (tierzero::Status s = tierzero::FitProcessLimits(); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  // Note [A reserve for running out] (tierzero/status.h): under the limits just fitted.
  tierzero::InstallMemoryReserve();
  // Note [Threads within the user's process limit]: before any other thread starts.
  tierzero::FitThreadLimit();
  // First, before any thread exists (Note [Signals on one thread of ours], signals.h).
  if (tierzero::Status s = tierzero::app::StartSignalThread(); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  // Note [The last net under exceptions]
  // Errors are Statuses; an exception escaping to here is a bug or memory the system would not
  // give (std::bad_alloc: a host array sized by an input no check bounded), or a thread it would
  // not start (StatusOfCurrentException, tierzero/status.h; train turns those of its set-up and
  // steps into its own failure first, Guarded, so what it made is removed as for any error). It
  // ends the command with an error line and status 1, not std::terminate's abort. (The run's
  // outputs are what their own atomic writes left: a temporary file is never under a final name.)
  try {
    return tierzero::Main(argc, argv);
  } catch (...) {
    return tierzero::app::FailUncaught(tierzero::StatusOfCurrentException());
  }
}

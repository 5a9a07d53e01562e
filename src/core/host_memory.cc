#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <optional>
#include <sstream>
#include <vector>

#include "tierzero/devices.h"

namespace tierzero {

// Note [The memory a process may use]
// A machine's physical memory is not what a process may hold when a cgroup limits it: a
// container (`docker run --memory`), a Kubernetes pod's limit, a Slurm job's cgroup. Over that
// limit the kernel's OOM killer ends the process with SIGKILL: no message, no save (a run whose
// host budget let its placement put 1.8 GB of states in host memory under a 1 GiB limit died
// so in set-up, exit 137, with nothing printed). So the budgets sized to the machine take the
// limit, not MemTotal, and Finalize refuses a placement whose host memory alone is over it
// (Note [Host memory within the process's limit], src/engine/setup.cc).
// Where the limit is read: /proc/self/cgroup names this process's cgroup in each hierarchy
// (v2's "0::/path"; v1's "N:memory,...:/path"), /proc/self/mountinfo where each hierarchy is
// mounted and which cgroup its mount shows as its root (a container with its own cgroup
// namespace sees "/" both ways; one without sees its host's path under a mount of its own
// cgroup). From that directory up to the mount, the smallest of memory.max (v2: "max" for
// none) and memory.limit_in_bytes (v1: about 2^63 for none) is the limit. Swap is left out:
// beyond the limit a job with swap pages its optimizer states out, which is as fatal to a run
// that streams them every step.

namespace {

// A file of /proc or a cgroup's, whole; empty when it cannot be read. Only a regular file is
// read (the kernel's are): under a root given to the library a FIFO would block the open or the
// read, and a link to /dev/zero would never end; and never more than 16 MiB (a host's mountinfo of
// thousands of mounts is a few hundred KiB).
std::string ReadSmall(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) return {};
  struct stat st {};
  std::string out;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    constexpr size_t kMost = size_t{16} << 20;
    char buf[8192];
    while (out.size() < kMost) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      out.append(buf, static_cast<size_t>(n));
    }
    if (out.size() >= kMost) out.clear();  // not such a file: nothing read is trusted
  }
  ::close(fd);
  return out;
}

// A count written in decimal alone ("2147483648", "0", with spaces around it); nothing for
// "max", an empty or unreadable file, and anything else ("1e9", "12abc", -1, a value past 2^64):
// such a value is not a limit, not the limit its first digits spell.
std::optional<uint64_t> ParseCount(const std::string& s) {
  const char* p = s.data();
  const char* end = s.data() + s.size();
  while (p < end && (*p == ' ' || *p == '\t')) ++p;
  uint64_t v = 0;
  const auto [rest, ec] = std::from_chars(p, end, v);
  if (ec != std::errc() || rest == p) return std::nullopt;
  for (const char* q = rest; q < end; ++q)
    if (*q != ' ' && *q != '\t' && *q != '\n') return std::nullopt;
  return v;
}

// A number of bytes, or 0 (none: "max", empty, unreadable, malformed).
uint64_t ParseBytes(const std::string& s) { return ParseCount(s).value_or(0); }

// The value after `key` at the start of a line of a "key value" file (meminfo, memory.stat),
// times `unit`; 0 when absent.
uint64_t Field(const std::string& text, const std::string& key, uint64_t unit) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    const size_t rest = key.size();
    if (rest < line.size() && line[rest] != ' ' && line[rest] != '\t' && line[rest] != ':')
      continue;
    size_t i = rest;
    while (i < line.size() && (line[i] == ':' || line[i] == ' ' || line[i] == '\t')) ++i;
    // meminfo's "16777216 kB" (the unit its caller multiplies by); memory.stat's have none.
    std::istringstream words(line.substr(i));
    std::string count, suffix, more;
    words >> count >> suffix >> more;
    if (!more.empty() || !(suffix.empty() || suffix == "kB")) return 0;
    const uint64_t v = ParseBytes(count);
    return v > std::numeric_limits<uint64_t>::max() / unit ? 0 : v * unit;  // 0: past 2^64 bytes
  }
  return 0;
}

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() &&
        std::isdigit(static_cast<unsigned char>(s[i + 1])) != 0) {
      out += static_cast<char>(std::strtol(s.substr(i + 1, 3).c_str(), nullptr, 8));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

bool IsDir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

struct Hierarchy {
  bool v2 = false;
  std::string dir;    // this process's cgroup directory (root-prefixed)
  std::string mount;  // where the hierarchy is mounted (root-prefixed)
};

// The hierarchies this process is in that hold `controller`'s files: v1's hierarchy of that
// controller ("memory", "pids"), and v2's unified tree.
std::vector<Hierarchy> ControllerHierarchies(const std::string& root,
                                             const std::string& controller) {
  // This process's cgroup path in v2 ("") and in v1's hierarchy of the controller.
  std::string v2_path, v1_path;
  bool has_v2 = false, has_v1 = false;
  {
    std::istringstream in(ReadSmall(root + "/proc/self/cgroup"));
    std::string line;
    while (std::getline(in, line)) {
      const size_t a = line.find(':');
      const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
      if (b == std::string::npos) continue;
      const std::string controllers = line.substr(a + 1, b - a - 1);
      const std::string path = line.substr(b + 1);
      if (controllers.empty()) {
        has_v2 = true;
        v2_path = path;
        continue;
      }
      std::istringstream cs(controllers);
      std::string c;
      while (std::getline(cs, c, ','))
        if (c == controller) has_v1 = true, v1_path = path;
    }
  }
  std::vector<Hierarchy> out;
  std::istringstream in(ReadSmall(root + "/proc/self/mountinfo"));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::vector<std::string> f;
    for (std::string w; ls >> w;) f.push_back(w);
    const auto dash = std::find(f.begin(), f.end(), "-");
    if (f.size() < 5 || dash == f.end() || dash + 1 == f.end()) continue;
    const std::string fstype = *(dash + 1);
    const std::string super = dash + 3 < f.end() ? *(dash + 3) : "";
    bool v2 = false;
    if (fstype == "cgroup2" && has_v2) {
      v2 = true;
    } else if (fstype == "cgroup" && has_v1) {
      bool has = false;
      std::istringstream os(super);
      for (std::string o; std::getline(os, o, ',');) has = has || o == controller;
      if (!has) continue;
    } else {
      continue;
    }
    const std::string mroot = Unescape(f[3]);
    const std::string mount = root + Unescape(f[4]);
    const std::string& path = v2 ? v2_path : v1_path;
    std::string rel;
    if (mroot == "/") {
      rel = path;
    } else if (path.compare(0, mroot.size(), mroot) == 0 &&
               (path.size() == mroot.size() || path[mroot.size()] == '/')) {
      rel = path.substr(mroot.size());
    } else {
      continue;  // this process's cgroup is outside the mount's view: its root is another's
    }
    while (!rel.empty() && rel.back() == '/') rel.pop_back();
    const std::string dir = mount + rel;
    if (!IsDir(dir)) continue;  // (likewise: "/../x" seen from another cgroup namespace)
    out.push_back({v2, dir, mount});
  }
  return out;
}

}  // namespace

HostMemory ReadHostMemory(const std::string& root) {
  HostMemory m;
  const std::string meminfo = ReadSmall(root + "/proc/meminfo");
  m.physical = Field(meminfo, "MemTotal", 1024);
  if (m.physical == 0) {
    m.physical = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) *
                 static_cast<uint64_t>(::sysconf(_SC_PAGE_SIZE));
  }
  m.available = Field(meminfo, "MemAvailable", 1024);
  if (m.available == 0 || m.available > m.physical) m.available = m.physical;
  m.limit = m.physical;
  m.limit_source = "physical memory";
  for (const Hierarchy& h : ControllerHierarchies(root, "memory")) {
    const char* limit_file = h.v2 ? "memory.max" : "memory.limit_in_bytes";
    for (std::string d = h.dir;;) {
      const uint64_t limit = ParseBytes(ReadSmall(d + "/" + limit_file));
      if (limit > 0 && limit < m.limit) {
        m.limit = limit;
        m.limit_source = d.substr(root.size()) + "/" + limit_file;
        m.limit_scope = d.substr(root.size());
        // Its room now: the limit less what the cgroup holds, page cache it can drop aside.
        const uint64_t usage =
            ParseBytes(ReadSmall(d + "/" + (h.v2 ? "memory.current" : "memory.usage_in_bytes")));
        const uint64_t cache =
            Field(ReadSmall(d + "/memory.stat"), h.v2 ? "inactive_file" : "total_inactive_file", 1);
        const uint64_t held = usage > cache ? usage - cache : 0;
        m.available = std::min(m.available, limit > held ? limit - held : 0);
      }
      if (d.size() <= h.mount.size()) break;
      const size_t slash = d.find_last_of('/');
      if (slash == std::string::npos || slash < h.mount.size()) break;
      d.resize(slash);
    }
  }
  m.available = std::min(m.available, m.limit);
  return m;
}

// Note [A container's pids limit]
// A cgroup's pids controller bounds the tasks (processes and threads) of everything in it:
// `docker run --pids-limit`, a Kubernetes pod's pid limit, systemd's TasksMax. Like `ulimit -u`
// it refuses a thread past it, and oneTBB then terminates (Note [Threads within the user's
// process limit], apps/tierzero/main.cc); unlike it, getrlimit does not show it. Read as the
// memory limit is (Note [The memory a process may use]): from this process's cgroup up to the
// mount, the smallest room, pids.max ("max" for none) less pids.current, in v2's tree and v1's
// pids hierarchy.
TaskLimit ReadTaskLimit(const std::string& root) {
  TaskLimit t;
  for (const Hierarchy& h : ControllerHierarchies(root, "pids")) {
    for (std::string d = h.dir;;) {
      // "max": none; "0": no new task at all.
      if (const std::optional<uint64_t> max = ParseCount(ReadSmall(d + "/pids.max")); max) {
        const uint64_t limit = *max;
        const uint64_t current = ParseBytes(ReadSmall(d + "/pids.current"));
        const uint64_t room = limit > current ? limit - current : 0;
        if (t.source.empty() || room < t.room) {
          t.room = room;
          t.limit = limit;
          t.current = current;
          t.source = d.substr(root.size()) + "/pids.max";
        }
      }
      if (d.size() <= h.mount.size()) break;
      const size_t slash = d.find_last_of('/');
      if (slash == std::string::npos || slash < h.mount.size()) break;
      d.resize(slash);
    }
  }
  return t;
}

}  // namespace tierzero

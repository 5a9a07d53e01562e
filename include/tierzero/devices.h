// What the engine can run on here: the CPU's SIMD level (CPU Adam, conversions), the GPUs CUDA
// sees, the simulated device that stands in for one (EngineConfig::device), and the host memory
// this process may use.
// `tierzero devices` prints this.
//
// Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/simd.h"
#include "tierzero/status.h"

namespace tierzero {

struct CpuInfo {
  SimdLevel detected = SimdLevel::kScalar;  // the best level this CPU supports
  SimdLevel active = SimdLevel::kScalar;    // the level kernels use (TZ_SIMD may lower it)
  bool avx2 = false, avx512 = false, avx512_bf16 = false;
};

struct GpuInfo {
  int ordinal = 0;
  std::string name;     // empty when unusable
  std::string problem;  // why the engine cannot use it; empty when usable
};

struct DeviceListing {
  CpuInfo cpu;
  std::vector<GpuInfo> gpus;  // each probed with a small slab
  std::string no_gpu_reason;  // when there is none: no driver, no device, built without CUDA
  uint64_t host_sim_default_capacity = 0;
};

// Probes every GPU (creating a device on each) and the simulated device. An error only when the
// simulated device cannot be created (host memory).
StatusOr<DeviceListing> ListDevices();

// GPUs CUDA sees (0 without a driver, a device, or a build with CUDA), and the free memory of one
// (0 when it is not there). Neither creates a device.
int GpuCount();
uint64_t GpuFreeBytes(int ordinal);

// The host memory this process may use: the machine's, or less where a cgroup limits it (a
// container, a Kubernetes pod, a batch job). Note [The memory a process may use] in
// src/core/host_memory.cc.
struct HostMemory {
  uint64_t physical = 0;  // MemTotal
  // The most this process (with the others in its cgroup) may hold: `physical`, or the smallest
  // memory limit of its cgroup and the cgroups above it where that is lower.
  uint64_t limit = 0;
  // Where `limit` comes from: "physical memory", or the file holding the limit
  // ("/sys/fs/cgroup/job/memory.max").
  std::string limit_source;
  // What could be had now without swapping: MemAvailable, and within the limiting cgroup its
  // limit less what the cgroup holds other than reclaimable page cache.
  uint64_t available = 0;
  // An identity of what `limit` is shared by: the limiting cgroup's directory, or "" for the
  // machine.
  std::string limit_scope;
};

// Reads /proc/meminfo, /proc/self/cgroup, /proc/self/mountinfo and the cgroup files (v1 and v2).
// `root` is prefixed to every path read (tests give a tree of their own). Never fails: what
// cannot be read does not limit (physical memory from sysconf when /proc/meminfo is unreadable).
HostMemory ReadHostMemory(const std::string& root = "");

// The tasks (processes and threads) this process's cgroup may still start: the smallest room,
// pids.max less pids.current, of its cgroup and those above it. Note [A container's pids limit]
// in src/core/host_memory.cc.
struct TaskLimit {
  // "" where no pids limit is set (or none can be read); then `room` and `limit` mean nothing.
  std::string source;    // the limiting file ("/sys/fs/cgroup/pids.max")
  uint64_t limit = 0;    // its pids.max
  uint64_t current = 0;  // its pids.current: the tasks there now (over `limit` once it is lowered)
  uint64_t room = 0;     // pids.max less pids.current there (0 when full)
};
TaskLimit ReadTaskLimit(const std::string& root = "");

}  // namespace tierzero

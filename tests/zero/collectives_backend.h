// What the collectives tests share (collectives_test.cc, collectives_device_test.cc): the backend
// under test (MPI on host buffers, or with TZ_TEST_COMM=nccl the NCCL communicator on one GPU per
// rank), a collective run on its buffers, and the data every rank can compute for every other.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/device_collectives.h"
#include "comm/nccl.h"
#include "comm/quantized.h"
#include "core/convert.h"
#include "kernels/quantize.h"
#include "offload/cuda_device.h"
#include "offload/host_sim_device.h"
#include "tierzero/communicator.h"

namespace tierzero::collectives_test {

inline bool WantNccl() {
  const char* e = std::getenv("TZ_TEST_COMM");
  return e != nullptr && std::string(e) == "nccl";
}

inline std::shared_ptr<Communicator> Mpi() {
  static std::shared_ptr<Communicator> comm = [] {
    auto c = Communicator::Mpi();
    if (!c.ok()) {
      ADD_FAILURE() << c.status().ToString();
      return Communicator::Single();
    }
    return *c;
  }();
  return comm;
}

// The communicator under test, with the GPU and comm stream of the NCCL backend.
struct Backend {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Communicator> boot;  // MPI (or Single alone): NCCL's bootstrap
  std::unique_ptr<Device> gpu;
  Stream stream;
  std::string skip;  // why this backend cannot run here
};

inline Backend& TheBackend() {
  static Backend* b = [] {
    auto* out = new Backend();
    if (!WantNccl()) {
      out->comm = Mpi();
      out->boot = out->comm;
      return out;
    }
    // Alone (no launcher), the one-rank bootstrap: no MPI runtime needed on the GPU machine.
    std::shared_ptr<Communicator> boot =
        std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr
            ? Mpi()
            : Communicator::Single();
    out->boot = boot;
    const Topology t = boot->topology();
    if (CudaDeviceCount() < t.local_size) {
      out->skip = "NCCL needs a GPU per rank: " + std::to_string(t.local_size) +
                  " ranks on this node, " + std::to_string(CudaDeviceCount()) + " GPUs";
      return out;
    }
    CudaDeviceOptions o;
    o.ordinal = t.local_rank;
    o.capacity_bytes = 256ull << 20;
    auto dev = CreateCudaDevice(o);
    if (!dev.ok()) {
      ADD_FAILURE() << dev.status().ToString();
      out->skip = "no CUDA device";
      return out;
    }
    out->gpu = std::move(dev).value();
    auto s = Stream::Create(*out->gpu, "comm");
    if (!s.ok()) {
      ADD_FAILURE() << s.status().ToString();
      out->skip = "no stream";
      return out;
    }
    out->stream = std::move(s).value();
    NcclOptions no;
    no.device = out->gpu.get();
    no.stream = out->stream.handle();
    no.bootstrap = boot;
    no.timeout_s = 120;
    auto c = CreateNcclCommunicator(no);
    if (!c.ok()) {
      ADD_FAILURE() << c.status().ToString();
      out->skip = "no NCCL communicator";
      return out;
    }
    out->comm = *c;
    return out;
  }();
  return *b;
}

#define REQUIRE_BACKEND()                                              \
  do {                                                                 \
    if (!TheBackend().skip.empty()) GTEST_SKIP() << TheBackend().skip; \
  } while (0)

inline Communicator& Comm() { return *TheBackend().comm; }

using Collective = std::function<StatusOr<std::unique_ptr<CommRequest>>(const void*, void*)>;

// Runs `f(send, recv)` on the backend's buffers: the host vectors themselves for MPI; device
// copies of both (recv too, for the in-place collectives) for NCCL, recv copied back after.
// `poll` progresses the request with Test, as a caller overlapping work would.
inline void RunCollective(const std::vector<uint8_t>& send, std::vector<uint8_t>& recv,
                          const Collective& f, bool poll = false) {
  Backend& b = TheBackend();
  auto finish = [&](std::unique_ptr<CommRequest> req) {
    if (poll) {
      for (;;) {
        auto done = req->Test();
        ASSERT_TRUE(done.ok()) << done.status().ToString();
        if (*done) break;
      }
    }
    Status s = req->Wait();
    ASSERT_TRUE(s.ok()) << s.ToString();
  };
  if (!b.gpu) {
    auto req = f(send.data(), recv.data());
    ASSERT_TRUE(req.ok()) << req.status().ToString();
    finish(std::move(req).value());
    return;
  }
  Device& d = *b.gpu;
  auto ds = DeviceBuffer::Allocate(d, std::max<size_t>(send.size(), 1));
  auto dr = DeviceBuffer::Allocate(d, std::max<size_t>(recv.size(), 1));
  ASSERT_TRUE(ds.ok() && dr.ok());
  const StreamHandle h = b.stream.handle();
  ASSERT_TRUE(d.CopyAsync(ds->data(), send.data(), send.size(), CopyKind::kHostToDevice, h).ok());
  ASSERT_TRUE(d.CopyAsync(dr->data(), recv.data(), recv.size(), CopyKind::kHostToDevice, h).ok());
  auto req = f(ds->data(), dr->data());
  ASSERT_TRUE(req.ok()) << req.status().ToString();
  finish(std::move(req).value());
  ASSERT_TRUE(d.CopyAsync(recv.data(), dr->data(), recv.size(), CopyKind::kDeviceToHost, h).ok());
  ASSERT_TRUE(b.stream.Synchronize().ok());
}

// A small integer in [-8, 8] for (rank, block, index).
inline int Value(int rank, int block, size_t i) {
  return static_cast<int>(
             (static_cast<size_t>(rank) * 131 + static_cast<size_t>(block) * 71 + i * 17 + 5) %
             17) -
         8;
}

// `n` elements of dtype holding the values f(i).
template <typename F>
std::vector<uint8_t> Fill(DType dt, size_t n, F f) {
  std::vector<uint8_t> out(DTypeBytes(dt, n));
  for (size_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(f(i));
    switch (dt) {
      case DType::kF32:
        std::memcpy(out.data() + 4 * i, &v, 4);
        break;
      case DType::kBF16: {
        const uint16_t h = F32ToBF16Scalar(v);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t h = F32ToF16Scalar(v);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
      case DType::kI8:
        out[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
        break;
      case DType::kI4:
        out[i / 2] |= static_cast<uint8_t>((static_cast<int>(v) & 0xF) << (4 * (i % 2)));
        break;
    }
  }
  return out;
}

// Equal byte vectors, or which elements of dtype differ (the first few, with their bytes).
inline testing::AssertionResult SameElements(const std::vector<uint8_t>& got,
                                             const std::vector<uint8_t>& want, DType dt) {
  if (got == want) return testing::AssertionSuccess();
  if (got.size() != want.size())
    return testing::AssertionFailure() << got.size() << " bytes, want " << want.size();
  const size_t width = dt == DType::kF32 ? 4 : (dt == DType::kI8 || dt == DType::kI4 ? 1 : 2);
  auto hex = [&](const std::vector<uint8_t>& v, size_t e) {
    std::string s;
    char b[3];
    for (size_t k = width; k-- > 0;) {
      std::snprintf(b, sizeof b, "%02x", v[e * width + k]);
      s += b;
    }
    return s;
  };
  size_t differ = 0;
  auto r = testing::AssertionFailure();
  for (size_t e = 0; e < got.size() / width; ++e) {
    if (std::memcmp(&got[e * width], &want[e * width], width) == 0) continue;
    if (++differ <= 4)
      r << "element " << e << ": 0x" << hex(got, e) << ", want 0x" << hex(want, e) << "; ";
  }
  return r << differ << " of " << got.size() / width << " elements differ";
}

inline const size_t kCounts[] = {1, 7, 1000, 4099, 70001};
inline const DType kAll[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI8, DType::kI4};
inline const DType kFloats[] = {DType::kF32, DType::kBF16, DType::kF16};

}  // namespace tierzero::collectives_test

// nvme_bench: the NVMe tier against fio on the same file, and the swap pipeline's overlap.
//
//   build/bin/nvme_bench [--path=FILE] [--size=1GiB] [--reps=3] [--pairs=9] [--pair-size=256MiB]
//
// 1. Sequential read and write of one extent of --pair-size, cut into 1 MiB or 4 MiB requests
//    with 1, 8 or 32 in flight (O_DIRECT, io_uring), next to fio with the same file, block size,
//    depth, O_DIRECT and engine (io_uring), as --pairs short pairs (tierzero then fio, fio then
//    tierzero, in turn): the ratio tierzero / fio is the median of the pairs' ratios (target
//    >= 0.95 at depth >= 8), each pair's two runs a fraction of a second apart, because this
//    virtual disk's speed drifts by more than the difference measured over longer runs.
// 2. CRC32C: single-thread GB/s, and the store's write+read time with checksums on vs off.
// 3. Swap pipeline: CPU Adam over NVMe-resident p|m|v blocks; time against max(pure I/O, pure
//    Adam) for the same bytes (target <= 1.15).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/bytes.h"
#include "core/check.h"
#include "cpu_adam/cpu_adam.h"
#include "offload/crc32c.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "offload/swapper.h"

namespace tierzero {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Args {
  std::string path = "build/nvme_bench.swap";
  uint64_t size = uint64_t{1} << 30;
  int reps = 3;
  int pairs = 9;
  uint64_t pair_size = uint64_t{256} << 20;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s.rfind("--path=", 0) == 0) {
      a.path = s.substr(7);
    } else if (s.rfind("--size=", 0) == 0) {
      auto v = ParseByteSize(s.substr(7));
      TZ_CHECK(v.ok()) << v.status().ToString();
      a.size = *v;
    } else if (s.rfind("--reps=", 0) == 0) {
      a.reps = std::max(1, std::atoi(s.c_str() + 7));
    } else if (s.rfind("--pairs=", 0) == 0) {
      a.pairs = std::max(1, std::atoi(s.c_str() + 8));
    } else if (s.rfind("--pair-size=", 0) == 0) {
      auto v = ParseByteSize(s.substr(12));
      TZ_CHECK(v.ok()) << v.status().ToString();
      a.pair_size = *v;
    } else {
      std::fprintf(stderr,
                   "usage: nvme_bench [--path=FILE] [--size=1GiB] [--reps=3] [--pairs=9] "
                   "[--pair-size=256MiB]\n");
      std::exit(2);
    }
  }
  return a;
}

void* AlignedAlloc(uint64_t bytes) {
  void* p = std::aligned_alloc(4096, AlignUp(bytes, 4096));
  TZ_CHECK(p != nullptr);
  std::memset(p, 0x5A, AlignUp(bytes, 4096));
  return p;
}

// fio's bandwidth in bytes/s for one sequential job, or a negative value when fio is missing.
double RunFio(const std::string& file, bool write, uint64_t bs, int depth, uint64_t size,
              bool fixed_buffers) {
  std::string cmd = "fio --name=tz --filename=" + file + " --rw=" + (write ? "write" : "read") +
                    " --bs=" + std::to_string(bs) + " --iodepth=" + std::to_string(depth) +
                    " --ioengine=io_uring --direct=1 --size=" + std::to_string(size) +
                    " --numjobs=1 --registerfiles" + (fixed_buffers ? " --fixedbufs" : "") +
                    " --output-format=json 2>/dev/null";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return -1;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  if (::pclose(pipe) != 0) return -1;
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded()) return -1;
  return j["jobs"][0][write ? "write" : "read"]["bw_bytes"].get<double>();
}

void SequentialVsFio(const Args& a) {
  const uint64_t size = std::min(a.size, a.pair_size);
  std::printf("\n== Sequential I/O vs fio (%s, %s per run, %d pairs: medians) ==\n", a.path.c_str(),
              FormatBytes(size).c_str(), a.pairs);
  std::printf("%-6s %6s %5s %6s %12s %12s %7s %15s\n", "op", "block", "depth", "bufs", "tierzero",
              "fio", "ratio", "pairs lo-hi");
  void* buf = AlignedAlloc(size);
  // Both sides register the file; "fixed" also registers the buffer (io_uring fixed buffers,
  // fio --fixedbufs), which on this VM halves the per-request page-pinning cost.
  std::vector<double> deep;  // the ratios at depth >= 8
  for (bool fixed : {false, true}) {
    for (uint64_t bs : {uint64_t{1} << 20, uint64_t{4} << 20}) {
      for (int depth : {1, 8, 32}) {
        NvmeStoreOptions o;
        o.paths = {a.path};
        o.bytes_per_path = size;
        o.block_bytes = bs;
        o.queue_depth = depth;
        o.backend = IoBackend::kIoUring;
        // fio moves bytes only (and rewrites the file behind the store's back, which checksums
        // would rightly report); the CRC cost is measured separately below.
        o.checksums = false;
        auto store = NvmeStore::Open(o);
        TZ_CHECK(store.ok()) << store.status().ToString();
        auto extent = (*store)->Allocate(size);
        TZ_CHECK(extent.ok());
        if (fixed) TZ_CHECK_OK((*store)->RegisterBuffers({{buf, AlignUp(size, 4096)}}));
        TZ_CHECK_OK((*store)->Write(*extent, buf));  // lay the data down once
        for (bool write : {true, false}) {
          std::vector<double> ours, fio, ratio;
          bool have_fio = true;
          for (int r = 0; r < a.pairs && have_fio; ++r) {
            // Alternate who goes first, so neither side always meets the disk right after the
            // other's burst (a VM disk's write-back cache can favour either position).
            double f = r % 2 == 1 ? RunFio(a.path, write, bs, depth, size, fixed) : 0.0;
            auto t0 = Clock::now();
            TZ_CHECK_OK(write ? (*store)->Write(*extent, buf) : (*store)->Read(*extent, buf));
            ours.push_back(size / Seconds(t0, Clock::now()));
            if (r % 2 == 0) f = RunFio(a.path, write, bs, depth, size, fixed);
            have_fio = f > 0;
            fio.push_back(f);
            ratio.push_back(ours.back() / f);
          }
          std::printf("%-6s %4lluMi %5d %6s %7.2f GB/s", write ? "write" : "read",
                      static_cast<unsigned long long>(bs >> 20), depth, fixed ? "fixed" : "plain",
                      Median(ours) / 1e9);
          if (have_fio) {
            const double mr = Median(ratio);
            if (depth >= 8) deep.push_back(mr);
            std::printf(" %7.2f GB/s %7.3f %7.2f-%.2f\n", Median(fio) / 1e9, mr,
                        *std::min_element(ratio.begin(), ratio.end()),
                        *std::max_element(ratio.begin(), ratio.end()));
          } else {
            std::printf("   (fio not found)\n");
          }
        }
      }
    }
  }
  if (!deep.empty()) {
    const auto at_least =
        std::count_if(deep.begin(), deep.end(), [](double r) { return r >= 0.95; });
    std::printf("depth >= 8: median ratio %.3f, %ld of %zu cells >= 0.95\n", Median(deep),
                static_cast<long>(at_least), deep.size());
  }
  std::free(buf);
}

void Checksums(const Args& a) {
  std::printf("\n== CRC32C cost ==\n");
  const uint64_t bytes = std::min<uint64_t>(a.size, 256 << 20);
  void* buf = AlignedAlloc(bytes);
  std::vector<double> crc_s;
  for (int r = 0; r < 5; ++r) {
    auto t0 = Clock::now();
    volatile uint32_t c = Crc32c(buf, bytes);
    (void)c;
    crc_s.push_back(Seconds(t0, Clock::now()));
  }
  std::printf("crc32c: %.2f GB/s on one thread\n", bytes / Median(crc_s) / 1e9);
  for (bool checksums : {false, true, false, true}) {
    NvmeStoreOptions o;
    o.paths = {a.path};
    o.bytes_per_path = bytes;
    o.checksums = checksums;
    auto store = NvmeStore::Open(o);
    TZ_CHECK(store.ok()) << store.status().ToString();
    std::vector<NvmeExtent> extents;
    for (uint64_t off = 0; off < bytes; off += 4 << 20)
      extents.push_back(*(*store)->Allocate(4 << 20));
    auto t0 = Clock::now();
    for (size_t i = 0; i < extents.size(); ++i) {
      TZ_CHECK_OK((*store)->Write(extents[i], static_cast<uint8_t*>(buf) + i * (4 << 20)));
    }
    for (size_t i = 0; i < extents.size(); ++i) {
      TZ_CHECK_OK((*store)->Read(extents[i], static_cast<uint8_t*>(buf) + i * (4 << 20)));
    }
    std::printf("store write+read of %s in 4 MiB extents, checksums %-3s: %.3f s\n",
                FormatBytes(bytes).c_str(), checksums ? "on" : "off", Seconds(t0, Clock::now()));
  }
  std::free(buf);
}

void SwapAdam(const Args& a, bool checksums) {
  std::printf("\n== Swap pipeline: CPU Adam over NVMe-resident states (checksums %s) ==\n",
              checksums ? "on" : "off");
  constexpr uint64_t kBlockParams = 4 << 20;  // 48 MiB of p|m|v per block
  const uint64_t block_bytes = kBlockParams * 12;
  const size_t blocks = std::max<uint64_t>(4, a.size * 2 / block_bytes);
  NvmeStoreOptions o;
  o.paths = {a.path};
  o.bytes_per_path = block_bytes * blocks;
  o.block_bytes = 1 << 20;
  o.queue_depth = 32;
  o.checksums = checksums;
  auto store = NvmeStore::Open(o);
  TZ_CHECK(store.ok()) << store.status().ToString();
  auto arena = PinnedArena::Create(nullptr, block_bytes, 4);
  TZ_CHECK(arena.ok());
  // The pipeline reuses these slots for every block: Note [Register reused buffers].
  TZ_CHECK_OK((*store)->RegisterBuffers({{(*arena)->base(), (*arena)->total_bytes()}}));
  std::vector<NvmeExtent> extents;
  {
    auto slot = (*arena)->TryAcquire();
    auto* f = static_cast<float*>(slot->data());
    for (uint64_t i = 0; i < kBlockParams; ++i) {
      f[i] = 0.01f * static_cast<float>(i % 100);  // p
      f[kBlockParams + i] = 0.0f;                  // m
      f[2 * kBlockParams + i] = 0.0f;              // v
    }
    for (size_t b = 0; b < blocks; ++b) {
      extents.push_back(*(*store)->Allocate(block_bytes));
      TZ_CHECK_OK((*store)->Write(extents.back(), slot->data()));
    }
  }
  std::vector<float> grad(kBlockParams, 0.001f);
  std::vector<uint16_t> out(kBlockParams);
  auto adam = std::move(CpuAdam::Create(AdamConfig{})).value();
  int64_t step = 0;
  auto adam_block = [&](void* data) {
    auto* f = static_cast<float*>(data);
    AdamBuffers b{f,           f + kBlockParams, f + 2 * kBlockParams, grad.data(),
                  DType::kF32, out.data(),       DType::kBF16,         kBlockParams};
    AdamStepOptions opt;
    opt.step = step;
    return adam->Step(b, opt).status();
  };
  std::vector<double> io_s, adam_s, pipe_s;
  for (int r = 0; r < a.reps; ++r) {
    ++step;
    auto t0 = Clock::now();
    TZ_CHECK_OK(
        RunSwapPipeline(**store, extents, **arena, [](size_t, void*) { return Status::OK(); }));
    io_s.push_back(Seconds(t0, Clock::now()));
    // Pure Adam over the same bytes: each block's state in RAM (a block-sized pinned slot per
    // block would need the whole state in memory; the blocks are identical in size, so one slot
    // per pass is the same work, memory-bound beyond the caches).
    std::vector<PinnedSlot> ram;
    for (int k = 0; k < 2; ++k) ram.push_back(std::move(*(*arena)->TryAcquire()));
    TZ_CHECK_OK((*store)->Read(extents[0], ram[0].data()));
    TZ_CHECK_OK((*store)->Read(extents[1 % blocks], ram[1].data()));
    t0 = Clock::now();
    for (size_t b = 0; b < blocks; ++b) TZ_CHECK_OK(adam_block(ram[b % 2].data()));
    adam_s.push_back(Seconds(t0, Clock::now()));
    ram.clear();
    t0 = Clock::now();
    TZ_CHECK_OK(
        RunSwapPipeline(**store, extents, **arena, [&](size_t, void* d) { return adam_block(d); }));
    pipe_s.push_back(Seconds(t0, Clock::now()));
  }
  const double io = Median(io_s), ad = Median(adam_s), pipe = Median(pipe_s);
  std::printf(
      "%zu blocks x %s (%llu M params): pure I/O %.3f s (%.2f GB/s read+write), pure Adam "
      "%.3f s, pipelined %.3f s, ratio to max %.3f (target <= 1.15)\n",
      blocks, FormatBytes(block_bytes).c_str(),
      static_cast<unsigned long long>(kBlockParams * blocks >> 20), io,
      2.0 * block_bytes * blocks / io / 1e9, ad, pipe, pipe / std::max(io, ad));
}

}  // namespace
}  // namespace tierzero

int main(int argc, char** argv) {
  const tierzero::Args args = tierzero::Parse(argc, argv);
  std::filesystem::create_directories(std::filesystem::path(args.path).parent_path().empty()
                                          ? "."
                                          : std::filesystem::path(args.path).parent_path());
  tierzero::SequentialVsFio(args);
  tierzero::Checksums(args);
  tierzero::SwapAdam(args, /*checksums=*/false);
  tierzero::SwapAdam(args, /*checksums=*/true);
  return 0;
}

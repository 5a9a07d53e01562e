#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "tierzero/status.h"

namespace tierzero {

// Note [A reserve for running out]
// Where the system gives no more memory (an address-space limit, `ulimit -v`; no overcommit),
// operator new throws std::bad_alloc and the command's error path turns it into an error line
// (StatusOfCurrentException). But the unwinding itself allocates: nlohmann::json's destructor
// flattens a container's children onto a heap vector before destroying them (so deep documents
// do not overflow the stack), and a destructor is noexcept. A second bad_alloc there was
// std::terminate: a run that had saved its checkpoint aborted while building its final report.
// So a reserve of address space is mapped at start (never touched: no memory is used), and the
// new_handler unmaps one block each time an allocation fails. The first failure is the
// caller's: it still throws, so the code that asked for too much takes its error path as
// before. Later ones (its unwinding's, its error message's) retry in what was given back, while
// any block is left. The blocks are mmap'd, not malloc'd: jemalloc serves an allocation over
// its oversize threshold (8 MiB) from an arena of its own and keeps the address space when it
// is freed, so a malloc'd reserve freed gave nothing to the allocations that followed
// (memory_reserve_test fails so). Two blocks of 32 MiB: a json container of two million values
// is flattened within one.
namespace {

constexpr int kMaxBlocks = 8;
std::atomic<void*> g_blocks[kMaxBlocks];
std::atomic<size_t> g_block_bytes{0};
std::atomic<int> g_drawn{0};

void GiveBackOneBlock() {
  const int drawn = g_drawn.fetch_add(1, std::memory_order_relaxed);
  bool released = false;
  for (auto& b : g_blocks) {
    if (void* p = b.exchange(nullptr)) {
      ::munmap(p, g_block_bytes.load());
      released = true;
      break;
    }
  }
  // (The first failure is the caller's: it throws. Later ones retry while a block was left.)
  if (drawn == 0 || !released) throw std::bad_alloc();
}

}  // namespace

// core/memory_reserve.h
void InstallMemoryReserve(size_t block_bytes, int blocks) {
  g_block_bytes.store(block_bytes);
  for (int i = 0; i < blocks && i < kMaxBlocks; ++i) {
    if (g_blocks[i].load() != nullptr) continue;
    void* p =
        ::mmap(nullptr, block_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) g_blocks[i].store(p);
  }
  std::set_new_handler(GiveBackOneBlock);
}

// core/memory_reserve.h
int MemoryReserveDrawn() { return g_drawn.load(std::memory_order_relaxed); }

}  // namespace tierzero

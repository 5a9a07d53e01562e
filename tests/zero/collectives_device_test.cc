// The device collectives (DeviceCollectives on the stream, and ZeRO++'s quantized ones against
// the host kernels), on the backend's GPU or a simulated device: the binary collectives_test runs
// them under mpirun as it runs the host collectives (collectives_test.cc).
#include "collectives_backend.h"

namespace tierzero {
namespace {
using namespace collectives_test;

TEST(Collectives, DeviceCollectivesInPlaceOnTheStream) {
  REQUIRE_BACKEND();
  Backend& b = TheBackend();
  std::unique_ptr<Device> sim;
  if (!b.gpu) {
    HostSimOptions o;
    o.capacity_bytes = 64ull << 20;
    o.h2d_bytes_per_second = 5e6;
    sim = *CreateHostSimDevice(o);
  }
  Device& d = b.gpu ? *b.gpu : *sim;
  auto dc = CreateDeviceCollectives(d, b.boot);
  ASSERT_TRUE(dc.ok()) << dc.status().ToString();
  Communicator& host = *b.boot;
  const int w = host.size(), me = host.rank();
  ASSERT_EQ((*dc)->size(), w);
  ASSERT_EQ((*dc)->rank(), me);
  const DType dt = DType::kBF16;
  const size_t n = 4099;
  const size_t block = DTypeBytes(dt, n);
  auto chunk = DeviceBuffer::Allocate(d, block * static_cast<size_t>(w));
  ASSERT_TRUE(chunk.ok());
  auto* base = static_cast<uint8_t*>(chunk->data());
  auto copy = Stream::Create(d, "copy");
  auto copied = Event::Create(d), done = Event::Create(d);
  ASSERT_TRUE(copy.ok() && copied.ok() && done.ok());
  const StreamHandle cs = (*dc)->stream();

  // All-gather: my block copied into place, then gathered in place.
  const auto mine = Fill(dt, n, [&](size_t i) { return Value(me, 0, i); });
  ASSERT_TRUE(d.CopyAsync(base + block * static_cast<size_t>(me), mine.data(), block,
                          CopyKind::kHostToDevice, copy->handle())
                  .ok());
  ASSERT_TRUE(copied->Record(*copy).ok());
  ASSERT_TRUE(d.StreamWaitEvent(cs, copied->handle()).ok());
  ASSERT_TRUE((*dc)->AllGather(base + block * static_cast<size_t>(me), base, n, dt).ok());
  // The trainer's own collective meanwhile, on the communicator the collectives duplicate.
  const int32_t tag = 100 + me;
  std::vector<int32_t> tags(static_cast<size_t>(w));
  ASSERT_TRUE((*host.AllGather(&tag, tags.data(), 1, DType::kF32))->Wait().ok());
  for (int r = 0; r < w; ++r) EXPECT_EQ(tags[static_cast<size_t>(r)], 100 + r);
  std::vector<uint8_t> gathered(block * static_cast<size_t>(w));
  ASSERT_TRUE(d.RecordEvent(done->handle(), cs).ok());
  ASSERT_TRUE(d.StreamWaitEvent(copy->handle(), done->handle()).ok());
  ASSERT_TRUE(
      d.CopyAsync(gathered.data(), base, gathered.size(), CopyKind::kDeviceToHost, copy->handle())
          .ok());
  ASSERT_TRUE(copy->Synchronize().ok());
  for (int r = 0; r < w; ++r) {
    const auto part = Fill(dt, n, [&](size_t i) { return Value(r, 0, i); });
    ASSERT_EQ(0, std::memcmp(gathered.data() + block * static_cast<size_t>(r), part.data(), block))
        << "block " << r;
  }

  // Reduce-scatter (mean) in place: block `me` of every rank's chunk, averaged.
  std::vector<uint8_t> all(block * static_cast<size_t>(w));
  for (int k = 0; k < w; ++k) {
    const auto part = Fill(dt, n, [&](size_t i) { return Value(me, 1 + k, i); });
    std::memcpy(all.data() + block * static_cast<size_t>(k), part.data(), block);
  }
  ASSERT_TRUE(
      d.CopyAsync(base, all.data(), all.size(), CopyKind::kHostToDevice, copy->handle()).ok());
  ASSERT_TRUE(copied->Record(*copy).ok());
  ASSERT_TRUE(d.StreamWaitEvent(cs, copied->handle()).ok());
  uint8_t* out = base + block * static_cast<size_t>(me);
  ASSERT_TRUE((*dc)->ReduceScatter(base, out, n, dt, ReduceOp::kMean).ok());
  ASSERT_TRUE(d.RecordEvent(done->handle(), cs).ok());
  ASSERT_TRUE(d.StreamWaitEvent(copy->handle(), done->handle()).ok());
  std::vector<uint8_t> got(block);
  ASSERT_TRUE(d.CopyAsync(got.data(), out, block, CopyKind::kDeviceToHost, copy->handle()).ok());
  ASSERT_TRUE(copy->Synchronize().ok());
  ASSERT_TRUE((*dc)->Drain().ok()) << (*dc)->Check().ToString();
  // Integers in [-8, 8] over at most 4 ranks: the sum and the mean are exact in bf16.
  const auto want = Fill(dt, n, [&](size_t i) {
    double s = 0;
    for (int r = 0; r < w; ++r) s += Value(r, 1 + me, i);
    return s / w;
  });
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), block));
  EXPECT_EQ((*dc)->stats().collectives, 2u);
}

// ZeRO++'s collectives on the device stream (the simulated device's host functions under MPI;
// NCCL with the CUDA kernels on a GPU) against the host kernels run locally on what every rank
// holds: the node all_gather, qwZ's gather (every rank's dequantize(quantize(shard))), and qgZ's
// two-hop mean, all bit for bit.
void CheckQuantizedDeviceCollectives(Device& d, const std::shared_ptr<Communicator>& boot) {
  DeviceCollectivesOptions options;
  options.node_collectives = true;
  auto dc = CreateDeviceCollectives(d, boot, options);
  ASSERT_TRUE(dc.ok()) << dc.status().ToString();
  const int w = boot->size(), me = boot->rank(), l_size = (*dc)->node_size();
  ASSERT_EQ(w % l_size, 0);
  const int n_size = w / l_size, node = me / l_size;
  const DType dt = DType::kBF16;
  const uint64_t n = 1337;  // a shard: runs of 1, 300 and the rest (blocks never span them)
  const std::vector<uint64_t> runs = {1, 300, n - 301};
  const std::vector<std::vector<uint64_t>> every(static_cast<size_t>(w), runs);
  auto qw = ShardQuantization::Create({8, 64}, every);
  auto qg = ShardQuantization::Create({4, 100}, every);
  ASSERT_TRUE(qw.ok() && qg.ok());
  {
    const Status s = (*dc)->PrepareQuantized(*qw);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  {
    const Status s = (*dc)->PrepareQuantized(*qg);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const size_t block = DTypeBytes(dt, n);
  const size_t chunk_bytes = block * static_cast<size_t>(w);
  auto value = [](int r, int salt, size_t i) {
    return std::sin(0.37 * static_cast<double>(i) + 1.3 * r + salt) * (1 + static_cast<int>(i % 7));
  };
  auto chunk = DeviceBuffer::Allocate(d, chunk_bytes);
  ASSERT_TRUE(chunk.ok());
  auto* base = static_cast<uint8_t*>(chunk->data());
  const StreamHandle cs = (*dc)->stream();
  std::vector<std::vector<uint8_t>> uploaded;  // alive until the copies are done
  uploaded.reserve(3);
  auto upload = [&](std::vector<uint8_t> host, uint8_t* dst) {
    uploaded.push_back(std::move(host));
    const auto& h = uploaded.back();
    ASSERT_TRUE(d.CopyAsync(dst, h.data(), h.size(), CopyKind::kHostToDevice, cs).ok());
  };
  auto download = [&](const uint8_t* src, size_t bytes) {
    std::vector<uint8_t> host(bytes);
    EXPECT_TRUE(d.CopyAsync(host.data(), src, bytes, CopyKind::kDeviceToHost, cs).ok());
    EXPECT_TRUE(d.SynchronizeStream(cs).ok());
    EXPECT_TRUE((*dc)->Drain().ok()) << (*dc)->Check().ToString();
    return host;
  };

  // The node all_gather (hpZ's backward gathers), in place.
  const size_t part = DTypeBytes(dt, 97);
  const int l = me % l_size;
  upload(Fill(dt, 97, [&](size_t i) { return Value(me, 3, i); }), base + part * l);
  ASSERT_TRUE((*dc)->NodeAllGather(base + part * l, base, 97, dt).ok());
  const auto parts = download(base, part * static_cast<size_t>(l_size));
  for (int k = 0; k < l_size; ++k) {
    const auto want = Fill(dt, 97, [&](size_t i) { return Value(node * l_size + k, 3, i); });
    ASSERT_EQ(0, std::memcmp(parts.data() + part * k, want.data(), part)) << "node part " << k;
  }

  // qwZ: every rank's shard quantized and dequantized, gathered in place.
  auto shard_of = [&](int r) { return Fill(dt, n, [&](size_t i) { return value(r, 0, i); }); };
  upload(shard_of(me), base + block * me);
  {
    const Status s = (*dc)->QuantizedAllGather(*qw, base + block * me, base, dt);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const auto gathered = download(base, chunk_bytes);
  for (int r = 0; r < w; ++r) {
    std::vector<uint8_t> packed(qw->layout(r).bytes()), want(block);
    ASSERT_TRUE(kernels::Quantize(qw->layout(r), shard_of(r).data(), dt, packed.data()).ok());
    ASSERT_TRUE(kernels::Dequantize(qw->layout(r), packed.data(), want.data(), dt).ok());
    ASSERT_EQ(0, std::memcmp(gathered.data() + block * r, want.data(), block)) << "shard " << r;
  }

  // qgZ: this rank's shard of the mean, in place. The reference follows Note [Quantized
  // collectives]: node n' sums its ranks' copies of my shard and requantizes (one node: sums
  // straight into fp32), then the nodes' partial sums are added in node order, divided by W.
  auto grads_of = [&](int r) {
    return Fill(dt, n * static_cast<size_t>(w), [&](size_t i) { return value(r, 1, i); });
  };
  upload(grads_of(me), base);
  {
    const Status s = (*dc)->QuantizedReduceScatter(*qg, base, base + block * me, dt);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const auto reduced = download(base + block * me, block);
  const kernels::QuantLayout& mine = qg->layout(me);
  std::vector<std::vector<uint8_t>> partials;
  std::vector<float> mean(n);
  for (int np = 0; np < n_size; ++np) {
    std::vector<std::vector<uint8_t>> copies;
    std::vector<const void*> inputs;
    for (int k = 0; k < l_size; ++k) {
      copies.emplace_back(mine.bytes());
      const auto g = grads_of(np * l_size + k);
      ASSERT_TRUE(kernels::Quantize(mine, g.data() + block * me, dt, copies.back().data()).ok());
    }
    for (const auto& c : copies) inputs.push_back(c.data());
    if (n_size == 1) {
      ASSERT_TRUE(kernels::DequantizeSum(mine, inputs, mean.data()).ok());
    } else {
      partials.emplace_back(mine.bytes());
      ASSERT_TRUE(kernels::DequantizeSumRequantize(mine, inputs, partials.back().data()).ok());
    }
  }
  if (n_size > 1) {
    std::vector<const void*> inputs;
    for (const auto& p : partials) inputs.push_back(p.data());
    ASSERT_TRUE(kernels::DequantizeSum(mine, inputs, mean.data()).ok());
  }
  for (float& v : mean) v /= static_cast<float>(w);
  std::vector<uint8_t> want(block);
  ASSERT_TRUE(Convert(mean.data(), DType::kF32, want.data(), dt, n).ok());
  EXPECT_EQ(0, std::memcmp(reduced.data(), want.data(), block));
  // The mean is near the exact one (Note [Quantized collectives] bounds the error).
  std::vector<float> got(n);
  ASSERT_TRUE(Convert(reduced.data(), dt, got.data(), DType::kF32, n).ok());
  for (size_t i = 0; i < n; ++i) {
    double exact = 0;
    for (int r = 0; r < w; ++r) exact += value(r, 1, n * static_cast<size_t>(me) + i);
    EXPECT_NEAR(got[i], exact / w, 1.05) << i;  // sum_r A_r / (qmax W) <= 1, bf16 rounding
  }
}

TEST(Collectives, QuantizedDeviceCollectivesMatchTheHostKernels) {
  REQUIRE_BACKEND();
  Backend& b = TheBackend();
  if (b.gpu) {
    CheckQuantizedDeviceCollectives(*b.gpu, b.boot);
    return;
  }
  HostSimOptions o;
  o.capacity_bytes = 64ull << 20;
  auto sim = CreateHostSimDevice(o);
  ASSERT_TRUE(sim.ok());
  // The machine's topology (one node), then emulated nodes of one rank and, with four ranks,
  // two nodes of two (both hops of the reduction).
  std::vector<int> per_node = {0};
  const int w = b.boot->size();
  if (w > 1) per_node.push_back(1);
  if (w >= 4 && w % 2 == 0) per_node.push_back(w / 2);
  for (int rpn : per_node) {
    SCOPED_TRACE("ranks_per_node " + std::to_string(rpn));
    std::shared_ptr<Communicator> boot = b.boot;
    if (rpn > 0) {
      auto c = Communicator::Mpi(rpn);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      boot = *c;
    }
    CheckQuantizedDeviceCollectives(**sim, boot);
  }
}

}  // namespace
}  // namespace tierzero

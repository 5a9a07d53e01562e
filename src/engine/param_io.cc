// Parameter reads and writes between iterations: a tensor's fp32 master weights or gradient read
// through the chunk manager and the optimizer groups, a tensor's values written to its master
// weights and parameter shard (with W > 1 each gathered or scattered over the ranks).
#include <cstring>

#include "comm/collective.h"
#include "core/convert.h"
#include "engine/engine_impl.h"

namespace tierzero {

Status Engine::Impl::GatherChunkMaster(int c, std::vector<float>& full) {
  const uint64_t n = layout.shard_elems();
  full.assign(layout.chunk_elems(), 0.0f);
  std::vector<float> mine(n, 0.0f);
  // A rank that cannot read its shard still joins the all_gather (with zeros), and the ranks
  // agree on the outcome, so none waits for it or keeps a chunk with zeros in it
  // (Note [Agreeing on an outcome]).
  Status read = WithChunkState(c, /*write_back=*/false, [&](float* master, float*, float*) {
    std::memcpy(mine.data(), master, n * 4);
    return Status::OK();
  });
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   comm->AllGather(mine.data(), full.data(), n, DType::kF32));
  RETURN_IF_ERROR(req->Wait());
  return AgreeOnStatus(*comm, read);
}
// ---- Parameters
// ---------------------------------------------------------------------------------

// The checks of every parameter accessor: after Finalize, between iterations unless `anytime`,
// a known id, and a buffer of the parameter's size (`into`: "into" or "with").
Status Engine::Impl::CheckAccess(std::string_view what, ParamId p, size_t n, std::string_view into,
                                 bool anytime) const {
  if (!finalized) return FailedPreconditionError(std::string(what) + " before Finalize");
  if (!anytime && in_iteration) {
    return FailedPreconditionError(std::string(what) + " inside an iteration");
  }
  if (p < 0 || p >= static_cast<ParamId>(params.size())) {
    return InvalidArgumentError("unknown parameter id");
  }
  const int64_t have = numel[static_cast<size_t>(p)];
  if (static_cast<int64_t>(n) != have) {
    return InvalidArgumentError(std::string(what) + " of '" + params[static_cast<size_t>(p)].name +
                                "' " + std::string(into) + " " + std::to_string(n) +
                                " elements; it has " + std::to_string(have));
  }
  return Status::OK();
}

Status Engine::ReadParam(ParamId p, std::span<float> out) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.CheckAccess("ReadParam", p, out.size(), "into", /*anytime=*/true));
  RETURN_IF_ERROR(im.updater->Await());
  const TensorLoc& loc = im.layout.tensor(p);
  std::vector<float> full;
  RETURN_IF_ERROR(im.GatherChunkMaster(loc.chunk, full));
  std::memcpy(out.data(), full.data() + loc.offset, loc.numel * 4);
  return Status::OK();
}

Status Engine::ReadGrad(ParamId p, std::span<float> out) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.CheckAccess("ReadGrad", p, out.size(), "into", /*anytime=*/false));
  RETURN_IF_ERROR(RefuseWithoutMoments("ReadGrad"));  // it holds no gradient shards
  RETURN_IF_ERROR(im.updater->Await());
  const DType gt = im.store->grad_dtype();
  const TensorLoc& loc = im.layout.tensor(p);
  // The chunk's gradient from every rank's shard (a shard on the device copied over first).
  std::vector<uint8_t> full(DTypeBytes(gt, im.layout.chunk_elems()));
  std::vector<uint8_t> mine;
  const void* shard = im.store->grad(loc.chunk);
  if (im.store->grad_on_device(loc.chunk)) {
    mine.resize(im.store->grad_bytes());
    RETURN_IF_ERROR(im.store->ReadGradShard(loc.chunk, mine.data()));
    shard = mine.data();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<CommRequest> req,
                   im.comm->AllGather(shard, full.data(), im.layout.shard_elems(), gt));
  RETURN_IF_ERROR(req->Wait());
  return Convert(full.data() + DTypeBytes(gt, loc.offset), gt, out.data(), DType::kF32, out.size());
}

Status Engine::WriteParam(ParamId p, std::span<const float> values) {
  Impl& im = *impl_;
  RETURN_IF_ERROR(im.CheckAccess("WriteParam", p, values.size(), "with", /*anytime=*/false));
  RETURN_IF_ERROR(im.updater->Await());
  im.updater->Discard();  // it started from the values replaced here
  const int c = im.layout.tensor(p).chunk;
  return im.WithChunkState(c, /*write_back=*/true, [&](float* master, float*, float*) -> Status {
    for (const ShardSlice& sl : im.slices[static_cast<size_t>(c)]) {
      if (sl.tensor != p) continue;
      std::memcpy(master + sl.shard_offset, values.data() + sl.tensor_begin, sl.numel * 4);
    }
    return im.UploadChunk(c, master);
  });
}

// Writes the compute-dtype copy of a chunk's master weights into its parameter shard.
Status Engine::Impl::UploadChunk(int c, const float* master) {
  const DType dt = cfg.compute_dtype;
  void* host = store->host_param(c);
  void* dst = host;
  if (dst == nullptr) {
    dst = upload.data();
    std::memset(dst, 0, upload.bytes());  // the padding of the shard stays zero
  }
  for (const ShardSlice& sl : slices[static_cast<size_t>(c)]) {
    RETURN_IF_ERROR(Convert(master + sl.shard_offset, DType::kF32,
                            static_cast<uint8_t*>(dst) + DTypeBytes(dt, sl.shard_offset), dt,
                            sl.numel));
  }
  if (host == nullptr) RETURN_IF_ERROR(store->WriteParam(c, dst));
  return Status::OK();
}

// The slices' moments as the Updater lays them out (Note [8-bit blocks per slice] in
// update/updater.cc).
AdamBuffers Engine::Impl::SliceMoments(const OptimizerGroup& g, size_t s) const {
  const ShardSlice& sl = slices[static_cast<size_t>(g.chunk)][s];
  AdamBuffers b;
  b.n = sl.numel;
  b.states = g.format;
  if (g.format == StateFormat::kF32) {
    b.m = g.m + sl.shard_offset;
    b.v = g.v + sl.shard_offset;
    return b;
  }
  const uint64_t w = MomentWidth(g.format);
  b.m_state = static_cast<uint8_t*>(g.m_state) + w * sl.shard_offset;
  b.v_state = static_cast<uint8_t*>(g.v_state) + w * sl.shard_offset;
  if (g.format == StateFormat::kInt8) {
    b.m_scale = g.m_scale + sl.shard_offset / kStateBlockElems + s;
    b.v_scale = g.v_scale + sl.shard_offset / kStateBlockElems + s;
  }
  return b;
}

Status Engine::Impl::WithChunkState(int chunk, bool write_back,
                                    const std::function<Status(float*, float*, float*)>& fn) {
  return optimizer().With(chunk, write_back, [&](const OptimizerGroup& g) -> Status {
    if (g.format == StateFormat::kF32) return fn(g.master, g.m, g.v);
    // fp32 moments for fn where the shard's slices are (padding stays 0).
    const uint64_t n = layout.shard_elems();
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    const size_t count = slices[static_cast<size_t>(chunk)].size();
    for (size_t s = 0; s < count; ++s) {
      const uint64_t at = slices[static_cast<size_t>(chunk)][s].shard_offset;
      DecodeMoments(SliceMoments(g, s), m.data() + at, v.data() + at);
    }
    RETURN_IF_ERROR(fn(g.master, m.data(), v.data()));
    if (!write_back) return Status::OK();
    for (size_t s = 0; s < count; ++s) {
      const uint64_t at = slices[static_cast<size_t>(chunk)][s].shard_offset;
      EncodeMoments(m.data() + at, v.data() + at, SliceMoments(g, s));
    }
    return Status::OK();
  });
}

}  // namespace tierzero

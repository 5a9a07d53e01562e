// Internal ways into an engine, for tests and the library's own tools (EngineInternals).
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "engine/engine_impl.h"
#include "offload/block_io.h"

namespace tierzero {

// Internal ways into an engine, for tests and the library's own tools.
struct EngineInternals {
  static Engine::Impl& Of(Engine& engine) { return *engine.impl_; }
  // Before Finalize: the NVMe tier's BlockIo goes through `wrap` (a FaultInjectionBlockIo).
  static void WrapNvmeIo(Engine& engine,
                         std::function<std::unique_ptr<BlockIo>(std::unique_ptr<BlockIo>)> wrap) {
    engine.impl_->nvme_wrap_io = std::move(wrap);
  }
  // An engine that runs on `device` instead of the one the config names (engine-level tests
  // give it a FaultInjectionDevice). The device must outlive nothing the engine hands out.
  static StatusOr<std::unique_ptr<Engine>> CreateOnDevice(const EngineConfig& config,
                                                          std::shared_ptr<Communicator> comm,
                                                          std::unique_ptr<Device> device) {
    if (device == nullptr) return InvalidArgumentError("CreateOnDevice without a device");
    EngineConfig c = config;
    c.device = device->info().kind == DeviceKind::kCuda ? DeviceChoice::kCuda : DeviceChoice::kHost;
    ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(c, std::move(comm)));
    e->impl_->device = std::move(device);
    return e;
  }
};

}  // namespace tierzero

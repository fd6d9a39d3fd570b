// A stand-in CUDA runtime for fake tensors, loaded only into a simulation's own process on a torch build without
// CUDA (trl_longstraw/simulation/runtime.py). FakeTensorMode gives tensors a `cuda` device and no storage; what torch
// itself asks of a CUDA device for them, a device guard (indexing, `.to`, `.contiguous`) and, in autograd's input
// buffers, the accelerator's current stream, needs a registered CUDA guard and CUDA hooks. These register c10's own
// FakeGuardImpl (its test guard: a current device and stream ids, nothing else) and hooks that report a built,
// available device. Nothing here allocates, launches or synchronises anything. It must be loaded before `import
// torch` reads the CUDA hooks for the first time.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

struct SimulatedCUDAHooks : at::CUDAHooksInterface {
  explicit SimulatedCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return c10::impl::kFakeGuardImplMaxDevices; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  // Host memory "pinned" for a fake device is plain host memory: nothing is ever copied from it.
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  bool isPinnedPtr(const void*) const override { return false; }
};

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", SimulatedCUDAHooks);
}  // namespace at

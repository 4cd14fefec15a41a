// The nanobind module jax_m2n._ffi_cuda: the CUDA handlers of `jax_m2n_reshard` and of the
// local data plane (`jax_m2n_local_copy`, `jax_m2n_local_store`) for registration from
// Python, the NCCL communicator's life cycle, and CUDA IPC memory. Glue only: argument
// conversion and error mapping; the work is in nccl_comm.cc, reshard_cuda.cc,
// local_copy_cuda.cc and ipc.cc.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/cuda/ipc.h"
#include "xla_ffi/cuda/local_copy_cuda.h"
#include "xla_ffi/cuda/nccl_comm.h"
#include "xla_ffi/cuda/peer_transport.h"
#include "xla_ffi/cuda/reshard_cuda.h"

namespace nb = nanobind;

namespace jax_m2n {
namespace {

constexpr const char kModuleDoc[] = R"doc(CUDA handlers of jax_m2n_reshard and the NCCL communicator.

Python-facing API (docs/dev_contracts.md, section "_ffi_cuda"; docs/cuda_transport.md):

  registrations() -> {"jax_m2n_reshard": {"instantiate": capsule, "execute": capsule},
                      "jax_m2n_local_copy": {"instantiate": ..., "execute": ...},
                      "jax_m2n_local_store": capsule}
      for jax.ffi.register_ffi_target(name, target, platform="CUDA", api_version=1).
  type_registrations() -> {"jax_m2n.cuda.ReshardState": {"type_id": ..., "type_info": ...}}
      register each with jax.ffi.register_ffi_type(name, reg, platform="CUDA") BEFORE
      the target.
  nccl_version(nccl_library="") -> int
  nccl_unique_id(nccl_library="") -> bytes        (128 bytes; one process makes it)
  initialize(unique_id, device_ids, local_devices, *, timeout_ms=600000,
             nccl_library="", blocking=True, warmup_bytes=8388608) -> None
      Collective over all processes. device_ids: [d.id for d in jax.devices()] (rank =
      position); local_devices: [(d.local_hardware_id, d.id) for d in
      jax.local_devices()]. Creates the communicator (one group of ncclCommInitRank
      for this process's devices) and connects every pair of ranks. Raises ValueError,
      TimeoutError (a process never arrived) or RuntimeError. Releases the GIL.
  is_initialized() -> bool
  error() -> str | None        the sticky error after a timeout (communicator aborted)
  finalize() -> None           destroy the communicator (re-initialize after an abort)
  set_engine(name) -> None     "auto" (default: the direct peer path when every
                               participant is a GPU of this process, else NCCL), "nccl"
                               or "peer"; applies to reshards that start afterwards.
                               Every process must choose alike.
  engine() -> str
  peer_stats() -> dict         process-wide counters of the peer path: rounds,
                               memcpys, memcpys_3d, kernel_tasks, converts,
                               plans_built
  ipc_alloc(device_ordinal, nbytes) -> (address, handle)
      cudaMalloc in the device's primary context + cudaIpcGetMemHandle: a device
      pointer (int) and the 64-byte handle (bytes) another process opens.
  ipc_open(device_ordinal, handle) -> address
      cudaIpcOpenMemHandle (lazy peer access) of another process's handle.
  ipc_close(address) -> None   cudaIpcCloseMemHandle of what ipc_open mapped
  ipc_free(address) -> None    cudaFree of what ipc_alloc allocated
      The four raise RuntimeError naming the call and CUDA's error string
      (ValueError for an argument out of range) and release the GIL.

Example (one process, every local GPU):
  import jax, jax_m2n._ffi_cuda as m
  m.initialize(m.nccl_unique_id(), [d.id for d in jax.devices()],
               [(d.local_hardware_id, d.id) for d in jax.local_devices()])
)doc";

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

[[noreturn]] void Raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

const NcclApi& Nccl(const std::string& library) {
  std::string error;
  const NcclApi* api = LoadNccl(library, &error);
  if (api == nullptr) Raise(PyExc_RuntimeError, error);
  return *api;
}

}  // namespace
}  // namespace jax_m2n

NB_MODULE(_ffi_cuda, m) {
  using namespace jax_m2n;  // NOLINT: module glue only
  m.doc() = kModuleDoc;

  m.def("registrations", []() {
    nb::dict stages;
    stages["instantiate"] = Capsule(JaxM2nReshardCudaInstantiate);
    stages["execute"] = Capsule(JaxM2nReshardCudaExecute);
    nb::dict d;
    d["jax_m2n_reshard"] = stages;
    nb::dict local_copy;
    local_copy["instantiate"] = Capsule(JaxM2nLocalCopyCudaInstantiate);
    local_copy["execute"] = Capsule(JaxM2nLocalCopyCudaExecute);
    d["jax_m2n_local_copy"] = local_copy;
    d["jax_m2n_local_store"] = Capsule(JaxM2nLocalStoreCuda);
    return d;
  });

  m.def("type_registrations", []() {
    nb::dict reg;
    reg["type_id"] = nb::capsule(reinterpret_cast<void*>(CudaReshardStateTypeId()));
    reg["type_info"] = nb::capsule(
        reinterpret_cast<void*>(const_cast<XLA_FFI_TypeInfo*>(CudaReshardStateTypeInfo())));
    nb::dict d;
    d[kCudaReshardStateName] = reg;
    return d;
  });

  m.def(
      "nccl_version", [](const std::string& nccl_library) { return Nccl(nccl_library).version; },
      nb::arg("nccl_library") = "");

  m.def(
      "nccl_unique_id",
      [](const std::string& nccl_library) {
        const NcclApi& api = Nccl(nccl_library);
        ncclUniqueId id;
        ncclResult_t r = api.GetUniqueId(&id);
        if (r != ncclSuccess) {
          Raise(PyExc_RuntimeError,
                JAX_M2N_AT("ncclGetUniqueId failed: " + api.Describe(r, nullptr)));
        }
        return nb::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
      },
      nb::arg("nccl_library") = "");

  m.def(
      "initialize",
      [](nb::bytes unique_id, std::vector<int64_t> device_ids,
         std::vector<std::pair<int, int64_t>> local_devices, int64_t timeout_ms,
         std::string nccl_library, bool blocking, int64_t warmup_bytes) {
        if (timeout_ms <= 0) {
          Raise(PyExc_ValueError, "initialize: timeout_ms must be > 0; got " +
                                      std::to_string(timeout_ms) + ".");
        }
        if (warmup_bytes < 0) {
          Raise(PyExc_ValueError, "initialize: warmup_bytes must be >= 0; got " +
                                      std::to_string(warmup_bytes) + ".");
        }
        InitOptions o;
        o.unique_id.assign(unique_id.c_str(), unique_id.size());
        o.device_ids = std::move(device_ids);
        o.local = std::move(local_devices);
        o.timeout_ms = timeout_ms;
        o.nccl_library = std::move(nccl_library);
        o.blocking = blocking;
        o.warmup_bytes = warmup_bytes;
        std::string error;
        bool timed_out = false;
        {
          nb::gil_scoped_release release;
          error = Communicator::Get().Initialize(o, &timed_out);
        }
        if (!error.empty()) {
          const bool bad_argument = error.find("initialize: ") != std::string::npos;
          Raise(timed_out ? PyExc_TimeoutError
                          : (bad_argument ? PyExc_ValueError : PyExc_RuntimeError),
                error);
        }
      },
      nb::arg("unique_id"), nb::arg("device_ids"), nb::arg("local_devices"), nb::kw_only(),
      nb::arg("timeout_ms") = 600000, nb::arg("nccl_library") = "",
      nb::arg("blocking") = true, nb::arg("warmup_bytes") = int64_t{8} << 20);

  m.def("is_initialized", []() { return Communicator::Get().initialized(); });

  m.def("error", []() -> std::optional<std::string> {
    std::string e = Communicator::Get().StickyError();
    if (e.empty()) return std::nullopt;
    return e;
  });

  m.def(
      "set_engine",
      [](const std::string& name) {
        if (name == "auto") {
          SetCudaEngine(CudaEngine::kAuto);
        } else if (name == "nccl") {
          SetCudaEngine(CudaEngine::kNccl);
        } else if (name == "peer") {
          SetCudaEngine(CudaEngine::kPeer);
        } else {
          Raise(PyExc_ValueError,
                "set_engine: name must be one of 'auto', 'nccl', 'peer'; got '" + name + "'.");
        }
      },
      nb::arg("name"));

  m.def("engine", []() -> std::string {
    switch (GetCudaEngine()) {
      case CudaEngine::kNccl:
        return "nccl";
      case CudaEngine::kPeer:
        return "peer";
      default:
        return "auto";
    }
  });

  m.def("peer_stats", []() {
    PeerStats st = GetPeerStats();
    nb::dict d;
    d["rounds"] = st.rounds;
    d["memcpys"] = st.memcpys;
    d["memcpys_3d"] = st.memcpys_3d;
    d["kernel_tasks"] = st.kernel_tasks;
    d["converts"] = st.converts;
    d["plans_built"] = st.plans_built;
    return d;
  });

  m.def(
      "ipc_alloc",
      [](int device_ordinal, int64_t nbytes) {
        if (nbytes <= 0) {
          Raise(PyExc_ValueError,
                "ipc_alloc: nbytes must be > 0; got " + std::to_string(nbytes) + ".");
        }
        uint64_t address = 0;
        std::string handle, error;
        {
          nb::gil_scoped_release release;
          error = IpcAlloc(device_ordinal, nbytes, &address, &handle);
        }
        if (!error.empty()) Raise(PyExc_RuntimeError, error);
        return std::make_pair(address, nb::bytes(handle.data(), handle.size()));
      },
      nb::arg("device_ordinal"), nb::arg("nbytes"));

  m.def(
      "ipc_open",
      [](int device_ordinal, nb::bytes handle) {
        if (handle.size() != kIpcHandleBytes) {
          Raise(PyExc_ValueError, "ipc_open: handle must be " +
                                      std::to_string(kIpcHandleBytes) + " bytes; got " +
                                      std::to_string(handle.size()) + ".");
        }
        std::string h(handle.c_str(), handle.size()), error;
        uint64_t address = 0;
        {
          nb::gil_scoped_release release;
          error = IpcOpen(device_ordinal, h, &address);
        }
        if (!error.empty()) Raise(PyExc_RuntimeError, error);
        return address;
      },
      nb::arg("device_ordinal"), nb::arg("handle"));

  m.def(
      "ipc_close",
      [](uint64_t address) {
        std::string error;
        {
          nb::gil_scoped_release release;
          error = IpcClose(address);
        }
        if (!error.empty()) Raise(PyExc_RuntimeError, error);
      },
      nb::arg("address"));

  m.def(
      "ipc_free",
      [](uint64_t address) {
        std::string error;
        {
          nb::gil_scoped_release release;
          error = IpcFree(address);
        }
        if (!error.empty()) Raise(PyExc_RuntimeError, error);
      },
      nb::arg("address"));

  m.def("finalize", []() {
    std::string error;
    {
      nb::gil_scoped_release release;
      error = Communicator::Get().Finalize();
    }
    if (!error.empty()) Raise(PyExc_RuntimeError, error);
  });
}

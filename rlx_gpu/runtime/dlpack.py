"""DLPack at the border: tensors in from any ``__dlpack__`` producer, arena views out, no copies on the host.

The C structs of ``dlpack.h`` (v0.8 legacy ``DLManagedTensor`` and v1.x ``DLManagedTensorVersioned``)
are declared with ctypes, because ``numpy.from_dlpack`` refuses bfloat16 and the ABI stores bf16.

Rules this module keeps (the DLPack spec's, plus two choices of ours):

- **Ownership.** Importing consumes the capsule: it is renamed ``used_dltensor[_versioned]`` and the
  producer's deleter is called exactly once, when the last view of the imported bytes is gone (or at
  once, when the tensor is refused). An exported capsule that nobody consumed calls our deleter from
  its own destructor; a consumer calls it when it is done. The exported view keeps its arena alive.
- **Layout.** Only dense row-major tensors cross (strides of size-1 dimensions are ignored, a NULL
  strides pointer means row-major). A strided view is *refused*, not copied: a hidden copy would break
  the "shares memory" promise of both directions; call ``.contiguous()`` or ``np.ascontiguousarray``.
- **Dtypes.** f32, f16, bf16 and f64 (ABI.md §1) and i32 (the integer tensors of §8); anything else is
  refused naming its dtype.
- **Devices.** CPU (and CUDA pinned host) memory becomes a NumPy view; CUDA memory becomes a
  ``DeviceTensor`` (pointer, byte count, device id) for a device backend to copy from.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from host_fallback.abi import ELEM_SIZE
from host_fallback.arena import STORAGE

from ..errors import DLPackError


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


#: ``void (*deleter)(DLManagedTensor*)``, the same C signature for both managed structs.
Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", Deleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", Deleter),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


FLAG_READ_ONLY = 1 << 0
DLPACK_MAJOR = 1
#: (type code, bits) of each ABI dtype; kDLInt = 0, kDLFloat = 2, kDLBfloat = 4; lanes are always 1.
DTYPE_CODES: dict[str, tuple[int, int]] = {"f32": (2, 32), "f16": (2, 16), "bf16": (4, 16), "f64": (2, 64),
                                         "i32": (0, 32)}
_ABI_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque", 4: "bfloat", 5: "complex", 6: "bool"}
KDL_CPU = 1
_HOST_DEVICES = {KDL_CPU: "cpu", 3: "cuda_host"}
_GPU_DEVICES = {2: "cuda", 13: "cuda_managed"}
_DEVICE_NAMES = {**_HOST_DEVICES, **_GPU_DEVICES, 4: "opencl", 7: "vulkan", 8: "metal", 10: "rocm",
                 11: "rocm_host", 14: "oneapi"}

# Capsule names must outlive every capsule that points at them: module-level buffers, never freed.
_NAME = ctypes.create_string_buffer(b"dltensor")
_NAME_VERSIONED = ctypes.create_string_buffer(b"dltensor_versioned")
_USED = ctypes.create_string_buffer(b"used_dltensor")
_USED_VERSIONED = ctypes.create_string_buffer(b"used_dltensor_versioned")

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi))
# Inside a capsule destructor the capsule is being deallocated: pass it as a bare address, never a py_object.
_capsule_valid_at = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer_at = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def describe_dtype(code: int, bits: int, lanes: int = 1) -> str:
    """``int32``, ``bfloat16``, ``float32x4``: a DLPack dtype as a person reads it."""
    return f"{_CODE_NAMES.get(code, f'code{code}')}{bits}" + (f"x{lanes}" if lanes != 1 else "")


# ----------------------------------------------------------------------------------------------- import

class _ImportedCapsule:
    """Owns one consumed managed tensor and calls its deleter exactly once, when nothing needs it any more.

    NumPy views of host memory hold this object as their base (through ``__array_interface__``).
    """

    def __init__(self, address: int, managed: DLManagedTensor | DLManagedTensorVersioned):
        self._address, self._managed = address, managed
        self.interface: dict[str, Any] = {}

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self.interface

    def release(self) -> None:
        address, self._address = self._address, 0
        if address and self._managed.deleter:
            self._managed.deleter(address)

    def __del__(self) -> None:
        self.release()


@dataclass(frozen=True, eq=False)
class HostTensor:
    """A tensor in host memory taken by DLPack: ``data`` is a zero-copy uint8 view of its bytes."""

    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def array(self) -> np.ndarray:
        """The same memory typed by the ABI's storage dtype (``ml_dtypes.bfloat16`` for bf16)."""
        return self.data.view(STORAGE[self.dtype]).reshape(self.shape)


@dataclass(frozen=True, eq=False)
class DeviceTensor:
    """A tensor in GPU memory taken by DLPack: copy ``nbytes`` from ``pointer`` while this object lives."""

    pointer: int
    nbytes: int
    device: str
    device_id: int
    dtype: str
    shape: tuple[int, ...]
    owner: Any  # keeps the producer's memory alive; its deleter runs when this object is collected


def import_tensor(obj: Any, *, stream: int | None = None) -> HostTensor | DeviceTensor:
    """Take ``obj`` (anything with ``__dlpack__``: NumPy, torch, CuPy) without copying its memory.

    ``stream`` is the consumer's stream for a GPU producer (DLPack's ``__dlpack__(stream=...)``); a
    producer whose ``__dlpack_device__`` is not a GPU gets None, as the protocol asks of host memory.
    Raises ``DLPackError`` for a dtype other than f32/f16/bf16/f64, a strided layout, or a device this
    library cannot read.
    """
    if not hasattr(obj, "__dlpack__"):
        raise DLPackError(f"{type(obj).__name__} does not implement __dlpack__; pass a NumPy array, "
                          f"a torch tensor or another DLPack producer")
    if stream is not None and hasattr(obj, "__dlpack_device__") and obj.__dlpack_device__()[0] not in _GPU_DEVICES:
        stream = None
    try:
        capsule = obj.__dlpack__(stream=stream, max_version=(DLPACK_MAJOR, 0))
    except TypeError:  # a producer older than DLPack 1.0 knows no max_version
        capsule = obj.__dlpack__(stream=stream)
    return import_capsule(capsule)


def import_capsule(capsule: Any) -> HostTensor | DeviceTensor:
    """Consume a ``dltensor`` or ``dltensor_versioned`` capsule (see ``import_tensor``)."""
    name = _capsule_name(capsule)
    if name == _NAME_VERSIONED.value:
        address = _capsule_pointer(capsule, _NAME_VERSIONED)
        managed: Any = DLManagedTensorVersioned.from_address(address)
        _capsule_set_name(capsule, _USED_VERSIONED)
    elif name == _NAME.value:
        address = _capsule_pointer(capsule, _NAME)
        managed = DLManagedTensor.from_address(address)
        _capsule_set_name(capsule, _USED)
    else:
        raise DLPackError(f"a capsule named {name!r} is not an unconsumed DLPack tensor: a capsule can be "
                          f"imported once; ask the producer's __dlpack__ for a new one")
    owner = _ImportedCapsule(address, managed)
    try:
        return _describe(managed, owner)
    except BaseException:
        owner.release()  # refused: hand the memory back now, not when the traceback dies
        raise


def _describe(managed: Any, owner: _ImportedCapsule) -> HostTensor | DeviceTensor:
    versioned = isinstance(managed, DLManagedTensorVersioned)
    if versioned and managed.version.major != DLPACK_MAJOR:
        raise DLPackError(f"the producer speaks DLPack {managed.version.major}.{managed.version.minor}; "
                          f"this library reads {DLPACK_MAJOR}.x")
    t = managed.dl_tensor
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _ABI_DTYPES.get((code, bits)) if lanes == 1 else None
    if dtype is None:
        raise DLPackError(f"dtype {describe_dtype(code, bits, lanes)} cannot enter an arena: the ABI stores "
                          f"f32, f16, bf16, f64 and i32; cast first (torch: .float() or .int(), NumPy: .astype(np.float32))")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if any(n < 0 for n in shape):
        raise DLPackError(f"negative extent in shape {list(shape)}")
    _check_dense(shape, [t.strides[i] for i in range(t.ndim)] if t.strides else None)
    nbytes = int(np.prod(shape, dtype=np.int64)) * ELEM_SIZE[dtype]
    pointer = (t.data or 0) + t.byte_offset
    device_type, device_id = t.device.device_type, t.device.device_id
    if device_type in _GPU_DEVICES:
        return DeviceTensor(pointer, nbytes, _GPU_DEVICES[device_type], device_id, dtype, shape, owner)
    if device_type not in _HOST_DEVICES:
        where = _DEVICE_NAMES.get(device_type, f"device type {device_type}")
        raise DLPackError(f"a {where} tensor cannot be read here: move it to the CPU or a CUDA device first")
    if nbytes == 0:
        owner.release()
        return HostTensor(np.empty(0, np.uint8), dtype, shape)
    read_only = versioned and bool(managed.flags & FLAG_READ_ONLY)
    owner.interface = {"version": 3, "shape": (nbytes,), "typestr": "|u1", "data": (pointer, read_only)}
    return HostTensor(np.asarray(owner), dtype, shape)


def _check_dense(shape: tuple[int, ...], strides: list[int] | None) -> None:
    """Refuse anything but row-major dense strides (in elements); size-1 and empty tensors always pass."""
    if strides is None or 0 in shape:
        return
    expected = 1
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expected:
            raise DLPackError(f"strides {strides} (elements) for shape {list(shape)} are not row-major dense: "
                              f"the arena holds dense tensors and a view is never copied silently; "
                              f"pass .contiguous() (torch) or np.ascontiguousarray(...) (NumPy)")
        expected *= extent


# ----------------------------------------------------------------------------------------------- export

#: Every exported managed tensor not yet deleted, by address: its ctypes memory and the objects it keeps alive.
_LIVE: dict[int, tuple[Any, ...]] = {}


@Deleter
def _delete_export(address: int) -> None:
    _LIVE.pop(address, None)


@_CapsuleDestructor
def _destroy_capsule(capsule: int) -> None:
    # The spec: a capsule that was never consumed still owns its tensor and must call the deleter.
    for name in (_NAME, _NAME_VERSIONED):
        if _capsule_valid_at(capsule, name):
            _delete_export(_capsule_pointer_at(capsule, name))


class ArenaView:
    """``shape`` elements of ``dtype`` at byte ``offset`` of a host arena, offered to DLPack consumers.

    ``torch.from_dlpack(view)`` and ``numpy.from_dlpack(view)`` share the arena's memory (NumPy has no
    bfloat16: take bf16 into torch, or into NumPy with ``import_tensor``). The arena, and ``owner``
    (for example the resident arena object that holds it), stay alive while any consumer holds a tensor.
    """

    def __init__(self, arena: np.ndarray, offset: int, dtype: str, shape: tuple[int, ...], owner: Any = None):
        if not isinstance(arena, np.ndarray) or arena.dtype != np.uint8 or arena.ndim != 1 \
                or not arena.flags.c_contiguous:
            raise DLPackError(f"an arena is a dense 1-D numpy uint8 array, got {type(arena).__name__} "
                              f"{getattr(arena, 'dtype', '')} {getattr(arena, 'shape', '')}")
        if dtype not in DTYPE_CODES:
            raise DLPackError(f"dtype {dtype!r} is not an ABI dtype; expected one of {sorted(DTYPE_CODES)}")
        self.offset, self.dtype, self.shape = int(offset), dtype, tuple(int(n) for n in shape)
        nbytes = int(np.prod(self.shape, dtype=np.int64)) * ELEM_SIZE[dtype]
        if self.offset < 0 or self.offset + nbytes > arena.nbytes or min(self.shape, default=0) < 0:
            raise DLPackError(f"{dtype} {list(self.shape)} at byte {offset} ({nbytes} bytes) lies outside the "
                              f"arena of {arena.nbytes} bytes")
        self._arena, self._owner, self._nbytes = arena, owner, nbytes

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CPU, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        if stream not in (None, -1):
            raise DLPackError(f"stream {stream!r} given for host memory; a CPU tensor takes stream=None")
        if dl_device is not None and tuple(dl_device) != (KDL_CPU, 0):
            raise DLPackError(f"this view lives on the CPU; it cannot be exported to device {tuple(dl_device)}")
        versioned = max_version is not None and max_version[0] >= DLPACK_MAJOR
        if copy:  # the consumer asked for its own copy: this tensor's bytes only
            own = self._arena[self.offset: self.offset + self._nbytes].copy()
            return _export_capsule(own, 0, self.dtype, self.shape, versioned, keep=(own,))
        if not self._arena.flags.writeable and not versioned:
            raise DLPackError("a read-only arena needs DLPack >= 1.0 to say so; the consumer asked for 0.x")
        return _export_capsule(self._arena, self.offset, self.dtype, self.shape, versioned,
                               keep=(self._arena, self._owner))


def _export_capsule(arena: np.ndarray, offset: int, dtype: str, shape: tuple[int, ...], versioned: bool,
                    keep: tuple[Any, ...]) -> Any:
    ndim = len(shape)
    sizes = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(ndim)))
    managed: Any = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    t = managed.dl_tensor
    t.data = arena.ctypes.data
    t.byte_offset = offset
    t.device = DLDevice(KDL_CPU, 0)
    t.ndim = ndim
    t.dtype = DLDataType(*DTYPE_CODES[dtype], 1)
    t.shape = ctypes.cast(sizes, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    managed.deleter = _delete_export
    if versioned:
        managed.version = DLPackVersion(DLPACK_MAJOR, 0)
        managed.flags = 0 if arena.flags.writeable else FLAG_READ_ONLY
    address = ctypes.addressof(managed)
    _LIVE[address] = (managed, sizes, strides, *keep)
    return _capsule_new(address, _NAME_VERSIONED if versioned else _NAME, _destroy_capsule)

"""DLPack import/export: memory is shared both ways, dtypes and layouts are checked, deleters run exactly once."""
from __future__ import annotations

import ctypes
import gc
import weakref

import ml_dtypes
import numpy as np
import pytest
import torch

from rlx_gpu.errors import DLPackError
from rlx_gpu.runtime.dlpack import (ArenaView, DeviceTensor, DLManagedTensor, DLManagedTensorVersioned,
                                    DLTensor, HostTensor, import_capsule, import_tensor)

pytestmark = pytest.mark.usefixtures("collect_only_new_objects")  # its gc.collect() calls: tests/conftest.py

TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}
NUMPY = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64}

_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_NAMES = {False: ctypes.create_string_buffer(b"dltensor"), True: ctypes.create_string_buffer(b"dltensor_versioned")}


class HandMade:
    """A producer written against dlpack.h by hand, with a deleter that counts its calls."""

    def __init__(self, *, shape=(2, 3), strides=None, code=2, bits=32, device=(1, 0), byte_offset=0,
                 versioned=False, major=1, flags=0):
        self.buffer = np.arange(64, dtype=np.uint8)
        self.deleted = 0
        self.versioned = versioned
        self.managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        self._deleter = type(self.managed.deleter)(self._count)
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(shape))(*strides) if strides is not None else None
        t = self.managed.dl_tensor
        t.data, t.byte_offset, t.ndim = self.buffer.ctypes.data, byte_offset, len(shape)
        t.device.device_type, t.device.device_id = device
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code, bits, 1
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self._strides is not None:
            t.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        self.managed.deleter = self._deleter
        if versioned:
            self.managed.version.major, self.managed.flags = major, flags

    def _count(self, address):
        assert address == ctypes.addressof(self.managed)
        self.deleted += 1

    def capsule(self):
        return _new_capsule(ctypes.addressof(self.managed), _NAMES[self.versioned], None)


def test_structs_have_the_dlpack_h_layout():
    # 64-bit dlpack.h: DLTensor 48 bytes; legacy managed tensor 64; versioned 80 with dl_tensor at 32
    assert (ctypes.sizeof(DLTensor), ctypes.sizeof(DLManagedTensor), ctypes.sizeof(DLManagedTensorVersioned)) == \
        (48, 64, 80)
    assert DLManagedTensorVersioned.dl_tensor.offset == 32


@pytest.mark.parametrize("dtype", list(TORCH))
def test_torch_tensor_in_shares_its_memory(dtype):
    t = torch.randn(3, 5, dtype=torch.float64).to(TORCH[dtype])
    taken = import_tensor(t)
    assert isinstance(taken, HostTensor) and (taken.dtype, taken.shape) == (dtype, (3, 5))
    assert np.array_equal(taken.data, t.view(torch.uint8).reshape(-1).numpy())
    assert np.array_equal(taken.array().astype(np.float64), t.to(torch.float64).numpy())
    taken.array()[1, 2] = 7.0
    assert t[1, 2].item() == 7.0
    t[0, 0] = -3.0
    assert float(taken.array()[0, 0]) == -3.0


def test_numpy_round_trip_through_an_arena_shares_memory():
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    taken = import_tensor(x)
    assert np.shares_memory(taken.data, x)
    arena = np.zeros(256, np.uint8)
    arena[64:64 + taken.nbytes] = taken.data
    out = np.from_dlpack(ArenaView(arena, 64, "f32", (4, 3)))
    assert np.array_equal(out, x) and np.shares_memory(out, arena)
    out[2, 1] = 5.0
    assert arena[64:112].view(np.float32)[7] == 5.0


def test_bf16_round_trip_through_our_own_consumer():
    # NumPy has no bfloat16 in DLPack; import_tensor is the NumPy-side consumer for bf16 views
    arena = np.zeros(64, np.uint8)
    back = import_tensor(ArenaView(arena, 16, "bf16", (2, 4)))
    assert back.dtype == "bf16" and np.shares_memory(back.data, arena)
    back.array()[1, 3] = 1.5
    assert arena[16:32].view(ml_dtypes.bfloat16)[7] == 1.5


@pytest.mark.parametrize("dtype", list(TORCH))
def test_torch_tensor_out_shares_the_arena(dtype):
    arena = np.zeros(512, np.uint8)
    values = np.random.default_rng(1).standard_normal((3, 4)).astype(NUMPY[dtype])
    arena[128:128 + values.nbytes] = values.view(np.uint8).reshape(-1)
    t = torch.from_dlpack(ArenaView(arena, 128, dtype, (3, 4)))
    assert t.dtype == TORCH[dtype] and t.shape == (3, 4)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[values.itemsize]
    assert np.array_equal(t.view(bits).numpy(), values.view(f"<i{values.itemsize}"))  # bit-exact, bf16 too
    arena[128:128 + values.itemsize] = np.array([2.0], NUMPY[dtype]).view(np.uint8)
    assert t[0, 0].item() == 2.0
    t[2, 3] = -1.0
    assert arena[128:128 + values.nbytes].view(NUMPY[dtype])[11] == -1.0


def test_the_arena_lives_while_torch_holds_a_view():
    arena = np.ones(64, np.uint8)
    alive = weakref.ref(arena)
    view = ArenaView(arena, 0, "f32", (4,))
    t = torch.from_dlpack(view)
    del arena, view
    gc.collect()
    assert alive() is not None
    assert t.view(torch.uint8)[0].item() == 1
    del t
    gc.collect()
    assert alive() is None


def test_an_unconsumed_capsule_releases_the_arena():
    arena = np.ones(64, np.uint8)
    alive = weakref.ref(arena)
    capsules = [ArenaView(arena, 0, "f32", (4,)).__dlpack__(),
                ArenaView(arena, 0, "f32", (4,)).__dlpack__(max_version=(1, 0))]
    del arena
    gc.collect()
    assert alive() is not None
    del capsules
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("versioned", [False, True])
def test_the_producer_deleter_runs_once_when_the_last_view_dies(versioned):
    made = HandMade(versioned=versioned)
    capsule = made.capsule()
    taken = import_capsule(capsule)
    assert _capsule_name(capsule) == (b"used_dltensor_versioned" if versioned else b"used_dltensor")
    part = taken.array()[1]
    del taken
    gc.collect()
    assert made.deleted == 0 and part.tolist() == made.buffer[12:24].view(np.float32).tolist()
    del part
    gc.collect()
    assert made.deleted == 1
    del capsule
    gc.collect()
    assert made.deleted == 1


def test_a_capsule_is_taken_once():
    made = HandMade()
    capsule = made.capsule()
    taken = import_capsule(capsule)
    with pytest.raises(DLPackError, match="imported once"):
        import_capsule(capsule)
    del taken
    gc.collect()
    assert made.deleted == 1


def test_wrong_dtype_is_refused_by_name_and_handed_back():
    made = HandMade(code=0, bits=64)
    with pytest.raises(DLPackError, match="int64") as refused:
        import_capsule(made.capsule())
    assert made.deleted == 1 and refused.tb is not None  # handed back at once, not when the traceback dies
    with pytest.raises(DLPackError, match="int64.*f32, f16, bf16, f64 and i32"):
        import_tensor(torch.arange(4, dtype=torch.int64))
    with pytest.raises(DLPackError, match="int16"):
        import_tensor(torch.arange(4, dtype=torch.int16))


def test_int32_enters_as_the_abis_i32():
    taken = import_tensor(torch.tensor([0, 3, 7], dtype=torch.int32))
    assert taken.dtype == "i32" and taken.array().tolist() == [0, 3, 7]


def test_unknown_major_version_is_refused_and_handed_back():
    made = HandMade(versioned=True, major=2)
    with pytest.raises(DLPackError, match="DLPack 2"):
        import_capsule(made.capsule())
    assert made.deleted == 1


def test_a_cuda_capsule_gives_pointer_size_and_device():
    made = HandMade(shape=(2, 4), code=4, bits=16, device=(2, 1), byte_offset=16, versioned=True)
    taken = import_capsule(made.capsule())
    assert isinstance(taken, DeviceTensor)
    assert (taken.pointer, taken.nbytes, taken.device, taken.device_id, taken.dtype, taken.shape) == \
        (made.buffer.ctypes.data + 16, 16, "cuda", 1, "bf16", (2, 4))
    assert made.deleted == 0
    del taken
    gc.collect()
    assert made.deleted == 1


def test_byte_offset_is_applied_on_the_host():
    made = HandMade(shape=(3,), byte_offset=8)
    taken = import_capsule(made.capsule())
    assert np.shares_memory(taken.data, made.buffer) and taken.data.tolist() == list(range(8, 20))


def test_an_opencl_capsule_is_refused_by_device():
    made = HandMade(device=(4, 0))
    with pytest.raises(DLPackError, match="opencl"):
        import_capsule(made.capsule())
    assert made.deleted == 1


@pytest.mark.parametrize("strided", [lambda: torch.randn(4, 6).t(), lambda: torch.randn(4, 6)[:, ::2],
                                     lambda: np.zeros((4, 6), np.float32)[::2]])
def test_a_strided_view_is_refused_not_copied(strided):
    with pytest.raises(DLPackError, match="not row-major dense.*contiguous"):
        import_tensor(strided())


def test_strides_of_size_one_dimensions_and_null_strides_are_dense():
    for shape, strides in (((1, 4), (999, 1)), ((2, 3), None)):
        made = HandMade(shape=shape, strides=strides)
        taken = import_capsule(made.capsule())
        assert taken.shape == shape and np.array_equal(taken.data, made.buffer[:taken.nbytes])
    strided = HandMade(shape=(2, 3), strides=(1, 2))
    with pytest.raises(DLPackError, match="strides"):
        import_capsule(strided.capsule())
    assert strided.deleted == 1


def test_read_only_memory_gives_a_read_only_view():
    x = np.ones(4, np.float32)
    x.flags.writeable = False
    assert not import_tensor(x).data.flags.writeable
    made = HandMade(versioned=True, flags=1)
    assert not import_capsule(made.capsule()).data.flags.writeable


def test_export_arguments_are_checked():
    arena = np.zeros(64, np.uint8)
    with pytest.raises(DLPackError, match="outside the arena"):
        ArenaView(arena, 60, "f32", (2,))
    with pytest.raises(DLPackError, match="'i64' is not an ABI dtype"):
        ArenaView(arena, 0, "i64", (2,))
    assert torch.from_dlpack(ArenaView(arena, 0, "i32", (2,))).dtype == torch.int32  # the §8 integer tensors
    view = ArenaView(arena, 0, "f32", (2,))
    with pytest.raises(DLPackError, match="device"):
        view.__dlpack__(dl_device=(2, 0))
    arena[:8] = np.array([3.0, 4.0], np.float32).view(np.uint8)
    copied = torch.from_dlpack(view, copy=True)
    assert copied.tolist() == [3.0, 4.0]
    copied[0] = 1.0
    assert arena[:4].view(np.float32)[0] == 3.0

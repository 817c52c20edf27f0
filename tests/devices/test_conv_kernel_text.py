"""kernels/conv.cl (causal_conv1d, ABI.md §10) builds and runs: on an OpenCL CPU device through pyopencl, every
kernel against the float64 reference (rlx_gpu.conformance.reference_conv) over widths, packed sequences
with empty and short ones, chunk boundaries inside a sequence's first width-1 tokens, carried state (in the
thunk's dtype or f32 beside a 16-bit thunk), slots, bias and silu; the backward the same bytes on every run;
and NVRTC compiles the same text in the CUDA dialect. Arguments are bound by the kernels' own parameter
names, read from the text."""
from __future__ import annotations

import re

import numpy as np
import pytest

from host_fallback.arena import COMPUTE, STORAGE
from rlx_gpu.backends import programs
from rlx_gpu.conformance import reference_conv as ref
from rlx_gpu.paths import data_dir

TEXT = (data_dir("kernels") / "conv.cl").read_text()
#: tolerance of each dtype against the float64 reference (inputs rounded to the dtype first)
TOL = {"f32": 2e-5, "f64": 1e-12, "f16": 4e-3, "bf16": 3e-2}


def source(dialect: str, dtype: str, target: str = "cpu") -> str:
    """conv.cl's program as the backends assemble one (rlx_gpu.backends.programs): defines, prelude, common."""
    kernels = data_dir("kernels")
    return "".join([programs.defines(dtype, None, target), programs.prelude_path(dialect).read_text(),
                    (kernels / "common.cl").read_text(), TEXT])


def parameters() -> dict[str, list[tuple[str, str]]]:
    """Each kernel's ``(type, name)`` parameters, in order."""
    found = {}
    for name, params in re.findall(r"^KERNEL (\w+)\(([^)]*)\)", TEXT, re.M):
        found[name] = [re.fullmatch(r"(GLOBAL uchar\*|i64|int|real)\s*(\w+)|(.*)", " ".join(p.split())).groups()[:2]
                       for p in params.split(",")]
    return found


def test_every_parameter_is_a_tensor_with_its_offset_or_a_scalar():
    for kernel, params in parameters().items():
        for i, (kind, name) in enumerate(params):
            assert kind in ("GLOBAL uchar*", "i64", "int", "real"), (kernel, kind, name)
            if kind == "GLOBAL uchar*":
                assert params[i + 1][0] == "i64", (kernel, name)


def test_no_multi_line_macros():
    continued = [n for n, line in enumerate(TEXT.splitlines(), 1) if line.rstrip().endswith("\\")]
    assert not continued, f"kernels/conv.cl continues a macro at lines {continued}"


# --- OpenCL CPU device ------------------------------------------------------------------------------

cl = pytest.importorskip("pyopencl")
from support.conformance_devices import KERNEL_OPENCL, SPECS  # noqa: E402


class Device:
    """One OpenCL device with conv.cl built per dtype; runs a kernel by name with named arguments over one
    arena (every tensor at its byte offset)."""

    def __init__(self, spec: str):
        _, platform, index = spec.split(":")
        self.device = cl.get_platforms()[int(platform)].get_devices()[int(index)]
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self.built: dict[str, object] = {}
        self.kernels: dict[tuple[str, str], object] = {}

    def kernel(self, dtype: str, name: str):
        if dtype not in self.built:
            self.built[dtype] = cl.Program(self.context, source("opencl", dtype)).build(options=["-cl-std=CL1.2"])
        if (dtype, name) not in self.kernels:
            self.kernels[dtype, name] = cl.Kernel(self.built[dtype], name)
        return self.kernels[dtype, name]

    def run(self, dtype: str, kernel: str, grid: tuple[int, int], arena: "Arena", **args) -> None:
        real = COMPUTE[dtype].type
        values, buffer = [], None
        for kind, name in parameters()[kernel]:
            if kind == "GLOBAL uchar*":
                values.append(arena.buffer)
                buffer = name
            elif buffer is not None:  # the buffer's byte offset
                values.append(np.int64(arena.offsets[buffer]))
                buffer = None
            elif kind == "real":
                values.append(real(args.pop(name)))
            else:
                values.append((np.int64 if kind == "i64" else np.int32)(args.pop(name)))
        assert not args, f"{kernel} has no parameters {sorted(args)}"
        local = (8, 1)
        global_size = (-(-grid[0] // 8) * 8, grid[1])
        self.kernel(dtype, kernel)(self.queue, global_size, local, *values)
        self.queue.finish()


class Arena:
    """Tensors at 64-byte aligned offsets of one buffer, by the kernels' buffer parameter names."""

    def __init__(self, device: Device, tensors: dict[str, np.ndarray]):
        self.offsets, chunks, size = {}, [], 0
        for name, array in tensors.items():
            self.offsets[name] = size
            raw = np.ascontiguousarray(array).view(np.uint8).ravel()
            chunks.append((size, raw))
            size += -(-max(raw.size, 1) // 64) * 64
        self.bytes = np.zeros(size + 64, np.uint8)
        for at, raw in chunks:
            self.bytes[at:at + raw.size] = raw
        self.device = device
        self.buffer = cl.Buffer(device.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                                hostbuf=self.bytes)
        self.shapes = {name: (array.dtype, array.shape) for name, array in tensors.items()}

    def read(self, name: str) -> np.ndarray:
        cl.enqueue_copy(self.device.queue, self.bytes, self.buffer)
        dtype, shape = self.shapes[name]
        at = self.offsets[name]
        return self.bytes[at:at + dtype.itemsize * int(np.prod(shape))].view(dtype).reshape(shape).astype(np.float64)


DEVICES: dict[str, Device] = {}


def device(spec: str) -> Device:
    if spec not in DEVICES:
        DEVICES[spec] = Device(spec)
    return DEVICES[spec]


def _inputs(width, dtype, state_dtype, varlen, carry, slots, seed=0):
    rng = np.random.default_rng(seed)
    dim, cu = 5, [0, 0, 2, 3, 3, 21, 22, 22]
    shape = (1, cu[-1], dim) if varlen else (3, 9, dim)
    rows = len(cu) - 1 if varlen else shape[0]
    entries = rows + 2 if slots else rows
    store = STORAGE[dtype]
    t = dict(xb=rng.standard_normal(shape).astype(store), wb=rng.standard_normal((dim, width)).astype(store),
             biasb=rng.standard_normal(dim).astype(store),
             stb=rng.standard_normal((entries, dim, width - 1)).astype(STORAGE[state_dtype]),
             cub=np.array(cu if varlen else [0], np.int32),
             slb=np.array(rng.permutation(entries)[:rows], np.int32),
             ddb=rng.standard_normal(shape).astype(store),
             dsb=rng.standard_normal((entries, dim, width - 1)).astype(STORAGE[state_dtype]))
    if not carry:
        t["stb"], t["dsb"] = t["stb"][:0], t["dsb"][:0]
    fields = dict(cu_seqlens=cu if varlen else None, state_slots=t["slb"] if slots else None)
    return t, fields, rows


def _flags(dtype, state_dtype, varlen, carry, slots, activation, rows, shape, width):
    return dict(R=rows, S=shape[1], D=shape[2], W=width, carry=carry, varlen=varlen, slotted=slots,
                state_real=state_dtype != dtype, has_bias=1, silu=activation == "silu")


CASES = [  # (dtype, state_dtype, varlen, carry, slots)
    ("f32", "f32", False, False, False), ("f32", "f32", False, True, True), ("f32", "f32", True, True, True),
    ("f32", "f32", True, False, False), ("f64", "f64", True, True, True), ("f16", "f32", True, True, True),
    ("bf16", "bf16", False, True, False),
]


@pytest.mark.skipif(not KERNEL_OPENCL, reason=f"no OpenCL device among {SPECS}")
@pytest.mark.parametrize("spec", KERNEL_OPENCL[:1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join([c[0], "st" + c[1]] + [n for n, on in zip(
    ("varlen", "carry", "slots"), c[2:]) if on]))
@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_kernels_match_the_reference(spec, case, width, activation):
    dtype, state_dtype, varlen, carry, slots = case
    dev = device(spec)
    t, fields, rows = _inputs(width, dtype, state_dtype, varlen, carry, slots)
    shape = t["xb"].shape
    total = shape[0] * shape[1]
    values = {name: a.astype(np.float64) for name, a in t.items() if name not in ("cub", "slb")}
    state = values["stb"] if carry else None
    y_want = ref.causal_conv1d(values["xb"], values["wb"], bias=values["biasb"], activation=activation,
                               state=state, **fields)
    grads = ref.causal_conv1d_backward(values["xb"], values["wb"], values["ddb"], bias=values["biasb"],
                                       activation=activation, state=state, d_state=values["dsb"] if carry else None,
                                       **fields)
    flags = _flags(dtype, state_dtype, varlen, carry, slots, activation, rows, shape, width)
    tol = TOL[dtype]
    for chunk in sorted({1, width - 1, 4, 64}):  # boundaries inside sequences' first width-1 tokens
        chunks = -(-total // chunk)
        arena = Arena(dev, {**t, "db": np.zeros(shape, STORAGE[dtype])})
        dev.run(dtype, "causal_conv1d", (shape[2], chunks), arena, T=chunk, **flags)
        want = y_want[0] if carry else y_want
        np.testing.assert_allclose(arena.read("db"), want, rtol=tol, atol=tol, err_msg=f"dst T={chunk}")
        if carry:
            np.testing.assert_allclose(arena.read("stb"), y_want[1], rtol=tol, atol=tol, err_msg=f"state T={chunk}")
        got = _backward(dev, dtype, t, flags, chunk, chunks, carry)
        for name, field in (("dxb", "d_x"), ("dwb", "d_weight"), ("dbb", "d_bias"), ("dsb", "d_state")):
            if field in grads:
                np.testing.assert_allclose(got[name], grads[field], rtol=4 * tol, atol=4 * tol,
                                           err_msg=f"{field} T={chunk}")
        again = _backward(dev, dtype, t, flags, chunk, chunks, carry)
        assert all(again[name].tobytes() == got[name].tobytes() for name in got)


def _backward(dev, dtype, t, flags, chunk, chunks, carry) -> dict[str, np.ndarray]:
    """The backward's three kernels in order: d_x and the chunks' sums, d_weight / d_bias, d_state."""
    shape, store = t["xb"].shape, STORAGE[dtype]
    part = np.zeros((chunks, shape[2], flags["W"] + 1), COMPUTE[dtype])
    arena = Arena(dev, {**t, "dxb": np.zeros(shape, store), "pb": part, "dwb": np.zeros(t["wb"].shape, store),
                        "dbb": np.zeros(shape[2], store)})
    dev.run(dtype, "causal_conv1d_backward_dx", (shape[2], chunks), arena, T=chunk, **flags)
    dev.run(dtype, "causal_conv1d_backward_weight", (shape[2], 1), arena, D=shape[2], W=flags["W"], chunks=chunks,
            has_bias=1)
    if carry:
        state_flags = {k: v for k, v in flags.items() if k != "carry"}
        dev.run(dtype, "causal_conv1d_backward_state", (shape[2], flags["R"]), arena, **state_flags)
    return {name: arena.read(name) for name in ("dxb", "dwb", "dbb", "dsb")}


@pytest.mark.skipif(not KERNEL_OPENCL, reason=f"no OpenCL device among {SPECS}")
def test_decode_step_is_one_launch_straight_on_the_pool():
    """Three rows of one token each into slots 4, 0, 2 of a pool of 5: outputs and pool as the reference's;
    the entries no row names keep their bytes."""
    dev = device(KERNEL_OPENCL[0])
    rng = np.random.default_rng(3)
    dim, width = 7, 4
    x = rng.standard_normal((3, 1, dim)).astype(np.float32)
    weight = rng.standard_normal((dim, width)).astype(np.float32)
    pool, slots = rng.standard_normal((5, dim, width - 1)).astype(np.float32), np.array([4, 0, 2], np.int32)
    arena = Arena(dev, dict(xb=x, wb=weight, biasb=np.zeros(dim, np.float32), stb=pool, cub=np.zeros(1, np.int32),
                            slb=slots, db=np.zeros(x.shape, np.float32)))
    dev.run("f32", "causal_conv1d", (dim, 1), arena, R=3, S=1, D=dim, W=width, T=width - 1, carry=1, varlen=0,
            slotted=1, state_real=0, has_bias=0, silu=1)
    y, final = ref.causal_conv1d(x, weight, activation="silu", state=pool, state_slots=slots)
    np.testing.assert_allclose(arena.read("db"), y, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(arena.read("stb"), final)


# --- NVRTC ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_nvrtc_compiles_the_cuda_dialect(dtype):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")
    from rlx_gpu.backends import nvrtc

    prog = programs.Program("cuda", "conv", dtype, None, source("cuda", dtype, "gpu"), "gpu")
    built = nvrtc.build(prog, "sm_90")
    usage = nvrtc.resource_usage(built.log)
    assert set(usage) == set(parameters()), usage
    assert all(u.spill_stores == 0 and u.stack == 0 for u in usage.values()), usage

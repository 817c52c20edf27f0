"""The tensor-core variants (``RLX_MMA``, issue 38) of the chunked mamba2, gated_delta_net and mamba3 kernels (and of
their chunked backwards').

No GPU runs them here; what this machine can check: the planners give the define only on CUDA devices with
tensor cores (16-bit thunks, and f32 with TF32 asked for), never at the cpu target nor on OpenCL, whose
prelude refuses it; every variant builds with NVRTC for sm_80 and sm_90 within the sm_90 budgets (0 spill,
0 stack, the state-space kernels' 128 registers); the chunk GEMM kernels' PTX holds the warp MMA
instructions of the operand type (and the portable twin's none); and the CudaSession, driven through the
CuPy contract double, plans and launches every chunked op x 16-bit dtype (and TF32) with them, each launch
marshalled against the MMA program's own PTX.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest

from host_fallback.abi import regions
from support import cuda_builds

from rlx_gpu import launches
from rlx_gpu.backends import nvrtc, programs
from rlx_gpu.conformance import cases
from rlx_gpu.launches.limits import REFERENCE_GPU, DeviceLimits
from rlx_gpu.launches.mma import MMA_16BIT, MMA_NONE, MMA_OF_DTYPE, MMA_TF32, device_mma, mma_defines
from rlx_gpu.launches.ssm import SWITCHES as SSM_SWITCHES

#: the kernels whose chunk products take the tensor cores, per program family
MMA_KERNELS = {"ssm": ("mamba2_chunk_state", "mamba2_chunk_scan"),
               "gdn": ("gated_delta_net_chunk_prep", "gated_delta_net_state_pass", "gated_delta_net_chunk_out"),
               "mamba3": ("mamba3_chunk_state", "mamba3_chunk_scan"),
               "mamba2_backward": ("mamba2_backward_dstate", "mamba2_backward_chunk"),
               "mamba3_backward": ("mamba3_cb_chunk",),
               "gdn_backward": ("gdn_chunk_back_pass", "gdn_chunk_back_grads")}
FAMILY = {"mamba2": "ssm", "gated_delta_net": "gdn", "mamba3": "mamba3", "mamba2_backward": "mamba2_backward",
          "mamba3_backward": "mamba3_backward", "gated_delta_net_backward": "gdn_backward"}
VARIANT = MMA_OF_DTYPE  # per dtype: 16-bit inputs, or TF32 for f32
#: the operand type the warp MMA operand loads name, per dtype
OPERAND = {"f16": ".f16", "bf16": ".bf16", "f32": ".tf32"}
STATE_SPACE_REGISTERS = 128  # tests/devices/test_ptxas.py's budget of the state-space kernels
#: and its larger ones: the backward step walks in the programs of the chunked backwards' variants (mamba3's,
#: gated_delta_net's: tests/devices/test_ptxas.py's budgets)
REGISTERS = {"mamba3_backward_walk": 208, "gated_delta_net_backward": 176}
ON_CUDA = dataclasses.replace(REFERENCE_GPU, mma=MMA_16BIT)
ON_CUDA_TF32 = dataclasses.replace(REFERENCE_GPU, mma=MMA_TF32)
CHUNKED = {"ssm_kernel": "chunked"}


def _thunk(op: str, dtype: str, **extra) -> dict:
    thunk, _ = cases.lay_out(op, dtype, {**cases.SMALL[op], "seq": 64, **extra})
    return thunk


#: gated_delta_net with per-channel gates past one tile each way: key channels over three 16-channel slices, full
#: chunks and a partial one, grouped value heads (packed sequences and slots are run-time data the CuPy double's
#: arena does not hold: tests/devices/test_mma_emulated.py runs them)
GDN_CHANNEL_WIDE = dict(batch=2, seq=150, heads=2, state_size=40, gate_per_channel=True, carry_state=True,
                        value_heads=4, value_size=20)
#: the chunked ops: mamba2, gated_delta_net with per-head and per-channel gates, mamba3, mamba2's and mamba3's backward,
#: gated_delta_net's with per-head and per-channel gates (its key channels and columns past one 16-wide slice)
OPS = (("mamba2", {}), ("gated_delta_net", {"gate_per_channel": False}),
       ("gated_delta_net", {"gate_per_channel": True}), ("gated_delta_net", GDN_CHANNEL_WIDE), ("mamba3", {}),
       ("mamba2_backward", {}), ("mamba3_backward", {}), ("gated_delta_net_backward", {"gate_per_channel": False}),
       ("gated_delta_net_backward", GDN_CHANNEL_WIDE))
OP_IDS = ["mamba2", "gdn-head", "gdn-channel", "gdn-channel-wide", "mamba3", "mamba2-backward", "mamba3-backward",
          "gdn-backward-head", "gdn-backward-channel-wide"]


# ------------------------------------------------------------------------------------------ planning
@pytest.mark.parametrize("op, extra", OPS, ids=OP_IDS)
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("lim", [REFERENCE_GPU, ON_CUDA, ON_CUDA_TF32], ids=["no-mma", "mma", "mma-tf32"])
def test_chunked_launches_carry_the_variant_the_device_and_dtype_allow(op, extra, dtype, lim):
    plan = launches.plan(_thunk(op, dtype, **extra), lim, **CHUNKED)
    expected = VARIANT.get(dtype, MMA_NONE) if lim.mma >= VARIANT.get(dtype, MMA_TF32 + 1) else MMA_NONE
    chunk = [item for item in plan.launches if item.kernel in MMA_KERNELS[FAMILY[op]]]
    assert chunk or dtype == "f64"  # f64 keeps the lanes kernel
    # a forward's one program holds the plan's kernels: every launch carries it; the backward's, those with the variant
    carriers = chunk if op.endswith("_backward") else plan.launches if chunk else ()
    for item in carriers:
        assert dict(item.defines).get("RLX_MMA", MMA_NONE) == expected, (item.kernel, dtype, lim.mma, item.defines)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("lim", [REFERENCE_GPU, ON_CUDA, ON_CUDA_TF32], ids=["no-mma", "mma", "mma-tf32"])
def test_mamba2s_backward_recomputes_its_chunk_states_from_split_operands(dtype, lim):
    """Its mamba2_chunk_state launch takes the variant with M2_SPLIT_STATES (rounded once, the states move d_a past
    the bounds: tests/devices/test_mma_emulated.py); the forward's never splits."""
    expected = VARIANT[dtype] if lim.mma >= VARIANT[dtype] else MMA_NONE
    (state,) = [item for item in launches.plan(_thunk("mamba2_backward", dtype), lim, **CHUNKED).launches
                if item.kernel == "mamba2_chunk_state"]
    assert dict(state.defines).get("RLX_MMA", MMA_NONE) == expected
    assert dict(state.defines).get("M2_SPLIT_STATES", 0) == (expected != MMA_NONE)
    forward = launches.plan(_thunk("mamba2", dtype), lim, **CHUNKED).launches
    assert forward and not any("M2_SPLIT_STATES" in dict(item.defines) for item in forward)


def test_no_variant_at_the_cpu_target_nor_before_sm80():
    cpu = DeviceLimits(1024, 1 << 20, True, mma=MMA_TF32)
    assert mma_defines(cpu, "bf16") == ()
    for op, extra in OPS:
        assert not any("RLX_MMA" in dict(item.defines) for item in launches.plan(_thunk(op, "bf16", **extra), cpu).launches)
    assert device_mma((7, 5), tf32=True) == MMA_NONE
    assert (device_mma((8, 0), tf32=False), device_mma((9, 0), tf32=True)) == (MMA_16BIT, MMA_TF32)


def test_the_opencl_prelude_refuses_the_variant():
    """An OpenCL device's limits never allow it (mma 0), and were a launch to ask, the OpenCL text stops."""
    source = programs.program("opencl", "ssm", "bf16", None, "gpu", (("RLX_MMA", 1),)).source
    assert re.search(r"#if defined\(RLX_MMA\) && !defined\(RLX_MMA_EMULATED\)\s+#error", source)
    assert DeviceLimits(1024, 1 << 16, True, target="gpu").mma == MMA_NONE


# ------------------------------------------------------------------------------------------ NVRTC builds
needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cuda.bindings") is None,
                                 reason="cuda-bindings with NVRTC is not installed")

#: every version-2 switch a chunked launch may add (kernels/ssm.cl's; gdn's one variant), per family and dtype
_SSM_EVERY = {dt: tuple((name, 1) for name in SSM_SWITCHES if dt != "f32" or not name.endswith("_F32"))
              for dt in VARIANT}
#: and of batch rows (mamba2's backward)
_SSM_ROWS = {dt: tuple(f for f in every if f[0] != "SSM_VARLEN") for dt, every in _SSM_EVERY.items()}
#: mamba2_chunk_state from split operands, as mamba2's backward launches it (with its fields)
_SPLIT = (("M2_SPLIT_STATES", 1),)
#: mamba3's version-2 fields are runtime flags of its one program
#: gated_delta_net's backward: its every-field variant of batch rows (test_ptxas's)
_GDNB_EVERY = (("GDNB_GATE_K", 1), ("GDNB_NORM", 1), ("SSM_CARRY", 1))
FIELD_VARIANTS = {"ssm": lambda dt: ((), _SSM_EVERY[dt], _SPLIT, _SSM_ROWS[dt] + _SPLIT),
                  "gdn": lambda dt: ((), (("GDN_V2", 1),)),
                  "gdn_backward": lambda dt: ((), _GDNB_EVERY + ((("SSM_STATE_F32", 1),) if dt != "f32" else ())),
                  "mamba3": lambda dt: ((),), "mamba3_backward": lambda dt: ((),), "mamba2_backward": lambda dt: ((), _SSM_ROWS[dt])}


def _mma_programs():
    out = []
    for family in MMA_KERNELS:
        for dtype, variant in VARIANT.items():
            for fields in FIELD_VARIANTS[family](dtype):
                prog = programs.program("cuda", family, dtype, None, "gpu", fields + (("RLX_MMA", variant),))
                named = ("-every-field" if set(fields) - set(_SPLIT) else "") + \
                    ("-split-states" if _SPLIT[0] in fields else "")
                out.append(pytest.param(prog, id=f"{family}-{dtype}-RLX_MMA{variant}{named}"))
    return out


def _bodies(ptx: str) -> dict[str, str]:
    """Each kernel's PTX body, by name (the entries follow one another; helpers are inlined)."""
    parts = re.split(r"\.entry (\w+)\(", ptx)
    return dict(zip(parts[1::2], parts[2::2]))


@needs_nvrtc
@pytest.mark.parametrize("prog", _mma_programs())
def test_mma_variant_meets_sm90_budgets_and_runs_on_the_tensor_cores(prog):
    built = cuda_builds.build(prog)
    usage = nvrtc.resource_usage(built.log)
    over = {k: u for k, u in usage.items()
            if u.spill_stores or u.spill_loads or u.stack or u.registers > REGISTERS.get(k, STATE_SPACE_REGISTERS)}
    assert usage and not over, f"{prog.label} over budget (0 spill, 0 stack, {STATE_SPACE_REGISTERS} registers): {over}"
    bodies = _bodies(built.ptx)
    for kernel in MMA_KERNELS[prog.family]:
        assert "wmma.mma.sync.aligned" in bodies[kernel], f"{prog.label}: {kernel} has no wmma.mma"
        loads = set(re.findall(r"wmma\.load\.[ab]\.sync\S*", bodies[kernel]))  # the operands' type ends the name
        assert loads and all(m.endswith(OPERAND[prog.dtype]) for m in loads), (prog.label, kernel, loads)
    assert nvrtc.flushing_instructions(built.ptx) == [], f"{prog.label} flushes f32 subnormals"


@needs_nvrtc
@pytest.mark.parametrize("family", sorted(MMA_KERNELS))
def test_the_portable_twin_has_no_mma(family):
    """The check above can fail: the same program without RLX_MMA holds no MMA instruction."""
    ptx = cuda_builds.build(programs.program("cuda", family, "bf16", None, "gpu")).ptx
    assert "wmma" not in ptx and "mma.sync" not in ptx


@needs_nvrtc
@pytest.mark.parametrize("family", sorted(MMA_KERNELS))
def test_mma_variant_builds_for_sm80(family):
    for dtype, variant in VARIANT.items():
        built = cuda_builds.build(programs.program("cuda", family, dtype, None, "gpu", (("RLX_MMA", variant),)), "sm_80")
        assert "wmma.mma.sync" in built.ptx and len(built.cubin) > 1000


# ------------------------------------------------------------------------------------------ the CuPy double
def _f32_variants(limits: DeviceLimits) -> set[int]:
    """The ``RLX_MMA`` values the chunk GEMM kernels of every chunked op's f32 plan take at ``limits``."""
    return {dict(item.defines).get("RLX_MMA", MMA_NONE) for op, extra in OPS
            for item in launches.plan(_thunk(op, "f32", **extra), limits, **CHUNKED).launches
            if item.kernel in MMA_KERNELS[FAMILY[op]]}


@needs_nvrtc
@pytest.mark.parametrize("configured, env, tf32", [(False, None, False), (True, None, True), (True, "0", False),
                                                   (False, "1", True)])
def test_the_config_asks_for_tf32_and_the_environment_overrides_it(monkeypatch, tmp_path, configured, env, tf32):
    """``cuda.tf32`` in the config gives the session TF32 (the chunk kernels' variant 2 on an f32 thunk, cuBLAS's
    TF32 compute); ``RLX_CUDA_TF32``, where set, wins over it either way."""
    from support.cupy_double import installed

    from rlx_gpu.runtime.executor import get_device

    config = tmp_path / "rlx.yaml"
    config.write_text(f"cuda:\n  tf32: {str(configured).lower()}\n")
    if env is None:
        monkeypatch.delenv("RLX_CUDA_TF32", raising=False)
    else:
        monkeypatch.setenv("RLX_CUDA_TF32", env)
    monkeypatch.setenv("RLX_TARGET", "gpu")
    with installed(monkeypatch):
        session = get_device("cuda:0", str(config)).session
        assert session.tf32 is tf32 and session.limits.mma == (MMA_TF32 if tf32 else MMA_16BIT)
        assert _f32_variants(session.limits) == {MMA_TF32 if tf32 else MMA_NONE}


@needs_nvrtc
def test_a_tf32_variable_other_than_0_or_1_is_refused(monkeypatch):
    from support.cupy_double import installed

    from rlx_gpu.errors import DeviceError
    from rlx_gpu.runtime import registry

    monkeypatch.setenv("RLX_CUDA_TF32", "yes")
    with installed(monkeypatch):
        with pytest.raises(DeviceError, match=r"RLX_CUDA_TF32='yes': expected 1 \(TF32 on\) or 0"):
            registry.open_session(registry.status("cuda").devices[0])


@needs_nvrtc
def test_a_session_opened_under_the_variable_is_not_handed_out_once_it_is_unset(monkeypatch):
    from support.cupy_double import installed

    from rlx_gpu.runtime import registry

    with installed(monkeypatch):
        device = registry.status("cuda").devices[0]
        monkeypatch.setenv("RLX_CUDA_TF32", "1")
        assert registry.open_session(device).tf32  # the config says off: the variable wins
        monkeypatch.delenv("RLX_CUDA_TF32")
        assert not registry.open_session(device).tf32  # the config's setting again, not the cached TF32 session
        assert registry.open_session(device, True).tf32


@needs_nvrtc
@pytest.mark.parametrize("tf32", [False, True], ids=["16-bit", "tf32"])
def test_the_cuda_session_launches_every_chunked_op_and_dtype_with_the_variant(monkeypatch, tf32):
    from support.cupy_double import installed

    from rlx_gpu.runtime import registry

    if tf32:
        monkeypatch.setenv("RLX_CUDA_TF32", "1")
    else:  # TF32 is off unless asked for, as torch's allow_tf32
        monkeypatch.delenv("RLX_CUDA_TF32", raising=False)
    monkeypatch.setenv("RLX_TARGET", "gpu")
    dtypes = ("f32",) if tf32 else ("f16", "bf16")
    with installed(monkeypatch) as machine:
        st = registry.status("cuda")
        assert st.available, st.reason
        session = registry.open_session(st.devices[0])
        assert session.limits.mma == (MMA_TF32 if tf32 else MMA_16BIT)
        # an f32 thunk keeps FP32 FMA unless TF32 is asked for
        assert _f32_variants(session.limits) == {MMA_TF32 if tf32 else MMA_NONE}
        built = {}
        build = session.prims.build_program
        monkeypatch.setattr(session.prims, "build_program", lambda prog: built.setdefault(prog, build(prog)))
        for op, extra in OPS:
            for dtype in dtypes:
                before = len(machine.launches)
                thunk = _thunk(op, dtype, **extra)
                arena = session.alloc(max(r.offset + r.nbytes for r in regions(thunk)) + 64)
                session.launch(thunk, arena, **CHUNKED)
                ran = {r.kernel for r in machine.launches[before:]}
                assert set(MMA_KERNELS[FAMILY[op]]) <= ran, (op, dtype, ran)
        variants = {(p.family, p.dtype) for p in built if dict(p.defines).get("RLX_MMA") == VARIANT[p.dtype]}
        # mamba2's backward recomputes its chunk states in the ssm program's split variant
        assert {p.dtype for p in built if p.family == "ssm" and "M2_SPLIT_STATES" in dict(p.defines)} == set(dtypes)
        assert variants == {(family, dt) for family in MMA_KERNELS for dt in dtypes}, built
        for prog in built:
            if "RLX_MMA" in dict(prog.defines):
                assert "wmma.mma.sync" in cuda_builds.build(prog).ptx

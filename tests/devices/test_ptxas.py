"""The gpu-target CUDA programs meet their sm_90 budgets, and every launch matches its kernel's signature.

Each program is compiled with NVRTC for sm_90 (cubin, PTX and ptxas's ``-v`` report; no GPU needed)
once per machine, through the session's cache (``cuda_builds``). Budgets: 0 spill bytes and 0 stack
bytes for every kernel in f32, f16 and bf16 (the recurrent family's version-2 variants in f32, the
storage types adding only loads and stores); at most 128 registers for the state-space kernels and 255 (the hardware limit) for the
rest; f64 is built and listed, and may spill. No f32 arithmetic flushes subnormals (``.ftz``).
Signatures: CuPy packs each launch argument by its size and checks nothing, so every planner's Launch
must match its kernel's PTX parameter list in count, width and kind (integer / floating point).
"""
from __future__ import annotations

from support import cuda_builds
import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings with NVRTC is not installed")

import numpy as np  # noqa: E402

import rlx_gpu  # noqa: E402

from rlx_gpu import launches  # noqa: E402
from rlx_gpu.backends import nvrtc, programs  # noqa: E402
from rlx_gpu.conformance import cases  # noqa: E402
from rlx_gpu.launches import Buf  # noqa: E402
from rlx_gpu.launches.limits import (RNN_FIELD_VARIANTS, REFERENCE_GPU, DeviceLimits, gate_variant,  # noqa: E402
                                     state_variant, variants)
from rlx_gpu.launches.ssm import SWITCHES as SSM_SWITCHES  # noqa: E402
from support.rnn_fields import BACKWARD_FIELDS as RNN_BACKWARD_FIELDS  # noqa: E402  (their backward ops)
from support.rnn_fields import FIELDS as RNN_FIELDS  # noqa: E402  (one case per op with every §8 field)

#: register budget per kernel at sm_90 (f32/f16/bf16); kernels not listed get the hardware's 255
STATE_SPACE_REGISTERS = 128
REGISTERS = {kernel: STATE_SPACE_REGISTERS for kernel in (
    "selective_scan_lanes", "selective_scan_chunked", "mamba2_lanes", "mamba2_chunk_state", "mamba2_state_pass",
    "mamba2_chunk_scan", "gated_delta_net_lanes", "gated_delta_net_chunk_prep", "gated_delta_net_state_pass",
    "gated_delta_net_chunk_out", "mamba3_lanes", "mamba3_lanes_final", "mamba3_chunk_turn", "mamba3_chunk_state",
    "mamba3_state_pass", "mamba3_chunk_scan", "mamba2_backward_dstate", "mamba2_backward_pass", "mamba2_backward_chunk",
    "mamba3_cb_states", "mamba3_cb_pass", "mamba3_cb_chunk", "gdn_chunk_back_pass", "gdn_chunk_back_grads",
)}
#: the state-space backward walks (kernels/ssm_backward.cl, gdn_backward.cl: a whole reverse walk inlined into
#: one kernel; f32/bf16 128-164 registers measured) and their reductions
BACKWARD_WALK_REGISTERS = 176
REGISTERS.update({**dict.fromkeys(("selective_scan_backward", "mamba2_backward", "gated_delta_net_backward"),
                                  BACKWARD_WALK_REGISTERS),
                  **dict.fromkeys(("ssm_backward_reduce", "gdn_backward_qk"), STATE_SPACE_REGISTERS)})
#: mamba3_backward's walk (kernels/mamba3_backward.cl: the forward's step and its reverse inlined, its argument
#: groups' pointers live; f32/f16/bf16 194-196 registers measured, no spill; bounding it to 168 or 128 spilled 200-960 B)
#: and its per-token, per-head and reduce launches
REGISTERS.update({"mamba3_backward_walk": 208, **dict.fromkeys(
    ("mamba3_backward_turn", "mamba3_backward_tokens", "mamba3_backward_angles", "mamba3_backward_reduce"),
    STATE_SPACE_REGISTERS)})
HARDWARE_REGISTERS = 255
BUDGET_DTYPES = ("f32", "f16", "bf16")
CPU = DeviceLimits(1024, 1 << 20, True)  # a cpu-target device



def _gpu_programs(dtypes):
    out = []
    for family in programs.FAMILIES:
        for dtype in dtypes:
            for defines in variants(family, "gpu"):
                if defines in RNN_FIELD_VARIANTS and dtype != "f32":
                    continue  # the version-2 recurrent programs: f32 (16-bit storage adds only loads and stores)
                src = "f32" if family == "cast" else None  # a cast program holds its kernel only with a source dtype
                prog = programs.program("cuda", family, dtype, src, "gpu", defines)
                out.append(pytest.param(prog, id=f"{family}-{dtype}" + "".join(f"-{k}{v}" for k, v in defines)))
    return out


def _ssm_version2_programs():
    """The state-space programs with every version-2 switch of kernels/ssm.cl on (the most each kernel
    holds), as the planners emit them: an f32 thunk without the f32-beside-16-bit switches, a bf16 one
    with them; the chunked program and the lanes kernels at the smallest and largest state variant."""
    every = {dt: tuple((name, 1) for name in SSM_SWITCHES if dt == "bf16" or not name.endswith("_F32"))
             for dt in ("f32", "bf16")}
    out = []
    for dtype, variant in (("f32", ()), ("bf16", ()), ("f32", state_variant(16)), ("bf16", state_variant(256))):
        prog = programs.program("cuda", "ssm", dtype, None, "gpu", variant + every[dtype])
        out.append(pytest.param(prog, id=f"ssm-{dtype}-every-field" + "".join(f"-{k}{v}" for k, v in variant)))
    gdn_every = {dt: (("GDNB_GATE_K", 1), ("GDNB_NORM", 1), ("SSM_CARRY", 1), ("SSM_VARLEN", 1), ("SSM_SLOTS", 1))
                 + ((("SSM_STATE_F32", 1),) if dt == "bf16" else ()) for dt in ("f32", "bf16")}
    for dtype in ("f32", "bf16"):  # the backward kernels have no state-size variant
        for family, defines in (("ssm_backward", every[dtype]), ("gdn_backward", gdn_every[dtype]),
                                ("mamba2_backward", tuple(f for f in every[dtype] if f[0] != "SSM_VARLEN"))):
            prog = programs.program("cuda", family, dtype, None, "gpu", defines)
            out.append(pytest.param(prog, id=f"{family}-{dtype}-every-field"))
    return out


def _rnn_reserve_programs():
    """The recurrent programs with a saved forward (ABI.md §9.1): the forward writing it (RNN_SAVE), the backward
    reading it (RNN_SAVED), for each op and each representative version-2 variant, in f32 and bf16."""
    out = []
    for family, flag in (("rnn", "RNN_SAVE"), ("rnn_backward", "RNN_SAVED")):
        for base in tuple(gate_variant(g) for g in (4, 3, 1)) + RNN_FIELD_VARIANTS:
            for dtype in ("f32", "bf16"):
                prog = programs.program("cuda", family, dtype, None, "gpu", base + ((flag, 1),))
                out.append(pytest.param(prog, id=f"{family}-{dtype}-{flag}" + "".join(f"-{k}{v}" for k, v in base)))
    return out


@pytest.mark.parametrize("prog", _gpu_programs(BUDGET_DTYPES) + _ssm_version2_programs() + _rnn_reserve_programs())
def test_gpu_program_meets_sm90_budgets(prog):
    usage = nvrtc.resource_usage(cuda_builds.build(prog).log)
    assert usage, f"no ptxas report for {prog.label}"
    over = {k: u for k, u in usage.items()
            if u.spill_stores or u.spill_loads or u.stack or u.registers > REGISTERS.get(k, HARDWARE_REGISTERS)}
    assert not over, f"{prog.label} over budget (0 spill, 0 stack, registers {REGISTERS}): {over}"


@pytest.mark.parametrize("prog", _gpu_programs(("f64",)))
def test_gpu_f64_program_builds_and_is_listed(prog):
    """f64 may spill; it must still build, and ptxas must report every kernel of the program."""
    built = cuda_builds.build(prog)
    usage = nvrtc.resource_usage(built.log)
    assert set(usage) == set(nvrtc.parameters(built.ptx)), usage
    assert len(built.cubin) > 1000


@pytest.mark.parametrize("family", programs.FAMILIES)
def test_f32_ptx_does_not_flush_subnormals(family):
    for target in ("gpu", "cpu"):
        for defines in variants(family, target):
            prog = programs.program("cuda", family, "f32", None, target, defines)
            assert nvrtc.flushing_instructions(cuda_builds.build(prog).ptx) == [], f"{prog.label} flushes f32 subnormals"


def test_flush_check_sees_ftz():
    """The check above can fail: the same program built with --ftz=true flushes."""
    prog = programs.program("cuda", "rnn", "f32", None, "gpu", gate_variant(4))
    assert nvrtc.flushing_instructions(nvrtc.build(prog, extra=("--ftz=true",)).ptx)


def test_gpu_target_uses_the_hardware_exp():
    """rlx_exp at the gpu target is ex2.approx.f32 (no .ftz); the cpu target keeps its polynomial."""
    gpu = cuda_builds.build(programs.program("cuda", "rnn", "f32", None, "gpu", gate_variant(4))).ptx
    cpu = cuda_builds.build(programs.program("cuda", "rnn", "f32", None, "cpu", gate_variant(4))).ptx
    assert "ex2.approx.f32" in gpu and "ex2.approx" not in cpu


# ------------------------------------------------------------------------------------------ signatures
def _thunks():
    """One small thunk of every planned op, the GPU shapes, and the recurrent kernel choices."""
    out = []
    for op in cases.SMALL:
        if op in launches.PLANNERS:
            out.append((op, None, {}))
    out += [("lstm", None, {"rnn_kernel": "persistent"}), ("gru", None, {"rnn_kernel": "step"})]
    out += [("lstm_backward", None, {"rnn_kernel": "step"})]  # the per-step reverse walk (rnnb_backward_cell)
    out += [("gated_delta_net_backward", None, {"ssm_kernel": "lanes"})]  # the step walk (batch rows run chunked)
    out += [("rnn", dict(cases.SMALL["rnn"], reverse=True, bidirectional=False, relu=True), {})]
    out += [(op, dict(params, seq=min(params.get("seq", 1), 2)), {}) for op, params in cases.GPU_SHAPES.values()]
    out += [(op, dict(cases.SMALL[op], seq=64), {}) for op in ("selective_scan", "mamba2", "gated_delta_net")]  # gpu: the chunked forms
    out += [("mamba2_backward", dict(cases.SMALL["mamba2"], seq=64, groups=1, dt_bias=True, d_dt_bias=True, d=True,
                                     d_d=True, z=True, d_z=True, carry_state=True, state=True, d_state=True), {})]
    carried = dict(cases.SMALL["mamba3"], seq=64, head_dim=40, state_size=64, carry_state=True, angle_state=True,
                   state=True, k_state=True, v_state=True)
    out += [("mamba3", carried, {"ssm_kernel": "lanes"}),  # gpu: a head split over groups, the final launch
            ("mamba3", carried, {}),  # the chunked prefill
            ("mamba3_backward", dict(carried, d_angle_state=True, d_state=True, d_k_state=True, d_v_state=True), {})]
    gdn_v2 = dict(cases.SMALL["gated_delta_net"], value_heads=4, value_size=6, scale=0.5, qk_l2norm=True, batch=1,
                  cu_seqlens=[0, 1, 1], state_slots=[1, 0], num_slots=2)  # the GDN_V2 flags (the state's type is one more int)
    out += [("gated_delta_net", dict(gdn_v2, seq=seq, cu_seqlens=[0, seq // 2, seq]), {}) for seq in (1, 7, 64)]
    return out


def _field_thunks():
    """The recurrent thunks with ABI.md §8's fields whose programs are the representative variants, and their
    backward ops (at f32: their gpu programs are the budget test's, and f64's signatures differ only in the
    compute type's width)."""
    return [(op, params, {"rnn_kernel": kernel}) for op, params in RNN_FIELDS.items() for kernel in ("persistent", "step")] + [
        (op, params, {"rnn_kernel": kernel}) for op, params in RNN_BACKWARD_FIELDS.values()
        for kernel in ("auto", "step")]


def _reserve_thunks():
    """``_field_thunks`` with a saved forward (ABI.md §9.1, f32): the forward's kernels writing it, the backward's
    reading it, and the reorders between the two orders of rows; the state-space ops' (mamba2's scores launch
    among them) at a decode step and over two of their chunks."""
    state_space = [(op, dict(cases.SMALL[op], seq=seq), {}) for op in ("selective_scan", "mamba2", "selective_scan_backward",
                                                                   "mamba2_backward") for seq in (1, 70)]
    return [(op, dict(params, reserve=True, reserve_bytes=rlx_gpu.reserve_bytes({"op": op, "dtype": "f32", **params})),
             options) for op, params, options in _field_thunks() + state_space]


#: every version-2 field of the state-space ops at once (f32 thunks; at the gpu target seq 64 takes the
#: chunked forms, the varlen table of mamba2's among them)
_SSM_V2 = dict(carry_state=True, state=True, d=True, z=True, batch=1, state_slots=[1, 0],
               num_slots=2)
SSM_V2_THUNKS = [
    (op, dict(cases.SMALL[op], seq=seq, **_SSM_V2, cu_seqlens=[0, 1, seq], **extra), {})
    for op, extra in (("selective_scan", dict(groups=2, delta_bias=True, delta_softplus=True)),
                      ("mamba2", dict(groups=1, dt_bias=True, dt_softplus=True, dt_limit=[0.0, None])))
    for seq in (2, 64)]
#: their backward ops with every field and every gradient (the reductions of d_d and the bias's among them)
SSM_V2_THUNKS += [
    (f"{op}_backward", dict(params, d_state=True, d_d=True, d_z=True, **{f"d_{bias}": True}), {})
    for (op, params, _), bias in zip(SSM_V2_THUNKS[::2], ("delta_bias", "dt_bias"))]
SSM_V2_THUNKS += [("gated_delta_net_backward", dict(cases.SMALL["gated_delta_net"], value_heads=4, value_size=6,
                                                    scale=0.5, qk_l2norm=True, gate_per_channel=True, batch=1,
                                                    cu_seqlens=[0, 3, 7], state_slots=[1, 0], num_slots=2), {})]


def _kind(arg) -> tuple[str, int]:
    if isinstance(arg, Buf):
        return ("i", 8)  # a device pointer
    value = np.asarray(arg)
    assert value.dtype.kind in "iuf" and value.shape == (), f"launch argument {arg!r} is not a sized scalar"
    return ("f" if value.dtype.kind == "f" else "i", value.dtype.itemsize)


@pytest.mark.parametrize("dtype", ["f32", "f64"])  # f16/bf16 share f32's compute type, so its signatures
@pytest.mark.parametrize("lim", [REFERENCE_GPU, CPU], ids=["gpu", "cpu"])
def test_every_launch_matches_its_kernel_signature(lim, dtype):
    checked = set()
    for op, params, options in _thunks() + (_field_thunks() + _reserve_thunks() + SSM_V2_THUNKS if dtype == "f32" else []):
        thunk, _ = cases.lay_out(op, dtype, params)
        for launch in launches.plan(thunk, lim, **options).launches:
            prog = programs.program_for("cuda", launch, lim)
            ptx = cuda_builds.build(prog).ptx  # the cpu target's f32 programs are the flush test's builds
            params_of = nvrtc.parameters(ptx)
            assert launch.kernel in params_of, f"{prog.label} has no kernel {launch.kernel}"
            got = tuple(_kind(a) for a in launch.args)
            assert got == params_of[launch.kernel], (
                f"{op}: launch of {launch.kernel} passes {got}, the kernel takes {params_of[launch.kernel]}")
            checked.add(launch.kernel)
    state_space = {"selective_scan", "mamba2", "gated_delta_net", "gated_delta_net_step", "gdn_qk_norm", "mamba3"} if lim.target == "cpu" else {
        "selective_scan_lanes", "selective_scan_chunked", "mamba2_lanes", "gated_delta_net_lanes", "gdn_qk_norm",
        "mamba3_lanes", "mamba3_lanes_final"}
    if lim.target == "cpu" or dtype != "f64":  # mamba3's chunked prefill (f64 keeps the step kernels on GPUs)
        state_space |= {"mamba3_chunk_turn", "mamba3_chunk_state", "mamba3_state_pass", "mamba3_chunk_scan"}
    if lim.target == "gpu" and dtype != "f64":
        state_space |= {"mamba2_chunk_state", "mamba2_state_pass", "mamba2_chunk_scan", "gated_delta_net_chunk_prep",
                        "mamba2_varlen_chunks", "mamba2_backward_dstate", "mamba2_backward_pass", "mamba2_backward_chunk",
                        "gated_delta_net_state_pass", "gated_delta_net_chunk_out", "mamba3_cb_states",
                        "mamba3_cb_pass", "mamba3_cb_chunk"}
    state_space |= {"selective_scan_backward", "mamba2_backward", "ssm_backward_reduce", "gated_delta_net_backward",
                    "gdn_backward_qk"} | ({"mamba2_reserve_scores"} if dtype == "f32" else set())
    recurrent = {"rnn_step", "rnn_persist", "rnn_state_in", "rnn_state_out", "rnnb_forward_init", "rnnb_forward_step",
                 "rnnb_backward_init", "rnnb_backward_out", "rnnb_backward_cell", "rnnb_reverse_walk", "rnnb_colsum"}
    if dtype == "f32":
        recurrent |= {"rnn_proj", "rnn_order", "rnn_pad", "rnnb_zero", "rnnb_forward_proj", "rnnb_backward_proj"}
    if lim.target == "gpu":  # the backward's per-step recurrent product (the cpu target's is the gemm)
        recurrent.add("rnnb_step_product")
    assert {"gemm", "cast"} | recurrent | state_space <= checked


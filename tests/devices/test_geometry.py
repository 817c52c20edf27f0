"""Launch geometry at the gpu target, planned (nothing allocated) for an H200-like device.

Every launch keeps CUDA's grid caps (y, z <= 65,535 work-groups; x <= 2^31 - 1), and the recurrent and
state-space launches at the issue's GPU shapes expose enough parallelism to fill 132 SMs: at least
4 x 132 work-groups, or 64 Ki work-items. Also: the cpu target keeps its own shapes.
"""
from __future__ import annotations

import dataclasses

import pytest

from rlx_gpu import launches
from rlx_gpu.conformance import cases
from rlx_gpu.launches.limits import CUDA_MAX_GRID, REFERENCE_GPU, DeviceLimits, variants

GPU = REFERENCE_GPU
FILL_GROUPS = 4 * GPU.compute_units
FILL_ITEMS = 64 * 1024
FILLING_OPS = {"lstm", "gru", "rnn", "selective_scan", "mamba2", "gated_delta_net"}


def _plan(op: str, params: dict, lim: DeviceLimits = GPU, dtype: str = "f32", **options):
    thunk, _ = cases.lay_out(op, dtype, params)
    return launches.plan(thunk, lim, **options)


def _check_caps(launch) -> None:
    groups = launch.groups
    assert all(g * l == s for g, l, s in zip(groups, launch.local_size, launch.global_size)), launch
    padded = groups + (1,) * (3 - len(groups))
    assert all(g <= cap for g, cap in zip(padded, CUDA_MAX_GRID)), \
        f"{launch.kernel}: grid {groups} work-groups exceeds CUDA's {CUDA_MAX_GRID}"
    items = 1
    for size in launch.local_size:
        items *= size
    assert items <= GPU.max_work_group, f"{launch.kernel}: work-group of {items} items"


@pytest.mark.parametrize("name", cases.GPU_SHAPES)
def test_gpu_shapes_keep_grid_caps_and_fill_the_device(name):
    op, params = cases.GPU_SHAPES[name]
    plan = _plan(op, params)
    assert plan.launches
    for launch in plan.launches:
        assert launch.target == "gpu"
        _check_caps(launch)
        if op in FILLING_OPS:
            groups = 1
            for g in launch.groups:
                groups *= g
            items = groups
            for size in launch.local_size:
                items *= size
            assert groups >= FILL_GROUPS or items >= FILL_ITEMS, (
                f"{name}: {launch.kernel} exposes {groups} work-groups of {items // groups} items; "
                f"a 132-SM GPU needs >= {FILL_GROUPS} groups or >= {FILL_ITEMS} items")


#: extents past 65,535 in every dimension a planner could put them in (y/z on the gpu target)
LARGE = {
    "reduce_sum outer": ("reduce_sum", dict(outer=200_000, r=3, inner=5)),
    "matmul batch": ("matmul", dict(batch=100_000, m=4, k=3, n=5, trans_a=False, trans_b=False,
                                    a_batch_stride=12, b_batch_stride=15)),
    "matmul rows": ("matmul", dict(batch=1, m=20_000_000, k=2, n=3, trans_a=True, trans_b=False,
                                   a_batch_stride=0, b_batch_stride=0)),
    "transpose columns (matmul trans_b)": ("matmul", dict(batch=70_000, m=2, k=70_000, n=2, trans_a=False,
                                                          trans_b=True, a_batch_stride=0, b_batch_stride=0)),
    "rnn hidden rows of W_hh^T": ("rnn", dict(batch=2, seq=1, input_size=3, hidden=70_000, num_layers=1,
                                              bidirectional=True, carry=True, relu=False)),
    "lstm batch": ("lstm", dict(batch=300_000, seq=1, input_size=3, hidden=4, num_layers=1,
                                bidirectional=True, carry=True)),
    "binary elements": ("binary", dict(fn="add", shape=[70_000, 70_000], a_strides=[70_000, 1], b_strides=[0, 1])),
}


@pytest.mark.parametrize("name", list(LARGE))
def test_large_extents_fold_within_grid_caps(name):
    op, params = LARGE[name]
    for launch in _plan(op, params).launches:
        _check_caps(launch)


def test_persistent_rnn_is_never_chosen_where_it_cannot_fill_a_gpu():
    op, params = cases.GPU_SHAPES["lstm B64 S512 H1024"]
    small = dict(params, batch=2, seq=3)
    kernels = {l.kernel for l in _plan(op, small).launches}
    assert "rnn_step" in kernels and "rnn_persist" not in kernels
    cpu = dataclasses.replace(GPU, target="cpu", max_grid=(2**63 - 1,) * 3)
    assert "rnn_persist" in {l.kernel for l in _plan(op, small, cpu).launches}


@pytest.mark.parametrize("target", ["gpu", "cpu"])
@pytest.mark.parametrize("op, gates", [("lstm", 4), ("gru", 3), ("rnn", 1)])  # ABI.md §3's G
def test_every_recurrent_launch_carries_its_ops_gate_count(op, gates, target):
    """A recurrent program holds one op: every rnn-family launch of a thunk, both kernel choices, is
    built with RNN_GATES = the op's gate count, a variant the target builds (the kernels have no
    runtime gate count to dispatch on)."""
    lim = GPU if target == "gpu" else dataclasses.replace(GPU, target="cpu", max_grid=(2**63 - 1,) * 3)
    for rnn_kernel in ("persistent", "step"):
        plan = _plan(op, cases.SMALL[op], lim, rnn_kernel=rnn_kernel)
        recurrent = [launch for launch in plan.launches if launch.family == "rnn"]
        assert ("rnn_persist" if rnn_kernel == "persistent" else "rnn_step") in {launch.kernel for launch in recurrent}
        assert {launch.defines for launch in recurrent} == {(("RNN_GATES", gates),)}, recurrent
        assert recurrent[0].defines in variants("rnn", target)


def test_cpu_target_keeps_its_shapes():
    """The cpu target's gemm is the register-blocked one (GEMM_RM x GEMM_CN per item, 8 x 8 groups)."""
    cpu = dataclasses.replace(GPU, target="cpu", max_grid=(2**63 - 1,) * 3)
    gemm = _plan("matmul", cases.GPU_SHAPES["matmul 4096^3"][1], cpu).launches[0]
    assert gemm.target == "cpu" and gemm.local_size == (8, 8, 1)
    assert gemm.groups == (32, 86, 1)  # 256 column runs of 16 and 683 row blocks of 6, in 8 x 8 groups
    gpu = _plan("matmul", cases.GPU_SHAPES["matmul 4096^3"][1]).launches[0]
    assert gpu.local_size == (16, 16, 1) and gpu.groups == (32 * 32, 1, 1)


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_cpu_target_decode_step_of_gated_delta_net_is_one_launch_on_the_state(per_channel):
    """seq 1: gated_delta_net_step alone (no decay pass, no scratch), GDN_DJ value columns per item;
    two steps take the blocked walk."""
    cpu = dataclasses.replace(GPU, target="cpu", max_grid=(2**63 - 1,) * 3)
    params = dict(batch=8, seq=1, heads=8, state_size=70, gate_per_channel=per_channel, carry_state=True)
    plan = _plan("gated_delta_net", params, cpu)
    (step,) = plan.launches
    assert step.kernel == "gated_delta_net_step" and plan.scratch_bytes == 0
    # 70 columns: items of 32, 32 and 6 (their group of 4 has one idle item)
    assert step.global_size == (4, 8, 8) and step.local_size == (4, 1, 1)
    two = {l.kernel for l in _plan("gated_delta_net", dict(params, seq=2), cpu).launches}
    assert "gated_delta_net_step" not in two


def test_a_cpu_target_decode_step_of_selective_scan_gives_each_item_several_channels():
    """seq 1 (a Mamba-1 selective_state_update): SS_TC = 8 channels per item (kernels/ssm.cl's decode branch);
    two steps, or packed sequences, one channel per item."""
    cpu = dataclasses.replace(GPU, target="cpu", max_grid=(2**63 - 1,) * 3)
    params = dict(batch=3, seq=1, hidden=1536, state_size=16, carry_state=True, state=True)
    (step,) = _plan("selective_scan", params, cpu).launches
    assert step.kernel == "selective_scan" and step.global_size == (192, 3) and step.local_size == (64, 1)
    (two,) = _plan("selective_scan", dict(params, seq=2), cpu).launches
    (packed,) = _plan("selective_scan", dict(params, batch=1, seq=3, cu_seqlens=[0, 1, 2, 3]), cpu).launches
    assert two.global_size == (1536, 3) and packed.global_size == (1536, 3)

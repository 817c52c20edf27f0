"""Where ABI.md defines each op (``OpDef.place``): the order of the op table, and the section a message cites."""
from __future__ import annotations

import pytest

import rlx_gpu
from host_fallback.abi import BACKWARD, OPS
from rlx_gpu.conformance.cases import lay_out, schedule_of

#: the section of ABI.md each version-2-only op is defined in, read from its headings
SECTIONS = {"causal_conv1d": "§10", "lstm_backward": "§9", "mamba2_backward": "§9", "causal_conv1d_backward": "§9"}


def test_the_op_table_is_in_the_abi_order_forward_ops_first_then_their_backward_ops():
    forward = [op for op in OPS.values() if op.name not in BACKWARD]
    places = [op.place for op in forward]
    assert places == sorted(places) and len(set(places)) == len(places)
    assert list(OPS)[:4] == ["lstm", "gru", "rnn", "selective_scan"]  # §3, then §4
    assert list(OPS)[len(forward):] == [f"{op.name}_backward" for op in forward if op.differentiable]


@pytest.mark.parametrize("op", sorted(SECTIONS))
def test_a_version_2_op_labelled_version_1_is_refused_citing_its_own_section(op):
    thunk, nbytes = lay_out(op, "f32")
    with pytest.raises(rlx_gpu.ScheduleError, match=rf"field 'op': {op} is an op of rlx-thunks/2 \(ABI.md {SECTIONS[op]}\)"):
        rlx_gpu.load_schedule(dict(schedule_of(thunk, nbytes), abi="rlx-thunks/1"))

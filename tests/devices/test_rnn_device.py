"""The recurrent device kernels' compile-time variants with ABI.md §8's fields.

The catalog's combined-field cases of lstm, gru and rnn (``rlx_gpu.conformance.combined.RNN_FIELDS``: every
optional field of an op at once, each through both recurrent kernels), which tests/conformance/test_conformance.py runs
on every device against the float64 reference, build exactly the representative variants that ptxas and
NVRTC check; a version-1 thunk keeps its program.
"""
from __future__ import annotations

from host_fallback.abi import complete
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.launches import rnn as rnn_launches
from rlx_gpu.launches.limits import RNN_FIELD_VARIANTS
from support.rnn_fields import BASE, FIELDS


def test_the_cases_build_the_representative_variants():
    """The programs ptxas and NVRTC check (RNN_FIELD_VARIANTS) are the ones these cases run."""
    built = {rnn_launches.variant(complete(runner.lay_out(Case(op, "f32", p)).thunk)) for op, p in FIELDS.items()}
    assert built == set(RNN_FIELD_VARIANTS)


def test_a_version_1_thunk_keeps_its_program():
    for op in FIELDS:
        thunk = complete(runner.lay_out(Case(op, "f32", BASE)).thunk)
        assert rnn_launches.variant(thunk) == (("RNN_GATES", rnn_launches.GATES[op]),)

"""The ABI model (host_fallback/abi): every op defined once, and what follows from the definitions agrees."""
from __future__ import annotations

import re

import pytest

from host_fallback import body
from host_fallback.abi import BACKWARD, OPS, regions
from host_fallback.abi import body as body_ops
from host_fallback.abi.aliasing import ALIASING
from rlx_gpu.conformance.cases import lay_out


@pytest.mark.parametrize("op", list(OPS))
def test_every_region_is_a_field_of_its_op(op):
    thunk, _ = lay_out(op, "f32")
    names = set(OPS[op].field_names)
    assert {re.sub(r"\[\d+\]$", "", r.field) for r in regions(thunk)} <= names


@pytest.mark.parametrize("op", list(OPS))
def test_every_op_obeys_the_aliasing_rule_after_its_field_rules(op):
    rules = OPS[op].rules
    assert ALIASING in rules
    assert all(not r.on_footprint for r in rules[:rules.index(ALIASING)]), "a field rule runs after the footprint's"


def test_a_backward_op_is_its_forwards_fields_and_their_gradients():
    for backward, forward in BACKWARD.items():
        fwd, bwd = OPS[forward], OPS[backward]
        assert bwd.field_names[:len(fwd.field_names) - 1] == tuple(n for n in fwd.field_names if n != "dst")
        assert set(fwd.defaults) <= set(bwd.defaults) and bwd.version == 2
        assert bwd.sample is fwd.sample and bwd.data_rules is fwd.data_rules


def test_the_host_implements_the_abis_elementwise_functions_in_its_order():
    assert tuple(body.UNARY) == body_ops.UNARY_FNS
    assert tuple(body.BINARY) == body_ops.BINARY_FNS

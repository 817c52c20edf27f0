"""The one accuracy measure (conformance.compare.nmse) and the one table of bounds (configs/default.yaml)."""
from __future__ import annotations

import numpy as np
import pytest

from rlx_gpu.conformance.compare import nmse, non_finite_mismatch
from rlx_gpu.errors import RlxError
from rlx_gpu.runtime.config import load_config
from host_fallback.abi import DTYPES


def test_nmse_is_the_relative_squared_error_over_finite_reference_values():
    want = np.array([3.0, 4.0, np.nan, np.inf])
    got = np.array([3.0, 4.5, 7.0, -1.0])  # the non-finite positions are the caller's to compare
    assert nmse(got, want) == pytest.approx(0.25 / 25.0, rel=1e-15)
    assert nmse(want[:2], want[:2]) == 0.0
    assert nmse(np.array([1e-20]), np.array([0.0])) == pytest.approx(1e-40 / 1e-30)


def test_a_non_finite_result_where_the_reference_is_finite_never_passes():
    assert not nmse(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) <= 1.0
    assert not nmse(np.array([np.inf, 1.0]), np.array([1.0, 1.0])) <= 1.0


def test_nan_and_each_signed_inf_are_compared_position_by_position_on_their_own():
    want = np.array([1.0, np.nan, np.inf, -np.inf, 2.0])
    assert non_finite_mismatch(want.copy(), want) is None
    for got, expected in (([1.0, np.inf, np.inf, -np.inf, 2.0], ("NaN", [1])),      # NaN became +Inf
                          ([1.0, np.nan, -np.inf, -np.inf, 2.0], ("+Inf", [2])),    # the sign of an Inf
                          ([1.0, np.nan, np.inf, np.nan, 2.0], ("NaN", [3])),       # -Inf became NaN
                          ([1.0, np.nan, np.inf, -np.inf, -np.inf], ("-Inf", [4]))):  # finite became -Inf
        name, where = non_finite_mismatch(np.array(got), want)
        assert (name, where.tolist()) == expected, got


def test_the_bundled_table_bounds_every_dtype_for_a_thunk_and_a_schedule():
    config = load_config()
    for dtype in DTYPES:
        assert 0 < config.tolerance("lstm", dtype) <= config.tolerance("schedule", dtype)
        assert config.tolerance("lstm", dtype) == config.tolerance("thunk", dtype)


def test_a_config_overrides_single_entries_and_keeps_the_rest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tolerances:\n  gru: {bf16: 1.0e-3}\n  thunk: {f32: 2.0e-7}\n")
    config, default = load_config(path), load_config()
    assert config.tolerance("gru", "bf16") == 1e-3
    assert config.tolerance("gru", "f16") == default.tolerance("thunk", "f16")  # gru's other dtypes: thunk
    assert config.tolerance("lstm", "f32") == 2e-7
    assert config.tolerance("schedule", "f64") == default.tolerance("schedule", "f64")


def test_a_missing_bound_names_the_config_and_the_entry(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("device: host\n")
    with pytest.raises(RlxError, match=r"c\.yaml: no tolerance for 'lstm' in f8"):
        load_config(path).tolerance("lstm", "f8")

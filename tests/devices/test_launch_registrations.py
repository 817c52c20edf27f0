"""What a planner module declares for its own kernels (tuning, variants, shared texts) reaches the programs, and
a declaration that would collide with another is refused."""
import pytest

from rlx_gpu.backends.programs import program
from rlx_gpu.launches import shared_texts
from rlx_gpu.launches.limits import TUNING, add_tuning, add_variants, variants
from rlx_gpu.launches.registry import register
from rlx_gpu.paths import data_dir


def test_a_family_s_program_holds_its_shared_texts_then_its_own():
    source = program("opencl", "mamba3_backward", "f32").source
    own = (data_dir("kernels") / "mamba3_backward.cl").read_text()
    assert shared_texts("mamba3_backward") == ("mamba3.cl", "mma_split.cl", "mamba3_chunk_backward.cl")
    for text in shared_texts("mamba3_backward"):
        assert source.index((data_dir("kernels") / text).read_text()) < source.index(own)


def test_a_planner_s_tuning_is_in_every_program_of_its_target():
    assert "#define M3_SPLIT_ROWS 4" in program("opencl", "ssm", "f32", target="gpu").source
    assert "M3_SPLIT_ROWS" not in TUNING["cpu"]


def test_a_tuning_name_already_taken_is_refused():
    with pytest.raises(ValueError, match=r"'M3_PB'.*taken"):
        add_tuning("test", cpu={"M3_PB": 8})
    with pytest.raises(ValueError, match="target 'tpu'"):
        add_tuning("test", tpu={"X": 1})
    assert TUNING["cpu"]["M3_PB"] == 16


def test_variants_declared_twice_are_refused():
    before = variants("mamba3", "gpu")
    with pytest.raises(ValueError, match="declared already"):
        add_variants("mamba3", gpu=((("SSM_N", 16),),))
    assert variants("mamba3", "gpu") == before


def test_ops_of_one_family_must_share_the_same_texts():
    with pytest.raises(ValueError, match="'ssm'.*shared texts"):
        register("not_an_op", lambda *a: None, lambda *a: None, family="ssm", shared_texts=())

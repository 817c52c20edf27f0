"""``rlx-gpu roofline``: the model's table from the launch plans, its shapes and anchors, one-line errors."""
from __future__ import annotations

from rlx_gpu.cli import main

FLA = "gdn fla B1 S32768 H16 HV64 K128 V128"


def test_roofline_prints_the_op_and_its_kernels_beside_the_anchors(capsys):
    assert main(["roofline", "--shape", FLA]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| op / kernel | launches | FMA GFLOP | MMA 16-bit GFLOP")
    op = next(line for line in lines if FLA in line)
    assert "fla chunk_gated_delta_rule 3.33 ms" in op and "FlashQLA 1.52 ms" in op
    kernels = [line.split(" | ")[0] for line in lines if line.startswith("| · ")]
    assert kernels == ["| · gated_delta_net_chunk_prep", "| · gated_delta_net_state_pass",
                       "| · gated_delta_net_chunk_out"]


def test_the_tensor_cores_fill_their_column_of_the_chunk_kernels_unless_none(capsys):
    def mma_column(*extra: str) -> list[str]:
        assert main(["roofline", "--shape", FLA, *extra]) == 0
        return [line.split(" | ")[3] for line in capsys.readouterr().out.splitlines() if line.startswith("| · ")]

    assert "—" not in mma_column()
    assert mma_column("--tensor-cores", "none") == ["—"] * 3


def test_an_unknown_shape_is_one_line_naming_the_shapes(capsys):
    assert main(["roofline", "--shape", "gdn B9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--shape 'gdn B9'" in err and FLA in err


def test_the_tables_in_docs_kernels_are_what_their_commands_print_now(capsys):
    """docs/kernels.md's roofline tables, each after the command that made it: the plans or a kernel's declared
    cost changed without the table (rerun the command and paste its output)."""
    import shlex
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text().splitlines()
    commands = [n for n, line in enumerate(lines[:-2])
                if line.startswith("`python tools/roofline.py") and lines[n + 2].startswith("| op / kernel |")]
    assert len(commands) >= 2
    for n in commands:
        table = []
        for line in lines[n + 2:]:
            if not line.startswith("|"):
                break
            table.append(line)
        assert main(["roofline", *shlex.split(lines[n].split("`")[1])[2:]]) == 0
        assert capsys.readouterr().out.splitlines() == table, lines[n]

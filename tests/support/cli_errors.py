"""The one rule for a clean CLI error: one line on stderr, no traceback, naming what it must name."""
from __future__ import annotations


def one_line_error(capsys, *needles):
    """The captured stderr: one line, no traceback, holding every one of ``needles``."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err

"""The recurrent reserve's Oclgrind check (tests/devices/test_rnn_reserve_device.py), run beside the suite as one of
``background``'s long checks: per target and op, a forward writing the reserve, then the backward reading it, every
kernel the reserve adds among them (the zeros past the lengths, the reorders both ways, lstm's projection), under
``tools/oclgrind_check.py``'s checkers. The command prints one JSON line: the exit code, Oclgrind's diagnostics and
the child's output."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the op and the shape of each case, run at both targets
CASES = [
    ("lstm", dict(batch=2, seq=3, input_size=3, hidden=4, num_layers=2, bidirectional=True, carry=True,
                  seq_lens=[3, 1], clip=0.5, peepholes=True, proj_size=2, w_hr=True)),
    ("gru", dict(batch=2, seq=3, input_size=3, hidden=4, num_layers=1, bidirectional=False, carry=False,
                 linear_before_reset=False, seq_lens=[2, 3])),
]

#: the child run under Oclgrind; it prints "<target> <op> ran" after each case
SCRIPT = """
import numpy as np
import rlx_gpu
from host_fallback.abi import regions
from rlx_gpu.conformance import runner
from rlx_gpu.conformance.catalog import Case
from rlx_gpu.conformance.devices import find, open_device
for target in ("cpu", "gpu"):
    session = open_device(find({spec!r}), target)
    for op, params in {cases!r}:
        need = rlx_gpu.reserve_bytes(dict(params, op=op, dtype="f32"))
        laid = runner.lay_out(Case(op + "_backward", "f32", dict(params, reserve=True, reserve_bytes=need)))
        forward = {{k: v for k, v in laid.thunk.items() if not k.startswith("d_")}}
        forward.update(op=op, dst=-(-laid.arena.size // 256) * 256)
        dst = next(r for r in regions(forward) if r.field == "dst")
        arena = np.zeros(dst.offset + dst.nbytes, np.uint8)
        arena[:laid.arena.size] = laid.arena
        on_device = session.upload(arena)
        session.launch(forward, on_device)
        session.launch(laid.thunk, on_device)
        session.finish()
        print(target, op, "ran", flush=True)
"""

#: the parent: tools/oclgrind_check.py's run_under_oclgrind on the child, its result as JSON
_PARENT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("oclgrind_check", {tool!r})
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
code, diagnostics, output = tool.run_under_oclgrind([sys.executable, "-c", {script!r}], {{}})
print(json.dumps(dict(code=code, diagnostics=diagnostics, output=output)))
"""


def command(spec: str) -> list[str]:
    """The check on the Oclgrind device ``spec``."""
    script = SCRIPT.format(spec=spec, cases=CASES)
    return [sys.executable, "-c", _PARENT.format(tool=str(ROOT / "tools" / "oclgrind_check.py"), script=script)]

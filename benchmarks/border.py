"""Time and memory of ``load_schedule`` on about 1 MB of the worst schedule texts we can build.

Each text is parsed and validated in a fresh child process (so peak RSS is its own): the table gives
the text size, the median wall and CPU (process) time of ``--repeats`` loads — on a shared machine
the CPU time is the cost, the wall time adds the wait for a core — the peak of Python allocations during
one load (tracemalloc, a separate load), the child's peak RSS above its baseline after imports, and the
outcome (accepted, or the start of the ScheduleError).

    PYTHONPATH=. python benchmarks/border.py [--size 1000000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _thunks_text(op: str, size: int, views: bool = False, last_bad: bool = False) -> str:
    from rlx_gpu.conformance.cases import lay_out, schedule_of

    thunk, arena = lay_out(op, "f32")
    sched = schedule_of(thunk, arena)
    if views:
        from host_fallback.abi import regions
        sched["tensors"] = {f"t{i}": {"offset": r.offset, "dtype": "f32", "shape": list(r.shape)}
                            for i, r in enumerate(regions(thunk)) if r.dtype == "f32"}
    one = json.dumps(thunk)
    count = max(1, (size - len(json.dumps(sched))) // (len(one) + 2))
    sched["thunks"] = [thunk] * count
    if last_bad:
        sched["thunks"] = sched["thunks"] + [dict(thunk, dst=arena)]
    return json.dumps(sched)


def _many_xs(size: int) -> str:
    n = size // 40
    body = {"arena_bytes": 16 * (n + 2), "thunks": []}
    scan = dict(op="scan", dtype="f32", body=body, body_input_off=0, body_output_off=16, outer_init_off=0,
                outer_final_off=16, length=1, carry_bytes=16, save_trajectory=False,
                xs_inputs=[[32 + 16 * i, 32 + 16 * i, 16] for i in range(n)], bcast_inputs=[], num_checkpoints=0)
    return json.dumps({"abi": "rlx-thunks/1", "arena_bytes": 16 * (n + 2), "thunks": [scan]})


def _many_init(size: int) -> str:
    n = size // 36
    init = [{"offset": 8 * i, "b64": "AAAAAAAAAAA="} for i in range(n)]
    return json.dumps({"abi": "rlx-thunks/1", "arena_bytes": 8 * n, "init": init, "thunks": []})


def _alias_thunks(size: int) -> str:
    inner = "{op: fill, dtype: f32, dst: 0, n: 4, value: 1}"
    body_refs = ", ".join(["*u"] * 60_000)  # each scan holds 60,000 fills: the second crosses the budget
    outer_refs = ", ".join(["*s"] * 60_000)
    return (f"abi: rlx-thunks/1\narena_bytes: 64\nmeta: [&u {inner}]\nthunks: [\n"
            f"&s {{op: scan, dtype: f32, body: {{arena_bytes: 64, thunks: [{body_refs}]}}, body_input_off: 0, "
            "body_output_off: 16, outer_init_off: 0, outer_final_off: 16, length: 1, carry_bytes: 16, "
            f"save_trajectory: false, xs_inputs: [], bcast_inputs: [], num_checkpoints: 0}}, {outer_refs}]\n")


def _alias_bomb(size: int) -> str:
    lines = ['  l0: &l0 ["xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx", "xxxxxxxx"]']
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return ("abi: rlx-thunks/1\narena_bytes: 64\nmeta:\n" + "\n".join(lines)
            + "\nthunks:\n  - {op: fill, dtype: f32, dst: *l8, n: 1, value: 0}\n")


def _yaml_block(size: int) -> str:
    import yaml
    sched = json.loads(_thunks_text("lstm", size * 4 // 5))
    return yaml.safe_dump(sched)


KINDS = {
    "JSON fill thunks (valid)": lambda n: _thunks_text("fill", n),
    "JSON lstm thunks + views (valid)": lambda n: _thunks_text("lstm", n, views=True),
    "JSON gdn thunks, last bad": lambda n: _thunks_text("gated_delta_net", n, last_bad=True),
    "JSON scan_backward_xs thunks (valid)": lambda n: _thunks_text("scan_backward_xs", n),
    "JSON scan with n xs slots (valid)": _many_xs,
    "JSON n init blocks (valid)": _many_init,
    "JSON '[' * n": lambda n: "[" * n,
    "JSON n-digit integer": lambda n: '{"abi": "rlx-thunks/1", "arena_bytes": ' + "9" * (n - 60) + ', "thunks": []}',
    "JSON 1 MB string as op":
        lambda n: '{"abi": "rlx-thunks/1", "arena_bytes": 64, "thunks": [{"op": "' + "x" * (n - 80) + '"}]}',
    "random bytes": lambda n: random.Random(1).randbytes(n),
    "YAML '- ' * n": lambda n: "- " * (n // 2),
    "YAML aliased scans (thunk budget)": _alias_thunks,
    "YAML alias bomb (1 KB)": _alias_bomb,
    "YAML block lstm thunks (valid)": _yaml_block,
}

_CHILD = r"""
import sys, time, tracemalloc, resource, pickle, statistics
sys.path.insert(0, {root!r})
import rlx_gpu
text = pickle.load(open({path!r}, "rb"))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times, cpu, outcome = [], [], "accepted"
for _ in range({repeats}):
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        rlx_gpu.load_schedule(text)
    except rlx_gpu.ScheduleError as err:
        outcome = str(err)[:70]
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
tracemalloc.start()
try:
    rlx_gpu.load_schedule(text)
except rlx_gpu.ScheduleError:
    pass
peak = tracemalloc.get_traced_memory()[1] / 2**20
print(repr((statistics.median(times), statistics.median(cpu), peak, rss, outcome)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import pickle
    import tempfile

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'text':38s} {'bytes':>9s} {'wall s':>7s} {'cpu s':>6s} {'py peak MB':>10s} {'rss+ MB':>8s}  outcome")
    for name, build in KINDS.items():
        text = build(args.size)
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            pickle.dump(text, f)
        code = _CHILD.format(root=str(ROOT), path=f.name, repeats=args.repeats)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        Path(f.name).unlink()
        if done.returncode:
            print(f"{name:38s} {len(text):9d} child failed after {time.perf_counter() - started:.1f} s: "
                  f"{done.stderr.strip()[-200:]}")
            continue
        seconds, cpu, peak, rss, outcome = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 - our own child
        print(f"{name:38s} {len(text):9d} {seconds:7.3f} {cpu:6.3f} {peak:10.1f} {rss:8.1f}  {outcome}")


if __name__ == "__main__":
    main()

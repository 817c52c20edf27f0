"""Fuzz the schedule border: N damaged schedules in subprocess batches, each under a memory limit.

Every case is ``rlx_gpu.conformance.fuzz.make_case(seed)`` (deterministic), checked by ``check_case``
on the chosen device: acceptable outcomes are a ScheduleError/DeviceError/RunError or a clean run that wrote
nothing outside its write footprint and left the caller's arena alone. A batch runs in a child
process limited to ``--mem-mb`` of address space (RLIMIT_AS) and ``--timeout`` seconds; a batch that
dies (signal, timeout, MemoryError) is split in halves until the cases that kill it are found, and
each of those counts as bad. Bad cases are pickled to ``--out`` for ``--replay``.

    python tools/fuzz.py --cases 100000 --device host
    python tools/fuzz.py --cases 5000 --device opencl --batch 250
    python tools/fuzz.py --replay fuzz-bad/

A fifth of the seeds are ``make_data_case``: damaged run-time data (top level, late, in scan bodies) and
non-finite knobs.
"""
from __future__ import annotations

import argparse
import collections
import json
import pickle
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _worker(start: int, count: int, device_spec: str) -> None:
    """Child: check seeds start..start+count, print one JSON line per bad case and a last summary line."""
    sys.path.insert(0, str(ROOT))
    import rlx_gpu
    from rlx_gpu.conformance.fuzz import check_case, make_case
    from rlx_gpu.runtime.config import Config

    device = rlx_gpu.get_device(device_spec, Config(fallback="allow"))
    counts: collections.Counter = collections.Counter()
    for seed in range(start, start + count):
        outcome, problem = check_case(make_case(seed), device)
        counts[outcome] += 1
        if problem is not None:
            print(json.dumps({"seed": seed, "outcome": outcome, "problem": problem}), flush=True)
    print(json.dumps({"counts": counts}), flush=True)


def _limit_memory(mem_mb: int):
    def apply() -> None:
        limit = mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def _run_batch(start: int, count: int, args: argparse.Namespace) -> tuple[collections.Counter, list[dict]]:
    """Counts and bad cases of one batch; a batch that dies is split until each killer is one case."""
    command = [sys.executable, __file__, "--worker", str(start), str(count), "--device", args.device]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              preexec_fn=_limit_memory(args.mem_mb), cwd=ROOT)
        died = None if done.returncode == 0 else f"exit status {done.returncode}: {done.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
        done, died = None, f"batch timed out after {args.timeout} s"
    if died is None:
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        return collections.Counter(lines[-1]["counts"]), lines[:-1]
    if count == 1:
        return collections.Counter({"died": 1}), [{"seed": start, "outcome": "died", "problem": died}]
    half = count // 2
    first, bad_first = _run_batch(start, half, args)
    second, bad_second = _run_batch(start + half, count - half, args)
    return first + second, bad_first + bad_second


def _save(bad: list[dict], out: Path) -> None:
    from rlx_gpu.conformance.fuzz import make_case

    out.mkdir(parents=True, exist_ok=True)
    for entry in bad:
        case = make_case(entry["seed"])
        with open(out / f"seed-{entry['seed']}.pkl", "wb") as f:
            pickle.dump({"case": case, **entry}, f)
        (out / f"seed-{entry['seed']}.txt").write_text(
            f"seed {entry['seed']}: {entry['outcome']}: {entry['problem']}\nmutations: {', '.join(case.mutations)}\n")


def _replay(folder: Path, device_spec: str) -> int:
    import rlx_gpu
    from rlx_gpu.conformance.fuzz import check_case
    from rlx_gpu.runtime.config import Config

    device = rlx_gpu.get_device(device_spec, Config(fallback="allow"))
    still = 0
    for path in sorted(folder.glob("seed-*.pkl")):
        with open(path, "rb") as f:
            saved = pickle.load(f)  # noqa: S301 - our own files
        outcome, problem = check_case(saved["case"], device)
        still += problem is not None
        print(f"{path.name}: {outcome}: {problem or 'fine now'}")
    print(f"{still} of {len(list(folder.glob('seed-*.pkl')))} saved cases still bad")
    return 1 if still else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--device", default="host", help="host, opencl, opencl:0, ...")
    parser.add_argument("--batch", type=int, default=1000, help="cases per child process")
    parser.add_argument("--jobs", type=int, default=1, help="child processes at once")
    parser.add_argument("--mem-mb", type=int, default=4096, help="address-space limit of a child (RLIMIT_AS)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a batch may take")
    parser.add_argument("--out", type=Path, default=Path("fuzz-bad"), help="folder for bad cases")
    parser.add_argument("--replay", type=Path, help="re-check the cases saved in this folder")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.device)
        return 0
    if args.replay:
        return _replay(args.replay, args.device)
    sys.path.insert(0, str(ROOT))
    batches = [(s, min(args.batch, args.start + args.cases - s))
               for s in range(args.start, args.start + args.cases, args.batch)]
    total: collections.Counter = collections.Counter()
    bad: list[dict] = []
    started = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        for counts, found in pool.map(lambda b: _run_batch(b[0], b[1], args), batches):
            total += counts
            bad += found
            print(f"[{sum(total.values())}/{args.cases}] {len(bad)} bad, {time.perf_counter() - started:.1f} s",
                  flush=True)
    if bad:
        _save(bad, args.out)
        for entry in bad[:20]:
            print(f"  seed {entry['seed']}: {entry['outcome']}: {entry['problem']}")
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(total.items()))
    print(f"{sum(total.values())} schedules, {len(bad)} bad ({outcomes}) on {args.device} in "
          f"{time.perf_counter() - started:.1f} s" + (f"; saved to {args.out}/" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

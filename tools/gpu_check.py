"""The GPU check: everything a lent NVIDIA machine should run for the CUDA backend, in under 8 minutes.

    python3 tools/gpu_check.py [--out DIR] [--skip-cuda] [--budget SECONDS]

Writes, under ``--out`` (default ``$OUT``, else ``gpu_check_out``), as it goes: ``env.json``
(interpreter, packages, ``nvidia-smi``, the CUDA devices or why there are none), ``build.md`` (every
program built for the device's ``sm_XY`` with registers / local / shared bytes read back from the
driver), ``conformance.txt`` and ``conformance.json`` (`rlx-gpu conformance --device cuda`), ``sanitizer.txt``
(``compute-sanitizer`` memcheck and racecheck on the small f32 cases, where the tool exists),
``bench.md`` (copy bandwidth and bf16 GEMM rate as ceilings; event-timed medians at the GPU shapes
against cuDNN and the torch chunked twins, and byte floors), ``summary.md`` (the final table),
``results.json`` and ``log.txt``. Exit status: 0 when nothing failed, 1 otherwise (a section that
could not run on a machine without CUDA counts as failed unless ``--skip-cuda`` or
``RLX_GPU_CHECK_SKIP_CUDA=1`` says to skip it). Missed performance targets are listed, not failures.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT / "tools")]

from gpu_bench import benchmarks, cuda_session, events_ms, torch_ms  # noqa: E402  (beside this script)

PACKAGES = ("numpy", "ml_dtypes", "pyyaml", "cupy-cuda13x", "cupy-cuda12x", "torch", "cuda-bindings", "nvidia-cuda-nvrtc")
CONFORMANCE = [sys.executable, "-m", "rlx_gpu.cli", "conformance", "--device", "cuda"]  # the conformance suite on CUDA
SANITIZED = ["--quick", "--dtypes", "f32"]  # the small f32 cases under compute-sanitizer


@dataclass
class Row:
    section: str
    item: str
    status: str  # ok | fail | skip | miss (a performance target not met)
    detail: str = ""


@dataclass
class Check:
    out: Path
    skip_cuda: bool
    budget: float
    started: float = field(default_factory=time.perf_counter)
    rows: list[Row] = field(default_factory=list)

    def log(self, text: str) -> None:
        print(text, flush=True)
        with open(self.out / "log.txt", "a") as f:
            f.write(text + "\n")

    def add(self, section: str, item: str, status: str, detail: str = "") -> None:
        self.rows.append(Row(section, item, status, detail))
        self.log(f"[{status}] {section}: {item} {detail}")
        self.write_summary()

    def write(self, name: str, text: str) -> None:
        (self.out / name).write_text(text)

    def write_summary(self) -> None:
        lines = ["| section | item | status | detail |", "|---|---|---|---|"]
        lines += [f"| {r.section} | {r.item} | {r.status} | {r.detail} |" for r in self.rows]
        self.write("summary.md", "\n".join(lines) + "\n")
        self.write("results.json", json.dumps([asdict(r) for r in self.rows], indent=1))

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    @property
    def failed(self) -> bool:
        return any(r.status == "fail" for r in self.rows)


def cuda_status():
    from rlx_gpu.runtime.registry import status

    return status("cuda")


# ---------------------------------------------------------------- sections
def environment(ck: Check, shared: dict) -> None:
    env = {"python": sys.version, "platform": platform.platform(), "packages": {}}
    for name in PACKAGES:
        try:
            env["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if shutil.which("nvidia-smi"):
        run = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                              "--format=csv"], capture_output=True, text=True, timeout=60)
        env["nvidia-smi"] = run.stdout.strip() or run.stderr.strip()
    st = cuda_status()
    env["cuda"] = {"reason": st.reason, "devices": [dict(spec=d.spec, name=d.name, **{k: v for k, v in d.details.items()})
                                                    for d in st.devices]}
    ck.write("env.json", json.dumps(env, indent=1, default=str))
    ck.add("env", "interpreter and packages", "ok", f"python {platform.python_version()}, "
           + ", ".join(f"{k} {v}" for k, v in env["packages"].items()))
    ck.add("env", "cuda backend", "ok" if st.available else "skip" if ck.skip_cuda else "fail",
           st.devices[0].name if st.available else st.reason)


def build(ck: Check, shared: dict) -> None:
    import re

    from rlx_gpu.backends import nvrtc

    session = cuda_session()
    prims = session.prims
    rows = ["| program | kernel | registers | local B | shared B | build s |", "|---|---|---|---|---|---|"]
    cold = time.perf_counter()
    for prog in nvrtc.programs(session.limits.target):
        t0 = time.perf_counter()
        module = session.program(prog)
        spent = time.perf_counter() - t0
        for name in re.findall(r"KERNEL\s+(\w+)\s*\(", prog.source):
            a = prims.kernel_attributes(prims.get_kernel(module, name))
            rows.append(f"| {prog.label} | {name} | {a['registers']} | {a['local_bytes']} | {a['shared_bytes']} | {spent:.2f} |")
    ck.write("build.md", "\n".join(rows) + "\n")
    ck.add("build", f"every program for {prims.arch}", "ok",
           f"{len(rows) - 2} kernels, {prims.cubins.compiled} cubins compiled in {time.perf_counter() - cold:.1f} s")


def conformance(ck: Check, shared: dict) -> None:
    cuda_session()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    timeout = max(60, int(ck.left() * 0.45))
    try:
        run = subprocess.run([*CONFORMANCE, "--json", str(ck.out / "conformance.json")], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=timeout)
        text, ok = run.stdout + run.stderr, run.returncode == 0
    except subprocess.TimeoutExpired as err:
        text, ok = f"{err.stdout or ''}\n--- stopped after {timeout} s", False
    ck.write("conformance.txt", text)
    last = [line for line in text.strip().splitlines() if line.strip()][-1:] or ["no output"]
    ck.add("conformance", "suite on cuda", "ok" if ok else "fail", last[0][:200])


def sanitizer(ck: Check, shared: dict) -> None:
    cuda_session()
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if tool is None:
        ck.add("sanitizer", "compute-sanitizer", "skip", "not installed on this machine")
        return
    env = dict(os.environ, RLX_CUDA_GRAPHS="0", PYTHONPATH=str(ROOT))
    report = []
    for mode in ("memcheck", "racecheck"):
        timeout = max(30, int(min(120, ck.left() * 0.25)))
        cmd = [tool, "--tool", mode, "--error-exitcode", "86", *CONFORMANCE, *SANITIZED]
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            text, rc = run.stdout + run.stderr, run.returncode
        except subprocess.TimeoutExpired as err:
            text, rc = f"{err.stdout or ''}\n--- stopped after {timeout} s", None
        report.append(f"===== {mode} (exit {rc})\n{text}")
        if rc not in (0, 86) and "Device not supported" in text:  # gVisor machines: the tool cannot attach
            ck.add("sanitizer", mode, "skip", "compute-sanitizer cannot attach to this device (see sanitizer.txt)")
            continue
        status = "ok" if rc == 0 else "fail"
        detail = "no errors" if rc == 0 else "timed out" if rc is None else "errors found" if rc == 86 else f"exit {rc}"
        ck.add("sanitizer", mode, status, detail)
    ck.write("sanitizer.txt", "\n".join(report))


def ceilings(ck: Check, shared: dict) -> dict[str, float]:
    import cupy as cp
    import torch

    session = cuda_session()
    stream = session.prims.stream
    n = 1 << 31
    src, dst = session.prims.allocate(n), session.prims.allocate(n)
    rt = cp.cuda.runtime
    ms = events_ms(stream, lambda: rt.memcpyAsync(dst.ptr, src.ptr, n, rt.memcpyDeviceToDevice, stream.ptr), 10)
    bandwidth = 2 * n / (ms * 1e-3)  # bytes read + written per second
    del src, dst
    ck.add("ceilings", "device copy bandwidth", "ok", f"{bandwidth / 1e12:.2f} TB/s (read + write, 2 GiB)")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = torch_ms(lambda: torch.matmul(a, b), 10, 3)
    tflops = 2 * 8192**3 / (ms * 1e-3) / 1e12
    ck.add("ceilings", "bf16 GEMM 8192^3 (torch)", "ok", f"{tflops:.0f} TFLOP/s")
    return {"bandwidth": bandwidth, "bf16_tflops": tflops}


SECTIONS = (("env", environment, False), ("build", build, True), ("conformance", conformance, True),
            ("sanitizer", sanitizer, True), ("ceilings", ceilings, True), ("bench", benchmarks, True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--skip-cuda", action="store_true", default=os.environ.get("RLX_GPU_CHECK_SKIP_CUDA") == "1")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text("")
    ck = Check(out, args.skip_cuda, args.budget)
    shared: dict[str, object] = {}
    for name, section, needs_cuda in SECTIONS:
        if needs_cuda and ck.skip_cuda:
            ck.add(name, "all", "skip", "--skip-cuda")
            continue
        if ck.left() < 20:
            ck.add(name, "all", "fail", f"not run: the {args.budget:.0f} s budget is spent")
            continue
        t0 = time.perf_counter()
        try:
            result = section(ck, shared)
            if isinstance(result, dict):
                shared.update(result)
        except Exception as err:  # one broken section must not hide the others
            ck.log(traceback.format_exc())
            ck.add(name, "section", "fail", f"{type(err).__name__}: {str(err)[:300]}")
        ck.log(f"-- {name} took {time.perf_counter() - t0:.1f} s")
    counts = {s: sum(r.status == s for r in ck.rows) for s in ("ok", "fail", "skip", "miss")}
    ck.log(f"== {counts['ok']} ok, {counts['fail']} failed, {counts['skip']} skipped, {counts['miss']} targets missed "
           f"in {time.perf_counter() - ck.started:.0f} s; summary in {out / 'summary.md'}")
    print((out / "summary.md").read_text())
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())

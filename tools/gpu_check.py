"""The GPU check: everything a lent NVIDIA machine should run for the CUDA backend, in under 8 minutes.

    python3 tools/gpu_check.py [--out DIR] [--skip-cuda] [--budget SECONDS]

Writes, under ``--out`` (default ``$OUT``, else ``gpu_check_out``), as it goes, seven files (the machine
that runs it returns at most eight): ``results.json`` (every row, the environment — interpreter,
packages, ``nvidia-smi``, the CUDA devices or why there are none — and the JSON of `rlx-gpu conformance
--device cuda`), ``log.txt`` (the progress, then the whole output of the conformance run and of
``compute-sanitizer`` memcheck and racecheck on the small f32 cases), ``build.md`` (every kernel of every
program built for the device's ``sm_XY``, named by its PTX ``.entry`` list, with registers / local /
shared bytes read back from the driver), ``bench.md`` (copy bandwidth and bf16 GEMM rate as ceilings;
event-timed medians at the GPU shapes against cuDNN and the torch chunked twins, and byte floors; a
scan's time per step with CUDA graphs and without), ``backward.md`` (a training step, forward and §9 backward
thunk, against cuDNN's and the anchors' backward: ``gpu_backward.py``), ``mma.md`` (the chunked mamba2,
gated_delta_net and mamba3 and their backwards on the tensor cores, bf16 and TF32, against their FP32 FMA twin
and mamba_ssm / fla in bf16, with the MMA outputs' agreement with the FMA ones: ``gpu_mma.py``) and ``summary.md`` (the final table,
which also holds the capture section's rows: a decode step of each op family captured in a
``torch.cuda.CUDAGraph`` and replayed against eager calls, ``gpu_capture.py``). ``--budget``
caps the whole check: every section, and every child process, gets only the time left. Exit status: 0
when nothing failed, 1 otherwise (a section that could not run on a machine without CUDA counts as
failed unless ``--skip-cuda`` or ``RLX_GPU_CHECK_SKIP_CUDA=1`` says to skip it). Missed performance
targets are listed, not failures.
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
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT / "tools")]

import gpu_backward  # noqa: E402  (beside this script)
import gpu_capture  # noqa: E402
import gpu_mma  # noqa: E402
from gpu_bench import benchmarks, cuda_session, events_ms, torch_ms  # noqa: E402

PACKAGES = ("numpy", "ml_dtypes", "pyyaml", "cupy-cuda13x", "cupy-cuda12x", "torch", "cuda-bindings", "nvidia-cuda-nvrtc",
            "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cublas-cu12", "cuda-pathfinder")
CONFORMANCE = [sys.executable, "-m", "rlx_gpu.cli", "conformance", "--device", "cuda"]  # the conformance suite on CUDA
SANITIZED = ["--quick", "--dtypes", "f32"]  # the small f32 cases under compute-sanitizer
FILES = ("results.json", "log.txt", "summary.md", "build.md", "bench.md", "backward.md", "mma.md")  # all it writes: at most 8 come back
MIN_CHILD = 30  # seconds: a child process given less than this is not started
RESERVE = 15  # seconds kept back from every child for the sections' own bookkeeping


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
    results: dict = field(default_factory=dict)  # what results.json holds besides the rows

    def log(self, text: str) -> None:
        print(text, flush=True)
        with open(self.out / "log.txt", "a") as f:
            f.write(text + "\n")

    def add(self, section: str, item: str, status: str, detail: str = "") -> None:
        self.rows.append(Row(section, item, status, detail))
        self.log(f"[{status}] {section}: {item} {detail}")
        self.write_summary()

    def write(self, name: str, text: str) -> None:
        if name not in FILES:
            raise ValueError(f"{name} is not one of the check's files {FILES}: the GPU machine returns at most 8")
        (self.out / name).write_text(text)

    def write_summary(self) -> None:
        lines = ["| section | item | status | detail |", "|---|---|---|---|"]
        lines += [f"| {r.section} | {r.item} | {r.status} | {r.detail} |" for r in self.rows]
        self.write("summary.md", "\n".join(lines) + "\n")
        self.write("results.json", json.dumps({"rows": [asdict(r) for r in self.rows], **self.results}, indent=1,
                                              default=str))

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def timeout(self, share: float) -> int | None:
        """Seconds for a child process: ``share`` of the time left, at least :data:`MIN_CHILD`, never past
        the budget (less :data:`RESERVE`); None when not even :data:`MIN_CHILD` is left."""
        room = self.left() - RESERVE
        return None if room < MIN_CHILD else int(min(room, max(MIN_CHILD, self.left() * share)))

    @property
    def failed(self) -> bool:
        return any(r.status == "fail" for r in self.rows)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child run: this one, ``extra``, and the checkout ahead of ``PYTHONPATH``
    (kept, so wheels carried to the machine stay importable)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def run_child(cmd: list[str], timeout: int, env: dict[str, str]) -> tuple[str, int | None]:
    """(stdout then stderr, exit status) of ``cmd``; the status is None when it ran past ``timeout``, and
    the output is then what it wrote until stopped (a ``TimeoutExpired`` carries it as bytes)."""
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return f"{_text(err.stdout)}{_text(err.stderr)}\n--- stopped after {timeout} s", None
    return run.stdout + run.stderr, run.returncode


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
    ck.results["env"] = env
    ck.add("env", "interpreter and packages", "ok", f"python {platform.python_version()}, "
           + ", ".join(f"{k} {v}" for k, v in env["packages"].items()))
    ck.add("env", "cuda backend", "ok" if st.available else "skip" if ck.skip_cuda else "fail",
           st.devices[0].name if st.available else st.reason)


def build(ck: Check, shared: dict) -> None:
    from rlx_gpu.backends import nvrtc

    session = cuda_session()
    prims = session.prims
    rows = ["| program | kernel | registers | local B | shared B | build s |", "|---|---|---|---|---|---|"]
    cold = time.perf_counter()
    for prog in nvrtc.programs(session.limits.target):
        if ck.left() < RESERVE:
            ck.add("build", "the remaining programs", "fail", "not run: time budget spent")
            return
        t0 = time.perf_counter()
        module = session.program(prog)
        spent = time.perf_counter() - t0
        for name in nvrtc.parameters(prims.cubins.ptx(prog)):  # the kernels the module holds
            a = prims.kernel_attributes(prims.get_kernel(module, name))
            rows.append(f"| {prog.label} | {name} | {a['registers']} | {a['local_bytes']} | {a['shared_bytes']} | {spent:.2f} |")
        ck.write("build.md", "\n".join(rows) + "\n")
    ck.add("build", f"every program for {prims.arch}", "ok",
           f"{len(rows) - 2} kernels, {prims.cubins.compiled} cubins compiled in {time.perf_counter() - cold:.1f} s")


def conformance(ck: Check, shared: dict) -> None:
    cuda_session()
    timeout = ck.timeout(0.45)
    if timeout is None:
        ck.add("conformance", "suite on cuda", "fail", "not run: time budget spent")
        return
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "conformance.json"
        text, rc = run_child([*CONFORMANCE, "--json", str(report)], timeout, child_env())
        if report.exists():
            ck.results["conformance"] = json.loads(report.read_text())
    ck.log(f"===== rlx-gpu conformance --device cuda (exit {rc})\n{text}")
    last = [line for line in text.strip().splitlines() if line.strip()][-1:] or ["no output"]
    ck.add("conformance", "suite on cuda", "ok" if rc == 0 else "fail", last[0][:200])


def sanitizer(ck: Check, shared: dict) -> None:
    cuda_session()
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if tool is None:
        ck.add("sanitizer", "compute-sanitizer", "skip", "not installed on this machine")
        return
    env = child_env(RLX_CUDA_GRAPHS="0")
    for mode in ("memcheck", "racecheck"):
        timeout = ck.timeout(0.25)
        if timeout is None:
            ck.add("sanitizer", mode, "fail", "not run: time budget spent")
            continue
        text, rc = run_child([tool, "--tool", mode, "--error-exitcode", "86", *CONFORMANCE, *SANITIZED],
                             min(120, timeout), env)
        ck.log(f"===== compute-sanitizer {mode} (exit {rc})\n{text}")
        if rc not in (0, 86) and "Device not supported" in text:  # gVisor machines: the tool cannot attach
            ck.add("sanitizer", mode, "skip", "compute-sanitizer cannot attach to this device (see log.txt)")
            continue
        status = "ok" if rc == 0 else "fail"
        detail = "no errors" if rc == 0 else "timed out" if rc is None else "errors found" if rc == 86 else f"exit {rc}"
        ck.add("sanitizer", mode, status, detail)


def ceilings(ck: Check, shared: dict) -> dict[str, float]:
    import cupy as cp
    import torch

    session = cuda_session()
    stream = session.prims.stream
    n = 1 << 31
    pair = [session.prims.allocate(n, "a copy-bandwidth source"), session.prims.allocate(n, "a copy-bandwidth target")]
    rt = cp.cuda.runtime
    ms = events_ms(stream, lambda: rt.memcpyAsync(pair[1].ptr, pair[0].ptr, n, rt.memcpyDeviceToDevice, stream.ptr), 10)
    bandwidth = 2 * n / (ms * 1e-3)  # bytes read + written per second
    pair.clear()  # the 4 GiB go back before the benchmarks
    ck.add("ceilings", "device copy bandwidth", "ok", f"{bandwidth / 1e12:.2f} TB/s (read + write, 2 GiB)")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = torch_ms(lambda: torch.matmul(a, b), 10, 3)
    tflops = 2 * 8192**3 / (ms * 1e-3) / 1e12
    ck.add("ceilings", "bf16 GEMM 8192^3 (torch)", "ok", f"{tflops:.0f} TFLOP/s")
    return {"bandwidth": bandwidth, "bf16_tflops": tflops}


SECTIONS = (("env", environment, False), ("build", build, True), ("conformance", conformance, True),
            ("sanitizer", sanitizer, True), ("ceilings", ceilings, True), ("bench", benchmarks, True),
            ("backward", gpu_backward.benchmarks, True), ("capture", gpu_capture.decode_steps, True),
            ("mma", gpu_mma.benchmarks, True))


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

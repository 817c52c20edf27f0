"""No macro of the kernel texts reads or declares its caller's locals (DESIGN.md principle 14): every
``#define`` of kernels/*.cl and the dialect preludes names a constant, a compile-time variant or a word of
the portable vocabulary, and a shared step is a function taking what it reads as parameters. A macro body
may use its own parameters, compile-time constants (upper-case names no kernel or function takes as a
parameter), types, C keywords, the names it calls and the members it selects; nothing else. A macro or
function that meets a work-group barrier says so in its name, so a reader of the kernel sees every
barrier its work-group must reach."""
from __future__ import annotations

import re

import pytest

from rlx_gpu.paths import data_dir

TEXTS = sorted(data_dir("kernels").glob("*.cl")) + [data_dir("kernels_opencl") / "prelude.cl",
                                                    data_dir("kernels_cuda") / "prelude.cuh"]
#: C, OpenCL C and CUDA words: keywords, built-in types, attributes
C_WORDS = frozenset("""
    const static inline void extern sizeof struct do while for if else return break continue switch case default
    unsigned signed char short int long float double half bool uchar ushort uint ulong
    __kernel __global __local __constant always_inline work_group_size_hint
    __global__ __device__ __shared__ __forceinline__""".split())
#: per text: the dialect's built-in variables (the CUDA prelude's RLX_AXIS(d) selects their .x, .y, .z)
BUILTINS = {"prelude.cuh": frozenset({"threadIdx", "blockIdx", "blockDim", "gridDim", "x", "y", "z"})}
DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(\(([^)]*)\))?((?:[^\n]*\\\n)*[^\n]*)", re.M)
#: a kernel or device function: its name, parameters and (up to a closing brace in column 0) body
FUNCTION = re.compile(r"^(KERNEL\w*|DEVICE_FN|INLINE_FN)\b[^;{]*?\b(\w+)\(([^)]*)\)\s*\{(.*?)^\}", re.S | re.M)
CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*")


def _code(text: str) -> str:
    """``text`` without comments, string literals, line continuations and number literals."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', " ", text).replace("\\\n", " ")
    return re.sub(r"(?<![\w.])\.?\d[\w.]*(?:[eE][-+]\d+\w*)?", " ", text)


def _everywhere() -> tuple[set[str], set[str]]:
    """The parameter names of every kernel and device function (a caller's locals), and every type name, of
    all the texts."""
    parameters, types = set(), set(C_WORDS)
    for path in TEXTS:
        text = _code(path.read_text())
        for fn in FUNCTION.finditer(text):
            parameters |= {re.findall(r"\w+", p)[-1] for p in fn.group(3).split(",") if p.strip()}
        types |= set(re.findall(r"typedef\b[^;{]*?(\w+)\s*;", text)) | set(re.findall(r"\}\s*(\w+)\s*;", text))
    return parameters, types


def _offences(name: str, params: list[str], body: str, builtins: frozenset[str], parameters: set[str],
              types: set[str]) -> list[str]:
    """What the macro ``name(params) body`` does with names that are not its own: the variables it declares,
    the names it reads and the parameters it assigns (a value returned through the caller's variable)."""
    kinds = "|".join(sorted(types, key=len, reverse=True))
    declaration = rf"\b(?:{kinds})\b[\s*]*(?:const\b[\s*]*)?([A-Za-z_]\w*)\s*(?:=|;|,|\[)"
    declared = list(dict.fromkeys(re.findall(declaration, body)))
    read = []
    for word in re.finditer(r"(\.|->)?\s*\b([A-Za-z_]\w*)\b(\s*\()?", body):
        member, ident, called = word.groups()
        allowed = (member or called or ident in params or ident in types or ident in builtins
                   or (CONSTANT.fullmatch(ident) and ident not in parameters))
        if not allowed and ident not in declared and ident not in read:
            read.append(ident)
    assigned = [p for p in params if re.search(rf"\b{p}\s*(?:[-+*/%&|^]|<<|>>)?=(?!=)|\+\+\s*{p}\b|\b{p}\s*\+\+", body)]
    found = [f"declares {', '.join(declared)}"] if declared else []
    found += [f"reads {', '.join(read)}"] if read else []
    found += [f"assigns its parameter {', '.join(assigned)}"] if assigned else []
    return [f"{name} ({'; '.join(found)})"] if found else []


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_no_macro_reads_or_declares_its_callers_locals(path):
    parameters, types = _everywhere()
    offenders = []
    for macro in DEFINE.finditer(_code(path.read_text())):
        params = [p.strip() for p in (macro.group(3) or "").split(",") if p.strip() not in ("", "...")]
        offenders += _offences(macro.group(1), params, macro.group(4), BUILTINS.get(path.name, frozenset()),
                               parameters, types)
    assert not offenders, (f"{path.name}: macros over their caller's names: {'; '.join(offenders)}; write an "
                           f"inline function taking what it reads and returning what it makes (DESIGN.md 14)")


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_only_functions_named_for_it_meet_a_barrier(path):
    """A function a work-group must all call (it meets a barrier) is named ``..._barrier``: a reader of the
    kernel sees every barrier, and the early-return check (test_kernel_text.py) finds it."""
    text = _code(path.read_text())
    hidden = [fn.group(2) for fn in FUNCTION.finditer(text) if not fn.group(1).startswith("KERNEL")
              and re.search(r"\bBARRIER\(|\w_barrier\(", fn.group(4)) and not fn.group(2).endswith("_barrier")]
    hidden += [m.group(1) for m in DEFINE.finditer(text) if "BARRIER(" in m.group(4) and "BARRIER" not in m.group(1)]
    assert not hidden, f"{path.name}: {hidden} meet a barrier without saying so; name them ..._barrier"

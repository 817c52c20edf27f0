"""Kernel signatures, read from the portable kernel text: each kernel's parameters, in order, by type class.

Each ``KERNEL`` of ``kernels/<family>.cl`` is read once per target (a kernel may have one text per target,
chosen by ``RLX_TARGET_GPU`` / ``RLX_TARGET_CPU``; other conditions leave a kernel in, as some program variant
compiles it) into its ordered parameters, each of a type class:

- ``tensor``: ``GLOBAL uchar* xb`` and the ``i64`` byte offset after it (ABI.md's ``(base, offset)``);
- ``i64`` and ``int``: 64- and 32-bit integers;
- ``real``: the launch's compute type (f64 for f64, else f32).

``launches.arguments`` binds a planner's arguments, named by these parameters, into their positional order.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache

from ..paths import data_dir
from .registry import families, shared_texts


class KernelTextError(ValueError):
    """A kernel text declares a parameter or a target condition that the signature reader cannot read."""


class KernelArgumentError(TypeError):
    """A launch does not match its kernel's signature: an unknown kernel, or a missing, unknown or mistyped
    argument (a planner bug, caught at plan time)."""


@dataclass(frozen=True)
class Param:
    """One argument of a kernel: its name, type class and, for a tensor, the name of its offset parameter."""

    name: str
    kind: str  # "tensor" | "i64" | "int" | "real"
    offset: str = ""

    @property
    def width(self) -> int:
        """How many positional arguments it takes: a tensor two (buffer, offset), a scalar one."""
        return 2 if self.kind == "tensor" else 1

    def describe(self) -> str:
        return f"tensor {self.name}, {self.offset}" if self.kind == "tensor" else f"{self.kind} {self.name}"


@dataclass(frozen=True)
class Signature:
    """The parameters of one kernel at one target, in order, and where its text declares them."""

    family: str
    kernel: str
    target: str
    where: str  # kernels/<family>.cl:<line>
    params: tuple[Param, ...]

    @property
    def label(self) -> str:
        return f"kernel {self.kernel} ({self.where}, {self.target} target)"

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.params)


@lru_cache(maxsize=None)
def signature(family: str, kernel: str, target: str) -> Signature:
    """The parameters of ``kernel`` in the texts of ``family`` (``texts``) at ``target``."""
    found = signatures(family, target)
    if kernel not in found:
        raise KernelArgumentError(f"kernels/{family}.cl declares no kernel {kernel!r} at the {target} target; "
                                  f"it declares {', '.join(sorted(found))}")
    return found[kernel]


def texts(family: str) -> tuple[str, ...]:
    """The kernel texts whose kernels are ``family``'s: ``<family>.cl`` and those of the texts it shares that are no
    family's own (its planner's kernels in a file of their own, as kernels/gdn_chunk_backward.cl)."""
    owned = {f"{name}.cl" for name in families()}
    return (*(text for text in shared_texts(family) if text not in owned), f"{family}.cl")


@lru_cache(maxsize=None)
def signatures(family: str, target: str) -> dict[str, Signature]:
    """Every kernel the texts of ``family`` (``texts``) declare at ``target``, by name (read once)."""
    found: dict[str, Signature] = {}
    for name in texts(family):
        found.update(parse((data_dir("kernels") / name).read_text(), f"kernels/{name}", family, target))
    return found


_KERNEL = re.compile(r"KERNEL(?:_BOUNDED\([^)]*\))?\s+(\w+)\s*\(([^)]*)\)")
_PARAM = re.compile(r"(GLOBAL uchar\*|i64|int|real) (\w+)")
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def parse(text: str, where: str, family: str, target: str) -> dict[str, Signature]:
    """The kernels ``text`` declares at ``target`` (a kernel twice only with the same parameters)."""
    text = _COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text)  # comments out, line numbers kept
    branches = _Branches(where, target)
    found: dict[str, Signature] = {}
    start = 0  # where the line begins in text
    for number, line in enumerate(text.split("\n"), 1):
        stripped, at, start = line.strip(), start, start + len(line) + 1
        if stripped.startswith("#"):
            branches.directive(stripped, number)
        elif stripped.startswith("KERNEL") and branches.visible:
            match = _KERNEL.match(text, at + line.index("KERNEL"))
            if match is None:
                raise KernelTextError(f"{where}:{number}: a KERNEL line without a parameter list")
            sig = Signature(family, match[1], target, f"{where}:{number}", _params(match[2], f"{where}:{number}"))
            if match[1] in found and found[match[1]].params != sig.params:
                raise KernelTextError(f"{sig.where}: kernel {match[1]} is declared again at the {target} target "
                                      f"with other parameters than at {found[match[1]].where}")
            found.setdefault(match[1], sig)
    return found


def _params(text: str, where: str) -> tuple[Param, ...]:
    """Typed parameters of one parameter list; a buffer takes the ``i64`` after it as its offset."""
    typed = []
    for raw in text.split(","):
        match = _PARAM.fullmatch(" ".join(raw.replace("*", "* ").split()).replace(" *", "*"))
        if match is None:
            raise KernelTextError(f"{where}: parameter {raw.strip()!r} is none of GLOBAL uchar*, i64, int, real")
        typed.append((match[1], match[2]))
    params, index = [], 0
    while index < len(typed):
        kind, name = typed[index]
        if kind == "GLOBAL uchar*":
            if index + 1 == len(typed) or typed[index + 1][0] != "i64":
                raise KernelTextError(f"{where}: buffer {name} is not followed by its i64 byte offset")
            params.append(Param(name, "tensor", typed[index + 1][1]))
            index += 2
        else:
            params.append(Param(name, kind))
            index += 1
    return tuple(params)


#: a term of a target condition: ``defined(RLX_TARGET_GPU)``, ``!defined RLX_TARGET_CPU``, ...
_TARGET_TERM = re.compile(r"(!?)\s*defined\s*\(?\s*RLX_TARGET_(\w+)\s*\)?")


class _Branches:
    """The preprocessor branches around a line, as far as the target decides them: each branch is True,
    False or None (decided by other macros: a kernel inside may be compiled, so it is read)."""

    def __init__(self, where: str, target: str) -> None:
        self.where, self.target = where, target
        self.stack: list[tuple[bool | None, bool | None]] = []  # (this branch, any earlier branch of the chain)

    @property
    def visible(self) -> bool:
        return all(current is not False for current, _ in self.stack)

    def directive(self, line: str, number: int) -> None:
        word, _, rest = line[1:].strip().partition(" ")
        rest = rest.strip()
        if word in ("if", "ifdef", "ifndef"):
            cond = self._condition({"if": rest, "ifdef": f"defined({rest})", "ifndef": f"!defined({rest})"}[word],
                                   number)
            self.stack.append((cond, cond))
        elif word == "elif":
            _, earlier = self.stack.pop()
            cond = self._condition(rest, number)
            self.stack.append((_and(_not(earlier), cond), _or(earlier, cond)))
        elif word == "else":
            _, earlier = self.stack.pop()
            self.stack.append((_not(earlier), True))
        elif word == "endif":
            self.stack.pop()

    def _condition(self, expr: str, number: int) -> bool | None:
        if "RLX_TARGET_" not in expr:
            return None
        if "||" in expr:
            raise KernelTextError(f"{self.where}:{number}: a target condition joins terms with ||; "
                                  f"write it as &&-joined terms (#if defined(RLX_TARGET_GPU) && ...)")
        value: bool | None = True
        for term in expr.split("&&"):
            match = _TARGET_TERM.fullmatch(term.strip())
            if match is None and "RLX_TARGET_" in term:
                raise KernelTextError(f"{self.where}:{number}: cannot read the target term {term.strip()!r}")
            value = _and(value, None if match is None else (match[2].lower() == self.target) != bool(match[1]))
        return value


def _not(a: bool | None) -> bool | None:
    return None if a is None else not a


def _and(a: bool | None, b: bool | None) -> bool | None:
    return False if a is False or b is False else (True if a and b else None)


def _or(a: bool | None, b: bool | None) -> bool | None:
    return True if a or b else (False if a is False and b is False else None)

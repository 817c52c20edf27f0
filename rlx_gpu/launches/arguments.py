"""A launch's arguments named by its kernel's parameters, bound once into the kernel's positional order.

A planner names every argument by the parameter names of the kernel text (``launches.signatures``):
a tensor as one ``(Buf, byte offset)`` pair under its buffer's name, an integer (a bool for a flag) for
``i64`` and ``int``, a number for ``real``. :func:`kernel_launch` binds them at plan time, so a missing,
unknown or mistyped argument fails there, naming the kernel, the parameter and the value, and no two
arguments can trade places unseen. The launch keeps the positional tuple the backends pass on (tensors
as buffer then ``np.int64`` offset, scalars as NumPy scalars of their parameter's type). Launches of a
loop that share most arguments bind those once (:func:`bind_some`) and each its own (:meth:`Partial.bind`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from numbers import Integral, Real
from typing import Any, Callable, Iterable, Mapping, NoReturn

import numpy as np

from host_fallback.arena import COMPUTE

from .core import Buf, Launch
from .signatures import KernelArgumentError, Param, Signature, signature

#: the scalar types planners pass, known by identity first (checking an abstract number type costs more, and
#: every argument of every launch is converted)
_INTEGERS = frozenset({int, bool, np.int64, np.int32})
_NUMBERS = frozenset({int, float, np.float32, np.float64})
Convert = Callable[[Any, type], "tuple | None"]


def _is_integer(value: Any) -> bool:
    return type(value) in _INTEGERS or isinstance(value, (Integral, np.integer))


def _tensor(value: Any, real: type) -> tuple | None:
    if type(value) is tuple and len(value) == 2 and isinstance(value[0], Buf) and _is_integer(value[1]):
        return value[0], np.int64(value[1])
    return None


def _i64(value: Any, real: type) -> tuple | None:
    return (np.int64(value),) if _is_integer(value) else None


def _int(value: Any, real: type) -> tuple | None:
    return (np.int32(int(value)),) if _is_integer(value) and -(1 << 31) <= value < (1 << 31) else None


def _real(value: Any, real: type) -> tuple | None:
    if type(value) in _NUMBERS or (isinstance(value, Real) and not isinstance(value, bool)):
        return (real(value),)
    return None


#: type class -> what its value must be, and its positional arguments from a value (None when it is not that)
_KINDS: dict[str, tuple[str, Convert]] = {
    "tensor": ("a (Buf, byte offset) pair", _tensor), "i64": ("an integer", _i64),
    "int": ("an integer of 32 bits", _int), "real": ("a number", _real)}


def bind(sig: Signature, dtype: str, args: Mapping[str, Any]) -> tuple:
    """``args`` (parameter name -> value) in the kernel's positional order (``real``: the compute type of
    ``dtype``)."""
    if len(args) != len(sig.params) or not sig.names.issuperset(args):
        raise _mismatch(sig, args, sig.names)
    real, out = COMPUTE[dtype].type, []
    for p in sig.params:
        value = args[p.name]
        out += _KINDS[p.kind][1](value, real) or _refuse(sig, p, value)
    return tuple(out)


def bind_some(sig: Signature, dtype: str, args: Mapping[str, Any]) -> Partial:
    """``args`` bound ahead, for launches that give the rest each (:meth:`Partial.bind`)."""
    if not sig.names.issuperset(args):
        raise _mismatch(sig, args, frozenset(args) & sig.names)
    real, pieces, holes, at = COMPUTE[dtype].type, [], [], 0
    for p in sig.params:
        if p.name in args:
            pieces += _KINDS[p.kind][1](args[p.name], real) or _refuse(sig, p, args[p.name])
        else:
            pieces += (None,) * p.width
            holes.append((at, at + p.width, p))
        at += p.width
    return Partial(sig, dtype, tuple(pieces), tuple(holes))


@dataclass(frozen=True)
class Partial:
    """A kernel's arguments with some bound ahead (what every launch of a loop shares, checked and converted
    once): the positional arguments with None in the holes, and each hole's place and parameter."""

    signature: Signature
    dtype: str
    template: tuple[Any, ...]
    holes: tuple[tuple[int, int, Param], ...]

    @cached_property
    def rest(self) -> frozenset[str]:
        """The parameters each launch gives."""
        return frozenset(p.name for _, _, p in self.holes)

    def bind(self, args: Mapping[str, Any]) -> tuple:
        """The positional arguments with ``args`` (parameter name -> value) for the rest."""
        if len(args) != len(self.rest) or not self.rest.issuperset(args):
            raise _mismatch(self.signature, args, self.rest)
        real, out = COMPUTE[self.dtype].type, list(self.template)
        for start, end, p in self.holes:
            value = args[p.name]
            out[start:end] = _KINDS[p.kind][1](value, real) or _refuse(self.signature, p, value)
        return tuple(out)


def named(sig: Signature, bound: tuple) -> dict[str, Any]:
    """A launch's positional arguments read back by parameter name: a tensor as a ``(Buf, int)`` pair, a
    scalar as a Python number (what :func:`bind` takes)."""
    width = sum(p.width for p in sig.params)
    if len(bound) != width:
        raise KernelArgumentError(f"{sig.label} takes {width} positional arguments; a launch has {len(bound)}")
    out, at = {}, 0
    for p in sig.params:
        out[p.name] = (bound[at], int(bound[at + 1])) if p.kind == "tensor" else bound[at].item()
        at += p.width
    return out


def kernel_launch(family: str, kernel: str, dtype: str, global_size: tuple[int, ...], local_size: tuple[int, ...],
                  args: Mapping[str, Any], *, target: str, defines: tuple[tuple[str, int], ...] = (),
                  src_dtype: str | None = None, shared: Partial | None = None) -> Launch:
    """A launch of ``kernel`` (``kernels/<family>.cl``) at ``target``, ``args`` named by its parameters: all of
    them, or the rest of those bound ahead in ``shared`` (:func:`bind_some`)."""
    sig = signature(family, kernel, target)
    if shared is None:
        bound = bind(sig, dtype, args)
    elif shared.signature is not sig or shared.dtype != dtype:
        raise KernelArgumentError(f"arguments bound ahead for {shared.signature.label} at {shared.dtype} given to "
                                  f"a {dtype} launch of {sig.label}")
    else:
        bound = shared.bind(args)
    return Launch(family, kernel, dtype, global_size, local_size, bound, src_dtype, target, defines)


def _refuse(sig: Signature, p: Param, value: Any) -> NoReturn:
    raise KernelArgumentError(f"{sig.label}: parameter {p.describe()} takes {_KINDS[p.kind][0]}; got {value!r}")


def _mismatch(sig: Signature, given: Iterable[str], wanted: frozenset[str]) -> KernelArgumentError:
    """The error for arguments ``given`` where the parameters ``wanted`` were expected."""
    unknown = [repr(name) for name in given if name not in sig.names]
    again = [repr(name) for name in given if name in sig.names and name not in wanted]
    missing = [p.describe() for p in sig.params if p.name in wanted and p.name not in given]
    parts = ([f"no parameter named {', '.join(unknown)}"] if unknown else []) + (
        [f"{', '.join(again)} bound ahead already"] if again else []) + (
        [f"missing {', '.join(missing)}"] if missing else [])
    return KernelArgumentError(f"{sig.label}: {'; '.join(parts)} (its parameters: "
                               f"{', '.join(p.name for p in sig.params)})")

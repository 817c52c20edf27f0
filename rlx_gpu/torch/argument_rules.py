"""The vocabulary ``arguments``' checks are written in: a function's named sizes fixed by the first argument
that shows each (``Sizes``), the dtype, device and index-tensor rules, and ``once_per_signature``, which runs
a static check once per signature of its arguments. Messages name the caller's function, argument and
layout (the anchors' spellings: ``(batch, dim, seqlen)``)."""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Hashable, Iterable, TypeVar

import torch

#: The floating dtypes the ops run (ABI.md §1).
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

Form = tuple[str, ...]
Check = TypeVar("Check", bound=Callable[..., None])
#: How many argument signatures each check remembers as passed.
PASSED_SIZE = 512


def signature(value: Any) -> Hashable:
    """What a static check reads of an argument: a tensor's shape, dtype and device; a value itself."""
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype, value.device
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(map(signature, value))
    try:
        hash(value)
    except TypeError:
        return type(value), id(value)
    return value


def once_per_signature(check: Check) -> Check:
    """``check`` run once per signature of its arguments (``signature``): a static check reads nothing
    else, so a signature that passed passes again; a decode loop pays a dictionary lookup per call, not
    the check. Under ``torch.compile`` the check runs as written (once, while tracing)."""
    passed: dict[Hashable, None] = {}
    lock = threading.Lock()

    @functools.wraps(check)
    def checked(*args: Any, **kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return check(*args, **kwargs)
        # signature of each argument, its two common cases written out (a decode step's call has a dozen)
        key = tuple([(a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else a if a is None or type(a) is bool
                     else signature(a) for a in args])
        if kwargs:
            key += tuple((k, signature(v)) for k, v in kwargs.items())
        if key in passed:
            return None
        check(*args, **kwargs)
        with lock:
            if len(passed) >= PASSED_SIZE:
                passed.clear()
            passed[key] = None
        return None
    return checked  # type: ignore[return-value]


def spelled(form: Form) -> str:
    """A form as the anchors' docstrings write it: ``(batch, dim, seqlen)``, ``(dim,)``."""
    return f"({form[0]},)" if len(form) == 1 else f"({', '.join(form)})"


def is_tensor(fn: str, arg: str, t: Any) -> bool:
    """Whether ``t`` is given (None: not); anything but a tensor or None is refused."""
    if t is None:
        return False
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    return True


class Sizes:
    """The named sizes of one call, each fixed by the first argument that shows it; ``take`` checks an
    argument against them and fixes the sizes it shows first. Messages are made only when one is raised:
    a call that passes costs a few microseconds."""

    def __init__(self, fn: str):
        self.fn = fn
        #: name -> (size, the argument that showed it and its shape, or a function saying where it came from)
        self.known: dict[str, tuple[int, str | Callable[[], str], torch.Size | None]] = {}

    def fix(self, name: str, size: int, source: Callable[[], str]) -> None:
        """Fix ``name`` to ``size``; ``source()`` says where it came from, in a message."""
        self.known[name] = (size, source, None)

    def size(self, name: str) -> int:
        return self.known[name][0]

    def source(self, name: str) -> str:
        """Where the size ``name`` came from: ``u [2, 4, 6]``, or what ``fix`` was told."""
        _, arg, shape = self.known[name]
        return arg() if callable(arg) else f"{arg} {list(shape)}"

    def take(self, arg: str, t: Any, *forms: Form) -> Form:
        """Check the tensor ``t`` against the form of its rank among ``forms`` (its dimensions' names);
        the form taken."""
        if not is_tensor(self.fn, arg, t):
            raise TypeError(f"{self.fn}: {arg} must be a torch.Tensor, got None")
        shape = t.shape
        rank = len(shape)
        for form in forms:
            if len(form) == rank:
                break
        else:
            written = [spelled(f) for f in forms]
            choices = written[0] if len(written) == 1 else f"{', '.join(written[:-1])} or {written[-1]}"
            raise ValueError(f"{self.fn}: {arg} has shape {list(shape)} ({rank} dimensions); expected {choices}")
        known = self.known
        fresh = []
        for name, size in zip(form, shape):
            seen = known.get(name)
            if seen is None:
                fresh.append((name, size))
            elif seen[0] != size:
                self._mismatch(arg, shape, form)
        for name, size in fresh:  # fixed once the whole shape fits, so a mismatch names only earlier sources
            known[name] = (size, arg, shape)
        return form

    def _mismatch(self, arg: str, shape: torch.Size, form: Form) -> None:
        known = self.known
        expected = ", ".join(str(known[n][0]) if n in known else n for n in form)
        why = ", ".join(f"{n}={known[n][0]} from {self.source(n)}" for n, s in zip(form, shape)
                        if n in known and known[n][0] != s)
        raise ValueError(f"{self.fn}: {arg} has shape {list(shape)}; expected {spelled(form)} = [{expected}] ({why})")

    def maybe(self, arg: str, t: Any, *forms: Form) -> Form | None:
        """``take`` for an optional argument: None when ``t`` is."""
        return None if t is None else self.take(arg, t, *forms)

    def divides(self, part: str, whole: str, arg: str, meaning: str) -> None:
        """``part`` (shown by ``arg``) divides ``whole``; ``meaning`` says why it must."""
        p, w = self.size(part), self.size(whole)
        if p == 0 or w % p:
            raise ValueError(f"{self.fn}: {arg} has {part}={p}, which does not divide {whole}={w} (from "
                             f"{self.source(whole)}); {meaning}")


def real(fn: str, arg: str, t: torch.Tensor) -> None:
    """``t`` is one of the ops' floating dtypes (complex: the scans are real)."""
    if t.is_complex():
        raise NotImplementedError(f"{fn}: {arg} is complex ({t.dtype}); rlx_gpu's scans are real (ABI.md §4): "
                                  f"pass a real {arg}")
    if t.dtype not in FLOATS:
        raise TypeError(f"{fn}: {arg} is {t.dtype}; expected a floating tensor ({', '.join(map(str, FLOATS))})")


def dtypes(fn: str, library: str, tensors: dict[str, torch.Tensor | None], anchor: str, same: Iterable[str],
            beside: dict[str, tuple[tuple[torch.dtype, ...], str]]) -> None:
    """Every tensor real; those named in ``same`` (the activations) of the anchor's dtype, as ``library``
    requires; each of ``beside`` of the anchor's dtype or one of its allowed dtypes, which its text names
    (``{anchor}`` and ``{A}`` there: the anchor's name and A's dtype)."""
    given = {arg: t for arg, t in tensors.items() if t is not None}
    for arg, t in given.items():
        real(fn, arg, t)
    act = given[anchor].dtype
    for arg in same:
        t = given.get(arg)
        if t is not None and t.dtype != act:
            raise TypeError(f"{fn}: {arg} is {t.dtype} beside {anchor} {act}; the activations "
                            f"({', '.join([anchor, *same])}) share one dtype, as {library}'s kernels require: "
                            f"pass {arg}.to({act})")
    for arg, (allowed, why) in beside.items():
        t = given.get(arg)
        if t is not None and t.dtype != act and t.dtype not in allowed:
            a_dtype = given["A"].dtype if "A" in given else None
            raise TypeError(f"{fn}: {arg} is {t.dtype} beside {anchor} {act}; {arg} takes "
                            f"{why.format(anchor=anchor, A=a_dtype)}")


def same_device(fn: str, anchor: str, tensors: dict[str, torch.Tensor | None]) -> None:
    home = tensors[anchor].device
    for arg, t in tensors.items():
        if t is not None and t.device != home:
            raise ValueError(f"{fn}: {arg} lies on {t.device}, {anchor} on {home}; the tensors of one call lie on "
                             f"one device: move {arg} with .to({anchor}.device)")


def indices(fn: str, arg: str, t: torch.Tensor | None, what: str) -> bool:
    """An index tensor (``what`` it holds) is integer; whether it is given."""
    if not is_tensor(fn, arg, t):
        return False
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{fn}: {arg} is {t.dtype}; expected an integer tensor (torch.int32 or torch.int64) of "
                        f"{what}")
    return True


#: The floating dtypes of more bytes than each (ABI.md §8's ``param_dtype``: f32 or f64 beside f16).
WIDER = {d: tuple(w for w in FLOATS if w.itemsize > d.itemsize) for d in FLOATS}


def parameter_dtypes(act: torch.dtype, A: torch.Tensor, *names: str) -> dict[str, tuple[tuple[torch.dtype, ...], str]]:
    """mamba_ssm's per-channel parameters: ``A`` in the activations' dtype or a wider float (f32 beside
    16-bit activations, as mamba_ssm keeps it), the others in the activations' or ``A``'s dtype."""
    return {"A": (WIDER.get(act, ()), "{anchor}'s dtype or a wider float (f32 beside 16-bit {anchor}, as mamba_ssm "
                                      "keeps A)"),
            **{n: ((A.dtype,), "{anchor}'s or A's dtype ({A})") for n in names}}

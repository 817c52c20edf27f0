"""The host's registries: what each kernel module of ``host_fallback`` registers against its ops on import.

``host_fallback`` (the package) imports those modules and serves thunks from these tables.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from .registry import Registry

Kernel = Callable[..., None]

#: op -> ``kernel(thunk, arena, **options)``, which runs one thunk on a host arena in place
KERNELS: Registry[Kernel] = Registry("host kernel")
#: op -> ``prepare(thunk)``, for the kernels that can do their thunk-only setup once: it returns
#: ``run(arena, **options)`` (the kernel's options), equivalent to ``KERNELS[op](thunk, arena, **options)``
PREPARE: Registry[Callable[[Mapping[str, Any]], Callable[..., None]]] = Registry("host kernel setup (prepare)")
#: the ops whose prepared ``run`` also takes ``given`` (a field's arena offset -> an array to read or write in
#: place of its arena view: a caller's memory, no copy through the arena) and then returns whether it ran
#: on them (False: nothing ran, the caller copies through the arena)
GIVEN: set[str] = set()
#: the ops of ``GIVEN`` whose ``run`` takes a ``given`` of output arrays alone (a call that hands over no input:
#: a training forward's saved forward written into the caller's array); the others are offered outputs only
#: beside an input, since their run takes the arrays on one path and a refused offer costs its setup
GIVEN_OUTPUTS: set[str] = set()
#: op -> a lower bound of the bytes its kernel allocates besides the arena, for the ops whose setup grows with it
WORKING: Registry[Callable[[Mapping[str, Any]], int]] = Registry("host working-memory bound")
#: op -> ``path_for(thunk, **options)``: the algorithm the host runs a thunk with, for ops that choose one
PATHS: Registry[Callable[..., str]] = Registry("host path chooser")

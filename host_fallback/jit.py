"""Host kernels compiled by Numba (the ``jit`` extra), used where it is installed.

The step paths of selective_scan, mamba2, gated_delta_net and mamba3, each one call a thunk
(``selective_scan_step``, ``mamba2_step``, ``gated_delta_net_step``, ``mamba3_step``; where they apply and their
arguments: ``compiled_step``), where NumPy's step makes a dozen array passes a token (mamba3's some forty): a B1
decode thunk's own time on an AMD EPYC Zen 5 falls from 45-75 µs to 6-15 µs (mamba3's from 103 to 10: ``python
benchmarks/decode.py --thunk``).

And causal_conv1d's decode step (``causal_conv1d_decode``; where it applies: ``conv._compiled_decode``): a run
of rows in one call that holds no GIL, one pass over each row's pool entry, where NumPy's step makes about
twenty array passes, releasing and retaking the GIL between them (two threads then mostly wait on each other).

And a whole lstm step (``lstm_step``), its two GEMMs ``W_hh·h + W_ih·x_t`` in register tiles
over weights packed once per call (``lstm_panels``, ``lstm_panel_bias``), then the gates, the cell and
``o·tanh(c)`` in vectorized passes. NumPy runs a step as an OpenBLAS GEMM (which repacks ``W_hh`` on
every call), the input projection a time chunk at a time, and about fifteen array passes
(``rnn_loops._lstm_loop``). NumPy's loop stays the path without Numba and everywhere the kernel does not apply
(``rnn_cell._cell`` says where); the tests run both against the same float64 recurrences.

The tiles' vectors are as wide as the CPU's (``lanes``): 16 float32 lanes where it has AVX-512, else 8
(AVX2's width); ``RLX_HOST_JIT_WIDTH=8`` or ``16`` forces one, to compare them on one machine (both are
tested on every machine). ``python benchmarks/rnn.py`` times the host lstm with either step beside torch's
oneDNN kernel, and each part of a step, under a header naming the CPU, its vector ISA and the width. At B=32
S=128 I=H=256, 2 layers, bidirectional, 2 threads: on a 2-core AMD EPYC Zen 3 (AVX2, 8 lanes) the compiled
step took the host lstm from 1.28x torch to 0.93x (medians); on a 2-core AMD EPYC Zen 5 (AVX-512) it is
0.97x with 16 lanes (0.92-0.99) and 1.79x with 8 (NumPy's step: 2.07x). On one thread each (CPU time) the
Zen 5 figures are 1.04x and 1.91x: torch's kernel loses more to its second thread than the host's
directions do.
And a small lstm's whole layer-direction, forward and backward through time (``lstm_sequence``,
``lstm_sequence_backward``; where they apply: the ``lstm_sequence`` module): one call for every step, where the
time went between the steps (B=8 S=24 H=32, 2 layers, one thread: the backward thunk 2.5 ms to 0.4, the forward
0.29 to 0.12). A gru's and an rnn's likewise (``gru_sequence``, ``gru_sequence_backward``, ``rnn_sequence``,
``rnn_sequence_backward``; where they apply: the ``rnn_sequence`` module), in the same tiles.
And selective_scan's backward (``selective_scan_backward_run``; where it applies: ``selective_scan_backward``):
one batch row's every gradient in one call, a chunk's states recomputed from the saved (or checkpointed) state
with their decays kept, then its reverse, in vector loops along blocks of channels.
And gated_delta_net's chunked backward (``gdn_channel_decays``, ``gdn_channel_gradients``, ``gdn_head_operands``,
``gdn_head_gradients``, ``gdn_reverse_state``; where they apply: ``gdn_backward_chunked``, ``gdn_backward_grads``):
each chunk's cumulative log-decays with their exponentials in one pass (per head with the GEMMs' operands); with
either gate kind the decayed triangular products with the query, key and log-decay gradients in one pass over the
GEMMs' products, where NumPy makes twenty to twenty-five passes and three or four square GEMMs a chunk, and each
chunk of the reverse over chunks one pass after its two GEMMs.
And mamba2's chunked backward (``mamba2_backward_operands``, ``mamba2_backward_state_gradients``,
``mamba2_backward_gradients``; where they apply: ``mamba2_backward_chunked``): the passes between its GEMMs, which stay
OpenBLAS's, one compiled pass each where NumPy makes several; with a saved forward every chunk in one pass
(``mamba2_backward_saved``, module ``jit_mamba2_saved``), its GEMMs in the lstm step's register tiles (imported from
``jit_lstm``, not copied) over operands packed per (row, head, chunk), where NumPy's slabs make five GEMMs and about
ten array passes a chunk.
NumPy's slabs stay the twin without Numba (the tests run both against the float64 reference).
And a float32 GEMM in the lstm step's tiles, blocked for the caches (``gemm``; where it runs: the ``gemm``
module), for a recurrent layer's large products where NumPy's OpenBLAS runs narrower vectors than the CPU's.
And the gates of a recurrent backward's rebuilt chunk (``lstm_chunk_gates``, ``gru_chunk_gates``; where they apply:
``rnn_backward_gates``): one pass a row after the chunk's GEMM, where NumPy makes a dozen.
``RLX_HOST_JIT=0`` keeps the NumPy loops where Numba is installed. The kernels are compiled for one
signature each, eagerly when their module is first imported (under Python's import lock: once, whatever
the threads), and cached on disk by Numba (``__pycache__`` beside it, else Numba's user cache or ``NUMBA_CACHE_DIR``):
a process pays the compile once per machine, several seconds (about 10 on a Zen 5, the whole-sequence lstm
kernels included); a later one loads them in about one.
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Callable

from . import environ

#: The environment variable that turns the compiled kernels off (``0``, ``off``, ``false`` or ``no``).
ENV = "RLX_HOST_JIT"
#: The environment variable that forces the tiles' vector width, in float32 lanes: ``8`` or ``16``.
WIDTH_ENV = "RLX_HOST_JIT_WIDTH"

_switch, _width = environ.reader(ENV), environ.reader(WIDTH_ENV)


def enabled() -> bool:
    """Whether ``RLX_HOST_JIT`` allows the compiled kernels (read on every call)."""
    return (_switch() or "1").strip().lower() not in ("0", "off", "false", "no")


def lanes() -> int:
    """The float32 lanes of the compiled lstm step's vectors: ``RLX_HOST_JIT_WIDTH`` where set (read on every
    call), else the CPU's (``host_lanes``)."""
    forced = (_width() or "").strip()
    if not forced:
        return host_lanes()
    if forced not in ("8", "16"):
        raise ValueError(f"{WIDTH_ENV}={forced!r}: expected 8 or 16 (float32 lanes a vector), or unset for the CPU's")
    return int(forced)


@cache
def host_lanes() -> int:
    """16 where the CPU has AVX-512F (32 registers of 16 float32 lanes), else 8 (AVX2's 16 of 8, and the
    width that suits a CPU with neither), from the features LLVM reports for this machine's CPU: what Numba
    compiles for, unless ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name another (either width is correct on
    any CPU; LLVM splits vectors wider than the target's)."""
    from llvmlite import binding  # Numba's dependency: only asked where the kernels exist

    return 16 if binding.get_host_cpu_features().get("avx512f") else 8


@cache
def _kernels() -> dict[str, ModuleType] | None:
    """Each compiled kernel's name -> its module (every ``jit_*`` module of this package, each listing its kernels
    in ``__all__``: adding one is adding its module), or None without Numba (Python's import lock compiles each
    module once across threads)."""
    try:
        modules = [importlib.import_module(f"{__package__}.{info.name}")
                   for info in pkgutil.iter_modules([str(Path(__file__).parent)]) if info.name.startswith("jit_")]
    except ImportError:  # no Numba (or no llvmlite): the NumPy loops
        return None
    return {name: module for module in modules for name in module.__all__}


def kernel(name: str) -> Callable | None:
    """The compiled kernel ``name``, or ``None`` without Numba or with ``RLX_HOST_JIT=0``.

    ``lstm_panels(w, lanes)``: ``w [4H, K]`` (float32, C-contiguous, the internal gate order ``i f o g`` of
    ``rnn_packing._ORDER``) packed for ``lstm_step``'s tiles of ``lanes`` (8 or 16, ``lanes()``) float32 lanes;
    ``lstm_panel_bias(b, lanes)`` the same for a bias ``[4H]``.

    ``lstm_step(w_hh, h, w_ih, x, bias, c, out, out_col, clip_ifo, clip_g, g_scale, coupled)``, float32: one
    step of the ``n`` columns of ``h [width, n]`` and ``x [in, n]`` (views, any strides), over the packed
    ``w_hh``, ``w_ih`` and ``bias`` (packed for one width, which the step reads from their shapes), whose rows
    of i f o are at ``-z`` (``activations.stored_scale``) and those of g at ``-2z`` (``g_scale`` 1) or at ``z``
    (``g_scale`` -2). ``c [H, >=n]`` is the cell, updated in place; ``o·tanh(c)`` goes to columns ``out_col..out_col+n`` of ``out``'s first ``H`` rows (C-contiguous).
    ``clip_ifo``, ``clip_g``: ``clip`` at the scale of each gate's rows, inf for none; ``coupled``:
    ``input_forget``. Shapes that do not fit together raise ``ValueError`` before anything is read or written.

    ``lstm_sequence(u, w_hh, h, c, lens, backwards, out, keep, h_prev, c_prev, hc, lanes)``, float32,
    C-contiguous: every step of one lstm layer-direction (ABI gate order i f g o, default activations, no clip),
    batch-major: ``u [S, B, 4H]`` the input projection plus bias, ``w_hh [4H, H]``, the states ``h, c [B, H]``
    updated in place to the final ones, ``lens [B]`` int64 each row's valid steps (empty: all; a row takes no
    step past its length, its ``out`` 0 there), walking time from the end where ``backwards``, ``out [S, B, H]``;
    where ``keep``, ``u`` ends as the activated gates and ``h_prev``, ``c_prev`` (the state entering each step)
    and ``hc`` (``tanh(c')``) ``[S, B, H]`` are filled, else they are not read (empty will do). ``lanes``: the
    tiles' width, 8 or 16 (``lanes()``). ``lstm_sequence_backward(gates, hc, c_prev, w_hh, dy, dh, dc, lens,
    backwards, dz, lanes)``: backpropagation through those kept steps (``backwards``: the forward's walk):
    ``dy [S, B, H]`` the output's gradient, ``dh, dc [B, H]`` the final state's, updated in place to the
    initial state's, ``dz [S, B, 4H]`` the gate pre-activations' gradient (0 past a row's length). Both raise
    ``ValueError`` for shapes that do not fit together, before anything is written.

    ``selective_scan_step``, ``mamba2_step``, ``gated_delta_net_step``: an f32 thunk's step path on its arena
    views, as ``compiled_step`` binds them (each kernel's docstring gives the shapes). Not checked: the
    caller passes a validated thunk's views.

    ``causal_conv1d_decode``: causal_conv1d's decode step for a run of rows, float32 (its docstring gives the
    arguments; ``conv._compiled_decode`` binds them). Any other kernel: its module's docstring.
    """
    if not enabled():
        return None
    modules = _kernels()
    return None if modules is None else getattr(modules[name], name)

"""rlx_gpu from PyTorch: the anchors' function signatures and torch.nn modules, with autograd.

Importing ``rlx_gpu`` never imports torch; this package does (torch is the ``torch`` extra).
``selective_scan_fn``, ``mamba_chunk_scan_combined`` and ``selective_state_update`` take mamba_ssm's
arguments; ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule`` and ``chunk_kda`` take
flash-linear-attention's; ``causal_conv1d_fn`` and ``causal_conv1d_update`` Dao-AILab causal-conv1d's;
``mamba3_siso_combined`` and ``mamba3_siso_step`` mamba_ssm's Mamba-3 SISO, and ``Mamba3`` its block
(projections, norms and gates in torch around them).
They run where their tensors lie (CPU tensors: ``RLX_DEVICE`` or the config's device; ``cuda:N``
tensors: CUDA device N) and are differentiable (``selective_state_update`` and ``causal_conv1d_update``
excepted, as in their anchors). ``LSTM``, ``GRU`` and ``RNN`` are torch.nn's modules (constructor, parameters and
``state_dict`` keys) running their layers as one fused op, differentiable through its backward op.
"""
from . import bridge
from .conv import causal_conv1d_fn, causal_conv1d_update
from .gdn import chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule
from .mamba3 import mamba3_siso_combined, mamba3_siso_step
from .mamba3_layer import Mamba3
from .nn import GRU, LSTM, RNN
from .ssm import mamba_chunk_scan_combined, selective_scan_fn
from .state_update import selective_state_update



def clear_cache() -> None:
    """Drop every compiled signature (with its resident arena), every step route and every packing of module
    weights (``bridge.clear_cache``); needed only after changing parameters through ``.data``, which torch
    does not count as a new version."""
    bridge.clear_cache()


__all__ = ["clear_cache", "selective_scan_fn", "mamba_chunk_scan_combined", "selective_state_update", "chunk_gated_delta_rule",
           "fused_recurrent_gated_delta_rule", "chunk_kda", "causal_conv1d_fn", "causal_conv1d_update", "mamba3_siso_combined",
           "mamba3_siso_step", "Mamba3", "LSTM", "GRU",
           "RNN"]

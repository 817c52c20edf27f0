"""rlx_gpu from PyTorch: the anchors' function signatures and torch.nn modules, with autograd.

Importing ``rlx_gpu`` never imports torch; this package does (torch is the ``torch`` extra).
"""

"""The graph builder: tensors and ops, scans, autodiff, the arena layout and lowering to a schedule."""

"""Conformance: sample thunks laid out in arenas, and float64 references written from ABI.md."""

"""The schedule of ABI.md §2: its model, reading and writing, the op table and validation."""

"""Running schedules: configuration, backend discovery, per-thunk placement and the executor."""

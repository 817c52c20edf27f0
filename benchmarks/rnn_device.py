"""lstm / gru / rnn on an OpenCL device: every version-2 field (ABI.md §8) beside the plain op.

    PYTHONPATH=. [RLX_TARGET=gpu] python benchmarks/rnn_device.py [--repeat N] [--device opencl:P:D]
    PYTHONPATH=. python benchmarks/rnn_device.py --plain   # the version-1 rows alone (any checkout)

B=16, S=64, I=H=128, one bidirectional layer (reverse: one direction, beside the plain one-direction op), f32:
the median time of the plain op, then of each field, as a ratio to the plain op. ``seq_lens uniform`` draws
lengths uniformly from [1, S] (seeded); ``seq_lens full`` gives every row S steps. ``--plain`` prints only the
version-1 rows, so the same command on an older checkout gives the before side of a before/after. On PoCL (a
CPU) the figures rank the kernels' work, not a GPU's. Times exclude compilation and transfers.
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks.backends import lay_out, median_time, open_opencl, warm_launcher, with_device_arguments

B, S, I, H = 16, 64, 128, 128
_OFFSETS = {"lstm": ("x", "w_ih", "w_hh", "bias", "h0", "c0", "dst"), "gru": ("x", "w_ih", "w_hh", "b_ih", "b_hh", "h0", "dst"),
            "rnn": ("x", "w_ih", "w_hh", "bias", "h0", "dst")}
UNIFORM = [int(n) for n in np.random.default_rng(1).integers(1, S + 1, B)]
_ACTIVATIONS = {"lstm": [["hard_sigmoid", 0.2, 0.5], ["scaled_tanh", 1.0, 0.8], ["elu", 1.0, 0.0]],
                "gru": [["leaky_relu", 0.01, 0.0], ["affine", 0.9, 0.1]], "rnn": [["softsign", 0.0, 0.0]]}


def plain(op: str, bidirectional: bool = True) -> dict:
    fields = dict(op=op, batch=B, seq=S, input_size=I, hidden=H, num_layers=1, bidirectional=bidirectional,
                  carry=False, **{f: 0 for f in _OFFSETS[op]})
    return dict(fields, relu=False) if op == "rnn" else fields


def fields_of(op: str) -> list[tuple[str, str, dict]]:
    """(label, the label of the plain op it is measured against, the thunk) for every field of ``op``."""
    base = plain(op)
    out = [("seq_lens full", "plain", dict(base, seq_lens=[S] * B)),
           ("seq_lens uniform", "plain", dict(base, seq_lens=UNIFORM)),
           ("reverse", "one direction", dict(plain(op, False), reverse=True)),
           ("clip", "plain", dict(base, clip=0.5)),
           ("activations", "plain", dict(base, activations=_ACTIVATIONS[op] * 2))]
    if op == "lstm":
        out += [("peepholes", "plain", dict(base, peepholes=True)), ("input_forget", "plain", dict(base, input_forget=True)),
                ("proj_size H/2", "plain", dict(base, proj_size=H // 2, w_hr=True))]
    if op == "gru":
        out.append(("linear_before_reset false", "plain", dict(base, linear_before_reset=False)))
    return out


def _arena(template: dict, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """The thunk laid out with random inputs, and seq_lens (an int32 tensor) holding its lengths."""
    lengths = template.get("seq_lens")
    t, arena = lay_out(dict(template, seq_lens=True) if lengths else template, rng)
    if lengths:
        raw = np.asarray(lengths, "<i4").view(np.uint8)
        arena[t["seq_lens"]: t["seq_lens"] + raw.size] = raw
    return t, arena


def interleaved(runs: dict, repeat: int) -> dict[str, float]:
    """Median seconds of each of ``runs`` over ``repeat`` rounds, each round running every one once (so the
    load of a shared machine drifts over all of them alike)."""
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeat):
        for label, run in runs.items():
            times[label].append(median_time(run, 1))
    return {label: float(np.median(ts)) for label, ts in times.items()}


def main() -> None:
    parser = with_device_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--plain", action="store_true", help="only the version-1 rows (the plain ops)")
    args = parser.parse_args()
    info, session = open_opencl(args.device)
    rng = np.random.default_rng(0)
    print(f"device: {info.name} ({info.spec}); target {session.limits.target}; medians of {args.repeat}; f32; "
          f"B{B} S{S} I{I} H{H}, one layer")
    print(f"{'op':<6} {'field':<28} {'ms':>9} {'x plain':>8}")
    for op in ("lstm", "gru", "rnn"):
        rows = [("plain", None, plain(op)), ("one direction", None, plain(op, False))]
        rows += [] if args.plain else fields_of(op)
        ms = interleaved({label: warm_launcher(session, *_arena(template, rng)) for label, _, template in rows}, args.repeat)
        for label, against, _ in rows:
            ratio = f"{ms[label] / ms[against]:>8.2f}" if against else ""
            print(f"{op:<6} {label:<28} {ms[label] * 1e3:>9.2f} {ratio:>8}")

if __name__ == "__main__":
    main()

"""Training a small character-level LSTM language model with ``rlx_gpu.torch.LSTM`` beside the same
model with ``torch.nn.LSTM``: the same initial weights, the same batches, the same optimizer; the two
loss curves agree step for step.

    python configs/examples/train_lstm_lm.py [--steps 200] [--device host|opencl] [--plot docs/training.png]
    torchrun --nproc-per-node 2 configs/examples/train_lstm_lm.py --distributed [--save params.pt]

The model is an embedding, a two-layer LSTM and a linear read-out, trained with Adam on windows of a
toy corpus to predict every next character. Only the recurrent layer differs between the two runs:
swapping ``torch.nn.LSTM`` for ``rlx_gpu.torch.LSTM`` is the whole port (its parameters, state_dict
and outputs are torch's), and its gradients come from the lstm_backward thunk.

With ``--distributed`` each process of a ``torch.distributed`` job (torchrun sets its rank, the world
size and the rendezvous address) trains the rlx_gpu model under ``DistributedDataParallel`` on its
share of every global batch; DDP averages the gradients over the processes (gloo for CPU tensors),
so the parameters are those of one process training on the whole batch.
"""
from __future__ import annotations

import argparse
import os

import torch

import rlx_gpu.torch.nn as rlx_nn

CORPUS = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
          "all that glitters is not gold. the early bird catches the worm. ") * 4
VOCAB = sorted(set(CORPUS))
EMBED, HIDDEN, LAYERS = 16, 32, 2
BATCH, WINDOW = 8, 24
LEARNING_RATE = 1e-2
#: How far apart the two loss curves may be at any step.
TOLERANCE = 1e-3


class LanguageModel(torch.nn.Module):
    """Embedding -> ``recurrent_cls`` (batch_first) -> linear logits over the vocabulary."""

    def __init__(self, recurrent_cls: type[torch.nn.Module]):
        super().__init__()
        self.embed = torch.nn.Embedding(len(VOCAB), EMBED)
        self.rnn = recurrent_cls(EMBED, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.head = torch.nn.Linear(HIDDEN, len(VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.embed(tokens))
        return self.head(y)


def batches(steps: int, batch: int = BATCH, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``(inputs, targets)``: random windows of the corpus and the windows one later."""
    ids = torch.tensor([VOCAB.index(ch) for ch in CORPUS])
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, ids.numel() - WINDOW - 1, (batch,), generator=g)
        rows = start[:, None] + torch.arange(WINDOW + 1)
        out.append((ids[rows[:, :-1]], ids[rows[:, 1:]]))
    return out


def models(seed: int = 0) -> dict[str, LanguageModel]:
    """The torch.nn model and the rlx_gpu one, starting from the same weights."""
    torch.manual_seed(seed)
    reference = LanguageModel(torch.nn.LSTM)
    ours = LanguageModel(rlx_nn.LSTM)
    ours.load_state_dict(reference.state_dict())
    return {"torch.nn.LSTM": reference, "rlx_gpu.torch.LSTM": ours}


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Adam over ``data``, one step per batch; the loss before each step (``model`` may be a DDP wrapper)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for tokens, targets in data:
        optimizer.zero_grad()
        loss = loss_of(model, tokens, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def plot(curves: dict[str, list[float]], path: str) -> None:
    """Both loss curves and their difference, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1))
    for (name, losses), style in zip(curves.items(), ("-", "--")):
        top.plot(losses, style, label=name)
    top.set_ylabel("cross-entropy")
    top.set_title(f"character LSTM language model ({LAYERS} layers, hidden {HIDDEN}), Adam")
    top.legend()
    first, second = curves.values()
    bottom.plot([abs(a - b) for a, b in zip(first, second)], ".", color="k", markersize=3)
    bottom.axhline(TOLERANCE, linestyle=":", color="r", label=f"tolerance {TOLERANCE:g}")
    bottom.set_ylabel("|difference|")
    bottom.legend(loc="center right")
    bottom.set_xlabel("step")
    bottom.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_distributed(steps: int, save: str | None) -> list[float]:
    """One process of a DDP job: the rlx_gpu model on rows ``rank·B/W .. (rank+1)·B/W`` of every global
    batch; rank 0 saves the trained parameters to ``save``. Returns this process's losses."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if BATCH % world:
            raise SystemExit(f"the global batch of {BATCH} rows does not split evenly over {world} processes")
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        data = [(tokens[rows], targets[rows]) for tokens, targets in batches(steps)]
        model = DistributedDataParallel(models()["rlx_gpu.torch.LSTM"])
        losses = train(model, data)
        if rank == 0 and save:
            torch.save(model.module.state_dict(), save)
        return losses
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default=None, help="the rlx_gpu device CPU tensors run on (RLX_DEVICE)")
    parser.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    parser.add_argument("--distributed", action="store_true",
                        help="one process of a torchrun job: train under DistributedDataParallel")
    parser.add_argument("--save", default=None, help="with --distributed: rank 0 saves the parameters here")
    args = parser.parse_args()
    if args.device:
        os.environ["RLX_DEVICE"] = args.device
    if args.distributed:
        losses = train_distributed(args.steps, args.save)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} on this process's share of the batch")
        return
    data = batches(args.steps)
    curves = {name: train(model, data) for name, model in models().items()}
    worst = max(abs(a - b) for a, b in zip(*curves.values()))
    for name, losses in curves.items():
        print(f"{name:>20}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"largest difference between the curves over {args.steps} steps: {worst:.2e}")
    if args.plot:
        plot(curves, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

"""Training small character-level language models with ``rlx_gpu.torch`` beside the same models in plain
torch: an LSTM (``rlx_gpu.torch.LSTM`` / ``torch.nn.LSTM``) and a gated-delta-net block (fla's
``chunk_gated_delta_rule`` from ``rlx_gpu.torch.gdn`` / the rule written step by step in torch). The
same initial weights, the same batches, the same optimizer: the loss curves agree step for step.

    python configs/examples/train_lstm_lm.py [--steps 200] [--models lstm gdn] [--device host|opencl]
                                             [--plot docs/training.png]
    torchrun --nproc-per-node 2 configs/examples/train_lstm_lm.py --distributed [--save params.pt]

Each model is trained with Adam on windows of a toy corpus to predict every next character. The
LSTM model is an embedding, a two-layer LSTM and a linear read-out; only the recurrent layer differs
between the two runs: swapping ``torch.nn.LSTM`` for ``rlx_gpu.torch.LSTM`` is the whole port (its
parameters, state_dict and outputs are torch's), and its gradients come from the lstm_backward thunk.
The gated-delta-net block projects the embedding to per-head q, k, v, a log decay and a write strength,
runs the rule (q and k L2-normalised) and adds its read-out back; only the rule differs, and rlx_gpu's
gradients come from the gated_delta_net_backward thunk.

With ``--distributed`` each process of a ``torch.distributed`` job (torchrun sets its rank, the world
size and the rendezvous address) trains the rlx_gpu model under ``DistributedDataParallel`` on its
share of every global batch; DDP averages the gradients over the processes (gloo for CPU tensors),
so the parameters are those of one process training on the whole batch.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch

import rlx_gpu.torch.nn as rlx_nn
from rlx_gpu.torch.gdn import chunk_gated_delta_rule

CORPUS = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
          "all that glitters is not gold. the early bird catches the worm. ") * 4
VOCAB = sorted(set(CORPUS))
EMBED, HIDDEN, LAYERS = 16, 32, 2
HEADS, HEAD_DIM = 2, 8
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


def delta_rule_in_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule step by step in plain torch (fla's naive recurrent form, from its math), with
    ``chunk_gated_delta_rule``'s arguments: per head ``S ← exp(g)·S``, ``S ← S + k⊗(beta·(v - Sᵀk))``,
    ``o = Sᵀq / sqrt(K)``; returns ``(o, final state)``."""
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    batch, steps, heads, key_size = q.shape
    state = q.new_zeros(batch, heads, key_size, v.shape[-1])
    out = []
    for t in range(steps):
        state = state * g[:, t].exp()[..., None, None]
        write = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state) * key_size ** -0.5)
    return torch.stack(out, 1), state


class DeltaNetLanguageModel(torch.nn.Module):
    """Embedding -> a gated-delta-net block with a residual (``rule`` has chunk_gated_delta_rule's
    signature) -> linear logits over the vocabulary."""

    def __init__(self, rule: Callable[..., tuple[torch.Tensor, Any]]):
        super().__init__()
        self.rule = rule
        self.embed = torch.nn.Embedding(len(VOCAB), EMBED)
        self.qkv = torch.nn.Linear(EMBED, 3 * HEADS * HEAD_DIM, bias=False)
        self.gates = torch.nn.Linear(EMBED, 2 * HEADS)  # a log decay and a write strength per head
        self.mix = torch.nn.Linear(HEADS * HEAD_DIM, EMBED, bias=False)
        self.head = torch.nn.Linear(EMBED, len(VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        batch, steps, _ = x.shape
        q, k, v = self.qkv(x).view(batch, steps, 3, HEADS, HEAD_DIM).unbind(2)
        decay, write = self.gates(x).view(batch, steps, 2, HEADS).unbind(2)
        o, _ = self.rule(q, k, v, -torch.nn.functional.softplus(decay), torch.sigmoid(write),
                         use_qk_l2norm_in_kernel=True)
        return self.head(x + self.mix(o.reshape(batch, steps, -1)))


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


#: Each model's two runs: (label, the model's constructor) for plain torch, then for rlx_gpu.
MODELS: dict[str, tuple[tuple[str, Callable[[], torch.nn.Module]], ...]] = {
    "lstm": (("torch.nn.LSTM", lambda: LanguageModel(torch.nn.LSTM)),
             ("rlx_gpu.torch.LSTM", lambda: LanguageModel(rlx_nn.LSTM))),
    "gdn": (("the delta rule in torch", lambda: DeltaNetLanguageModel(delta_rule_in_torch)),
            ("rlx_gpu.torch chunk_gated_delta_rule", lambda: DeltaNetLanguageModel(chunk_gated_delta_rule))),
}
TITLES = {"lstm": f"character LSTM language model ({LAYERS} layers, hidden {HIDDEN})",
          "gdn": f"gated-delta-net block ({HEADS} heads of {HEAD_DIM})"}


def models(kind: str = "lstm", seed: int = 0) -> dict[str, torch.nn.Module]:
    """The plain-torch model of ``kind`` and the rlx_gpu one (labels first), starting from the same weights."""
    torch.manual_seed(seed)
    (ref_label, make_reference), (label, make) = MODELS[kind]
    reference = make_reference()
    ours = make()
    ours.load_state_dict(reference.state_dict())
    return {ref_label: reference, label: ours}


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


def plot(curves: dict[str, dict[str, list[float]]], path: str) -> None:
    """Each model's two loss curves and their difference (a column per model, by ``MODELS`` kind), in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(6.5 * len(curves), 5.5), sharex="col",
                             height_ratios=(3, 1), squeeze=False)
    for (kind, runs), top, bottom in zip(curves.items(), axes[0], axes[1]):
        for (name, losses), style in zip(runs.items(), ("-", "--")):
            top.plot(losses, style, label=name)
        top.set_ylabel("cross-entropy")
        top.set_title(f"{TITLES[kind]}, Adam", fontsize=10)
        top.legend()
        first, second = runs.values()
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))  # the first paragraph
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
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
    curves = {}
    for kind in args.models:
        curves[kind] = {name: train(model, data) for name, model in models(kind).items()}
        for name, losses in curves[kind].items():
            print(f"{name:>38}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        worst = max(abs(a - b) for a, b in zip(*curves[kind].values()))
        print(f"{kind}: largest difference between the curves over {args.steps} steps: {worst:.2e}")
    if args.plot:
        plot(curves, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

"""Bytes per logit the LM loss holds at its peak, measured for the torch losses the targets run.

Each case makes 16-bit logits ``h @ W^T`` for ``T`` tokens over a vocabulary of ``V``, computes a loss on them
and runs its backward, under ``torch.profiler`` with ``profile_memory``: the allocator's events, replayed in
order, give the peak of the bytes allocated since the logits were made. Divided by ``T x V`` that is the
``loss`` fact of :class:`planner.targets.TargetFacts` (the hidden states and weights are ``H = 16`` wide, so
the weight gradient adds ``2H/T`` bytes per logit, 0.016 at ``T = 2048``). Runs on the CPU; tensor-parallel
losses on a one-rank gloo group (their per-logit bytes are those of a vocabulary shard of any size).

Cases (``kept``: the logits stay referenced to the backward, as a pipeline schedule keeps a stage output):

- ``torch``: ``cross_entropy(logits.float())``, the executor's loss (``kept``: 14.0, the profile default);
- ``torch_loss_parallel``: the same under ``torch.distributed.tensor.parallel.loss_parallel`` on a
  vocabulary-sharded DTensor (the executor with tp > 1);
- ``torchtitan``: torchtitan's ``cross_entropy_loss`` (tp = 1), with the logits deleted before the backward
  as its trainer does, and ``kept`` (pipeline parallel);
- ``torchtitan_tp``: its ``_LossParallelCrossEntropy`` (tp > 1), deleted and ``kept``;
- ``torchtitan_compiled`` (``--compile``): the loss under ``torch.compile`` (inductor needs a C++ compiler).

    .venv/bin/python benchmarks/loss_memory.py [--tokens 2048] [--vocab 32000] [--compile] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN = 16


def peak_bytes(prof: profile) -> int:
    """Largest sum of the allocations minus frees seen, in event order."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def bytes_per_logit(loss_fn: Callable, tokens: int, vocab: int, kept: bool, warm: bool = False) -> float:
    """Peak bytes per logit of ``loss_fn(logits, labels)`` and its backward (``warm``: once before, for compile)."""
    for _ in range(2 if warm else 1):
        torch.manual_seed(0)
        h = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(vocab, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            logits = h @ w.t()
            loss = loss_fn(logits, labels)
            if not kept:
                del logits
            loss.backward()
    return peak_bytes(prof) / (tokens * vocab)


def losses(vocab: int, compiled: bool) -> dict[str, Callable]:
    """The loss functions measured, by name (the tensor-parallel ones on a one-rank group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))

    def plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x.float(), y, reduction="sum")

    def sharded(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits, labels = DTensor.from_local(x, mesh, [Shard(1)]), DTensor.from_local(y, mesh, [Replicate()])
        with loss_parallel():
            return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")

    out = {"torch": plain, "torch_loss_parallel": sharded}
    try:
        from torchtitan.components.loss import _LossParallelCrossEntropy, cross_entropy_loss
    except ImportError:
        return out
    group = dist.group.WORLD
    out["torchtitan"] = lambda x, y: cross_entropy_loss(x.unsqueeze(0), y.unsqueeze(0))
    out["torchtitan_tp"] = lambda x, y: _LossParallelCrossEntropy.apply(x.float(), y, group, vocab, "sum")
    if compiled:
        out["torchtitan_compiled"] = torch.compile(out["torchtitan"])
    return out


def measure(tokens: int, vocab: int, compiled: bool = False) -> dict[str, float]:
    """``{case: bytes per logit}`` with ``case`` and ``case/kept`` for each loss."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp) / "store"), 1), rank=0, world_size=1)
        try:
            out = {}
            for name, fn in losses(vocab, compiled).items():
                for kept in (False, True):
                    out[name + ("/kept" if kept else "")] = bytes_per_logit(fn, tokens, vocab, kept,
                                                                            warm=name.endswith("compiled"))
            return out
        finally:
            dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--compile", action="store_true", help="also the torch.compile'd torchtitan loss")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    found = measure(args.tokens, args.vocab, args.compile)
    if args.json:
        print(json.dumps(found))
    else:
        for name, value in found.items():
            print(f"{name:28s} {value:6.2f} bytes per logit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

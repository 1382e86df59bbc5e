"""The single-process ground truth every distributed run is compared against.

One process, fp32, AdamW, gradient accumulation over micro-batches. The loss of a step is the mean
next-token cross-entropy over *all* tokens of the global batch — each micro-batch contributes its
token-loss sum divided by the global token count, so the accumulated loss (and gradient) equals
that of the unsplit batch exactly — plus the MoE load-balancing loss averaged over micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from planner.contracts import ModelSpec
from planner.errors import AutoparError

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
EPS = 1e-8
LR = 1e-3


class TokenSource(Protocol):
    """What the reference and the executor read batches from (:mod:`executor.data`)."""

    def batch(self, step: int, global_batch: int) -> torch.Tensor: ...


def make_optimizer(params: Iterable[nn.Parameter] | Iterable[dict], lr: float = LR) -> torch.optim.AdamW:
    """AdamW with the constants every run uses (the reference and the executor alike)."""
    return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, eps=EPS)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, denominator: float) -> torch.Tensor:
    """sum over tokens of -log p(target) / ``denominator`` (the step's global token count)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           reduction="sum") / denominator


@dataclass
class ReferenceResult:
    """Loss of each step, gradients of the first step (by parameter name), state after the last step."""

    losses: list[float]
    grads_first_step: dict[str, torch.Tensor]
    final_state: dict[str, torch.Tensor]


def reference_run(spec_or_model: ModelSpec | nn.Module, data: TokenSource, *, steps: int, global_batch: int,
                  micro_batch_size: int, lr: float = LR, seed: int = 0, aux_loss: bool = True,
                  start_step: int = 0, autocast: torch.dtype | None = None) -> ReferenceResult:
    """Train for ``steps`` optimizer steps on ``data.batch(step, global_batch)``, steps numbered from
    ``start_step``. A ModelSpec is built on CPU in fp32 with :func:`executor.model.init_weights`
    (``seed``); a module (built-in or Hugging Face, whose output's ``.logits`` is used) is trained in
    place as it is. ``autocast``: run forward and backward under ``torch.autocast(dtype)`` (the
    executor's bf16 mixed precision under ZeRO-0/1); parameters stay as they are.

    Step loss = sum over micro-batches m of [CE_sum(m) / (global_batch x seq_length)
    + aux(m) / n_micro], i.e. the mean token loss of the unsplit batch plus the mean MoE aux loss."""
    if isinstance(spec_or_model, ModelSpec):
        from executor.model import build_model, init_weights

        model = build_model(spec_or_model, device="cpu")
        init_weights(model, seed)
    else:
        model = spec_or_model
    if micro_batch_size < 1 or global_batch % micro_batch_size:
        raise AutoparError("micro_batch_size", micro_batch_size,
                           f"use a divisor of global_batch={global_batch}",
                           problem="does not split the global batch into equal micro-batches")
    opt = make_optimizer(model.parameters(), lr)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    n_micro = global_batch // micro_batch_size
    for step in range(start_step, start_step + steps):
        batch = data.batch(step, global_batch)
        tokens_total = batch.shape[0] * (batch.shape[1] - 1)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in batch.split(micro_batch_size):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                out = model(mb[:, :-1])
                logits = getattr(out, "logits", out)
                loss = lm_loss(logits, mb[:, 1:], tokens_total)
                if aux_loss and hasattr(model, "aux_loss"):
                    loss = loss + model.aux_loss() / n_micro
                loss.backward()
            total += loss.item()
        if step == start_step:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(total)
    return ReferenceResult(losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()})

"""The built-in Llama-family decoder, built from a :class:`planner.contracts.ModelSpec`.

RMSNorm (or LayerNorm), rotary position embeddings, grouped-query attention, SwiGLU (or GeLU) MLP
(blocks in :mod:`executor.layers`), optional Mixture-of-Experts blocks (:mod:`executor.moe`), tied or
separate LM head.

The fully-qualified parameter names are the checkpoint contract: they never depend on a parallel
plan. ``layers`` is an ``nn.ModuleDict`` keyed ``"0" .. "L-1"`` so a pipeline stage can delete the
layers it does not hold and keep the names of the others; ``tok_embeddings``, ``norm`` and
``output`` may be ``None`` on a stage, and then :meth:`Transformer.forward` takes or returns hidden
states instead of tokens or logits.

Weights are drawn per parameter from a generator seeded by ``(seed, crc32(name))``
(:func:`init_weights`, :func:`full_state_dict`), so every plan starts from the same numbers.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from executor.layers import ROPE_THETA, TransformerBlock, make_norm, rope_cos_sin
from planner.contracts import ModelSpec, ParallelLayout
from planner.targets import Job, Target, check

INIT_STD = 0.02


def check_builtin(spec: ModelSpec) -> None:
    """Raise AutoparError for the spec features the built-in model does not implement: the ``model``
    rows of the ``autopar`` capability table (:data:`planner.targets.TARGETS`)."""
    check(Target.autopar, Job(spec, None, ParallelLayout()), scopes=("model",))


class Transformer(nn.Module):
    """Embedding, ``layers`` (ModuleDict "0".."L-1"), final norm, LM head (any may be None on a stage)."""

    def __init__(self, spec: ModelSpec, rope_theta: float = ROPE_THETA) -> None:
        super().__init__()
        check_builtin(spec)
        self.spec = spec
        self.rope_theta = rope_theta
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = make_norm(spec, spec.hidden_size)
        self.output: nn.Linear | None = (
            None if spec.tied_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False))
        self.has_head = True  # False on a pipeline stage that stops before the head
        self.positions: torch.Tensor | None = None  # set by the runtime (context / sequence parallel)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [B, S] (or hidden states [B, S, D] when ``tok_embeddings`` is None) -> logits [B, S, V]
        (or hidden states when ``has_head`` is False or the stage holds neither norm nor head).

        ``positions`` [S]: global positions of the rows (default ``self.positions``, else 0..S-1);
        RoPE angles are computed from them, so non-contiguous context-parallel shards are exact."""
        if positions is None:
            positions = self.positions if self.positions is not None else torch.arange(x.shape[1])
        positions = positions.to(x.device)
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        cos, sin = rope_cos_sin(positions, self.spec.head_size, self.rope_theta, dtype=h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, positions)
        if not self.has_head or (self.norm is None and self.output is None):
            return h
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            return self.output(h)
        return F.linear(h, self.tok_embeddings.weight)

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE blocks' load-balancing losses of the last forward (0 without MoE)."""
        total = None
        for layer in self.layers.values():
            moe = getattr(layer, "moe", None)
            if moe is not None and getattr(moe, "aux_loss", None) is not None:
                total = moe.aux_loss if total is None else total + moe.aux_loss
        return total if total is not None else torch.zeros(())


def build_model(spec: ModelSpec, *, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32, rope_theta: float = ROPE_THETA) -> Transformer:
    """The built-in decoder for ``spec`` on ``device`` (``meta``: shapes only; materialise with
    ``to_empty`` then :func:`init_weights`, or load :func:`full_state_dict`)."""
    with torch.device(device):
        model = Transformer(spec, rope_theta)
    return model.to(dtype)


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def param_init(name: str, shape: torch.Size, seed: int, num_layers: int) -> torch.Tensor:
    """The value of parameter ``name`` (CPU fp32): N(0, 0.02) for linears and embeddings, the output
    projections (wo, w2) scaled by 1/sqrt(2 L) (GPT-2 / Megatron residual scaling), ones for norm
    weights, zeros for biases. Depends only on (seed, name, shape), never on the plan."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf == "bias":
        return torch.zeros(shape)
    if "norm" in owner:
        return torch.ones(shape)
    residual = owner in ("wo", "w2") or (leaf == "w2" and owner in ("experts", "shared_experts"))
    std = INIT_STD / math.sqrt(2 * num_layers) if residual else INIT_STD
    return torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))


def full_state_dict(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the built-in model for ``spec``, by name, as :func:`init_weights` draws it."""
    shapes = build_model(spec, device="meta")
    return {name: param_init(name, p.shape, seed, spec.num_layers) for name, p in shapes.named_parameters()}


def init_weights(model: nn.Module, seed: int) -> None:
    """Fill a materialised (non-sharded) model in place with the plan-independent weights."""
    num_layers = model.spec.num_layers if hasattr(model, "spec") else 1
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(param_init(name, p.shape, seed, num_layers).to(p.dtype))


def count_params(model: nn.Module) -> int:
    """Parameters of the model (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


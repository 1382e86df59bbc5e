"""The layer split and the recompute per stage, as the frameworks can state them: the rows of the tables and
the launch-file writers read them. Never imports torch."""

from __future__ import annotations

from dataclasses import dataclass

from planner.contracts import ParallelLayout, Recompute
from planner.cost.checks import default_layer_split
from planner.cost.pipeline import rank_chunks


def stage_layers(layout: ParallelLayout, num_layers: int) -> list[int]:
    """Transformer layers per (virtual) stage, in stage order (stage ``chunk * pp + rank``)."""
    if layout.layers_per_stage is not None:
        return list(layout.layers_per_stage)
    return default_layer_split(num_layers, layout.pp * layout.virtual_stages)


def _rank_chunks(counts: list[int], layout: ParallelLayout) -> list[list[int]]:
    """Layers of each model chunk, per pipeline rank (:func:`planner.cost.pipeline.rank_chunks`)."""
    return [[counts[c] for c in rank_chunks(layout.schedule, layout.pp, layout.virtual_stages, r)]
            for r in range(layout.pp)]


def recompute_text(layout: ParallelLayout) -> str:
    """``recompute`` or the per-stage list as ``[kind:layers, ...]``."""
    if layout.recompute_per_stage is None:
        return layout.recompute.value
    parts = (
        s.kind.value if s.num_layers is None else f"{s.kind.value}:{s.num_layers}"
        for s in layout.recompute_per_stage
    )
    return "[" + ", ".join(parts) + "]"


def _per_rank(layout: ParallelLayout, chunks: list[list[int]]) -> list[tuple[str, int]]:
    """(kind, layers recomputed) of each pipeline rank; ("none", 0) when it recomputes nothing."""
    assert layout.recompute_per_stage is not None
    out = []
    for rank, choice in zip(chunks, layout.recompute_per_stage):
        total = sum(rank)
        n = total if choice.num_layers is None else min(choice.num_layers, total)
        out.append((choice.kind.value, n) if n > 0 and choice.kind is not Recompute.none else ("none", 0))
    return out


@dataclass(frozen=True)
class RecomputeSetting:
    kind: str  # "none" | "selective" | "full" | "op"
    block: int | None = None  # full recompute of only the first ``block`` layers of every model chunk


def uniform_recompute(layout: ParallelLayout, num_layers: int) -> RecomputeSetting | None:
    """The plan's recompute as one setting shared by every stage (Megatron's --recompute-*), or None.

    A rank recomputing ``n`` of its layers fully is "block N": the first ``N`` layers of each model
    chunk, when ``sum over its chunks of min(N, chunk layers)`` equals ``n`` on every rank.
    """
    if layout.recompute_per_stage is None:
        return RecomputeSetting(layout.recompute.value)
    chunks = _rank_chunks(stage_layers(layout, num_layers), layout)
    wanted = _per_rank(layout, chunks)
    kinds = {k for k, _ in wanted} - {"none"}
    if not kinds:
        return RecomputeSetting("none")
    if len(kinds) > 1:
        return None
    kind = kinds.pop()
    if all(n == sum(rank) for rank, (_, n) in zip(chunks, wanted) if sum(rank) > 0):
        return RecomputeSetting(kind)
    if kind != "full":  # only full recompute has a "first N layers" form (Megatron's --recompute-method block)
        return None
    largest = max((c for rank in chunks for c in rank), default=0)
    for block in range(1, largest + 1):
        if all(sum(min(block, c) for c in rank) == n for rank, (_, n) in zip(chunks, wanted)):
            return RecomputeSetting("full", block)
    return None


def every_nth_recompute(layout: ParallelLayout, num_layers: int) -> int | None:
    """torchtitan's layer-selective checkpointing: the smallest ``N`` for which every rank, fully
    recomputing every N-th of its ``L`` layers (``floor(L / N)`` of them), recomputes as many layers as
    ``recompute_per_stage`` says; None without ``recompute_per_stage``, with selective or per-op
    recompute, or when no ``N`` does. (torchtitan counts the blocks of all model parts of a rank with one counter,
    torchtitan/distributed/activation_checkpoint.py ``_apply_layer_sac``, v0.2.2.)"""
    if layout.recompute_per_stage is None:
        return None
    chunks = _rank_chunks(stage_layers(layout, num_layers), layout)
    wanted = _per_rank(layout, chunks)
    if any(k in ("selective", "op") for k, _ in wanted):
        return None
    totals = [sum(rank) for rank in chunks]
    for every in range(1, max(totals, default=0) + 2):
        if all(t // every == n for t, (_, n) in zip(totals, wanted)):
            return every
    return None


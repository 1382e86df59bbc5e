"""Exhaustive search over the same space as :func:`planner.search.engine.search`, for checking it.

Every layer split into ``pp × virtual_stages`` contiguous chunks of at least one layer and every
per-stage recompute choice (none, or 1..n of the stage's layers selective or full) is priced with
:class:`~planner.search.stages.StageModel`. Only for small instances: the count grows as
``C(L-1, p·v-1) · Π (2·n_r + 1)``.
"""

from __future__ import annotations

import itertools

from planner.contracts import Recompute
from planner.search.stages import StageModel, StageTerms


def compositions(total: int, parts: int):  # noqa: ANN201 - generator of lists
    """Every way of writing ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield [edges[i + 1] - edges[i] for i in range(parts)]


def brute_force_stages(sm: StageModel) -> tuple[float, list[int], list[tuple[Recompute, int]]] | None:
    """(step seconds, chunks, per-rank recompute) of the fastest split that fits, or None."""
    best: tuple[float, list[int], list[tuple[Recompute, int]]] | None = None
    for chunks in compositions(sm.model.num_layers, sm.p * sm.v):
        per_rank: list[list[tuple[StageTerms, tuple[Recompute, int]]]] = []
        for r, layers in enumerate(sm.rank_layers(chunks)):
            opts = []
            for kind, count in sm.stage_options(len(layers)):
                t = sm.stage_terms(r, layers, kind, count)
                if t.memory_bytes <= sm.capacity:
                    opts.append((t, (kind, count)))
            if not opts:
                break
            per_rank.append(opts)
        else:
            for combo in itertools.product(*per_rank):
                step = sm.step_s([t for t, _ in combo])
                if best is None or step < best[0]:
                    best = (step, list(chunks), [c for _, c in combo])
    return best

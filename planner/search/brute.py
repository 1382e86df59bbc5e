"""Exhaustive search over the same space as :func:`planner.search.engine.search`, for checking it.

Every layer split into ``pp × virtual_stages`` contiguous chunks of at least one layer and every
per-stage recompute choice (none, or 1..n of the stage's layers selective or full) is priced with
:class:`~planner.search.stages.StageModel`. Only for small instances: the count grows as
``C(L-1, p·v-1) · Π (2·n_r + 1)``.
"""

from __future__ import annotations

import itertools

from planner.contracts import ParallelLayout, Recompute
from planner.search.stages import StageModel, StageTerms


def compositions(total: int, parts: int):  # noqa: ANN201 - generator of lists
    """Every way of writing ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield [edges[i + 1] - edges[i] for i in range(parts)]


def brute_force_stages(
    sm: StageModel, target: str | None = None
) -> tuple[float, list[int], list[tuple[Recompute, int]]] | None:
    """(step seconds, chunks, per-rank recompute) of the fastest split that fits, or None; with a ``target``,
    of those its capability table accepts (planner/targets/)."""
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
                if (best is None or step < best[0]) and _runs(sm, target, list(chunks), [c for _, c in combo]):
                    best = (step, list(chunks), [c for _, c in combo])
    return best


def _runs(sm: StageModel, target: str | None, chunks: list[int], recompute: list[tuple[Recompute, int]]) -> bool:
    if target is None:
        return True
    from planner import targets

    job = targets.Job(sm.model, sm.training, sm.layout_for(chunks, recompute), micro_batches=sm.m)
    return targets.refusal(target, job) is None


def brute_force_search(model, training, profile, options=None) -> tuple[float, ParallelLayout] | None:  # noqa: ANN001
    """Fastest layout over the whole search space, by pricing every leaf and every split: (step s, layout).

    The same space as :func:`planner.search.engine.search` (its structures, schedules incl. GPipe,
    ZeRO stages, HSDP groups, offload and resharding, what ``options.target`` runs), without bounds,
    dominance or CP-SAT.
    """
    from planner import targets
    from planner.errors import AutoparError
    from planner.search.enumerate import base_layout, leaf_choices, schedule_choices, structures
    from planner.search.options import SearchOptions
    from planner.search.rules import Rules

    opts = options or SearchOptions()
    rules = Rules()
    best: tuple[float, object] | None = None
    cache: dict = {}
    for st in structures(model, training, profile, opts, rules):
        for sched, v in schedule_choices(st, model, opts, rules):
            for zero, rep, shard, offload, reshard in leaf_choices(st, opts):
                layout = base_layout(st, opts, dp_replicate=rep, dp_shard=shard, zero_stage=zero,
                                      **ParallelLayout.offload_fields(offload), reshard_after_forward=reshard,
                                      schedule=sched, virtual_stages=v)
                if targets.refusal(opts.target, targets.Job(model, training, layout, micro_batches=st.m),
                                   ("model", "layout")) is not None:
                    continue
                try:
                    sm = StageModel(model, training, profile, layout, block_cache=cache, target=opts.target)
                except AutoparError:
                    continue
                found = brute_force_stages(sm, opts.target)
                if found is not None and (best is None or found[0] < best[0]):
                    best = (found[0], sm.layout_for(found[1], found[2]))
    return best

"""Any GPU count and a global batch range: which (GPUs, global batch) a plan uses, and why.

A cluster's GPU count need not suit the job. With ``SearchOptions.idle_gpus`` (the default) a count that is
not ``2^a x 3^b`` whole nodes (or, inside one node, GPUs) is searched beside the largest two such counts below
it: the degrees a layout multiplies (attention heads, layers, batch rows) are products of small powers of 2
and 3, so 1,000 GPUs may leave nothing but poor layouts where 768 or 864 run well. A count of that form is
searched alone: with the global batch fixed, fewer GPUs would each do more of the same work. With
``SearchOptions.global_batch_max`` the global batch may be any count from ``training.global_batch_size`` to
it; the searched ones are both ends and the multiple of the largest power of two between them.

Every (GPUs, batch) pair is one search with an even share of the time budget left; the plan is the pair that trains the
most tokens per second, ties to fewer GPUs. ``Plan.sizing`` records each pair tried, its step time and
tokens/s or why it has none, and one sentence on the choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from planner.contracts import ClusterProfile, ModelSpec, Plan, TrainingConfig
from planner.contracts.plan import SizeTried, Sizing
from planner.errors import AutoparError
from planner.search.options import SearchOptions

MAX_SMALLER_COUNTS = 2
"""GPU counts below the cluster's that an uneven count is searched beside (the largest of the 2^a x 3^b form)."""


def smooth(n: int) -> bool:
    """Whether ``n`` is ``2^a x 3^b``."""
    for p in (2, 3):
        while n % p == 0:
            n //= p
    return n == 1


def gpu_counts(profile: ClusterProfile, opts: SearchOptions) -> list[int]:
    """The GPU counts to search, the cluster's first (module docstring). Whole nodes above one node;
    a measured profile is cut by whole nodes only (its nodes are what was measured)."""
    per, nodes = profile.gpus_per_node, profile.num_nodes
    unit, count = (per, nodes) if nodes > 1 else (1, per)
    if not opts.idle_gpus or smooth(count) or (nodes == 1 and profile.kind == "measured"):
        return [profile.num_gpus]
    smaller = sorted((n for n in smooth_below(count)), reverse=True)[:MAX_SMALLER_COUNTS]
    return [profile.num_gpus, *(n * unit for n in smaller)]


def smooth_below(count: int) -> list[int]:
    """Every ``2^a x 3^b`` below ``count``."""
    out, three = [], 1
    while three < count:
        two = three
        while two < count:
            out.append(two)
            two *= 2
        three *= 3
    return out


def batch_counts(training: TrainingConfig, opts: SearchOptions) -> list[int]:
    """The global batches to search, largest first: the one asked for, or both ends of the range and the
    multiple of the largest power of two inside it."""
    lo = training.global_batch_seqs
    hi = opts.global_batch_max or lo
    power = 1 << hi.bit_length()
    while power > 1 and (hi // power) * power < lo:
        power //= 2
    return sorted({lo, hi, (hi // power) * power}, reverse=True)


def on_gpus(profile: ClusterProfile, gpus: int) -> ClusterProfile:
    """``profile`` cut to ``gpus`` (whole nodes, or part of its one node)."""
    if gpus == profile.num_gpus:
        return profile
    if profile.num_nodes > 1:
        return profile.with_nodes(gpus // profile.gpus_per_node)
    from planner.reference import on_gpus as resize

    return resize(profile, gpus)


def used_profile(profile: ClusterProfile, plan: Plan) -> ClusterProfile:
    """The profile of the GPUs ``plan`` uses (``profile`` cut where its sizing left some idle)."""
    return on_gpus(profile, plan.num_gpus)


def check_range(training: TrainingConfig, opts: SearchOptions) -> None:
    """A batch range needs a batch in sequences at its low end and a high end above it."""
    hi = opts.global_batch_max
    if hi is None:
        return
    if training.global_batch_size is None:
        raise AutoparError("global_batch_max", hi, "give the range's low end as global_batch_size (sequences), "
                           "or drop global_batch_max", problem="needs global_batch_size, not global_batch_tokens")
    if hi < training.global_batch_size:
        raise AutoparError("global_batch_max", hi, f"give at least global_batch_size={training.global_batch_size}",
                           problem="is below the range's low end")


def asked(training: TrainingConfig, profile: ClusterProfile, opts: SearchOptions) -> bool:
    """Whether more than one (GPUs, batch) pair is to be searched."""
    check_range(training, opts)
    return len(gpu_counts(profile, opts)) > 1 or len(batch_counts(training, opts)) > 1


Search = Callable[[ModelSpec, TrainingConfig, ClusterProfile, SearchOptions], Plan]


def sized_search(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, opts: SearchOptions,
                 search_one: Search) -> Plan:
    """The plan of the (GPUs, batch) pair with the most tokens per second, with ``Plan.sizing``."""
    pairs = [(g, b) for g in gpu_counts(profile, opts) for b in batch_counts(training, opts)]
    deadline = time.perf_counter() + opts.time_budget_s
    found: list[tuple[SizeTried, Plan | None]] = []
    errors: list[AutoparError] = []
    for i, (gpus, batch) in enumerate(pairs):
        # each pair is one plain search with an even share of the budget left (a pair refused at once leaves
        # its share to the others)
        left = max((deadline - time.perf_counter()) / (len(pairs) - i), 0.1)
        share = replace(opts, time_budget_s=left, global_batch_max=None, idle_gpus=False)
        job = training.model_copy(update={"global_batch_size": batch, "global_batch_tokens": None})
        try:
            plan = search_one(model, job, on_gpus(profile, gpus), share)
        except AutoparError as exc:
            errors.append(exc)
            found.append((SizeTried(num_gpus=gpus, global_batch_size=batch, reason=str(exc)), None))
            continue
        step = plan.prediction.step_time_s
        found.append((SizeTried(num_gpus=gpus, global_batch_size=batch, step_time_s=step,
                                tokens_per_s=batch * training.seq_length / step), plan))
    if not any(plan for _, plan in found):  # the budget's error first: it is the one the user can fix at once
        raise next((e for e in errors if e.field == "time_budget_s"), errors[0])
    best, plan = max(((t, p) for t, p in found if p is not None), key=lambda tp: (tp[0].tokens_per_s, -tp[0].num_gpus))
    sizing = Sizing(available_gpus=profile.num_gpus, global_batch_range=_range(training, opts),
                    chosen_gpus=best.num_gpus, chosen_global_batch=best.global_batch_size,
                    why=why(best, [t for t, _ in found], profile.num_gpus), tried=[t for t, _ in found])
    return plan.model_copy(update={"sizing": sizing})


def _range(training: TrainingConfig, opts: SearchOptions) -> list[int] | None:
    return None if opts.global_batch_max is None else [training.global_batch_seqs, opts.global_batch_max]


def why(best: SizeTried, tried: list[SizeTried], available: int) -> str:
    """One sentence: the GPUs used and the batch chosen, each against the best of the others."""
    parts = []
    others = [t for t in tried if t.tokens_per_s and t.num_gpus != best.num_gpus]
    if best.num_gpus < available:
        full = [t for t in tried if t.num_gpus == available]
        if any(t.tokens_per_s for t in full):
            rival = max((t for t in full if t.tokens_per_s), key=lambda t: t.tokens_per_s)
            parts.append(f"{best.num_gpus} of {available} GPUs ({available - best.num_gpus} idle) train "
                         f"{best.tokens_per_s / rival.tokens_per_s - 1:.1%} more tokens/s than all {available}")
        else:
            parts.append(f"{best.num_gpus} of {available} GPUs ({available - best.num_gpus} idle): no layout of all "
                         f"{available} runs the job ({full[0].reason if full else 'not searched'})")
    elif others:
        rival = max(others, key=lambda t: t.tokens_per_s)
        parts.append(f"all {available} GPUs: {best.tokens_per_s / rival.tokens_per_s - 1:.1%} more tokens/s "
                     f"than the best on {rival.num_gpus}")
    batches = [t for t in tried if t.num_gpus == best.num_gpus and t.global_batch_size != best.global_batch_size]
    if batches:
        listed = ", ".join(f"{t.global_batch_size}: " + (f"{t.tokens_per_s / best.tokens_per_s - 1:+.1%}"
                                                          if t.tokens_per_s else "no layout") for t in batches)
        parts.append(f"global batch {best.global_batch_size}, the most tokens/s of those searched ({listed})")
    return "; ".join(parts)

"""Price: a candidate priced exactly (:class:`~planner.search.stages.StageModel`): one structure on its
default split, a target's fallback when it refuses the default split, the frugal layouts that bound memory,
and :class:`Found`, a priced candidate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from planner import targets
from planner.contracts import (
    ClusterProfile,
    ModelSpec,
    ParallelLayout,
    Recompute,
    Schedule,
    TrainingConfig,
)
from planner.cost.comm import placement
from planner.cost.memory import (
    activation_factor,
)
from planner.search.enumerate import Structure, base_layout
from planner.search.options import SearchOptions
from planner.search.stages import (
    SharedCosts,
    StageModel,
    floor_states,
    pipeline_send_s,
    shared_costs,
)


def price_structure(st: Structure, model: ModelSpec, training: TrainingConfig, profile: ClusterProfile,
                    opts: SearchOptions, cache: dict) -> None:
    """Fill the structure's per-micro-batch work and its lower bound ``m · (W/p + 2·t_p2p)``.

    The blocks, embedding and head depend only on (tp, sp, cp, ep, micro-batch) and the pipeline
    send only on (tp, cp, micro-batch, pp, dp) (see :func:`~planner.search.stages.shared_costs`),
    so both are memoised in ``cache`` under those keys: most structures build no layout."""
    flags = (opts.tp_comm_overlap, opts.ep_comm_overlap, st.pp_scatter_gather, opts.dp_comm_overlap)
    core_key = ("structure-work", st.tp, st.sp, st.cp, st.ep, st.etp, st.mb, flags)
    p2p_key = ("structure-p2p", st.tp, st.cp, st.mb, st.pp, st.dp, flags)
    core, p2p_s = cache.get(core_key), cache.get(p2p_key)
    if core is None:
        sc = shared_costs(model, training, profile, base_layout(st, opts), cache, opts.target)
        p2p_s = cache[p2p_key] = sc.p2p_s
        core = cache[core_key] = structure_work(sc)
    elif p2p_s is None:  # the send alone: no layout to build (its group is the mesh's pipeline placement)
        group = placement(st.pp, st.tp * st.cp * st.dp, profile.gpus_per_node)
        p2p_s = cache[p2p_key] = pipeline_send_s(model, training, profile, group,
                                                 st.mb * (training.seq_length // st.cp), st.tp, st.pp_scatter_gather)
    (st.layer_times, st.emb_s, st.head_s, st.work_s, st.forward_work_s, st.forward_ratio,
     st.forward_ratio_min) = core
    st.p2p_s = p2p_s
    st.bound_s = st.m * (st.work_s / st.pp + 2 * st.p2p_s)


@dataclass(order=True)
class Found:
    step_s: float
    order: int
    layout: ParallelLayout = field(compare=False)
    family: str = field(compare=False)
    status: str = field(compare=False)


def target_refusal(model: ModelSpec, training: TrainingConfig, target: str, layout: ParallelLayout,
                   micro_batches: int, scopes: tuple[str, ...] = targets.SCOPES) -> targets.TargetRefusal | None:
    """The first row of ``target``'s capability table (planner/targets/) that refuses this layout."""
    return targets.refusal(target, targets.Job(model, training, layout, micro_batches=micro_batches), scopes)


class Uniform(NamedTuple):
    """:func:`target_fallback`'s choice: step seconds, the layout, its stage terms, the per-rank recompute."""

    step_s: float
    layout: ParallelLayout
    terms: list
    recompute: list[tuple[Recompute, int]]


def target_fallback(sm: StageModel, target: str, micro_batches: int) -> Uniform | None:
    """The fastest fitting layout of ``sm`` that ``target`` runs when it refused the search's split or per-stage
    recompute: the default split with one recompute kind and count on every pipeline rank (a count past a
    rank's layers recomputes all of them, as ``--recompute-num-layers`` does). Per kind, the step time grows
    and the memory falls with the count, so the fewest layers that fit (bisected on memory alone) is the
    kind's best, and no recompute, where it fits and runs, beats every kind; a count the target refuses there
    is passed for the next larger one it runs. Targets with one recompute choice for every stage price a
    leaf's default split with :func:`best_uniform` directly (``_price_default``)."""
    if default_split_refusal(sm, target, micro_batches) is not None:
        return None  # refused whatever the recompute (its micro-batches, its split): nothing here to choose
    return best_uniform(sm, target, micro_batches)


def default_split_refusal(sm: StageModel, target: str, micro_batches: int) -> targets.TargetRefusal | None:
    """``target``'s refusal of ``sm``'s default split without recompute: what no recompute choice there mends."""
    layout = sm.layout_for(sm.default_chunks(), [(Recompute.none, 0)] * sm.p)
    return target_refusal(sm.model, sm.training, target, layout, micro_batches)


def best_uniform(sm: StageModel, target: str, micro_batches: int) -> Uniform | None:
    """:func:`target_fallback`'s search, on a split the target does not refuse as such (the caller asked
    :func:`default_split_refusal`: it is not asked again)."""
    chunks = sm.default_chunks()
    most = max(len(r) for r in sm.rank_layers(chunks))
    best = None

    for kind in (Recompute.none, *sm.recompute_kinds):
        counts = [0] if kind is Recompute.none else range(1, most + 1)
        lo, hi = 0, len(counts) - 1
        while lo < hi:  # the first count that fits (the last one when none does)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if sm.uniform_fits(chunks, kind, counts[mid]) else (mid + 1, hi)
        for count in counts[lo:]:
            step, terms = sm.evaluate(chunks, [(kind, count)] * sm.p)
            if not sm.fits(terms) or (best is not None and step >= best[0]):
                break
            layout = sm.layout_for(chunks, [(kind, count)] * sm.p)
            # no recompute there is the split the caller found the target runs (default_split_refusal)
            if kind is Recompute.none or target_refusal(sm.model, sm.training, target, layout, micro_batches) is None:
                best = Uniform(step, layout, terms, [(kind, count)] * sm.p)
                break
        if best is not None and kind is Recompute.none:
            return best  # every recompute only adds time
    return best



def frugal_layout(st: Structure, opts: SearchOptions, sched: Schedule, v: int,
                  training: TrainingConfig | None = None, profile: ClusterProfile | None = None) -> ParallelLayout:
    """The structure's leaf with the least activation memory per formula byte (ties: the highest ZeRO
    stage), fully sharded, offloaded; :func:`frugal_stage_model` lowers its states to every leaf's least."""
    zeros = sorted(opts.zero_stages, reverse=True)
    if training is not None and profile is not None:
        zeros.sort(key=lambda z: activation_factor(profile.assumptions, training, z))
    frugal_zero = zeros[0]
    return base_layout(st, opts, dp_shard=st.dp, zero_stage=frugal_zero, schedule=sched, virtual_stages=v,
                        offload_optimizer=opts.offload and frugal_zero >= 1)


def frugal_stage_model(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, st: Structure,
                       opts: SearchOptions, sched: Schedule, v: int, cache: dict) -> StageModel:
    """A stage model holding no more than any leaf of ``st`` with schedule ``sched`` (memory bounds only)."""
    sm = StageModel(model, training, profile, frugal_layout(st, opts, sched, v, training, profile), block_cache=cache,
                    target=opts.target)
    return floor_states(sm, opts.zero_stages, opts.offload)


def structure_work(sc: SharedCosts) -> tuple[list[float], float, float, float, float, float, float]:
    """(per-layer f+b, embedding f+b, head f+b, whole-model f+b, its forward part, largest and
    smallest forward share) of one micro-batch without recompute: see :class:`Structure`.
    The layer list is shared by every structure of this shape and must not be mutated."""
    per_kind = {k: (kc.forward_s + kc.backward_s[Recompute.none], kc.forward_s) for k, kc in sc.kind_cost.items()}
    layer_times = [per_kind[k][0] for k in sc.kinds]
    (ef_s, eb_s), (hf_s, hb_s) = sc.emb, sc.head
    emb_s, head_s = ef_s + eb_s, hf_s + hb_s
    counts = {k: sc.kinds.count(k) for k in per_kind}
    work_s = sum(counts[k] * per_kind[k][0] for k in per_kind) + emb_s + head_s
    forward_work_s = sum(counts[k] * per_kind[k][1] for k in per_kind) + ef_s + hf_s
    ratios = [f / t for t, f in per_kind.values() if t > 0]
    ratios += [x / (x + y) for x, y in ((ef_s, eb_s), (hf_s, hb_s)) if x + y > 0]
    lows = [kc.forward_s / (kc.forward_s + max(kc.backward_s.values())) for kc in sc.kind_cost.values()
            if kc.forward_s > 0]
    lows += [x / (x + y) for x, y in ((ef_s, eb_s), (hf_s, hb_s)) if x + y > 0]
    return (layer_times, emb_s, head_s, work_s, forward_work_s, max(ratios) if ratios else 0.5, min(lows + [0.5]))

"""Bound: lower bounds on a structure's, a schedule's and a leaf's step time (its work spread evenly, the
schedule's bubble over the best contiguous split, pipeline tails, pigeonhole communication) and on its
memory, which let the search skip what cannot beat the k-th best plan."""

from __future__ import annotations

import bisect
import math
import time

from planner.contracts import (
    ClusterProfile,
    ModelSpec,
    Schedule,
    TrainingConfig,
)
from planner.cost.checks import default_layer_split
from planner.cost.comm import placement
from planner.cost.pipeline import SCHEDULES, PipeWork, microbatches_in_flight
from planner.errors import AutoparError
from planner.search.enumerate import Structure, out_of_time
from planner.search.options import SearchOptions
from planner.search.price import frugal_stage_model
from planner.search.stages import (
    LeafComm,
    StageModel,
    memory_minmax_s,
    pipeline_send_s,
    work_floor_s,
)


def structure_floor(st: Structure, model: ModelSpec, training: TrainingConfig, profile: ClusterProfile,
                    opts: SearchOptions, cache: dict) -> float:
    """A floor of ``st.bound_s`` without pricing its blocks: ``m · (W_floor/p + 2·t_p2p)`` with
    :func:`~planner.search.stages.work_floor_s` <= ``work_s`` and the pipeline send computed as
    :func:`price_structure` does (``tests/test_search.py`` checks floor <= bound on every structure)."""
    return structure_floors([st], model, training, profile, opts, cache)[0]


def structure_floors(structs: list[Structure], model: ModelSpec, training: TrainingConfig, profile: ClusterProfile,
                     opts: SearchOptions, cache: dict, deadline: float = math.inf) -> list[float]:
    """:func:`structure_floor` of each structure (one loop, the floors and sends memoised per shape;
    AutoparError once ``time.perf_counter()`` passes ``deadline``)."""
    works: dict[tuple, float] = {}
    sends: dict[tuple, float] = {}
    seq, gpn = training.seq_length, profile.gpus_per_node
    tp_ov, ep_ov = opts.tp_comm_overlap, opts.ep_comm_overlap
    out = []
    for n, st in enumerate(structs):
        if n % 1024 == 0 and time.perf_counter() > deadline:
            raise out_of_time(opts, f"while bounding the layouts ({n:,} of {len(structs):,} bounded)")
        tp, cp, mb = st.tp, st.cp, st.mb
        wkey = (tp, st.sp, cp, st.ep, st.etp, mb)
        work = works.get(wkey)
        if work is None:
            work = works[wkey] = work_floor_s(model, training, profile, tp, st.sp, cp, st.ep, mb, tp_ov and tp > 1,
                                              ep_ov and st.ep > 1, cache, st.etp)
        tokens = mb * (seq // cp)
        stride = tp * cp * st.dp
        sg = st.pp_scatter_gather
        skey = (st.pp, stride, tokens, tp, sg)
        p2p_s = sends.get(skey)
        if p2p_s is None:
            p2p_s = sends[skey] = pipeline_send_s(model, training, profile, placement(st.pp, stride, gpn),
                                                  tokens, tp, sg)
        out.append(st.m * (work / st.pp + 2 * p2p_s))
    return out


def min_max_stage(st: Structure) -> float:
    """Smallest possible slowest-stage time over contiguous splits (v=1, no recompute, no DP traffic)."""
    p, times = st.pp, st.layer_times
    if p == 1:
        return st.work_s + 2 * st.p2p_s
    send = 2 * st.p2p_s
    if all(t == times[0] for t in times):
        bases = [(send + st.emb_s, 1), (send, p - 2), (send + st.head_s, 1)]
        return _uniform_min_max(len(times), times[0], [(b, c) for b, c in bases if c > 0])

    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)

    emb_s, head_s, right = st.emb_s, st.head_s, bisect.bisect_right
    first_base = send + emb_s

    def fits(cap: float) -> bool:
        """Greedy: fill each stage as far as ``cap`` allows, leaving one layer for each later stage."""
        i = 0
        base = first_base
        for stage in range(p - 1):
            j = right(prefix, cap - base + prefix[i]) - 1  # furthest end within cap
            if j < i + 1:  # noqa: PLR1730 - max() is slower in this hot loop
                j = i + 1
            last_ok = n - (p - 1 - stage)
            if j > last_ok:  # noqa: PLR1730
                j = last_ok
            if base + prefix[j] - prefix[i] > cap:
                return False
            i = j
            base = send + 0.0
        return base + prefix[n] - prefix[i] + head_s <= cap

    lo, hi = st.work_s / p, st.work_s + send
    eps = (hi - lo) / 2**24  # the precision of 24 halvings of that bracket
    # the default split fits its own slowest stage: a much tighter start for the bisection
    start, slowest = 0, 0.0
    for stage, size in enumerate(default_layer_split(n, p)):
        end = start + size
        slowest = max(slowest, send + prefix[end] - prefix[start] + (st.emb_s if stage == 0 else 0.0)
                      + (st.head_s if stage == p - 1 else 0.0))
        start = end
    hi = max(min(hi, slowest), lo)
    while hi - lo > eps:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


def _uniform_min_max(n: int, t: float, stages: list[tuple[float, int]]) -> float:
    """Exact min-max of :func:`min_max_stage` when all ``n`` layers take ``t``; ``stages``: (fixed
    time, how many stages have it), every stage holding at least one layer.

    A cap ``T`` admits a split iff every stage holds one layer (``T >= b + t``) and the stages'
    capacities ``floor((T - b)/t)`` add up to ``n`` (any counts within the capacities, at least
    one each, make a contiguous split). The optimum is the time of its slowest stage, so it is
    ``b + k·t`` for one stage's ``b`` and an integer ``k``: per fixed time, bisect the smallest
    feasible ``k`` (feasibility grows with ``T``) and take the least of those caps. The floor
    rounds up by ``1e-9`` of a layer and the result is lowered by ``1e-12`` relative: rounding
    only ever makes the bound smaller, so it stays a lower bound of every split's slowest stage."""
    if t <= 0:
        return max(b for b, _ in stages)
    floor_b = max(b for b, _ in stages) + t  # every stage holds a layer

    def feasible(cap: float) -> bool:
        return cap >= floor_b * (1 - 1e-12) and sum(c * math.floor((cap - b) / t + 1e-9) for b, c in stages) >= n

    best = math.inf
    for b, _ in stages:
        lo, hi = 1, n  # b + n·t is feasible: that stage alone can hold every layer
        if not feasible(b + hi * t):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(b + mid * t):
                hi = mid
            else:
                lo = mid + 1
        best = min(best, b + lo * t)
    return best * (1 - 1e-12)


def _rank_work(st: Structure, v: int, recompute_s: float, comm_f: float, comm_b: float,
               eff: float) -> tuple[float, float, float]:
    """(Σ forward compute, Σ backward compute, Σ (f + b) with the per-micro-batch collectives) over
    the ranks for one micro-batch; see :func:`schedule_bound`."""
    p = st.pp
    fwd = st.forward_work_s + v * p * st.p2p_s
    bwd = st.work_s - st.forward_work_s + v * p * st.p2p_s + recompute_s
    keep = 1.0 - eff

    def with_comm(work: float, comm: float) -> float:
        return max(work + keep * comm, comm + keep * work) if comm else work

    return fwd, bwd, with_comm(fwd, p * comm_f) + with_comm(bwd, p * comm_b)


def schedule_bound(st: Structure, sched: Schedule, v: int, minmax: float, recompute_s: float = 0.0,
                   comm_f: float = 0.0, comm_b: float = 0.0, eff: float = 1.0) -> float:
    """Lower bound of the pipeline phase.

    Every term grows with the collectives (``comm_f = comm_b = 0`` bounds every ZeRO stage).

    ``minmax``: a lower bound on the slowest rank's ``f + b`` valid for this schedule's chunking;
    ``recompute_s``: least recompute time over all ranks that memory forces (see
    :func:`~planner.search.stages.recompute_bound_s`); ``comm_f``/``comm_b``: per-micro-batch
    ZeRO-2/3 collectives of a rank holding the average parameters (affine in them, so the ranks'
    sum is ``p·comm``). A rank's forward with its collective is ``f + c - eff·min(c, f)``
    (``eff``: the share of a collective its compute window hides), which equals
    ``max(f + (1-eff)·c, c + (1-eff)·f)``: convex, so the ranks' sum is at least
    ``max(F + (1-eff)·C, C + (1-eff)·F)`` with ``F = Σf``, ``C = p·c``; likewise the backward. The
    slowest rank is at least the summed work over ``p``.
    """
    m, p = st.m, st.pp
    fwd, bwd, total = _rank_work(st, v, recompute_s, comm_f, comm_b, eff)
    if p == 1:
        return m * total
    work = PipeWork(m, p, v, max(minmax, total / p), total, fwd, fwd + bwd, st.forward_ratio_min, st.forward_ratio,
                    st.p2p_s)
    return SCHEDULES[sched].work_floor(work)  # the schedule's own bound (planner.cost.pipeline)


def interleaved_memory_floor(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, st: Structure,
                             opts: SearchOptions, sched: Schedule, depths: list[int], cache: dict) -> float:
    """A lower bound of the frugal memory min-max stage (``memory_minmax_s`` of :func:`frugal_layout`,
    without ZeRO-3 gather buffers) of every depth in ``depths`` of the virtual schedule ``sched`` at once.

    :func:`~planner.search.stages.memory_minmax_s` grows with each rank's micro-batches in flight
    (they multiply the activations a rank keeps, whatever it recomputes, so every holding's memory
    grows with them) and with its fixed time (the sends, ``2·v·t_p2p``). Interleaved rank ``r``
    keeps ``p + (p-1-2r)/v`` in flight: fewest at the deepest ``v`` for the first half of the ranks,
    at the shallowest for the rest. The frugal stage model of the shallowest depth with each rank's
    fewest in flight over the depths therefore bounds them all: one bound where the search would
    compute one per depth (seven for DeepSeek-V3's 61 layers) to prune them. 0 (no bound) when
    that layout is not valid.
    """
    try:
        sm = frugal_stage_model(model, training, profile, st, opts, sched, min(depths), cache)
    except AutoparError:
        return 0.0
    flights = [[microbatches_in_flight(sched, r, st.pp, st.m, d) for r in range(st.pp)]
               for d in depths]
    sm.in_flight = [min(f[r] for f in flights) for r in range(st.pp)]  # its own list: the cached one is shared
    return memory_minmax_s(sm, 0.0, gather_buffers=False)


def leaf_bound(st: Structure, sched: Schedule, v: int, minmax: float, recompute_s: float, comm: LeafComm,
               tail_comms: tuple[LeafComm, ...] = ()) -> float:
    """Schedule bound with the per-micro-batch ZeRO-2/3 collectives (:func:`schedule_bound`), plus a
    bound on the slowest tail.

    ``comm`` is the data-parallel side of a stage holding the average parameters per GPU
    (collective and optimizer times are affine in them, so the largest stage has at least the
    average). The tail of a stage is its optimizer step plus the exposed part of its once-per-step
    traffic ``c``, which is at least ``(1 - eff)·c`` and at least ``c - eff·T`` with ``T`` the slowest
    stage (the windows it hides behind are that stage's forward and backward). Both are convex in
    the stage's parameters, so the most loaded stage has at least the average's. The pipeline term
    grows by ``(m - 1)`` per second of ``T`` (more for the other schedules) and the tail shrinks by
    at most ``eff`` <= 1, so for ``m >= 2`` the bound holds at the smallest ``T``.

    ``tail_comms``: the same data-parallel side for stages holding other parameters that some
    stage is known to hold at least (e.g. ``ceil(blocks / p)`` blocks of one kind: by pigeonhole
    some rank holds that many); the tail bound is the largest of them (the same affine times, the
    same argument per stage)."""
    gpm = comm.gathers_per_mb
    comm_f = comm.gather_s if gpm else 0.0
    comm_b = (comm.gather_s * (gpm - 1) if gpm else 0.0) + (comm.grad_s if comm.grads_per_mb else 0.0)
    bound = schedule_bound(st, sched, v, minmax, recompute_s, comm_f, comm_b, comm.eff)
    # the smallest slowest-stage time the pipeline term above was priced at
    t_min = max(minmax, _rank_work(st, v, recompute_s, comm_f, comm_b, comm.eff)[2] / st.pp) if st.m >= 2 else None
    tail = 0.0
    for c in (comm, *tail_comms):
        per_step = _per_step_s(c)
        exposed = (1.0 - c.eff) * per_step
        if t_min is not None:
            exposed = max(exposed, per_step - c.eff * t_min)
        tail = max(tail, c.optimizer_s + exposed)
    return bound + tail


def pigeonhole_comms(sm: StageModel, cache: dict) -> tuple[LeafComm, ...]:
    """Per block kind, the data-parallel side of a rank holding ``ceil(count / p)`` blocks of it and
    nothing else: some rank holds at least that many, and the tail bound of :func:`leaf_bound`
    only grows with the parameters (its collective and optimizer times are affine, increasing)."""
    lay, p = sm.layout, sm.p
    key = (lay.zero_stage, lay.dp_shard, lay.dp_replicate, lay.cp, lay.tp, lay.ep, lay.expert_tp)
    out = []
    for kind in sorted(set(sm.kinds)):
        held = -(-sm.kinds.count(kind) // p)
        kc = sm.kind_cost[kind]
        out.append(LeafComm.of(sm.profile, sm.training, lambda: lay, key, lay.offload_share,
                               lay.reshard_after_forward, lay.dp_comm_overlap, held * kc.dense_params,
                               held * kc.expert_params, cache, pp=lay.pp))
    return tuple(out)


def _per_step_s(comm: LeafComm) -> float:
    """Once-per-step data-parallel traffic of a stage holding the average parameters."""
    gpm = comm.gathers_per_mb
    return comm.replica_s + (0.0 if comm.grads_per_mb else comm.grad_s) + (0.0 if gpm else comm.gather_s)


def leaf_tail_bound(comm: LeafComm) -> float:
    """The part of :func:`leaf_bound` that does not depend on the schedule: the optimizer step and
    the exposed once-per-step traffic ``(1 - eff)·c`` of a stage holding the average parameters.
    ``leaf_bound >= schedule_bound(...) (no collectives) + leaf_tail_bound``: its pipeline
    term grows with the per-micro-batch collectives (``with_comm >= work``, and every schedule's
    bound grows with the summed work and the slowest rank) and its tail is at least this."""
    return comm.optimizer_s + (1.0 - comm.eff) * _per_step_s(comm)



"""The planner's search: every layout of the GPUs, pruned by bounds, inner choices solved by CP-SAT.

Outer enumeration (:func:`structures`): every ``tp × cp × pp × dp`` factorisation of the GPUs, SP
on/off, expert parallel and expert tensor-parallel degrees (MoE; ep × etp folded over the
``dp × cp × tp`` ranks), micro-batch size; then per structure the schedule (1F1B,
GPipe, interleaved with ``v`` virtual stages, zero-bubble), ZeRO stage 0–3 with every HSDP shard
group, optimizer offload and ZeRO-3 resharding. Each removed candidate is counted under the rule
that removed it.

Branch and bound: a structure's lower bound is the time of its work perfectly spread over its
pipeline ranks (``m · W/p``); a (structure, schedule) bound adds the schedule's bubble over the
best contiguous layer split; a leaf's bound adds its optimizer step. Leaves are priced exactly
(:class:`~planner.search.stages.StageModel`) in bound order, first on the default split with the
fastest recompute per stage that fits, then — unless that already meets the bound — by CP-SAT
(:mod:`planner.search.cpsat`), which moves layers between stages and picks recompute per stage.
Before a CP-SAT proof, :class:`~planner.search.stages.SplitBound` prices every rank exactly at its
fastest recompute that fits (two ranks: every split's step; deeper: the slowest rank, with the
tail of a rank holding ``ceil(blocks/p)`` blocks); a bound at the cutoff settles the leaf as
CP-SAT's INFEASIBLE would. The search stops when the next bound is no better than the k-th best
plan found.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
import heapq
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from planner import targets
from planner.contracts import (
    Alternative,
    ClusterProfile,
    FamilyOutcome,
    LinkLevel,
    ModelSpec,
    ParallelLayout,
    Plan,
    Prediction,
    Recompute,
    Schedule,
    SearchReport,
    TrainingConfig,
)
from planner.cost.comm import placement
from planner.cost.memo import memoised
from planner.cost.memory import (
    activation_factor,
    model_state_bytes,
    state_bytes_per_param,
    usable_bytes,
)
from planner.cost.params import embedding_params, layer_params, lm_head_params
from planner.cost.pipeline import SCHEDULES, microbatches_in_flight
from planner.cost.predict import check_sequence, default_layer_split, predict
from planner.errors import AutoparError
from planner.search.cpsat import layer_kind_prefix, solve_stages
from planner.search.options import SearchOptions
from planner.search.rules import Rule, Rules
from planner.search.stages import (
    RECOMPUTE_KINDS,
    LeafComm,
    SharedCosts,
    SplitBound,
    StageModel,
    expert_fold,
    floor_states,
    memory_minmax_s,
    pipeline_send_s,
    recompute_bound_s,
    shared_costs,
    state_bytes_per_param_split,
    work_floor_s,
)

GIB = 2**30
# structures priced first, on one plain leaf each, to start the bound
SEED_STRUCTURES = 48
# structures whose best plan is priced in full to say why it lost
EXPLAINED_FAMILIES = 12


def out_of_time(opts: SearchOptions, what: str) -> AutoparError:
    """The error of a search whose budget ran out before any layout that fits was priced."""
    return AutoparError("time_budget_s", f"{opts.time_budget_s:g}",
                        "raise the search time budget (autopar plan --time-budget SECONDS, options.time_budget_s), or "
                        "narrow the search (--max-tp, --max-pp, --max-micro-batch)", problem=f"ran out {what}")


DIVISORS_MAX = 2**40  # above every count the contracts allow (planner/contracts/limits.py)


def divisors(n: int) -> list[int]:
    """Every d with n % d == 0, ascending: the products of n's prime powers. Factorising by trial
    division takes at most √n steps: 2^12 for the counts the contracts allow (GPUs <= 2^20,
    sequences per step <= 2^24), and far fewer for the smooth counts real jobs use."""
    return list(_divisors(n))


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    if not 1 <= n <= DIVISORS_MAX:
        raise ValueError(f"divisors({n}) is outside 1..{DIVISORS_MAX}; the contracts bound every count below it")
    out, rest, p = [1], n, 2
    while p * p <= rest:
        if rest % p == 0:
            base, power = list(out), 1
            while rest % p == 0:
                rest //= p
                power *= p
                out += [d * power for d in base]
        p += 1 if p == 2 else 2
    if rest > 1:  # a prime factor above √rest
        out += [d * rest for d in out]
    return tuple(sorted(out))


@dataclass
class Structure:
    tp: int
    sp: bool
    cp: int
    pp: int
    dp: int
    ep: int
    mb: int
    m: int  # micro-batches per step
    etp: int | None = None  # the routed experts' TP degree when folded below tp (MoE); None = tp
    pp_scatter_gather: bool = True  # each TP rank sends 1/tp of the activation (:func:`stage_sends`)
    work_s: float = 0.0  # forward+backward of the whole model for one micro-batch (no recompute)
    p2p_s: float = 0.0
    bound_s: float = 0.0
    layer_times: list[float] = field(default_factory=list)
    emb_s: float = 0.0
    head_s: float = 0.0
    forward_work_s: float = 0.0  # the forward part of work_s
    forward_ratio: float = 0.5  # largest forward / (forward + backward) of any block, embedding or head
    forward_ratio_min: float = 0.0  # smallest, with the slowest (recomputing) backward, sends included
    family: str = field(init=False)

    def __post_init__(self) -> None:
        self.family = (f"tp{self.tp}{'+sp' if self.sp else ''} cp{self.cp} pp{self.pp} dp{self.dp}"
                       + (f" ep{self.ep}" if self.ep > 1 else "") + (f" etp{self.etp}" if self.etp is not None else ""))

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


def structures(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, opts: SearchOptions,
               rules: Rules, deadline: float = math.inf) -> list[Structure]:
    """Every (tp, sp, cp, pp, dp, ep, etp, micro-batch) that passes the divisibility and placement rules
    (AutoparError once ``time.perf_counter()`` passes ``deadline``)."""
    n, gpn, L = profile.num_gpus, profile.gpus_per_node, model.num_layers
    a, k, s, gbs = model.num_attention_heads, model.kv_heads, training.seq_length, training.global_batch_seqs
    max_tp = opts.max_tp or gpn
    out = []
    for tp in divisors(n):
        if time.perf_counter() > deadline:
            raise out_of_time(opts, f"while listing the layouts ({len(out):,} listed so far)")
        if tp > max_tp:
            rules.remove(Rule.TP_PER_NODE, f"tp={tp}")
            continue
        if a % tp:
            rules.remove(Rule.TP_HEADS, f"tp={tp}, heads={a}")
            continue
        if k % tp and tp % k:
            rules.remove(Rule.TP_KV_HEADS, f"tp={tp}, kv_heads={k}")
            continue
        for cp in divisors(n // tp):
            if opts.max_cp is not None and cp > opts.max_cp:
                rules.remove(Rule.MAX_CP, f"cp={cp}", limit=opts.max_cp)
                continue
            if cp > 1 and s % (2 * cp):
                rules.remove(Rule.CP_SEQ, f"cp={cp}, seq={s}")
                continue
            for pp in divisors(n // (tp * cp)):
                if time.perf_counter() > deadline:
                    raise out_of_time(opts, f"while listing the layouts ({len(out):,} listed so far)")
                if pp > L:
                    rules.remove(Rule.PP_LAYERS, f"pp={pp}, layers={L}")
                    continue
                if opts.max_pp is not None and pp > opts.max_pp:
                    rules.remove(Rule.MAX_PP, f"pp={pp}", limit=opts.max_pp)
                    continue
                dp = n // (tp * cp * pp)
                if gbs % dp:
                    rules.remove(Rule.DP_BATCH, f"dp={dp}, batch={gbs}")
                    continue
                for sp in ((False, True) if tp > 1 and opts.sequence_parallel else (False,)):
                    if sp and (s // cp) % tp:
                        rules.remove(Rule.SP_SEQ, f"tp={tp}, cp={cp}, seq={s}")
                        continue
                    for ep, etp in _expert_degrees(model, opts, rules, dp, cp, tp, sp):
                        for mb in divisors(gbs // dp):
                            if mb > opts.max_micro_batch_size:
                                rules.remove(Rule.MAX_MICRO_BATCH, f"mb={mb}", limit=opts.max_micro_batch_size)
                                continue
                            out.append(Structure(tp, sp, cp, pp, dp, ep, mb, gbs // (dp * mb), etp=etp,
                                                 pp_scatter_gather=stage_sends(model, opts, sp)))
    return out


def _expert_degrees(model: ModelSpec, opts: SearchOptions, rules: Rules, dp: int, cp: int, tp: int,
                    sp: bool) -> list[tuple[int, int | None]]:
    """(ep, etp) of a (dp, cp, tp, sp) shape: (1, None) for a dense model; for an MoE model every ep
    dividing the experts and etp dividing tp (etp = tp first, kept as None) whose ep x etp folds over the
    ``dp x cp x tp`` ranks (:func:`~planner.search.stages.expert_fold`). Folding below tp (etp < tp) needs
    sequence parallelism: the experts take each rank's share of the sequence."""
    if model.moe is None:
        return [(1, None)]
    out = []
    etps = [tp] + [e for e in reversed(divisors(tp)) if e < tp] if sp else [tp]
    for etp in etps:
        for ep in divisors(model.moe.num_experts):
            if opts.max_ep is not None and ep > opts.max_ep:
                rules.remove(Rule.MAX_EP, f"ep={ep}", limit=opts.max_ep)
                continue
            if expert_fold(dp, cp, tp, ep, etp)[0] is not None:
                rules.remove(Rule.FOLD, f"ep={ep}, etp={etp}, dp x cp x tp={dp * cp * tp}")
                continue
            out.append((ep, None if etp == tp else etp))
    return out


def stage_sends(model: ModelSpec, opts: SearchOptions, sp: bool) -> bool:
    """The ``pp_scatter_gather`` of a structure: the option's, or what ``opts.target``'s pipeline sends with
    (or without) sequence parallelism (:func:`planner.targets.planned_scatter_gather`); a value the target
    does not run is its table's to refuse."""
    if opts.pp_scatter_gather is not None:
        return opts.pp_scatter_gather
    return targets.planned_scatter_gather(opts.target, model, sp)


def _base_layout(st: Structure, opts: SearchOptions, **extra) -> ParallelLayout:  # noqa: ANN003
    fields = dict(tp=st.tp, sp=st.sp, cp=st.cp, pp=st.pp, ep=st.ep, etp=st.etp, dp_shard=st.dp, dp_replicate=1,
                  micro_batch_size=st.mb, tp_comm_overlap=opts.tp_comm_overlap and st.tp > 1,
                  dp_comm_overlap=opts.dp_comm_overlap, ep_comm_overlap=opts.ep_comm_overlap and st.ep > 1,
                  pp_scatter_gather=st.pp_scatter_gather, compile=opts.compile)
    fields.update(extra)
    return ParallelLayout(**fields)


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
        sc = shared_costs(model, training, profile, _base_layout(st, opts), cache, opts.target)
        p2p_s = cache[p2p_key] = sc.p2p_s
        core = cache[core_key] = _structure_work(sc)
    elif p2p_s is None:  # the send alone: no layout to build (its group is the mesh's pipeline placement)
        group = placement(st.pp, st.tp * st.cp * st.dp, profile.gpus_per_node)
        p2p_s = cache[p2p_key] = pipeline_send_s(model, training, profile, group,
                                                 st.mb * (training.seq_length // st.cp), st.tp, st.pp_scatter_gather)
    (st.layer_times, st.emb_s, st.head_s, st.work_s, st.forward_work_s, st.forward_ratio,
     st.forward_ratio_min) = core
    st.p2p_s = p2p_s
    st.bound_s = st.m * (st.work_s / st.pp + 2 * st.p2p_s)


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


def _structure_work(sc: SharedCosts) -> tuple[list[float], float, float, float, float, float, float]:
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


def schedule_choices(st: Structure, model: ModelSpec, opts: SearchOptions, rules: Rules) -> list[tuple[Schedule, int]]:
    if st.pp == 1:
        return [(Schedule.one_f_one_b, 1)]
    out = []
    for sched in opts.schedules:
        if sched is Schedule.interleaved_1f1b:
            if st.m % st.pp:
                rules.remove(Rule.INTERLEAVED_MICRO_BATCHES, f"m={st.m}, pp={st.pp}")
                continue
            for v in range(2, opts.max_virtual_stages + 1):
                if st.pp * v > model.num_layers:
                    rules.remove(Rule.VIRTUAL_STAGES, f"pp={st.pp}, v={v}")
                    break
                out.append((sched, v))
        else:
            out.append((sched, 1))
    return out


def leaf_choices(
    st: Structure, opts: SearchOptions, rules: Rules | None = None
) -> tuple[tuple[int, int, int, bool, bool], ...]:
    """The per-schedule choices of a structure: (ZeRO stage, dp_replicate, dp_shard, offload,
    reshard after forward). ZeRO-0 replicates over all of dp; ZeRO >= 1 shards over every HSDP
    group size whose ranks (× cp × tp) can hold the folded expert groups; offload needs ZeRO >= 1."""
    out, removed = _leaf_choices(st.dp, st.cp, st.tp, st.ep, st.expert_tp, opts)
    if rules is not None and removed:
        rules.remove(Rule.FOLD_SHARD, f"ep={st.ep}, etp={st.expert_tp}", removed)
    return out


@functools.lru_cache(maxsize=4096)
def _leaf_choices(dp: int, cp: int, tp: int, ep: int, etp: int,
                  opts: SearchOptions) -> tuple[tuple[tuple[int, int, int, bool, bool], ...], int]:
    out, removed = [], 0
    for zero in opts.zero_stages:
        if zero == 0:
            splits = [(1, dp)]
        else:
            shards = divisors(dp) if opts.hsdp else [dp]
            splits = [(dp // d, d) for d in shards if expert_fold(d, cp, tp, ep, etp)[0] is None]
            removed += len(shards) - len(splits)
        for rep, shard in splits:
            for offload in ((False, True) if zero >= 1 and opts.offload else (False,)):
                for reshard in ((True, False) if zero == 3 else (True,)):
                    out.append((zero, rep, shard, offload, reshard))
    return tuple(out), removed  # cached: immutable


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
    compute = fwd + bwd
    if p == 1:
        return m * total
    minmax = max(minmax, total / p)
    if sched is Schedule.interleaved_1f1b:
        return (m - 1 / v) * minmax + total / v
    if sched is Schedule.zero_bubble:
        # m·T* + Σ_{i≠i*} f_i: every other rank's forward is at least the smallest forward share
        # ρ_min of its compute (recompute included), which sums to at least compute - T*; the
        # expression increases with T* (m >= 1 > ρ_min), so the lower bound of T* may stand in
        others = m * minmax + st.forward_ratio_min * max(0.0, compute - minmax)
        # the slowest rank's forward compute is at most ρ of its compute (ρ: the largest forward
        # share of any block, embedding or head; recompute only lowers it), which is at most
        # T* - 2vt: f* = fc* + vt + g* with g* its exposed forward collective. Every rank's forward
        # holds its own g_i, so Σ_{i≠i*} f_i = Σf - f* >= fwd + g* - f* = fwd - fc* - vt
        # >= fwd - ρ(T* - 2vt) - vt, and m·T* + Σ_{i≠i*} f_i >= (m - ρ)·T* + fwd + (2ρ - 1)·vt,
        # which grows with T* (m >= 1 > ρ): with or without collectives in the stages
        rho = st.forward_ratio
        return max((m - rho) * minmax + fwd + (2 * rho - 1) * v * st.p2p_s, others)
    return (m - 1) * minmax + total


@dataclass(frozen=True)
class _LeafLabel:
    """A leaf's name in messages, formatted only when one is shown (most leaves are pruned unnamed)."""

    family: str
    zero: int
    rep: int
    shard: int
    offload: bool

    def __str__(self) -> str:
        return (f"{self.family} zero{self.zero}" + (f" hsdp{self.rep}x{self.shard}" if self.rep > 1 else "")
                + (" offload" if self.offload else ""))


class _NoFitReason:
    """A family's reason "does not fit: ... GiB", formatted (and its memory priced) only when shown."""

    __slots__ = ("capacity", "need", "why")

    def __init__(self, need: float | Callable[[], float], why: str, capacity: float) -> None:
        self.need, self.why, self.capacity = need, why, capacity

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        if callable(self.need):
            self.need = self.need()
        return f"does not fit: {self.why} {self.need / GIB:.1f} GiB of {self.capacity / GIB:.1f} GiB"


@dataclass(order=True)
class Found:
    step_s: float
    order: int
    layout: ParallelLayout = field(compare=False)
    family: str = field(compare=False)
    status: str = field(compare=False)


def target_refusal(model: ModelSpec, training: TrainingConfig, target: str, layout: ParallelLayout,
                   micro_batches: int, scopes: tuple[str, ...] = targets.SCOPES) -> targets.TargetRefusal | None:
    """The first row of ``target``'s capability table (planner/targets.py) that refuses this layout."""
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
    """:func:`target_fallback`'s search, on a split the target does not refuse as such."""
    chunks = sm.default_chunks()
    most = max(len(r) for r in sm.rank_layers(chunks))
    best = None

    for kind in (Recompute.none, *RECOMPUTE_KINDS):
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
            if target_refusal(sm.model, sm.training, target, layout, micro_batches) is None:
                best = Uniform(step, layout, terms, [(kind, count)] * sm.p)
                break
        if best is not None and kind is Recompute.none:
            return best  # every recompute only adds time
    return best



def pessimistic_s(pred: Prediction) -> float:
    """The slow end of a prediction's step-time interval (the step time itself without one)."""
    return pred.interval.high_s if pred.interval is not None else pred.step_time_s


def rank_found(ranked: list[Found], preds: list[Prediction | None], robust: bool) -> tuple[list, list]:
    """Equally fast plans (to 1e-9) with the least memory per GPU first; ``robust``: by the slow end of
    each interval (a plan not predicted in full keeps its place behind those that are)."""
    fastest = ranked[0].step_s

    def key(i: int) -> tuple:
        pred = preds[i]
        nominal = round(ranked[i].step_s / fastest, 9)
        first = (pessimistic_s(pred) if pred is not None else math.inf) if robust else nominal
        return first, nominal, pred.memory.total_bytes if pred else math.inf, i

    order = sorted(range(len(ranked)), key=key)
    return [ranked[i] for i in order], [preds[i] for i in order]


def ties(pred: Prediction, best: Prediction) -> bool:
    """Whether two predictions' step-time intervals overlap (neither is surely faster)."""
    if pred.interval is None or best.interval is None:
        return False
    return pred.interval.low_s <= best.interval.high_s and best.interval.low_s <= pred.interval.high_s


def alternative(alt: Found, pred: Prediction | None, best: Found, best_pred: Prediction) -> Alternative:
    """An alternative and why it lost (or that it ties the best within the model's accuracy)."""
    if pred is None:
        return Alternative(layout=alt.layout, slower_by=alt.step_s / best.step_s - 1,
                           reason=f"{alt.step_s / best.step_s - 1:+.1%} step time; not predicted in "
                                  "full: the search's time budget was spent")
    reason = why_slower(pred, best_pred)
    if ties(pred, best_pred):
        reason += (f"; a tie within the model's accuracy: its {pred.interval.level:.0%} interval "
                   f"[{pred.interval.low_s:.3g}, {pred.interval.high_s:.3g}] s overlaps the best's "
                   f"[{best_pred.interval.low_s:.3g}, {best_pred.interval.high_s:.3g}] s")
    return Alternative(layout=alt.layout, prediction=pred, slower_by=pred.step_time_s / best_pred.step_time_s - 1,
                       reason=reason)


def frugal_layout(st: Structure, opts: SearchOptions, sched: Schedule, v: int,
                  training: TrainingConfig | None = None, profile: ClusterProfile | None = None) -> ParallelLayout:
    """The structure's leaf with the least activation memory per formula byte (ties: the highest ZeRO
    stage), fully sharded, offloaded; :func:`frugal_stage_model` lowers its states to every leaf's least."""
    zeros = sorted(opts.zero_stages, reverse=True)
    if training is not None and profile is not None:
        zeros.sort(key=lambda z: activation_factor(profile.assumptions, training, z))
    frugal_zero = zeros[0]
    return _base_layout(st, opts, dp_shard=st.dp, zero_stage=frugal_zero, schedule=sched, virtual_stages=v,
                        offload_optimizer=opts.offload and frugal_zero >= 1)


def frugal_stage_model(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, st: Structure,
                       opts: SearchOptions, sched: Schedule, v: int, cache: dict) -> StageModel:
    """A stage model holding no more than any leaf of ``st`` with schedule ``sched`` (memory bounds only)."""
    sm = StageModel(model, training, profile, frugal_layout(st, opts, sched, v, training, profile), block_cache=cache,
                    target=opts.target)
    return floor_states(sm, opts.zero_stages, opts.offload)


def interleaved_memory_floor(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, st: Structure,
                             opts: SearchOptions, depths: list[int], cache: dict) -> float:
    """A lower bound of the frugal memory min-max stage (``memory_minmax_s`` of :func:`frugal_layout`,
    without ZeRO-3 gather buffers) of every interleaving depth in ``depths`` at once.

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
        sm = frugal_stage_model(model, training, profile, st, opts, Schedule.interleaved_1f1b, min(depths), cache)
    except AutoparError:
        return 0.0
    flights = [[microbatches_in_flight(Schedule.interleaved_1f1b, r, st.pp, st.m, d) for r in range(st.pp)]
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
        out.append(LeafComm.of(sm.profile, sm.training, lambda: lay, key, lay.offload_optimizer,
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


_gc_lock = threading.Lock()
_gc_state: dict = {"searches": 0, "thresholds": None}
SEARCH_GC_GEN0 = 50_000  # allocations between young-generation collections while searches run (CPython's default: 700)


@contextlib.contextmanager
def gc_relaxed() -> Iterator[None]:
    """Python's cyclic garbage collector made rarer while searches run (its thresholds restored when
    the last one ends).

    A search allocates millions of short-lived tuples and floats. At CPython's default threshold
    every 700 net allocations start a young-generation collection, and the older generations'
    passes walk every cached cost and layout besides: on DeepSeek-V3 / 2,048 GPUs ~450 collections,
    0.25-0.3 s of a ~2.1 s search (2 vCPUs). At 50,000 it is ~4 collections. The collector is never
    switched off: in the service, other requests keep making cyclic garbage (sessions, tracebacks)
    while searches run back to back, and it is still collected. Counted, not nested naively:
    overlapping searches (the service's worker threads) keep the raised threshold until the last
    one leaves.
    """
    with _gc_lock:
        if _gc_state["searches"] == 0:
            _gc_state["thresholds"] = gc.get_threshold()
            gen0, *older = _gc_state["thresholds"]
            gc.set_threshold(max(gen0, SEARCH_GC_GEN0), *older)
        _gc_state["searches"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["searches"] -= 1
            if _gc_state["searches"] == 0:
                gc.set_threshold(*_gc_state["thresholds"])


def search(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile,
           options: SearchOptions | None = None, progress=None) -> Plan:  # noqa: ANN001 - rich progress callback
    """The fastest layout that fits, with the top-k alternatives and why the rest lost. The time
    budget (``options.time_budget_s``) covers every phase: listing and bounding the layouts, pricing,
    solving, and the alternatives' predictions and explanations, which are left out once it is spent."""
    t0 = time.perf_counter()
    check_sequence(model, training)  # no layout could run it: say why, not "no layout could be evaluated"
    options = options or SearchOptions()
    profile = targets.priced_profile(profile, options.target, training.precision)  # its expert GEMMs (TargetFacts)
    # thousands of layouts share a few thousand GEMM shapes and link lookups
    with gc_relaxed(), memoised(profile):
        return _search(model, training, profile, options, progress, t0)


def _search(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, opts: SearchOptions,
            progress, t0: float | None = None) -> Plan:  # noqa: ANN001
    """:func:`search` inside its memo; ``t0``: when the search (and its budget) started, default now."""
    run = _SearchState(model, training, profile, opts, progress, time.perf_counter() if t0 is None else t0)
    run.seed()
    run.price_structures()
    run.solve_pending()
    return run.plan()


class _SearchState:
    """One search's shared state and its phases.

    Structures are taken in the order of their bound ``bound_s`` (ties: the order of
    ``structures``), but priced lazily: a heap holds each unpriced structure under a cheap floor
    of its bound (``structure_floor`` <= ``bound_s``) and a priced one under ``bound_s``; an
    unpriced structure at the top is priced and pushed back. A floor is at most its bound, so a
    priced (b, i) reaches the top only after every structure whose (bound, index) precedes it:
    the order is exactly that of sorting by ``bound_s``. Once the top is at the k-th best, every
    structure left is pruned by its bound unpriced (most of them: their block costs are never computed).

    ``results``: per leaf id its best known solution; ``values``: the sorted step times of every
    priced leaf (the k-th is the pruning cutoff); ``families``: per family its members, best and
    reason; ``report``: the search's counters; ``pending``: the leaves left for CP-SAT.
    """

    def __init__(self, model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, opts: SearchOptions,
                 progress, t0: float) -> None:
        self.model, self.training, self.profile, self.progress, self.t0 = model, training, profile, progress, t0
        self.deadline = t0 + opts.time_budget_s
        self.rules = Rules()
        if opts.offload and not any(link.level is LinkLevel.host_device for link in profile.links):
            # nothing to price the optimizer-state copies with: offload is not a choice on this profile
            opts = dataclasses.replace(opts, offload=False)
            self.rules.remove(Rule.OFFLOAD_LINK,
                              f"profile '{profile.name}'")
        self.opts = opts
        targets.check(opts.target, targets.Job(model, training, ParallelLayout()), ("model",))  # nothing could run
        if opts.compile:  # a target that compiles nothing refuses every leaf: say so once
            refused = targets.refusal(opts.target, targets.Job(model, training, ParallelLayout(compile=True)),
                                      ("layout",))
            if refused is not None and refused.limit.field == "layout.compile":
                raise refused
        self.spec = targets.TARGETS[targets.Target(opts.target)]
        self.master_in_param = self.spec.facts.master_in_param  # the target's model states (TargetFacts)
        self.cache: dict = {}
        self.structs = structs = structures(model, training, profile, opts, self.rules, self.deadline)
        if not structs:
            raise AutoparError("cluster", f"{profile.num_gpus} GPUs",
                               "change the GPU count, global batch or sequence length so that some layout divides them",
                               problem="admits no layout: "
                               + "; ".join(f"{r} ({n}x)" for r, n in self.rules.counts.items()))
        self.heap = [(floor, i, False) for i, floor
                     in enumerate(structure_floors(structs, model, training, profile, opts, self.cache, self.deadline))]
        heapq.heapify(self.heap)
        self._init_memory()
        self._init_tallies()
        for _, i, _ in sorted(self.heap):
            self.families.setdefault(structs[i].family, {"members": 0, "best": None, "reason": ""})

    def _init_memory(self) -> None:
        """The model's parameter totals and what a GPU may hold."""
        model, training = self.model, self.training
        self.state = state_bytes_per_param(training)
        self.all_params_dense = (sum(layer_params(model, i)[0] for i in range(model.num_layers))
                                 + embedding_params(model) + lm_head_params(model))
        self.all_params_expert = sum(layer_params(model, i)[1] for i in range(model.num_layers))
        a = self.profile.assumptions
        self.capacity = usable_bytes(self.profile.device.memory_bytes, a)  # every need below is a whole device's total
        # what every layout holds beside its model states, at least: the runtime, the reserve, the least fragmentation
        self.reserved = float(a.runtime_bytes + a.reserved_memory_bytes)
        self.least_frag = 1.0 + min(a.allocator_fragmentation, a.sharded_fragmentation)

    def _init_tallies(self) -> None:
        """The results, counters and memo caches the phases share."""
        self.results: dict[int, Found] = {}  # leaf id -> best known solution
        self.values: list[float] = []  # sorted step times of every priced leaf
        self.families: dict[str, dict] = {}
        self.report = dict(considered=0, dominated=0, pruned=0, infeasible=0, evaluated=0, solved=0, closed=0)
        self.status_counts: dict[str, int] = defaultdict(int)
        self.shortfall: list = [math.inf, "", -1]  # gap, leaf, order of the no_fit call
        self.pending: list[tuple] = []
        # (order, need, label), priced if nothing fits
        self.lazy_needs: list[tuple[int, Callable[[], float], _LeafLabel]] = []
        self.no_fits = iter(range(1 << 60))
        self.priced: set[tuple] = set()
        # per leaf, its ranks' micro-batches and minmax: [recompute bound, memory min-max]
        self.leaf_memory: dict[tuple, list] = {}
        # model-state bytes per GPU by (tp, pp, ep, etp, zero, shard, offload)
        self.states_need: dict[tuple, float] = {}
        self.per_param: dict[tuple, tuple[float, float, bool]] = {}
        self.ids = iter(range(1, 1 << 60))
        self.prefix_ok: bool | None = None
        self.budget_hit = False
        self.minmax_of: dict[int, float] = {}
        self.scheds_of: dict[tuple[int, int], tuple[list, list]] = {}  # per (pp, m): schedule_choices and its removals
        self.leaves_of: dict[tuple, tuple[tuple, int]] = {}  # per (dp, cp, tp, ep, etp): leaf_choices
        # per structure and ranks' micro-batches: (rec_min, stage_min)
        self.frugal_of: dict[tuple, tuple[float, float]] = {}
        self.interleaved_floor_of: dict[int, float] = {}  # per structure: memory min-max under any interleaving depth
        self.tails_of: dict[tuple, tuple[list[float | None], float]] = {}  # per (tp, cp, pp, dp, ep, etp): tail bounds
        # (structure, its bound: bound_s, or a floor if left unpriced; priced?)
        self.ordered: list[tuple[Structure, float, bool]] = []

    # ------------------------------------------------------------------ shared bookkeeping
    def over_budget(self) -> bool:
        return time.perf_counter() > self.deadline

    def kth(self) -> float:
        values, k = self.values, self.opts.top_k
        return values[k - 1] if len(values) >= k else math.inf

    def record(self, leaf: int, step: float, layout: ParallelLayout, st: Structure, status: str,
               sm: StageModel | None = None) -> None:
        """Keep ``step`` as leaf's solution if it is its best (a layout the target refuses: its fallback)."""
        opts = self.opts
        refused = target_refusal(self.model, self.training, opts.target, layout, st.m)
        if refused is not None:  # a split or recompute the target cannot run: its even split, one choice
            legal = target_fallback(sm, opts.target, st.m) if sm is not None else None
            if legal is None:
                self.rules.remove(Rule.TARGET, str(refused), target=opts.target, feature=refused.feature)
                return
            step, layout = legal.step_s, legal.layout
            status = f"{status.split(' ')[0]} ({opts.target}: even split, one recompute choice)"
        old = self.results.get(leaf)
        if old is not None:
            if step >= old.step_s:
                old.status = status
                return
            del self.values[bisect.bisect_left(self.values, old.step_s)]
        bisect.insort(self.values, step)
        item = Found(step, leaf, layout, st.family, status)
        self.results[leaf] = item
        fam = self.families[st.family]
        if fam["best"] is None or step < fam["best"].step_s:
            fam["best"] = item

    def no_fit(self, st: Structure, need: float | Callable[[], float], label: _LeafLabel, why: str) -> None:
        """Count a leaf that does not fit. ``need`` may be a function (a stage model's memory on a
        split, which takes pricing): it is called only if the shortfall or the family's reason is shown."""
        self.report["infeasible"] += 1
        order = next(self.no_fits)
        if callable(need):
            self.lazy_needs.append((order, need, label))
        elif need - self.capacity < self.shortfall[0]:
            self.shortfall[:] = [need - self.capacity, str(label), order]
        fam = self.families[st.family]
        if not fam["reason"]:
            fam["reason"] = _NoFitReason(need, why, self.capacity)

    def states_need_of(self, st: Structure, zero: int, shard: int, offload: bool) -> float:
        """Bytes per GPU of the model states (and the reserve) of a stage holding the average parameters."""
        shard_n = shard * st.cp
        key = (st.tp, st.pp, st.ep, st.expert_tp, zero, shard_n, offload)
        need = self.states_need.get(key)
        if need is None:
            dense = self.all_params_dense / (st.tp * st.pp)
            expert = self.all_params_expert / (st.expert_tp * st.ep * st.pp)
            state = self.state
            need = self.states_need[key] = self.reserved + self.least_frag * (
                sum(model_state_bytes(dense, state, zero, shard_n, offload, self.master_in_param))
                + sum(model_state_bytes(expert, state, zero, expert_fold(shard, st.cp, st.tp, st.ep, st.expert_tp)[1],
                                        offload, self.master_in_param)))
        return need

    def states_per_param(self, st: Structure, zero: int, shard: int, offload: bool) -> tuple[float, float, bool]:
        """(dense, expert) model-state bytes per parameter on a GPU, and whether ZeRO-3 gathers blocks:
        what a leaf's memory bounds see of its data-parallel choice (as StageModel computes them)."""
        key = (st.cp, st.tp, st.ep, st.expert_tp, zero, shard, offload)
        sig = self.per_param.get(key)
        if sig is None:
            expert_shard = expert_fold(shard, st.cp, st.tp, st.ep, st.expert_tp)[1]
            sig = self.per_param[key] = (*state_bytes_per_param_split(self.state, zero, shard * st.cp, expert_shard,
                                                                      offload, self.master_in_param), zero == 3)
        return sig

    def leaf_comm(self, st: Structure, zero: int, rep: int, shard: int, offload: bool, reshard: bool) -> LeafComm:
        """The leaf's data-parallel side (it does not depend on the schedule; memoised)."""
        opts = self.opts

        def make_layout() -> ParallelLayout:
            return _base_layout(st, opts, dp_replicate=rep, dp_shard=shard, zero_stage=zero, offload_optimizer=offload,
                                reshard_after_forward=reshard)

        return LeafComm.of(self.profile, self.training, make_layout,
                           (zero, shard, rep, st.cp, st.tp, st.ep, st.expert_tp), offload,
                           reshard, opts.dp_comm_overlap, self.all_params_dense / (st.tp * st.pp),
                           self.all_params_expert / (st.expert_tp * st.ep * st.pp), self.cache, pp=st.pp)

    # ------------------------------------------------------------------ one leaf
    def price_leaf(self, si: int, st: Structure, sched: Schedule, v: int, minmax: float, rec_min: float, zero: int,
                   rep: int, shard: int, offload: bool, reshard: bool) -> None:
        """Bound one leaf, cheapest test first; price it on the default split, queue it for CP-SAT.
        ``minmax``: the v=1 contiguous min-max stage (0 for interleaved); ``rec_min``: recompute
        that memory forces on every leaf of this schedule."""
        key = (si, sched, v, zero, rep, shard, offload, reshard)
        if key in self.priced:
            return
        self.priced.add(key)
        opts, report = self.opts, self.report
        label = _LeafLabel(st.family, zero, rep, shard, offload)
        need = self.states_need_of(st, zero, shard, offload)
        if need > self.capacity:
            self.no_fit(st, need, label, "model states alone need")
            return

        def make_layout() -> ParallelLayout:
            return _base_layout(st, opts, dp_replicate=rep, dp_shard=shard, zero_stage=zero, offload_optimizer=offload,
                                reshard_after_forward=reshard, schedule=sched, virtual_stages=v)

        refused = target_refusal(self.model, self.training, opts.target, make_layout(), st.m, ("layout",))
        if refused is not None:
            self.rules.remove(Rule.TARGET, str(refused), target=opts.target, feature=refused.feature)
            return
        comm = self.leaf_comm(st, zero, rep, shard, offload, reshard)
        if leaf_bound(st, sched, v, minmax, rec_min, comm) >= self.kth():
            report["pruned"] += 1
            return
        if self.over_budget():
            self.budget_hit = True
            report["pruned"] += 1
            return
        # the memory bounds depend on the micro-batches each rank holds, not on how the schedule
        # orders them: 1F1B and zero-bubble leaves share them (their ranks hold p - r); and on the
        # data-parallel choice only through the model-state bytes per parameter and whether ZeRO-3
        # gathers (the structure fixes the groups, the blocks' times and activations): leaves
        # equal in those share them (ZeRO-3 with and without resharding, ZeRO-0 and -1 unsharded, ...)
        # the memory bounds read the leaf's whole data-parallel choice: states per parameter, and by ZeRO stage
        # the activation factor, fragmentation, held and gathered weights; by replication the communicators
        mem_key = (si, SCHEDULES[sched].in_flight, v,
                   self.states_per_param(st, zero, shard, offload), zero, rep, reshard or zero < 3, minmax)
        bounded = self._memory_bound(st, sched, v, minmax, comm, label, make_layout, mem_key)
        if bounded is not None:
            self._price_default(st, *bounded, label, (sched, v, comm))

    def _build(self, make_layout: Callable[[], ParallelLayout]) -> StageModel | None:
        """The leaf's stage model; a layout it rejects is counted under its rule (None)."""
        try:
            return StageModel(self.model, self.training, self.profile, make_layout(), block_cache=self.cache,
                              target=self.opts.target)
        except AutoparError as err:
            self.rules.remove(Rule.CONTRACT, str(err), field=err.field, problem=err.problem)
            return None

    def _memory_bound(self, st: Structure, sched: Schedule, v: int, minmax: float, comm: LeafComm, label: _LeafLabel,
                      make_layout: Callable[[], ParallelLayout], mem_key: tuple) -> tuple | None:
        """The leaf's bound with the recompute and slowest rank its memory forces: (stage model, bound,
        slowest rank's f + b at least, recompute bound), or None when the bound prunes it or it does not fit."""
        sm = None
        bounds = self.leaf_memory.get(mem_key)
        if bounds is None:
            sm = self._build(make_layout)
            if sm is None:
                return None
            bounds = self.leaf_memory[mem_key] = [recompute_bound_s(sm), None]
        rec_s = bounds[0]
        lb = leaf_bound(st, sched, v, minmax, rec_s, comm)
        if lb >= self.kth():
            self.report["pruned"] += 1
            return None
        if sm is None:
            sm = self._build(make_layout)
            if sm is None:
                return None
        stage_lb = minmax  # the slowest rank's f + b, at least
        if st.pp > 1:
            # the slowest rank once every rank fits its own memory (recompute where it must)
            if bounds[1] is None:
                bounds[1] = memory_minmax_s(sm, minmax)
            mem_stage = bounds[1]
            if not math.isfinite(mem_stage):
                self.no_fit(st, lambda sm=sm: sm.min_memory(sm.default_chunks()), label,
                            "needs, on the default split with full recompute,")
                return None
            if mem_stage > minmax:
                stage_lb = mem_stage
                lb = leaf_bound(st, sched, v, mem_stage, rec_s, comm)
                if lb >= self.kth():
                    self.report["pruned"] += 1
                    return None
        return sm, lb, stage_lb, rec_s

    def _price_default(self, st: Structure, sm: StageModel, lb: float, stage_lb: float, rec_s: float,
                       label: _LeafLabel, leaf: tuple) -> None:
        """Price an unpruned leaf (``leaf``: its schedule, depth and data-parallel side) on the default
        split; one that meets its bound there is closed, the rest are queued for CP-SAT."""
        sched, v, comm = leaf
        self.report["evaluated"] += 1
        leaf_id = next(self.ids)
        if self.prefix_ok is None:
            self.prefix_ok = layer_kind_prefix(sm) is not None
        if st.pp == 1:
            self._price_single_stage(leaf_id, st, sm, label)
            return
        chunks = sm.default_chunks()
        refused = None
        if not self.spec.per_stage_recompute:  # one choice for every stage: its best, not per-rank choices
            greedy, refused = self._uniform_default(sm, st)
        else:
            greedy = sm.greedy(chunks)
        if greedy is not None and target_refusal(self.model, self.training, self.opts.target,
                                                 sm.layout_for(chunks, greedy[2]), st.m) is not None:
            # per-rank choices the target cannot run: its own best on the default split stands in, and
            # CP-SAT (restricted as the target is) settles the leaf
            self.record(leaf_id, greedy[0], sm.layout_for(chunks, greedy[2]), st, "FEASIBLE (default split)", sm)
            greedy = None
        if greedy is not None:
            met = greedy[0] <= lb * (1 + 1e-9)
            self.record(leaf_id, greedy[0], sm.layout_for(chunks, greedy[2]), st,
                        "OPTIMAL (bound)" if met else "FEASIBLE (default split)", sm)
            if met:
                self.report["closed"] += 1
                return
        if self.prefix_ok:
            slowest = max(t.forward_s + t.backward_s for t in greedy[1]) if greedy else math.inf
            self.pending.append((lb, leaf_id, sm, st, label, greedy[0] if greedy else None, chunks,
                                 (sched, v, stage_lb, rec_s, comm, slowest)))
        elif greedy is None and leaf_id not in self.results and refused is None:
            self.no_fit(st, lambda sm=sm, chunks=chunks: sm.min_memory(chunks), label,
                        "needs, even with full recompute,")

    def _uniform_default(self, sm: StageModel, st: Structure) -> tuple[tuple | None, object]:
        """(the target's best uniform recompute choice on the default split as (step, terms, per-rank choices),
        or None; the target's refusal where it refuses that split whatever the recompute, recorded as a rule)."""
        target = self.opts.target
        refused = default_split_refusal(sm, target, st.m)
        if refused is not None:
            self.rules.remove(Rule.TARGET, str(refused), target=target, feature=refused.feature)
            return None, refused
        uniform = best_uniform(sm, target, st.m)
        return (None if uniform is None else (uniform.step_s, uniform.terms, uniform.recompute)), None

    def _price_single_stage(self, leaf_id: int, st: Structure, sm: StageModel, label: _LeafLabel) -> None:
        """One stage: no split to choose; per kind, the fewest recomputed layers that fit."""
        layers = self.model.num_layers
        best = None
        for kind, count in sm.fewest_recomputed(layers):
            val, terms = sm.evaluate([layers], [(kind, count)])
            if sm.fits(terms) and (best is None or val < best[0]):
                best = (val, kind, count)
        if best is None:
            self.no_fit(st, lambda sm=sm: sm.min_memory([layers]), label, "needs, even with full recompute,")
            return
        self.record(leaf_id, best[0], sm.layout_for([layers], [(best[1], best[2])]), st, "OPTIMAL (enumerated)", sm)
        self.report["closed"] += 1

    # ------------------------------------------------------------------ structures in bound order
    def minmax_for(self, si: int) -> float:
        if si not in self.minmax_of:
            self.minmax_of[si] = min_max_stage(self.ordered[si][0])
        return self.minmax_of[si]

    def reach(self, si: int, force: bool = False) -> tuple[Structure, float, bool] | None:
        """The si-th structure in bound order, pricing it (and any whose floor is below it) unless
        its floor is already at the k-th best or the time budget is spent (``force``: regardless)."""
        heap, ordered = self.heap, self.ordered
        while len(ordered) <= si:
            if not heap:
                return None
            key, i, exact = heap[0]
            if not exact and (force or (key < self.kth() and not self.budget_hit)):
                st = self.structs[i]
                price_structure(st, self.model, self.training, self.profile, self.opts, self.cache)
                heapq.heapreplace(heap, (st.bound_s, i, True))
                continue
            heapq.heappop(heap)
            ordered.append((self.structs[i], key, exact))
        return ordered[si]

    def seed(self) -> None:
        """One plain leaf (1F1B or single stage, ZeRO-1, no offload) of the most promising
        structures, so the bound prunes from the start."""
        opts = self.opts
        seed_zero = 1 if 1 in opts.zero_stages else opts.zero_stages[0]
        for si in range(SEED_STRUCTURES):
            if self.reach(si, force=True) is None:  # the seeds are priced whatever the k-th best
                break
            st = self.ordered[si][0]
            sched = Schedule.one_f_one_b if Schedule.one_f_one_b in opts.schedules or st.pp == 1 else opts.schedules[0]
            if sched is Schedule.interleaved_1f1b:
                continue
            self.price_leaf(si, st, sched, 1, self.minmax_for(si), 0.0, seed_zero, 1, st.dp, False, True)

    def _choices(self, st: Structure) -> tuple[tuple, tuple]:
        """The structure's (schedules, their rule removals) and (leaves, leaves removed), memoised per
        (pp, m) and (dp, cp, tp, ep, etp) (hashing the options on every call costs more than the choices)."""
        sched_key, leaves_key = (st.pp, st.m), (st.dp, st.cp, st.tp, st.ep, st.expert_tp)
        if sched_key not in self.scheds_of:  # depends on (pp, m) only: its rule removals are replayed
            sub = Rules()
            self.scheds_of[sched_key] = (schedule_choices(st, self.model, self.opts, sub), sub)
        if leaves_key not in self.leaves_of:
            self.leaves_of[leaves_key] = _leaf_choices(*leaves_key, self.opts)
        return self.scheds_of[sched_key], self.leaves_of[leaves_key]

    def drain(self, si: int) -> None:
        """Every structure from the si-th on, all pruned by their bound (the top of the heap is at the
        k-th best, or the time budget is spent): counted as :meth:`price_structures` counts them, in the
        same order, without pricing them; the rule removals summed per (pp, m, dp, cp, tp, ep, etp) and replayed in
        order of first appearance (the same counts, first examples and rule order)."""
        rest = [self.ordered[si]] + [(self.structs[i], key, exact) for key, i, exact in sorted(self.heap)]
        self.heap.clear()
        repeats: dict[tuple, int] = {}
        why = f" is no better than the top {self.opts.top_k}"
        for n, (st, st_bound, exact) in enumerate(rest, start=si):
            if self.progress:
                self.progress(n, len(self.structs))
            (scheds, _), (leaves, _) = self._choices(st)
            key = (st.pp, st.m, st.dp, st.cp, st.tp, st.ep, st.expert_tp)
            repeats[key] = repeats.get(key, 0) + 1
            count = len(leaves) * len(scheds)
            fam = self.families[st.family]
            fam["members"] += count
            self.report["considered"] += count
            self.report["pruned"] += count
            if not fam["reason"]:
                fam["reason"] = (f"lower bound {st_bound:.3f} s (its work spread evenly)" if exact else
                                 f"lower bound {st_bound:.3f} s (its GEMMs, attention and collectives spread "
                                 "evenly)") + why
        for (pp, m, dp, cp, tp, ep, etp), times in repeats.items():
            self.rules.merge(self.scheds_of[(pp, m)][1], times)
            removed = self.leaves_of[(dp, cp, tp, ep, etp)][1]
            if removed:
                self.rules.remove(Rule.FOLD_SHARD, f"ep={ep}, etp={etp}", removed * times)

    # ------------------------------------------------------------------ phase A
    def price_structures(self) -> None:
        """Phase A: price every leaf that its bound does not rule out, on the default split."""
        for si in range(len(self.structs)):
            if self.over_budget():
                self.budget_hit = True
            st, st_bound, _ = self.reach(si)
            if st_bound >= self.kth() or self.budget_hit:
                # the heap's top is at the k-th best (or the budget is spent): it and all after it are pruned
                self.drain(si)
                break
            if self.progress:
                self.progress(si, len(self.structs))
            self._price_structure(si, st)

    def _price_structure(self, si: int, st: Structure) -> None:
        """Every schedule of one structure that its bounds do not rule out, and their leaves."""
        report = self.report
        (scheds, sched_removed), (leaves, removed) = self._choices(st)
        self.rules.merge(sched_removed)
        if removed:
            self.rules.remove(Rule.FOLD_SHARD, f"ep={st.ep}, etp={st.expert_tp}", removed)
        per_sched = len(leaves)
        self.families[st.family]["members"] += per_sched * len(scheds)
        report["considered"] += per_sched * len(scheds)
        minmax = self.minmax_for(si)
        # per leaf, its schedule-free tail bound (None: its model states alone do not fit, which
        # price_leaf reports), and the least of them: a floor every leaf's tail stands on; computed
        # once the first schedule survives its own bound
        tails: list[float | None] = []
        tail_min = 0.0
        for sched, v in scheds:
            if sched is Schedule.gpipe and Schedule.one_f_one_b in self.opts.schedules:
                report["dominated"] += per_sched  # GPipe: the step time of 1F1B with more micro-batches in flight
                continue
            stage_min = minmax if v == 1 else 0.0
            plain = schedule_bound(st, sched, v, stage_min)
            if plain >= self.kth():
                report["pruned"] += per_sched
                continue
            if not tails:
                tails, tail_min = self._tails(st, leaves)
            if plain + tail_min >= self.kth():
                report["pruned"] += per_sched
                continue
            if sched is Schedule.interleaved_1f1b and st.pp > 1 and not self._interleaved_may_fit(si, st, scheds, v,
                                                                                                  per_sched, tail_min):
                continue
            self._price_schedule(si, st, sched, v, stage_min, leaves, tails, tail_min)

    def _tails(self, st: Structure, leaves: tuple) -> tuple[list[float | None], float]:
        """Per leaf its schedule-free tail bound (None: its model states alone do not fit) and the least
        of them; they depend on the groups and the pipeline depth, not on sp or the micro-batch."""
        tails_key = (st.tp, st.cp, st.pp, st.dp, st.ep, st.expert_tp)
        if tails_key not in self.tails_of:
            found = [leaf_tail_bound(self.leaf_comm(st, zero, rep, shard, offload, reshard))
                     if self.states_need_of(st, zero, shard, offload) <= self.capacity else None
                     for zero, rep, shard, offload, reshard in leaves]
            self.tails_of[tails_key] = (found, min((t for t in found if t is not None), default=0.0))
        return self.tails_of[tails_key]

    def _interleaved_may_fit(self, si: int, st: Structure, scheds: list, v: int, per_sched: int,
                             tail_min: float) -> bool:
        """One memory bound for every interleaving depth of this structure before one per depth:
        whether depth ``v``'s leaves survive it (those that do not are counted)."""
        sched = Schedule.interleaved_1f1b
        if si not in self.interleaved_floor_of:
            self.interleaved_floor_of[si] = interleaved_memory_floor(
                self.model, self.training, self.profile, st, self.opts, [d for s, d in scheds if s is sched],
                self.cache)
        floor_stage = self.interleaved_floor_of[si]
        if not math.isfinite(floor_stage):
            self.report["infeasible"] += per_sched  # no split of any of its leaves fits, at any depth
            return False
        if schedule_bound(st, sched, v, floor_stage) + tail_min >= self.kth():
            self.report["pruned"] += per_sched
            return False
        return True

    def _price_schedule(self, si: int, st: Structure, sched: Schedule, v: int, stage_min: float, leaves: tuple,
                        tails: list, tail_min: float) -> None:
        """The leaves of one (structure, schedule) that the frugal leaf's bound does not rule out."""
        report, per_sched = self.report, len(leaves)
        # the recompute and the slowest rank that memory forces even on the leaf with the least
        # state memory (highest ZeRO stage, fully sharded, offloaded) bound every leaf of this schedule
        frugal_key = (si, SCHEDULES[sched].in_flight, v,
                      stage_min)  # as for the leaves: 1F1B and zero-bubble ranks hold the same
        if frugal_key in self.frugal_of:
            rec_min, stage_min = self.frugal_of[frugal_key]
        else:
            try:
                frugal_sm = frugal_stage_model(self.model, self.training, self.profile, st, self.opts, sched, v,
                                               self.cache)
                rec_min = recompute_bound_s(frugal_sm)
                if st.pp > 1:
                    # (without ZeRO-3's gather buffer, which the lower ZeRO stages do not hold)
                    stage_min = max(stage_min, memory_minmax_s(frugal_sm, stage_min, gather_buffers=False))
            except AutoparError:
                rec_min = 0.0
            self.frugal_of[frugal_key] = (rec_min, stage_min)
        if not math.isfinite(stage_min):
            report["infeasible"] += per_sched  # no split of any of its leaves fits, at any speed
            return
        base = schedule_bound(st, sched, v, stage_min, rec_min)
        if base + tail_min >= self.kth():
            report["pruned"] += per_sched
            return
        for (zero, rep, shard, offload, reshard), tail in zip(leaves, tails):
            if tail is not None and base + tail >= self.kth():
                report["pruned"] += 1  # leaf_bound would be at least this
                continue
            self.price_leaf(si, st, sched, v, stage_min, rec_min, zero, rep, shard, offload, reshard)

    # ------------------------------------------------------------------ phase B
    def solve_pending(self) -> None:
        """Phase B: CP-SAT on the leaves whose bound can still beat the k-th best, best bound first."""
        self.pending.sort(key=lambda x: (x[0], x[1]))
        for lb, leaf, sm, st, label, greedy_val, chunks, bounds in self.pending:
            if lb >= self.kth():
                self.report["pruned"] += 1
                continue
            if self.over_budget():
                self.budget_hit = True
                continue
            cutoff = min(greedy_val if greedy_val is not None else math.inf, self.kth())
            if math.isfinite(bounds[-1]) and self._split_settles(sm, st, cutoff, bounds):
                if cutoff == greedy_val:  # the default split is this leaf's optimum
                    self.record(leaf, greedy_val, self.results[leaf].layout, st, "OPTIMAL")
                    self.report["closed"] += 1
                else:
                    self.report["pruned"] += 1
                continue
            self._solve(leaf, sm, st, label, greedy_val, chunks, cutoff)

    def _split_settles(self, sm: StageModel, st: Structure, cutoff: float, bounds: tuple) -> bool:
        """Before proving it with CP-SAT: every split with each rank at its fastest recompute that fits
        (SplitBound): two ranks, each split's (interleaved: each holding's) step bound; deeper (v = 1), the
        slowest rank of a contiguous split in the leaf bound. A bound at the cutoff settles the leaf as
        CP-SAT's INFEASIBLE would: nothing beats the k-th best, or the default split."""
        sched, v, stage_lb, rec_s, comm, slowest = bounds
        split = SplitBound(sm)
        if st.pp == 2:
            return split.two_rank_step_s(cutoff) >= cutoff
        split_stage = split.minmax_s(stage_lb, slowest) if v == 1 else split.holding_minmax_s(stage_lb, slowest)
        return leaf_bound(st, sched, v, split_stage, rec_s, comm, pigeonhole_comms(sm, self.cache)) >= cutoff

    def _solve(self, leaf: int, sm: StageModel, st: Structure, label: _LeafLabel, greedy_val: float | None,
               chunks: list, cutoff: float) -> None:
        """CP-SAT on one leaf's split and per-stage recompute, below ``cutoff``; its outcome recorded. No
        solution hint: with the default split and greedy recompute as a hint, one CP-SAT worker stopped at
        FEASIBLE on zero-bubble leaves it proves OPTIMAL in 0.01 s without (12 benchmark and test searches:
        2.58 s of CP-SAT with hints, 0.53 s without, the same plans)."""
        opts = self.opts
        self.report["solved"] += 1
        sol = solve_stages(sm,
                           time_limit_s=min(opts.solver_time_limit_s, max(self.deadline - time.perf_counter(), 0.01)),
                           workers=opts.workers,
                           upper_bound_s=cutoff if math.isfinite(cutoff) else None,
                           even_split=not self.spec.uneven_split, uniform_recompute=not self.spec.per_stage_recompute)
        self.status_counts[sol.status] += 1
        if sol.chunks:
            val = sm.evaluate(sol.chunks, sol.recompute)[0]
            self.record(leaf, val, sm.layout_for(sol.chunks, sol.recompute), st, sol.status, sm)
        elif sol.status == "INFEASIBLE":
            if greedy_val is None:
                if not math.isfinite(cutoff):
                    self.no_fit(st, lambda sm=sm, chunks=chunks: sm.min_memory(chunks), label,
                                "needs, on the default split with full recompute,")
            elif cutoff == greedy_val:
                # nothing beats the default split
                self.record(leaf, greedy_val, self.results[leaf].layout, st, "OPTIMAL")
        elif greedy_val is not None:
            self.record(leaf, greedy_val, self.results[leaf].layout, st,
                        f"FEASIBLE (CP-SAT {sol.status} in its time limit)")

    # ------------------------------------------------------------------ the plan
    def _nothing_found(self) -> AutoparError:
        """Why no plan was found: the budget ran out, or the closest leaf's memory shortfall."""
        report, shortfall = self.report, self.shortfall
        if self.budget_hit:
            return out_of_time(self.opts, "before any layout that fits was priced "
                                          f"({report['considered']:,} candidates considered, "
                                          f"{report['infeasible']:,} shown not to fit)")
        for order, need, label in self.lazy_needs:  # the first smallest gap, as if priced when found
            if self.over_budget() and math.isfinite(shortfall[0]):
                break  # the closest seen so far stands for the rest
            gap = need() - self.capacity
            if gap < shortfall[0] or (gap == shortfall[0] and order < shortfall[2]):
                shortfall[:] = [gap, str(label), order]
        return _nothing_fits(self.model, self.training, self.profile, shortfall, report)

    def plan(self) -> Plan:
        """The fastest plan found, its alternatives (predicted while the budget lasts), the families' outcomes
        and the search report."""
        model, training, profile, opts, report = self.model, self.training, self.profile, self.opts, self.report
        ranked = sorted(self.results.values())[: opts.top_k]
        if not ranked:
            raise self._nothing_found()
        # the fastest is predicted in full; the alternatives while the budget lasts
        preds = [predict(model, training, profile, found.layout, target=opts.target) if i == 0 or not self.over_budget()
                 else None for i, found in enumerate(ranked)]
        ranked, preds = rank_found(ranked, preds, opts.robust)
        best, best_pred = ranked[0], preds[0]
        alternatives = [alternative(alt, pred, best, best_pred) for alt, pred in zip(ranked[1:], preds[1:])]
        if any(a.prediction is not None and ties(a.prediction, best_pred) for a in alternatives):
            best_pred = best_pred.model_copy(update={"notes": [*best_pred.notes, (
                "an alternative's step-time interval overlaps this plan's: the cost model cannot tell them apart "
                "(see each alternative's reason)")]})
        fam_out = self._family_outcomes(best, best_pred)
        wall = time.perf_counter() - self.t0
        rules = self.rules
        search_report = SearchReport(
            candidates_considered=report["considered"] + sum(rules.counts.values()),
            removed_by_rule=dict(rules.counts), rule_examples=dict(rules.examples), dominated=report["dominated"],
            pruned_by_bound=report["pruned"], memory_infeasible=report["infeasible"], evaluated=report["evaluated"],
            solved=report["solved"], solver_status_counts=dict(self.status_counts),
            closed_without_solver=report["closed"],
            wall_s=wall, families=fam_out,
        )
        return Plan(model=model, training=training, cluster=profile.name, num_gpus=profile.num_gpus, layout=best.layout,
                    precision=training.precision, target=opts.target, prediction=best_pred, alternatives=alternatives,
                    solver_status=(f"FEASIBLE: search stopped at its {opts.time_budget_s:g} s budget before every "
                                   f"bound was closed (the chosen candidate's own split: {best.status})"
                                   if self.budget_hit
                                   else best.status),
                    search=search_report)

    def _family_outcomes(self, best: Found, best_pred: Prediction) -> list[FamilyOutcome]:
        """Per family, fastest first, its best against the chosen plan (the first few explained in full) or
        why none of it was found."""
        fam_out = []
        ranked_fams = sorted(self.families.items(),
                             key=lambda kv: (kv[1]["best"] is None, kv[1]["best"].step_s if kv[1]["best"] else 0.0))
        for n, (name, fam) in enumerate(ranked_fams):
            b = fam["best"]
            if b is not None and b.layout == best.layout:
                reason = "the chosen plan's structure"
            elif b is not None and n < EXPLAINED_FAMILIES and not self.over_budget():
                reason = why_slower(predict(self.model, self.training, self.profile, b.layout, target=self.opts.target),
                                    best_pred)
            elif b is not None:
                reason = f"slower: its best is {b.step_s / best.step_s - 1:+.1%}"
            else:
                reason = str(fam["reason"]) or "not reached"
            fam_out.append(FamilyOutcome(family=name, best_step_s=b.step_s if b else None,
                                         slower_by=(b.step_s / best.step_s - 1) if b else None, members=fam["members"],
                                         reason=reason))
        return fam_out


def why_slower(pred: Prediction, best: Prediction) -> str:
    """The term that grew most against the best plan: compute, bubble, a kind of exposed comm, optimizer."""
    def terms(p: Prediction) -> dict[str, float]:
        out = {"compute on the critical stage":
               p.compute_time_s - sum(c.exposed_s for c in p.comm if c.kind in ("tp", "cp", "ep")),
               "pipeline bubble": p.bubble_time_s, "optimizer step": p.optimizer_time_s}
        for c in p.comm:
            out[f"exposed {c.kind} communication"] = out.get(f"exposed {c.kind} communication", 0.0) + c.exposed_s
        return out
    if abs(pred.step_time_s - best.step_time_s) <= 1e-9 * best.step_time_s:
        return (f"as fast, but needs {pred.memory.total_bytes / GIB:.1f} GiB per GPU against the chosen plan's "
                f"{best.memory.total_bytes / GIB:.1f} GiB (equal step times: the smaller footprint ranks first)")
    a, b = terms(pred), terms(best)
    deltas = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}
    worst = max(deltas, key=deltas.get)
    total = pred.step_time_s - best.step_time_s
    return (f"{total / best.step_time_s:+.1%} step time ({total:+.3f} s); largest difference: {worst} "
            f"{deltas[worst]:+.3f} s")


def _nothing_fits(
    model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, shortfall: list, report: dict
) -> AutoparError:
    gap, where = shortfall[:2]
    fixes = ("more GPUs (more pipeline/tensor/ZeRO sharding), optimizer offload, full recompute, "
             "a smaller micro-batch or a shorter sequence, or a GPU with more memory")
    if math.isfinite(gap):
        return AutoparError(
            "cluster", f"{profile.num_gpus} x {profile.device.name}",
            f"add about {gap / GIB:.1f} GiB per GPU: {fixes}",
            problem=f"has no layout of {model.name} that fits: the closest ({where}) is {gap / GIB:.1f} GiB over "
                    f"the {usable_bytes(profile.device.memory_bytes, profile.assumptions) / GIB:.1f} GiB a plan may "
                    f"fill ({profile.device.memory_bytes / GIB:.0f} GiB less the "
                    f"{profile.assumptions.memory_headroom:.0%} memory_headroom)",
        )
    return AutoparError("cluster", f"{profile.num_gpus} GPUs", fixes, problem="has no layout that could be evaluated")

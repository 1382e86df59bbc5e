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
import gc
import heapq
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

from planner import targets
from planner.contracts import (
    ClusterProfile,
    FamilyOutcome,
    LinkLevel,
    ModelSpec,
    ParallelLayout,
    Plan,
    Prediction,
    Schedule,
    SearchReport,
    TrainingConfig,
)
from planner.cost.checks import check_sequence
from planner.cost.memo import memoised
from planner.cost.memory import (
    memory_offset,
    model_state_bytes,
    state_bytes_per_param,
    usable_bytes,
)
from planner.cost.params import embedding_params, layer_params, lm_head_params
from planner.cost.pipeline import SCHEDULES
from planner.cost.predict import predict
from planner.cost.stage import state_per_param
from planner.errors import AutoparError
from planner.search import sizing
from planner.search.bound import (
    interleaved_memory_floor,
    leaf_bound,
    leaf_tail_bound,
    min_max_stage,
    pigeonhole_comms,
    schedule_bound,
    structure_floors,
)
from planner.search.cpsat import layer_kind_prefix, solve_stages
from planner.search.enumerate import (
    Structure,
    base_layout,
    leaf_choices_of,
    out_of_time,
    schedule_choices,
    structures,
)
from planner.search.explain import (
    Counts,
    FamilyState,
    LeafLabel,
    NoFitReason,
    alternative,
    nothing_fits,
    rank_found,
    ties,
    why_slower,
)
from planner.search.options import SearchOptions
from planner.search.price import (
    Found,
    best_uniform,
    default_split_refusal,
    frugal_stage_model,
    price_structure,
    target_fallback,
    target_refusal,
)
from planner.search.rules import Rule, Rules
from planner.search.stages import (
    LeafComm,
    SplitBound,
    StageModel,
    expert_fold,
    memory_minmax_s,
    recompute_bound_s,
)

# structures priced first, on one plain leaf each, to start the bound
SEED_STRUCTURES = 48
# structures whose best plan is priced in full to say why it lost
EXPLAINED_FAMILIES = 12


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
    options = options or SearchOptions()
    if sizing.asked(training, profile, options):  # several (GPUs, batch) pairs: one search each, the best kept
        return sizing.sized_search(model, training, profile, options,
                                   lambda m, t, p, o: search(m, t, p, o, progress))
    t0 = time.perf_counter()
    check_sequence(model, training)  # no layout could run it: say why, not "no layout could be evaluated"
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
                                      ("layout",), field="layout.compile")
            if refused is not None:
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
            self.families.setdefault(structs[i].family, FamilyState())

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
        # with a run calibration's memory offset, which every layout's peak carries (planner.cost.memory.fixed_terms)
        self.reserved = float(a.runtime_bytes + a.reserved_memory_bytes) + memory_offset(self.profile)
        self.least_frag = 1.0 + min(a.allocator_fragmentation, a.sharded_fragmentation)

    def _init_tallies(self) -> None:
        """The results, counters and memo caches the phases share."""
        self.results: dict[int, Found] = {}  # leaf id -> best known solution
        self.values: list[float] = []  # sorted step times of every priced leaf
        self.families: dict[str, FamilyState] = {}
        self.report = Counts()
        self.status_counts: dict[str, int] = defaultdict(int)
        self.shortfall: list = [math.inf, "", -1]  # gap, leaf, order of the no_fit call
        self.pending: list[tuple] = []
        # (order, need, label), priced if nothing fits
        self.lazy_needs: list[tuple[int, Callable[[], float], LeafLabel]] = []
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
        self.interleaved_floor_of: dict[tuple[int, Schedule], float] = {}  # per structure and virtual schedule:
        # memory min-max under any of its depths
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
        if fam.best is None or step < fam.best.step_s:
            fam.best = item

    def no_fit(self, st: Structure, need: float | Callable[[], float], label: LeafLabel, why: str) -> None:
        """Count a leaf that does not fit. ``need`` may be a function (a stage model's memory on a
        split, which takes pricing): it is called only if the shortfall or the family's reason is shown."""
        self.report.infeasible += 1
        order = next(self.no_fits)
        if callable(need):
            self.lazy_needs.append((order, need, label))
        elif need - self.capacity < self.shortfall[0]:
            self.shortfall[:] = [need - self.capacity, str(label), order]
        fam = self.families[st.family]
        if not fam.reason:
            fam.reason = NoFitReason(need, why, self.capacity)

    def states_need_of(self, st: Structure, zero: int, shard: int, offload: float) -> float:
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

    def states_per_param(self, st: Structure, zero: int, shard: int, offload: float) -> tuple[float, float, bool]:
        """(dense, expert) model-state bytes per parameter on a GPU, and whether ZeRO-3 gathers blocks:
        what a leaf's memory bounds see of its data-parallel choice (as StageModel computes them)."""
        key = (st.cp, st.tp, st.ep, st.expert_tp, zero, shard, offload)
        sig = self.per_param.get(key)
        if sig is None:
            expert_shard = expert_fold(shard, st.cp, st.tp, st.ep, st.expert_tp)[1]
            sig = self.per_param[key] = (*state_per_param(self.state, zero, shard * st.cp, expert_shard, offload,
                                                          self.master_in_param), zero == 3)
        return sig

    def leaf_comm(self, st: Structure, zero: int, rep: int, shard: int, offload: float, reshard: bool) -> LeafComm:
        """The leaf's data-parallel side (it does not depend on the schedule; memoised)."""
        opts = self.opts

        def make_layout() -> ParallelLayout:
            return base_layout(st, opts, dp_replicate=rep, dp_shard=shard, zero_stage=zero,
                               **ParallelLayout.offload_fields(offload), reshard_after_forward=reshard)

        return LeafComm.of(self.profile, self.training, make_layout,
                           (zero, shard, rep, st.cp, st.tp, st.ep, st.expert_tp), offload,
                           reshard, opts.dp_comm_overlap, self.all_params_dense / (st.tp * st.pp),
                           self.all_params_expert / (st.expert_tp * st.ep * st.pp), self.cache, pp=st.pp)

    # ------------------------------------------------------------------ one leaf
    def price_leaf(self, si: int, st: Structure, sched: Schedule, v: int, minmax: float, rec_min: float, zero: int,
                   rep: int, shard: int, offload: float, reshard: bool) -> None:
        """Bound one leaf, cheapest test first; price it on the default split, queue it for CP-SAT.
        ``minmax``: the v=1 contiguous min-max stage (0 for interleaved); ``rec_min``: recompute
        that memory forces on every leaf of this schedule."""
        key = (si, sched, v, zero, rep, shard, offload, reshard)
        if key in self.priced:
            return
        self.priced.add(key)
        opts, report = self.opts, self.report
        label = LeafLabel(st.family, zero, rep, shard, offload)
        need = self.states_need_of(st, zero, shard, offload)

        def make_layout() -> ParallelLayout:
            return base_layout(st, opts, dp_replicate=rep, dp_shard=shard, zero_stage=zero,
                               **ParallelLayout.offload_fields(offload), reshard_after_forward=reshard,
                               schedule=sched, virtual_stages=v)

        refused = target_refusal(self.model, self.training, opts.target, make_layout(), st.m, ("layout",))
        if refused is not None:  # before the memory test: "the closest" of a failed search is one the target runs
            self.rules.remove(Rule.TARGET, str(refused), target=opts.target, feature=refused.feature)
            return
        if need > self.capacity:
            self.no_fit(st, need, label, "model states alone need")
            return
        comm = self.leaf_comm(st, zero, rep, shard, offload, reshard)
        if leaf_bound(st, sched, v, minmax, rec_min, comm) >= self.kth():
            report.pruned += 1
            return
        if self.over_budget():
            self.budget_hit = True
            report.pruned += 1
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

    def _memory_bound(self, st: Structure, sched: Schedule, v: int, minmax: float, comm: LeafComm, label: LeafLabel,
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
            self.report.pruned += 1
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
                    self.report.pruned += 1
                    return None
        return sm, lb, stage_lb, rec_s

    def _price_default(self, st: Structure, sm: StageModel, lb: float, stage_lb: float, rec_s: float,
                       label: LeafLabel, leaf: tuple) -> None:
        """Price an unpruned leaf (``leaf``: its schedule, depth and data-parallel side) on the default
        split; one that meets its bound there is closed, the rest are queued for CP-SAT."""
        sched, v, comm = leaf
        self.report.evaluated += 1
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
                self.report.closed += 1
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

    def _price_single_stage(self, leaf_id: int, st: Structure, sm: StageModel, label: LeafLabel) -> None:
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
        self.report.closed += 1

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
            if SCHEDULES[sched].virtual or SCHEDULES[sched].depth != 1:
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
            self.leaves_of[leaves_key] = leaf_choices_of(*leaves_key, self.opts)
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
            fam.members += count
            self.report.considered += count
            self.report.pruned += count
            if not fam.reason:
                fam.reason = (f"lower bound {st_bound:.3f} s (its work spread evenly)" if exact else
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
        self.families[st.family].members += per_sched * len(scheds)
        report.considered += per_sched * len(scheds)
        minmax = self.minmax_for(si)
        # per leaf, its schedule-free tail bound (None: its model states alone do not fit, which
        # price_leaf reports), and the least of them: a floor every leaf's tail stands on; computed
        # once the first schedule survives its own bound
        tails: list[float | None] = []
        tail_min = 0.0
        for sched, v in scheds:
            if SCHEDULES[sched].dominated_by in self.opts.schedules:
                report.dominated += per_sched  # e.g. GPipe: the step time of 1F1B with more micro-batches in flight
                continue
            stage_min = minmax if v == 1 else 0.0
            plain = schedule_bound(st, sched, v, stage_min)
            if plain >= self.kth():
                report.pruned += per_sched
                continue
            if not tails:
                tails, tail_min = self._tails(st, leaves)
            if plain + tail_min >= self.kth():
                report.pruned += per_sched
                continue
            if SCHEDULES[sched].virtual and st.pp > 1 and not self._interleaved_may_fit(si, st, sched, scheds, v,
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

    def _interleaved_may_fit(self, si: int, st: Structure, sched: Schedule, scheds: list, v: int, per_sched: int,
                             tail_min: float) -> bool:
        """One memory bound for every interleaving depth of this structure and (virtual) schedule before one
        per depth: whether depth ``v``'s leaves survive it (those that do not are counted)."""
        if (si, sched) not in self.interleaved_floor_of:
            self.interleaved_floor_of[si, sched] = interleaved_memory_floor(
                self.model, self.training, self.profile, st, self.opts, sched, [d for s, d in scheds if s is sched],
                self.cache)
        floor_stage = self.interleaved_floor_of[si, sched]
        if not math.isfinite(floor_stage):
            self.report.infeasible += per_sched  # no split of any of its leaves fits, at any depth
            return False
        if schedule_bound(st, sched, v, floor_stage) + tail_min >= self.kth():
            self.report.pruned += per_sched
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
            report.infeasible += per_sched  # no split of any of its leaves fits, at any speed
            return
        base = schedule_bound(st, sched, v, stage_min, rec_min)
        if base + tail_min >= self.kth():
            report.pruned += per_sched
            return
        for (zero, rep, shard, offload, reshard), tail in zip(leaves, tails):
            if tail is not None and base + tail >= self.kth():
                report.pruned += 1  # leaf_bound would be at least this
                continue
            self.price_leaf(si, st, sched, v, stage_min, rec_min, zero, rep, shard, offload, reshard)

    # ------------------------------------------------------------------ phase B
    def solve_pending(self) -> None:
        """Phase B: CP-SAT on the leaves whose bound can still beat the k-th best, best bound first."""
        self.pending.sort(key=lambda x: (x[0], x[1]))
        for lb, leaf, sm, st, label, greedy_val, chunks, bounds in self.pending:
            if lb >= self.kth():
                self.report.pruned += 1
                continue
            if self.over_budget():
                self.budget_hit = True
                continue
            cutoff = min(greedy_val if greedy_val is not None else math.inf, self.kth())
            if math.isfinite(bounds[-1]) and self._split_settles(sm, st, cutoff, bounds):
                if cutoff == greedy_val:  # the default split is this leaf's optimum
                    self.record(leaf, greedy_val, self.results[leaf].layout, st, "OPTIMAL")
                    self.report.closed += 1
                else:
                    self.report.pruned += 1
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

    def _solve(self, leaf: int, sm: StageModel, st: Structure, label: LeafLabel, greedy_val: float | None,
               chunks: list, cutoff: float) -> None:
        """CP-SAT on one leaf's split and per-stage recompute, below ``cutoff``; its outcome recorded. No
        solution hint: with the default split and greedy recompute as a hint, one CP-SAT worker stopped at
        FEASIBLE on zero-bubble leaves it proves OPTIMAL in 0.01 s without (12 benchmark and test searches:
        2.58 s of CP-SAT with hints, 0.53 s without, the same plans)."""
        opts = self.opts
        self.report.solved += 1
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
                                          f"({report.considered:,} candidates considered, "
                                          f"{report.infeasible:,} shown not to fit)")
        for order, need, label in self.lazy_needs:  # the first smallest gap, as if priced when found
            if self.over_budget() and math.isfinite(shortfall[0]):
                break  # the closest seen so far stands for the rest
            gap = need() - self.capacity
            if gap < shortfall[0] or (gap == shortfall[0] and order < shortfall[2]):
                shortfall[:] = [gap, str(label), order]
        return nothing_fits(self.model, self.training, self.profile, shortfall, report)

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
            candidates_considered=report.considered + sum(rules.counts.values()),
            removed_by_rule=dict(rules.counts), rule_examples=dict(rules.examples), dominated=report.dominated,
            pruned_by_bound=report.pruned, memory_infeasible=report.infeasible, evaluated=report.evaluated,
            solved=report.solved, solver_status_counts=dict(self.status_counts),
            closed_without_solver=report.closed,
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
                             key=lambda kv: (kv[1].best is None, kv[1].best.step_s if kv[1].best else 0.0))
        for n, (name, fam) in enumerate(ranked_fams):
            b = fam.best
            if b is not None and b.layout == best.layout:
                reason = "the chosen plan's structure"
            elif b is not None and n < EXPLAINED_FAMILIES and not self.over_budget():
                reason = why_slower(predict(self.model, self.training, self.profile, b.layout, target=self.opts.target),
                                    best_pred)
            elif b is not None:
                reason = f"slower: its best is {b.step_s / best.step_s - 1:+.1%}"
            else:
                reason = str(fam.reason) or "not reached"
            fam_out.append(FamilyOutcome(family=name, best_step_s=b.step_s if b else None,
                                         slower_by=(b.step_s / best.step_s - 1) if b else None, members=fam.members,
                                         reason=reason))
        return fam_out

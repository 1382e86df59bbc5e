"""Enumerate: every structure (tp, sp, cp, pp, dp, ep, etp, micro-batch) that passes the divisibility and
placement rules (each removal counted under its :class:`~planner.search.rules.Rule`), and per structure the
schedules and the data-parallel leaves (ZeRO stage, HSDP shard group, offload, resharding)."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

from planner import targets
from planner.contracts import (
    ClusterProfile,
    ModelSpec,
    ParallelLayout,
    Schedule,
    TrainingConfig,
)
from planner.cost.pipeline import SCHEDULES
from planner.errors import AutoparError
from planner.search.options import SearchOptions
from planner.search.rules import Rule, Rules
from planner.search.stages import (
    expert_fold,
)


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


def base_layout(st: Structure, opts: SearchOptions, **extra) -> ParallelLayout:  # noqa: ANN003
    fields = dict(tp=st.tp, sp=st.sp, cp=st.cp, pp=st.pp, ep=st.ep, etp=st.etp, dp_shard=st.dp, dp_replicate=1,
                  micro_batch_size=st.mb, tp_comm_overlap=opts.tp_comm_overlap and st.tp > 1,
                  dp_comm_overlap=opts.dp_comm_overlap, ep_comm_overlap=opts.ep_comm_overlap and st.ep > 1,
                  pp_scatter_gather=st.pp_scatter_gather, compile=opts.compile)
    fields.update(extra)
    return ParallelLayout(**fields)


def _schedule_refusal(target: str, model: ModelSpec, sched: Schedule, pp: int, depth: int):  # noqa: ANN202
    """The target's refusal of the schedule itself (its rows about ``schedule``), whatever else the layout holds:
    such a schedule is not enumerated at all (each of its leaves would be refused one by one)."""
    layout = ParallelLayout(pp=pp, schedule=sched, virtual_stages=depth)
    return targets.refusal(target, targets.Job(model, None, layout), ("layout",), field="schedule")


def schedule_choices(st: Structure, model: ModelSpec, opts: SearchOptions, rules: Rules) -> list[tuple[Schedule, int]]:
    if st.pp == 1:
        return [(Schedule.one_f_one_b, 1)]
    out = []
    for sched in opts.schedules:
        facts = SCHEDULES[sched]
        refused = _schedule_refusal(opts.target, model, sched, st.pp, 2 if facts.virtual else facts.depth)
        if refused is not None:
            rules.remove(Rule.TARGET, str(refused), target=opts.target, feature=refused.feature)
            continue
        if facts.virtual:
            if st.m % st.pp:
                rules.remove(Rule.INTERLEAVED_MICRO_BATCHES, f"m={st.m}, pp={st.pp}")
                continue
            for v in range(2, opts.max_virtual_stages + 1):
                if st.pp * v > model.num_layers:
                    rules.remove(Rule.VIRTUAL_STAGES, f"pp={st.pp}, v={v}")
                    break
                out.append((sched, v))
        elif st.pp * facts.depth > model.num_layers:  # the V schedules: two chunks per rank
            rules.remove(Rule.VIRTUAL_STAGES, f"pp={st.pp}, v={facts.depth}")
        else:
            out.append((sched, facts.depth))
    return out


def leaf_choices(
    st: Structure, opts: SearchOptions, rules: Rules | None = None
) -> tuple[tuple[int, int, int, float, bool], ...]:
    """The per-schedule choices of a structure: (ZeRO stage, dp_replicate, dp_shard, offload share,
    reshard after forward). ZeRO-0 replicates over all of dp; ZeRO >= 1 shards over every HSDP
    group size whose ranks (× cp × tp) can hold the folded expert groups; offload needs ZeRO >= 1, and
    each share of ``opts.offload_fractions`` is a choice (a target offloading none or all refuses the rest)."""
    out, removed = leaf_choices_of(st.dp, st.cp, st.tp, st.ep, st.expert_tp, opts)
    if rules is not None and removed:
        rules.remove(Rule.FOLD_SHARD, f"ep={st.ep}, etp={st.expert_tp}", removed)
    return out


@functools.lru_cache(maxsize=4096)
def leaf_choices_of(dp: int, cp: int, tp: int, ep: int, etp: int,
                  opts: SearchOptions) -> tuple[tuple[tuple[int, int, int, float, bool], ...], int]:
    out, removed = [], 0
    for zero in opts.zero_stages:
        if zero == 0:
            splits = [(1, dp)]
        else:
            shards = divisors(dp) if opts.hsdp else [dp]
            splits = [(dp // d, d) for d in shards if expert_fold(d, cp, tp, ep, etp)[0] is None]
            removed += len(shards) - len(splits)
        for rep, shard in splits:
            for offload in ((0.0, *opts.offload_fractions) if zero >= 1 and opts.offload else (0.0,)):
                for reshard in ((True, False) if zero == 3 else (True,)):
                    out.append((zero, rep, shard, offload, reshard))
    return tuple(out), removed  # cached: immutable

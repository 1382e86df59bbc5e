"""One candidate layout, decomposed into per-pipeline-stage terms the search can recombine.

:func:`planner.cost.predict.predict` prices a whole layout. The search instead has to try many ways
of giving layers to pipeline stages and of choosing recompute per stage, so this module computes,
once per candidate, everything that does not depend on that choice (the cost and activation bytes
of one block of each kind, the embedding and LM head, the pipeline send, the data-parallel
collectives as a function of the parameters a stage holds) and then prices one stage, and one
split, by counts of blocks. Every per-rank formula is :mod:`planner.cost.stage`'s, the one ``predict``
composes too: the passes (:func:`~planner.cost.stage.rank_passes_s`), the exposed data-parallel traffic
(:func:`~planner.cost.stage.dp_exposure`), the optimizer step (:func:`~planner.cost.stage.optimizer_step_s`)
and the peak memory (:func:`~planner.cost.stage.held_per_param`, :func:`~planner.cost.stage.peak_bytes`);
the block, embedding, head and send costs are :mod:`planner.cost.layer`'s and :mod:`planner.cost.comm`'s.
What is this module's own is the bookkeeping: costs per block kind, memoised per shape, and the
data-parallel collectives as affine functions of the parameters held (:func:`dp_affine`), so that a
split costs sums of counts.

``tests/test_search.py`` checks :meth:`StageModel.evaluate` against ``predict`` on random splits.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from planner import targets
from planner.contracts import (
    ClusterProfile,
    Collective,
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Precision,
    Recompute,
    StageRecompute,
    TrainingConfig,
)
from planner.cost.checks import default_layer_split
from planner.cost.comm import (
    collective_time_s,
    mesh_groups,
    placement,
)
from planner.cost.compute import attention_time_s, gemm_fwd_bwd_s
from planner.cost.flops import attention_window_share
from planner.cost.layer import (
    MicroBatch,
    _attention_gemms,
    _mlp_gemms,
    block_cost,
    embedding_cost,
    expert_rows,
    lm_head_cost,
    routed_expert_gemms,
    routed_token_count,
    tp_pairs,
)
from planner.cost.memory import (
    ActivationShape,
    activation_factor,
    allocator_budget_bytes,
    fixed_terms,
    fragmentation_share,
    kind_factor,
    layer_activation_bytes,
    logits_bytes,
    memory_offset,
    optimizer_step_bytes_per_param,
    recompute_transient,
    state_bytes_per_param,
    usable_bytes,
)
from planner.cost.params import dense_per_tp_rank, embedding_params, head_per_tp_rank, layer_params
from planner.cost.pipeline import SCHEDULES, head_rank, microbatches_in_flight, pipeline_time_s, rank_chunks
from planner.cost.predict import (
    check_layout,
    dp_cadence,
    dp_traffic,
    dp_units,
    expert_split,
)
from planner.cost.stage import (
    dp_exposure,
    held_per_param,
    local_params,
    optimizer_step_s,
    peak_bytes,
    pipeline_send_s,
    rank_passes_s,
)

RECOMPUTE_KINDS = (Recompute.selective, Recompute.full, Recompute.op)


def admitted_recompute(model: ModelSpec, training: TrainingConfig, layout: ParallelLayout,
                       target: str) -> tuple[Recompute, ...]:
    """The recompute kinds of :data:`RECOMPUTE_KINDS` that ``target``'s table (its layout rows) admits for
    ``layout`` (Megatron-LM: no per-op SAC; torchtitan: no attention-core selective; per-op SAC not under a
    split-backward schedule). Every kind where the layout is refused without recompute too: the search's
    own check of each plan then says why."""
    def refused(kind: Recompute) -> bool:
        lay = layout.model_copy(update={"recompute": kind})
        return targets.refusal(target, targets.Job(model, training, lay), ("layout",)) is not None

    if refused(Recompute.none):
        return RECOMPUTE_KINDS
    return tuple(k for k in RECOMPUTE_KINDS if not refused(k))


@functools.lru_cache(maxsize=16384)
def expert_fold(dp_shard: int, cp: int, tp: int, ep: int, etp: int) -> tuple[str | None, int]:
    """(why ep x etp cannot fold over these ranks or None, the expert data-parallel group size) of a
    layout with these degrees: :meth:`ParallelLayout.expert_fold_problem` and ``expert_dp``, the one
    home of the folding rule, asked of a layout built without validation (the search calls this per
    candidate degree)."""
    lay = ParallelLayout.model_construct(dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp)
    return lay.expert_fold_problem(), lay.expert_dp


@functools.lru_cache(maxsize=64)
def cadence(zero: int, pp: int, reshard: bool) -> tuple[int, bool]:
    """:func:`planner.cost.predict.dp_cadence` of a layout with these fields (asked per leaf: kept here)."""
    return dp_cadence(ParallelLayout.model_construct(zero_stage=zero, pp=pp, reshard_after_forward=reshard))


@dataclass(frozen=True)
class KindCost:
    """One block kind (dense or MoE) under this candidate: per micro-batch, per GPU."""

    forward_s: float
    backward_s: dict[Recompute, float]  # backward incl. the recompute it implies
    activations: dict[Recompute, float]  # bytes kept for backward
    dense_params: float  # per GPU (/tp)
    expert_params: float  # per GPU (/(ep·etp))
    gather_params: float  # ZeRO-3 gather buffer of one block: all its params / tp


@dataclass(frozen=True)
class StageTerms:
    """Everything the step formula needs from one pipeline stage."""

    forward_s: float  # incl. exposed per-micro-batch data-parallel traffic
    backward_s: float
    tail_s: float  # exposed once-per-step data-parallel traffic + optimizer step
    memory_bytes: float
    layers: int


@dataclass(frozen=True)
class Affine:
    """``t(x) = (alpha + per_call·(calls - 1))·[x > 0] + slope·x``: a collective time as a function of the
    bytes it moves in ``calls`` calls (ZeRO-2/3 per FSDP unit, :func:`planner.cost.predict.dp_units`)."""

    alpha: float
    slope: float
    per_call: float = 0.0

    def __call__(self, x: float, calls: int = 1) -> float:
        return self.alpha + self.per_call * (calls - 1) + self.slope * x if x > 0 else 0.0


@dataclass(frozen=True)
class SharedCosts:
    """What a candidate's blocks, embedding, head and pipeline send cost: depends only on the
    micro-batch shape and the tp/cp/ep/pp groups, so it is computed once per such shape."""

    kinds: list[bool]  # per block: MoE?
    mb: MicroBatch
    kind_cost: dict[bool, KindCost]
    emb: tuple[float, float]  # (forward, backward) seconds
    head: tuple[float, float]
    p2p_s: float


def shared_costs(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout,
                 cache: dict, target: str = "autopar") -> SharedCosts:
    """Per-shape costs of ``layout`` (its split, recompute and data-parallel choices play no part) with
    ``target``'s FP8 saved inputs, on ``profile`` as given (the search's is already the target's,
    ``planner.targets.priced_profile``: its expert GEMMs' concurrency is part of every key), memoised in
    ``cache`` across the candidates of one search."""
    fp8_in = targets.target_facts(target).fp8_inputs(training)
    # fast path: the same layout fields give the same groups and micro-batch, so the same result
    fast_key = ("shared-fast", layout.micro_batch_size, layout.tp, layout.sp, layout.cp, layout.ep, layout.etp,
                layout.pp, layout.dp_shard, layout.dp_replicate, layout.tp_comm_overlap, layout.ep_comm_overlap,
                layout.pp_scatter_gather, profile.gpus_per_node, training.seq_length, training.precision,
                training.flash_attention, training.moe_load_imbalance,
                activation_factor(profile.assumptions, training, layout.zero_stage), fp8_in,
                profile.assumptions.grouped_gemm_streams)
    got = cache.get(fast_key)
    if got is not None:
        return got
    cache[fast_key] = out = _shared_costs(model, training, profile, layout, cache, fp8_in)
    return out


def _shared_costs(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout,
                  cache: dict, fp8_in: bool) -> SharedCosts:
    kinds_key = ("kinds", id(model))
    if kinds_key not in cache:
        cache[kinds_key] = (model, [model.is_moe_layer(i) for i in range(model.num_layers)])
    kinds = cache[kinds_key][1]
    groups = mesh_groups(layout, profile.gpus_per_node)
    mb = MicroBatch.of(layout, training)
    factor = activation_factor(profile.assumptions, training, layout.zero_stage)  # activation bytes per formula byte
    key = ("shared", mb, layout.ep, groups["tp"], groups["cp"], groups["ep"], groups["pp"], layout.tp_comm_overlap,
           layout.ep_comm_overlap, layout.pp_scatter_gather, layout.pp > 1, factor, fp8_in,
           profile.assumptions.grouped_gemm_streams)
    if key not in cache:
        # blocks, embedding and head do not depend on pp: shared by every pipeline depth
        core_key = ("blocks", mb, layout.ep, groups["tp"], groups["cp"], groups["ep"], layout.tp_comm_overlap,
                    layout.ep_comm_overlap, factor, fp8_in, profile.assumptions.grouped_gemm_streams)
        if core_key not in cache:
            kind_cost = {kind: _kind_cost(model, training, profile, layout, mb, groups, kinds.index(kind), cache,
                                          fp8_in)
                         for kind in sorted(set(kinds))}
            # the embedding and head see the TP group only: shared by every expert-parallel degree
            ends_key = ("ends", mb, groups["tp"])
            if ends_key not in cache:
                emb_f, emb_b = embedding_cost(profile, model, mb, groups)
                head_f, head_b = lm_head_cost(profile, model, mb, groups)
                cache[ends_key] = ((emb_f.total_s, emb_b.total_s), (head_f.total_s, head_b.total_s))
            cache[core_key] = (kind_cost, *cache[ends_key])
        kind_cost, emb, head = cache[core_key]
        p2p_s = pipeline_send_s(model, training, profile, groups["pp"], mb.tokens, layout.tp, layout.pp_scatter_gather)
        cache[key] = SharedCosts(kinds, mb, kind_cost, emb, head, p2p_s)
    return cache[key]


def _kind_cost(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout,
               mb: MicroBatch, groups: dict, index: int, cache: dict, fp8_in: bool) -> KindCost:
    """:class:`KindCost` of block ``index``'s kind. A dense block neither routes tokens nor holds
    experts, so its cost is shared by every expert-parallel degree; the activation bytes depend on
    the micro-batch shape only (``tests/test_search.py`` checks both against an unshared cache)."""
    moe = model.is_moe_layer(index)
    ep_part = (layout.ep, groups["ep"], layout.ep_comm_overlap) if moe else ()
    factor = activation_factor(profile.assumptions, training, layout.zero_stage)
    key = ("kind", index, mb, groups["tp"], groups["cp"], layout.tp_comm_overlap, factor, fp8_in,
           profile.assumptions.grouped_gemm_streams, *ep_part)
    if key not in cache:
        params_key = ("layer-params", id(model), index)
        if params_key not in cache:
            cache[params_key] = (model, layer_params(model, index))
        dense, expert = cache[params_key][1]
        acts_key = ("acts", index, mb, layout.micro_batch_size, layout.tp, layout.sp, layout.ep, factor, fp8_in)
        if acts_key not in cache:
            shape = ActivationShape(layout.micro_batch_size, mb.local_seq, training.seq_length, layout.tp, layout.sp,
                                    mb.etp, layout.ep)
            elt = training.precision.bytes
            cache[acts_key] = {r: kind_factor(factor, r) * layer_activation_bytes(model, index, shape, r,
                                                                  flash=training.flash_attention, elt=elt, fp8=fp8_in,
                                                                  moe_imbalance=training.moe_load_imbalance)
                               for r in Recompute}
        bc = block_cost(profile, model, index, mb, layout, groups)
        cache[key] = KindCost(
            forward_s=bc.forward.total_s, backward_s={r: bc.backward_s(r) for r in Recompute},
            activations=cache[acts_key], dense_params=dense_per_tp_rank(model, index, layout.tp),
            expert_params=expert / expert_split(layout),
            # this rank's share
            gather_params=dense_per_tp_rank(model, index, layout.tp) + expert / expert_split(layout),
        )
    return cache[key]


def optimizer_time_s(profile: ClusterProfile, training: TrainingConfig, zero_stage: int, shard_n: int,
                     expert_shard: int, offload: float, dense_params: float, expert_params: float) -> float:
    """Optimizer step of a stage holding these parameters per GPU (:func:`planner.cost.stage.optimizer_step_s`)."""
    local = local_params(dense_params, expert_params, zero_stage, shard_n, expert_shard)
    return optimizer_step_s(profile, state_bytes_per_param(training), optimizer_step_bytes_per_param(training),
                            offload, local)[0]


def dp_affine(profile: ClusterProfile, training: TrainingConfig, layout: ParallelLayout | Callable[[], ParallelLayout],
              cache: dict, key: tuple | None = None) -> tuple[dict[str, Affine], dict[str, Affine]]:
    """(dense, expert) grad/replica/gather seconds of ``dp_traffic`` as ``alpha + slope·params`` plus
    ``per_call`` for each further call (they are α-β), memoised per data-parallel grouping
    ``(zero, dp_shard, dp_replicate, cp, tp, ep, etp)``
    (etp: the experts' TP degree, tp when not folded): they do not depend on pp or the split. ``layout``
    may be a factory, called on a cache miss."""
    if key is None:
        lay = layout() if callable(layout) else layout
        key = (lay.zero_stage, lay.dp_shard, lay.dp_replicate, lay.cp, lay.tp, lay.ep, lay.expert_tp)
    key = ("dp", *key)
    if key not in cache:
        lay = layout() if callable(layout) else layout

        def affine(dense: bool) -> dict[str, Affine]:
            def at(x: float, calls: int = 1) -> dict[str, float]:
                tr = dp_traffic(profile, lay, training, x if dense else 0.0, 0.0 if dense else x, calls, calls)
                return {"grad": tr.grad_s, "replica": tr.replica_s, "gather": tr.gather_s}
            # two points on the large-message segment: exact for single-segment links (reference
            # profiles); a measured profile fitted piecewise (LinkProfile.min_bytes/max_bytes) is
            # exact for stages whose traffic is past its last breakpoint, approximate below it
            # (the plan's figures are predict's either way)
            x1, x2 = 1e9, 1e10
            t1, t2, twice = at(x1), at(x2), at(x1, 2)
            out = {}
            for k in t1:
                slope = (t2[k] - t1[k]) / (x2 - x1)
                out[k] = Affine(t1[k] - slope * x1, slope, twice[k] - t1[k])
            return out
        # the dense side does not depend on ep (its groups are the dp x cp ranks at stride tp):
        # shared by every expert-parallel degree
        dense_key = ("dp-dense", *key[1:6])
        if dense_key not in cache:
            cache[dense_key] = affine(True)
        cache[key] = (cache[dense_key], affine(False))
    return cache[key]


@dataclass(frozen=True)
class LeafComm:
    """A candidate's data-parallel side for a stage holding the average parameters: what
    :func:`planner.search.bound.leaf_bound` needs, computable without a :class:`StageModel`."""

    grad_s: float
    replica_s: float
    gather_s: float
    gathers_per_mb: int  # ZeRO-3 gathers per micro-batch, 0: once per step (predict.dp_cadence)
    grads_per_mb: bool  # ZeRO-2/3 reduce-scatter gradients every micro-batch (without a pipeline)
    optimizer_s: float
    eff: float  # share of a collective the compute window hides

    @classmethod
    def of(cls, profile: ClusterProfile, training: TrainingConfig, make_layout: Callable[[], ParallelLayout],
           key: tuple[int, ...], offload: float, reshard: bool, dp_comm_overlap: bool,
           dense: float, expert: float, cache: dict, *, pp: int) -> LeafComm:
        """``key``: (zero, dp_shard, dp_replicate, cp, tp, ep[, etp]) (etp left out: tp); ``make_layout``
        builds the layout only when the data-parallel costs of this grouping are not cached yet; ``pp``
        sets the cadence (:func:`planner.cost.predict.dp_cadence`). Each collective is priced as one call:
        a lower bound of the stages' per-unit calls."""
        zero, shard, rep, cp, tp, ep, *rest = key
        key = (zero, shard, rep, cp, tp, ep, rest[0] if rest else tp)
        memo = ("leafcomm", key, offload, reshard, dp_comm_overlap, dense, expert, pp > 1)
        if memo in cache:
            return cache[memo]
        d, e = dp_affine(profile, training, make_layout, cache, key)
        shard_n = shard * cp
        expert_shard = expert_fold(shard, cp, tp, ep, key[6])[1]
        gathers, grads = cadence(zero, pp, reshard)
        out = cls(
            grad_s=d["grad"](dense) + e["grad"](expert), replica_s=d["replica"](dense) + e["replica"](expert),
            gather_s=d["gather"](dense) + e["gather"](expert),
            gathers_per_mb=gathers,
            grads_per_mb=grads,
            optimizer_s=optimizer_time_s(profile, training, zero, shard_n, expert_shard, offload, dense, expert),
            eff=profile.assumptions.async_overlap_efficiency if dp_comm_overlap else 0.0,
        )
        cache[memo] = out
        return out


class StageModel:
    """Per-stage decomposition of ``predict`` for ``layout`` (whose split and recompute are ignored)."""

    def __init__(self, model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout,
                 block_cache: dict | None = None, target: str = "autopar") -> None:
        profile = targets.priced_profile(profile, target, training.precision)  # the search's is already: itself back
        if (layout.layers_per_stage is None and layout.recompute_per_stage is None
                and layout.recompute is Recompute.none):
            base = layout  # the search's own base layouts already are (a copy costs a validation)
        else:
            base = layout.model_copy(update={"layers_per_stage": None, "recompute_per_stage": None,
                                             "recompute": Recompute.none})
        self.m = check_layout(model, training, base, profile.num_gpus)
        self.model, self.training, self.profile, self.layout = model, training, profile, base
        self.target = target
        self.recompute_kinds = admitted_recompute(model, training, base, target)
        self.p, self.v = base.pp, base.virtual_stages
        self.placement = [rank_chunks(base.schedule, self.p, self.v, r) for r in range(self.p)]
        self.head_rank = head_rank(base.schedule, self.p, self.v)  # holds the last chunk: the head, the loss
        cache = block_cache if block_cache is not None else {}
        shared = shared_costs(model, training, profile, base, cache, target)
        self.kinds, self.mb = shared.kinds, shared.mb
        self.kind_cost, self.emb, self.head, self.p2p_s = shared.kind_cost, shared.emb, shared.head, shared.p2p_s
        elt = training.precision.bytes
        self.emb_params = embedding_params(model) / base.tp
        tied = model.vocab_size * model.hidden_size if model.tied_embeddings and base.pp > 1 else 0
        self.head_params = head_per_tp_rank(model, base.tp, tied)
        self.state = state_bytes_per_param(training)
        self.step_bytes = optimizer_step_bytes_per_param(training)
        self.shard_n = base.dp_shard * base.cp
        self.expert_shard = base.expert_dp
        self.eff = profile.assumptions.async_overlap_efficiency if base.dp_comm_overlap else 0.0
        self.cadence = dp_cadence(base)
        self.gathers_per_mb, self.grads_per_mb = self.cadence
        flight_key = ("in-flight", base.schedule, base.pp, self.m, base.virtual_stages)
        if flight_key not in cache:  # shared by every layout of this schedule shape (read-only)
            cache[flight_key] = [microbatches_in_flight(base.schedule, r, base.pp, self.m, base.virtual_stages)
                                 for r in range(base.pp)]
        self.in_flight = cache[flight_key]
        a = profile.assumptions
        self.emb_act = activation_factor(a, training, base.zero_stage) * elt * self.mb.tokens * model.hidden_size / (
            base.tp if base.sp else 1)
        # the target's loss and model states (planner.targets.TargetFacts), as predict(target=...) reads them
        self.master_in_param = targets.target_facts(target).master_in_param
        self.logits = logits_bytes(model, self.mb.tokens, base.tp,
                                   targets.loss_bytes_per_logit(target, base, a.loss_bytes_per_logit))
        # memory: stage totals (fixed terms + allocated x (1 + fragmentation)) fit ``capacity``; the
        # allocation alone fits ``alloc_capacity`` (the same test, for the linear bounds and CP-SAT)
        self.fixed = sum(fixed_terms(a, base, memory_offset(profile)).values())
        self.frag = fragmentation_share(a, base.zero_stage)
        self.capacity = usable_bytes(profile.device.memory_bytes, a)
        self.alloc_capacity = allocator_budget_bytes(profile.device.memory_bytes, a, base, memory_offset(profile))
        self.dense_dp, self.expert_dp = dp_affine(profile, training, base, cache)
        # per-parameter bytes held by phase (planner.cost.stage.held_per_param), hoisted out of stage_terms
        zero = base.zero_stage
        held = held_per_param(self.state, zero, self.shard_n, self.expert_shard, base.offload_share,
                              base.reshard_after_forward, base.pp, self.m, a.optimizer_temp_bytes_per_param,
                              self.master_in_param)
        (self._state_dense, self._state_expert), self._step_state = held.backward, held.step
        self.block_buffer = held.block_buffer
        self._timing: dict = {}  # stage_terms_counts' timing per (first, last, counts, kind)
        self._held: dict = {}  # stage_memory_counts' holdings, likewise (they depend on the rank no further)
        # the target's FSDP2 units beside the blocks, held gathered through the backward (TargetFacts.fsdp_root)
        self.root = targets.target_facts(target).fsdp_root(model, base.tp) * held.root

    # -- data parallel -------------------------------------------------------------------------
    def traffic(self, dense_params: float, expert_params: float, units: int = 1,
                moe_blocks: int = 1) -> tuple[float, float, float]:
        """(grad, replica, gather) seconds of a stage's data-parallel collectives, the dense weights' in
        ``units`` calls and the experts' in ``moe_blocks`` (:func:`planner.cost.predict.dp_traffic`)."""
        d, e = self.dense_dp, self.expert_dp
        return (d["grad"](dense_params, units) + e["grad"](expert_params, moe_blocks),
                d["replica"](dense_params) + e["replica"](expert_params),
                d["gather"](dense_params, units) + e["gather"](expert_params, moe_blocks))

    def optimizer_s(self, dense_params: float, expert_params: float) -> float:
        """:func:`planner.cost.stage.optimizer_step_s` of this layout's rank holding these parameters."""
        local = local_params(dense_params, expert_params, self.layout.zero_stage, self.shard_n, self.expert_shard)
        return optimizer_step_s(self.profile, self.state, self.step_bytes, self.layout.offload_share, local)[0]

    # -- one stage -----------------------------------------------------------------------------
    def rank_layers(self, chunks: list[int]) -> list[list[int]]:
        """Block indices each pipeline rank owns, chunk by chunk (:func:`planner.cost.pipeline.rank_chunks`)."""
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        return [[i for c in mine for i in range(starts[c], starts[c] + chunks[c])] for mine in self.placement]

    def _counts(self, layers: list[int], count: int) -> tuple[int, int, int, int]:
        """(dense blocks, MoE blocks, recomputed dense, recomputed MoE) of ``layers``, the first ``count``
        recomputed."""
        count = min(count, len(layers))
        n_moe = sum(self.kinds[i] for i in layers)
        r_moe = sum(self.kinds[i] for i in layers[:count])
        return len(layers) - n_moe, n_moe, count - r_moe, r_moe

    def stage_terms(self, rank: int, layers: list[int], kind: Recompute, count: int) -> StageTerms:
        """Terms of pipeline rank ``rank`` owning ``layers``, the first ``count`` of them recomputed as ``kind``."""
        n_dense, n_moe, r_dense, r_moe = self._counts(layers, count)
        return self.stage_terms_counts(rank, n_dense, n_moe, kind, r_dense, r_moe)

    def stage_memory(self, rank: int, layers: list[int], kind: Recompute, count: int) -> float:
        """``stage_terms(...).memory_bytes`` without the timing terms (for fit tests)."""
        n_dense, n_moe, r_dense, r_moe = self._counts(layers, count)
        return self.stage_memory_counts(rank, n_dense, n_moe, kind, r_dense, r_moe)

    def uniform_fits(self, chunks: list[int], kind: Recompute, count: int) -> bool:
        """Whether every rank fits with the same recompute choice on split ``chunks`` (memory only)."""
        return all(self.stage_memory(r, layers, kind, count) <= self.capacity
                   for r, layers in enumerate(self.rank_layers(chunks)))

    def stage_terms_counts(self, rank: int, n_dense: int, n_moe: int, kind: Recompute, r_dense: int,
                           r_moe: int) -> StageTerms:
        """As :meth:`stage_terms`, from counts: blocks of each kind and how many of each are recomputed. The
        timing depends on the rank only through whether it holds the embedding or the head, so it is kept per
        (first, last, counts, kind) for this layout (a split's middle ranks share it); the memory is the rank's."""
        if kind is Recompute.none:
            r_dense = r_moe = 0
        key = (rank == 0, rank == self.head_rank, n_dense, n_moe, kind, r_dense, r_moe)
        timing = self._timing.get(key)
        if timing is None:
            timing = self._timing[key] = self._stage_timing(key)
        layers = n_dense + n_moe
        return StageTerms(*timing, self._memory(rank, *self._held_for(key), layers), layers)

    def _held_for(self, key: tuple) -> tuple[float, float, float, float, float]:
        """:meth:`_holdings` of a rank with key (first, last, counts, kind): the rank matters no further."""
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = self._holdings(*key)
        return held

    def _stage_timing(self, key: tuple) -> tuple[float, float, float]:
        """(forward, backward, tail seconds) of a rank with key (first: it holds the embedding, last: the head,
        its block counts and recompute kind)."""
        first, last, n_dense, n_moe, kind, r_dense, r_moe = key
        f = b = 0.0
        for moe, n, rc in ((False, n_dense, r_dense), (True, n_moe, r_moe)):
            if n:
                kc = self.kind_cost[moe]
                f += n * kc.forward_s
                b += (n - rc) * kc.backward_s[Recompute.none] + rc * kc.backward_s[kind]
        dense, experts = self._held_for(key)[:2]
        layers = n_dense + n_moe
        f, b = rank_passes_s(f, b, first, last, self.emb, self.head, self.v, self.p2p_s)
        units = dp_units(self.layout, layers, first or last)
        x = dp_exposure(self.layout, self.cadence, *self.traffic(dense, experts, units, n_moe), units, f, b, self.eff)
        return f + x.exp_f, b + x.exp_b, x.step_s + self.optimizer_s(dense, experts)

    def _memory(self, rank: int, dense: float, experts: float, acts: float, transient: float, gather_biggest: float,
                layers: int) -> float:
        """Peak bytes of pipeline rank ``rank`` (as ``predict.stage_memory``): fixed terms plus, with the
        allocator's fragmentation, model states and the larger of the backward's holdings (activations of
        the micro-batches in flight, the full-recompute transient, the loss, the biggest block's buffers)
        and the optimizer step's temporaries."""
        per_mb = acts + (self.emb_act if rank == 0 else 0.0)
        loss = self.logits + self.root if rank == self.head_rank else 0.0
        act_phase = per_mb * self.in_flight[rank] + transient + loss
        if layers:
            act_phase += self.block_buffer * gather_biggest
        return peak_bytes(self.fixed, self.frag, dense * self._state_dense + experts * self._state_expert + act_phase,
                          dense * self._step_state[0] + experts * self._step_state[1])

    def stage_memory_counts(self, rank: int, n_dense: int, n_moe: int, kind: Recompute, r_dense: int,
                            r_moe: int) -> float:
        """``stage_terms_counts(...).memory_bytes`` without the timing terms (for fit tests)."""
        if kind is Recompute.none:
            r_dense = r_moe = 0
        key = (rank == 0, rank == self.head_rank, n_dense, n_moe, kind, r_dense, r_moe)
        return self._memory(rank, *self._held_for(key), n_dense + n_moe)

    def _holdings(self, first: bool, last: bool, n_dense: int, n_moe: int, kind: Recompute, r_dense: int,
                  r_moe: int) -> tuple[float, float, float, float, float]:
        """What a rank holds: (dense params, expert params, activations per micro-batch, the
        full-recompute transient, the biggest block's gathered params) — the embedding on the ``first`` rank
        and the head on the ``last`` included."""
        dense = experts = acts = transient = gather_biggest = 0.0
        for moe, n, rc in ((False, n_dense, r_dense), (True, n_moe, r_moe)):
            if n == 0:
                continue
            kc = self.kind_cost[moe]
            dense += n * kc.dense_params
            experts += n * kc.expert_params
            acts += (n - rc) * kc.activations[Recompute.none] + rc * kc.activations[kind]
            if rc:
                transient = max(transient, recompute_transient(kc.activations, kind))
            gather_biggest = max(gather_biggest, kc.gather_params)
        if first:
            dense += self.emb_params
        if last:
            dense += self.head_params
        return dense, experts, acts, transient, gather_biggest

    # -- a whole split ---------------------------------------------------------------------------
    def step_s(self, terms: list[StageTerms]) -> float:
        pipe, _ = pipeline_time_s(self.layout.schedule, [t.forward_s for t in terms], [t.backward_s for t in terms],
                                  self.m, self.v)
        return pipe + max(t.tail_s for t in terms)

    def evaluate(self, chunks: list[int], recompute: list[tuple[Recompute, int]]) -> tuple[float, list[StageTerms]]:
        """Step time and per-stage terms of one split (layers per chunk) and per-rank recompute choice."""
        terms = [self.stage_terms(r, layers, *recompute[r]) for r, layers in enumerate(self.rank_layers(chunks))]
        return self.step_s(terms), terms

    def fits(self, terms: list[StageTerms]) -> bool:
        return all(t.memory_bytes <= self.capacity for t in terms)

    def default_chunks(self) -> list[int]:
        return default_layer_split(self.model.num_layers, self.p * self.v)

    def stage_options(self, n_layers: int) -> list[tuple[Recompute, int]]:
        """Every recompute choice of a stage with ``n_layers`` layers: none, or 1..n of them selective / full."""
        return [(Recompute.none, 0)] + [(k, c) for k in self.recompute_kinds for c in range(1, n_layers + 1)]

    def fewest_recomputed(self, n_layers: int) -> list[tuple[Recompute, int]]:
        """For a single stage: none, and per recompute kind the smallest count that fits (bisection).

        Within a kind each more recomputed layer adds ``Δ`` to every micro-batch (``m·Δ``) and takes
        at most ``eff·Δ`` off the tail, so the step only grows with the count: these are the only
        candidates for the fastest choice."""
        out = [(Recompute.none, 0)]
        layers = list(range(n_layers))
        for kind in self.recompute_kinds:
            if self.stage_terms(0, layers, kind, n_layers).memory_bytes > self.capacity:
                continue
            lo, hi = 1, n_layers
            while lo < hi:
                mid = (lo + hi) // 2
                if self.stage_terms(0, layers, kind, mid).memory_bytes <= self.capacity:
                    hi = mid
                else:
                    lo = mid + 1
            out.append((kind, lo))
        return out

    def greedy(self, chunks: list[int]) -> tuple[float, list[StageTerms], list[tuple[Recompute, int]]] | None:
        """Per stage, the fastest recompute choice that fits its memory (a feasible upper bound), or None.

        Within one kind, more recomputed layers only add time and only save memory, so the fastest
        fitting choice of each kind is its smallest fitting count (found by bisection)."""
        choices, terms = [], []
        for r, layers in enumerate(self.rank_layers(chunks)):
            moe_prefix = [0]
            for i in layers:
                moe_prefix.append(moe_prefix[-1] + self.kinds[i])
            n, n_moe = len(layers), moe_prefix[-1]

            # the loop's values bound as defaults: both helpers are only called within this iteration
            def at(kind: Recompute, count: int, *, moe_prefix=moe_prefix, r=r, n=n, n_moe=n_moe) -> StageTerms:
                rm = moe_prefix[count]
                return self.stage_terms_counts(r, n - n_moe, n_moe, kind, count - rm, rm)

            def fits(kind: Recompute, count: int, *, moe_prefix=moe_prefix, r=r, n=n, n_moe=n_moe) -> bool:
                rm = moe_prefix[count]
                return self.stage_memory_counts(r, n - n_moe, n_moe, kind, count - rm, rm) <= self.capacity

            if fits(Recompute.none, 0):
                terms.append(at(Recompute.none, 0))
                choices.append((Recompute.none, 0))
                continue
            best = None
            for kind in self.recompute_kinds:
                if not fits(kind, n):
                    continue
                lo, hi = 1, n  # smallest count that fits
                while lo < hi:
                    mid = (lo + hi) // 2
                    if fits(kind, mid):
                        hi = mid
                    else:
                        lo = mid + 1
                t = at(kind, lo)
                if (best is None
                        or t.forward_s + t.backward_s + t.tail_s
                        < best[0].forward_s + best[0].backward_s + best[0].tail_s):
                    best = (t, (kind, lo))
            if best is None:
                return None
            terms.append(best[0])
            choices.append(best[1])
        return self.step_s(terms), terms, choices

    def min_memory(self, chunks: list[int]) -> float:
        """Memory of the most loaded stage with every layer fully recomputed (the least this split can need)."""
        return max(self.stage_terms(r, layers, Recompute.full, len(layers)).memory_bytes
                   for r, layers in enumerate(self.rank_layers(chunks)))

    def layout_for(self, chunks: list[int], recompute: list[tuple[Recompute, int]]) -> ParallelLayout:
        """The full layout of a solution: explicit split (None when it is the default one) and recompute."""
        kinds = {k for k, c in recompute if c > 0}
        update: dict = {"layers_per_stage": None if chunks == self.default_chunks() else list(chunks)}
        rank_sizes = [len(x) for x in self.rank_layers(chunks)]
        uniform = [((k, min(c, n)) if c > 0 else (Recompute.none, 0)) for (k, c), n in zip(recompute, rank_sizes)]
        if all(c == 0 for _, c in uniform):
            update["recompute"] = Recompute.none
        elif len(kinds) == 1 and all(c == n for (_, c), n in zip(uniform, rank_sizes)):
            update["recompute"] = kinds.pop()
        else:
            update["recompute_per_stage"] = [
                StageRecompute(kind=k if c > 0 else Recompute.none, num_layers=None if c == n else c)
                for (k, c), n in zip(uniform, rank_sizes)
            ]
            update["recompute"] = Recompute.none
        return self.layout.model_copy(update=update)


def recompute_bound_s(sm: StageModel) -> float:
    """Least recompute time (seconds per micro-batch, summed over ranks) any split needs to fit memory.

    Rank ``r`` keeping ``n`` blocks without recompute needs ``e_r + n·u_r`` bytes with
    ``u_r = states per block + in_flight_r · activations per block``: it holds ``(C - e_r)/u_r``
    blocks for free. The layers beyond what all ranks hold for free must shed
    ``u_r`` bytes each; recompute sheds at most ``ρ`` bytes (× in-flight) per second of extra
    backward, so each costs at least ``u_r / (in_flight_r · ρ)`` seconds, cheapest on the rank
    with the most micro-batches in flight. A relaxation (fractional layers, no transient, no
    gather buffers), so a valid lower bound.
    """
    per_state, per_state_e = sm._state_dense, sm._state_expert
    rho = 0.0
    for kc in sm.kind_cost.values():
        for kind in sm.recompute_kinds:
            extra = kc.backward_s[kind] - kc.backward_s[Recompute.none]
            saved = kc.activations[Recompute.none] - kc.activations[kind]
            if extra > 0 and saved > 0:
                rho = max(rho, saved / extra)
    free = 0.0
    marginal = math.inf
    for r in range(sm.p):
        fl = sm.in_flight[r]
        u = min(kc.dense_params * per_state + kc.expert_params * per_state_e + fl * kc.activations[Recompute.none]
                for kc in sm.kind_cost.values())
        e = 0.0
        if r == 0:
            e += sm.emb_params * per_state + fl * sm.emb_act
        if r == sm.head_rank:
            e += sm.head_params * per_state + sm.logits + sm.root
        free += max(0.0, (sm.alloc_capacity - e) / u) if u > 0 else math.inf
        if rho > 0:
            marginal = min(marginal, u / (fl * rho))
    excess = sm.model.num_layers - free
    if excess <= 0 or not math.isfinite(marginal):
        return 0.0
    return excess * marginal


def floor_states(sm: StageModel, zero_stages: Iterable[int], offload: bool) -> StageModel:
    """Make ``sm`` (a structure's frugal leaf) hold no more than any leaf of its structure: per parameter,
    the least backward-peak state bytes over the ZeRO stages and offload choices the search tries
    (pipelined ZeRO-2/3 hold gathered weights and unsharded gradients, so the highest stage is not always
    the least), no FSDP2 root unit held gathered (only resharded ZeRO-3 leaves hold one), and the largest
    allocator budget, and every recompute kind the target admits for one of them. Its bounds then bound every
    leaf (a fit test on it means nothing)."""
    lay, a = sm.layout, sm.profile.assumptions
    best_d = best_e = step_d = step_e = math.inf
    budget = sm.alloc_capacity
    kinds = set(sm.recompute_kinds)
    for zero in zero_stages:
        for off in ({False, offload} if zero >= 1 else {False}):
            kinds.update(admitted_recompute(sm.model, sm.training, lay.model_copy(
                update={"zero_stage": zero, "offload_optimizer": off}), sm.target))
            held = held_per_param(sm.state, zero, sm.shard_n, sm.expert_shard, off, True, lay.pp, sm.m,
                                  a.optimizer_temp_bytes_per_param, sm.master_in_param)
            (d, e), (sd, se) = held.backward, held.step
            best_d, best_e, step_d, step_e = min(best_d, d), min(best_e, e), min(step_d, sd), min(step_e, se)
        budget = max(budget, allocator_budget_bytes(sm.profile.device.memory_bytes, a,
                                                    lay.model_copy(update={"zero_stage": zero}),
                                                    memory_offset(sm.profile)))
    sm._state_dense, sm._state_expert, sm.alloc_capacity = best_d, best_e, budget
    sm._step_state = (step_d, step_e)
    sm.root = 0.0
    sm.recompute_kinds = tuple(k for k in RECOMPUTE_KINDS if k in kinds)
    return sm


def _optimizer_step_cap(sm: StageModel, kc: KindCost, rank: int) -> float:
    """Blocks of cost ``kc`` pipeline rank ``rank`` can hold through the optimizer step: its model states
    and the step's temporaries within the allocator's budget (``math.inf`` without temporaries)."""
    od, oe = sm._step_state
    fixed = (sm.emb_params if rank == 0 else 0.0) + (sm.head_params if rank == sm.head_rank else 0.0)
    per_block = kc.dense_params * od + kc.expert_params * oe
    room = sm.alloc_capacity - fixed * od
    if room < 0:
        return -1.0
    return room / per_block if per_block > 0 else math.inf


def memory_minmax_s(sm: StageModel, known: float = 0.0, gather_buffers: bool = True) -> float:
    """Lower bound on the slowest pipeline rank's ``F + B`` (one micro-batch) once every rank must
    fit its own memory; ``math.inf`` when no split fits at any speed.

    Rank ``r`` with fixed time ``x_r`` (sends, embedding, head) and fixed bytes ``e_r`` holds ``n``
    blocks of time ``t`` and bytes ``u_r = states + in_flight_r·activations`` within a time cap
    ``T`` and the capacity ``C`` iff some recompute count ``c`` (real, ``0 <= c <= n``) of a kind
    that adds ``Δ`` seconds and sheds ``s_r`` bytes per block satisfies
    ``e_r + n·u_r - c·s_r <= C`` and ``x_r + n·t + c·Δ <= T``; eliminating ``c`` gives
    ``n <= min(((T - x_r)/Δ + (C - e_r)/s_r) / (u_r/s_r + t/Δ), (C - e_r)/(u_r - s_r), (T - x_r)/t)``.
    ``T`` is feasible when the ranks' whole-block capacities add up to the blocks of the most
    common kind (the other kind counted as free). The smallest feasible ``T`` (found exactly, below) bounds
    any contiguous, interleaved or uneven split: layer order and integral recompute counts are
    relaxed away, so it never exceeds the true slowest rank. Charged as ``predict`` charges them:
    the ZeRO-3 gather buffer of a block of the counted kind (on a rank holding any) and, for full
    recompute, the transient of one block's activations. ``known``: a lower bound already known
    (the result is at least it). ``gather_buffers=False`` leaves the
    ZeRO-3 buffer out, for a bound that must also hold for the same layout below ZeRO-3.
    """
    n_moe = sum(sm.kinds)
    kind, n_major = (True, n_moe) if n_moe >= len(sm.kinds) - n_moe else (False, len(sm.kinds) - n_moe)
    kc = sm.kind_cost[kind]
    states = kc.dense_params * sm._state_dense + kc.expert_params * sm._state_expert
    a_none = kc.activations[Recompute.none]
    t = kc.forward_s + kc.backward_s[Recompute.none]
    # (Δ seconds, bytes shed per micro-batch in flight, transient bytes) per recompute kind: a fully
    # recomputed block rebuilds its activations for a moment
    options = [(kc.backward_s[r] - kc.backward_s[Recompute.none], a_none - kc.activations[r],
                recompute_transient(kc.activations, r)) for r in sm.recompute_kinds]
    options = [o for o in options if o[1] > 0]
    # ZeRO-3 gathers a whole block (double-buffered) on any rank that holds one
    gather_buffer = sm.block_buffer * kc.gather_params if gather_buffers else 0.0
    ranks = []
    capacity, inf = sm.alloc_capacity, math.inf
    send = 2 * sm.v * sm.p2p_s
    for r, fl in enumerate(sm.in_flight):
        x = send
        e = 0.0
        if r == 0:
            x += sum(sm.emb)
            e += sm.emb_params * sm._state_dense + fl * sm.emb_act
        if r == sm.head_rank:
            x += sum(sm.head)
            e += sm.head_params * sm._state_dense + sm.logits + sm.root
        if capacity - e < 0:
            return inf
        room = max(capacity - e - gather_buffer, 0.0)  # holding any block of this kind
        u = states + fl * a_none
        # the optimizer step holds the states and its temporaries: a cap on blocks whatever the recompute
        opt_cap = _optimizer_step_cap(sm, kc, r)
        # per recompute kind (Δ, s = fl·shed): the memory-only cap room/(u - s) and the joint cap
        # (slack/Δ + room/s)/(u/s + t/Δ) = (slack + Δ·room/s)/(Δ·u/s + t)
        caps = []
        for d, shed, transient in options:
            s_r, room_k = fl * shed, max(room - transient, 0.0)
            mem_cap = min(room_k / (u - s_r) if u > s_r else inf, opt_cap)
            caps.append((mem_cap, d * room_k / s_r, d * u / s_r + t) if d > 0 else (mem_cap, inf, 1.0))
        ranks.append((x, min(room / u if u > 0 else inf, opt_cap), caps))
    if n_major == len(sm.kinds) and any(max([plain, *(c[0] for c in caps)]) < sm.v - 1e-9 for _, plain, caps in ranks):
        return inf  # every chunk holds a block: a rank that cannot hold v of them fits no split

    # Rank r holds k blocks (``floor(n_r(T) + 1e-9) >= k``) from the cap ``T_r(k)`` on: its time
    # allows k blocks and it holds them without recompute (``plain``) or with some recompute kind
    # whose memory cap allows them and whose joint cap ``(T - x + alpha)/beta`` reaches k. ``T_r(k)``
    # grows with k, so a rank holds ``#{k : T_r(k) <= T}`` blocks, and the smallest feasible ``T``
    # is the ``n_major``-th smallest of all the ranks' thresholds (and at least every rank's fixed
    # time): exact, where a bisection would stop short of it.
    def threshold(x: float, plain: float, caps: list, k: int) -> float:
        kk = k - 1e-9
        need = x + t * kk if t > 0 else x
        if plain >= kk:
            return need
        joint = math.inf
        for mem_cap, alpha, beta in caps:
            if mem_cap >= kk:
                joint = min(joint, beta * kk - alpha)
        return max(need, x + joint)

    floor_x = max(x for x, *_ in ranks)
    if known >= floor_x and _holds(ranks, known, t, n_major):
        return known
    heap = [(threshold(x, plain, caps, 1), r, 1) for r, (x, plain, caps) in enumerate(ranks)]
    heapq.heapify(heap)
    found = math.inf
    replace, isfinite = heapq.heapreplace, math.isfinite
    for _ in range(n_major):
        found, r, k = heap[0]
        if not isfinite(found):
            return math.inf  # the ranks hold fewer than n_major blocks at any speed
        x, plain, caps = ranks[r]
        k += 1
        # threshold(x, plain, caps, k), inlined (the hot loop of the search)
        kk = k - 1e-9
        need = x + t * kk if t > 0 else x
        if not plain >= kk:
            joint = inf
            for mem_cap, alpha, beta in caps:
                if mem_cap >= kk:
                    j = beta * kk - alpha
                    if j < joint:  # noqa: PLR1730 - min()/max() are slower in this hot loop
                        joint = j
            j = x + joint
            if j > need:  # noqa: PLR1730
                need = j
        replace(heap, (need, r, k))
    exact = max(found, floor_x) * (1 - 1e-12)  # rounding may only lower it
    return max(known, exact)


def _holds(ranks: list, cap: float, t: float, n_major: int) -> bool:
    """Whether the ranks of :func:`memory_minmax_s` hold ``n_major`` blocks within ``cap`` (every
    rank's fixed time at most ``cap``): ``floor(n_r(cap) + 1e-9)`` summed, as its thresholds count."""
    total = 0
    for x, plain, caps in ranks:
        slack = cap - x
        best = plain
        for mem_cap, alpha, beta in caps:
            n = min(mem_cap, (slack + alpha) / beta)
            if n > best:
                best = n
        timed = slack / t if t > 0 else math.inf
        if timed < best:
            best = timed
        total += math.floor(best + 1e-9) if math.isfinite(best) else n_major
        if total >= n_major:
            return True
    return False


class SplitBound:
    """Lower bounds of a leaf over every split of its blocks, each pipeline rank at the fastest
    recompute choice that fits its own memory — exact per rank, where :func:`memory_minmax_s`
    relaxes layer order and integral counts. The blocks are one kind then the other
    (:func:`~planner.search.cpsat.layer_kind_prefix`), so whatever chunks a rank holds, its
    blocks are ``a`` of the first kind then ``b`` of the second, and recomputing ``c`` of them
    recomputes the first ``c`` in that order.

    ``cost(r, a, b)``: the least ``f + b`` (exposed per-micro-batch collectives included, as
    :meth:`StageModel.stage_terms_counts` prices them) of rank ``r`` holding ``a + b`` blocks, over
    the recompute choices that fit (``inf`` if none does). Within a recompute kind a larger count
    only adds backward time (``b + c - eff·min(c, b)`` grows with ``b``), so the smallest fitting
    count is the fastest; memory falls with the count except where a fully recomputed prefix first
    reaches the second kind (its transient may grow), so the smallest fitting count is bisected on
    each side of that point. ``cost`` grows when a rank gains a block (a choice that fits the larger
    holding, recomputing the same blocks, fits the smaller one and is no slower).

    :meth:`minmax_s` (``v = 1``): a cap ``T`` admits a contiguous split with empty ranks allowed iff
    taking, rank by rank, the furthest block that keeps ``cost <= T`` covers every block; the
    smallest such ``T`` (bisected) never exceeds the slowest rank of any real split.
    :meth:`two_rank_step_s`: two ranks, every split's (``v = 1``) or every holding's (interleaved)
    step bound.
    """

    def __init__(self, sm: StageModel) -> None:
        self.sm = sm
        kinds = sm.kinds
        self.n = len(kinds)
        self.first = kinds[0]
        self.n_first = next((i for i, k in enumerate(kinds) if k != self.first), self.n)
        self.memo: dict[tuple[int, int, int], float] = {}
        # recompute must shed memory for the monotonicity above; one kind, then the other
        self.sound = (all(kc.activations[k] <= kc.activations[Recompute.none]
                          for kc in sm.kind_cost.values() for k in sm.recompute_kinds)
                      and all(k != self.first for k in kinds[self.n_first:]))

    def _split(self, a: int, b: int, c: int) -> tuple[int, int, int, int]:
        """(dense, moe, recomputed dense, recomputed moe) of a rank holding a + b blocks, the first c recomputed."""
        ra = min(c, a)
        return (b, a, c - ra, ra) if self.first else (a, b, ra, c - ra)

    def range_counts(self, i: int, j: int) -> tuple[int, int]:
        """(first-kind, second-kind) blocks among ``i..j-1``."""
        a = max(0, min(j, self.n_first) - i)
        return a, j - i - a

    def cost(self, r: int, a: int, b: int) -> float:
        key = (r, a, b)
        found = self.memo.get(key)
        if found is not None:
            return found
        sm = self.sm
        n, cap = a + b, sm.capacity

        def mem(kind: Recompute, c: int) -> float:
            nd, nm, rd, rm = self._split(a, b, c)
            return sm.stage_memory_counts(r, nd, nm, kind, rd, rm)

        def time_of(kind: Recompute, c: int) -> float:
            nd, nm, rd, rm = self._split(a, b, c)
            t = sm.stage_terms_counts(r, nd, nm, kind, rd, rm)
            return t.forward_s + t.backward_s

        if mem(Recompute.none, 0) <= cap:
            best = time_of(Recompute.none, 0)
        else:
            best = math.inf
            # the full-recompute transient may grow once the recomputed prefix reaches the second kind
            for kind in sm.recompute_kinds:
                for lo, hi in ((1, a), (a + 1, n)):
                    if lo > hi or mem(kind, hi) > cap:
                        continue
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if mem(kind, mid) <= cap:
                            hi = mid
                        else:
                            lo = mid + 1
                    best = min(best, time_of(kind, lo))
                    break  # the first segment that fits holds the smallest fitting count
        self.memo[key] = best
        return best

    def admits(self, cap: float) -> bool:
        i, n = 0, self.n
        for r in range(self.sm.p):
            if self.cost(r, 0, 0) > cap:
                return False
            j = i  # the furthest end within the cap
            while j < n and self.cost(r, *self.range_counts(i, j + 1)) <= cap:
                j += 1
            i = j
        return i == n

    def minmax_s(self, lo: float, hi: float, rel: float = 1e-6) -> float:
        """``v = 1``: the smallest admitted cap, to ``rel`` (from below); ``lo``: a lower bound
        already known (returned when it is admitted), ``hi``: the slowest rank of some split that fits."""
        if self.sm.v != 1 or not self.sound or not math.isfinite(hi) or lo >= hi * (1 - rel):
            return lo
        if self.admits(lo):
            return lo
        while hi - lo > rel * hi:
            mid = (lo + hi) / 2
            if self.admits(mid):
                hi = mid
            else:
                lo = mid
        return lo

    def _most(self, r: int, cap: float, second: bool) -> int:
        """The most blocks of one kind (the other none) rank ``r`` holds within ``cap`` (``cost`` grows with them)."""
        lo, hi = 0, (self.n - self.n_first) if second else self.n_first
        at = (lambda k: self.cost(r, 0, k)) if second else (lambda k: self.cost(r, k, 0))
        if at(hi) <= cap:
            return hi
        while lo < hi:  # at(lo) <= cap < at(hi + 1)
            mid = (lo + hi + 1) // 2
            if at(mid) <= cap:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def holds_all(self, cap: float) -> bool:
        """Whether ranks within ``cap`` hold, any way the blocks are dealt out, as many blocks of each
        kind as there are: each rank holding only that kind holds the most (any holding of both
        kinds costs at least its part of either), so both sums must reach the counts."""
        for r in range(self.sm.p):
            if self.cost(r, 0, 0) > cap:
                return False
        for second, need in ((False, self.n_first), (True, self.n - self.n_first)):
            if need and sum(self._most(r, cap, second) for r in range(self.sm.p)) < need:
                return False
        return True

    def holding_minmax_s(self, lo: float, hi: float, rel: float = 1e-6) -> float:
        """Any ``v``: the smallest cap :meth:`holds_all` admits, to ``rel`` (from below) — a lower
        bound of the slowest rank of every split (interleaved: whatever chunks a rank holds)."""
        if not self.sound or not math.isfinite(hi) or lo >= hi * (1 - rel):
            return lo
        if self.holds_all(lo):
            return lo
        while hi - lo > rel * hi:
            mid = (lo + hi) / 2
            if self.holds_all(mid):
                hi = mid
            else:
                lo = mid
        return lo

    def _ends(self, r: int, a: int, b: int) -> tuple[float, float]:
        """(forward, least tail) of rank ``r`` holding ``a + b`` blocks: the forward (its exposed
        gathers included) does not depend on recompute; the tail only falls as the backward window
        grows with the recompute count, so its least value is at none or at every block recomputed."""
        sm = self.sm
        nd, nm, _, _ = self._split(a, b, 0)
        plain = sm.stage_terms_counts(r, nd, nm, Recompute.none, 0, 0)
        tail = plain.tail_s
        for kind in sm.recompute_kinds:
            tail = min(tail, sm.stage_terms_counts(r, nd, nm, kind, nd, nm).tail_s)
        return plain.forward_s, tail

    def two_rank_step_s(self, cutoff: float) -> float:
        """Two pipeline ranks: below ``cutoff``, one split's lower bound (found first, not the least);
        else every split's step, whatever its recompute, is at least ``cutoff``. With no cutoff
        (``math.inf``): the least bound over the splits.

        ``v = 1``: every contiguous split; interleaved: every holding ``(a_0, b_0)`` of rank 0 with
        at least ``v`` blocks per rank (a relaxation of the chunk sizes). Each rank is at least its
        fastest fitting ``T_r = cost(r, ...)`` and its forward ``f_r`` is fixed; 1F1B/GPipe
        ``(m-1)·max T + Σ T`` and interleaved ``m·max T + (Σ T - max T)/v`` grow with every
        ``T_r``; zero-bubble ``m·T* + Σ_{i≠i*} f_i >= m·max_r T_r + Σf - max f``; plus the larger
        of the ranks' least tails."""
        sm, n, m, v = self.sm, self.n, self.sm.m, self.sm.v
        if sm.p != 2 or not self.sound:
            return -math.inf
        facts = SCHEDULES[sm.layout.schedule]
        A, B = self.n_first, n - self.n_first
        # rows of holdings along which rank 0 gains one block at a time (so its cost grows and rank
        # 1's falls): v = 1, the split point; interleaved, the second-kind blocks at each first-kind count
        if v == 1:
            rows = [[self.range_counts(0, k) for k in range(1, n)]]
        else:
            rows = [[(a, b) for b in range(B + 1) if v <= a + b <= n - v] for a in range(A + 1)]
        factor = facts.max_factor(m)  # the pipeline term is at least factor · max T
        best = math.inf
        for row in rows:
            if not row:
                continue
            lo, hi = 0, len(row) - 1
            if factor > 0 and math.isfinite(cutoff):
                # only the holdings whose slowest rank is below cutoff/factor can bound below it
                limit = cutoff / factor

                def t1_ok(i: int, row: list = row, limit: float = limit) -> bool:
                    return self.cost(1, A - row[i][0], B - row[i][1]) < limit

                def t0_ok(i: int, row: list = row, limit: float = limit) -> bool:
                    return self.cost(0, *row[i]) < limit

                lo = _first_true(lo, hi, t1_ok)  # rank 1 falls along the row
                hi = _last_true(lo, hi, t0_ok)  # rank 0 grows along it
                if lo > hi:
                    continue
            mid = len(row) / 2
            for i in sorted(range(lo, hi + 1), key=lambda i: abs(i - mid)):  # the even ones first: they decide early
                a0, b0 = row[i]
                t0, t1 = self.cost(0, a0, b0), self.cost(1, A - a0, B - b0)
                if not (math.isfinite(t0) and math.isfinite(t1)):
                    continue
                top = max(t0, t1)
                if factor * top >= min(best, cutoff):
                    continue  # its pipeline term alone reaches the cutoff (or the best so far)
                (f0, tail0), (f1, tail1) = self._ends(0, a0, b0), self._ends(1, A - a0, B - b0)
                best = min(best, facts.two_rank_floor(t0, t1, f0, f1, m, v) + max(tail0, tail1))
                if best < cutoff < math.inf:
                    return best
        return best


def _first_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The first index in ``lo..hi`` where ``ok`` (false, then true) holds; ``hi + 1`` if none."""
    if not ok(hi):
        return hi + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _last_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The last index in ``lo..hi`` where ``ok`` (true, then false) holds; ``lo - 1`` if none."""
    if lo > hi or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo




def work_floor_s(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, tp: int, sp: bool, cp: int,
                 ep: int, batch: int, tp_overlap: bool, ep_overlap: bool, cache: dict, etp: int | None = None) -> float:
    """A lower bound of a structure shape's whole-model forward + backward (no recompute) for one
    micro-batch, :attr:`~planner.search.enumerate.Structure.work_s`, without building a layout: per
    block, the GEMMs, the attention core and the context-parallel collectives exactly as
    ``block_cost`` computes them (same functions, same arguments, groups from the same mesh
    placement), the TP and EP collectives less the most an overlap could hide; the memory-bound
    ops, kernel launches, embedding and head (all >= 0) are left out. Lowered by 1e-9 relative
    against float re-association. Memoised in ``cache``: the parts that do not depend on sp or ep
    once per (tp, cp, micro-batch). ``etp``: the experts' TP degree when folded (None: tp)."""
    etp = None if etp == tp else etp
    key = ("work-floor", tp, sp, cp, ep, etp, batch, tp_overlap, ep_overlap)
    got = cache.get(key)
    if got is not None:
        return got
    kinds_key = ("kinds", id(model))
    if kinds_key not in cache:
        cache[kinds_key] = (model, [model.is_moe_layer(i) for i in range(model.num_layers)])
    kinds = cache[kinds_key][1]
    base_key = ("work-floor-base", tp, cp, batch)
    base = cache.get(base_key)
    if base is None:
        mb = MicroBatch(batch, training.seq_length, cp, tp, False, training.precision, training.flash_attention,
                        training.moe_load_imbalance)
        base = cache[base_key] = {kind: (kinds.count(kind), *_block_floor_base(model, profile, kinds.index(kind), mb))
                                  for kind in sorted(set(kinds))}
    h, elt = model.hidden_size, training.precision.bytes
    tokens = batch * (training.seq_length // cp)
    tp_key = ("work-floor-tp", tp, sp, tokens, tp_overlap)  # shared by every ep
    tp_s = cache.get(tp_key)
    if tp_s is None:
        tp_s = cache[tp_key] = _tp_floor_s(profile, tp, sp, tokens * h * elt, tp_overlap)
    total = 0.0
    for count, fixed, moe in base.values():
        per = fixed + tp_s
        if moe is not None:
            mb = MicroBatch(batch, training.seq_length, cp, tp, sp, training.precision, training.flash_attention,
                            training.moe_load_imbalance, etp)
            gemms, a2a_s = _moe_floor_s(model, training, profile, moe, mb, ep, ep_overlap, cache)
            # the routed experts leave the attention's TP pairs (the floor is linear in them)
            per = fixed + tp_s * tp_pairs(model, True, mb) / 2
            per += gemms
            per += a2a_s
        total += count * per
    # on a calibrated profile each piece above is its term's factor times itself (PassCost.calibrated): the
    # smallest factor of those terms keeps the floor below (a run calibration's factors are never all 1 there)
    scale = min(profile.term_factor(t) for t in ("gemm", "attention", "tp", "cp", "ep")) \
        if profile.calibration is not None else 1.0
    cache[key] = total * scale * (1 - 1e-9)
    return cache[key]


def _moe_floor_s(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, moe: MoESpec,
                 mb: MicroBatch, ep: int, ep_overlap: bool, cache: dict) -> tuple[float, float]:
    """(routed experts' GEMMs, exposed dispatch/combine all-to-all and, with folded experts, their own
    TP all-gather/reduce-scatter less the most an overlap hides: 0 without EP) of an MoE block,
    forward + backward, as ``block_cost`` computes them, for :func:`work_floor_s`. Memoised in
    ``cache``: the GEMMs per (tp, etp, tokens, ep), shared by sp on and off."""
    tp, etp, sp, tokens = mb.tp, mb.etp, mb.sp, mb.tokens
    key = ("work-floor-moe", tp, etp, sp, tokens, ep, ep_overlap)
    got = cache.get(key)
    if got is not None:
        return got
    routed = routed_token_count(moe, tokens, training.moe_load_imbalance)
    gemm_key = ("work-floor-experts", tp, etp, tokens, ep)
    gemms = cache.get(gemm_key)
    if gemms is None:
        gemms = cache[gemm_key] = sum(routed_expert_gemms(profile, model, moe, mb, ep))
    a = profile.assumptions
    hide = a.async_overlap_efficiency if ep_overlap else 0.0
    comm_s = 0.0
    gpn, elt = profile.gpus_per_node, training.precision.bytes
    if ep > 1:
        size = routed * model.hidden_size * elt / (tp if sp else 1)
        a2a = 2 * collective_time_s(profile, Collective.all_to_all, placement(ep, mb.expert_tp, gpn), size)
        comm_s = 2 * max(a2a - hide * a2a, 0.0)
    if mb.sp and mb.expert_tp > 1:
        size = expert_rows(moe, mb) * model.hidden_size * elt
        group = placement(mb.expert_tp, 1, gpn)
        pair = (collective_time_s(profile, Collective.all_gather, group, size)
                + collective_time_s(profile, Collective.reduce_scatter, group, size))
        comm_s += 2 * max(pair - hide * pair, 0.0)
    cache[key] = (gemms, comm_s)
    return cache[key]


def _tp_floor_s(profile: ClusterProfile, tp: int, sp: bool, size: float, tp_overlap: bool) -> float:
    """The exposed TP collectives of a block, forward + backward, for :func:`work_floor_s`: at least
    the total less the most an overlap hides (``size``: bytes of the block's activations)."""
    a, gpn = profile.assumptions, profile.gpus_per_node
    tp_s = 0.0
    if tp > 1:  # exposed TP of a block (same for every kind): at least the total less the most an overlap hides
        tp_group = placement(tp, 1, gpn)
        decomposed = a.tp_overlap_efficiency if tp_overlap else 0.0
        if sp:
            gather = collective_time_s(profile, Collective.all_gather, tp_group, size)
            scatter = collective_time_s(profile, Collective.reduce_scatter, tp_group, size)
            tp_fwd = 2 * (gather + scatter)
            beside_wgrad, critical, beside_dgrad = 2 * scatter, 2 * gather, 2 * gather
        else:
            tp_fwd = 2 * collective_time_s(profile, Collective.all_reduce, tp_group, size)
            beside_wgrad, critical, beside_dgrad = tp_fwd, 0.0, 0.0
        back = beside_wgrad + critical + beside_dgrad
        tp_s = (max(tp_fwd - decomposed * tp_fwd, 0.0)
                + max(back - max(a.async_overlap_efficiency * (beside_wgrad + beside_dgrad), decomposed * back), 0.0))
    return tp_s


def _block_floor_base(model: ModelSpec, profile: ClusterProfile, index: int, mb: MicroBatch) -> tuple[float, object]:
    """(the GEMMs but the routed experts', the attention core and the CP collectives of block
    ``index``, forward + backward, as ``planner.cost.layer.block_cost`` computes them; its MoE
    spec or None): the part of :func:`work_floor_s` that depends on neither sp nor ep."""
    t, h, tokens, elt = mb.tp, model.hidden_size, mb.tokens, mb.elt
    total = sum(_attention_gemms(profile, model, tokens, t, mb.precision))
    moe = model.moe if model.is_moe_layer(index) else None
    if moe is None:
        total += sum(_mlp_gemms(profile, model, tokens, model.ffn_hidden_size, t, mb.precision))
    else:
        total += sum(gemm_fwd_bwd_s(profile, tokens, moe.num_experts, h, Precision.bf16))
        if moe.num_shared_experts:
            total += sum(_mlp_gemms(profile, model, tokens, moe.shared_ffn, t, mb.precision, moe.num_shared_experts))
    heads = max(model.num_attention_heads // t, 1)
    kv_heads = heads if model.mla is not None else max(model.kv_heads // t, 1)
    total += attention_window_share(model, mb.seq) * sum(attention_time_s(
        profile, batch=mb.batch, q_len=mb.local_seq, kv_len=mb.seq, heads=heads, kv_heads=kv_heads,
        qk_dim=model.head_size, v_dim=model.value_head_size, precision=mb.precision, causal=True, flash=mb.flash))
    if mb.cp > 1:  # not overlapped
        kv_dim = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim if model.mla else kv_heads * (
            model.head_size + model.value_head_size)
        size = mb.batch * mb.seq * kv_dim * elt
        cp_group = placement(mb.cp, t, profile.gpus_per_node)
        total += collective_time_s(profile, Collective.all_gather, cp_group, size)
        total += collective_time_s(profile, Collective.reduce_scatter, cp_group, size)
    return total, moe

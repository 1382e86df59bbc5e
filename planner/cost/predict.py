"""Predict one training step of a given layout: step time, throughput, MFU, memory, communication.

The step is ``pipeline(forward/backward of each stage) + max over stages (exposed data-parallel
communication + optimizer step)``. Every number comes from a named function of
``planner.cost``; this module only checks the layout and adds them up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.contracts import (
    ClusterProfile,
    Collective,
    CommTime,
    MemoryBreakdown,
    ModelSpec,
    ParallelLayout,
    Precision,
    Prediction,
    Recompute,
    StagePrediction,
    TrainingConfig,
)
from planner.contracts.cluster import RunCalibration, slow_device_limit
from planner.contracts.report import STEP_TERMS
from planner.cost.checks import check_layout
from planner.cost.comm import (
    call_latency_s,
    collective_time_s,
    mesh_groups,
    placement,
)
from planner.cost.compute import device_pace, peak_flops
from planner.cost.flops import model_flops_per_step, recompute_flops
from planner.cost.layer import BlockCost, MicroBatch, PassCost, block_cost, embedding_cost, lm_head_cost
from planner.cost.memo import memo_for, memoised
from planner.cost.memory import (
    ActivationShape,
    activation_factor,
    bucket_bytes_per_param,
    compute_copy_bytes_per_param,
    fixed_terms,
    fragmentation_share,
    held_gradient_bytes_per_param,
    kept_gathered_bytes_per_param,
    kind_factor,
    layer_activation_bytes,
    logits_bytes,
    memory_offset,
    model_state_bytes,
    optimizer_step_bytes_per_param,
    prefetch_bytes_per_param,
    recompute_transient,
    root_gathered_bytes_per_param,
    state_bytes_per_param,
    usable_bytes,
)
from planner.cost.params import dense_per_tp_rank, embedding_params, head_per_tp_rank, layer_params
from planner.cost.pipeline import (
    SCHEDULES,
    head_rank,
    microbatches_in_flight,
    pipeline_time_s,
    rank_layers,
)
from planner.cost.stage import dp_exposure, local_params, optimizer_step_s, peak_bytes, pipeline_send_s, rank_passes_s
from planner.errors import AutoparError

if TYPE_CHECKING:
    from planner.targets import TargetFacts


def expert_split(layout: ParallelLayout) -> int:
    """Ranks one routed expert layer's weights are split over: ``ep x etp`` (``tp x ep`` with etp = tp)."""
    return layout.expert_tp * layout.ep


@dataclass
class _Stage:
    layers: list[int]  # block indices this pipeline rank owns (all of its chunks)
    first: bool
    last: bool
    recompute: list[Recompute]  # per owned block


def _stages(model: ModelSpec, layout: ParallelLayout) -> list[_Stage]:
    p, v = layout.pp, layout.virtual_stages
    last = head_rank(layout.schedule, p, v)
    stages = []
    for rank, layers in enumerate(rank_layers(layout, model.num_layers)):
        if layout.recompute_per_stage is not None:
            choice = layout.recompute_per_stage[rank]
            n = len(layers) if choice.num_layers is None else min(choice.num_layers, len(layers))
            recompute = [choice.kind] * n + [Recompute.none] * (len(layers) - n)
        else:
            recompute = [layout.recompute] * len(layers)
        stages.append(_Stage(layers, rank == 0, rank == last, recompute))
    return stages


@dataclass
class DPTraffic:
    """Data-parallel traffic of one pipeline stage (seconds and bytes on the critical rank)."""

    grad_s: float = 0.0  # gradient reduction within the shard group (all-reduce for ZeRO-0)
    grad_bytes: float = 0.0
    replica_s: float = 0.0  # HSDP: all-reduce of the gradient shard across replicas, once per step
    gather_s: float = 0.0  # one all-gather of the 16-bit weights (ZeRO >= 1)
    gather_bytes: float = 0.0
    units: int = 1  # calls the dense weights' reduce-scatter (ZeRO-2/3) and gather (ZeRO-3) each take


def dp_units(layout: ParallelLayout, blocks: int, holds_root: bool) -> int:
    """Calls a stage's ZeRO-2/3 reduce-scatter (and ZeRO-3 all-gather) of its dense weights takes: one
    per FSDP unit. FSDP wraps each transformer block as a unit and gathers / reduce-scatters it alone (Zhao et al.
    2023, PyTorch FSDP, §3.2-3.3: llm-foundry's FSDP1 auto-wrap, torchtitan's and the autopar executor's
    FSDP2 ``fully_shard`` per block), the embedding, final norm and head in the root unit(s): ``blocks + 1``
    on a stage holding any of them. ZeRO-0/1 reduce and gather in buckets: one call per step (DeepSpeed
    ZeRO-2's 5e8-element buckets and ZeRO-3's per-sub-module fetches are not modelled apart)."""
    if layout.zero_stage < 2:
        return 1
    return max(blocks + (1 if holds_root else 0), 1)


def dp_cadence(layout: ParallelLayout) -> tuple[int, bool]:
    """(ZeRO-3 gathers per micro-batch, gradients reduced every micro-batch) of a layout; 0 gathers per
    micro-batch: once per step.

    Without a pipeline every framework here reduce-scatters ZeRO-2/3 gradients each micro-batch: Composer
    (llm-foundry) skips the sync only for DDP (``ddp_sync_context`` yields for FSDP), torchtitan calls no
    ``set_requires_gradient_sync`` in its accumulation loop, DeepSpeed ZeRO-2/3 has no ``no_sync``; and
    ZeRO-3 gathers before each forward and, resharding, again before backward. Under a pipeline torch's
    stages turn FSDP's gradient sync and resharding after backward off until the last micro-batch
    (``torch.distributed.pipelining`` stage.py; as ``memory.held_gradient_bytes_per_param`` and
    ``kept_gathered_bytes_per_param`` hold them): one reduce-scatter per step, and weights stay gathered
    after each backward, so only resharding after forward gathers again, once per micro-batch."""
    if layout.pp > 1:
        return (1 if layout.zero_stage == 3 and layout.reshard_after_forward else 0), False
    gathers = (2 if layout.reshard_after_forward else 1) if layout.zero_stage == 3 else 0
    return gathers, layout.zero_stage >= 2


def _in_calls(profile: ClusterProfile, collective: Collective, group, nbytes: float, calls: int) -> float:
    """``nbytes`` moved in ``calls`` collectives: the bytes once, the per-call latency ``calls`` times
    (priced on the link segment of the whole ``nbytes``)."""
    t = collective_time_s(profile, collective, group, nbytes)
    return t + (calls - 1) * call_latency_s(profile, collective, group, nbytes) if calls > 1 and t else t


def dp_traffic(
    profile: ClusterProfile, layout: ParallelLayout, training: TrainingConfig, params: float, expert_params: float,
    units: int = 1, expert_units: int = 1,
) -> DPTraffic:
    """Data-parallel collectives of one stage holding ``params`` dense and ``expert_params`` expert weights.

    Gradients are reduced over every rank holding the same weights: the ``dp × cp`` ranks for
    dense weights (stride tp), the expert data-parallel ranks for experts: ``edp = dp_shard·cp·tp /
    (ep·etp)`` per replicate group (``ParallelLayout.expert_dp``; ``dp_shard·cp/ep`` when etp = tp),
    stride ``ep·etp`` (experts are ranked (edp, ep, etp), etp innermost). ZeRO-0: all-reduce.
    ZeRO-1/2/3: reduce-scatter over the shard group, all-reduce of the shard across replicas (HSDP),
    all-gather of the 16-bit weights. ZeRO-2/3's reduce-scatter and ZeRO-3's gather take ``units`` calls
    for the dense weights and ``expert_units`` for the experts (:func:`dp_units`; one per MoE block): each
    call pays the latency, which at hundreds of ranks is the ring's ``n - 1`` steps
    (:func:`planner.cost.comm.extra_ring_latency_s`).
    """
    state = state_bytes_per_param(training)
    gpn, tp = profile.gpus_per_node, layout.tp
    replicas = placement(layout.dp_replicate, tp * layout.cp * layout.dp_shard, gpn)
    per_call = layout.zero_stage >= 2
    out = DPTraffic(units=max(units, 1) if per_call else 1)
    for count, shard, stride, calls in (
        (params, layout.dp_shard * layout.cp, tp, out.units),
        (expert_params, layout.expert_dp, layout.ep * layout.expert_tp, max(expert_units, 1) if per_call else 1),
    ):
        if count <= 0:
            continue
        grad_bytes, weight_bytes = count * state.grads, count * state.weights
        out.grad_bytes += grad_bytes
        if layout.zero_stage == 0:
            everyone = placement(shard * layout.dp_replicate, stride, gpn)
            out.grad_s += collective_time_s(profile, Collective.all_reduce, everyone, grad_bytes)
            continue
        group = placement(shard, stride, gpn)
        out.grad_s += _in_calls(profile, Collective.reduce_scatter, group, grad_bytes, calls)
        out.replica_s += collective_time_s(profile, Collective.all_reduce, replicas, grad_bytes / shard)
        out.gather_s += _in_calls(profile, Collective.all_gather, group, weight_bytes,
                                  calls if layout.zero_stage == 3 else 1)
        out.gather_bytes += weight_bytes
    if profile.calibration is not None:  # the cluster's own runs (ClusterProfile.term_factor)
        out.grad_s *= profile.term_factor("dp_grad")
        out.replica_s *= profile.term_factor("dp_grad")
        out.gather_s *= profile.term_factor("dp_param")
    return out


def stage_memory(profile: ClusterProfile, training: TrainingConfig, layout: ParallelLayout, stage: int, *,
                 dense: float, experts: float, activations: float, biggest_block: float, loss: float,
                 accumulates: bool = True, master_in_param: bool = False, root_params: float = 0.0) -> MemoryBreakdown:
    """Peak device memory of pipeline rank ``stage`` holding ``dense`` and ``experts`` parameters (after TP, EP x ETP)
    and ``activations`` bytes, with named terms beside the tensors (:data:`MEMORY_TERMS`).

    ``allocated = states + max(activations + loss + block buffers + kept-gathered weights, optimizer
    temporaries)``; ``total = runtime + communicators + reserved + allocated·(1 + fragmentation)``; it fits
    when ``total <= capacity·(1 - memory_headroom)``. Without accumulation (one micro-batch a step) the
    gradients are made as the activations are freed: they join the optimizer step's side only.
    ``master_in_param``: the target's parameters are the fp32 master (``TargetFacts.master_in_param``): states
    and the 16-bit ``compute_copies`` as :func:`~planner.cost.memory.model_state_bytes` counts them.
    ``root_params``: the target's FSDP2 units beside the blocks held gathered (``TargetFacts.fsdp_root``)."""
    a, zero, reshard = profile.assumptions, layout.zero_stage, layout.reshard_after_forward
    state = state_bytes_per_param(training)
    shard_n = layout.dp_shard * layout.cp
    w1, g1, o1 = model_state_bytes(dense, state, zero, shard_n, layout.offload_share, master_in_param)
    w2, g2, o2 = model_state_bytes(experts, state, zero, layout.expert_dp, layout.offload_share, master_in_param)
    states = w1 + w2 + g1 + g2 + o1 + o2
    copies = (dense + experts) * compute_copy_bytes_per_param(zero, state, master_in_param, layout.offload_share)
    pp = layout.pp
    gathered = (dense + experts) * kept_gathered_bytes_per_param(zero, reshard, pp, state)
    gathered += biggest_block * prefetch_bytes_per_param(zero, reshard, pp, state)
    bucket = biggest_block * bucket_bytes_per_param(zero, pp, state)
    root = root_params * root_gathered_bytes_per_param(zero, reshard, pp, state)
    held = (dense + experts) * held_gradient_bytes_per_param(zero, pp, state)
    late_grads = 0.0 if accumulates else -(g1 + g2)
    act_phase = activations + loss + copies + gathered + root + bucket + held + late_grads
    opt_temp = (1.0 - layout.offload_share) * local_params(
        dense, experts, zero, shard_n, layout.expert_dp) * a.optimizer_temp_bytes_per_param
    terms = {"loss": loss, "compute_copies": copies, "gathered_weights": gathered, "root_weights": root,
             "gradient_bucket": bucket,
             "held_gradients": held,
             "gradients_after_peak": late_grads,
             "optimizer_step": max(0.0, opt_temp - act_phase)}
    frag, fixed = fragmentation_share(a, zero), fixed_terms(a, layout, memory_offset(profile))
    total = peak_bytes(sum(fixed.values()), frag, states + act_phase, states + opt_temp)
    terms["fragmentation"] = (states + act_phase + terms["optimizer_step"]) * frag
    terms.update(fixed)
    cap = profile.device.memory_bytes
    usable = usable_bytes(cap, a)
    return MemoryBreakdown(
        params_bytes=int(w1 + w2), grads_bytes=int(g1 + g2), optimizer_bytes=int(o1 + o2),
        activations_bytes=int(activations), buffers_bytes=int(total - states - activations), total_bytes=int(total),
        capacity_bytes=cap, fits=total <= usable, stage=stage, terms={k: int(v) for k, v in terms.items() if v},
        headroom_bytes=int(cap - usable),
    )


def mfu_peak_flops(profile: ClusterProfile) -> float:
    """The peak MFU and HFU are against: the dense 16-bit peak, or the fp32 one where that is faster
    (a CPU without native bf16 runs bf16 matmuls 4-70x slower than fp32, by operand layout and shape
    on an AVX2 VM: its bf16 "peak" would put an fp32 run's MFU above 100%)."""
    fp32 = profile.device.peak_tflops.get(Precision.fp32)
    return max(peak_flops(profile, Precision.bf16), (fp32 or 0.0) * 1e12)


def predict(
    model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout, *,
    target: str = "autopar",
) -> Prediction:
    """Predict one optimizer step of ``model`` trained with ``training`` on ``profile`` under ``layout`` as
    ``target`` runs it (its loss memory and model states: :class:`planner.targets.TargetFacts`), with the
    interval and blind-spot notes of its regime (:func:`planner.uncertainty.assess`)."""
    from planner import targets
    from planner.uncertainty import assess

    facts = targets.target_facts(target)
    profile = targets.priced_profile(profile, target, training.precision)
    target = getattr(target, "value", target)
    if memo_for(profile) is None:  # the profile is held unchanged for the call: its lookups may be kept
        with memoised(profile):
            return assess(_predict(model, training, profile, layout, facts), model, training, profile, layout,
                          target)
    return assess(_predict(model, training, profile, layout, facts), model, training, profile, layout, target)


@dataclass
class _Step:
    """One prediction's inputs and the per-kind costs its parts share (every block of one kind, dense or
    MoE, costs the same: each quantity is computed once per kind)."""

    model: ModelSpec
    training: TrainingConfig
    profile: ClusterProfile
    layout: ParallelLayout
    m: int  # micro-batches per step (per data-parallel pipeline)
    groups: dict
    mb: MicroBatch
    kinds: list[bool]
    loss_per_logit: float = 0.0  # bytes per logit of the target's loss (TargetFacts.loss)
    master_in_param: bool = False  # TargetFacts.master_in_param
    root_params: float = 0.0  # TargetFacts.fsdp_root
    fp8_inputs: bool = False  # TargetFacts.fp8_inputs: saved inputs in FP8
    _blocks: dict = field(default_factory=dict)
    _params: dict = field(default_factory=dict)
    _acts: dict = field(default_factory=dict)

    def block(self, i: int) -> BlockCost:
        key = self.kinds[i]
        if key not in self._blocks:
            self._blocks[key] = block_cost(self.profile, self.model, i, self.mb, self.layout, self.groups)
        return self._blocks[key]

    def params_of(self, i: int) -> tuple[int, int]:
        key = self.kinds[i]
        if key not in self._params:
            self._params[key] = layer_params(self.model, i)
        return self._params[key]

    def dense_of(self, i: int) -> float:
        """Block ``i``'s non-expert parameters on one TP rank (norms and router whole)."""
        key = ("rank", self.kinds[i])
        if key not in self._params:
            self._params[key] = dense_per_tp_rank(self.model, i, self.layout.tp)
        return self._params[key]

    def activations_of(self, i: int, recompute: Recompute) -> float:
        key = (self.kinds[i], recompute)
        if key not in self._acts:
            t, lay = self.training, self.layout
            shape = ActivationShape(lay.micro_batch_size, self.mb.local_seq, t.seq_length, lay.tp, lay.sp, self.mb.etp,
                                    lay.ep)
            self._acts[key] = layer_activation_bytes(self.model, i, shape, recompute, flash=t.flash_attention,
                                                     elt=t.precision.bytes,
                                                     fp8=self.fp8_inputs,
                                                     moe_imbalance=t.moe_load_imbalance)
        return self._acts[key]


@dataclass
class _Times:
    """Per pipeline rank: forward and backward seconds of one micro-batch, and the parameters it holds."""

    fwd_s: list[float]
    bwd_s: list[float]
    dense: list[float]  # parameters after TP
    experts: list[float]  # routed-expert parameters after EP and ETP
    ends: tuple[PassCost, PassCost, PassCost, PassCost]  # embedding forward/backward, head forward/backward
    p2p_s: float
    p2p_bytes: float


def _new_step(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout,
              facts: TargetFacts) -> _Step:
    m = check_layout(model, training, layout, profile.num_gpus)
    if training.precision is Precision.fp8 and Precision.fp8 not in profile.device.peak_tflops:
        raise AutoparError("precision", "fp8", "train in bf16 on this GPU, or use a GPU with FP8 (Hopper or later)",
                           problem=f"needs FP8 tensor cores, which {profile.device.name} does not have")
    mb = MicroBatch.of(layout, training)
    own = facts.loss(layout)
    return _Step(model, training, profile, layout, m, mesh_groups(layout, profile.gpus_per_node), mb,
                 [model.is_moe_layer(i) for i in range(model.num_layers)],
                 profile.assumptions.loss_bytes_per_logit if own is None else own, facts.master_in_param,
                 facts.fsdp_root(model, layout.tp), facts.fp8_inputs(training))


def _stage_times(c: _Step, stages: list[_Stage]) -> _Times:
    """Each rank's forward and backward (its blocks, the embedding or head, its pipeline sends) and parameters."""
    model, lay = c.model, c.layout
    emb_f, emb_b = embedding_cost(c.profile, model, c.mb, c.groups)
    head_f, head_b = lm_head_cost(c.profile, model, c.mb, c.groups)
    p2p_bytes = c.mb.tokens * model.hidden_size * c.training.precision.bytes / (lay.tp if lay.pp_scatter_gather else 1)
    p2p_s = pipeline_send_s(model, c.training, c.profile, c.groups["pp"], c.mb.tokens, lay.tp, lay.pp_scatter_gather)
    out = _Times([], [], [], [], (emb_f, emb_b, head_f, head_b), p2p_s, p2p_bytes)
    for st in stages:
        f, b = rank_passes_s(sum(c.block(i).forward.total_s for i in st.layers),
                             sum(c.block(i).backward_s(r) for i, r in zip(st.layers, st.recompute)), st.first, st.last,
                             (emb_f.total_s, emb_b.total_s), (head_f.total_s, head_b.total_s), lay.virtual_stages,
                             p2p_s)
        dense = sum(c.dense_of(i) for i in st.layers)
        if st.first:
            dense += embedding_params(model) / lay.tp
        if st.last:
            tied = model.vocab_size * model.hidden_size if model.tied_embeddings and lay.pp > 1 else 0
            dense += head_per_tp_rank(model, lay.tp, tied)
        out.fwd_s.append(f)
        out.bwd_s.append(b)
        out.dense.append(dense)
        out.experts.append(sum(c.params_of(i)[1] for i in st.layers) / expert_split(lay))
    return out


def _data_parallel(c: _Step, t: _Times, stages: list[_Stage]
                   ) -> tuple[list[float], list[dict[str, tuple[float, float, float]]]]:
    """Each rank's once-per-step exposed data-parallel time, and per kind (bytes, seconds, exposed) per step;
    the per-micro-batch exposed part joins ``t``'s forward and backward.

    Cadence by :func:`dp_cadence`: without a pipeline ZeRO-2/3 reduce-scatter gradients every micro-batch,
    beside its backward, and ZeRO-3 gathers the weights before every forward (and again before backward
    when it reshards), each unit apart (:func:`dp_units`), prefetching one unit ahead
    (:func:`planner.cost.stage.dp_exposure`: the first gather and the last reduce-scatter of each micro-batch show).
    Otherwise gradients are reduced once, beside the last micro-batch's backward. Weights gathered once
    per step overlap the first forward (overlap-param-gather); HSDP's replica all-reduce happens once per step."""
    lay, m = c.layout, c.m
    eff = c.profile.assumptions.async_overlap_efficiency if lay.dp_comm_overlap else 0.0
    cadence = dp_cadence(lay)
    gathers_per_mb, grads_per_mb = cadence
    exposed, comm = [], []
    for i, st in enumerate(stages):
        moe_blocks = sum(c.kinds[li] for li in st.layers)
        tr = dp_traffic(c.profile, lay, c.training, t.dense[i], t.experts[i],
                        dp_units(lay, len(st.layers), st.first or st.last), moe_blocks)
        x = dp_exposure(lay, cadence, tr.grad_s, tr.replica_s, tr.gather_s, tr.units, t.fwd_s[i], t.bwd_s[i], eff)
        share_gather_b = x.gather_b / (x.gather_b + x.grad_mb) if x.gather_b + x.grad_mb else 0.0
        t.fwd_s[i] += x.exp_f
        t.bwd_s[i] += x.exp_b
        exposed.append(x.step_s)
        n_gathers = m * gathers_per_mb if gathers_per_mb else 1
        comm.append({
            "dp_param": (n_gathers * tr.gather_bytes, m * (x.gather_f + x.gather_b) + x.gather_step,
                         m * (x.exp_f + share_gather_b * x.exp_b) + x.exp_gather_step),
            "dp_grad": ((m if grads_per_mb else 1) * tr.grad_bytes, m * x.grad_mb + x.grad_step,
                        m * (1 - share_gather_b) * x.exp_b + x.exp_grad_step),
        })
    return exposed, comm


def _optimizer(c: _Step, t: _Times) -> tuple[list[float], float]:
    """Each rank's optimizer step (bandwidth bound), on the GPU or on the CPU with copies over the host
    link, and the longest of those copies (0 without offload)."""
    lay = c.layout
    state, step_bytes = state_bytes_per_param(c.training), optimizer_step_bytes_per_param(c.training)
    opt_s, offload_s = [], 0.0
    for dense, experts in zip(t.dense, t.experts):
        local = local_params(dense, experts, lay.zero_stage, lay.dp_shard * lay.cp, lay.expert_dp)
        seconds, copies = optimizer_step_s(c.profile, state, step_bytes, lay.offload_share, local)
        opt_s.append(seconds)
        offload_s = max(offload_s, copies)
    return opt_s, offload_s


def _memories(c: _Step, stages: list[_Stage], t: _Times) -> tuple[list[MemoryBreakdown], list[StagePrediction]]:
    """Each rank's peak memory (:func:`stage_memory`) and its stage summary."""
    model, lay, a = c.model, c.layout, c.profile.assumptions
    factor = activation_factor(a, c.training, lay.zero_stage)
    mems, preds = [], []

    def kept(li: int, r: Recompute) -> float:
        return kind_factor(factor, r) * c.activations_of(li, r)

    for i, st in enumerate(stages):
        in_flight = microbatches_in_flight(lay.schedule, i, lay.pp, c.m, lay.virtual_stages)
        per_mb = sum(kept(li, r) for li, r in zip(st.layers, st.recompute))
        if st.first:
            per_mb += factor * c.training.precision.bytes * c.mb.tokens * model.hidden_size / (lay.tp if lay.sp else 1)
        activations = per_mb * in_flight
        # recomputing a block in backward rebuilds its activations for a moment
        activations += max((recompute_transient({k: kept(li, k) for k in (Recompute.none, r)}, r)
                            for li, r in zip(st.layers, st.recompute) if r is not Recompute.none), default=0.0)
        # this rank's share of its biggest block (experts split over ep x etp)
        biggest = max((c.dense_of(li) + c.params_of(li)[1] / expert_split(lay) for li in st.layers),
                      default=0)
        loss = logits_bytes(model, c.mb.tokens, lay.tp, c.loss_per_logit) if st.last else 0.0
        mem = stage_memory(c.profile, c.training, lay, i, dense=t.dense[i], experts=t.experts[i],
                           activations=activations, biggest_block=biggest, loss=loss, accumulates=c.m > 1,
                           master_in_param=c.master_in_param, root_params=c.root_params)
        mems.append(mem)
        preds.append(StagePrediction(stage=i, layers=len(st.layers), forward_s=t.fwd_s[i], backward_s=t.bwd_s[i],
                                     memory_bytes=mem.total_bytes, microbatches_in_flight=in_flight))
    return mems, preds


def _layer_comm(c: _Step, st: _Stage, t: _Times) -> list[CommTime]:
    """TP/CP/EP traffic of one rank's blocks, embedding and head over the step, per kind."""
    passes: list[PassCost] = []
    for li, r in zip(st.layers, st.recompute):
        passes += c.block(li).passes(r)
    emb_f, emb_b, head_f, head_b = t.ends
    passes += ([emb_f, emb_b] if st.first else []) + ([head_f, head_b] if st.last else [])
    per_kind: dict[str, tuple[float, float, float]] = {}  # kind -> (time, exposed, bytes) per micro-batch
    for pc in passes:
        for kind, s in pc.comm_s.items():
            tt, ee, bb = per_kind.get(kind, (0.0, 0.0, 0.0))
            per_kind[kind] = (tt + s, ee + pc.exposed_comm_s[kind], bb + pc.comm_bytes[kind])
    return [CommTime(kind=kind, level=c.groups[kind].level, group_size=c.groups[kind].size,
                     bytes_per_step=c.m * nbytes, time_s=c.m * s, exposed_s=c.m * e)
            for kind, (s, e, nbytes) in per_kind.items()]


def _comm(c: _Step, st: _Stage, t: _Times, dp_comm: dict, offload_s: float) -> list[CommTime]:
    """Communication of the critical rank ``st`` per step: its blocks' collectives, pipeline sends, data
    parallel traffic and optimizer offload copies."""
    lay, m = c.layout, c.m
    comm = _layer_comm(c, st, t)
    if lay.pp > 1:
        s = 2 * m * lay.virtual_stages * t.p2p_s
        comm.append(CommTime(kind="pp", level=c.groups["pp"].level, group_size=lay.pp,
                             bytes_per_step=2 * m * lay.virtual_stages * t.p2p_bytes, time_s=s, exposed_s=s))
    grad_group = placement(lay.dp * lay.cp, lay.tp, c.profile.gpus_per_node)  # ranks holding the same weights
    for kind, (nbytes, s, e) in dp_comm.items():
        if s > 0:
            comm.append(CommTime(kind=kind, level=grad_group.level, group_size=grad_group.size,
                                 bytes_per_step=nbytes, time_s=s, exposed_s=e))
    if offload_s:
        comm.append(CommTime(kind="offload", level="host_device", group_size=1, bytes_per_step=0.0,
                             time_s=offload_s, exposed_s=offload_s))
    return comm


def _terms(c: _Step, st: _Stage, t: _Times, comm: list[CommTime], bubble_s: float, opt_s: float) -> dict[str, float]:
    """The critical rank's step by term (``Prediction.terms``): its passes' compute by operator class over the
    step (recompute included), each collective kind's exposed time, the bubble with the pipeline's sends,
    the optimizer step (with offload copies), kernel launches as ``other``."""
    passes: list[PassCost] = []
    for li, r in zip(st.layers, st.recompute):
        passes += c.block(li).passes(r)
    emb_f, emb_b, head_f, head_b = t.ends
    passes += ([emb_f, emb_b] if st.first else []) + ([head_f, head_b] if st.last else [])
    m = c.m
    out = dict.fromkeys(STEP_TERMS, 0.0)
    out["gemm"] = m * sum(p.gemm_s for p in passes)
    out["attention"] = m * sum(p.attention_s for p in passes)
    out["loss"] = m * sum(p.loss_s for p in passes)
    out["elementwise"] = m * sum(p.memory_s - p.loss_s for p in passes)
    out["other"] = m * sum(p.overhead_s for p in passes)
    for x in comm:
        if x.kind != "offload":  # the offload copies are part of the optimizer step (opt_s)
            out[x.kind] += x.exposed_s
    out["pp"] += bubble_s
    out["optimizer"] += opt_s
    return out


def _hardware_flops(c: _Step, stages: list[_Stage], model_flops: float) -> float:
    """Model FLOPs plus what recompute runs again."""
    gbs, seq = c.training.global_batch_seqs, c.training.seq_length
    per_kind: dict[tuple[bool, Recompute], float] = {}
    extra = 0.0
    for st in stages:
        for li, r in zip(st.layers, st.recompute):
            if (c.kinds[li], r) not in per_kind:
                per_kind[(c.kinds[li], r)] = recompute_flops(c.model, r, li, gbs, seq)
            extra += per_kind[(c.kinds[li], r)]
    return model_flops + extra


def _notes(c: _Step, peak: MemoryBreakdown) -> list[str]:
    """What a reader of the prediction must know: it does not fit, what MFU is against, a slow device."""
    profile = c.profile
    mfu_peak, bf16_peak = mfu_peak_flops(profile), peak_flops(profile, Precision.bf16)
    notes = []
    if not peak.fits:
        notes.append(f"does not fit: stage {peak.stage} needs {peak.total_bytes / 2**30:.1f} GiB of "
                     f"{peak.capacity_bytes / 2**30:.1f} GiB, {peak.headroom_bytes / 2**30:.1f} GiB of which are kept "
                     "free (assumptions.memory_headroom)")
    if c.training.precision is Precision.fp8:
        notes.append("MFU/HFU are against the dense 16-bit peak")
    if mfu_peak > bf16_peak:
        notes.append(f"MFU/HFU are against this device's fp32 peak ({mfu_peak / 1e12:.3g} TFLOP/s), its fastest dense "
                     f"precision: its bf16 runs at {bf16_peak / 1e12:.3g} (a CPU without native bf16)")
    pace = device_pace(profile)
    slower = [f"{what} at rank {rank}'s, {f:.2f}x rank 0's time" for what, f, rank in
              (("GEMMs and attention", pace.compute, pace.compute_rank), ("memory-bound work", pace.memory,
                                                                          pace.memory_rank)) if rank is not None]
    if slower:
        notes.append("priced at the slowest checked device's pace (the compute tables are rank 0's; a device "
                     f"check ran more than {slow_device_limit(profile.is_cpu):.0%} below the checks' median, and "
                     "synchronous training waits for the slowest device): " + "; ".join(slower))
    if profile.calibration is not None:
        notes.append(calibration_note(profile.calibration))
    if c.layout.pp > 1 and SCHEDULES[c.layout.schedule].v_shape:
        notes.append(f"{c.layout.schedule.value}'s bubble is the equal-stage formula (Qi et al. 2024 §6; DualPipe's "
                     "table) spread over the ranks' own times, with B = W = half the backward: no measured run of a "
                     "V schedule checks it yet, so a plan that wins by its bubble wins by an untested term")
    return notes


def calibration_note(cal: RunCalibration) -> str:
    """How far a prediction on a profile calibrated from its cluster's runs may be trusted (planner.run_calibration)."""
    held = ("" if cal.held_out_median_error is None else
            f"; expected error ±{cal.held_out_median_error:.0%} for a plan not yet run (median, each run left out)")
    return (f"profile calibrated from {len(cal.runs)} run(s) on this cluster: their median step-time error "
            f"{cal.uncalibrated_median_error:.0%} before, {cal.fitted_median_error:.0%} after{held}")


def _predict(
    model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout, facts: TargetFacts
) -> Prediction:
    c = _new_step(model, training, profile, layout, facts)
    stages = _stages(model, layout)
    t = _stage_times(c, stages)
    dp_exposed, dp_comm = _data_parallel(c, t, stages)
    pipe_s, bubble_s = pipeline_time_s(layout.schedule, t.fwd_s, t.bwd_s, c.m, layout.virtual_stages)
    opt_s, offload_s = _optimizer(c, t)
    step_s = pipe_s + max(e + o for e, o in zip(dp_exposed, opt_s))
    mems, stage_preds = _memories(c, stages, t)
    peak = max(mems, key=lambda mm: mm.total_bytes)
    crit = max(range(len(stages)), key=lambda i: t.fwd_s[i] + t.bwd_s[i])  # the slowest rank
    comm = _comm(c, stages[crit], t, dp_comm[crit], offload_s)
    model_flops = model_flops_per_step(model, training.global_batch_seqs, training.seq_length)
    hw_flops = _hardware_flops(c, stages, model_flops)
    n, mfu_peak, tokens = profile.num_gpus, mfu_peak_flops(profile), training.tokens_per_step
    return Prediction(
        step_time_s=step_s, tokens_per_s=tokens / step_s, tokens_per_s_per_gpu=tokens / step_s / n,
        model_flops_per_step=model_flops, hardware_flops_per_step=hw_flops,
        mfu=model_flops / (step_s * n * mfu_peak), hfu=hw_flops / (step_s * n * mfu_peak),
        compute_time_s=c.m * (t.fwd_s[crit] + t.bwd_s[crit]), bubble_time_s=bubble_s,
        bubble_fraction=bubble_s / step_s, optimizer_time_s=opt_s[crit],
        exposed_comm_time_s=sum(x.exposed_s for x in comm), memory=peak, comm=comm, stages=stage_preds,
        notes=_notes(c, peak), terms=_terms(c, stages[crit], t, comm, bubble_s, opt_s[crit]),
    )

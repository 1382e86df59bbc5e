"""Memory per GPU: model states by precision and ZeRO stage, and activations per Korthikanti et al.

Model states per parameter (mixed precision, Adam; Rajbhandari et al. "16Φ"): 2 bytes weights,
2 or 4 bytes gradients, 4 bytes fp32 master weights, 8 bytes Adam moments. ZeRO-1 shards the
optimizer part (master + moments), ZeRO-2 also the gradients, ZeRO-3 also the weights, over the
data-parallel shard group: the ``dp_shard × cp`` ranks for dense weights, the expert data-parallel
ranks ``edp = dp_shard·cp·tp / (ep·etp)`` (``ParallelLayout.expert_dp``) for the routed experts, which
each rank holds ``1/(ep·etp)`` of.
Targets whose parameter is itself the fp32 master (FSDP2; fp32 parameters under autocast:
``TargetFacts.master_in_param``) shard that parameter only with the parameters and hold 16-bit copies
only through the backward (:func:`model_state_bytes`, :func:`compute_copy_bytes_per_param`).

Activations (Korthikanti et al. 2022, Eq. 1-5) for one layer and one micro-batch of ``b``
sequences of ``s`` tokens, hidden ``h``, ``a`` heads, TP degree ``t``, fp16/bf16:
``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` without SP, ``s·b·h·(34/t + 5as/(ht))`` with SP,
``34·s·b·h/t`` with SP and selective recompute, ``2·s·b·h`` (``/t`` with SP) with full recompute.
:func:`layer_activation_bytes` generalises those terms to GQA, SwiGLU, no dropout, flash
attention, context parallelism and MoE; for the paper's GPT layer it reduces to the equations.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.contracts import Assumptions, ClusterProfile, ModelSpec, ParallelLayout, Recompute, TrainingConfig
from planner.cost.sac import kept_linear_elements


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state per parameter, by kind."""

    weights: float
    grads: float
    optimizer: float  # fp32 master copy + optimizer moments
    master: float = 0.0  # the fp32 master copy's part of ``optimizer``


def state_bytes_per_param(training: TrainingConfig) -> StateBytes:
    """Per-parameter bytes: weights in the training precision (fp32 for fp32 training), grads in the
    reduce dtype, fp32 master (if any) plus the optimizer's fp32 state."""
    weights = 4 if training.precision.bytes == 4 else 2
    grads = 4 if (training.grad_reduce_in_fp32 or weights == 4) else 2
    master = 4 if training.master_weights_fp32 else 0
    return StateBytes(weights, grads, master + training.optimizer.state_bytes_per_param, master)


def optimizer_step_bytes_per_param(training: TrainingConfig) -> float:
    """HBM traffic of one optimizer step per parameter.

    Gradients (``g`` bytes): inf/NaN check, norm, clipping (read + write), the update's read and the
    zeroing write: ``6g``. Optimizer state (``o`` bytes, 8 for Adam): read and write, ``2o``. Weights:
    with an fp32 master copy the update reads and writes the master (``2·4``) and the 16-bit copy is
    refreshed from it (read 4, write ``w``); without one the update reads and writes the weights
    (``2w``). Mixed-precision AdamW: ``6·4 + 2·8 + 3·4 + 2 = 54`` bytes.
    """
    state = state_bytes_per_param(training)
    opt_state = training.optimizer.state_bytes_per_param
    weights = 3 * 4 + state.weights if training.master_weights_fp32 else 2 * state.weights
    return 6 * state.grads + 2 * opt_state + weights


def model_state_bytes(
    params: float, state: StateBytes, zero_stage: int, shard: int, offload_optimizer: float = 0.0,
    master_in_param: bool = False,
) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes for ``params`` parameters sharded over ``shard`` ranks.

    ZeRO-0: ``Φ(w + g + o)``; ZeRO-1: ``Φ(w + g) + Φo/N``; ZeRO-2: ``Φw + Φ(g + o)/N``;
    ZeRO-3: ``Φ(w + g + o)/N``. CPU offload moves the share ``offload_optimizer`` (0..1,
    :attr:`~planner.contracts.ParallelLayout.offload_share`; ``True`` is 1) of the optimizer part off the GPU.

    ``master_in_param`` (a target's :class:`~planner.targets.TargetFacts`): the parameter itself is the fp32
    master (FSDP2, or fp32 parameters under autocast). Weights are then that parameter, sharded only where
    the parameters are (ZeRO-2/3: FSDP2 shards them), and the optimizer part only the moments; the 16-bit
    copies the compute uses are :func:`compute_copy_bytes_per_param`. An offloaded plan is counted as
    above whatever the target: FSDP2's ``CPUOffloadPolicy`` keeps every shard on the host, but nothing
    checks the host's memory, so the GPU keeps being charged the weight and gradient shards.
    """
    n = max(shard, 1)
    if master_in_param and state.master and not offload_optimizer:
        sharded = n if zero_stage >= 2 else 1  # FSDP2 shards the parameter itself (ZeRO-2/3)
        moments = params * (state.optimizer - state.master) / (n if zero_stage >= 1 else 1)
        return params * state.master / sharded, params * state.grads / sharded, moments
    weights = params * state.weights / (n if zero_stage >= 3 else 1)
    grads = params * state.grads / (n if zero_stage >= 2 else 1)
    optimizer = params * state.optimizer / (n if zero_stage >= 1 else 1) * (1.0 - float(offload_optimizer))
    return weights, grads, optimizer


def compute_copy_bytes_per_param(zero_stage: int, state: StateBytes, master_in_param: bool,
                                  offload_optimizer: bool = False) -> float:
    """Bytes per parameter of the 16-bit copies a ``master_in_param`` target holds through the backward
    (not at the optimizer step): autocast's cached casts of the fp32 parameters (ZeRO-0/1) and FSDP2's
    weights gathered before forward and kept to backward (ZeRO-2, ``reshard_after_forward=False``); none
    at ZeRO-3 (its gathered blocks are the ``gathered_weights`` term), where the parameters are the
    16-bit weights, or offloaded (counted as every target's: :func:`model_state_bytes`)."""
    if not (master_in_param and state.master) or offload_optimizer or zero_stage >= 3:
        return 0.0
    return state.weights

@dataclass(frozen=True)
class ActivationShape:
    """Local shape of one micro-batch on one GPU."""

    batch: int  # b
    seq: int  # s / cp (tokens this rank holds)
    kv_seq: int  # s (keys/values each query attends to)
    tp: int
    sp: bool
    etp: int | None = None  # the routed experts' TP degree; None = tp
    ep: int = 1  # expert-parallel degree (per-op SAC keeps the all-to-alls' outputs)


def layer_activation_bytes(
    model: ModelSpec, index: int, shape: ActivationShape, recompute: Recompute, *, flash: bool, elt: int = 2,
    fp8: bool = False, moe_imbalance: float = 1.0,
) -> float:
    """Activation bytes stored by block ``index`` for the backward pass of one micro-batch.

    Terms (``E = s·b·h`` elements, ``/t`` for TP-split tensors, ``/t`` for the replicated ones
    only with SP): norm inputs ``2E``; QKV and MLP inputs ``2E``; dropout masks ``E`` bytes each
    (if dropout); Q, K, V; attention output; with unfused attention the scores ``a·s·s_kv·b`` as
    softmax output (2 B), dropout mask (1 B) and dropout output (2 B); with flash attention the
    fp32 log-sum-exp ``4·a·s·b`` bytes; GeLU FFN input and output ``2·s·b·f``; SwiGLU gate, up
    and product ``3·s·b·f``; MoE: router input, the top-k dispatched copies and the experts'
    intermediates. ``fp8``: the FP8-cast input of each linear layer is saved for backward (Transformer
    Engine; a target's ``TargetFacts.fp8_saved_inputs``): 1 byte instead of ``elt`` for the QKV,
    output-projection, FC1 and FC2 inputs. With folded experts (``etp < tp``) a rank keeps its
    ``T·k·etp/tp`` routed rows (:func:`planner.cost.layer.expert_rows`), their intermediates at
    width ``f/etp``.
    """
    b, s, t = shape.batch, shape.seq, shape.tp
    h = model.hidden_size
    rep = t if shape.sp else 1  # replicated-region tensors are split only with sequence parallel
    tokens = s * b
    if recompute is Recompute.full:
        return elt * tokens * h / rep
    if recompute is Recompute.op:
        return op_kept_bytes(model, index, shape, flash=flash, elt=elt, moe_imbalance=moe_imbalance)
    a = model.num_attention_heads / t
    k = max(model.kv_heads / t, 1.0) if model.mla is None else a
    dqk, dv = model.head_size, model.value_head_size
    dropout = model.dropout > 0
    mask_bytes = tokens * h if dropout else 0.0  # dropout masks: 1 byte per element
    # replicated region: two norm inputs, the QKV input, the MLP input and two dropout masks
    lin = 1 if fp8 else elt  # bytes of a saved linear-layer input
    replicated = ((2 * elt + 2 * lin) * tokens * h + 2 * mask_bytes) / rep
    # attention (TP-split): Q, K, V and the output-projection input
    # Q for the local queries; K and V for the whole sequence the queries attend to (context
    # parallelism keeps the gathered K/V for backward); the output-projection input
    kv_tokens = b * shape.kv_seq
    attn = elt * tokens * a * dqk + elt * kv_tokens * k * (dqk + dv) + lin * tokens * a * dv
    scores = b * a * s * shape.kv_seq
    if recompute is Recompute.selective:
        core = 0.0
    elif flash:
        core = 4.0 * tokens * a
    else:
        core = scores * (elt + (1 + elt if dropout else 0))  # softmax out (+ dropout mask and output)
    # feed-forward (TP-split)
    if model.is_moe_layer(index):
        moe = model.moe
        assert moe is not None
        per_mlp = (3 if model.ffn_kind == "swiglu" else 2)
        routed_tokens = tokens * moe.top_k * (moe.capacity_factor or moe_imbalance)
        e = t if shape.etp is None else shape.etp
        if e != t:
            routed_tokens = routed_tokens * e / t
        ffn = routed_tokens * (lin * h + (elt * (per_mlp - 1) + lin) * moe.expert_ffn_hidden_size / e)
        ffn += tokens * moe.num_shared_experts * (elt * (per_mlp - 1) + lin) * moe.shared_ffn / t
        ffn += 4 * tokens * moe.num_experts / rep  # fp32 router probabilities
    else:
        per_mlp = 3 if model.ffn_kind == "swiglu" else 2
        ffn = tokens * (elt * (per_mlp - 1) + lin) * model.ffn_hidden_size / t  # last one is FC2's input
    return replicated + attn + core + ffn


def recompute_transient(acts: dict[Recompute, float], kind: Recompute) -> float:
    """Bytes a recomputed block adds for a moment during its backward, beyond what it keeps (``acts`` its
    activations per recompute kind): full recompute rebuilds all of them (counted whole, its kept input
    with them), per-op SAC what it did not keep; selective recompute's core is one head-batch kernel, 0."""
    if kind is Recompute.full:
        return acts[Recompute.none]
    return acts[Recompute.none] - acts[Recompute.op] if kind is Recompute.op else 0.0


def op_kept_bytes(model: ModelSpec, index: int, shape: ActivationShape, *, flash: bool, elt: int = 2,
                  moe_imbalance: float = 1.0) -> float:
    """Bytes block ``index`` keeps for its backward under per-op SAC (:mod:`planner.cost.sac`), one micro-batch:
    the checkpointed block's input ``E/rep``; the kept linears' outputs (:func:`planner.cost.sac.kept_linears`);
    the attention kernel's output and fp32 log-sum-exp (flash; unfused: the output and its probabilities); with
    SP each reduce-scatter's output ``E/t`` (two a dense block, one more per MoE block's shared experts, one
    fewer without them); with EP the dispatch and combine all-to-alls' outputs, ``h`` per routed row each.
    ``E = s·b·h`` (``s`` this rank's tokens), ``rep = t`` with SP, else 1."""
    b, s, t = shape.batch, shape.seq, shape.tp
    h, tokens = model.hidden_size, shape.seq * shape.batch
    rep = t if shape.sp else 1
    a = model.num_attention_heads / t
    scores = b * a * s * shape.kv_seq
    core = elt * tokens * a * model.value_head_size + (4.0 * tokens * a if flash else elt * scores)
    kept = elt * tokens * (h / rep + kept_linear_elements(model, index, t)) + core
    moe = model.moe if model.is_moe_layer(index) else None
    if shape.sp and t > 1:
        scatters = 2 if moe is None else 1 + (1 if moe.num_shared_experts else 0)
        kept += scatters * elt * tokens * h / t
    if moe is not None and shape.ep > 1:
        routed = tokens / rep * moe.top_k * (moe.capacity_factor or moe_imbalance)
        kept += 2 * elt * routed * h
    return kept


def logits_bytes(model: ModelSpec, tokens: int, tp: int, bytes_per_logit: float = 6.0) -> float:
    """LM-head logits and loss of one micro-batch at their peak, ``β·T·V/t``: ``β = 6`` for 16-bit logits
    plus the fp32 softmax Megatron's vocab-parallel loss keeps; an eager torch cross-entropy also holds the
    log-softmax and its gradient (each target's ``β``: :class:`planner.targets.TargetFacts`)."""
    return bytes_per_logit * tokens * model.vocab_size / tp


# -- memory beside the tensors -------------------------------------------------------------------------
MEMORY_TERMS: dict[str, str] = {
    "loss": "LM head logits and cross-entropy of one micro-batch: bytes per logit x tokens x vocab / tp, the "
            "bytes per logit the target's (planner.targets.TargetFacts.loss; the executor's: "
            "assumptions.loss_bytes_per_logit)",
    "compute_copies": "16-bit copies of fp32 parameters held through the backward where the parameter is the "
                      "master (TargetFacts.master_in_param): autocast's cached casts (ZeRO-0/1), FSDP2's weights "
                      "kept gathered from forward (ZeRO-2)",
    "gathered_weights": "ZeRO-3: the unsharded weights of the current and the prefetched block (2x the biggest), or "
                        "of every block of the stage when they are kept from forward to backward (no resharding, "
                        "or pipelined: torch's pipelining keeps them until the last micro-batch's backward)",
    "root_weights": "ZeRO-3 with resharding, one pipeline stage: the 16-bit weights of the FSDP2 units beside the "
                    "blocks that the target holds gathered through the backward (TargetFacts.fsdp_root: the "
                    "executor's root unit, embedding and head; torchtitan's norm and output)",
    "gradient_bucket": "ZeRO-2/3: the unsharded gradients of the block being reduce-scattered",
    "held_gradients": "pipelined ZeRO-2/3: the stage's unsharded gradients, kept until the last micro-batch's "
                      "backward (torch's pipelining turns FSDP's gradient reduction off before it)",
    "gradients_after_peak": "one micro-batch a step: its gradients are made as its activations are freed, so they "
                            "are not held at the backward's peak (negative)",
    "optimizer_step": "what the optimizer step's temporaries add where that step, not the backward, is the peak "
                      "(assumptions.optimizer_temp_bytes_per_param)",
    "fragmentation": "the caching allocator's reserve beyond its peak allocation (assumptions.allocator_fragmentation, "
                     "sharded_fragmentation)",
    "runtime": "CUDA context, kernel images and library handles, outside the allocator (assumptions.runtime_bytes)",
    "communicators": "NCCL buffers: one communicator per process group of more than one rank, all-to-all connections "
                     "for expert parallelism (assumptions.communicator_bytes, all_to_all_communicator_bytes)",
    "reserved": "assumptions.reserved_memory_bytes",
    "calibration": "what this cluster's runs measured beyond the prediction, the median over them (the executor's "
                   "process, the host runtime of a CPU rank): RunCalibration.memory_offset_bytes, fitted by "
                   "planner.run_calibration",
}
"""The named terms of ``MemoryBreakdown.terms``: what a rank holds beside weights, gradients, optimizer
state and activations."""


def kind_factor(factor: float, recompute: Recompute) -> float:
    """The share of :func:`activation_factor` a block's kept activations take under ``recompute``: the
    factor corrects the formula's count (no recompute, selective), whose tensors the model's code adds to
    (RoPE's inputs, SiLU's input, norm statistics); full recompute keeps the block's input and per-op SAC
    the outputs it names (:func:`op_kept_bytes`), counted tensor by tensor: 1. A recompute transient, which
    rebuilds the formula's tensors, takes the factor of ``Recompute.none``."""
    return 1.0 if recompute in (Recompute.full, Recompute.op) else factor


def activation_factor(a: Assumptions, training: TrainingConfig, zero_stage: int) -> float:
    """Measured over formula activation bytes: ``autocast_activation_factor`` where 16-bit training runs
    on fp32 parameters under autocast (ZeRO-0/1), else ``activation_memory_factor``."""
    autocast = training.precision.bytes == 2 and zero_stage < 2
    return a.autocast_activation_factor if autocast else a.activation_memory_factor


def kept_gathered_bytes_per_param(zero_stage: int, reshard_after_forward: bool, pp: int, state: StateBytes) -> float:
    """Bytes per stage parameter of ZeRO-3 weights held gathered through the backward: ``w`` without
    resharding (every block's unsharded weights live until its backward) and under pipelining (torch's
    pipeline stages turn FSDP's resharding after backward off until the last micro-batch), else 0."""
    return state.weights if zero_stage == 3 and (not reshard_after_forward or pp > 1) else 0.0


def held_gradient_bytes_per_param(zero_stage: int, pp: int, state: StateBytes) -> float:
    """Bytes per stage parameter of unsharded gradients held across micro-batches: pipelined ZeRO-2/3
    (torch's pipeline stages turn FSDP's gradient reduction off until the last micro-batch), ``g``."""
    return state.grads if zero_stage >= 2 and pp > 1 else 0.0


def root_gathered_bytes_per_param(zero_stage: int, reshard_after_forward: bool, pp: int, state: StateBytes) -> float:
    """Bytes per parameter of ``TargetFacts.fsdp_root``'s units at the backward's peak: their 16-bit weights
    where blocks are resharded (ZeRO-3, one stage; otherwise every weight is already counted gathered)."""
    return state.weights if zero_stage == 3 and reshard_after_forward and pp == 1 else 0.0


def prefetch_bytes_per_param(zero_stage: int, reshard_after_forward: bool, pp: int, state: StateBytes) -> float:
    """Bytes per parameter of the biggest block that resharded ZeRO-3 holds gathered: the current block and
    the prefetched one (``2w``). Not under pipelining, which keeps the whole stage gathered
    (:func:`kept_gathered_bytes_per_param`)."""
    return 2 * state.weights if zero_stage == 3 and reshard_after_forward and pp == 1 else 0.0


def bucket_bytes_per_param(zero_stage: int, pp: int, state: StateBytes) -> float:
    """Bytes per parameter of the biggest block's unsharded gradients that ZeRO-2/3 reduce-scatter (``g``).
    Not under pipelining, which holds the whole stage's (:func:`held_gradient_bytes_per_param`)."""
    return state.grads if zero_stage >= 2 and pp == 1 else 0.0


def block_buffer_bytes_per_param(zero_stage: int, reshard_after_forward: bool, pp: int, state: StateBytes) -> float:
    """Bytes per parameter of the biggest block held in flight: :func:`prefetch_bytes_per_param` plus
    :func:`bucket_bytes_per_param`."""
    return (prefetch_bytes_per_param(zero_stage, reshard_after_forward, pp, state)
            + bucket_bytes_per_param(zero_stage, pp, state))


def communicator_groups(layout: ParallelLayout) -> int:
    """NCCL communicators a rank creates: the world's (barriers, the loss) and one per mesh dimension of
    more than one rank; none on a single device. Experts on a mesh of their own (ep > 1: the executor's
    expert mesh, Megatron-Core's expert groups) add their TP group (etp > 1), their data-parallel group
    (expert_dp > 1) and the group sharing the routing statistics or token counts over cp x tp (> 1),
    each a communicator of its own even where it spans the same ranks as a dense group; folded experts
    without EP (1 < etp < tp) gather their rows over a TP group of their own."""
    if layout.num_gpus == 1:
        return 0
    dims = (layout.tp, layout.cp, layout.pp, layout.dp_shard, layout.dp_replicate, layout.ep)
    if layout.ep > 1:
        experts = (layout.expert_tp, layout.expert_dp, layout.cp * layout.tp)
        return 1 + sum(d > 1 for d in dims) + sum(d > 1 for d in experts)
    return 1 + sum(d > 1 for d in dims) + (1 if 1 < layout.expert_tp != layout.tp else 0)


def fixed_terms(a: Assumptions, layout: ParallelLayout, offset: float = 0.0) -> dict[str, float]:
    """Bytes a rank holds beside its tensors' peak allocation, by term: outside the caching allocator, and the
    run calibration's ``offset`` (:func:`memory_offset`) where there is one."""
    comms = communicator_groups(layout) * a.communicator_bytes
    if layout.ep > 1:
        comms += a.all_to_all_communicator_bytes
    out = {"runtime": float(a.runtime_bytes), "communicators": float(comms), "reserved": float(a.reserved_memory_bytes)}
    return {**out, "calibration": float(offset)} if offset else out


def memory_offset(profile: ClusterProfile) -> float:
    """The bytes a profile's run calibration adds to every peak (``RunCalibration.memory_offset_bytes``; 0 without)."""
    cal = profile.calibration
    return float(cal.memory_offset_bytes or 0) if cal is not None else 0.0


def fragmentation_share(a: Assumptions, zero_stage: int) -> float:
    """The allocator's reserve beyond its peak allocation, as a share of that peak."""
    return a.sharded_fragmentation if zero_stage >= 2 else a.allocator_fragmentation


def usable_bytes(capacity_bytes: float, a: Assumptions) -> float:
    """Device memory a plan may fill: the capacity less ``memory_headroom``."""
    return capacity_bytes * (1.0 - a.memory_headroom)


def allocator_budget_bytes(capacity_bytes: float, a: Assumptions, layout: ParallelLayout, offset: float = 0.0) -> float:
    """Most bytes the allocator may hold at its peak: ``(usable - fixed) / (1 + fragmentation)``. A stage fits
    iff its allocated peak is at most this (the search compares allocations against it)."""
    fixed = sum(fixed_terms(a, layout, offset).values())
    return (usable_bytes(capacity_bytes, a) - fixed) / (1.0 + fragmentation_share(a, layout.zero_stage))

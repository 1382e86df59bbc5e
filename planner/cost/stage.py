"""One pipeline rank's terms, composed by :func:`planner.cost.predict.predict` and by the search's
:class:`planner.search.stages.StageModel` alike: each formula below is written once and both call it.

- **Passes**: a rank's forward ``F = Σ f_block + [first]·f_emb + [last]·f_head + v·t_p2p``, the backward likewise
  (:func:`rank_passes_s`).
- **Data-parallel exposure** (:func:`dp_exposure`): the per-micro-batch ZeRO-2/3 collectives left beside each
  pass, and the once-per-step ones beside the last backward / first forward.
- **Optimizer step** (:func:`optimizer_step_s`): HBM-bound on the GPU, or host copies plus the CPU step.
- **Peak memory** (:func:`held_per_param`, :func:`peak_bytes`): per parameter, what a rank holds beside its
  activations through the backward and through the optimizer step; the peak is
  ``fixed + (1 + fragmentation)·max(backward allocation, optimizer-step allocation)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from planner.contracts import ClusterProfile, Collective, ModelSpec, ParallelLayout, TrainingConfig
from planner.cost.comm import GroupPlacement, collective_time_s, hidden_time_s, host_copy_time_s
from planner.cost.compute import memory_time_s
from planner.cost.memory import (
    StateBytes,
    block_buffer_bytes_per_param,
    compute_copy_bytes_per_param,
    held_gradient_bytes_per_param,
    kept_gathered_bytes_per_param,
    model_state_bytes,
    root_gathered_bytes_per_param,
)


def rank_passes_s(blocks_f: float, blocks_b: float, first: bool, last: bool, emb: tuple[float, float],
                  head: tuple[float, float], virtual: int, p2p_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch on a rank whose blocks take ``blocks_f``/``blocks_b``:
    the embedding's (first rank) and the head's (last rank) passes added, and one send per chunk each way."""
    f, b = blocks_f, blocks_b
    if first:
        f, b = f + emb[0], b + emb[1]
    if last:
        f, b = f + head[0], b + head[1]
    return f + virtual * p2p_s, b + virtual * p2p_s


def pipeline_send_s(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, pp_group: GroupPlacement,
                    tokens: int, tp: int, scatter_gather: bool) -> float:
    """One micro-batch's activations sent to the next pipeline rank (``tokens`` rows of the hidden
    size, split over the TP group with scatter-gather); 0 without a pipeline. Times the run calibration's ``pp``
    factor (``ClusterProfile.term_factor``)."""
    if pp_group.size <= 1:
        return 0.0
    p2p_bytes = tokens * model.hidden_size * training.precision.bytes / (tp if scatter_gather else 1)
    return collective_time_s(profile, Collective.p2p, pp_group, p2p_bytes) * profile.term_factor("pp")


def exposed_s(comm_s: float, window_s: float, eff: float) -> float:
    """Part of ``comm_s`` left on the critical path beside ``window_s`` of independent compute."""
    return comm_s - hidden_time_s(comm_s, window_s, eff)


def unit_exposed_s(comm_s: float, first_s: float, units: int, window_s: float, eff: float) -> float:
    """Exposed part of ``comm_s`` of one micro-batch's pass over ``units`` FSDP units, ``window_s`` of
    compute, prefetching one unit ahead (FSDP1's rate limiter allows two gathers in flight, FSDP2 one
    prefetch: Zhao et al. 2023 §3.3-3.4): the ``first_s`` call has no compute before it (the forward's first
    gather: "the 1st all-gather will not be able to overlap with anything", PyTorch FSDP notes; the
    backward's last reduce-scatter) and shows whole; each other call hides behind one unit's compute,
    ``eff·min(call, unit)``, which for equal units is ``exposed_s(rest, window·(units - 1)/units)``."""
    if comm_s <= 0:
        return 0.0
    rest = comm_s - first_s
    return first_s + exposed_s(rest, window_s * (units - 1) / units, eff)


def microbatch_exposed_s(layout: ParallelLayout, gather_f: float, gather_b: float, grad_mb: float, units: int,
                         fwd_s: float, bwd_s: float, eff: float) -> tuple[float, float]:
    """Exposed (forward, backward) parts of one micro-batch's data-parallel traffic on a stage: the
    forward's gathers, the backward's gathers and reduce-scatters. Without a pipeline each pass shows
    its first gather / last reduce-scatter (:func:`unit_exposed_s`); in a pipeline other micro-batches'
    compute runs beside them, so the whole pass is the window (:func:`exposed_s`)."""
    if layout.pp > 1:
        return exposed_s(gather_f, fwd_s, eff), exposed_s(gather_b + grad_mb, bwd_s, eff)
    return (unit_exposed_s(gather_f, gather_f / units, units, fwd_s, eff),
            unit_exposed_s(gather_b + grad_mb, grad_mb / units, units, bwd_s, eff))


class DPExposure(NamedTuple):
    """One rank's data-parallel traffic by cadence (seconds of one call set) and what of it is exposed (a
    named tuple: the search builds one per stage timing)."""

    gather_f: float  # weight gathers before each micro-batch's forward
    gather_b: float  # ... and again before its backward (resharded ZeRO-3)
    grad_mb: float  # gradient reduce-scatters beside each micro-batch's backward
    grad_step: float  # once per step: the replica all-reduce and gradients reduced once
    gather_step: float  # once per step: weights gathered before the first forward
    exp_f: float  # exposed per micro-batch, forward
    exp_b: float  # exposed per micro-batch, backward
    exp_grad_step: float  # exposed once per step
    exp_gather_step: float

    @property
    def step_s(self) -> float:
        """Exposed once-per-step traffic (a rank's tail, beside its optimizer step)."""
        return self.exp_grad_step + self.exp_gather_step


def dp_exposure(layout: ParallelLayout, cadence: tuple[int, bool], grad_s: float, replica_s: float,
                gather_s: float, units: int, fwd_s: float, bwd_s: float, eff: float) -> DPExposure:
    """Split a rank's data-parallel collectives by ``cadence`` (:func:`planner.cost.predict.dp_cadence`:
    gathers per micro-batch, 0 for once per step; gradients reduced per micro-batch?) and expose them:
    per micro-batch beside its passes (:func:`microbatch_exposed_s`); once per step behind the last
    backward's / first forward's compute ``fwd_s``/``bwd_s`` (the window excludes the per-micro-batch
    traffic, which holds the same links)."""
    gathers_per_mb, grads_per_mb = cadence
    gather_f = gather_s if gathers_per_mb else 0.0
    gather_b = gather_s * (gathers_per_mb - 1) if gathers_per_mb else 0.0
    grad_mb = grad_s if grads_per_mb else 0.0
    exp_f, exp_b = microbatch_exposed_s(layout, gather_f, gather_b, grad_mb, units, fwd_s, bwd_s, eff)
    grad_step = replica_s + (0.0 if grads_per_mb else grad_s)
    gather_step = 0.0 if gathers_per_mb else gather_s
    return DPExposure(gather_f, gather_b, grad_mb, grad_step, gather_step, exp_f, exp_b,
                      exposed_s(grad_step, bwd_s, eff), exposed_s(gather_step, fwd_s, eff))


def local_params(dense: float, experts: float, zero_stage: int, shard_n: int, expert_shard: int) -> float:
    """Parameters whose optimizer state a rank updates: dense over the ``dp_shard x cp`` ranks, experts over
    their data-parallel ranks, from ZeRO-1 on."""
    if zero_stage >= 1:
        return dense / shard_n + experts / expert_shard
    return dense + experts


def optimizer_step_s(profile: ClusterProfile, state: StateBytes, step_bytes: float, offload: float,
                     local: float) -> tuple[float, float]:
    """(seconds, of which host copies) of the optimizer step over ``local`` parameters of ``state`` bytes
    (:func:`~planner.cost.memory.state_bytes_per_param`) moving ``step_bytes`` each
    (:func:`~planner.cost.memory.optimizer_step_bytes_per_param`). On the GPU it is bandwidth-bound; the
    share ``offload`` (0..1; ``True`` is 1) sends its gradients down and weights up over the host link and
    steps on the CPU. The two shares run side by side, the GPU's kernels queued while the host steps its own
    (Megatron-Core's HybridDeviceOptimizer, DeepSpeed's Twin-Flow): the step is the slower of
    ``gpu = (1 - s)·Φ·b / HBM`` and ``host = s·Φ·(g/D2H + w/H2D + b / cpu_rate)``; the copies reported are
    the host share's when it is the slower."""
    f = profile.term_factor("optimizer")  # the cluster's runs' correction (1 uncalibrated)
    share = float(offload)
    gpu = memory_time_s(profile, local * (1.0 - share) * step_bytes) if share < 1.0 else 0.0
    if not share:
        return gpu * f, 0.0
    mine = local * share
    copies = host_copy_time_s(profile, mine * state.grads, to_device=False) + host_copy_time_s(
        profile, mine * state.weights, to_device=True)
    host = copies + mine * step_bytes / profile.assumptions.cpu_optimizer_bytes_per_s
    return max(gpu, host) * f, (copies if host >= gpu else 0.0) * f


@dataclass(frozen=True)
class HeldPerParam:
    """Bytes per parameter a rank holds beside its activations, by phase: ``backward`` and ``step``
    (dense, expert) allocations at the backward's peak and through the optimizer step; ``block_buffer`` per
    parameter of its biggest block; ``root`` per parameter of the target's FSDP2 root units."""

    backward: tuple[float, float]
    step: tuple[float, float]
    block_buffer: float
    root: float


def state_per_param(state: StateBytes, zero: int, shard_n: int, expert_shard: int, offload: float,
                    master_in_param: bool = False) -> tuple[float, float]:
    """(dense, expert) model-state bytes per parameter on one GPU (:func:`~planner.cost.memory.model_state_bytes`
    with dense weights over ``shard_n`` ranks, experts over ``expert_shard``)."""
    return (sum(model_state_bytes(1.0, state, zero, shard_n, offload, master_in_param)),
            sum(model_state_bytes(1.0, state, zero, expert_shard, offload, master_in_param)))


def held_per_param(state: StateBytes, zero: int, shard_n: int, expert_shard: int, offload: float, reshard: bool,
                   pp: int, m: int, temp: float, master_in_param: bool = False) -> HeldPerParam:
    """Backward: the model states, ZeRO-3 weights kept gathered, pipelined ZeRO-2/3's unsharded gradients and
    the 16-bit copies of a target whose parameters are the fp32 master (``master_in_param``), less a single
    micro-batch's gradients (``m == 1``: made as its activations are freed). Optimizer step: the states and
    ``temp`` bytes of temporaries per local parameter of the GPU's share (none when all is offloaded). The
    biggest block's buffers and
    the root units by :func:`~planner.cost.memory.block_buffer_bytes_per_param` and
    :func:`~planner.cost.memory.root_gathered_bytes_per_param`."""
    d, e = state_per_param(state, zero, shard_n, expert_shard, offload, master_in_param)
    div_d, div_e = (shard_n, expert_shard) if zero >= 1 else (1, 1)
    t = temp * (1.0 - float(offload))
    held = (kept_gathered_bytes_per_param(zero, reshard, pp, state) + held_gradient_bytes_per_param(zero, pp, state)
            + compute_copy_bytes_per_param(zero, state, master_in_param, offload))
    late = (0.0, 0.0) if m > 1 else (model_state_bytes(1.0, state, zero, shard_n, offload, master_in_param)[1],
                                     model_state_bytes(1.0, state, zero, expert_shard, offload, master_in_param)[1])
    return HeldPerParam((d + held - late[0], e + held - late[1]), (d + t / div_d, e + t / div_e),
                        block_buffer_bytes_per_param(zero, reshard, pp, state),
                        root_gathered_bytes_per_param(zero, reshard, pp, state))


def peak_bytes(fixed: float, fragmentation: float, backward_alloc: float, step_alloc: float) -> float:
    """A rank's peak device memory: bytes outside the caching allocator plus its larger allocation (through
    the backward, or through the optimizer step) with the allocator's fragmentation on top."""
    return fixed + max(backward_alloc, step_alloc) * (1.0 + fragmentation)

"""Time-to-train of a plan on a cluster that fails: checkpoint size and cost, the optimal interval, goodput.

Pure functions, each formula in its docstring, checked against hand calculations in
tests/test_goodput.py. The model is Daly's (2006): failures arrive as a Poisson process of mean time
between failures ``M`` (the job's: one GPU's rate times the GPUs), a checkpoint stops training for ``δ``,
a failure costs the restart ``R`` plus the work since the last checkpoint, and training runs ``τ`` between
checkpoints.
"""

from __future__ import annotations

import math

from planner.contracts import ClusterProfile, LinkLevel, ModelSpec, ParallelLayout, Prediction, TrainingConfig
from planner.contracts.goodput import CheckpointChoice, GoodputPrediction, TrainingGoal
from planner.cost.comm import host_copy_time_s
from planner.cost.memory import state_bytes_per_param
from planner.cost.params import total_params


def job_mtbf_s(failures_per_gpu_hour: float, gpus: int) -> float:
    """``M = 3600 / (rate · GPUs)``: any GPU's failure stops the whole job."""
    return 3600.0 / (failures_per_gpu_hour * gpus)


def young_interval_s(delta_s: float, mtbf_s: float) -> float:
    """Young (1974), to first order: ``τ = sqrt(2 δ M)``."""
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval_s(delta_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 37, for ``δ`` not small against ``M``: ``τ = sqrt(2δM)·(1 + x/3 + x²/9) − δ`` with
    ``x = sqrt(δ / 2M)``, for ``δ < 2M``; ``τ = M`` beyond."""
    if delta_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = math.sqrt(delta_s / (2.0 * mtbf_s))
    return max(young_interval_s(delta_s, mtbf_s) * (1.0 + x / 3.0 + x * x / 9.0) - delta_s, 1e-9)


def expected_wall_s(train_s: float, interval_s: float, delta_s: float, restart_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 20: the expected wall-clock time to complete ``train_s`` of training,
    ``T_w = M·e^{R/M}·(e^{(τ+δ)/M} − 1)·T_s/τ``; without failures (``M → ∞``) ``T_s·(1 + δ/τ)``."""
    return mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + delta_s) / mtbf_s) * train_s / interval_s


def checkpoint_bytes_per_param(training: TrainingConfig, master_in_param: bool) -> float:
    """Bytes one parameter takes in a checkpoint: its optimizer states (the fp32 master included) and, where
    the 16-bit weights are parameters of their own (not copies of the fp32 master), those too. Mixed-precision
    AdamW: ``4 + 8 (+ 2) = 12 (14)``; gradients are not saved."""
    state = state_bytes_per_param(training)
    return state.optimizer + (0 if master_in_param else state.weights)


def checkpoint_sizes(model: ModelSpec, training: TrainingConfig, layout: ParallelLayout, prediction: Prediction,
                     master_in_param: bool) -> tuple[float, float]:
    """(bytes of one checkpoint, stored once; bytes the most loaded rank copies to host): the parameters times
    :func:`checkpoint_bytes_per_param`, and the rank's weights and optimizer states as the memory model holds
    them (an offloaded optimizer share is on the host already: the memory model's optimizer bytes are the GPU's)."""
    total = total_params(model) * checkpoint_bytes_per_param(training, master_in_param)
    mem = prediction.memory
    per_rank = mem.params_bytes + mem.optimizer_bytes
    return float(total), float(per_rank)


def checkpoint_times(profile: ClusterProfile, per_rank_bytes: float, total_bytes: float, nodes: int,
                     gbps_per_node: float) -> tuple[float, float]:
    """(device-to-host copy of the rank's states over the host link, the write of the whole checkpoint at
    ``nodes · gbps_per_node`` GB/s): every rank copies at once, and storage takes each byte once. A profile of
    CPU ranks has no host link: their copy is one through host memory (``assumptions.cpu_optimizer_bytes_per_s``)."""
    write = total_bytes / (nodes * gbps_per_node * 1e9)
    if not any(link.level is LinkLevel.host_device for link in profile.links):
        return per_rank_bytes / profile.assumptions.cpu_optimizer_bytes_per_s, write
    return host_copy_time_s(profile, per_rank_bytes, to_device=False), write


def choose_checkpoint(mode: str, copy_s: float, write_s: float, train_s: float, restart_s: float,
                      mtbf_s: float) -> CheckpointChoice:
    """One mode's interval and expected wall time. ``sync``: training stops for the copy and the write
    (``δ = copy + write``). ``async``: it stops for the copy only (``δ = copy``); the write runs behind it, so
    the interval is at least the write, and a failure loses the checkpoint being written: the restart is
    charged the write as well (``R + write``, an upper estimate)."""
    if mode == "sync":
        delta, restart, floor = copy_s + write_s, restart_s, 0.0
    else:
        delta, restart, floor = copy_s, restart_s + write_s, write_s
    interval = max(daly_interval_s(max(delta, 1e-9), mtbf_s), floor)
    wall = expected_wall_s(train_s, interval, delta, restart, mtbf_s)
    return CheckpointChoice(mode=mode, blocking_s=delta, write_s=write_s, interval_s=interval, wall_s=wall,
                            goodput=min(1.0, train_s / wall))


def steps_to_train(goal: TrainingGoal, training: TrainingConfig) -> int:
    """The goal's steps, or its tokens over the tokens of one step, rounded up."""
    if goal.steps is not None:
        return goal.steps
    per_step = training.global_batch_seqs * training.seq_length
    return max(1, math.ceil(goal.tokens / per_step))


def plan_goodput(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout: ParallelLayout,
                 num_gpus: int, prediction: Prediction, goal: TrainingGoal, target: str) -> GoodputPrediction:
    """The plan's time-to-train: each checkpoint mode the target offers (:func:`choose_checkpoint`; async where
    ``TargetFacts.async_checkpoint`` names its option), the one with the shorter expected wall time chosen;
    days, GPU-hours (every GPU held for the wall time) and cost."""
    from planner import targets

    facts = targets.target_facts(target)
    steps = steps_to_train(goal, training)
    train_s = steps * prediction.step_time_s
    mtbf = job_mtbf_s(goal.failure_rate_per_gpu_hour, num_gpus)
    total, per_rank = checkpoint_sizes(model, training, layout, prediction, facts.master_in_param)
    nodes = math.ceil(num_gpus / profile.gpus_per_node)
    copy_s, write_s = checkpoint_times(profile, per_rank, total, nodes, goal.checkpoint_gbps_per_node)
    modes = ["sync"] + (["async"] if facts.async_checkpoint else [])
    found = sorted((choose_checkpoint(m, copy_s, write_s, train_s, goal.restart_s, mtbf) for m in modes),
                   key=lambda c: c.wall_s)
    chosen = found[0]
    gpu_hours = chosen.wall_s / 3600.0 * num_gpus
    notes = [f"async checkpoints: {facts.async_checkpoint}" if chosen.mode == "async" else
             f"synchronous checkpoints ({facts.checkpoint_source})"]
    return GoodputPrediction(
        steps=steps, train_s=train_s, mtbf_s=mtbf, checkpoint_bytes=total, checkpoint_bytes_per_rank=per_rank,
        chosen=chosen, other=found[1] if len(found) > 1 else None, days=chosen.wall_s / 86400.0,
        gpu_hours=gpu_hours, cost=None if goal.price_per_gpu_hour is None else gpu_hours * goal.price_per_gpu_hour,
        notes=notes)

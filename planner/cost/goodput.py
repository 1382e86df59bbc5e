"""Time-to-train of a plan on a cluster that fails: checkpoint size and cost, the optimal interval, goodput.

Pure functions, each formula in its docstring, checked against hand calculations in
tests/test_goodput.py. The model is Daly's (2006): failures arrive as a Poisson process of mean time
between failures ``M`` (the job's: one GPU's rate times the GPUs), a checkpoint stops training for ``δ``,
a failure costs the restart ``R`` plus the work since the last checkpoint, and training runs ``τ`` between
checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.contracts import (
    CheckpointCost,
    CheckpointLine,
    CheckpointPoint,
    ClusterProfile,
    LinkLevel,
    ModelSpec,
    ParallelLayout,
    Prediction,
    TrainingConfig,
)
from planner.contracts.goodput import LLAMA3_STORAGE_GBPS_PER_NODE, CheckpointChoice, GoodputPrediction, TrainingGoal
from planner.cost.comm import host_copy_time_s
from planner.cost.memory import state_bytes_per_param
from planner.cost.params import embedding_tensors, head_tensors, layer_tensors, total_params
from planner.cost.pipeline import head_rank, rank_layers


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
    """Bytes one parameter takes in a checkpoint: its optimizer states (the fp32 master included) and the
    weights, unless they are the fp32 master itself (``master_in_param`` with a master: FSDP2's fp32 parameter).
    Mixed-precision AdamW: ``4 + 8 (+ 2) = 12 (14)``; fp32 AdamW (no master: the weights are it): ``4 + 8 = 12``;
    gradients are not saved."""
    state = state_bytes_per_param(training)
    return state.optimizer + (0 if master_in_param and state.master else state.weights)


def checkpoint_sizes(model: ModelSpec, training: TrainingConfig, layout: ParallelLayout, prediction: Prediction,
                     master_in_param: bool) -> tuple[float, float]:
    """(bytes of one checkpoint, stored once; bytes the most loaded rank copies to host): the parameters times
    :func:`checkpoint_bytes_per_param`, and the rank's weights and optimizer states as the memory model holds
    them (an offloaded optimizer share is on the host already: the memory model's optimizer bytes are the GPU's)."""
    total = total_params(model) * checkpoint_bytes_per_param(training, master_in_param)
    mem = prediction.memory
    per_rank = mem.params_bytes + mem.optimizer_bytes
    return float(total), float(per_rank)


def line_time_s(line: CheckpointLine, nbytes: float, tensors: int) -> float:
    """A measured checkpoint line at a rank's state: ``t = fixed_s + per_tensor_s · tensors + bytes / bytes_per_s``."""
    return line.fixed_s + line.per_tensor_s * tensors + nbytes / line.bytes_per_s


def state_tensors_per_rank(model: ModelSpec, layout: ParallelLayout) -> int:
    """Parameter tensors the most loaded pipeline rank saves: the blocks it holds
    (:func:`planner.cost.pipeline.rank_layers`, :func:`planner.cost.params.layer_tensors`), the embedding on rank
    0 and the final norm and head on the head's rank. Sharding (TP, ZeRO, FSDP, EP) splits a tensor, it adds none."""
    head = head_rank(layout.schedule, layout.pp, layout.virtual_stages)
    return max(sum(layer_tensors(model, i) for i in layers) + (embedding_tensors(model) if rank == 0 else 0)
               + (head_tensors(model) if rank == head else 0)
               for rank, layers in enumerate(rank_layers(layout, model.num_layers)))


MAX_LINE_RATE = 1e13  # bytes/s: a line whose times do not grow with the bytes (the contract's bound)


def _solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares ``rows · x ≈ ys`` by the normal equations (a few columns), None when singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in a[pivot][:n])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [v - f * w for v, w in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def fit_line(points: list[tuple[float, int, float]]) -> CheckpointLine:
    """``t = fixed + per_tensor · tensors + bytes / rate`` through (bytes, tensors, seconds) points, each
    weighted by 1/t (relative error: the points span orders of magnitude), every coefficient ≥ 0: the subset
    of terms with the least weighted residual whose coefficients are all non-negative (a term the points do not
    show is left at 0; a line whose times do not grow with the bytes gets ``MAX_LINE_RATE``)."""
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 8):
        cols = [k for k in range(3) if mask >> k & 1]
        rows = [[(1.0, float(n), b)[k] / t for k in cols] for b, n, t in points]
        x = _solve(rows, [1.0] * len(points)) if len(points) >= len(cols) else None
        if x is None or min(x) < 0:
            continue
        coef = [0.0, 0.0, 0.0]
        for k, v in zip(cols, x):
            coef[k] = v
        resid = sum((coef[0] + coef[1] * n + coef[2] * b - t) ** 2 / t**2 for b, n, t in points)
        if best is None or resid < best[0]:
            best = (resid, coef)
    if best is None:
        raise ValueError(f"no checkpoint line fits the points {points[:4]}")
    fixed, per_tensor, per_byte = best[1]
    return CheckpointLine(fixed_s=fixed, per_tensor_s=per_tensor,
                          bytes_per_s=min(MAX_LINE_RATE, 1.0 / per_byte) if per_byte > 0 else MAX_LINE_RATE)


def fit_checkpoint_cost(points: list[CheckpointPoint], ranks: int, storage: str) -> CheckpointCost:
    """The three lines through measured saves (:func:`fit_line`): sync blocking and the async write at the
    bytes written, the async blocking at the bytes held (its copy)."""
    def line(mode: str, write: bool) -> CheckpointLine:
        return fit_line([((p.bytes if write or mode == "sync" or p.held_bytes is None else p.held_bytes), p.tensors,
                          p.write_s if write else p.blocking_s) for p in points if p.mode == mode])

    return CheckpointCost(ranks=ranks, storage=storage[:500], sync=line("sync", False),
                          async_blocking=line("async", False), async_write=line("async", True), points=points)


@dataclass(frozen=True)
class CheckpointTimes:
    """One checkpoint of a plan: ``sync_s`` training stops for a synchronous save; an asynchronous one stops it
    for ``copy_s`` while ``write_s`` goes on behind it; ``source`` says where the figures came from."""

    sync_s: float
    copy_s: float
    write_s: float
    source: str


def largest_replicated_item_bytes(model: ModelSpec, layout: ParallelLayout) -> float:
    """The largest state-dict entry that several data-parallel ranks hold whole: torch.distributed.checkpoint
    writes such an entry once, giving each to the rank that has planned the fewest bytes so far, in the order the
    entries come (``dedup_save_plans``), so the busiest rank writes up to the even share plus the largest one.
    The largest tensor is the token table or head ``V·h`` (an expert stack ``E·h·F`` if larger), split by TP (and
    by ``dp_shard`` under HSDP), as an fp32 optimizer state; none where nothing is replicated (one data-parallel
    rank, or FSDP / ZeRO-3 over all of them)."""
    replicas = layout.dp_replicate * (layout.dp_shard if layout.zero_stage < 3 else 1)
    if replicas == 1:
        return 0.0
    big = max(model.vocab_size * model.hidden_size,
              0 if model.moe is None else model.moe.num_experts * model.hidden_size * model.moe.expert_ffn_hidden_size)
    split = layout.tp * (layout.dp_shard if layout.zero_stage >= 3 else 1)
    return big / split * 4  # an fp32 optimizer state: no weights copy is larger


def written_bytes(model: ModelSpec, layout: ParallelLayout, total_bytes: float, ranks: int) -> float:
    """What the busiest rank writes of a checkpoint of ``total_bytes``: the even share plus the largest replicated
    entry (:func:`largest_replicated_item_bytes`), at most the whole checkpoint."""
    return min(total_bytes, total_bytes / ranks + largest_replicated_item_bytes(model, layout))


def checkpoint_times(profile: ClusterProfile, per_rank_bytes: float, total_bytes: float, tensors: int,
                     ranks: int, gbps_per_node: float | None, written: float | None = None) -> CheckpointTimes:
    """A plan's checkpoint on ``ranks`` ranks: the most loaded rank holds ``per_rank_bytes`` and writes
    ``written`` (:func:`written_bytes`; None: the even share ``total_bytes / ranks``, torch.distributed.checkpoint
    writing a replicated tensor once and a sharded one by its holder).

    With the profile's measured lines (``profile.checkpoint``) and no storage bandwidth stated: sync and the
    async write its line at the written share, the async blocking (the copy: it stages every tensor the rank
    holds) its line at the held bytes, and the async write that copy plus what the lines put behind it at the
    written share (``write(written) − blocking(written)``; the profiler's ranks hold what they write), all at the
    rank's ``tensors`` (:func:`line_time_s`). Otherwise the copy
    is the held bytes over the host link (a CPU rank's through host memory,
    ``assumptions.cpu_optimizer_bytes_per_s``) and the write the whole checkpoint at ``nodes · gbps_per_node``
    GB/s (storage takes each byte once; unstated: Llama 3's), plus the measured lines' per-save and per-tensor
    costs where the profile has them (none where it does not)."""
    measured, written = profile.checkpoint, total_bytes / ranks if written is None else written
    if measured is not None and gbps_per_node is None:
        copy = line_time_s(measured.async_blocking, per_rank_bytes, tensors)
        behind = line_time_s(measured.async_write, written, tensors) - line_time_s(measured.async_blocking, written,
                                                                                   tensors)
        return CheckpointTimes(line_time_s(measured.sync, written, tensors), copy, copy + max(0.0, behind),
                               f"measured checkpoint lines ({measured.storage})")
    gbps = LLAMA3_STORAGE_GBPS_PER_NODE if gbps_per_node is None else gbps_per_node
    write = total_bytes / (math.ceil(ranks / profile.gpus_per_node) * gbps * 1e9)
    if not any(link.level is LinkLevel.host_device for link in profile.links):
        copy = per_rank_bytes / profile.assumptions.cpu_optimizer_bytes_per_s
    else:
        copy = host_copy_time_s(profile, per_rank_bytes, to_device=False)
    if measured is None:
        return CheckpointTimes(copy + write, copy, write, f"host copy and {gbps:.3g} GB/s per node; no per-save cost "
                               "measured")
    sync_fixed, copy_fixed = (line_time_s(measured.sync, 0, tensors), line_time_s(measured.async_blocking, 0, tensors))
    return CheckpointTimes(sync_fixed + copy + write, copy_fixed + copy, write,
                           f"host copy and {gbps:.3g} GB/s per node, measured per-save costs")


def choose_checkpoint(mode: str, times: CheckpointTimes, train_s: float, restart_s: float,
                      mtbf_s: float) -> CheckpointChoice:
    """One mode's interval and expected wall time. ``sync``: training stops for the whole save
    (``δ = times.sync_s``). ``async``: it stops for the copy only (``δ = times.copy_s``); the write runs behind
    it, so the interval is at least the write, and a failure loses the checkpoint being written: the restart is
    charged the write as well (``R + write``, an upper estimate)."""
    if mode == "sync":
        delta, write, restart, floor = times.sync_s, times.sync_s, restart_s, 0.0
    else:
        delta, write, restart, floor = times.copy_s, times.write_s, restart_s + times.write_s, times.write_s
    interval = max(daly_interval_s(max(delta, 1e-9), mtbf_s), floor)
    wall = expected_wall_s(train_s, interval, delta, restart, mtbf_s)
    return CheckpointChoice(mode=mode, blocking_s=delta, write_s=write, interval_s=interval, wall_s=wall,
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
    times = checkpoint_times(profile, per_rank, total, state_tensors_per_rank(model, layout), num_gpus,
                             goal.checkpoint_gbps_per_node, written_bytes(model, layout, total, num_gpus))
    modes = ["sync"] + (["async"] if facts.async_checkpoint else [])
    found = sorted((choose_checkpoint(m, times, train_s, goal.restart_s, mtbf) for m in modes),
                   key=lambda c: c.wall_s)
    chosen = found[0]
    gpu_hours = chosen.wall_s / 3600.0 * num_gpus
    notes = [f"async checkpoints: {facts.async_checkpoint}" if chosen.mode == "async" else
             f"synchronous checkpoints ({facts.checkpoint_source})", f"checkpoint cost: {times.source}"]
    return GoodputPrediction(
        steps=steps, train_s=train_s, mtbf_s=mtbf, checkpoint_bytes=total, checkpoint_bytes_per_rank=per_rank,
        chosen=chosen, other=found[1] if len(found) > 1 else None, days=chosen.wall_s / 86400.0,
        gpu_hours=gpu_hours, cost=None if goal.price_per_gpu_hour is None else gpu_hours * goal.price_per_gpu_hour,
        notes=notes)

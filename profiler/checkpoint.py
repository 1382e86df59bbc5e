"""Measure what a checkpoint costs on this cluster's storage, for the goodput (``planner.cost.goodput``).

Every rank saves a model-shaped state at once with the executor's own checkpointer
(:class:`executor.checkpoint.Checkpointer`: ``get_state_dict`` and torch.distributed.checkpoint), the state on
the rank's device: parameters and the AdamW states of one step, synchronously (``dcp.save``) and asynchronously
(``dcp.async_save``: until it returns, and until the write is done). The configurations vary the size of the
state per rank (each rank's its own, as a sharded plan's) and the count of its parameter tensors
(:data:`GRID`): a save costs per tensor (its state-dict entries: the weight, AdamW's states and the flattened
param-group settings; their write requests) as well as per byte and per save. A line per mode is fitted
through the medians (``planner.cost.goodput.fit_line``) and the points are kept in the profile.

The saves go to ``--checkpoint-dir`` (default: the system's temporary folder on every node, which is rarely
where a job's checkpoints go: give the storage the training will write to) and are deleted after each trial.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from executor.checkpoint import Checkpointer
from executor.reference import make_optimizer
from planner.contracts import CheckpointCost, CheckpointPoint
from planner.cost.goodput import fit_checkpoint_cost

MIB = 1 << 20
# (state bytes per rank, parameter tensors per rank): small and large states in few and many tensors, so the
# per-tensor and per-byte terms each move by an order of magnitude and four points fit three coefficients
# (quick: seconds on CPU ranks)
GRID = {True: ((4 * MIB, 16), (4 * MIB, 64), (128 * MIB, 16), (128 * MIB, 64)),
        False: ((32 * MIB, 16), (32 * MIB, 512), (1024 * MIB, 16), (1024 * MIB, 512))}
TRIALS = {True: 3, False: 5}
STATE_BYTES_PER_ELEMENT = 12  # fp32 weight, AdamW's exp_avg and exp_avg_sq


def shared_root(checkpoint_dir: str | None) -> Path:
    """One folder name for every rank (rank 0's choice, broadcast): under ``checkpoint_dir`` or the system's
    temporary folder."""
    box = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    base = Path(checkpoint_dir) if checkpoint_dir else Path(tempfile.gettempdir())
    return base / f"autopar-profile-checkpoint-{box[0]}"


def model_state(nbytes: int, tensors: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A module of ``tensors`` equal 1-D parameters whose weights and AdamW states take ``nbytes``, after one
    optimizer step (so the states exist). Their names carry the rank: each rank holds and writes a state of its
    own, as a sharded plan's ranks do (replicated names would be written once, by one rank)."""
    numel = max(1, nbytes // (STATE_BYTES_PER_ELEMENT * tensors))
    rank = dist.get_rank()
    module = nn.ParameterDict({f"rank{rank}_{i}": nn.Parameter(torch.zeros(numel, device=device))
                               for i in range(tensors)})
    optimizer = make_optimizer(module.parameters())
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return module, optimizer


def _timed_saves(ck: Checkpointer, module: nn.Module, optimizer: torch.optim.Optimizer, first_step: int,
                 trials: int) -> tuple[float, float]:
    """Median (blocking, write) seconds of ``trials`` saves by every rank (rank 0's view, as a run records
    them) after one more that is not counted (a state's first save sets up: DCP's plan, the async save's
    thread); each save is deleted after it."""
    for k in range(trials + 1):
        dist.barrier()
        path = ck.save(first_step + k, [module], optimizer, {})
        ck.wait()
        dist.barrier()
        if _node_leader():
            shutil.rmtree(path, ignore_errors=True)
    done = ck.records[-trials:]
    return statistics.median(r.blocking_s for r in done), statistics.median(r.write_s for r in done)


def _node_leader() -> bool:
    """The first rank of a node, rank 0 included (node-local storage is deleted by each node; outside torchrun,
    the one process)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def measure_checkpoint(device: torch.device, checkpoint_dir: str | None, quick: bool,
                       progress=None) -> CheckpointCost:  # noqa: ANN001
    """Every rank: the grid's saves in both modes; the fitted lines and their points (every rank returns
    them; rank 0's timings)."""
    root = shared_root(checkpoint_dir)
    configs, trials = GRID[quick], TRIALS[quick]
    savers = {"sync": Checkpointer(root / "sync"), "async": Checkpointer(root / "async", use_async=True)}
    points: list[CheckpointPoint] = []
    for i, (nbytes, tensors) in enumerate(configs):
        module, optimizer = model_state(nbytes, tensors, device)
        state_bytes = sum(p.numel() for p in module.parameters()) * STATE_BYTES_PER_ELEMENT
        for mode, ck in savers.items():
            blocking, write = _timed_saves(ck, module, optimizer, i * (trials + 1), trials)
            points.append(CheckpointPoint(mode=mode, bytes=state_bytes, tensors=tensors, blocking_s=blocking,
                                          write_s=write))
        del module, optimizer
        if progress is not None:
            progress(f"saves of {nbytes // MIB} MiB in {tensors} tensors per rank", i + 1, len(configs))
    dist.barrier()
    if _node_leader():
        shutil.rmtree(root, ignore_errors=True)
    return fit_checkpoint_cost(points, dist.get_world_size(), str(root.parent))

"""Checkpoints with torch.distributed.checkpoint (DCP), keyed by plan-independent parameter names.

``<root>/step_<N>/`` holds, after N optimizer steps:

- ``model``: every parameter by its fully qualified name in the unsplit model (the built-in
  model's names survive the pipeline split; ``get_state_dict`` strips the DDP / FSDP / recompute
  wrappers), as plain tensors or DTensor shards — whatever this plan holds;
- ``optim``: AdamW's state *flattened* by parameter name (``state.<fqn>.exp_avg``, ``...exp_avg_sq``,
  ``...step``, ``param_groups.<fqn>.lr`` ...), so it is independent of which rank owns which
  parameter and in which order the optimizer saw them;
- ``progress``: the next step to run (the data position: batches are a pure function of the step)
  and the loss/time of every step so far.

DCP writes each rank's shards plus global metadata; loading plans the reads from the *current*
plan's shapes and placements, so a checkpoint saved under one plan loads under another (PP2xDP2 ->
DP4, TP2xDP2 -> FSDP4, 4 ranks -> 2 ranks): DCP reshards tensors and DTensors alike.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from planner.contracts.report import CheckpointRecord

STEP_DIR = re.compile(r"^step_(\d+)$")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def latest_step(root: str | Path) -> int | None:
    """The highest step saved completely under ``root`` (DCP writes ``.metadata`` last), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / ".metadata").exists()]
    return max(steps, default=None)


def _tensor_bytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state dict, DTensors by their local shard."""
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _module(parts: list[nn.Module]) -> nn.Module:
    """The rank's chunks as one module whose names are the model's (the chunks of an interleaved or V
    schedule each hold some of ``layers``; they are merged, not listed, so ``layers.7`` stays ``layers.7``)."""
    return parts[0] if len(parts) == 1 else _merge(parts)


def _merge(parts: list[nn.Module]) -> nn.Module:
    """A container holding every chunk's modules under their own names: a child with parameters in one chunk
    only is taken as it is (a Hugging Face chunk's stand-in ``nn.Identity`` norm or head has none); a child
    with parameters in several (a ``layers`` dict) is merged the same way."""
    merged = nn.Module()
    for name in dict.fromkeys(n for part in parts for n, _ in part.named_children()):
        children = [c for part in parts if (c := dict(part.named_children()).get(name)) is not None
                    and next(c.parameters(), None) is not None]
        if len(children) > 1 and any(next(c.parameters(recurse=False), None) is not None for c in children):
            raise ValueError(f"chunks hold the weights of {name} twice")  # a shared module: not a pipeline split
        if children:
            merged.add_module(name, children[0] if len(children) == 1 else _merge(children))
    return merged


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeRO-1 (ZeroRedundancyOptimizer): the AdamW over this rank's partition of the parameters. Its
    flattened state holds exactly the names this rank owns, so the ranks' files together hold every
    parameter's state once, loadable by any plan."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _state(parts: list[nn.Module], optimizer: torch.optim.Optimizer, progress: dict) -> dict:
    model_sd, optim_sd = get_state_dict(_module(parts), _local_optimizer(optimizer), options=OPTIONS)
    return {"model": model_sd, "optim": optim_sd, "progress": progress}


def _written(record: CheckpointRecord, t0: float, done: threading.Event, _future: Future) -> None:
    """An asynchronous save's done callback: its write time, from the save's start."""
    record.write_s = time.perf_counter() - t0
    done.set()


class Checkpointer:
    """Saves every ``every`` steps (synchronously, or with ``dcp.async_save`` overlapping the next
    steps: at most one save in flight) and loads the newest step."""

    def __init__(self, root: str | Path, *, every: int = 0, use_async: bool = False) -> None:
        self.root, self.every, self.use_async = Path(root), every, use_async
        self._pending: Future | None = None
        self._written = threading.Event()
        self.records: list[CheckpointRecord] = []  # each save's blocking and write times
        # an async save runs its collectives in a background thread: on the training's own process group
        # they would interleave with the step's collectives (a hang), so it gets a group of its own
        self._group = dist.new_group(backend="gloo") if use_async else None

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, parts: list[nn.Module], optimizer: torch.optim.Optimizer,
             progress: dict) -> Path:
        """Collective: every rank writes its shards of the state after ``steps_done`` steps."""
        self.wait()
        path = step_dir(self.root, steps_done)
        t0 = time.perf_counter()
        state = _state(parts, optimizer, {**progress, "step": steps_done})
        nbytes = _tensor_bytes(state)
        tensors = len(state["model"])
        if self.use_async:
            result = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            self._pending = getattr(result, "upload_completion", result)
            record = self._record(steps_done, "async", time.perf_counter() - t0, nbytes, tensors)
            self._written = threading.Event()
            self._pending.add_done_callback(partial(_written, record, t0, self._written))
        else:
            dcp.save(state, checkpoint_id=str(path))
            # its write is its blocking time
            self._record(steps_done, "sync", time.perf_counter() - t0, nbytes, tensors)
        return path

    def _record(self, step: int, mode: str, blocking_s: float, nbytes: int, tensors: int) -> CheckpointRecord:
        record = CheckpointRecord(step=step, mode=mode, blocking_s=blocking_s, write_s=blocking_s,
                                  bytes_per_rank=nbytes, tensors_per_rank=tensors)
        self.records.append(record)
        return record

    def wait(self) -> None:
        """Block until an asynchronous save has been written and its write time recorded."""
        if self._pending is not None:
            self._pending.result()
            self._written.wait()  # the done callback runs after result() returns in waiters
            self._pending = None

    def load(self, step: int, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict:
        """Load ``step_<step>`` into this plan's parts and optimizer (resharding); returns ``progress``."""
        return load_checkpoint(self.root, step, parts, optimizer)


def load_checkpoint(root: str | Path, step: int, parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict:
    """Read ``root/step_<step>`` into the state dicts of *this* plan, then set them (collective)."""
    path = step_dir(root, step)
    state = _state(parts, optimizer, {"step": 0, "losses": [], "times": []})
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        _module(parts),
        _local_optimizer(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=OPTIONS,
    )
    dist.barrier()
    return state["progress"]

"""A rank's step time split into the planner's terms (:data:`planner.contracts.report.STEP_TERMS`), from
``torch.profiler``.

The executor runs its last few steps under the profiler (:class:`StepProfiler`) with ``record_function``
labels around what only it knows: the step (``autopar.step``), the optimizer step (``autopar.optimizer``),
making the next batch (``autopar.data``) and its own collectives (``autopar.cp``, ``autopar.ep``,
``autopar.dp_grad``, ``autopar.other`` for the loss's all-reduce). FSDP2 labels its own (``FSDP::all_gather``,
``FSDP::post_backward_reduce``, ...). :func:`split_step` walks the main thread's operator tree under each
``autopar.step`` and gives each operator's own time (its time less its children's) to one term:

- inside a communication label, everything is that collective's (FSDP's gathers and copies out, our
  all-to-alls; a blocking wait shows as the label's own time);
- otherwise a collective by its name, wherever it is called from (a loss-parallel cross-entropy's all-reduce
  is communication, not loss): point-to-point sends and receives are the pipeline's, all-to-all the
  experts', under the optimizer step the weights' (ZeRO-1's broadcast), any other the tensor-parallel
  group's where there is one (DTensor) and data parallel's where there is not (DDP's bucketed all-reduce);
- torch's pipeline schedules label each step (``Forward 3``, ``Backward 3``, ``PP:0F3``) and wait for their neighbour's
  tensors inside that label, outside any operator: the label's own time is ``pp`` (the bubble);
- a compute operator by its name: GEMMs, the attention core and the cross-entropy (with what they call),
  the rest elementwise;
- what is left (Python, autograd and framework overhead, waits outside any operator such as DDP's wait for
  its last bucket) is ``other``, so the terms sum to the step's wall time.

Only CPU runs are split: the tree is the main thread's operators, and on CUDA the autograd engine runs the
backward on a device thread of its own and kernels overlap, so a host-thread tree would leave the backward out
(:class:`StepProfiler` does not profile CUDA runs; their reports carry no breakdown).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch.profiler import record_function

from planner.contracts.report import COMM_TERMS, STEP_TERMS, TermTimes

LABELS = {"autopar.optimizer": "optimizer", "autopar.cp": "cp", "autopar.ep": "ep", "autopar.dp_grad": "dp_grad",
          "autopar.other": "other", "autopar.pp": "pp"}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_grouped_mm",
            "aten::mv", "aten::addmv"}
COMM_PREFIXES = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")


@dataclass
class Node:
    """One profiled operator or label on the main thread: its name, its own time in microseconds (its time
    less its children's) and its children."""

    name: str
    self_us: float
    children: list[Node] = field(default_factory=list)


def label_term(name: str) -> str | None:
    """The term a label's whole subtree belongs to (None: not a label that decides)."""
    if name in LABELS:
        return LABELS[name]
    if name.startswith("FSDP::"):
        return "dp_grad" if "post_backward" in name or "reduce" in name else "dp_param"
    return None


def comm_term(name: str, tp: int) -> str:
    """An unlabelled collective's term, by its name (module doc)."""
    low = name.lower()
    if "send" in low or "recv" in low:
        return "pp"
    if "all_to_all" in low or "alltoall" in low:
        return "ep"
    return "tp" if tp > 1 else "dp_grad"


def compute_term(name: str) -> str:
    """An operator's compute term, by its name; ``other`` for what is not an ATen operator."""
    if name in GEMM_OPS:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if "cross_entropy" in name or "log_softmax" in name or "nll_loss" in name:
        return "loss"
    return "elementwise" if name.startswith("aten::") else "other"


COMM_CONTEXTS = (*COMM_TERMS, "other")  # terms of labels whose subtree is communication (autopar.other: the loss's)
# torch.distributed.pipelining's labels of a schedule's steps: "Forward 3" (GPipe, 1F1B), "PP:0F3" (looped schedules)
PIPELINE_OPS = re.compile(r"^(Forward \d+|Backward \d+|PP:.*)$")


def add_times(node: Node, tp: int, out: dict[str, float], inherited: str | None = None) -> None:
    """Add ``node``'s subtree's own times (microseconds) to ``out`` by term."""
    term = label_term(node.name)
    if term is None and node.name.startswith(COMM_PREFIXES) and inherited not in COMM_CONTEXTS:
        # a collective under a compute op (loss-parallel's all-reduce under the log-softmax) is communication;
        # under the optimizer step it moves weights (ZeRO-1's broadcast)
        term = "dp_param" if inherited == "optimizer" else comm_term(node.name, tp)
    term = term or inherited
    own = term or compute_term(node.name)
    if term is None and PIPELINE_OPS.match(node.name):
        own = "pp"  # a schedule step's own time, outside its operators, is the wait for the neighbour's tensors
    out[own] = out.get(own, 0.0) + node.self_us
    # what the attention core and the loss call (allocations, copies, their own kernels) is theirs too
    below = term or (own if own in ("attention", "loss") else None)
    for child in node.children:
        add_times(child, tp, out, below)


def split_step(steps: list[Node], tp: int, data: list[Node] = ()) -> tuple[float, dict[str, float], float]:
    """(mean wall seconds of the ``autopar.step`` nodes given, seconds per step by term, seconds per step
    making batches) — every term of :data:`STEP_TERMS` present, summing to the wall time."""
    totals: dict[str, float] = {}
    wall_us = 0.0
    for step in steps:
        wall_us += subtree_us(step)
        add_times(step, tp, totals)
    n = max(len(steps), 1)
    terms = {t: totals.get(t, 0.0) / n / 1e6 for t in STEP_TERMS}
    return wall_us / n / 1e6, terms, sum(subtree_us(d) for d in data) / n / 1e6


def subtree_us(node: Node) -> float:
    return node.self_us + sum(subtree_us(c) for c in node.children)


def labelled_trees(events: list) -> tuple[list[Node], list[Node]]:
    """(``autopar.step`` nodes, ``autopar.data`` nodes) of ``torch.profiler``'s FunctionEvents, each with the
    operators it called on its thread (``cpu_children``): the labels are only ever entered on the main
    thread, so the collectives' worker threads (gloo's, NCCL's) are not in these trees."""

    def node(e) -> Node:  # noqa: ANN001 - a torch FunctionEvent
        return Node(e.name, float(e.self_cpu_time_total), [node(c) for c in e.cpu_children])

    steps = [node(e) for e in events if e.name == "autopar.step"]
    data = [node(e) for e in events if e.name == "autopar.data"]
    return steps, data


class StepProfiler:
    """Profile the steps :meth:`step` is asked to (the run's last ``count``) and split them by term."""

    def __init__(self, count: int, first: int, device_type: str, tp: int) -> None:
        # CPU runs only (module doc): a CUDA run's report carries no breakdown
        self.count, self.first, self.tp = (count if device_type == "cpu" else 0), first, tp
        self._prof = None

    def profiled(self, step: int) -> bool:
        return self.count > 0 and step >= self.first

    def start(self, step: int) -> None:
        """Start the profiler before step ``step``'s batch is made, if it is the first profiled step; it stays
        on to the end of the run."""
        from torch.profiler import ProfilerActivity, profile

        if self.profiled(step) and self._prof is None:
            self._prof = profile(activities=[ProfilerActivity.CPU])
            self._prof.__enter__()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run step ``step`` labelled ``autopar.step`` when it is profiled."""
        if self._prof is None or not self.profiled(step):
            yield
            return
        with record_function("autopar.step"):
            yield

    def result(self, rank: int) -> TermTimes | None:
        """This rank's :class:`TermTimes` (None when nothing was profiled)."""
        if self._prof is None:
            return None
        self._prof.__exit__(None, None, None)
        steps, data = labelled_trees(list(self._prof.events()))
        self._prof = None
        if not steps:
            return None
        wall, terms, data_s = split_step(steps, self.tp, data)
        terms["other"] = max(0.0, terms["other"])
        return TermTimes(rank=rank, step_s=max(wall, 1e-9), terms=terms, data_s=data_s)


label = record_function  # the executor's labels (module doc); a no-op cost when nothing profiles

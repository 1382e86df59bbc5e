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

CUDA runs are split by device time (:func:`device_trees`, :func:`split_device`): the autograd engine runs the
backward on a thread of its own and kernels run asynchronously, so the host's CPU tree does not tell where the
device's time goes. The step's wall time is still the mean span of the ``autopar.step`` host events (the span
ends with a ``torch.cuda.synchronize()``: :meth:`StepProfiler.step`). Every host event of any thread (the main
one and the autograd engine's) that starts inside a profiled step and has no parent is a tree's root; an
operator's own time is the device time of the kernels it launched itself (``self_device_time_total``), and the
operators and labels go to terms as on CPU. The autograd engine's ``autograd::engine::evaluate_function:
MmBackward0`` is no label: what it calls goes by its own names. ``other`` is the wall time less the device
terms, the time the device sat idle (host-bound gaps, launch latency), plus the device time that goes to
``other`` as on CPU (``autopar.other``'s, non-ATen operators'). Kernels on several streams overlap (NCCL's
beside the compute): where the device terms sum past the wall time, the communication terms are scaled down
until they fit (overlapped communication is not exposed), and where the rest alone is past it, every term is
scaled down alike, so that the terms always sum to the wall time. Communication that overlaps compute but
fits inside the wall time is counted whole (the idle time in ``other`` is then that much short).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

from planner.contracts.report import COMM_TERMS, STEP_TERMS, TermTimes

LABELS = {"autopar.optimizer": "optimizer", "autopar.cp": "cp", "autopar.ep": "ep", "autopar.dp_grad": "dp_grad",
          "autopar.other": "other", "autopar.pp": "pp"}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_grouped_mm",
            "aten::mv", "aten::addmv"}
COMM_PREFIXES = ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "record_param_comms")


@dataclass
class Node:
    """One profiled operator or label: its name, its own time in microseconds (on CPU its time less its
    children's; on CUDA its own kernels' device time) and its children."""

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
    steps = [cpu_node(e) for e in events if e.name == "autopar.step"]
    data = [cpu_node(e) for e in events if e.name == "autopar.data"]
    return steps, data


def cpu_node(e) -> Node:  # noqa: ANN001 - a torch FunctionEvent
    """``e``'s subtree on its thread, each node's own time its own CPU time."""
    return Node(e.name, float(e.self_cpu_time_total), [cpu_node(c) for c in e.cpu_children])


def device_node(e) -> Node:  # noqa: ANN001 - a torch FunctionEvent
    """``e``'s subtree on its thread, each node's own time the device time of the kernels it launched itself
    (``self_cuda_time_total`` where a torch lacks ``self_device_time_total``)."""
    own = getattr(e, "self_device_time_total", None)
    own = e.self_cuda_time_total if own is None else own
    return Node(e.name, float(own), [device_node(c) for c in e.cpu_children])


def device_trees(events: list) -> tuple[list[float], list[Node], list[Node]]:
    """(each ``autopar.step``'s wall microseconds, the roots of every thread's trees inside the steps by device
    time, the ``autopar.data`` nodes by CPU time) of a CUDA run's FunctionEvents (module doc). Only host events
    count: the kernels' own events, the labels' copies on the device timeline and async ranges do not."""
    host = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    windows = [(e.time_range.start, e.time_range.end) for e in host if e.name == "autopar.step"]
    roots = [device_node(e) for e in host
             if e.cpu_parent is None and any(a <= e.time_range.start < b for a, b in windows)]
    data = [cpu_node(e) for e in host if e.name == "autopar.data"]
    return [b - a for a, b in windows], roots, data


def split_device(walls_us: list[float], roots: list[Node], tp: int,
                 data: list[Node] = ()) -> tuple[float, dict[str, float], float]:
    """:func:`split_step` for a CUDA run (module doc): (mean wall seconds of the steps, seconds per step by term,
    seconds per step making batches), the device terms with the device's idle time in ``other``, fitted to the
    wall time (:func:`fit_to_wall`)."""
    totals: dict[str, float] = {}
    for root in roots:
        add_times(root, tp, totals)
    n = max(len(walls_us), 1)
    wall = sum(walls_us) / n / 1e6
    terms = {t: totals.get(t, 0.0) / n / 1e6 for t in STEP_TERMS}
    terms["other"] += max(0.0, wall - sum(terms.values()))
    return wall, fit_to_wall(terms, wall), sum(subtree_us(d) for d in data) / n / 1e6


def fit_to_wall(terms: dict[str, float], wall: float) -> dict[str, float]:
    """``terms`` scaled down to sum to ``wall`` where they sum past it (overlapping streams): the communication
    terms first, down to nothing, then every term alike."""
    total = sum(terms.values())
    if total <= wall:
        return terms
    comm = sum(terms[t] for t in COMM_TERMS)
    keep = max(0.0, 1.0 - (total - wall) / comm) if comm > 0 else 1.0
    terms = {t: v * keep if t in COMM_TERMS else v for t, v in terms.items()}
    rest = sum(terms.values())
    if rest > wall:
        terms = {t: v * wall / rest for t, v in terms.items()}
    return terms


class StepProfiler:
    """Profile the steps :meth:`step` is asked to (the run's last ``count``) and split them by term."""

    def __init__(self, count: int, first: int, device_type: str, tp: int) -> None:
        # CPU and CUDA runs (module doc): other devices' reports carry no breakdown
        self.count, self.first, self.tp = (count if device_type in ("cpu", "cuda") else 0), first, tp
        self.cuda = device_type == "cuda"
        self._prof = None

    def profiled(self, step: int) -> bool:
        return self.count > 0 and step >= self.first

    def start(self, step: int) -> None:
        """Start the profiler before step ``step``'s batch is made, if it is the first profiled step; it stays
        on to the end of the run."""
        from torch.profiler import ProfilerActivity, profile

        if self.profiled(step) and self._prof is None:
            cuda = [ProfilerActivity.CUDA] if self.cuda else []
            self._prof = profile(activities=[ProfilerActivity.CPU, *cuda])
            self._prof.__enter__()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run step ``step`` labelled ``autopar.step`` when it is profiled."""
        if self._prof is None or not self.profiled(step):
            yield
            return
        with record_function("autopar.step"):
            yield
            if self.cuda:  # the step's span ends when its kernels have (the optimizer's launches return at once)
                torch.cuda.synchronize()

    def result(self, rank: int) -> TermTimes | None:
        """This rank's :class:`TermTimes` (None when nothing was profiled)."""
        if self._prof is None:
            return None
        self._prof.__exit__(None, None, None)
        events = list(self._prof.events())
        self._prof = None
        if self.cuda:
            walls, roots, data = device_trees(events)
            if not walls:
                return None
            wall, terms, data_s = split_device(walls, roots, self.tp, data)
        else:
            steps, data = labelled_trees(events)
            if not steps:
                return None
            wall, terms, data_s = split_step(steps, self.tp, data)
            terms["other"] = max(0.0, terms["other"])
        return TermTimes(rank=rank, step_s=max(wall, 1e-9), terms=terms, data_s=data_s)


label = record_function  # the executor's labels (module doc); a no-op cost when nothing profiles

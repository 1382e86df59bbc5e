"""What the search may choose (:class:`SearchOptions`): the one home of the search's defaults, which the
API's ``PlanOptions`` and ``autopar plan``'s flags read. Imports nothing heavy (no OR-Tools), so the CLI can
read the defaults at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from planner.contracts import Schedule
from planner.contracts.limits import MAX_TIME_BUDGET_S
from planner.errors import AutoparError


@dataclass(frozen=True)
class SearchOptions:
    """What the search may choose, and the framework features the layouts assume. The one home of the
    search's defaults: the API's ``PlanOptions`` and ``autopar plan``'s flags take theirs from here."""

    top_k: int = 5
    max_micro_batch_size: int = 16
    max_virtual_stages: int = 8
    schedules: tuple[Schedule, ...] = tuple(Schedule)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    hsdp: bool = True
    offload: bool = True
    offload_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)  # shares of the optimizer offloaded, where the
    # target offloads a share (Megatron-Core ZeRO-1, DeepSpeed ZeRO-3; planner.targets): a plan dimension
    max_tp: int | None = None  # default: GPUs per node (TP stays inside a node)
    max_pp: int | None = None  # default: no limit but the layer count
    max_cp: int | None = None
    max_ep: int | None = None
    sequence_parallel: bool = True  # False: never split norms/dropout over the TP group
    # framework features (not searched): what the training stack does
    tp_comm_overlap: bool = False
    dp_comm_overlap: bool = True
    ep_comm_overlap: bool = False
    compile: bool = False  # torch.compile of model and loss (ParallelLayout.compile): torchtitan only
    pp_scatter_gather: bool | None = None  # None: what the target's pipeline sends (TargetFacts.pp_sends, by sp)
    solver_time_limit_s: float = 1.0
    time_budget_s: float = 20.0  # seconds for the whole search, every phase (0 < budget <= MAX_TIME_BUDGET_S)
    workers: int = 1  # CP-SAT search workers: its models are small, one worker proves them ~2x faster than two
    target: str = "autopar"  # what will run the plan (planner.targets): its regime prices the intervals
    robust: bool = False  # rank the plans found by the pessimistic end of their step-time interval
    idle_gpus: bool = True  # an uneven GPU count is searched beside smaller ones (planner.search.sizing)
    global_batch_max: int | None = None  # the global batch may be any count up to this (planner.search.sizing)

    def __post_init__(self) -> None:
        b = self.time_budget_s
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= MAX_TIME_BUDGET_S:
            raise AutoparError("time_budget_s", b,
                               f"give a number of seconds above 0 and at most {MAX_TIME_BUDGET_S:g}",
                               problem="is not a time budget the search can keep")

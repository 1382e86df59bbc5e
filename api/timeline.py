"""One training step of a pipeline, simulated: which micro-batch each stage (rank) runs, and when.

:func:`simulate` is a pure function. Each rank runs its operations in the order its schedule
prescribes (GPipe, 1F1B, interleaved 1F1B, or an approximation of zero-bubble); an operation starts
when its rank is free and the operation it depends on has ended:

* forward of micro-batch *j* on virtual stage *s* after its forward on stage *s - 1*;
* backward of *j* on stage *s* after its backward on stage *s + 1* (the last stage: after its own
  forward);
* zero-bubble's weight-gradient half ``W`` after the input-gradient half ``B`` of the same
  micro-batch on the same rank.

Virtual stage ``s = chunk * p + rank`` (Megatron's interleaving: rank r holds chunks r, r + p, ...).
The V schedules (ZB-V, DualPipeV: rank r holds chunks r and 2p-1-r, :func:`planner.cost.pipeline.rank_chunks`)
are simulated greedily instead (:func:`_simulate_v`): a free rank runs the ready operation it can start
first, an input gradient before a forward before a weight gradient, holding at most the schedule's
micro-batches in flight. Gaps between a rank's boxes are the pipeline bubble. Communication is not drawn.
"""

from __future__ import annotations

from typing import NamedTuple

from planner.contracts import Schedule
from planner.cost.pipeline import SCHEDULES as FACTS
from planner.cost.pipeline import microbatches_in_flight, rank_chunks

SCHEDULES = tuple(s.value for s in Schedule)
V_SCHEDULES = tuple(s.value for s in Schedule if FACTS[s].v_shape)


class Box(NamedTuple):
    kind: str  # "F" forward, "B" backward (zero-bubble: input gradient only), "W" weight gradient
    microbatch: int
    start_s: float
    end_s: float
    chunk: int = 0  # model chunk on this rank (interleaved); 0 otherwise


class ScheduleError(ValueError):
    pass


def _order_1f1b(p: int, r: int, ops_f: list, ops_b: list, warmup: int) -> list:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards."""
    n = len(ops_f)
    w = min(warmup, n)
    order = list(ops_f[:w])
    for i in range(n - w):
        order.append(ops_f[w + i])
        order.append(ops_b[i])
    order.extend(ops_b[n - w:])
    return order


def _interleaved_sequence(m: int, p: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in Megatron's interleaved order: groups of p micro-batches, chunk by chunk."""
    seq = []
    for g in range(0, m, p):
        group = range(g, min(m, g + p))
        chunks = range(v - 1, -1, -1) if backward else range(v)
        for c in chunks:
            seq.extend((j, c) for j in group)
    return seq


def simulate(schedule: str, forward_s: list[float], backward_s: list[float], microbatches: int,
             virtual_stages: int = 1) -> list[list[Box]]:
    """Per rank, the boxes of one step in start order.

    ``forward_s[i]`` / ``backward_s[i]``: time of one micro-batch through stage *i* (all its chunks);
    interleaved splits them evenly over ``virtual_stages`` chunks; zero-bubble splits the backward
    into equal input-gradient (``B``) and weight-gradient (``W``) halves, and runs a ``W`` whenever
    it fits in an idle gap before the rank's next operation can start, or when more than
    ``p - rank - 1`` of them are pending (bounded memory, as in ZB-H1), and the rest at the end.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    p = len(forward_s)
    if p == 0 or len(backward_s) != p:
        raise ScheduleError("give one forward and one backward time per stage")
    m = int(microbatches)
    if m < 1:
        raise ScheduleError(f"microbatches={microbatches} must be at least 1")
    if schedule in V_SCHEDULES:
        return _simulate_v(Schedule(schedule), forward_s, backward_s, m)
    v = int(virtual_stages) if schedule == "interleaved_1f1b" else 1
    if v < 1:
        raise ScheduleError(f"virtual_stages={virtual_stages} must be at least 1")
    zb = schedule == "zero_bubble"

    def dur(kind: str, r: int) -> float:
        if kind == "F":
            return max(0.0, forward_s[r]) / v
        b = max(0.0, backward_s[r]) / v
        return b / 2 if zb else b

    # each op: (kind, microbatch, chunk); per-rank mandatory order (W's are placed dynamically)
    orders: list[list[tuple[str, int, int]]] = []
    for r in range(p):
        if v > 1:
            fs = [("F", j, c) for j, c in _interleaved_sequence(m, p, v, backward=False)]
            bs = [("B", j, c) for j, c in _interleaved_sequence(m, p, v, backward=True)]
            warm = (p - r - 1) * 2 + (v - 1) * p
        else:
            fs = [("F", j, 0) for j in range(m)]
            bs = [("B", j, 0) for j in range(m)]
            warm = m if schedule == "gpipe" else p - r - 1
        orders.append(_order_1f1b(p, r, fs, bs, warm))

    last_vs = v * p - 1
    end: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> end time

    def dep(kind: str, j: int, c: int, r: int) -> tuple[str, int, int] | None:
        s = c * p + r
        if kind == "F":
            return ("F", j, s - 1) if s > 0 else None
        return ("B", j, s + 1) if s < last_vs else ("F", j, s)

    boxes: list[list[Box]] = [[] for _ in range(p)]
    free = [0.0] * p
    nxt = [0] * p
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]

    def run_w(r: int) -> None:
        j, c = pending_w[r].pop(0)
        start = free[r]
        free[r] = start + dur("W", r)
        boxes[r].append(Box("W", j, start, free[r], c))

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, j, c = orders[r][nxt[r]]
                d = dep(kind, j, c, r)
                if d is not None and d not in end:
                    break
                ready = end[d] if d is not None else 0.0
                if zb:
                    while pending_w[r] and (free[r] + dur("W", r) <= ready or len(pending_w[r]) > p - r - 1):
                        run_w(r)
                start = max(free[r], ready)
                free[r] = start + dur(kind, r)
                end[(kind, j, c * p + r)] = free[r]
                boxes[r].append(Box(kind, j, start, free[r], c))
                if zb and kind == "B":
                    pending_w[r].append((j, c))
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(f"{schedule} with p={p}, m={m}, v={v} deadlocks in this simulation")
    for r in range(p):
        while pending_w[r]:
            run_w(r)
    return boxes


def stage_of(schedule: str, p: int, virtual: int, rank: int, chunk: int) -> int:
    """The virtual stage of a rank's ``chunk``-th chunk (:func:`planner.cost.pipeline.rank_chunks`)."""
    return rank_chunks(Schedule(schedule), p, virtual, rank)[chunk]


class _VState:
    """The greedy V simulation's state: op ends by (kind, micro-batch, stage), per-rank clocks and boxes."""

    def __init__(self, schedule: Schedule, forward_s: list[float], backward_s: list[float], m: int) -> None:
        p = len(forward_s)
        self.p, self.m, self.split = p, m, FACTS[schedule].split_backward
        self.stages = [rank_chunks(schedule, p, 2, r) for r in range(p)]
        b_share = 0.25 if self.split else 0.5  # per chunk: the rank's backward halved, then split in B and W
        self.dur = [{"F": max(0.0, forward_s[r]) / 2, "B": max(0.0, backward_s[r]) * b_share,
                     "W": max(0.0, backward_s[r]) * 0.25} for r in range(p)]
        self.cap = [2 * microbatches_in_flight(schedule, r, p, m, 2) for r in range(p)]  # in chunk units
        self.end: dict[tuple[str, int, int], float] = {}
        self.todo = [[(k, j, c) for j in range(m) for c in (0, 1) for k in ("FBW" if self.split else "FB")]
                     for _ in range(p)]
        self.held = [0] * p  # chunk micro-batches whose activations the rank holds
        self.free = [0.0] * p
        self.boxes: list[list[Box]] = [[] for _ in range(p)]

    def ready(self, r: int, op: tuple[str, int, int]) -> float | None:
        """When ``op`` of rank ``r`` may start (its dependency's end), or None while that has not run."""
        kind, j, c = op
        s, last = self.stages[r][c], 2 * self.p - 1
        dep = {"F": ("F", j, s - 1) if s > 0 else None,
               "B": ("B", j, s + 1) if s < last else ("F", j, s), "W": ("B", j, s)}[kind]
        return 0.0 if dep is None else self.end.get(dep)

    def best(self, r: int, capped: bool) -> tuple[float, int, tuple[str, int, int]] | None:
        """The rank's next op: the earliest start, then an input gradient before a forward before a W."""
        out = None
        for op in self.todo[r]:
            at = self.ready(r, op)
            if at is None or (capped and op[0] == "F" and self.held[r] >= self.cap[r]):
                continue
            key = (max(at, self.free[r]), "BFW".index(op[0]), op)
            out = key if out is None or key[:2] < out[:2] else out
        return out

    def run(self, r: int, start: float, op: tuple[str, int, int]) -> None:
        kind, j, c = op
        self.free[r] = start + self.dur[r][kind]
        self.end[(kind, j, self.stages[r][c])] = self.free[r]
        self.boxes[r].append(Box(kind, j, start, self.free[r], c))
        self.todo[r].remove(op)
        self.held[r] += 1 if kind == "F" else -1 if kind == ("W" if self.split else "B") else 0


def _simulate_v(schedule: Schedule, forward_s: list[float], backward_s: list[float], m: int) -> list[list[Box]]:
    """The V schedules, greedily (module doc); the cap on micro-batches in flight is lifted only where it
    would stop every rank."""
    st = _VState(schedule, forward_s, backward_s, m)
    while any(st.todo):
        found = [(b, r) for r in range(st.p) if (b := st.best(r, True)) is not None]
        if not found:
            found = [(b, r) for r in range(st.p) if (b := st.best(r, False)) is not None]
        if not found:
            raise ScheduleError(f"{schedule.value} with p={st.p}, m={m} deadlocks in this simulation")
        (start, _, op), r = min(found, key=lambda x: x[0][:2])
        st.run(r, start, op)
    for rank in st.boxes:
        rank.sort(key=lambda b: b.start_s)
    return st.boxes


def makespan(boxes: list[list[Box]]) -> float:
    return max((b.end_s for rank in boxes for b in rank), default=0.0)


def busy(boxes: list[Box]) -> float:
    return sum(b.end_s - b.start_s for b in boxes)

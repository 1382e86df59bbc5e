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
Gaps between a rank's boxes are the pipeline bubble. Communication is not drawn.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


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


def makespan(boxes: list[list[Box]]) -> float:
    return max((b.end_s for rank in boxes for b in rank), default=0.0)


def busy(boxes: list[Box]) -> float:
    return sum(b.end_s - b.start_s for b in boxes)

"""Explain: rank the plans found (by step time or, ``robust``, by the slow end of their interval), say how
each alternative lost, and what was missing when nothing fits."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from planner.contracts import (
    Alternative,
    ClusterProfile,
    ModelSpec,
    Prediction,
    TrainingConfig,
)
from planner.cost.memory import (
    usable_bytes,
)
from planner.errors import AutoparError
from planner.search.price import Found

GIB = 2**30


@dataclass
class Counts:
    """What happened to the candidates the search considered (the ``SearchReport`` counters)."""

    considered: int = 0  # leaves of the structures listed (rule removals are counted by Rules)
    dominated: int = 0  # another candidate is as fast with less memory
    pruned: int = 0  # lower bound no better than the k-th best plan
    infeasible: int = 0  # shown not to fit
    evaluated: int = 0  # priced exactly
    solved: int = 0  # layer split and recompute solved by CP-SAT
    closed: int = 0  # the default split met the bound: optimal without CP-SAT


@dataclass
class FamilyState:
    """A structural family (tp, cp, pp, ep, sp) during the search: how many candidates it had, its fastest
    found, and why it lost when none was found."""

    members: int = 0
    best: Found | None = None
    reason: str | NoFitReason = ""


@dataclass(frozen=True)
class LeafLabel:
    """A leaf's name in messages, formatted only when one is shown (most leaves are pruned unnamed)."""

    family: str
    zero: int
    rep: int
    shard: int
    offload: float  # the optimizer share offloaded (0: none)

    def __str__(self) -> str:
        share = "" if not self.offload else " offload" if self.offload == 1 else f" offload{self.offload:g}"
        return f"{self.family} zero{self.zero}" + (f" hsdp{self.rep}x{self.shard}" if self.rep > 1 else "") + share


class NoFitReason:
    """A family's reason "does not fit: ... GiB", formatted (and its memory priced) only when shown."""

    __slots__ = ("capacity", "need", "why")

    def __init__(self, need: float | Callable[[], float], why: str, capacity: float) -> None:
        self.need, self.why, self.capacity = need, why, capacity

    def __bool__(self) -> bool:
        return True

    def __str__(self) -> str:
        if callable(self.need):
            self.need = self.need()
        return f"does not fit: {self.why} {self.need / GIB:.1f} GiB of {self.capacity / GIB:.1f} GiB"


def pessimistic_s(pred: Prediction) -> float:
    """The slow end of a prediction's step-time interval (the step time itself without one)."""
    return pred.interval.high_s if pred.interval is not None else pred.step_time_s


def rank_found(ranked: list[Found], preds: list[Prediction | None], robust: bool) -> tuple[list, list]:
    """Equally fast plans (to 1e-9) with the least memory per GPU first; ``robust``: by the slow end of
    each interval (a plan not predicted in full keeps its place behind those that are)."""
    fastest = ranked[0].step_s

    def key(i: int) -> tuple:
        pred = preds[i]
        nominal = round(ranked[i].step_s / fastest, 9)
        first = (pessimistic_s(pred) if pred is not None else math.inf) if robust else nominal
        return first, nominal, pred.memory.total_bytes if pred else math.inf, i

    order = sorted(range(len(ranked)), key=key)
    return [ranked[i] for i in order], [preds[i] for i in order]


def ties(pred: Prediction, best: Prediction) -> bool:
    """Whether two predictions' step-time intervals overlap (neither is surely faster)."""
    if pred.interval is None or best.interval is None:
        return False
    return pred.interval.low_s <= best.interval.high_s and best.interval.low_s <= pred.interval.high_s


def alternative(alt: Found, pred: Prediction | None, best: Found, best_pred: Prediction) -> Alternative:
    """An alternative and why it lost (or that it ties the best within the model's accuracy)."""
    if pred is None:
        return Alternative(layout=alt.layout, slower_by=alt.step_s / best.step_s - 1,
                           reason=f"{alt.step_s / best.step_s - 1:+.1%} step time; not predicted in "
                                  "full: the search's time budget was spent")
    reason = why_slower(pred, best_pred)
    if ties(pred, best_pred):
        reason += (f"; a tie within the model's accuracy: its {pred.interval.level:.0%} interval "
                   f"[{pred.interval.low_s:.3g}, {pred.interval.high_s:.3g}] s overlaps the best's "
                   f"[{best_pred.interval.low_s:.3g}, {best_pred.interval.high_s:.3g}] s")
    return Alternative(layout=alt.layout, prediction=pred, slower_by=pred.step_time_s / best_pred.step_time_s - 1,
                       reason=reason)


def why_slower(pred: Prediction, best: Prediction) -> str:
    """The term that grew most against the best plan: compute, bubble, a kind of exposed comm, optimizer."""
    def terms(p: Prediction) -> dict[str, float]:
        out = {"compute on the critical stage":
               p.compute_time_s - sum(c.exposed_s for c in p.comm if c.kind in ("tp", "cp", "ep")),
               "pipeline bubble": p.bubble_time_s, "optimizer step": p.optimizer_time_s}
        for c in p.comm:
            out[f"exposed {c.kind} communication"] = out.get(f"exposed {c.kind} communication", 0.0) + c.exposed_s
        return out
    if abs(pred.step_time_s - best.step_time_s) <= 1e-9 * best.step_time_s:
        return (f"as fast, but needs {pred.memory.total_bytes / GIB:.1f} GiB per GPU against the chosen plan's "
                f"{best.memory.total_bytes / GIB:.1f} GiB (equal step times: the smaller footprint ranks first)")
    a, b = terms(pred), terms(best)
    deltas = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}
    worst = max(deltas, key=deltas.get)
    total = pred.step_time_s - best.step_time_s
    return (f"{total / best.step_time_s:+.1%} step time ({total:+.3f} s); largest difference: {worst} "
            f"{deltas[worst]:+.3f} s")


def nothing_fits(
    model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, shortfall: list, report: Counts
) -> AutoparError:
    gap, where = shortfall[:2]
    fixes = ("more GPUs (more pipeline/tensor/ZeRO sharding), optimizer offload, full recompute, "
             "a smaller micro-batch or a shorter sequence, or a GPU with more memory")
    if math.isfinite(gap):
        return AutoparError(
            "cluster", f"{profile.num_gpus} x {profile.device.name}",
            f"add about {gap / GIB:.1f} GiB per GPU: {fixes}",
            problem=f"has no layout of {model.name} that fits: the closest ({where}) is {gap / GIB:.1f} GiB over "
                    f"the {usable_bytes(profile.device.memory_bytes, profile.assumptions) / GIB:.1f} GiB a plan may "
                    f"fill ({profile.device.memory_bytes / GIB:.0f} GiB less the "
                    f"{profile.assumptions.memory_headroom:.0%} memory_headroom)",
        )
    return AutoparError("cluster", f"{profile.num_gpus} GPUs", fixes, problem="has no layout that could be evaluated")

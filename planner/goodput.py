"""Rank a search's plans by expected time-to-train (:mod:`planner.cost.goodput`), step time beside it.

The search ranks layouts by step time; the time to train a token budget on a cluster that fails also pays
for checkpoints (a plan whose ranks hold more state copies more to the host each time) and for the work
lost at each failure. :func:`rank_by_time_to_train` prices the plan and every alternative that has a
prediction, and makes the one that trains soonest the plan; the others stay alternatives with the reason.
"""

from __future__ import annotations

import statistics

from planner.contracts import Alternative, ClusterProfile, Plan, Prediction, RunReport
from planner.contracts.goodput import GoodputPrediction, TrainingGoal
from planner.cost.goodput import plan_goodput


def _with_goodput(plan: Plan, layout, prediction: Prediction, goal: TrainingGoal,  # noqa: ANN001
                  profile: ClusterProfile) -> Prediction:
    good = plan_goodput(plan.model, plan.training, profile, layout, plan.num_gpus, prediction, goal, plan.target)
    return prediction.model_copy(update={"goodput": good})


def rank_by_time_to_train(plan: Plan, goal: TrainingGoal, profile: ClusterProfile) -> Plan:
    """``plan`` with every prediction's :class:`~planner.contracts.goodput.GoodputPrediction` and the layout
    that trains the goal soonest as the plan (the search's fastest step otherwise stays, as ties do)."""
    best = _with_goodput(plan, plan.layout, plan.prediction, goal, profile)
    alts = [a.model_copy(update={"prediction": _with_goodput(plan, a.layout, a.prediction, goal, profile)})
            if a.prediction is not None else a for a in plan.alternatives]
    wall = best.goodput.chosen.wall_s
    winner = min((a for a in alts if a.prediction is not None), default=None,
                 key=lambda a: a.prediction.goodput.chosen.wall_s)
    if winner is None or winner.prediction.goodput.chosen.wall_s >= wall:
        return plan.model_copy(update={"prediction": best, "alternatives": [_ttt_reason(a, wall) for a in alts]})
    demoted = Alternative(layout=plan.layout, prediction=best, slower_by=best.step_time_s /
                          winner.prediction.step_time_s - 1, reason="faster step, but longer to train: see goodput")
    rest = [demoted, *(a for a in alts if a is not winner)]
    new_wall = winner.prediction.goodput.chosen.wall_s
    return plan.model_copy(update={
        "layout": winner.layout, "prediction": winner.prediction,
        "alternatives": [_ttt_reason(a, new_wall) for a in rest],
        "solver_status": f"{plan.solver_status} (chosen over a faster step by expected time-to-train)"})


def _ttt_reason(alt: Alternative, best_wall_s: float) -> Alternative:
    """The alternative's reason with how much longer it takes to train."""
    if alt.prediction is None or alt.prediction.goodput is None:
        return alt
    longer = alt.prediction.goodput.chosen.wall_s / best_wall_s - 1
    return alt.model_copy(update={"reason": f"{alt.reason}; time-to-train {longer:+.1%}"})


def checkpoint_comparison(report: RunReport, goodput: GoodputPrediction | None) -> list[dict]:
    """A run's checkpoints per mode beside the prediction, for ``autopar run`` and the run page: the saves, the
    median blocking and write times of those after the first (a run's first save sets up: the async save's
    process group and thread, DCP's first plan; with one save, that one), the first's blocking, and the
    blocking and write the plan's goodput predicted for the mode (None without a goal, or for a mode it did
    not price)."""
    predicted = {c.mode: c for c in ((goodput.chosen, goodput.other) if goodput else ()) if c is not None}
    rows = []
    for mode in ("sync", "async"):
        saves = [r for r in report.checkpoints if r.mode == mode]
        if not saves:
            continue
        later = saves[1:] or saves
        pred = predicted.get(mode)
        rows.append({"mode": mode, "saves": len(saves), "bytes_per_rank": saves[0].bytes_per_rank,
                     "tensors_per_rank": saves[0].tensors_per_rank, "first_blocking_s": saves[0].blocking_s,
                     "blocking_s": statistics.median(r.blocking_s for r in later),
                     "write_s": statistics.median(r.write_s for r in later),
                     "predicted_blocking_s": None if pred is None else pred.blocking_s,
                     "predicted_write_s": None if pred is None else pred.write_s})
    return rows

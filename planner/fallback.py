"""Plans for the loss of 1..K nodes, precomputed with the plan (``autopar plan --fallbacks K``, the API's
``fallbacks``): when a node dies mid-run, the job resumes on the nodes left from its last checkpoint
(torch.distributed.checkpoint reshards across plans, :mod:`executor.checkpoint`) under the fallback plan
for that many lost nodes, with ``autopar run plan.json --fallback K``.

Each fallback is the search's best on the same cluster with K nodes fewer, for the same model and the
same global batch (the search changes the micro-batch and accumulation to keep it; on an uneven node count
it may leave some of the nodes left idle, planner.search.sizing); where no layout keeps that batch on the
nodes left, the fallback says why instead.
"""

from __future__ import annotations

from dataclasses import replace

from planner.contracts import ClusterProfile, Plan
from planner.contracts.plan import Fallback
from planner.errors import AutoparError
from planner.search import SearchOptions, search


def fallback_plans(plan: Plan, profile: ClusterProfile, most_lost: int, options: SearchOptions) -> list[Fallback]:
    """One :class:`Fallback` per number of lost nodes, 1..``most_lost`` (as many as leave a node); the searches
    share ``options.time_budget_s`` evenly, so asking for fallbacks at most doubles the plan's time."""
    out = []
    counts = range(1, min(most_lost, profile.num_nodes - 1) + 1)
    share = replace(options, time_budget_s=max(options.time_budget_s / max(len(counts), 1), 0.1))
    for lost in counts:
        left = profile.with_nodes(profile.num_nodes - lost)
        try:
            found = search(plan.model, plan.training, left, share)
        except AutoparError as exc:
            out.append(Fallback(lost_nodes=lost, num_gpus=left.num_gpus, reason=str(exc)))
            continue
        reason = f"the fastest layout on {left.num_nodes} node(s) for the same global batch"
        if found.num_gpus < left.num_gpus:  # an uneven count left (planner.search.sizing)
            reason = f"the fastest layout on {found.num_gpus} of the {left.num_gpus} GPUs left: {found.sizing.why}"
        out.append(Fallback(lost_nodes=lost, num_gpus=found.num_gpus, layout=found.layout, prediction=found.prediction,
                            slower_by=found.prediction.step_time_s / plan.prediction.step_time_s - 1, reason=reason))
    return out


def fallback_plan(plan: Plan, lost: int) -> Plan:
    """The runnable Plan of ``plan``'s fallback for ``lost`` nodes (what ``autopar run --fallback`` runs)."""
    found = next((f for f in plan.fallbacks if f.lost_nodes == lost), None)
    if found is None:
        have = sorted(f.lost_nodes for f in plan.fallbacks) or "none"
        raise AutoparError("--fallback", lost, f"use one of the plan's fallbacks ({have}), or plan with "
                           f"--fallbacks {lost}", problem="has no fallback plan in this plan")
    if found.layout is None:
        raise AutoparError("--fallback", lost, "plan again with a global batch the nodes left can hold",
                           problem=f"has no layout: {found.reason}")
    return plan.model_copy(update={"layout": found.layout, "prediction": found.prediction, "num_gpus": found.num_gpus,
                                   "alternatives": [], "fallbacks": [], "search": None,
                                   "solver_status": f"fallback for {lost} lost node(s)"})

"""Plan requests: resolve the model, profile and options, run the planner's search, store the outcome.

A request that is well formed but admits no plan (nothing fits in memory, no layout divides the
batch) is not an error: it is stored with ``status="infeasible"`` and the planner's explanation —
the field at fault, its value and what would fix it — so a person sees why, not an error page.
"""

from __future__ import annotations

from api import store
from api.db import Database, PlanRow
from api.schemas import ModelRef, PlanRequest
from planner.contracts import ClusterProfile, ModelSpec, Plan
from planner.errors import AutoparError
from planner.fallback import fallback_plans
from planner.goodput import rank_by_time_to_train
from planner.search import SearchOptions, search, sizing


def resolve_model(ref: ModelRef) -> ModelSpec:
    """The ModelSpec a request names; AutoparError (field ``model.*``) for unknown presets and bad configs."""
    if ref.preset is not None:
        from planner.presets import get_preset

        try:
            return get_preset(ref.preset)
        except AutoparError as exc:
            raise AutoparError("model.preset", ref.preset, exc.fix, problem=exc.problem) from None
    if ref.hf_config is not None:
        from planner.hf_config import model_spec_from_hf_config

        try:
            return model_spec_from_hf_config(ref.hf_config, name=ref.name)
        except AutoparError as exc:
            raise AutoparError(f"model.hf_config.{exc.field}", exc.value, exc.fix, problem=exc.problem) from None
    assert ref.spec is not None
    return ref.spec


def resolve_profile(db: Database, req: PlanRequest) -> tuple[int, ClusterProfile]:
    try:
        row, _ = (store.get_profile(db, profile_id=req.profile_id) if req.profile_id is not None
                  else store.latest_profile(db, cluster=req.cluster))
    except store.NotFound as exc:
        field = "profile_id" if req.profile_id is not None else "cluster"
        raise AutoparError(field, exc.key,
                           "list stored profiles with GET /v1/profiles or clusters with GET /v1/clusters",
                           problem="is not stored") from None
    profile = ClusterProfile.model_validate(row.body)
    if req.num_nodes is not None and req.num_nodes != profile.num_nodes:
        if profile.kind == "measured":
            raise AutoparError("num_nodes", req.num_nodes,
                               f"omit num_nodes (this measured profile describes {profile.num_nodes} nodes) "
                               "or upload a profile measured on the cluster you plan for",
                               problem="cannot change a measured profile")
        profile = profile.with_nodes(req.num_nodes)
    if req.options.memory_headroom is not None:  # the profile's own (assumptions.memory_headroom) otherwise
        profile = profile.model_copy(update={"assumptions": profile.assumptions.model_copy(
            update={"memory_headroom": req.options.memory_headroom})})
    return row.id, profile


def search_options(req: PlanRequest, max_budget_s: float) -> SearchOptions:
    o = req.options
    budget = min(SearchOptions().time_budget_s, max_budget_s) if o.time_budget_s is None else o.time_budget_s
    if budget > max_budget_s:
        raise AutoparError("options.time_budget_s", o.time_budget_s, f"ask for at most {max_budget_s:g} s "
                           "(the server's AUTOPAR_PLAN_BUDGET_S)", problem="is above the server's limit")
    return SearchOptions(top_k=o.top_k, max_micro_batch_size=o.max_micro_batch_size,
                         max_virtual_stages=o.max_virtual_stages, schedules=tuple(dict.fromkeys(o.schedules)),
                         zero_stages=tuple(sorted(set(o.zero_stages))), hsdp=o.hsdp, offload=o.offload, max_tp=o.max_tp,
                         max_pp=o.max_pp, max_cp=o.max_cp, max_ep=o.max_ep, sequence_parallel=o.sequence_parallel,
                         tp_comm_overlap=o.tp_comm_overlap, dp_comm_overlap=o.dp_comm_overlap,
                         ep_comm_overlap=o.ep_comm_overlap, compile=o.compile, target=o.target.value,
                         robust=o.robust, idle_gpus=o.idle_gpus, global_batch_max=o.global_batch_max,
                         time_budget_s=budget)


def explanation(exc: AutoparError) -> dict:
    return dict(field=exc.field, value=str(exc.value), problem=exc.problem, fix=exc.fix, message=str(exc))


def keyed_plan(db: Database, req: PlanRequest, key: str | None) -> PlanRow | None:
    """The plan stored for the request's Idempotency-Key (a retry), or None; AutoparError when the key was
    sent with another request."""
    first = store.plan_by_key(db, key) if key else None
    if first is None:
        return None
    if first.plan.request != req.model_dump(mode="json", exclude_none=True):
        raise AutoparError("Idempotency-Key", key, "send a new key with each new request (a retry sends the same "
                           "key and body)", problem=f"was sent before with another request (plan {first.plan.id})")
    return first.plan


def make_plan(db: Database, req: PlanRequest, max_budget_s: float, key: str | None = None) -> tuple[PlanRow, bool]:
    """Resolve, search (or reuse an identical earlier request's result), store under the Idempotency-Key ``key``
    (the caller answered a key seen before with :func:`keyed_plan`). Returns (row, reused)."""
    model = resolve_model(req.model)
    if "\x00" in model.name:
        raise AutoparError("model.name", model.name, "remove the NUL character", problem="contains a NUL character")
    profile_id, profile = resolve_profile(db, req)
    opts = search_options(req, max_budget_s)
    request = req.model_dump(mode="json", exclude_none=True)
    # the resolved inputs, not the request's wording: a preset and its spec written out plan the same
    digest = store.canonical_hash(dict(model=model.model_dump(mode="json"),
                                       training=req.training.model_dump(mode="json"),
                                       profile_id=profile_id, num_nodes=profile.num_nodes,
                                       options=req.options.model_dump(mode="json"),
                                       **({"goal": req.goal.model_dump(mode="json")} if req.goal else {}),
                                       **({"fallbacks": req.fallbacks} if req.fallbacks else {})))
    common = dict(profile_id=profile_id, request=request, request_hash=digest, model_name=model.name,
                  num_gpus=profile.num_gpus, idempotency_key=key)
    earlier = store.find_reusable_plan(db, request_hash=digest)
    budget_stopped = ((earlier.plan or {}).get("solver_status") or "").startswith("FEASIBLE") or \
        (earlier.explanation or {}).get("field") == "time_budget_s" if earlier is not None else False
    if earlier is not None and not budget_stopped:
        # deterministic search, same inputs: same answer (a budget-stopped search is searched again)
        row = store.store_plan(db, status=earlier.status, step_time_s=earlier.step_time_s, plan=earlier.plan,
                               explanation=earlier.explanation, **common)
        return row, True
    try:
        plan: Plan = search(model, req.training, profile, opts)
        profile = sizing.used_profile(profile, plan)  # the GPUs it uses (planner.search.sizing)
        common["num_gpus"] = plan.num_gpus
        if req.goal is not None:  # ranked by expected time-to-train, the goal kept with the plan
            plan = rank_by_time_to_train(plan, req.goal, profile).model_copy(update={"goal": req.goal})
        if req.fallbacks:  # a search per lost node count, sharing the request's budget (planner.fallback)
            plan = plan.model_copy(update={"fallbacks": fallback_plans(plan, profile, req.fallbacks, opts)})
    except AutoparError as exc:
        row = store.store_plan(db, status="infeasible", step_time_s=None, plan=None, explanation=explanation(exc),
                               **common)
        return row, False
    row = store.store_plan(db, status="ok", step_time_s=plan.prediction.step_time_s,
                           plan=plan.model_dump(mode="json"), explanation=None, **common)
    return row, False

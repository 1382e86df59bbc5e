"""Human pages at ``/``: clusters and profiles, plans with their timeline, runs against predictions, tune jobs.

Server-rendered HTML (Jinja2, autoescaped) with charts drawn as inline SVG by :mod:`api.charts`;
no JavaScript is needed and nothing is fetched from the network. Every page renders whatever is
stored — missing points, infeasible plans, no runs — and an unknown id is an HTML 404 page.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError

from api import charts, store
from api.charts import Series, fmt_bytes, fmt_plain, fmt_seconds, fmt_si
from api.deps import request_db
from api.schemas import MAX_ID
from api.timeline import ScheduleError, makespan, simulate
from planner.contracts import ClusterProfile, Plan, RunReport
from planner.contracts.cluster import LINEAR_LAYOUTS, LinkLevel, link_key, link_points
from planner.contracts.common import Precision
from planner.contracts.report import term_comparison
from planner.contracts.tune import TuneReport
from planner.cost.comm import ring_factor
from planner.cost.pipeline import SCHEDULES
from planner.targets.split import recompute_text

log = logging.getLogger("autopar.pages")
HERE = Path(__file__).parent
STATIC = HERE / "static"
templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.filters.update(bytes=fmt_bytes, seconds=fmt_seconds, si=fmt_si, recompute=recompute_text,
                             pct=lambda v: "—" if v is None else f"{100 * v:.1f}%")
router = APIRouter(include_in_schema=False)

# drawn micro-batches: enough for the warm-up, a steady state and the cool-down of the deepest pipeline, few
# enough that a box stays wider than a few pixels (128 of them drew a barcode)
MIN_TIMELINE_MICROBATCHES = 12
MAX_BUBBLE_MICROBATCHES = 1024  # the bubble is simulated with the step's own count up to this
MAX_TIMELINE_RANKS = 32
LEVELS = (LinkLevel.intra_node, LinkLevel.inter_node, LinkLevel.host_device)


# -- helpers ---------------------------------------------------------------------------------------

def _page(request: Request, _template: str, _status: int = 200, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, _template, context, status_code=_status)


def _not_found(request: Request, what: str, key: object) -> HTMLResponse:
    return _page(request, "error.html", 404, title="Not found", what=what, key=str(key))


def not_found_page(request: Request, path: str) -> HTMLResponse:
    """HTML 404 for a path no page serves (used by the app's 404 handler)."""
    return _not_found(request, "page", path)


def _id(raw: str) -> int | None:
    """Page ids come as text so that a bad one is a 404 page, not a JSON 422."""
    if not raw.isdigit() or len(raw) > 12:
        return None
    value = int(raw)
    return value if 1 <= value <= MAX_ID else None


def _stored(request: Request, raw: str, getter):  # noqa: ANN001, ANN202
    """``getter(db, id)`` (a store function's entry by its row id) for a page id given as text, or None when
    the id is malformed or unknown (the caller answers with the 404 page)."""
    key = _id(raw)
    if key is None:
        return None
    try:
        return getter(request_db(request), key)
    except store.NotFound:
        return None


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name, "")
    return min(hi, max(lo, int(raw))) if raw.isdigit() and len(raw) < 12 else default


def _text_param(request: Request, name: str) -> str | None:
    raw = (request.query_params.get(name) or "").replace("\x00", "").strip()[:200]
    return raw or None


def _log_range(lo: float, hi: float, per_octave: int = 2) -> list[float]:
    n = int(round(math.log2(hi / lo) * per_octave))
    return [lo * 2 ** (i / per_octave) for i in range(n + 1)]


# -- static files ----------------------------------------------------------------------------------

@router.get("/static/{name}")
def static(name: str) -> Response:
    files = {p.name: p for p in STATIC.iterdir() if p.is_file()} if STATIC.is_dir() else {}
    if name not in files:
        return Response("not found", status_code=404, media_type="text/plain")
    return FileResponse(files[name], headers={"Cache-Control": "public, max-age=300"})


# -- index -----------------------------------------------------------------------------------------

@router.get("/", response_class=HTMLResponse)
def index(request: Request) -> HTMLResponse:
    db = request_db(request)
    gpu = _text_param(request, "gpu")
    kind = _text_param(request, "kind")
    kind = kind if kind in ("measured", "reference") else None
    clusters, total = store.list_clusters(db, gpu=gpu, kind=kind, limit=500)
    plans, plan_total = store.list_plans(db, limit=10)
    counts = store.counts(db)
    return _page(request, "index.html", title="Clusters", clusters=clusters, total=total, gpu=gpu or "",
                 kind=kind or "", plans=plans, plan_total=plan_total, counts=counts)


# -- profiles --------------------------------------------------------------------------------------

def link_charts(profile: ClusterProfile) -> list[dict]:
    """Per link level: bus bandwidth vs message size, measured points and the α-β fit."""
    from planner.cost.comm import pick_segment

    out = []
    sizes = _log_range(4 * 1024, 1024**3)
    for level in LEVELS:
        links = [link for link in profile.links if link.level is level]
        if not links:
            continue
        series, measured = [], False
        # one series per link: the segments of a piecewise link draw as one line (each size priced
        # by the segment covering it, as the planner does) and one set of markers
        groups: dict = {}
        for link in links:
            groups.setdefault(link_key(link) if link.segmented else id(link), []).append(link)
        for i, segs in enumerate(groups.values()):
            link = segs[0]
            color = charts.PALETTE[i % len(charts.PALETTE)]
            n = link.group_size or 8
            factor = ring_factor(link.collective, n) or 1.0
            name = f"{link.collective.value} (n={n})" if link.group_size else link.collective.value
            if len(segs) > 1:
                name += f", {len(segs)} segments"
            fit = []
            for b in sizes:
                seg = pick_segment(segs, b)
                fit.append((b, b * factor / (seg.alpha_s + b * factor / seg.busbw_bytes_per_s) / 1e9))
            points = link_points(segs)
            series.append(Series(f"{name} fit", fit, "line", color, dashed=bool(points), legend=name))
            if points:
                measured = True
                pts = [(p.bytes, p.bytes * factor / p.time_s / 1e9) for p in points if p.bytes > 0]
                series.append(Series(f"{name} measured", pts, "markers", color, legend=name,
                                     labels=[f"{name}: {fmt_bytes(b)} at {v:.3g} GB/s" for b, v in pts]))
        note = ("markers: measured; dashed: α-β fit t = α + bytes·factor / busbw" if measured else
                "no measured points: lines are the α-β fit t = α + bytes·factor / busbw")
        svg = charts.xy_chart(series, title=f"Bus bandwidth, {level.value.replace('_', '-')}"
                              + ("" if measured else " (α-β fit only)"),
                              x_label="message size", y_label="bus bandwidth (GB/s)", x_base=2, x_fmt=fmt_bytes,
                              y_fmt=fmt_plain,
                              note=note)
        out.append(dict(level=level.value, svg=svg, measured=measured, links=links))
    return out


def compute_charts(profile: ClusterProfile) -> list[dict]:
    """Achieved compute vs size per operator kind: measured points, else the cost model's prediction."""
    from planner.cost.compute import (
        attention_time_s,
        attention_work,
        causal_work_fraction,
        gemm_time_s,
        memory_time_s,
        peak_flops,
    )

    out = []
    overhead = profile.assumptions.kernel_overhead_s
    # the model lines beside rank 0's measurements: rank 0's device, not the slowest checked one's
    # (the pace a plan is priced at, planner.cost.compute.device_pace)
    rank0 = profile.model_copy(update={"device_checks": []})
    # GEMM
    series: list[Series] = []
    gemm = profile.compute.gemm
    precisions = sorted({p.precision for p in gemm}, key=lambda p: p.value)
    colour: dict[Precision, str] = {}
    for prec in precisions:
        # forward, input gradient, weight gradient: the order of a linear layer's GEMMs
        layouts = [x for x in LINEAR_LAYOUTS if any(p.precision is prec and p.layout is x for p in gemm)]
        for layout in layouts:
            mine = [p for p in gemm if p.precision is prec and p.layout is layout]
            pts = [(2.0 * p.m * p.n * p.k, 2.0 * p.m * p.n * p.k / p.time_s / 1e12) for p in mine]
            tag = f"{prec.value} {layout.value}" if len(layouts) > 1 else prec.value
            labels = [f"{tag} {p.m}x{p.n}x{p.k}: {2.0 * p.m * p.n * p.k / p.time_s / 1e12:.3g} TFLOP/s" for p in mine]
            name = f"{prec.value} {layout.role} measured" if len(layouts) > 1 else f"{prec.value} measured"
            c = charts.PALETTE[len(series) % len(charts.PALETTE)]
            colour.setdefault(prec, c)
            series.append(Series(name, pts, "markers", c, labels=labels))
    modelled = not gemm
    shown: list[Precision] = []
    if modelled:
        shown = [Precision.bf16] + ([Precision.fp8] if Precision.fp8 in profile.device.peak_tflops else [])
        for i, prec in enumerate(shown):
            pts = []
            for s in _log_range(128, 32768, 2):
                s = int(s)
                t = gemm_time_s(rank0, s, s, s, prec) + overhead
                pts.append((2.0 * s**3, 2.0 * s**3 / t / 1e12))
            series.append(Series(f"{prec.value} model (no measurements), square m=n=k", pts, "line",
                                 charts.PALETTE[i]))
    xs = [pt[0] for ser in series for pt in ser.points] or [1e9, 1e13]
    for i, prec in enumerate(precisions or shown):
        peak = peak_flops(profile, prec) / 1e12
        series.append(Series(f"{prec.value} datasheet peak {peak:.3g}", [(min(xs), peak), (max(xs), peak)], "line",
                             colour.get(prec, charts.PALETTE[i]), dashed=True))
    out.append(dict(kind="GEMM", modelled=modelled, svg=charts.xy_chart(
        series, title="GEMM: TFLOP/s vs FLOPs (2mnk)" + (", model (no measurements)" if modelled else ""),
        x_label="FLOPs per GEMM", y_label="TFLOP/s", y_fmt=fmt_plain,
        note="model includes the kernel launch overhead" if modelled else "")))

    # attention
    series = []
    att = profile.compute.attention
    if att:
        fwd, bwd, lf, lb = [], [], [], []
        blocking = profile.compute.attention_blocking
        for p in att:
            if blocking:  # the kernel's own tiles (torch's CPU flash kernel)
                work = attention_work(p.seq_length, p.seq_length, p.causal, blocking)
            else:
                work = p.seq_length**2 * (causal_work_fraction(p.seq_length) if p.causal else 1.0)
            flops = 4.0 * p.batch * p.num_heads * p.head_dim * work
            fwd.append((flops, flops / p.forward_time_s / 1e12))
            bwd.append((flops, 2.5 * flops / p.backward_time_s / 1e12))
            shape = f"b={p.batch} s={p.seq_length} h={p.num_heads} d={p.head_dim} {p.precision.value}"
            lf.append(f"forward {shape}: {fwd[-1][1]:.3g} TFLOP/s")
            lb.append(f"backward {shape}: {bwd[-1][1]:.3g} TFLOP/s")
        series += [Series("forward measured", fwd, "markers", charts.PALETTE[0], labels=lf),
                   Series("backward measured", bwd, "markers", charts.PALETTE[1], labels=lb)]
    else:
        fwd, bwd = [], []
        for s in _log_range(512, 131072, 1):
            s = int(s)
            tf, tb = attention_time_s(rank0, batch=1, q_len=s, kv_len=s, heads=32, kv_heads=8, qk_dim=128, v_dim=128,
                                      precision=Precision.bf16, causal=True, flash=True)
            flops = 4.0 * s * s * 32 * 128 * causal_work_fraction(s)
            fwd.append((flops, flops / (tf + overhead) / 1e12))
            bwd.append((flops, 2.5 * flops / (tb + overhead) / 1e12))
        series += [Series("forward, model (no measurements)", fwd, "line", charts.PALETTE[0]),
                   Series("backward, model (no measurements)", bwd, "line", charts.PALETTE[1])]
    out.append(dict(kind="attention", modelled=not att, svg=charts.xy_chart(
        series, title="Attention (causal, fused): TFLOP/s" + ("" if att else ", model (no measurements)"),
        x_label="forward FLOPs (causal share)", y_label="TFLOP/s", y_fmt=fmt_plain,
        note="" if att else "model: 1 sequence, 32 heads (8 KV), head dim 128, bf16, sequence 512 to 128k")))

    # elementwise
    series = []
    elt = profile.compute.elementwise
    ops = sorted({p.op for p in elt})
    for i, op in enumerate(ops):
        pts = [(p.bytes, p.bytes / p.time_s / 1e9) for p in elt if p.op == op]
        series.append(Series(f"{op} measured", pts, "markers", charts.PALETTE[i % len(charts.PALETTE)]))
    model_pts = [(b, b / (memory_time_s(rank0, b) + overhead) / 1e9) for b in _log_range(64 * 1024, 4 * 1024**3, 1)]
    series.append(Series("model" + ("" if elt else " (no measurements)"), model_pts, "line", "#6b7280",
                         dashed=bool(elt)))
    hbm = profile.device.hbm_bandwidth_bytes_per_s / 1e9
    memory = "memory" if profile.is_cpu else "HBM"
    series.append(Series(f"{memory} datasheet {hbm:,.0f} GB/s", [(model_pts[0][0], hbm), (model_pts[-1][0], hbm)],
                         "line", "#9ca3af", dashed=True))
    out.append(dict(kind="elementwise", modelled=not elt, svg=charts.xy_chart(
        series, title="Elementwise: GB/s vs bytes" + ("" if elt else ", model (no measurements)"),
        x_label="bytes read + written", y_label="GB/s", x_base=2, x_fmt=fmt_bytes, y_fmt=fmt_plain,
        note=f"model: bytes / achieved {memory} bandwidth, plus the kernel launch overhead")))
    return out


@router.get("/profiles/{profile_id}", response_class=HTMLResponse)
def profile_page(request: Request, profile_id: str) -> HTMLResponse:
    found = _stored(request, profile_id, lambda db, key: store.get_profile(db, profile_id=key))
    if found is None:
        return _not_found(request, "profile", profile_id)
    row, cluster = found
    db = request_db(request)
    history = store.cluster_history(db, name=cluster.name)
    problem, links, compute = None, [], []
    try:
        profile = ClusterProfile.model_validate(row.body)
    except ValidationError as exc:  # stored by an older schema: show what can be shown
        profile, problem = None, ("the stored profile does not validate against today's contract: "
                                  f"{exc.error_count()} errors")
    if profile is not None:
        try:
            links = link_charts(profile)
            compute = compute_charts(profile)
        except Exception:  # noqa: BLE001 - a chart must never take the page down
            log.exception("charts of profile %s", row.id)
            problem = "some charts could not be drawn from this profile (the server log has the details)"
    plans, plan_total = store.list_plans(db, profile_id=row.id, limit=20)
    tune_jobs, _ = store.list_tune_jobs(db, cluster=cluster.name, limit=10)
    return _page(request, "profile.html", title=f"{cluster.name} v{row.version}", row=row, cluster=cluster,
                 profile=profile, history=history, links=links, compute=compute, problem=problem, plans=plans,
                 plan_total=plan_total, tune_jobs=tune_jobs)


# -- plans -----------------------------------------------------------------------------------------

@router.get("/plans", response_class=HTMLResponse)
def plans_page(request: Request) -> HTMLResponse:
    db = request_db(request)
    model = _text_param(request, "model")
    status = _text_param(request, "status")
    status = status if status in ("ok", "infeasible") else None
    limit = 50
    offset = _int_param(request, "offset", 0, 0, 10**9)
    rows, total = store.list_plans(db, model=model, status=status, limit=limit, offset=offset)
    return _page(request, "plans.html", title="Plans", rows=rows, total=total, model=model or "", status=status or "",
                 limit=limit, offset=offset)


def microbatch_count(plan: Plan) -> int:
    lay = plan.layout
    return max(1, plan.training.global_batch_seqs // max(1, lay.dp * lay.micro_batch_size))


def timeline_view(plan: Plan) -> dict:
    """The simulated pipeline of one step, capped for drawing."""
    stages = plan.prediction.stages
    lay = plan.layout
    m = microbatch_count(plan)
    if not stages:
        return dict(svg=None, message="the prediction has no per-stage times to draw a timeline from")
    shown_m = min(m, max(MIN_TIMELINE_MICROBATCHES, 2 * len(stages)))
    schedule = lay.schedule.value
    fwd, bwd = [s.forward_s for s in stages], [s.backward_s for s in stages]
    try:
        boxes = simulate(schedule, fwd, bwd, shown_m, lay.virtual_stages)
        whole = boxes if shown_m == m else simulate(schedule, fwd, bwd, min(m, MAX_BUBBLE_MICROBATCHES),
                                                    lay.virtual_stages)
    except ScheduleError as exc:
        return dict(svg=None, message=str(exc))
    ranks = boxes[:MAX_TIMELINE_RANKS]
    total = makespan(whole)
    busy = [sum(b.end_s - b.start_s for b in r) for r in whole]
    bubble = 1 - max(busy) / total if total > 0 else 0.0
    notes = []
    if shown_m < m:
        notes.append(f"drawn with {shown_m} of the step's {m} micro-batches (warm-up, steady state, cool-down); "
                     f"the bubble and the makespan are the schedule's with "
                     f"{min(m, MAX_BUBBLE_MICROBATCHES)}")
    if len(boxes) > MAX_TIMELINE_RANKS:
        notes.append(f"showing the first {MAX_TIMELINE_RANKS} of {len(boxes)} pipeline stages")
    title = (f"{schedule}: {len(stages)} stage{'s' if len(stages) != 1 else ''} x {shown_m} micro-batches"
             + (f", {lay.virtual_stages} chunks per stage" if lay.virtual_stages > 1 else ""))
    svg = charts.timeline_chart(ranks, title=title, rank_labels=[f"stage {i}" for i in range(len(ranks))],
                                split_backward=lay.pp > 1 and SCHEDULES[lay.schedule].split_backward)
    return dict(svg=svg, message=None, notes=notes, microbatches=m, shown=shown_m, makespan=total, bubble=bubble,
                schedule=schedule, v_shape=SCHEDULES[lay.schedule].v_shape)


def plan_charts(plan: Plan) -> dict:
    pred = plan.prediction
    mem = pred.memory
    segs = [("params", mem.params_bytes), ("grads", mem.grads_bytes), ("optimizer", mem.optimizer_bytes),
            ("activations", mem.activations_bytes), ("buffers", mem.buffers_bytes)]
    memory = charts.stacked_bars([(f"stage {mem.stage} (peak)", segs)], title="Memory per GPU (most loaded stage)",
                                 limit=mem.capacity_bytes, limit_label="capacity")
    stages = charts.stacked_bars([(f"stage {s.stage}", [("memory", s.memory_bytes)]) for s in pred.stages],
                                 title="Memory per GPU by pipeline stage", limit=mem.capacity_bytes,
                                 limit_label="capacity", colors={"memory": "#7c3aed"})
    comm = charts.stacked_bars(
        [(f"{c.kind} ({c.level.value}, n={c.group_size})",
          [("exposed", c.exposed_s), ("overlapped", max(0.0, c.time_s - c.exposed_s))]) for c in pred.comm],
        title="Communication per step: exposed vs overlapped", fmt=fmt_seconds,
        colors={"exposed": "#dc2626", "overlapped": "#93c5fd"}, empty_message="no communication in this layout")
    other = max(0.0, pred.step_time_s - pred.compute_time_s - pred.exposed_comm_time_s - pred.optimizer_time_s
                - pred.bubble_time_s)
    step = charts.stacked_bars(
        [("step", [("compute", pred.compute_time_s), ("pipeline bubble", pred.bubble_time_s),
                   ("exposed communication", pred.exposed_comm_time_s), ("optimizer", pred.optimizer_time_s),
                   ("other", other)])],
        title="Step time", fmt=fmt_seconds,
        colors={"compute": "#2563eb", "pipeline bubble": "#d1d5db", "exposed communication": "#dc2626",
                "optimizer": "#16a34a", "other": "#f59e0b"})
    return dict(memory=memory, stages=stages, comm=comm, step=step)


@router.get("/plans/{plan_id}", response_class=HTMLResponse)
def plan_page(request: Request, plan_id: str) -> HTMLResponse:
    found = _stored(request, plan_id, lambda db, key: store.get_plan(db, plan_id=key))
    if found is None:
        return _not_found(request, "plan", plan_id)
    row, cluster = found
    plan, problem, view, timeline = None, None, {}, {}
    if row.plan:
        try:
            plan = Plan.model_validate(row.plan)
        except ValidationError as exc:
            problem = f"the stored plan does not validate against today's contract: {exc.error_count()} errors"
    if plan is not None:
        try:
            view = plan_charts(plan)
            timeline = timeline_view(plan)
        except Exception:  # noqa: BLE001 - a chart must never take the page down
            log.exception("charts of plan %s", row.id)
            problem = "some charts could not be drawn from this plan (the server log has the details)"
    runs, run_total = store.list_runs(request_db(request), plan_id=row.id, limit=20)
    return _page(request, "plan.html", title=f"Plan {row.id}", row=row, cluster=cluster, plan=plan,
                 explanation=row.explanation, request_body=row.request or {}, charts=view, timeline=timeline,
                 problem=problem, runs=runs, run_total=run_total,
                 microbatches=microbatch_count(plan) if plan else None)


# -- runs ------------------------------------------------------------------------------------------

def runs_chart(rows: list) -> Any:
    pts, labels = [], []
    for r in rows:
        if r.predicted_step_s and r.measured_step_s:
            pts.append((r.measured_step_s, r.predicted_step_s))
            labels.append(f"run {r.id} (plan {r.plan_id}): measured {fmt_seconds(r.measured_step_s)}, "
                          f"predicted {fmt_seconds(r.predicted_step_s)}")
    return charts.xy_chart([Series("runs", pts, "markers", charts.PALETTE[0], labels=labels)],
                           title="Predicted vs measured step time", x_label="measured step time (s)",
                           y_label="predicted step time (s)", log_x=True, log_y=True, diagonal=True,
                           x_fmt=fmt_seconds, y_fmt=fmt_seconds, width=560, height=420,
                           empty_message="no runs with a prediction yet: POST /v1/runs")


@router.get("/runs", response_class=HTMLResponse)
def runs_page(request: Request) -> HTMLResponse:
    db = request_db(request)
    limit = 100
    offset = _int_param(request, "offset", 0, 0, 10**9)
    rows, total = store.list_runs(db, limit=limit, offset=offset)
    summary = store.run_error_summary(db)
    return _page(request, "runs.html", title="Runs", rows=rows, total=total, limit=limit, offset=offset,
                 summary=summary, chart=runs_chart(rows))


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str) -> HTMLResponse:
    found = _stored(request, run_id, lambda db, key: store.get_run(db, run_id=key))
    if found is None:
        return _not_found(request, "run", run_id)
    row, plan_row = found
    report, problem, charts_ = None, None, []
    try:
        report = RunReport.model_validate(row.report)
    except ValidationError as exc:
        problem = f"the stored report does not validate against today's contract: {exc.error_count()} errors"
    from api.routes.runs import predicted_peak

    pred = (plan_row.plan or {}).get("prediction") or {}
    peak = None
    if report is not None:
        charts_ = _run_charts(report, row.predicted_step_s)
        peak = predicted_peak(pred, report)  # as the run measured it: the API's predicted_peak_memory_bytes
    return _page(request, "run.html", title=f"Run {row.id}", row=row, plan_row=plan_row, report=report,
                 problem=problem, charts=charts_, pred=pred, predicted_peak=peak,
                 terms=term_comparison(pred.get("terms") or {}, report),
                 checkpoints=_checkpoints(report, pred))


def _checkpoints(report: RunReport | None, pred: dict) -> list[dict]:
    """The run's checkpoints per mode beside the plan's goodput (``planner.goodput.checkpoint_comparison``)."""
    from planner.contracts.goodput import GoodputPrediction
    from planner.goodput import checkpoint_comparison

    if report is None:
        return []
    try:
        goodput = GoodputPrediction.model_validate(pred["goodput"]) if pred.get("goodput") else None
    except ValidationError:
        goodput = None  # a plan stored before today's contract: the measured side alone
    return checkpoint_comparison(report, goodput)


def _run_charts(report: RunReport, predicted_s: float | None) -> list:
    """Step time per step (the prediction dashed) and the loss curve."""
    series = [Series("measured step time", [(s.step, s.time_s) for s in report.steps], "both", charts.PALETTE[0])]
    if predicted_s and report.steps:
        steps = [s.step for s in report.steps]
        series.append(Series("predicted", [(min(steps), predicted_s), (max(steps), predicted_s)],
                             "line", charts.PALETTE[1], dashed=True))
    times = charts.xy_chart(series, title="Step time per step", x_label="step", y_label="seconds",
                            log_x=False, y_fmt=fmt_seconds, x_fmt=lambda v: f"{v:g}")
    losses = charts.xy_chart([Series("loss", [(s.step, s.loss) for s in report.steps], "both", charts.PALETTE[2])],
                             title="Loss per step", x_label="step", y_label="loss", log_x=False,
                             y_fmt=lambda v: f"{v:.4g}", x_fmt=lambda v: f"{v:g}")
    return [times, losses]


# -- tune jobs -------------------------------------------------------------------------------------

TUNE_REFRESH_S = 2
TUNE_LOG_SHOWN = 15


def tune_rows(report: TuneReport, stored: list[dict]) -> list[dict]:
    """The table of a finished job's runs (as ``autopar tune`` prints it), each with its stored run and plan."""
    where = {r["name"]: r for r in stored}
    rows = []
    for r in report.runs:
        after = (f"{r.calibrated_step_s / r.measured_step_s - 1:+.0%}" if r.calibrated_step_s and r.measured_step_s
                 else None)
        rows.append(dict(name=r.name, layout=r.layout.summary(), role=r.role, predicted=r.predicted_step_s,
                         calibrated=r.calibrated_step_s, measured=r.measured_step_s, after=after, error=r.error,
                         run_id=where.get(r.name, {}).get("run_id"), plan_id=where.get(r.name, {}).get("plan_id")))
    return rows


@router.get("/tune/{job_id}", response_class=HTMLResponse)
def tune_page(request: Request, job_id: str) -> HTMLResponse:
    """A tune job: while it runs, its phase, progress and log (the page reloads itself every 2 s); when done,
    its runs predicted before and after calibration against measured, and what it stored; when failed, why."""
    job = _stored(request, job_id, lambda db, key: store.get_tune_job(db, job_id=key))
    if job is None:
        return _not_found(request, "tune job", job_id)
    report, problem = None, None
    if job.result:
        try:
            report = TuneReport.model_validate(job.result)
        except ValidationError as exc:
            problem = f"the stored report does not validate against today's contract: {exc.error_count()} errors"
    active = job.state in store.ACTIVE
    replanned = None
    if report is not None and report.replanned is not None:
        replanned = dict(layout=report.replanned.layout.summary(), step=report.replanned.prediction.step_time_s,
                         same=report.replanned.layout == report.first_plan)
    calibrated_cluster = None  # the job's own cluster, or '<name>-calibrated' when it started from a reference
    if job.calibrated_profile_id:
        found = _stored(request, str(job.calibrated_profile_id),
                        lambda db, key: store.get_profile(db, profile_id=key))
        calibrated_cluster = found.cluster.name if found else None
    response = _page(request, "tune.html", title=f"Tune job {job.id}", job=job, report=report, problem=problem,
                     active=active, refresh_s=TUNE_REFRESH_S, log_lines=(job.log or [])[-TUNE_LOG_SHOWN:],
                     rows=tune_rows(report, job.runs or []) if report else [], replanned=replanned,
                     line=report.line() if report else None, calibrated_cluster=calibrated_cluster)
    if active:
        response.headers["Refresh"] = str(TUNE_REFRESH_S)
    return response

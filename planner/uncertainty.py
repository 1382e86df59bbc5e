"""How sure a prediction is: an interval from the held-out residuals of its regime, and blind-spot flags.

A published run judged by ``autopar validate`` leaves a residual ``r = ln(predicted step time / measured
step time)`` (a throughput metric's error is inverted to the step time's). The residuals come from the
leave-one-source-out folds (each row predicted by constants fitted without its source), so an interval
says how far off the model is on data it was not fitted to. They are grouped by regime — framework
family, dense or Mixture-of-Experts, precision, scale — and ``benchmarks/validate_published.py
--write-intervals`` stores each regime's 10th and 90th percentile in ``planner/data/intervals.json``.

For a prediction of step time ``t`` in a regime with percentiles ``q10 <= q90``, the measured time lies
in ``[t·exp(-q90), t·exp(-q10)]`` for 80% of the held-out runs like it. A regime with fewer than
:data:`MIN_ROWS` residuals falls back to a coarser one (:meth:`Regime.keys`).

The same file keeps the best MFU any published run reached per GPU family and model class (dense or MoE,
precision, size): a plan predicted above it wins on terms no published run has checked, and says so.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from functools import cache
from importlib import resources

LEVEL = 0.8
MIN_ROWS = 8
"""Residuals a regime needs for its own interval; with fewer it falls back to a coarser regime."""

FRAMEWORK_OF_TARGET = {"autopar": "fsdp", "torchtitan": "fsdp", "megatron": "megatron", "deepspeed": "deepspeed"}
"""The published framework family whose residuals judge each target (autopar's executor is FSDP2-based)."""


def framework_family(text: str) -> str:
    """A published row's framework column as a family: megatron (Megatron-LM/-Core, NeMo, Megatron-Bridge),
    deepspeed (Megatron-DeepSpeed, DeepSpeed), fsdp (torchtitan, PyTorch FSDP, Composer) or other."""
    t = text.lower()
    if "deepspeed" in t:
        return "deepspeed"
    if any(w in t for w in ("megatron", "nemo")):
        return "megatron"
    if any(w in t for w in ("torchtitan", "fsdp", "composer")):
        return "fsdp"
    return "other"


def scale_bucket(num_gpus: int) -> str:
    return "<=64" if num_gpus <= 64 else "<=1024" if num_gpus <= 1024 else ">1024"


def layout_style(layout) -> str:  # noqa: ANN001 - a ParallelLayout
    """How a layout splits the model: ``sharded`` (ZeRO-3/FSDP gathers weights every micro-batch),
    ``3d`` (tensor or pipeline parallel without that), or ``dp`` (data parallel alone)."""
    if layout.zero_stage == 3:
        return "sharded"
    return "3d" if layout.tp > 1 or layout.pp > 1 else "dp"


@dataclass(frozen=True)
class Regime:
    framework: str
    moe: bool
    precision: str  # bf16 | fp8 | fp32 | fp16
    scale: str
    style: str  # layout_style

    def keys(self) -> list[str]:
        """This regime's key and its fallbacks, finest first: framework|kind|precision|scale|style."""
        k, f, p, s, st = "moe" if self.moe else "dense", self.framework, self.precision, self.scale, self.style
        return [f"{f}|{k}|{p}|{s}|{st}", f"{f}|{k}|{p}|*|{st}", f"*|{k}|{p}|*|{st}", f"*|{k}|*|*|{st}",
                f"*|{k}|*|*|*", "*|*|*|*|*"]


def step_time_residual(metric: str, signed_error: float) -> float:
    """``ln(predicted / measured step time)`` from a row's signed relative error in its own metric (a
    time metric grows with the step time; throughput, TFLOP/s and MFU shrink with it)."""
    ratio = 1.0 + signed_error
    return math.log(ratio) if metric == "iteration_time_s" else -math.log(ratio)


def q10_q90(values: list[float]) -> tuple[float, float]:
    """The ``(1 - LEVEL)/2`` and ``(1 + LEVEL)/2`` percentiles of residuals (inclusive interpolation)."""
    cuts = statistics.quantiles(values, n=20, method="inclusive")  # 5% steps: cuts[1] = 10th, cuts[17] = 90th
    return cuts[1], cuts[17]


def quantile_table(residuals: list[tuple[Regime, float]]) -> dict[str, dict]:
    """Every regime key (each fallback level) with at least :data:`MIN_ROWS` residuals: its row count and
    the ``(1 - LEVEL)/2`` and ``(1 + LEVEL)/2`` percentiles."""
    groups: dict[str, list[float]] = {}
    for regime, r in residuals:
        for key in regime.keys():
            groups.setdefault(key, []).append(r)
    out = {}
    for key, values in sorted(groups.items()):
        if len(values) < MIN_ROWS:
            continue
        q10, q90 = q10_q90(values)
        out[key] = {"rows": len(values), "q10": round(q10, 5), "q90": round(q90, 5),
                    "median": round(statistics.median(values), 5)}
    return out


@cache
def table() -> dict:
    """The packaged ``intervals.json`` ({} before ``validate_published.py --write-intervals`` wrote it)."""
    path = resources.files("planner") / "data" / "intervals.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class Interval:
    low_s: float
    high_s: float
    regime: str
    rows: int


def step_time_interval(step_s: float, regime: Regime, doc: dict | None = None) -> Interval | None:
    """The :data:`LEVEL` interval of a predicted step time in ``regime`` (its finest key with enough rows)."""
    regimes = (table() if doc is None else doc).get("regimes", {})
    for key in regime.keys():
        q = regimes.get(key)
        if q is not None:
            return Interval(step_s * math.exp(-q["q90"]), step_s * math.exp(-q["q10"]), key, q["rows"])
    return None


def cluster_interval(step_s: float, profile) -> Interval | None:  # noqa: ANN001 - a ClusterProfile
    """The :data:`LEVEL` interval of a step predicted on a profile calibrated from its cluster's runs, from those
    runs' leave-one-run-out residuals (``RunCalibration.held_out_residuals``; at least three), rather than from
    published runs of its regime: the cluster's own error is the better guide once it has run."""
    cal = profile.calibration
    if cal is None or len(cal.held_out_residuals) < 3:
        return None
    q10, q90 = q10_q90(cal.held_out_residuals)
    return Interval(step_s * math.exp(-q90), step_s * math.exp(-q10),
                    f"this cluster's {len(cal.runs)} runs (leave-one-run-out)", len(cal.held_out_residuals))


def size_class(active_params: float) -> str:
    """Model size class by active parameters: small models reach a higher MFU than large ones at scale."""
    return "<13B" if active_params < 13e9 else "13-100B" if active_params <= 100e9 else ">100B"


def model_class(model, precision: str) -> str:  # noqa: ANN001 - a ModelSpec
    """``dense|bf16|>100B``-style class a published best MFU is kept for."""
    from planner.cost.params import active_params

    return f"{'moe' if model.moe is not None else 'dense'}|{precision}|{size_class(active_params(model))}"


def best_published_mfu(gpu_family: str, cls: str, doc: dict | None = None) -> tuple[float, str] | None:
    """(MFU, run id) of the best published run on this GPU family of model class ``cls``, if any."""
    best = (table() if doc is None else doc).get("best_mfu", {}).get(f"{gpu_family}|{cls}")
    return (best["mfu"], best["run_id"]) if best else None


def intervals_document(results: list, frameworks: dict[str, str], source: str) -> dict:
    """``intervals.json`` from held-out ``planner.validate.RowResult``s (``frameworks``: run id -> the row's
    framework column): each regime's residual percentiles, and the best published MFU per GPU family and
    model class (measured MFU = predicted MFU x predicted / measured step time)."""
    residuals, best = [], {}
    for res in results:
        case = res.case
        r = step_time_residual(case.metric, res.error)
        moe = case.model.moe is not None
        regime = Regime(framework_family(frameworks.get(case.run_id, "")), moe, case.training.precision.value,
                        scale_bucket(case.profile.num_gpus), layout_style(case.layout))
        residuals.append((regime, r))
        mfu = res.prediction.mfu * math.exp(r)
        key = f"{case.family}|{model_class(case.model, case.training.precision.value)}"
        if key not in best or mfu > best[key]["mfu"]:
            best[key] = {"mfu": round(mfu, 4), "run_id": case.run_id}
    return {"level": LEVEL, "min_rows": MIN_ROWS,
            "residual": "ln(predicted / measured step time), leave-one-source-out",
            "source": source, "rows": len(residuals), "regimes": quantile_table(residuals), "best_mfu": best}


def gpu_family(profile) -> str | None:  # noqa: ANN001 - a ClusterProfile
    """The calibration family (a100, hopper, blackwell) of a profile's GPU, None for a CPU or an unknown part."""
    from planner import reference

    if profile.is_cpu:
        return None
    try:
        return reference.system_family(profile.name.split("-nic")[0])
    except KeyError:
        found = reference.datasheet_for(profile.device.name)
        return reference.system_family(found[0]) if found else None


EXECUTOR_MOE_HOST_NOTE = (
    "the executor routes MoE tokens in eager PyTorch (routing, sorting and gathers launched from the host); the "
    "host's time is priced per kernel the planner counts (planner.targets.autopar.EXECUTOR_HOST_S_PER_KERNEL, "
    "measured on dense runs), and the routing counts as a few kernels: on one H100 a 2-layer model of "
    "Qwen3-30B-A3B's blocks (128 experts of 768, 4k tokens) stepped in 126.5 ms against 67.3 ms predicted (1.9x), "
    "its MoE layer 12.2 ms wall against 6.8 ms of kernels (benchmarks/data/moe_h100.log, run 5); expect MoE steps "
    "slower than predicted where a layer's kernels are short")
"""A measured blind spot of the autopar target, said on each of its MoE predictions."""


def assess(pred, model, training, profile, layout, target: str = "autopar", doc: dict | None = None):  # noqa: ANN001, ANN201
    """``pred`` with its interval (regime: the target's framework family, dense/MoE, precision, scale, layout
    style) and, where its MFU is above the best published on its GPU family and model class, a note saying so;
    for the executor's MoE plans the measured host-bound dispatch (:data:`EXECUTOR_MOE_HOST_NOTE`)."""
    regime = Regime(FRAMEWORK_OF_TARGET.get(target, "other"), model.moe is not None, training.precision.value,
                    scale_bucket(profile.num_gpus), layout_style(layout))
    found = cluster_interval(pred.step_time_s, profile) or step_time_interval(pred.step_time_s, regime, doc)
    update: dict = {}
    if found is not None:
        update["interval"] = {"low_s": found.low_s, "high_s": found.high_s, "level": LEVEL, "regime": found.regime,
                              "rows": found.rows}
    family = gpu_family(profile)
    cls = model_class(model, training.precision.value)
    best = best_published_mfu(family, cls, doc) if family else None
    notes = list(pred.notes)
    if best is not None and pred.mfu > best[0]:
        notes.append(f"MFU {pred.mfu:.1%} is above the best published run of its class ({cls}) on {family} GPUs "
                     f"({best[0]:.1%}, {best[1]}): this plan wins on terms no published run has checked")
    if target == "autopar" and model.moe is not None:
        notes.append(EXECUTOR_MOE_HOST_NOTE)
    if notes != pred.notes:
        update["notes"] = notes
    if not update:
        return pred
    if "interval" in update:
        from planner.contracts.plan import StepTimeInterval

        update["interval"] = StepTimeInterval(**update["interval"])
    return pred.model_copy(update=update)

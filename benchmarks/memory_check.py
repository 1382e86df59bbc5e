"""Predicted against measured GPU memory, per case of ``memory_cases.py``, and the memory constants refitted.

Reads what ``memory_measure.py`` recorded on a GPU (``benchmarks/data/memory_h100.json``: the executor on
one H100 80GB) and predicts every case with ``planner.cost.predict`` on a one-GPU reference profile.

- Headline, leave one model out: the constants the cases measure (``autocast_activation_factor``,
  ``activation_memory_factor``, ``loss_bytes_per_logit`` by non-negative least squares on the allocated
  peak; the fragmentation shares and the runtime bytes as medians) are fitted on the other models' rows
  and each model's rows are predicted with them.
- Beside it, in sample: every row predicted with the defaults of ``planner.contracts.Assumptions``, and
  the constants fitted on all rows, to compare with those defaults.

Per row: the allocated peak (``max_memory_allocated`` over forward/backward and the optimizer step) and the
device total (the allocator's peak reserve plus what lies outside it) against the prediction.

- Last, the executor's own tune runs on one H200 (``tests/data/gpu_runs``), out of sample.

    .venv/bin/python benchmarks/memory_check.py [--measured benchmarks/data/memory_h100.json] [--tune-runs DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_cases import ROWS, one_gpu_profile, plan_of  # noqa: E402
from planner.contracts import Assumptions  # noqa: E402

GIB = 2**30
GROUPS = ("1b-", "3b-", "v128k-")  # the rows of one model: left out together


def predicted(row: tuple, **assume: float):  # noqa: ANN201 - a MemoryBreakdown
    name, model, seq, gbs, layout = row
    profile = one_gpu_profile()
    profile = profile.model_copy(update={"assumptions": profile.assumptions.model_copy(update=assume)})
    return plan_of(model, seq, gbs, profile, **layout).prediction.memory


def measured_allocated(case: dict) -> int:
    return max(case["fb_peak_allocated"], case["opt_peak_allocated"])


IDENTIFIED_SHARE = 0.05  # a constant is fitted where it makes at least this share of some row's peak


def identified(contribution: np.ndarray, peaks: np.ndarray) -> bool:
    """Whether the rows measure a constant: at its default it makes at least :data:`IDENTIFIED_SHARE` of some
    row's allocated peak. Below that (e.g. the activation factor where every row recomputes fully and only one
    block's transient carries it) the allocations' few-percent noise would set it, so it keeps its default."""
    return bool((contribution >= IDENTIFIED_SHARE * peaks).any())


def fit_linear(rows: list[tuple], cases: dict[str, dict]) -> dict[str, float]:
    """Non-negative least squares of the allocated peak on the three linear constants. The peak is the
    larger of the backward's and the optimizer step's, so each row's coefficients are taken around the
    defaults (each constant one unit up); a constant fitted negative is held at 0."""
    names = ["autocast_activation_factor", "activation_memory_factor", "loss_bytes_per_logit"]
    default = {n: getattr(Assumptions(), n) for n in names}
    a_rows, b = [], []
    for row in rows:
        at = predicted(row).allocated_bytes
        coef = [predicted(row, **{n: default[n] + 1.0}).allocated_bytes - at for n in names]
        a_rows.append(coef)
        b.append(measured_allocated(cases[row[0]]) - (at - sum(c * default[n] for c, n in zip(coef, names))))
    a, y = np.array(a_rows, float), np.array(b, float)
    peaks = y + a @ [default[n] for n in names]
    free = [i for i in range(len(names)) if identified(a[:, i] * default[names[i]], peaks)]
    while True:
        coef, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (coef >= 0).all():
            break
        free = [f for f, c in zip(free, coef) if c >= 0]
    out = dict.fromkeys(names, 0.0)
    out.update({names[f]: float(c) for f, c in zip(free, coef)})
    unseen = [n for i, n in enumerate(names) if i not in free]  # no row identifies it: keep the default
    out.update({n: getattr(Assumptions(), n) for n in unseen})
    return out


def fit_medians(rows: list[tuple], cases: dict[str, dict]) -> dict[str, float]:
    frag: dict[bool, list[float]] = {False: [], True: []}
    for row in rows:
        c = cases[row[0]]
        frag[row[4].get("zero_stage", 0) >= 2].append(c["peak_reserved"] / measured_allocated(c) - 1)
    runtime = statistics.median(cases[r[0]]["outside_allocator_bytes"] for r in rows)
    out = {"runtime_bytes": int(runtime)}
    for sharded, name in ((False, "allocator_fragmentation"), (True, "sharded_fragmentation")):
        out[name] = statistics.median(frag[sharded]) if frag[sharded] else getattr(Assumptions(), name)
    return out


def fitted(rows: list[tuple], cases: dict[str, dict]) -> dict[str, float]:
    return {**fit_linear(rows, cases), **fit_medians(rows, cases)}


def group(name: str) -> str:
    return next(g for g in GROUPS if name.startswith(g))


def errors(rows: list[tuple], cases: dict[str, dict], constants: dict[str, dict[str, float]]) -> list[tuple]:
    """(row name, predicted allocated, measured, predicted total, measured) with each row's constants."""
    out = []
    for row in rows:
        c = cases[row[0]]
        mem = predicted(row, **constants[group(row[0])])
        out.append((row[0], mem.allocated_bytes, measured_allocated(c), mem.total_bytes,
                    c["peak_reserved"] + c["outside_allocator_bytes"]))
    return out


def show(title: str, found: list[tuple]) -> None:
    print(f"-- {title}")
    print(f"{'case':22} {'alloc pred':>10} {'meas':>7} {'err':>7}   {'total pred':>10} {'meas':>7} {'err':>7}")
    ea, et = [], []
    for name, pa, ma, pt, mt in found:
        ea.append(pa / ma - 1)
        et.append(pt / mt - 1)
        print(f"{name:22} {pa / GIB:10.2f} {ma / GIB:7.2f} {ea[-1]:+7.1%}   "
              f"{pt / GIB:10.2f} {mt / GIB:7.2f} {et[-1]:+7.1%}")
    for label, e in (("allocated", ea), ("total", et)):
        print(f"summary {title.split(':')[0]} {label:9}: median |error| {statistics.median(abs(x) for x in e):.1%}, "
              f"worst under {min(min(e), 0.0):+.1%}, worst over {max(max(e), 0.0):+.1%} ({len(e)} rows)")


def tune_runs(folder: Path) -> None:
    """The executor's own runs recorded by ``benchmarks/tune.py --gpu`` (``tests/data/gpu_runs``: one H200, each
    plan as searched and run): its predicted allocated peak against the run's ``max_memory_allocated``. No
    constant was fitted on them (those above come from the H100 cases): an out-of-sample check."""
    from planner.contracts import Plan, RunReport

    errs = []
    print(f"-- the executor's tune runs ({folder.relative_to(ROOT)}): allocated peak, out of sample")
    for f in sorted(p for p in folder.glob("*/*") if (p / "report.json").is_file()):
        plan = Plan.model_validate_json((f / "plan.json").read_text())
        report = RunReport.model_validate_json((f / "report.json").read_text())
        pred, meas = plan.prediction.memory.as_measured(report.memory_kind), max(report.peak_memory_bytes_per_rank)
        errs.append(pred / meas - 1)
        lay = plan.layout
        what = f"mb{lay.micro_batch_size} {lay.recompute.value} zero{lay.zero_stage}" + (
            " offload" if lay.offload_optimizer else "")
        print(f"{f.parent.name + '/' + f.name:16} {plan.model.name:12} {what:28} {pred / GIB:7.2f} {meas / GIB:7.2f} "
              f"{errs[-1]:+7.1%}")
    if errs:
        print(f"summary tune runs allocated: median |error| {statistics.median(abs(x) for x in errs):.1%}, "
              f"worst under {min(min(errs), 0.0):+.1%}, worst over {max(max(errs), 0.0):+.1%} ({len(errs)} rows)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", default=str(ROOT / "benchmarks/data/memory_h100.json"))
    ap.add_argument("--tune-runs", default=str(ROOT / "tests/data/gpu_runs"))
    args = ap.parse_args()
    doc = json.loads(Path(args.measured).read_text())
    cases = {c["name"]: c for c in doc["cases"]}
    print(f"measured: {doc['device']}, torch {doc['torch']}, CUDA {doc['cuda']}, NCCL {doc['nccl']}; runtime at start "
          f"{doc['runtime']['runtime_bytes'] / 1e9:.2f} GB outside the allocator")
    rows = [r for r in ROWS if r[0] in cases and "error" not in cases[r[0]]]
    held = {g: fitted([r for r in rows if group(r[0]) != g], cases) for g in GROUPS}
    defaults = {k: getattr(Assumptions(), k) for k in held[GROUPS[0]]}
    every = fitted(rows, cases)
    print(f"{'constant':28} {'default':>10} {'all rows':>10} " + " ".join(f"{'w/o ' + g[:-1]:>10}" for g in GROUPS))
    for name in defaults:
        print(f"{name:28} {defaults[name]:10.4g} {every[name]:10.4g} "
              + " ".join(f"{held[g][name]:10.4g}" for g in GROUPS))
    show(
        "leave-one-model-out (headline): each model's rows with constants fitted on the others",
        errors(rows, cases, held),
    )
    show("in-sample: the defaults of planner.contracts.Assumptions", errors(rows, cases, dict.fromkeys(GROUPS, {})))
    tune_runs(Path(args.tune_runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

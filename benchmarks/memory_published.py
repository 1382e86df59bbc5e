"""Predicted against published peak GPU memory, one row per figure of ``planner/data/published_memory.csv``.

Each row's model, training, layout and reference profile are built from its cells (columns: docs/memory.md,
"Published peak memory") and predicted with ``planner.cost.predict``. The figure is compared with the
predicted quantity it measures (:data:`METRICS`):

- ``max_allocated`` (``torch.cuda.max_memory_allocated``, Megatron's "max allocated"): ``allocated_bytes``;
- ``max_reserved`` (the caching allocator's peak reserve, torchtitan's logged "memory"):
  ``allocated_bytes + fragmentation``, the total less the CUDA context, NCCL buffers and fixed reserve,
  which lie outside the allocator as they lie outside the figure;
- ``device_used`` (nvidia-smi): ``total_bytes``.

Error is predicted / published - 1. A row with a ``skip_reason`` (a configuration the source leaves
incomplete, a feature or device the planner does not model) is listed with that reason, not predicted.
A compared row names in ``approximations`` what the planner models only roughly (:data:`APPROXIMATIONS`).
Summaries: the headline over every compared row, the rows with no approximation at all, and each source.
torchtitan's per-op selective checkpointing is the planner's ``op`` recompute (``planner.cost.sac``); until
2026-12-07 those rows were informational (their policy was not modelled).

    .venv/bin/python benchmarks/memory_published.py [--csv planner/data/published_memory.csv]
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.contracts import (  # noqa: E402
    ClusterProfile,
    MemoryBreakdown,
    ModelSpec,
    ParallelLayout,
    TrainingConfig,
)
from planner.contracts.model import MoESpec  # noqa: E402
from planner.contracts.plan import StageRecompute  # noqa: E402
from planner.cost.predict import predict  # noqa: E402
from planner.errors import AutoparError  # noqa: E402
from planner.presets import get_preset  # noqa: E402
from planner.reference import SYSTEMS, reference_profile  # noqa: E402

CSV = ROOT / "planner/data/published_memory.csv"
GIB = 2**30
UNITS = {"GiB": 2**30, "MiB": 2**20, "GB": 1e9, "MB": 1e6}


def _allocated(m: MemoryBreakdown) -> float:
    return float(m.allocated_bytes)


def _reserved(m: MemoryBreakdown) -> float:
    return float(m.allocated_bytes + m.terms.get("fragmentation", 0))


def _device(m: MemoryBreakdown) -> float:
    return float(m.total_bytes)


METRICS = {"max_allocated": _allocated, "max_reserved": _reserved, "device_used": _device}
"""What a published figure measures -> the predicted bytes it is compared with."""

APPROXIMATIONS = {
    "compile": "torch.compile of the blocks: not modelled (a compiled loss is: the compile column)",
    "float8": "float8/MX linears: precision fp8, every linear saving a 1-byte input",
    "async_tp": "async tensor parallel: not modelled",
}
"""Features a compared row's run used that the planner models only approximately, by the name the CSV uses."""

@dataclass(frozen=True)
class Case:
    """One row, built: what ``predict`` takes."""

    model: ModelSpec
    training: TrainingConfig
    profile: ClusterProfile
    layout: ParallelLayout


@dataclass(frozen=True)
class Result:
    row_id: str
    metric: str
    published: float  # bytes
    predicted: float  # bytes
    approximations: str
    source: str

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1.0


def load_rows(path: Path = CSV) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _cell(row: dict[str, str], key: str) -> str:
    value = row.get(key, "").strip()
    if not value:
        raise AutoparError(key, value, f"fill column {key!r} of row {row.get('row_id')!r}, or give the row "
                           "a skip_reason", problem="is empty")
    return value


def _int(row: dict[str, str], key: str) -> int:
    value = _cell(row, key)
    if not value.isdigit():
        raise AutoparError(key, value, f"write a whole number in column {key!r} of row {row.get('row_id')!r}",
                           problem="is not a whole number")
    return int(value)


def _bool(row: dict[str, str], key: str) -> bool:
    value = _cell(row, key).lower()
    if value not in ("true", "false"):
        raise AutoparError(key, value, f"write true or false in column {key!r} of row {row.get('row_id')!r}",
                           problem="is not a boolean")
    return value == "true"


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def model_fields(text: str) -> dict:
    """``"num_layers=2;moe.top_k=1"`` -> ``{"num_layers": 2, "moe": {"top_k": 1}}``."""
    out: dict = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise AutoparError("model_fields", item, "write each field as name=value, separated by ';'",
                               problem="has no '='")
        head, _, sub = key.strip().partition(".")
        if sub:
            out.setdefault(head, {})[sub] = _number(value.strip())
        else:
            out[head] = _number(value.strip())
    return out


def model_of(row: dict[str, str]) -> ModelSpec:
    """The row's preset, or a ModelSpec from its ``model_fields`` (a ``moe.`` prefix fills the MoESpec)."""
    fields = row.get("model_fields", "").strip()
    if not fields:
        return get_preset(_cell(row, "model"))
    spec = model_fields(fields)
    if "moe" in spec:
        spec["moe"] = MoESpec(**spec["moe"])
    return ModelSpec(name=_cell(row, "model"), **spec)


def recompute_of(row: dict[str, str], pp: int) -> dict:
    """Layout fields for none, selective, full, op, or ``full:N`` (N blocks of each stage fully recomputed)."""
    value = _cell(row, "recompute")
    kind, _, layers = value.partition(":")
    if kind not in ("none", "selective", "full", "op") or (layers and not layers.isdigit()):
        raise AutoparError("recompute", value, "write none, selective, full, op or full:<layers per stage>",
                           problem="is no recompute choice the planner models")
    if layers:
        return {"recompute_per_stage": [StageRecompute(kind=kind, num_layers=int(layers))] * pp}
    return {"recompute": kind}


def layout_of(row: dict[str, str]) -> ParallelLayout:
    pp = _int(row, "pp")
    lps = row.get("layers_per_stage", "").strip()
    return ParallelLayout(
        dp_shard=_int(row, "dp_shard"), dp_replicate=_int(row, "dp_replicate"), tp=_int(row, "tp"), pp=pp,
        cp=_int(row, "cp"), ep=_int(row, "ep"), sp=_bool(row, "sp"), zero_stage=_int(row, "zero_stage"),
        reshard_after_forward=_bool(row, "reshard_after_forward"),
        micro_batch_size=_int(row, "micro_batch_size"),
        schedule=_cell(row, "schedule"), virtual_stages=_int(row, "virtual_stages"),
        layers_per_stage=[int(x) for x in lps.split(",")] if lps else None, **recompute_of(row, pp),
        # model and loss compiled (the loss: 4 B/logit); a blank cell is not compiled, a typo is an error
        compile=_bool(row, "compile") if row.get("compile", "").strip() else False,
    )


def training_of(row: dict[str, str]) -> TrainingConfig:
    return TrainingConfig(seq_length=_int(row, "seq_length"),
                          global_batch_size=_int(row, "global_batch_size"), precision=_cell(row, "precision"))


def profile_of(row: dict[str, str]) -> ClusterProfile:
    """A reference profile of the row's system and GPU count: whole nodes, or one node cut to the count."""
    system, n = _cell(row, "system"), _int(row, "num_gpus")
    per_node = SYSTEMS[system].gpus_per_node if system in SYSTEMS else 0
    if per_node and n < per_node:
        return reference_profile(system).model_copy(update={"gpus_per_node": n, "num_nodes": 1})
    if per_node and n % per_node:
        raise AutoparError("num_gpus", n, f"use a multiple of {per_node} ({system} nodes) or fewer than one "
                           "node", problem="is not a whole number of nodes")
    return reference_profile(system, num_nodes=max(n // max(per_node, 1), 1))


def build(row: dict[str, str]) -> Case:
    return Case(model_of(row), training_of(row), profile_of(row), layout_of(row))


def compared_bytes(metric: str, memory: MemoryBreakdown) -> float:
    """The predicted bytes a published figure of kind ``metric`` is compared with (:data:`METRICS`)."""
    if metric not in METRICS:
        raise AutoparError("metric", metric, f"use one of {', '.join(METRICS)}",
                           problem="names no quantity the benchmark compares")
    return METRICS[metric](memory)


def published_bytes(row: dict[str, str]) -> float:
    unit = _cell(row, "unit")
    if unit not in UNITS:
        raise AutoparError("unit", unit, f"use one of {', '.join(UNITS)}", problem="is no unit of bytes")
    return float(_cell(row, "value")) * UNITS[unit]


def target_of(row: dict[str, str]) -> str:
    """The target whose facts (loss memory, model states: planner.targets.TargetFacts) the row's framework
    matches: torchtitan, Megatron (Megatron-Bridge / -LM), else the executor's."""
    framework = row.get("framework", "").lower()
    return "torchtitan" if "torchtitan" in framework else "megatron" if "megatron" in framework else "autopar"


def compare(row: dict[str, str]) -> Result:
    case = build(row)
    memory = predict(case.model, case.training, case.profile, case.layout, target=target_of(row)).memory
    metric = _cell(row, "metric")
    return Result(row["row_id"], metric, published_bytes(row), compared_bytes(metric, memory),
                  ";".join(approximations_of(row)), row.get("source", ""))


def approximations_of(row: dict[str, str]) -> list[str]:
    names = [a for a in row.get("approximations", "").split(";") if a]
    unknown = [a for a in names if a not in APPROXIMATIONS]
    if unknown:
        raise AutoparError("approximations", ";".join(unknown), f"use names of {', '.join(APPROXIMATIONS)}",
                           problem="names no known approximation")
    return names


def summary(label: str, results: list[Result]) -> str:
    if not results:
        return f"summary {label}: no rows"
    under = min(results, key=lambda r: r.error)
    over = max(results, key=lambda r: r.error)
    worst_under = f"{under.error:+.1%} ({under.row_id})" if under.error < 0 else "none"
    worst_over = f"{over.error:+.1%} ({over.row_id})" if over.error > 0 else "none"
    return (f"summary {label}: median |error| {statistics.median(abs(r.error) for r in results):.1%}, "
            f"worst under {worst_under}, worst over {worst_over} ({len(results)} rows)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=str(CSV))
    args = ap.parse_args()
    rows = load_rows(Path(args.csv))
    results: list[Result] = []
    skipped = [(r["row_id"], r["skip_reason"]) for r in rows if r.get("skip_reason", "").strip()]
    print(f"{'row':44} {'metric':13} {'published':>9} {'predicted':>9} {'error':>7}  approximations")
    for row in rows:
        if row.get("skip_reason", "").strip():
            continue
        res = compare(row)
        results.append(res)
        print(f"{res.row_id:44} {res.metric:13} {res.published / GIB:9.2f} {res.predicted / GIB:9.2f} "
              f"{res.error:+7.1%}  {res.approximations or '-'}")
    print("(GiB; error = predicted / published - 1)")
    print(summary("headline", results))
    print(summary("no approximations", [r for r in results if not r.approximations]))
    for source in dict.fromkeys(r.source for r in results):
        print(summary(f"[{source}]", [r for r in results if r.source == source]))
    print(f"skipped {len(skipped)} rows:")
    for row_id, reason in skipped:
        print(f"  {row_id}: {reason}")
    return 0 if results and not any(math.isnan(r.error) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

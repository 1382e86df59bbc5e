"""planner/data/published_memory.csv and benchmarks/memory_published.py: every row builds (or says why
not), cites where its figure was read, and is compared with the predicted quantity it measures."""

from __future__ import annotations

import math
import re

import pytest

from benchmarks.memory_published import (
    APPROXIMATIONS,
    METRICS,
    UNITS,
    build,
    compare,
    compared_bytes,
    load_rows,
    model_fields,
    recompute_of,
    target_of,
)
from planner.contracts import MemoryBreakdown
from planner.cost.predict import predict
from planner.errors import AutoparError

ROWS = load_rows()
COMPARED = [r for r in ROWS if not r["skip_reason"].strip()]


def test_rows_from_several_sources():
    assert len(ROWS) >= 20
    assert len({r["source"] for r in ROWS}) >= 3
    assert len({r["row_id"] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r["row_id"] for r in ROWS])
def test_row_cites_its_figure(row):
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/\S+", row["source_ref"])
    assert row["location"].strip() and row["caveats"].strip()
    assert float(row["value"]) > 0 and row["unit"] in UNITS


@pytest.mark.parametrize("row", COMPARED, ids=[r["row_id"] for r in COMPARED])
def test_compared_row_builds_and_predicts(row):
    assert row["metric"] in METRICS
    assert set(filter(None, row["approximations"].split(";"))) <= set(APPROXIMATIONS)
    result = compare(row)
    assert result.predicted > 0 and math.isfinite(result.error)


def test_skipped_rows_state_why():
    skipped = [r for r in ROWS if r["skip_reason"].strip()]
    assert skipped, "the CSV lists figures the planner cannot express"
    assert all(len(r["skip_reason"].split()) >= 4 for r in skipped)


def _breakdown() -> MemoryBreakdown:
    gib = 2**30
    terms = {"loss": 3 * gib, "fragmentation": 5 * gib, "runtime": 1 * gib, "communicators": 2 * gib}
    return MemoryBreakdown(params_bytes=10 * gib, grads_bytes=4 * gib, optimizer_bytes=6 * gib,
                           activations_bytes=7 * gib, buffers_bytes=11 * gib, total_bytes=38 * gib,
                           capacity_bytes=80 * gib, fits=True, terms=terms)


def test_each_metric_is_paired_with_its_quantity():
    m = _breakdown()
    gib = 2**30
    assert m.allocated_bytes == 30 * gib  # 38 less fragmentation, runtime and communicators
    assert compared_bytes("max_allocated", m) == 30 * gib
    assert compared_bytes("max_reserved", m) == 35 * gib  # the allocator's reserve: allocated + fragmentation
    assert compared_bytes("device_used", m) == 38 * gib  # nvidia-smi: everything, context and NCCL included


def test_a_reserved_figure_is_compared_with_the_predicted_reserve():
    row = next(r for r in COMPARED if r["metric"] == "max_reserved")
    case = build(row)
    memory = predict(case.model, case.training, case.profile, case.layout, target=target_of(row)).memory
    predicted = compare(row).predicted
    assert memory.terms["fragmentation"] > 0
    assert predicted == memory.allocated_bytes + memory.terms["fragmentation"]
    assert predicted not in (memory.allocated_bytes, memory.total_bytes)


def test_unknown_metric_is_refused():
    with pytest.raises(AutoparError) as err:
        compared_bytes("peak", _breakdown())
    assert err.value.field == "metric" and "max_reserved" in str(err.value)


def test_recompute_cell_is_read_or_refused():
    assert recompute_of({"recompute": "full"}, pp=2) == {"recompute": "full"}
    per_stage = recompute_of({"recompute": "full:16"}, pp=2)["recompute_per_stage"]
    assert [(s.kind.value, s.num_layers) for s in per_stage] == [("full", 16), ("full", 16)]
    with pytest.raises(AutoparError) as err:
        recompute_of({"row_id": "x", "recompute": "mlp"}, pp=1)
    assert err.value.field == "recompute"


def test_model_fields_fill_nested_moe():
    assert model_fields("num_layers=2;moe.top_k=1;moe.num_experts=16") == {
        "num_layers": 2, "moe": {"top_k": 1, "num_experts": 16}}
    with pytest.raises(AutoparError) as err:
        model_fields("num_layers")
    assert err.value.field == "model_fields"


def test_empty_cell_names_row_and_column():
    row = dict(COMPARED[0], seq_length="")
    with pytest.raises(AutoparError) as err:
        build(row)
    assert err.value.field == "seq_length" and row["row_id"] in str(err.value)

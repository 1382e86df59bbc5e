"""planner/validate.py: parsing of published-runs cells, rows -> prediction cases (with stated
defaults or a reason for skipping), the comparison metric and the error summary.

Rows are written by hand with the header of shared/data/published_runs.csv (copied below), so these
tests do not need /work/shared; one integration test reads the real file and is skipped without it.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from planner import validate as v
from planner.contracts import Precision, Recompute, StageRecompute
from planner.cost.flops import hardware_flops_per_step, model_flops_per_step
from planner.cost.predict import predict
from planner.errors import AutoparError
from planner.validate import COLUMNS

HEADER = ",".join(COLUMNS)

REAL_CSV = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "published_runs.csv"
needs_real_csv = pytest.mark.skipif(not REAL_CSV.is_file(),
                                    reason=f"{REAL_CSV} is not present (shared data not mounted)")

IB_HDR = ("8x NVIDIA Mellanox 200 Gb/s HDR InfiniBand HCAs per node for application traffic (+2 for storage); "
          "3-level fat tree, 850 switches")
ROCE = ("RoCE, 400 Gbps between GPUs; 3-layer Clos: 16 GPUs/rack ToR, 3072-GPU pods full bisection, "
        "1:7 oversubscription at aggregation (24K cluster)")
OPA = "Omni-Path (4 OPA links per node), dedicated NCCL subnet"
IB_50GBYTE = "InfiniBand, fully interconnected ('IB (50 GB/s)')"


def row(**cells: str) -> dict[str, str]:
    """A CSV row as csv.DictReader gives it: every column present, unset ones empty."""
    unknown = set(cells) - set(COLUMNS)
    assert not unknown, f"not a published_runs.csv column: {unknown}"
    return {c: cells.get(c, "") for c in COLUMNS}


def megatron_row(**changes: str) -> dict[str, str]:
    """GPT 22B on one DGX A100 node, TP=8, Megatron-LM 2022 (Korthikanti et al.), iteration time given.

    micro_batch_size, sequence_parallel and activation_recompute are left blank on purpose.
    """
    cells = dict(
        run_id="handmade_22B_tp8", source="Korthikanti et al. 'Reducing Activation Recomputation' (hand-made row)",
        model="GPT 22B", arch_type="dense", num_layers="48", hidden_size="6144", num_attention_heads="64",
        vocab_size="51200", seq_length="2048", gpu_type="A100-SXM4-80GB (NVIDIA Selene, DGX A100)", num_gpus="8",
        gpus_per_node="8", inter_node_interconnect=IB_HDR, precision="mixed precision", global_batch_size_seqs="8",
        tp="8", pp="1", dp="1", iteration_time_s_reported="1.5", tflops_per_gpu_reported="140",
        framework="Megatron-LM", config_completeness="complete",
    )
    cells.update(changes)
    return row(**cells)


def write_csv(path: Path, rows: list[dict[str, str]], header: list[str] = COLUMNS) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    return path


# ---------------------------------------------------------------- cell parsing
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("128K (reported as 128K tokens)", 128_000),
        ("15360 (ramped up from 16)", 15360),
        ("1,920", 1920),
        ("4M tokens", 4_000_000),
        ("1.42", 1.42),
        ("", None),
        (None, None),
        ("not stated", None),
    ],
)
def test_num_reads_the_leading_number(text, expected):
    got = v._num(text)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("gpu_type", "system"),
    [
        ("A100-SXM4-80GB (NVIDIA Selene, DGX A100)", "dgx-a100-80gb"),
        ("A100 80GB", "dgx-a100-80gb"),
        ("A100 40GB", "dgx-a100-40gb"),
        ("H100 96GB HBM2e, 2.4 TB/s, 500W power limit (Meta Grand Teton)", "gt-h100-96gb-500w"),
        ("H100 80GB HBM3, 700W TDP (Grand Teton)", "dgx-h100"),
        ("H100 (DGX-H100)", "dgx-h100"),
        ("H200", "hgx-h200"),
        ("H800", "hgx-h800"),
        ("B200", "dgx-b200"),
        ("TPU v4", None),
    ],
)
def test_system_of_gpu_type(gpu_type, system):
    assert v._system(gpu_type) == system


@pytest.mark.parametrize(
    ("text", "gbit"),
    [
        (IB_HDR, 200),  # 8 HCAs x 200 Gb/s over 8 GPUs
        (ROCE, 400),
        (OPA, 50),  # 4 links x 100 Gb/s over 8 GPUs
        (IB_50GBYTE, 400),  # 50 GB/s = 400 Gb/s
        ("", None),
        ("not stated", None),
    ],
)
def test_nic_gbit_per_gpu_phrasings_of_the_data(text, gbit):
    assert v._nic_gbit_per_gpu(text, 8) == gbit


def test_nic_per_node_figure_is_shared_by_the_node_gpus():
    assert v._nic_gbit_per_gpu(IB_HDR, 4) == 400
    assert v._nic_gbit_per_gpu(OPA, 4) == 100


def test_source_key_is_the_run_id_up_to_the_first_underscore():
    assert v.source_key("korth_22B_full_recompute") == "korth"
    assert v.source_key("torchtitan_a100_llama3_8b_selective_layer") == "torchtitan"
    assert v.source_key("standalone") == "standalone"


# ---------------------------------------------------------------- summary
def test_summarize_by_hand():
    s = v.summarize([0.1, -0.2, 0.3, -0.05, 0.0])
    # |err| sorted: 0, 0.05, 0.1, 0.2, 0.3; p90 = element ceil(0.9 * 5) = 5th
    assert s.rows == 5
    assert s.median_abs_err == pytest.approx(0.1)
    assert s.p90_abs_err == pytest.approx(0.3)
    assert s.max_abs_err == pytest.approx(0.3)
    assert s.mean_abs_err == pytest.approx(0.13)


def test_summarize_ten_errors():
    errors = [(-1) ** i * (i + 1) / 100 for i in range(10)]  # |err| = 0.01 .. 0.10
    s = v.summarize(errors)
    assert s.rows == 10
    assert s.median_abs_err == pytest.approx(0.055)
    assert s.p90_abs_err == pytest.approx(0.09)  # 9th of 10
    assert s.max_abs_err == pytest.approx(0.10)
    assert s.mean_abs_err == pytest.approx(0.055)


def test_summarize_nothing():
    s = v.summarize([])
    assert s.rows == 0
    assert math.isnan(s.median_abs_err) and math.isnan(s.p90_abs_err) and math.isnan(s.max_abs_err)


# ---------------------------------------------------------------- rows -> cases
def test_complete_megatron_row_builds_an_iteration_time_case_with_stated_defaults():
    case = v.build_case(megatron_row())
    assert isinstance(case, v.RowCase), case
    assert case.run_id == "handmade_22B_tp8"
    assert case.source == "handmade"
    # iteration time wins over the TFLOP/s figure the row also gives
    assert case.metric == "iteration_time_s"
    assert case.reported == pytest.approx(1.5)
    assert case.flop_convention == "model"
    assert (case.model.num_layers, case.model.hidden_size, case.model.num_attention_heads) == (48, 6144, 64)
    assert case.model.ffn_kind == "gelu"
    assert case.training.seq_length == 2048 and case.training.global_batch_seqs == 8
    assert case.training.precision is Precision.bf16
    assert case.training.flash_attention is False  # Megatron-LM 2022 had unfused attention
    assert case.profile.name.startswith("dgx-a100-80gb") and case.profile.num_gpus == 8
    assert case.profile.device.name == "A100 80GB"
    assert (case.layout.tp, case.layout.pp, case.layout.dp) == (8, 1, 1)
    assert case.layout.sp is False  # pre-Korthikanti-era default when the row says nothing

    defaults = "\n".join(case.defaults)
    assert f"micro_batch_size={case.layout.micro_batch_size}" in defaults
    assert "the source does not say" in defaults
    assert case.layout.micro_batch_size in (1, 2, 4, 8)
    assert f"recompute={case.layout.recompute.value}" in defaults
    assert "sequence_parallel=off" in defaults
    assert "attention=unfused" in defaults
    assert "unstated architecture details from preset megatron-22b" in defaults


def test_stated_fields_are_used_and_not_listed_as_defaults():
    case = v.build_case(megatron_row(micro_batch_size="4", activation_recompute="selective", sequence_parallel="on"))
    assert isinstance(case, v.RowCase), case
    assert case.layout.micro_batch_size == 4
    assert case.layout.recompute is Recompute.selective
    assert case.layout.sp is True
    defaults = "\n".join(case.defaults)
    assert "micro_batch_size=" not in defaults
    assert "recompute=" not in defaults
    assert "sequence_parallel=" not in defaults


def test_unstated_recompute_is_the_least_that_fits_full_recompute_of_n_layers_included():
    """GPT 22B, TP 8 + SP, seq 4096, 4 sequences a micro-batch on 80 GB: neither no recompute nor
    selective fits, full recompute of all 48 layers does, and so does full recompute of the first N
    for some N < 48 (Megatron's --recompute-method block): the default is the smallest such N."""
    case = v.build_case(megatron_row(seq_length="4096", micro_batch_size="4", sequence_parallel="on"))
    assert isinstance(case, v.RowCase), case
    per = case.layout.recompute_per_stage
    assert per is not None and per[0].kind is Recompute.full
    n = per[0].num_layers
    assert 0 < n < 48
    assert f"recompute=full on {n} layers of each stage (the least that fits in memory)" in case.defaults

    def fits(**rc) -> bool:
        layout = case.layout.model_copy(update={"recompute_per_stage": None, **rc})
        return predict(case.model, case.training, case.profile, layout, target=case.target).memory.fits

    assert not fits(recompute=Recompute.none) and not fits(recompute=Recompute.selective)
    assert fits(recompute_per_stage=[StageRecompute(kind=Recompute.full, num_layers=n)])
    assert not fits(recompute_per_stage=[StageRecompute(kind=Recompute.full, num_layers=n - 1)])


@pytest.mark.parametrize("field", ["num_layers", "hidden_size", "tp"])
def test_row_missing_a_required_field_is_skipped_naming_it(field):
    result = v.build_case(megatron_row(**{field: ""}))
    assert isinstance(result, v.Skipped)
    assert result.run_id == "handmade_22B_tp8" and result.source == "handmade"
    assert field in result.reason and "missing" in result.reason


def test_row_with_unknown_gpu_type_is_skipped_naming_it():
    result = v.build_case(megatron_row(gpu_type="TPU v4"))
    assert isinstance(result, v.Skipped)
    assert "TPU v4" in result.reason


def test_row_whose_degrees_do_not_multiply_to_the_gpu_count_is_skipped():
    result = v.build_case(megatron_row(dp="2"))  # 8 x 1 x 1 x 2 = 16 on 8 GPUs
    assert isinstance(result, v.Skipped)
    assert "tp x pp x cp x dp = 16" in result.reason
    assert "num_gpus=8" in result.reason


def test_row_without_a_global_batch_is_skipped():
    result = v.build_case(megatron_row(global_batch_size_seqs=""))
    assert isinstance(result, v.Skipped)
    assert "global batch" in result.reason


def test_partial_row_is_skipped_by_build_cases():
    complete = megatron_row()
    partial = megatron_row(run_id="handmade_partial", config_completeness="partial",
                           missing_fields="global_batch;micro_batch_size")
    cases, skipped = v.build_cases([complete, partial])
    assert [c.run_id for c in cases] == ["handmade_22B_tp8"]
    assert [s.run_id for s in skipped] == ["handmade_partial"]
    assert "config_completeness=partial" in skipped[0].reason
    assert "micro_batch_size" in skipped[0].reason


def fp8_row(**changes: str) -> dict[str, str]:
    cells = dict(
        run_id="handmade_fp8_1.3b", source="NeMo performance summary (hand-made row)", model="GPT 1.3B",
        arch_type="dense", num_layers="24", hidden_size="2048", num_attention_heads="16", seq_length="2048",
        gpu_type="H100 80GB", num_gpus="8", gpus_per_node="8", precision="FP8 (Transformer Engine)",
        global_batch_size_seqs="64", micro_batch_size="2", tp="1", pp="1", tflops_per_gpu_reported="400",
        tokens_per_sec_per_gpu_reported="20000", framework="NeMo", config_completeness="complete",
    )
    cells.update(changes)
    return row(**cells)


def test_fp8_row_is_compared_on_tokens_per_second_even_with_tflops_given():
    case = v.build_case(fp8_row())
    assert isinstance(case, v.RowCase), case
    assert case.training.precision is Precision.fp8
    assert case.metric == "tokens_per_s_per_gpu"
    assert case.reported == pytest.approx(20000)
    result = v.evaluate(case)
    assert result.predicted == pytest.approx(result.prediction.tokens_per_s_per_gpu)


def test_bf16_row_with_tflops_and_tokens_is_compared_on_tflops():
    case = v.build_case(fp8_row(precision="BF16"))
    assert isinstance(case, v.RowCase), case
    assert case.metric == "tflops_per_gpu"
    assert case.reported == pytest.approx(400)


SC21_CONVENTION = ("F = 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) per iteration (GEMMs only, lower bound); INCLUDES the "
                   "recompute forward pass (hardware-FLOP style); % of 312 TFLOP/s")


def test_tflops_only_row_that_counts_the_recompute_uses_the_hardware_convention():
    r = megatron_row(iteration_time_s_reported="", activation_recompute="full", micro_batch_size="1",
                     flop_convention=SC21_CONVENTION)
    case = v.build_case(r)
    assert isinstance(case, v.RowCase), case
    assert case.metric == "tflops_per_gpu"
    assert case.flop_convention == "hardware"
    assert case.reported == pytest.approx(140)

    result = v.evaluate(case)
    step, n = result.prediction.step_time_s, case.profile.num_gpus
    hw = hardware_flops_per_step(case.model, 8, 2048, Recompute.full) / step / n / 1e12
    model = model_flops_per_step(case.model, 8, 2048) / step / n / 1e12
    assert result.predicted == pytest.approx(hw)
    assert result.predicted > model  # the recompute forward is counted


def test_tflops_row_with_a_model_flop_convention():
    r = megatron_row(iteration_time_s_reported="", activation_recompute="full", micro_batch_size="1",
                     flop_convention="MFU per PaLM definition")
    case = v.build_case(r)
    assert isinstance(case, v.RowCase), case
    assert case.metric == "tflops_per_gpu" and case.flop_convention == "model"


def test_mfu_row_reads_percent():
    r = megatron_row(iteration_time_s_reported="", tflops_per_gpu_reported="", mfu_pct_reported="45.3")
    case = v.build_case(r)
    assert isinstance(case, v.RowCase), case
    assert case.metric == "mfu"
    assert case.reported == pytest.approx(0.453)
    result = v.evaluate(case)
    assert result.predicted == pytest.approx(result.prediction.mfu)


def test_row_without_any_throughput_figure_is_skipped():
    r = megatron_row(iteration_time_s_reported="", tflops_per_gpu_reported="")
    result = v.build_case(r)
    assert isinstance(result, v.Skipped)
    assert "no throughput figure" in result.reason


# ---------------------------------------------------------------- evaluate
def test_evaluate_error_is_predicted_over_reported_minus_one():
    case = v.build_case(megatron_row(micro_batch_size="4", activation_recompute="none"))
    assert isinstance(case, v.RowCase), case
    first = v.evaluate(case)
    assert first.predicted == pytest.approx(first.prediction.step_time_s)
    assert first.error == pytest.approx(first.predicted / 1.5 - 1)

    case.reported = first.predicted
    assert v.evaluate(case).error == pytest.approx(0.0, abs=1e-12)
    case.reported = first.predicted / 2
    assert v.evaluate(case).error == pytest.approx(1.0)
    case.reported = first.predicted * 2
    assert v.evaluate(case).error == pytest.approx(-0.5)


def test_evaluate_on_another_profile():
    case = v.build_case(megatron_row(micro_batch_size="4", activation_recompute="none"))
    assert isinstance(case, v.RowCase), case
    slower = case.profile.model_copy(deep=True)
    slower.assumptions.matmul_efficiency = case.profile.assumptions.matmul_efficiency / 2
    assert v.evaluate(case, slower).predicted > v.evaluate(case).predicted


# ---------------------------------------------------------------- load_rows
def test_load_rows_reads_a_csv(tmp_path):
    path = write_csv(tmp_path / "runs.csv", [megatron_row(), fp8_row()])
    rows = v.load_rows(path)
    assert [r["run_id"] for r in rows] == ["handmade_22B_tp8", "handmade_fp8_1.3b"]
    assert rows[0]["tp"] == "8" and tuple(rows[0]) == COLUMNS


def test_load_rows_missing_file(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(AutoparError) as err:
        v.load_rows(missing)
    assert str(missing) in str(err.value) and "does not exist" in str(err.value)


def test_load_rows_without_run_id_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("name,num_layers\nx,2\n")
    with pytest.raises(AutoparError) as err:
        v.load_rows(path)
    assert "run_id" in str(err.value)


def test_load_rows_empty_file(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    with pytest.raises(AutoparError, match="run_id"):
        v.load_rows(path)


# ---------------------------------------------------------------- the real data
KORTH = [f"korth_{size}_{kind}" for size in ("22B", "175B", "530B", "1T")
         for kind in ("full_recompute", "present_work")]


@needs_real_csv
def test_published_runs_csv():
    header = REAL_CSV.read_text().splitlines()[0]
    first_release = ",".join(COLUMNS[: len(COLUMNS) - len(v.ADDED_COLUMNS)])  # the shared copy predates etp
    assert header in (HEADER, first_release), "planner.validate.COLUMNS no longer matches published_runs.csv"

    rows = v.load_rows(REAL_CSV)
    cases, skipped = v.build_cases(rows)
    assert len(cases) + len(skipped) == len(rows)
    assert len(cases) >= 50
    assert all(s.reason.strip() for s in skipped)
    reasons = {s.run_id: s.reason for s in skipped}
    assert "korth_530B_full_recompute_dp8" in reasons
    assert "config_completeness=partial" in reasons["korth_530B_full_recompute_dp8"]
    assert "llama3_405b_16384gpu_cp16" in reasons
    assert "num_gpus=16384" in reasons["llama3_405b_16384gpu_cp16"]

    by_id = {c.run_id: c for c in cases}
    errors = {}
    for run_id in KORTH:
        case = by_id[run_id]
        assert case.metric == "iteration_time_s"
        errors[run_id] = v.evaluate(case).error
    bad = {k: f"{e:+.1%}" for k, e in errors.items() if abs(e) > 0.15}
    assert not bad, f"Korthikanti iteration times off by more than 15%: {bad}"


@needs_real_csv
def test_every_number_of_the_real_data_reads_as_a_number():
    """The stricter reader refuses no cell of published_runs.csv: its rows are skipped only for the
    reasons they always were (a partial configuration, degrees that do not multiply to the GPUs)."""
    cases, skipped = v.build_cases(v.load_rows(REAL_CSV))
    for s in skipped:
        assert s.reason.startswith(("config_completeness=", "tp x pp x cp x dp = ")), s
    for row in v.load_rows(REAL_CSV):
        v._numbers(row)  # raises CellError on a cell it cannot read


def test_row_network_description_sets_the_profile_nic():
    case = v.build_case(megatron_row(num_gpus="16", dp="2", global_batch_size_seqs="16", inter_node_interconnect=OPA))
    assert isinstance(case, v.RowCase), case
    assert case.profile.num_nodes == 2
    inter = [link for link in case.profile.links if link.level.value == "inter_node"]
    assert inter and all(link.busbw_bytes_per_s == pytest.approx(50 / 8 * 0.95 * 1e9) for link in inter)


# ---------------------------------------------------------------- bad cells: skipped with a one-line reason
@pytest.mark.parametrize(
    ("changes", "named", "problem"),
    [
        # a figure of 0 divided the predicted value (ZeroDivisionError); a word read as None (TypeError)
        (dict(iteration_time_s_reported="", tflops_per_gpu_reported="0"), "tflops_per_gpu_reported='0'",
         "is not a positive number"),
        (dict(iteration_time_s_reported="", tflops_per_gpu_reported="", mfu_pct_reported="0"), "mfu_pct_reported='0'",
         "is not a positive number"),
        (dict(iteration_time_s_reported="0"), "iteration_time_s_reported='0'", "is not a positive number"),
        (dict(iteration_time_s_reported="", tflops_per_gpu_reported="abc"), "tflops_per_gpu_reported='abc'",
         "is not a number"),
        (dict(iteration_time_s_reported="", tflops_per_gpu_reported="nan"), "tflops_per_gpu_reported='nan'",
         "is not a number"),
        (dict(iteration_time_s_reported="fast"), "iteration_time_s_reported='fast'", "is not a number"),
        (dict(iteration_time_s_reported="", tflops_per_gpu_reported="", mfu_pct_reported="150"),
         "mfu_pct_reported='150'", "is more than 100"),
        # signs were dropped and fractions truncated
        (dict(iteration_time_s_reported="", tflops_per_gpu_reported="-408.8"), "tflops_per_gpu_reported='-408.8'",
         "is not a positive number"),
        (dict(num_layers="-24"), "num_layers='-24'", "is not a positive number"),
        (dict(global_batch_size_seqs="-192"), "global_batch_size_seqs='-192'", "is not a positive number"),
        (dict(tp="1.5"), "tp='1.5'", "is not a whole number"),
        (dict(num_gpus="8.9"), "num_gpus='8.9'", "is not a whole number"),
        (dict(pp="2", num_gpus="16", virtual_pipeline_stages="-2"), "virtual_pipeline_stages='-2'",
         "is not a positive number"),
        (dict(num_gpus="1e300"), "num_gpus='1e300'", "is more than"),
        # a 0 was taken for "not stated"
        (dict(micro_batch_size="0"), "micro_batch_size='0'", "is not a positive number"),
        (dict(dp="0"), "dp='0'", "is not a positive number"),
        (dict(global_batch_size_seqs="0"), "global_batch_size_seqs='0'", "is not a positive number"),
        (dict(global_batch_size_seqs="", global_batch_tokens="100"), "global_batch_tokens='100'",
         "is less than one sequence"),
        # an unknown format was read as bf16
        (dict(precision="fp64"), "precision='fp64'", "names no numeric format"),
        (dict(moe_num_experts="8"), "moe_num_experts='8'",
         "makes the model MoE but moe_top_k and moe_expert_ffn_hidden_size are blank"),
    ],
)
def test_a_bad_cell_skips_the_row_naming_the_column_and_the_value(changes, named, problem):
    result = v.build_case(megatron_row(**changes))
    assert isinstance(result, v.Skipped), result
    assert result.run_id == "handmade_22B_tp8"
    assert result.reason.startswith(f"{named} {problem}"), result.reason
    assert "\n" not in result.reason and "; " in result.reason  # one line, with the fix after the problem


def test_numbers_are_read_with_their_sign_exponent_and_unit():
    case = v.build_case(megatron_row(num_layers="4.8e1", hidden_size="6,144", iteration_time_s_reported="",
                                     tflops_per_gpu_reported="1.4e2", global_batch_size_seqs="~8"))
    assert isinstance(case, v.RowCase), case
    assert case.model.num_layers == 48 and case.model.hidden_size == 6144
    assert case.training.global_batch_size == 8
    assert case.metric == "tflops_per_gpu" and case.reported == pytest.approx(140)  # the old reader gave 2.0


def test_a_cell_that_says_not_stated_is_blank():
    case = v.build_case(megatron_row(precision="not stated", micro_batch_size="n/a", dp="unknown"))
    assert isinstance(case, v.RowCase), case
    assert "precision=bf16" in case.defaults
    assert any(d.startswith("micro_batch_size=") for d in case.defaults)
    result = v.build_case(megatron_row(num_layers="not stated"))
    assert isinstance(result, v.Skipped) and result.reason == "missing num_layers"


def test_a_model_the_contract_refuses_is_skipped_with_a_one_line_reason():
    """pydantic's multi-line message with its help URL was the reason."""
    result = v.build_case(megatron_row(num_layers="5000"))
    assert isinstance(result, v.Skipped)
    assert result.reason.startswith("model not buildable: ModelSpec: num_layers=5000: ")
    assert "\n" not in result.reason and "errors.pydantic.dev" not in result.reason
    result = v.build_case(megatron_row(moe_num_experts="8", moe_top_k="16", moe_expert_ffn_hidden_size="1024"))
    assert isinstance(result, v.Skipped)
    assert "top_k=16 exceeds moe.num_experts=8" in result.reason
    assert "\n" not in result.reason and "errors.pydantic.dev" not in result.reason


def test_a_row_whose_cells_do_not_line_up_with_the_header_is_skipped(tmp_path):
    path = tmp_path / "ragged.csv"
    good = ",".join(megatron_row()[c] if "," not in megatron_row()[c] else f'"{megatron_row()[c]}"' for c in COLUMNS)
    path.write_text(f"{HEADER}\n{good}\nshort_row,x,y\n{good.replace('handmade_22B_tp8', 'long_row', 1)},extra\n")
    cases, skipped = v.build_cases(v.load_rows(path))
    assert [c.run_id for c in cases] == ["handmade_22B_tp8"]
    reasons = {s.run_id: s.reason for s in skipped}
    assert reasons["short_row"].startswith(f"row has 3 cells but the header has {len(COLUMNS)} columns")
    assert reasons["long_row"].startswith(f"row has {len(COLUMNS) + 1} cells but the header has {len(COLUMNS)} columns")


# ---------------------------------------------------------------- bad files: AutoparError naming FILE
def test_load_rows_binary_file(tmp_path):
    path = tmp_path / "bin.csv"
    path.write_bytes(b"\x80\x81\xff\xfe")
    with pytest.raises(AutoparError) as err:
        v.load_rows(path)
    assert err.value.field == "FILE"
    assert str(err.value).startswith(f"FILE={str(path)!r} is not UTF-8 text")


def test_load_rows_reads_a_csv_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbfrun_id,x\n1,2\n")
    assert v.load_rows(path) == [{"run_id": "1", "x": "2"}]


def test_load_rows_cell_longer_than_the_csv_field_limit(tmp_path):
    path = write_csv(tmp_path / "big.csv", [megatron_row(notes="x" * 200_000)])
    with pytest.raises(AutoparError) as err:
        v.load_rows(path)
    assert err.value.field == "FILE" and "has a cell longer than" in str(err.value) and "line 2" in str(err.value)


def test_load_rows_unclosed_quote(tmp_path):
    path = tmp_path / "quote.csv"
    path.write_text('run_id,x\nok,1\n"broken,2\nlost,3\n')
    with pytest.raises(AutoparError) as err:
        v.load_rows(path)
    assert err.value.field == "FILE" and "is not valid CSV in the row starting on line 3" in str(err.value)


def test_load_rows_folder_and_device(tmp_path):
    with pytest.raises(AutoparError) as err:
        v.load_rows(tmp_path)
    assert "is a folder" in str(err.value)
    if Path("/dev/null").exists():
        with pytest.raises(AutoparError) as err:
            v.load_rows("/dev/null")
        assert "FILE='/dev/null' has no run_id column" in str(err.value)  # read (empty), as a pipe would be


# ---------------------------------------------------------------- the command (real entry point)
def _autopar(*args: str, cwd: Path) -> tuple[int, str, str]:
    import os
    import subprocess
    import sys

    script = Path(sys.executable).with_name("autopar")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "planner.cli"]
    proc = subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_bad_files_are_errors_not_tracebacks(tmp_path):
    (tmp_path / "bin.csv").write_bytes(b"\x80\x81\xff\xfe")
    write_csv(tmp_path / "big.csv", [megatron_row(notes="x" * 200_000)])
    (tmp_path / "adir").mkdir()
    for name, problem in [("bin.csv", "FILE='bin.csv' is not UTF-8 text"), ("big.csv", "has a cell longer than"),
                          ("adir", "FILE='adir' is a folder")]:
        rc, out, err = _autopar("validate", name, cwd=tmp_path)
        assert rc == 2 and "Traceback" not in out + err, (name, rc, out, err)
        assert err.startswith("error: ") and problem in " ".join(err.split()), err


def test_cli_bad_cells_skip_the_row_and_json_stays_json(tmp_path):
    path = write_csv(tmp_path / "runs.csv", [megatron_row(iteration_time_s_reported="", tflops_per_gpu_reported="0")])
    rc, out, err = _autopar("validate", str(path), "--json", cwd=tmp_path)
    assert rc == 0, err
    data = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert data["rows"] == []
    assert data["skipped"][0]["reason"].startswith("tflops_per_gpu_reported='0' is not a positive number")
    assert data["summary"] == {"rows": 0, "median_abs_err": None, "p90_abs_err": None, "max_abs_err": None,
                               "mean_abs_err": None}


# ---------------------------------------------------------------- the planner's own published-runs set
PREFIXES = {"mosaic", "torchtitan", "mlperf", "mbridge", "nemo2407", "nemolongseq", "mlmexllama", "sc21", "korth",
            "mlm", "llama3", "bloom", "mtnlg", "deepseek"}


def test_packaged_published_runs_reads_and_groups_by_its_fourteen_sources():
    """planner/data/published_runs.csv: the header is COLUMNS, every number reads, and each run-id prefix
    of published_runs_SOURCES.md is one source (nemolongseq: FP8 with TFLOP/s only, so never judged)."""
    assert v.PUBLISHED_RUNS.read_text().splitlines()[0] == HEADER
    rows = v.load_rows(v.PUBLISHED_RUNS)
    for r in rows:
        v._numbers(r)  # raises CellError on a cell it cannot read
    assert {v.source_key(r["run_id"]) for r in rows} == PREFIXES
    cases, skipped = v.build_cases(rows)
    assert len(cases) + len(skipped) == len(rows) and len(cases) >= 350
    assert {c.source for c in cases} == PREFIXES - {"nemolongseq"}
    assert all(c.source == v.source_key(c.run_id) for c in cases)


QWEN3_235B = ("mbridge_26.04.01_dgx-h100_qwen3_235b_a22b_256gpu_fp8",
              "mbridge_25.11_dgx-h100_qwen3_235b_a22b_256gpu_fp8-cs")


def test_packaged_qwen3_235b_h100_rows_are_judged_with_the_etp_their_source_states():
    """TP 2, PP 8, EP 32 on 256 H100: EP 32 folds over the DP 16 x TP 2 ranks only with ETP 1 (the
    Megatron-Bridge configs' expert_tensor_parallel_size, the rows' etp cell); without the cell the same
    etp=1 is the stated default, and a cell saying 2 makes the row unjudgeable (the fold fails)."""
    rows = {r["run_id"]: r for r in v.load_rows(v.PUBLISHED_RUNS)}
    for run_id in QWEN3_235B:
        r = rows[run_id]
        assert r["etp"] == "1" and "expert_tensor_parallel_size" in r["notes"]
        case = v.build_case(r)
        assert isinstance(case, v.RowCase), case
        assert (case.layout.tp, case.layout.ep, case.layout.etp, case.layout.expert_dp) == (2, 32, 1, 1)
        assert not any(d.startswith("etp=") for d in case.defaults)
        assert 0.5 < v.evaluate(case).predicted / case.reported < 2.0
        unstated = v.build_case({**r, "etp": ""})
        assert unstated.layout == case.layout and "etp=1" in " ".join(unstated.defaults)
        refused = v.build_case({**r, "etp": "2"})
        assert isinstance(refused, v.Skipped) and "ep=32 x etp=2 must divide" in refused.reason


def test_unstated_etp_stays_tp_where_the_experts_fold_without_it():
    """A Megatron-Core row whose ep divides dp x cp keeps the experts split over tp (Megatron's default);
    a row of another framework gets no etp default; an old-format CSV without the column reads as unstated."""
    mixtral = dict(model="Mixtral 8x7B", arch_type="MoE", num_layers="32", hidden_size="4096", num_attention_heads="32",
                   num_kv_heads="8", ffn_hidden_size="14336", vocab_size="32000", moe_num_experts="8", moe_top_k="2",
                   moe_expert_ffn_hidden_size="14336",
                   gpu_type="H100 (DGX-H100)", num_gpus="64", gpus_per_node="8", seq_length="4096",
                   global_batch_size_seqs="256", micro_batch_size="1", tp="2", pp="1", cp="1",
                   tokens_per_sec_per_gpu_reported="3000", config_completeness="complete")
    ok = v.build_case(row(run_id="m_a", framework="NeMo / Megatron-Bridge + Megatron-Core", ep="8", **mixtral))
    assert isinstance(ok, v.RowCase) and ok.layout.etp is None and ok.layout.expert_tp == 2
    folded = row(run_id="m_b", framework="NeMo / Megatron-Bridge + Megatron-Core", **{**mixtral, "tp": "4"}, ep="8")
    case = v.build_case(folded)  # dp = 16: ep 8 divides it: no default needed
    assert isinstance(case, v.RowCase) and case.layout.etp is None
    other = v.build_case(row(run_id="m_c", framework="torchtitan", ep="8", **{**mixtral, "num_gpus": "8", "tp": "2",
                                                                              "global_batch_size_seqs": "64"}))
    assert isinstance(other, v.Skipped) and "ep=8 x etp=2" in other.reason  # 4 dp x 2 tp ranks: no default
    old = {k: val for k, val in folded.items() if k != "etp"}
    assert v.build_case(old).layout == case.layout


def test_cli_validate_reads_the_packaged_csv_when_no_file_is_given(tmp_path):
    rc, out, err = _autopar("validate", "--json", cwd=tmp_path)
    assert rc == 0, err
    data = json.loads(out)
    cases, skipped = v.build_cases(v.load_rows(v.PUBLISHED_RUNS))
    assert {r["run_id"] for r in data["rows"]} == {c.run_id for c in cases}
    assert len(data["skipped"]) == len(skipped)


def _two_source_rows(held_out_seconds: str) -> list[dict[str, str]]:
    """Three hand-made A100 rows of source 'a' and one of source 'b' whose reported time is given."""
    rows = [megatron_row(run_id=f"a_{i}", global_batch_size_seqs=str(8 * 2**i), micro_batch_size="1",
                         iteration_time_s_reported=str(1.5 * 2**i * 1.6)) for i in range(3)]
    return rows + [megatron_row(run_id="b_0", micro_batch_size="1", iteration_time_s_reported=held_out_seconds)]


def test_a_held_out_source_does_not_move_its_own_prediction_but_moves_the_in_sample_fit():
    """Leave-one-source-out: source b's prediction (error x reported) is the same whatever b reports; the
    in-sample fit sees b's figure, so its prediction of b changes with it."""
    from planner import calibrate

    def predicted(rows, errors):
        return (1 + errors["b"][0]) * float(rows[-1]["iteration_time_s_reported"])

    # b repeats a_0's configuration (reported 2.4 s, an efficiency inside the fitted bounds); both of b's
    # figures stay inside the objective's cap, so the in-sample fit sees them
    near, far = _two_source_rows("2.4"), _two_source_rows("2.8")
    loso_near = predicted(near, calibrate.leave_one_source_out(near, rounds=1, tol=1e-2))
    loso_far = predicted(far, calibrate.leave_one_source_out(far, rounds=1, tol=1e-2))
    assert loso_near == pytest.approx(loso_far, rel=1e-9)
    fit_near = predicted(near, calibrate.in_sample(near, rounds=1, tol=1e-2)[1])
    fit_far = predicted(far, calibrate.in_sample(far, rounds=1, tol=1e-2)[1])
    assert fit_far > fit_near * 1.005


@pytest.mark.parametrize(("gpu_type", "stated"), [("H100", "dgx-h100"), ("H100 (variant not stated)", "dgx-h100"),
                                                  ("A100", "dgx-a100-80gb"), ("H100 SXM5 80GB", None),
                                                  ("A100-SXM4-80GB", None)])
def test_an_unstated_gpu_part_is_a_stated_default(gpu_type, stated):
    case = v.build_case(megatron_row(gpu_type=gpu_type, micro_batch_size="1", activation_recompute="none"))
    assert isinstance(case, v.RowCase), case
    named = [d for d in case.defaults if d.startswith("gpu=")]
    assert named == ([f"gpu={stated} (the cell names no memory size, form factor or system)"] if stated else [])


def test_a_head_size_stated_in_arch_type_is_used():
    """Qwen3-235B: hidden 4096 over 64 heads would be 64 per head; the row states head_dim 128."""
    case = v.build_case(megatron_row(arch_type="dense (GQA, head_dim 128)", micro_batch_size="1",
                                     activation_recompute="none"))
    assert isinstance(case, v.RowCase), case
    assert case.model.head_dim == 128
    assert v.build_case(megatron_row(micro_batch_size="1", activation_recompute="none")).model.head_dim is None

"""planner/cli.py: the ``autopar`` commands.

Success paths run the typer app in-process (typer.testing.CliRunner). Error paths run the real
console entry point in a subprocess, because turning AutoparError / ValidationError / usage errors
into a message and exit code 2 happens in ``main()``, outside the typer app.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner import cli
from planner.contracts import CONTRACTS, Plan
from planner.presets import PRESETS
from planner.reference import SYSTEMS
from planner.validate import COLUMNS

REPO = Path(__file__).resolve().parents[1]
CONTRACT_NAMES = {"ModelSpec", "TrainingConfig", "ClusterProfile", "Plan", "Prediction", "TrainingGoal", "RunReport"}

HEADER = ",".join(COLUMNS)

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables as wide as in piped output, whatever terminal pytest runs in."""
    monkeypatch.setattr(cli.console, "width", 200)


def invoke(*args: str):
    result = runner.invoke(cli.app, list(args))
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}\n{result.exception!r}"
    return result


def flat(text: str) -> str:
    """Whitespace collapsed, so checks do not depend on where a long line wrapped."""
    return " ".join(text.split())


# ---------------------------------------------------------------- success paths (in-process)
def test_predict_prints_the_prediction_table():
    out = invoke("predict", "--model", "llama3-8b", "--global-batch", "8", "--seq", "2048").output
    assert "step time" in out
    assert "MFU" in out
    assert "Peak memory per GPU" in out
    assert "dgx-h100" in out  # the default reference cluster


def test_predict_json_is_a_plan():
    out = invoke("predict", "--model", "megatron-22b", "--cluster", "dgx-a100-80gb", "--global-batch", "16",
                 "--seq", "2048", "--tp", "8", "--micro-batch", "4", "--sp", "--recompute", "selective",
                 "--json").stdout
    plan = Plan.model_validate_json(out)
    assert plan.cluster == "dgx-a100-80gb" and plan.num_gpus == 8
    assert plan.model.name == "megatron-22b"
    assert (plan.layout.tp, plan.layout.sp, plan.layout.dp, plan.layout.micro_batch_size) == (8, True, 1, 4)
    assert plan.layout.recompute.value == "selective"
    assert plan.training.global_batch_seqs == 16 and plan.training.seq_length == 2048
    assert plan.prediction.step_time_s > 0 and 0 < plan.prediction.mfu < 1


def test_predict_compile_prices_torchtitans_compiled_loss():
    def loss(*extra: str) -> int:
        out = invoke("predict", "--model", "llama3-8b", "--global-batch", "64", "--seq", "4096", "--zero", "3",
                     "--target", "torchtitan", "--json", *extra).stdout
        plan = Plan.model_validate_json(out)
        assert plan.layout.compile is bool(extra)
        return plan.prediction.memory.terms["loss"]

    assert loss() - loss("--compile") == 8 * 4096 * 128256  # 12 -> 4 bytes per logit


def test_predict_with_a_model_file_and_nodes(tmp_path):
    spec = PRESETS["llama3-8b"].model_dump_json()
    path = tmp_path / "model.json"
    path.write_text(spec)
    out = invoke("predict", "--model-file", str(path), "--nodes", "2", "--global-batch", "32", "--seq", "2048",
                 "--tp", "2", "--json").stdout
    plan = Plan.model_validate_json(out)
    assert plan.num_gpus == 16 and plan.layout.dp == 8


def test_schema_prints_every_contract():
    schemas = json.loads(invoke("schema").stdout)
    assert set(schemas) == CONTRACT_NAMES == set(CONTRACTS)
    for name, schema in schemas.items():
        assert schema["title"] == name
        assert "properties" in schema


def test_schema_out_writes_one_file_per_contract(tmp_path):
    out_dir = tmp_path / "schemas"
    invoke("schema", "--out", str(out_dir))
    files = sorted(p.name for p in out_dir.iterdir())
    assert files == sorted(f"{name}.schema.json" for name in CONTRACT_NAMES)
    for name in CONTRACT_NAMES:
        assert json.loads((out_dir / f"{name}.schema.json").read_text())["title"] == name


def test_presets_lists_the_presets():
    out = invoke("presets").output
    for name in PRESETS:
        assert name in out
    assert "megatron-22b" in out and "llama3.1-405b" in out


def test_clusters_lists_the_reference_systems():
    out = invoke("clusters").output
    for name in SYSTEMS:
        assert name in out
    assert "989 TFLOP/s" in out and "312 TFLOP/s" in out
    assert "nvidia-h200-1x1" in out and "747 TFLOP/s" in out  # the measured H200 (planner/data/measured)


def test_a_shipped_measured_profile_is_a_cluster_name():
    out = flat(invoke("plan", "--model", "llama3-8b", "--cluster", "nvidia-h200-1x1", "--global-batch", "8",
                      "--seq", "4096").output)
    assert "nvidia-h200-1x1" in out and "(1 GPUs)" in out
    message = assert_usage_error(autopar("plan", "--model", "llama3-8b", "--cluster", "nvidia-h200-1x1", "--nodes",
                                         "2", "--global-batch", "8"), "--nodes=2", "cannot change a measured profile")
    assert "1 nodes" in message


def _row(**cells: str) -> dict[str, str]:
    return {c: cells.get(c, "") for c in COLUMNS}


def small_runs_csv(tmp_path: Path) -> Path:
    common = dict(
        source="Korthikanti et al. (hand-made row)", model="GPT 22B", arch_type="dense", num_layers="48",
        hidden_size="6144", num_attention_heads="64", vocab_size="51200", seq_length="2048",
        gpu_type="A100-SXM4-80GB", num_gpus="8", gpus_per_node="8", precision="mixed precision",
        global_batch_size_seqs="4", micro_batch_size="4", tp="8", pp="1", dp="1", sequence_parallel="off",
        framework="Megatron-LM", config_completeness="complete",
    )
    rows = [
        _row(run_id="hand_22B_full", activation_recompute="full", iteration_time_s_reported="1.42", **common),
        _row(run_id="hand_22B_selective", activation_recompute="selective", iteration_time_s_reported="1.10",
             **common),
        _row(run_id="hand_tpu", **{**common, "gpu_type": "TPU v4"}, iteration_time_s_reported="1.0"),
    ]
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_validate_summarises_and_lists_skipped_rows(tmp_path):
    out = invoke("validate", str(small_runs_csv(tmp_path))).output
    summary = [line for line in out.splitlines() if line.startswith("rows=")]
    assert len(summary) == 1, out
    line = summary[0]
    assert line.startswith("rows=2 ")
    for key in ("median_abs_err=", "p90_abs_err=", "max_abs_err="):
        assert key in line
    assert "hand_22B_full" in out and "hand_22B_selective" in out
    assert "Rows not judged" in out
    assert "hand_tpu: no reference profile for gpu_type 'TPU v4'" in flat(out)


def test_validate_json(tmp_path):
    data = json.loads(invoke("validate", str(small_runs_csv(tmp_path)), "--json").stdout)
    assert [r["run_id"] for r in data["rows"]] == ["hand_22B_full", "hand_22B_selective"]
    for r in data["rows"]:
        assert r["metric"] == "iteration_time_s"
        assert r["error"] == pytest.approx(r["predicted"] / r["reported"] - 1)
    assert data["skipped"] == [{"run_id": "hand_tpu", "source": "hand",
                                "reason": "no reference profile for gpu_type 'TPU v4'"}]
    assert data["summary"]["rows"] == 2


# ---------------------------------------------------------------- error paths (real entry point)
def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("autopar")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "planner.cli"]


def autopar(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_console_script(), *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def assert_usage_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    both = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    assert "Traceback" not in both, both
    message = flat(proc.stderr)
    for needle in needles:
        assert needle in message, f"{needle!r} not in error message: {message}"
    return message


BASE = ("predict", "--model", "llama3-8b", "--global-batch", "8")


def test_outputs_that_cannot_be_written_are_refused_before_the_work(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    plan = ("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "64")
    assert_usage_error(autopar(*plan, "--out", str(tmp_path)), f"--out='{tmp_path}' is a folder",
                       f"e.g. {tmp_path / 'plan.json'}")
    assert_usage_error(autopar(*plan, "--out", str(afile / "p.json")), "cannot be written", "afile is a file")
    assert_usage_error(autopar("schema", "--out", str(afile)), f"--out='{afile}' is a file",
                       "give a folder (it is made if missing)")
    saved = tmp_path / "p.json"
    assert autopar(*plan, "--out", str(saved)).returncode == 0
    assert_usage_error(autopar("export", str(saved), "--to", "megatron", "--out-dir", str(afile / "x")),
                       "--out-dir=", "cannot be written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "p.json"]  # nothing made, no probe left


def test_unknown_preset_lists_known_presets():
    message = assert_usage_error(autopar("predict", "--model", "llama9", "--global-batch", "8"), "llama9",
                                 "is not known")
    for name in ("llama3-8b", "megatron-22b", "deepseek-v3"):
        assert name in message


def test_tp_that_does_not_divide_the_gpus():
    assert_usage_error(autopar(*BASE, "--tp", "3"), "tp x pp x cp=3", "8 GPUs")


def test_global_batch_not_divisible():
    assert_usage_error(autopar("predict", "--model", "llama3-8b", "--global-batch", "7"), "global_batch_size=7",
                       "micro_batch_size")


def test_unreadable_model_file(tmp_path):
    missing = tmp_path / "nope.json"
    assert_usage_error(autopar("predict", "--model-file", str(missing), "--global-batch", "8"), "--model-file",
                       str(missing), "does not exist")


def test_model_file_with_heads_not_dividing_hidden(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "bad", "num_layers": 2, "hidden_size": 100, "num_attention_heads": 3,
                                "ffn_hidden_size": 400, "vocab_size": 1000}))
    assert_usage_error(autopar("predict", "--model-file", str(path), "--global-batch", "8"), "ModelSpec",
                       "num_attention_heads=3", "hidden_size=100")


def test_model_file_that_is_not_json(tmp_path):
    path = tmp_path / "notjson.json"
    path.write_text("{this is not json")
    assert_usage_error(autopar("predict", "--model-file", str(path), "--global-batch", "8"), "ModelSpec")


def test_zero_sequence_length():
    assert_usage_error(autopar(*BASE, "--seq", "0"), "--seq", "greater than or equal to 1")


def test_unknown_cluster_lists_known_clusters():
    message = assert_usage_error(autopar(*BASE, "--cluster", "tpu-v4"), "cluster='tpu-v4'", "is not known")
    for name in [*SYSTEMS, "nvidia-h200-1x1"]:
        assert name in message


def test_unknown_schedule_value():
    assert_usage_error(autopar(*BASE, "--schedule", "pipedream"), "--schedule", "pipedream", "1f1b",
                       "interleaved_1f1b")


FAIL_CASES = [
    pytest.param(("predict", "--model", "llama3-8b"), "--global-batch", id="no-global-batch"),
    pytest.param(("predict", "--global-batch", "8"), "exactly one of --model", id="no-model"),
]


@pytest.mark.parametrize(("args", "needle"), FAIL_CASES)
def test_cli_fail_message_in_process(args, needle):
    """``fail()`` prints the message and raises typer.Exit(2); in standalone mode that is exit 2."""
    result = runner.invoke(cli.app, list(args))
    assert result.exit_code == 2
    assert needle in flat(result.output)


@pytest.mark.parametrize(("args", "needle"), FAIL_CASES)
def test_cli_fail_exits_2_from_the_console_script(args, needle):
    assert_usage_error(autopar(*args), needle)


def test_validate_missing_file(tmp_path):
    missing = tmp_path / "runs.csv"
    assert_usage_error(autopar("validate", str(missing)), str(missing), "does not exist")


def test_console_script_success_exits_zero():
    proc = autopar(*BASE, "--json")
    assert proc.returncode == 0, proc.stderr
    assert Plan.model_validate_json(proc.stdout).num_gpus == 8


@pytest.mark.parametrize("path, value, said", [
    (("compute", "achieved_memory_bandwidth_bytes_per_s"), -1,
     "achieved_memory_bandwidth_bytes_per_s=-1: Input should be greater than 0"),
    (("compute", "achieved_matmul_tflops"), {"bf16": -5},
     "achieved_matmul_tflops.bf16=-5: Input should be greater than 0"),
    (("device", "peak_tflops"), {"bf16": 1e400}, "peak_tflops.bf16=inf: Input should be a finite number"),
    (("assumptions", "kernel_overhead_s"), 1e400, "kernel_overhead_s=inf: Input should be a finite number"),
])
def test_a_profile_with_infinite_or_negative_figures_is_refused(tmp_path, path, value, said):
    """An edited profile whose rates are negative or infinite gave negative or infinite step times and
    MFU above 100%; every contract now refuses inf and NaN (allow_inf_nan=False), rates must be > 0."""
    from planner.reference import reference_profile

    body = json.loads(reference_profile("dgx-h100", 1).model_dump_json())
    body[path[0]][path[1]] = value
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps(body))  # 1e400 is written as Infinity
    assert_usage_error(autopar("predict", "--model", "llama3-8b", "--global-batch", "64", "--profile", str(bad)),
                       "invalid ClusterProfile", said)


def test_binary_deep_and_endless_inputs_get_one_line_errors(tmp_path):
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\x80\x81\xff\xfe")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert_usage_error(autopar("predict", "--model-file", str(binary), "--global-batch", "8"), "--model-file=",
                       "is not UTF-8 text")
    assert_usage_error(autopar("explain", str(binary)), "PLAN.json=", "is not UTF-8 text")
    assert_usage_error(autopar("predict", "--hf-config", str(deep), "--global-batch", "8"), "is not readable JSON",
                       "maximum recursion depth")
    if Path("/dev/zero").exists():
        assert_usage_error(autopar("explain", "/dev/zero"), "PLAN.json='/dev/zero' holds more than")


def test_names_from_files_print_as_written_not_as_markup(tmp_path):
    """rich read "[/]" in a model name as a closing tag and crashed (and "[red]x[/]" printed as "x")."""
    spec = tmp_path / "m.json"
    spec.write_text(json.dumps({"name": "a[/]b [red]x[/]", "num_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "ffn_hidden_size": 256, "vocab_size": 1000}))
    out = invoke("predict", "--model-file", str(spec), "--global-batch", "8", "--seq", "128").output
    assert out.startswith("a[/]b [red]x[/] on dgx-h100 (8 GPUs)")
    plan = tmp_path / "p.json"
    invoke("plan", "--model-file", str(spec), "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "8",
           "--seq", "128", "--out", str(plan))
    assert "a[/]b [red]x[/] on dgx-h100" in invoke("explain", str(plan)).output


def test_export_and_schema_write_all_or_none_and_an_empty_cluster_is_refused(tmp_path):
    plan = tmp_path / "p.json"
    assert autopar("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "64",
                   "--target", "megatron", "--out", str(plan)).returncode == 0
    (tmp_path / "ex" / "megatron_args.sh").mkdir(parents=True)  # a folder where a file is to go
    assert_usage_error(autopar("export", str(plan), "--to", "megatron", "--out-dir", str(tmp_path / "ex")),
                       "--out-dir=", "holds a folder where megatron_args.sh is to be written")
    (tmp_path / "sch" / "Plan.schema.json").mkdir(parents=True)
    assert_usage_error(autopar("schema", "--out", str(tmp_path / "sch")), "holds a folder where Plan.schema.json")
    assert [p.name for p in (tmp_path / "sch").iterdir()] == ["Plan.schema.json"]  # none written before it
    assert_usage_error(autopar("predict", "--model", "llama3-8b", "--global-batch", "64", "--cluster", ""),
                       "--cluster='' is empty")


def test_hand_edited_plans_that_cannot_run_are_refused_by_explain_and_export(tmp_path):
    """explain showed, and export wrote launch configs for, plans no planner makes: tp=3 on 8 GPUs, a
    global batch the micro-batches do not split (DeepSpeed got gradient_accumulation_steps 0), ep on a
    dense model, a precision other than the training's."""
    good = tmp_path / "p.json"
    assert autopar("plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "64",
                   "--out", str(good)).returncode == 0
    plan = json.loads(good.read_text())
    edits = {
        "tp3": (lambda p: p["layout"].update(tp=3), "uses 24 GPUs"),
        "gbs7": (lambda p: p["training"].update(global_batch_size=7), "does not divide global_batch_size=7"),
        "ep8": (lambda p: p["layout"].update(ep=8), "needs a Mixture-of-Experts model"),
        "fp32": (lambda p: p.update(precision="fp32"), "differs from training.precision=bf16"),
    }
    for name, (edit, said) in edits.items():
        bad = json.loads(json.dumps(plan))
        edit(bad)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(bad))
        assert_usage_error(autopar("explain", str(path)), f"{path}: ", said)
        assert_usage_error(autopar("export", str(path), "--to", "deepspeed", "--out-dir", str(tmp_path / name)), said)
        assert not (tmp_path / name).exists()


def test_a_sequence_longer_than_a_learned_position_table_is_refused(tmp_path):
    spec = tmp_path / "m.json"
    spec.write_text(json.dumps({"name": "gpt-ish", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                "ffn_hidden_size": 256, "vocab_size": 1000, "position_embedding": "learned",
                                "max_position_embeddings": 16}))
    for command in ("predict", "plan"):
        assert_usage_error(autopar(command, "--model-file", str(spec), "--global-batch", "8", "--seq", "128"),
                           "seq_length=128 is longer than the model's learned position table",
                           "max_position_embeddings=16")


@pytest.mark.parametrize("extra, said", [
    (("--schedule", "zero_bubble"), "--schedule='zero_bubble' has no pipeline to schedule with pp=1"),
    (("--schedule", "gpipe"), "--schedule='gpipe' has no pipeline to schedule with pp=1"),
    (("--no-reshard",), "--no-reshard=True has no gathered weights to keep with ZeRO-0"),
    (("--tp-overlap",), "--tp-overlap=True has no tensor-parallel collectives to overlap with tp=1"),
])
def test_layout_options_that_nothing_would_use_are_refused(extra, said):
    assert_usage_error(autopar(*BASE, *extra), said)


def test_the_same_options_are_taken_where_they_apply():
    invoke("predict", "--model", "llama3-8b", "--global-batch", "8", "--pp", "2", "--schedule", "zero_bubble")
    invoke("predict", "--model", "llama3-8b", "--global-batch", "8", "--zero", "3", "--no-reshard")
    invoke("predict", "--model", "llama3-8b", "--global-batch", "8", "--tp", "2", "--tp-overlap")


def test_gpus_plans_a_job_on_part_of_a_node():
    """--gpus 4 on a DGX H100 reference cluster: a 4-GPU job (it used to need whole nodes); with --nodes, refused."""
    import json as _json
    import subprocess as _sp
    import sys as _sys

    run = _sp.run([_sys.executable, "-m", "planner.cli", "predict", "--model", "llama3-8b", "--gpus", "4",
                   "--global-batch", "16", "--seq", "2048", "--zero", "3", "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert _json.loads(run.stdout)["num_gpus"] == 4
    both = _sp.run([_sys.executable, "-m", "planner.cli", "predict", "--model", "llama3-8b", "--gpus", "4", "--nodes",
                    "1"], capture_output=True, text=True)
    assert both.returncode == 2 and "--gpus" in both.stderr


def test_the_search_options_have_one_set_of_defaults():
    """SearchOptions is the one home of the search's defaults: the API's PlanOptions and `autopar plan`'s flags
    (each flag's default, read from the command's signature) equal it field by field."""
    import inspect

    from api.schemas import PlanOptions
    from planner.cli import plan
    from planner.search import SearchOptions

    search, api = SearchOptions(), PlanOptions()
    for name in ("top_k", "max_micro_batch_size", "max_virtual_stages", "hsdp", "offload", "sequence_parallel",
                 "tp_comm_overlap", "dp_comm_overlap", "ep_comm_overlap", "compile", "robust", "max_tp", "max_pp",
                 "max_cp", "max_ep"):
        assert getattr(api, name) == getattr(search, name), name
    assert tuple(api.zero_stages) == search.zero_stages and tuple(api.schedules) == search.schedules
    assert api.target.value == search.target
    cli = {k: p.default for k, p in inspect.signature(plan).parameters.items()}
    assert (cli["top"], cli["max_micro_batch"], cli["max_vp"]) == (
        search.top_k, search.max_micro_batch_size, search.max_virtual_stages)
    assert (cli["time_budget"], cli["target"], cli["robust"], cli["compile_model"]) == (
        search.time_budget_s, search.target, search.robust, search.compile)
    assert (not cli["no_offload"], not cli["no_hsdp"], cli["sequence_parallel"]) == (
        search.offload, search.hsdp, search.sequence_parallel)
    assert (cli["tp_overlap"], cli["dp_overlap"], cli["ep_overlap"]) == (
        search.tp_comm_overlap, search.dp_comm_overlap, search.ep_comm_overlap)
    assert cli["zero_stages"] == ",".join(map(str, search.zero_stages))
    assert cli["schedules"] == ",".join(s.value for s in search.schedules)
    from api.planning import search_options
    from api.schemas import PlanRequest

    req = PlanRequest.model_validate({"model": {"preset": "llama3-8b"}, "cluster": "dgx-h100",
                                      "training": {"seq_length": 4096, "global_batch_size": 64}})
    assert search_options(req, max_budget_s=3600).time_budget_s == search.time_budget_s


def test_predict_with_a_v_schedule_needs_no_virtual_stages():
    """--vp left out means the schedule's own depth: 2 chunks per rank for ZB-V (planner.contracts.plan)."""
    out = json.loads(invoke("predict", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                            "--global-batch", "64", "--pp", "2", "--schedule", "zero_bubble_v", "--json").stdout)
    assert out["layout"]["virtual_stages"] == 2 and out["layout"]["schedule"] == "zero_bubble_v"

"""`autopar run`: refusals before any process starts, a DP4 run end to end with a valid RunReport whose
losses equal the single-process reference, a rank killed mid-run and restarted from its checkpoint,
and 3-D plans from `autopar plan` (8 ranks) run for the built-in model and a Hugging Face Llama."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
from run_plans import ROOT, SPEC, TRAINING, child_env, profile_for, reference_losses, write_plan

from planner.contracts import ClusterProfile, Precision, RunReport


def autopar_run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from planner.cli import main; main()", "run", *args]
    return subprocess.run(cmd, check=False, env=env or child_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_unsupported_plans_are_refused_before_any_process_starts(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "ok.json", dp_shard=4)
    cases = {
        # expert parallelism on a dense model
        "ep.json": (plan.model_copy(update={"layout": plan.layout.model_copy(update={"ep": 2})}), "layout.ep"),
        # a mesh of 4 ranks in a plan that says 8
        "n8.json": (plan.model_copy(update={"num_gpus": 8}), "plan.num_gpus"),
        # 8 sequences do not split over dp=4 x micro-batch 4
        "mb.json": (plan.model_copy(update={"layout": plan.layout.model_copy(update={"micro_batch_size": 4})}),
                    "global_batch_size"),
    }
    for name, (bad, field) in cases.items():
        (tmp_path / name).write_text(bad.model_dump_json())
        t0 = time.perf_counter()
        r = autopar_run(str(tmp_path / name), "--steps", "2")
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        assert field in r.stderr and "starting" not in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr
        assert time.perf_counter() - t0 < 60
    # an existing checkpoint without --resume, and a report upload without the plan's id
    (tmp_path / "ck" / "step_2").mkdir(parents=True)
    (tmp_path / "ck" / "step_2" / ".metadata").write_text("")
    r = autopar_run(str(tmp_path / "ok.json"), "--checkpoint-dir", str(tmp_path / "ck"))
    assert r.returncode == 2 and "--resume" in r.stderr and "step 2" in r.stderr, r.stderr
    r = autopar_run(str(tmp_path / "ok.json"), "--server", "http://127.0.0.1:9")
    assert r.returncode == 2 and "--plan-id" in r.stderr, r.stderr
    # a report path that cannot be written: refused before any worker trains
    r = autopar_run(str(tmp_path / "ok.json"), "--out", str(tmp_path))
    assert r.returncode == 2 and f"--out='{tmp_path}' is a folder" in r.stderr and "starting" not in r.stderr, r.stderr
    (tmp_path / "broken.json").write_text('{"model": 3}')
    r = autopar_run(str(tmp_path / "broken.json"))
    assert r.returncode == 2 and "not a valid Plan" in r.stderr, r.stderr


def _run_in_process(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, list]:
    """`autopar run ARGS` in this process (no torch import per case): exit code, stderr and the
    torchrun command lines it would have started (none, for a refusal)."""
    import typer
    from typer.testing import CliRunner

    from executor import cli as run_cli

    started: list = []
    monkeypatch.setattr(run_cli.subprocess, "call", lambda cmd, **kw: started.append(cmd) or 1)
    monkeypatch.setenv("AUTOPAR_FORCE_CPU", "1")  # CPU ranks (the plans' 4 ranks), on a GPU host too
    app = typer.Typer()
    app.command()(run_cli.run)
    result = CliRunner().invoke(app, list(args))
    assert isinstance(result.exception, SystemExit) or result.exception is None, repr(result.exception)
    return result.exit_code, result.stderr, started


def test_bad_files_and_options_are_refused_before_any_worker_starts(tmp_path: Path, monkeypatch) -> None:
    """Each refused with a one-line error naming the field and the value, exit 2, before torchrun; before,
    these were tracebacks (a binary or deeply nested JSON), a run lost after training (a bad --profile),
    a worker's traceback (a checkpoint folder that is a file, a bad token file) or silently accepted."""
    import numpy as np

    plan = str(tmp_path / "ok.json")
    write_plan(tmp_path / "ok.json", dp_shard=4)
    files = {"bin.json": b"\x80\x81\xff\xfe", "deep.json": b"[" * 100_000 + b"]" * 100_000, "empty.json": b"",
             "spec.json": SPEC.model_dump_json().encode(), "afile": b"hi\n", "odd.bin": b"abc", "empty.bin": b"",
             "text.bin": b"hello world, a text file and no tokens " * 4}
    for name, body in files.items():
        (tmp_path / name).write_bytes(body)
    (tmp_path / "adir").mkdir()
    t = {name: str(tmp_path / name) for name in [*files, "adir"]}
    cases = [
        ((t["bin.json"],), f"PLAN.json='{t['bin.json']}' is not UTF-8 text"),
        ((t["deep.json"],), f"PLAN.json='{t['deep.json']}' is not a valid Plan"),
        ((t["empty.json"],), f"PLAN.json='{t['empty.json']}' is not a valid Plan"),
        ((t["adir"],), f"PLAN.json='{t['adir']}' is a folder"),
        ((plan, "--hf-config", t["bin.json"]), f"--hf-config='{t['bin.json']}' is not UTF-8 text"),
        ((plan, "--hf-config", t["deep.json"]), f"--hf-config='{t['deep.json']}' cannot be read as JSON"),
        ((plan, "--profile", t["bin.json"]), f"--profile='{t['bin.json']}' is not UTF-8 text"),
        ((plan, "--profile", t["empty.json"]), f"--profile='{t['empty.json']}' is not a valid ClusterProfile"),
        ((plan, "--profile", t["spec.json"]), f"problem(s) in --profile {t['spec.json']})"),
        ((plan, "--profile", t["adir"]), f"--profile='{t['adir']}' is a folder"),
        ((plan, "--data", t["adir"]), f"--data='{t['adir']}' is a folder"),
        ((plan, "--checkpoint-dir", t["afile"]), f"--checkpoint-dir='{t['afile']}' is a file"),
        ((plan, "--checkpoint-dir", t["afile"], "--checkpoint-every", "1"),
         f"--checkpoint-dir='{t['afile']}' is a file"),
        ((plan, "--checkpoint-dir", t["afile"] + "/ck", "--checkpoint-every", "1"), "cannot be written"),
        ((plan, "--data", t["odd.bin"]), f"--data='{t['odd.bin']}' is not a flat array of uint16"),
        ((plan, "--data", t["empty.bin"]), "holds 0 tokens, fewer than one sequence"),
        ((plan, "--data", t["text.bin"]), "vocab_size=64"),
        ((plan, "--lr", "inf"), "--lr=inf"),
        ((plan, "--lr", "nan"), "--lr=nan"),
        ((plan, "--lr", "1e300"), "--lr=1e+300"),
        ((plan, "--steps", "2", "--warmup", "5"), "--warmup=5 is not below --steps 2"),
        ((plan, "--steps", "2", "--warmup", "2"), "--warmup=2 is not below --steps 2"),
        ((plan, "--async-checkpoint"), "--async-checkpoint=True has no checkpoints to save"),
    ]
    if Path("/dev/zero").exists():  # endless: read no further than any JSON input can be
        cases += [((path, *args), f"{flag}='/dev/zero' holds more than") for flag, path, args in
                  (("PLAN.json", "/dev/zero", ()), ("--profile", plan, ("--profile", "/dev/zero")),
                   ("--hf-config", plan, ("--hf-config", "/dev/zero")))]
        cases.append(((plan, "--data", "/dev/null"), "--data='/dev/null' is not a regular file"))
    if Path("/proc/self").is_dir():  # a folder no file can be created in
        cases.append(((plan, "--checkpoint-dir", "/proc/autopar-ck", "--checkpoint-every", "1"),
                      "--checkpoint-dir='/proc/autopar-ck' cannot be written"))
    for args, expected in cases:
        code, stderr, started = _run_in_process(monkeypatch, *args)
        assert code == 2 and not started, (args, code, stderr)
        assert stderr.startswith("error: ") and stderr.count("\n") == 1, (args, stderr)  # one line
        assert expected in stderr and "--data-dtype" not in stderr, (args, stderr)
    # the defaults and a good token file still start the workers; --warmup defaults below a short --steps
    (np.arange(100) % 64).astype(np.uint16).tofile(tmp_path / "tokens.bin")  # ids below the plan's vocab_size 64
    code, stderr, started = _run_in_process(monkeypatch, plan, "--steps", "1", "--data", str(tmp_path / "tokens.bin"),
                                            "--lr", "0.01")
    assert code == 1 and len(started) == 1, stderr  # the fake torchrun "failed"
    assert started[0][started[0].index("--warmup") + 1] == "0" and "torchrun exit status 1" in stderr
    # through the real entry point: no traceback
    r = autopar_run(t["bin.json"])
    assert r.returncode == 2 and "PLAN.json=" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_autopar_run_dp4_writes_a_valid_report_matching_the_reference(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", dp_shard=4)
    # a CPU profile whose measured matmul rates are its peaks (as `autopar profile` writes them): the MFU
    # is against its fp32 peak, faster than its bf16 one (no native bf16), as the prediction's MFU is
    prof = profile_for(4).model_copy(update={"kind": "measured"})
    prof.compute.achieved_matmul_tflops = {Precision.fp32: 0.05, Precision.bf16: 0.01}
    prof.device.peak_tflops = {Precision.fp32: 0.05, Precision.bf16: 0.01}
    (tmp_path / "prof.json").write_text(ClusterProfile.model_validate(prof.model_dump()).model_dump_json())
    r = autopar_run(str(tmp_path / "plan.json"), "--steps", "5", "--warmup", "2", "--out", str(tmp_path / "r.json"),
                    "--profile", str(tmp_path / "prof.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = RunReport.model_validate_json((tmp_path / "r.json").read_text())
    assert report.num_ranks == 4 and report.device == "cpu" and report.memory_kind == "rss"
    assert [s.step for s in report.steps] == [0, 1, 2, 3, 4] and report.warmup_steps == 2
    assert len(report.peak_memory_bytes_per_rank) == 4 and min(report.peak_memory_bytes_per_rank) > 50 * 2**20
    # the last 2 steps ran under the profiler (--profile-steps 2, the default): only step 2 is in the median
    assert [s.profiled for s in report.steps] == [False, False, False, True, True]
    assert report.median_step_time_s == pytest.approx(report.steps[2].time_s)
    assert len(report.breakdown) == 4 and "where the step goes" in r.stdout
    assert report.tokens_per_s == pytest.approx(TRAINING.tokens_per_step / report.median_step_time_s)
    assert report.mfu == pytest.approx(plan.prediction.model_flops_per_step / (report.median_step_time_s * 4 * 0.05e12))
    env = report.environment
    assert env.backend == "gloo" and env.torch_version and env.nccl_version is None and env.cuda_version is None
    # described as a profile describes its machine (profiler.identity.environment)
    assert env.gloo_version.startswith("bundled with torch ") and env.hostnames == [socket.gethostname()]
    assert env.devices_per_node == len(os.sched_getaffinity(0))
    ref, _ = reference_losses(5)
    assert [s.loss for s in report.steps] == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert "step time" in r.stdout and "tokens/s" in r.stdout


def _final_state(ckpt: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(ckpt) + ".pt")
    return torch.load(str(ckpt) + ".pt", weights_only=False)


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_checkpoint_and_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    import torch

    # FSDP (ZeRO-3): its reductions have a fixed layout. Under DDP the resumed run's first step would use
    # DDP's initial gradient buckets, the uninterrupted run the rebuilt ones: a ring all-reduce then sums
    # in another order and the weights agree to ~1e-7, not bit for bit.
    write_plan(tmp_path / "plan.json", dp_shard=4, zero_stage=3)
    marker = tmp_path / "died"
    r = autopar_run(str(tmp_path / "plan.json"), "--steps", "6", "--checkpoint-dir", str(tmp_path / "a"),
                    "--checkpoint-every", "2", "--max-restarts", "1", "--out", str(tmp_path / "a.json"),
                    env=child_env(AUTOPAR_TEST_DIE=f"2:3:{marker}"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert marker.exists(), "rank 2 never exited: the hook did not fire"
    assert "resumed from" in r.stdout and "continuing at step 2" in r.stdout
    r = autopar_run(str(tmp_path / "plan.json"), "--steps", "6", "--checkpoint-dir", str(tmp_path / "b"),
                    "--checkpoint-every", "2", "--out", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = _final_state(tmp_path / "a" / "step_6"), _final_state(tmp_path / "b" / "step_6")
    assert set(a["model"]) == set(b["model"]) and a["progress"]["step"] == 6
    for name in b["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for key, value in b["optim"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(a["optim"][key], value), key
    ra = RunReport.model_validate_json((tmp_path / "a.json").read_text())
    rb = RunReport.model_validate_json((tmp_path / "b.json").read_text())
    assert [s.loss for s in ra.steps] == [s.loss for s in rb.steps]  # history restored from the checkpoint


def _three_d_plan_from_autopar_plan(tmp_path: Path, model_args: list[str], *extra: str, hf: dict | None = None):
    """`autopar plan` over 8 ranks (one node of 8 "GPUs"), then the best of its ranked layouts that
    has three parallel dimensions > 1 and that the executor accepts."""
    import json

    from executor.train import check_plan
    from planner.contracts import Plan
    from planner.errors import AutoparError

    (tmp_path / "prof8.json").write_text(profile_for(8).model_dump_json())
    cmd = [sys.executable, "-c", "from planner.cli import main; main()", "plan", *model_args, "--profile",
           str(tmp_path / "prof8.json"), "--global-batch", str(TRAINING.global_batch_seqs), "--seq",
           str(TRAINING.seq_length), "--precision", "fp32", "--top", "50", "--max-micro-batch", "1",
           "--out", str(tmp_path / "searched.json"), *extra]
    r = subprocess.run(cmd, check=False, env=child_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    searched = Plan.model_validate_json((tmp_path / "searched.json").read_text())
    for lay in [searched.layout, *[a.layout for a in searched.alternatives]]:
        if sum(d > 1 for d in (lay.pp, lay.tp, lay.cp, lay.dp_replicate, lay.dp_shard)) < 3:
            continue
        candidate = searched.model_copy(update={"layout": lay, "alternatives": []})
        try:
            check_plan(candidate, hf_config=hf)
        except AutoparError:
            continue
        (tmp_path / "plan.json").write_text(candidate.model_dump_json())
        return lay
    raise AssertionError("no 3-D layout the executor accepts among the top 50: "
                         + json.dumps([a.layout.model_dump(exclude_defaults=True) for a in searched.alternatives]))


@pytest.mark.slow
def test_a_3d_plan_from_autopar_plan_runs_for_the_built_in_model(tmp_path: Path) -> None:
    (tmp_path / "spec.json").write_text(SPEC.model_dump_json())
    chosen = _three_d_plan_from_autopar_plan(tmp_path, ["--model-file", str(tmp_path / "spec.json")])
    r = autopar_run(str(tmp_path / "plan.json"), "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = RunReport.model_validate_json((tmp_path / "r.json").read_text())
    assert report.layout == chosen and report.num_ranks == 8
    ref, _ = reference_losses(3)
    assert [s.loss for s in report.steps] == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
def test_a_hugging_face_llama_runs_under_a_3d_plan_from_autopar_plan(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import json

    from executor.data import SyntheticTokens
    from executor.hf import build_hf_model
    from executor.reference import reference_run

    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 64,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # every dimension is open to a Hugging Face model now: whatever 3-D layout the search ranks first
    chosen = _three_d_plan_from_autopar_plan(tmp_path, ["--hf-config", str(tmp_path / "config.json")], hf=config)
    print(f"\nchosen: {chosen.model_dump_json(exclude_defaults=True)}")
    r = autopar_run(str(tmp_path / "plan.json"), "--hf-config", str(tmp_path / "config.json"), "--steps", "3",
                    "--warmup", "1", "--out", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = RunReport.model_validate_json((tmp_path / "r.json").read_text())
    assert report.layout == chosen and report.num_ranks == 8
    ref = reference_run(build_hf_model(config, seed=0), SyntheticTokens(64, TRAINING.seq_length, 0), steps=3,
                        global_batch=TRAINING.global_batch_seqs, micro_batch_size=1)
    # Step 0 runs before any update; held tight, it caught the rotary inv_freq buffer (non-persistent,
    # not in state_dict()) left uninitialised by to_empty(): off by 1e-5 and different on every run.
    assert report.steps[0].loss == pytest.approx(ref.losses[0], rel=1e-6)
    assert [s.loss for s in report.steps] == pytest.approx(ref.losses, rel=1e-5)


@pytest.mark.slow
def test_bf16_plans_train_in_mixed_precision_with_fp32_master_weights(tmp_path: Path) -> None:
    """bf16 under DDP (autocast), under PP2 x DP2 (autocast around the schedule), under FSDP2 ZeRO-3 and
    TP2 x FSDP2 (MixedPrecisionPolicy): each run follows the single-process bf16 reference, not the fp32
    one, and the checkpointed weights are fp32 (master weights)."""
    import torch
    from run_plans import GBS, SEQ

    from executor.data import SyntheticTokens
    from executor.reference import reference_run

    def ref(dtype):
        return reference_run(SPEC, SyntheticTokens(SPEC.vocab_size, SEQ, 0), steps=3, global_batch=GBS,
                             micro_batch_size=1, autocast=dtype).losses

    fp32, bf16 = ref(None), ref(torch.bfloat16)
    # bf16 visibly changes the numbers; a run that silently stayed fp32 would sit on the fp32 curve
    gap = max(abs(a - b) / b for a, b in zip(bf16, fp32))
    assert 5e-6 < gap < 2e-2, (bf16, fp32)
    layouts = {"ddp": {"dp_shard": 4, "zero_stage": 0}, "pp": {"pp": 2, "dp_shard": 2, "zero_stage": 1},
               "fsdp": {"dp_shard": 4, "zero_stage": 3},
               "tp_fsdp": {"tp": 2, "sp": True, "dp_shard": 2, "zero_stage": 3}}
    for name, lay in layouts.items():
        plan = write_plan(tmp_path / f"{name}.json", **lay, micro_batch_size=1)
        plan = plan.model_copy(update={"training": plan.training.model_copy(update={"precision": Precision.bf16})})
        (tmp_path / f"{name}.json").write_text(plan.model_dump_json())
        r = autopar_run(str(tmp_path / f"{name}.json"), "--steps", "3", "--warmup", "1", "--out",
                        str(tmp_path / f"{name}.r.json"), "--checkpoint-dir", str(tmp_path / f"{name}.ck"),
                        "--checkpoint-every", "3")
        assert r.returncode == 0, (name, r.stdout[-3000:] + r.stderr[-3000:])
        losses = [s.loss for s in RunReport.model_validate_json((tmp_path / f"{name}.r.json").read_text()).steps]
        err = max(abs(a - b) / b for a, b in zip(losses, bf16))
        off_fp32 = max(abs(a - b) / b for a, b in zip(losses, fp32))
        if lay["zero_stage"] < 2:
            # autocast on 4 ranks rounds exactly what the single-process autocast run rounds (measured: equal)
            assert err < 1e-6, (name, losses, bf16)
        else:
            # FSDP2 runs the whole forward (norms, softmax too) on bf16 weights where autocast keeps those
            # ops fp32, so it tracks the autocast curve only to bf16 rounding (measured 2.9e-5) and must
            # be as far from fp32 as bf16 rounding puts it
            assert err < 1e-4 and off_fp32 > gap / 2, (name, losses, bf16, fp32)
        state = _final_state(tmp_path / f"{name}.ck" / "step_3")
        weights = list(state["model"].values())
        assert weights and all(w.dtype == torch.float32 for w in weights), name


def _plan_of(path: Path, preset: str, num_ranks: int, **layout: object):
    """A plan of a preset model over ``num_ranks`` H100s (`autopar plan` would pick its own layout)."""
    from planner.contracts import ParallelLayout, TrainingConfig
    from planner.presets import get_preset
    from planner.reference import reference_profile
    from planner.tune import plan_for

    prof = reference_profile("dgx-h100", 1).model_copy(update={"gpus_per_node": num_ranks})
    plan = plan_for(get_preset(preset), TrainingConfig(seq_length=4096, global_batch_size=64),
                    ParallelLayout(**layout), prof)
    path.write_text(plan.model_dump_json())
    return plan


def test_dry_run_says_whether_this_host_can_run_the_cpu_ranks(tmp_path: Path) -> None:
    """CPU ranks: `--dry-run` exits 0 with one line where this host's cores and memory hold them, else 2
    with the reason and the fix, and `autopar run` refuses the same before a worker starts (a 16-GPU
    plan of an 8B model on a 2-core host started 16 workers until the kernel's OOM killer ended them)."""
    env = child_env(AUTOPAR_FORCE_CPU="1")  # the CPU ranks' check, on a GPU host too
    write_plan(tmp_path / "ok.json", dp_shard=4)
    r = autopar_run(str(tmp_path / "ok.json"), "--dry-run", env=env)
    assert r.returncode == 0 and r.stdout.startswith("ok: 4 CPU rank(s)") and r.stdout.count("\n") == 1, r
    assert "starting" not in r.stderr and "GiB" in r.stdout, r.stderr
    # 2 ranks of 405B parameters unsharded: ~7 TiB each, more than any host holds
    _plan_of(tmp_path / "big.json", "llama3.1-405b", 2, dp_shard=2)
    for extra in (("--dry-run",), ("--steps", "1")):
        r = autopar_run(str(tmp_path / "big.json"), *extra, env=env)
        assert r.returncode == 2 and r.stderr.startswith("error: --nproc-per-node=2 CPU ranks need about"), r.stderr
        assert "available" in r.stderr and "--nnodes" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert "starting" not in r.stderr and not r.stdout, r
    # more ranks than MAX_RANKS_PER_CORE per core
    from executor.cli import MAX_RANKS_PER_CORE

    cores = len(os.sched_getaffinity(0))
    if MAX_RANKS_PER_CORE * cores >= 64:
        pytest.skip(f"{cores} cores hold the largest plan of the test model (64 ranks)")
    write_plan(tmp_path / "wide.json", dp_shard=8, tp=2, pp=4, schedule="gpipe")
    r = autopar_run(str(tmp_path / "wide.json"), "--dry-run", env=env)
    assert r.returncode == 2 and f"more than {MAX_RANKS_PER_CORE} per core" in r.stderr, r.stderr
    assert f"run at most {MAX_RANKS_PER_CORE * cores} here" in r.stderr, r.stderr
    # spread over hosts, each node's share is what this host must hold
    r = autopar_run(str(tmp_path / "wide.json"), "--dry-run", "--nnodes", "16", "--node-rank", "1",
                    "--master-addr", "127.0.0.1", env=env)
    assert r.returncode == 0 and r.stdout.startswith("ok: 4 CPU rank(s)"), r


def test_dry_run_says_whether_this_host_has_the_gpus(tmp_path: Path) -> None:
    """CUDA ranks: one GPU each, and each holding the plan's predicted memory per GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this host")
    have = torch.cuda.device_count()
    write_plan(tmp_path / "one.json")
    r = autopar_run(str(tmp_path / "one.json"), "--dry-run")
    assert r.returncode == 0 and r.stdout.startswith(f"ok: 1 rank(s) on 1 of this host's {have} CUDA GPU(s)"), r
    _plan_of(tmp_path / "many.json", "llama3-8b", 2 * have, dp_shard=2 * have, zero_stage=3)
    r = autopar_run(str(tmp_path / "many.json"), "--dry-run")
    assert r.returncode == 2 and f"ranks need a CUDA GPU each, and this host has {have}" in r.stderr, r.stderr
    assert "AUTOPAR_FORCE_CPU=1" in r.stderr and "starting" not in r.stderr
    _plan_of(tmp_path / "huge.json", "llama3.1-405b", 1)
    r = autopar_run(str(tmp_path / "huge.json"), "--steps", "1")
    assert r.returncode == 2 and "plan.prediction.memory.total_bytes" in r.stderr, r.stderr
    assert "is more than GPU 0" in r.stderr and "starting" not in r.stderr, r.stderr


def test_fp16_and_fp8_plans_are_refused_with_the_fix(tmp_path: Path) -> None:
    for precision in (Precision.fp16, Precision.fp8):
        plan = write_plan(tmp_path / "p.json", dp_shard=4)
        plan = plan.model_copy(update={"training": plan.training.model_copy(update={"precision": precision})})
        (tmp_path / "p.json").write_text(plan.model_dump_json())
        r = autopar_run(str(tmp_path / "p.json"), "--steps", "1")
        assert r.returncode == 2 and "training.precision" in r.stderr and "bf16" in r.stderr, r.stderr


@pytest.mark.slow
def test_plan_from_the_service_runs_and_the_report_is_stored_beside_its_prediction(tmp_path: Path,
                                                                                    live_server) -> None:  # noqa: ANN001
    """The service round trip: upload a profile, POST a model spec for a plan, run that plan with
    `autopar run --server --token --plan-id`, then read the run back next to the plan's prediction."""
    import httpx

    from planner.contracts import Plan

    auth = {"Authorization": "Bearer tok"}
    with live_server(f"sqlite:///{tmp_path / 'svc.db'}", AUTOPAR_TOKENS="tok") as server:
        base = server.url
        prof = httpx.post(f"{base}/v1/profiles", json=profile_for(4).model_dump(mode="json"), headers=auth, timeout=30)
        assert prof.status_code == 201, prof.text
        req = {"model": {"spec": SPEC.model_dump(mode="json")}, "training": TRAINING.model_dump(mode="json"),
               "profile_id": prof.json()["id"], "options": {"top_k": 3, "max_micro_batch_size": 1}}
        made = httpx.post(f"{base}/v1/plans", json=req, headers=auth, timeout=120)
        assert made.status_code == 201, made.text
        plan_id = made.json()["id"]
        plan = Plan.model_validate(httpx.get(f"{base}/v1/plans/{plan_id}", timeout=30).json()["plan"])
        (tmp_path / "plan.json").write_text(plan.model_dump_json())
        # the planner's own pick must be one the executor runs
        r = autopar_run(str(tmp_path / "plan.json"), "--steps", "3", "--warmup", "1", "--server", base,
                        "--plan-id", str(plan_id), "--out", str(tmp_path / "r.json"),
                        env={**child_env(), "AUTOPAR_TOKEN": "tok"})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"of plan #{plan_id}" in r.stderr, r.stderr
        report = RunReport.model_validate_json((tmp_path / "r.json").read_text())
        runs = httpx.get(f"{base}/v1/runs", params={"plan_id": plan_id}, timeout=30).json()
        assert runs["total"] == 1, runs
        run = httpx.get(f"{base}/v1/runs/{runs['items'][0]['id']}", timeout=30).json()
        assert run["measured_step_s"] == pytest.approx(report.median_step_time_s)
        assert run["predicted_step_s"] == pytest.approx(plan.prediction.step_time_s)
        assert [s["loss"] for s in run["report"]["steps"]] == [s.loss for s in report.steps]
        ref, _ = reference_losses(3)
        assert [s.loss for s in report.steps] == pytest.approx(ref, rel=1e-5)
        # without the token the upload is refused with a clear message, and the run is not stored twice
        env = {k: v for k, v in child_env().items() if k != "AUTOPAR_TOKEN"}
        r = autopar_run(str(tmp_path / "plan.json"), "--steps", "1", "--warmup", "0", "--server", base,
                        "--plan-id", str(plan_id), env=env)
        assert r.returncode == 2 and "token" in r.stderr.lower() and "Traceback" not in r.stderr, r.stderr
        assert "starting" not in r.stderr, r.stderr  # asked before the workers start, not after training
        assert httpx.get(f"{base}/v1/runs", params={"plan_id": plan_id}, timeout=30).json()["total"] == 1
        # a plan id the service does not hold: refused before training too
        r = autopar_run(str(tmp_path / "plan.json"), "--steps", "1", "--warmup", "0", "--server", base,
                        "--plan-id", str(plan_id + 1000), env={**child_env(), "AUTOPAR_TOKEN": "tok"})
        assert r.returncode == 2 and "--plan-id" in r.stderr and "not a plan stored" in r.stderr, r.stderr
        assert "starting" not in r.stderr, r.stderr
        # the id of another plan (a 2-rank one: another mesh): refused before training, not at the report's post
        two = httpx.post(f"{base}/v1/profiles", json=profile_for(2).model_dump(mode="json"), headers=auth, timeout=30)
        wrong = httpx.post(f"{base}/v1/plans", json={**req, "profile_id": two.json()["id"]}, headers=auth,
                           timeout=120).json()
        r = autopar_run(str(tmp_path / "plan.json"), "--steps", "1", "--warmup", "0", "--server", base,
                        "--plan-id", str(wrong["id"]), env={**child_env(), "AUTOPAR_TOKEN": "tok"})
        assert r.returncode == 2 and "is another plan at" in r.stderr and "starting" not in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("name", "moe", "layout"), [
    ("pp2_tp2_sp", False, {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b"}),
    ("pp2_dp2_interleaved", False, {"pp": 2, "dp_shard": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2,
                                    "zero_stage": 1}),
    # ZB-V through the worker: rank 0 holds the embedding and the head, FSDP2 keeps the stage's weights
    # gathered for the split weight pass (ZB-H1 with a MoE: tests/dist_scripts/pipeline_check.py)
    ("moe_pp2_fsdp2_zero_bubble_v", True, {"pp": 2, "dp_shard": 2, "schedule": "zero_bubble_v", "virtual_stages": 2,
                                           "zero_stage": 3}),
    ("moe_pp2_fsdp2_1f1b", True, {"pp": 2, "dp_shard": 2, "schedule": "1f1b", "zero_stage": 3}),
    # per-op selective checkpointing (executor.sac) on pipeline stages under FSDP2, experts and router included
    ("moe_pp2_fsdp2_1f1b_op", True, {"pp": 2, "dp_shard": 2, "schedule": "1f1b", "zero_stage": 3,
                                     "recompute": "op"}),
    ("pp2_fsdp2_zero_bubble", False, {"pp": 2, "dp_shard": 2, "schedule": "zero_bubble", "zero_stage": 3}),
    ("moe_pp2_tp2_sp_ep2_etp1", True, {"pp": 2, "tp": 2, "sp": True, "ep": 2, "etp": 1, "schedule": "1f1b"}),
    ("moe_pp2_cp2_ep2_fsdp", True, {"pp": 2, "cp": 2, "ep": 2, "schedule": "1f1b", "zero_stage": 3}),
    ("moe_cp2_tp2_sp_ep2_etp2", True, {"cp": 2, "tp": 2, "sp": True, "ep": 2}),
])
def test_the_worker_matches_losses_and_gradients_of_the_reference(tmp_path: Path, name: str, moe: bool,
                                                                   layout: dict) -> None:
    """The training worker itself (not a test harness): losses of 3 steps and every parameter's
    first-step gradient equal the single-process run's, under pipeline x tensor, interleaved pipeline
    x data (ZeRO-1) and an MoE model (aux loss through the schedule) under zero-bubble x ZeRO-1 and
    1F1B x FSDP, zero-bubble x FSDP (this test found its lost weight gradients; now kept gathered), and with
    its experts folded over tensor / context parallel ranks (etp 1 and tp)."""
    import torch
    from run_plans import GBS, SEQ, torchrun_worker

    from executor.data import SyntheticTokens
    from executor.reference import reference_run
    from planner.contracts import MoESpec, ParallelLayout
    from planner.tune import plan_for

    spec = SPEC.model_copy(update={"moe": MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=32)} if moe else {})
    lay = ParallelLayout(**layout, micro_batch_size=1)
    plan = plan_for(spec, TRAINING, lay, profile_for(lay.num_gpus))
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    torchrun_worker(tmp_path / "plan.json", lay.num_gpus, "--steps", "3", "--warmup", "0", "--record-dir",
                    str(tmp_path / "rec"), "--out", str(tmp_path / "r.json"))
    ref = reference_run(spec, SyntheticTokens(spec.vocab_size, SEQ, 0), steps=3, global_batch=GBS, micro_batch_size=1)
    report = RunReport.model_validate_json((tmp_path / "r.json").read_text())
    assert [s.loss for s in report.steps] == pytest.approx(ref.losses, rel=1e-5), name
    grads: dict[str, torch.Tensor] = {}
    for r in range(lay.num_gpus):
        grads.update(torch.load(tmp_path / "rec" / f"rank{r}.pt", weights_only=False)["grads"])
    assert set(grads) == set(ref.grads_first_step), name
    for key, g in ref.grads_first_step.items():
        torch.testing.assert_close(grads[key], g, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{name} {k}: {m}")

"""Hugging Face models under pipeline plans through the training worker's own Runtime (4 gloo ranks,
tests/dist_scripts/hf_pipeline_check.py: every case in one launch): the step losses and every
parameter's first-step gradient equal the single-process HF run's (executor.reference), for each
schedule, an uneven split, per-stage recompute, and pipelines combined with data, FSDP, tensor
(+ sequence), context and expert parallelism. Then ``autopar run`` itself: two nodes on loopback, and a
killed rank of a 3-D plan resumed from its checkpoint."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
from run_plans import ROOT, child_env

from executor.data import SyntheticTokens
from executor.hf import build_hf_model
from executor.hf_pipeline import KeptLayers
from executor.pipeline import split_model
from planner.contracts import ParallelLayout, RunReport

SCRIPT = Path(__file__).parent / "dist_scripts" / "hf_pipeline_check.py"
_spec = importlib.util.spec_from_file_location("hf_pipeline_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)
SEQ, GBS, four_layers, plan_of = check.SEQ, check.GBS, check.four_layers, check.plan_of
# |dist - ref| <= 1e-4 relative + 1e-6 absolute per element (fp32: reduction order moves gradients by
# ~1e-7 relative; a gradient from the wrong micro-batch, stage or reduction is off by O(1))
RTOL, ATOL = 1e-4, 1e-6


def reference(family: str, steps: int):  # noqa: ANN201 - a ReferenceResult
    from executor.reference import reference_run

    return reference_run(build_hf_model(four_layers(family), seed=0), SyntheticTokens(128, SEQ, 0), steps=steps,
                         global_batch=GBS, micro_batch_size=1)


def assert_grads_match(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], name: str) -> None:
    assert set(grads) == set(ref), name
    for key, g in ref.items():
        torch.testing.assert_close(grads[key], g, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{name} {k}: {m}")


def test_chunks_keep_the_model_wide_layer_names_and_their_layer_types():
    model = build_hf_model(four_layers("gemma3"))
    kinds = list(model.config.layer_types)
    lay = ParallelLayout(pp=2, layers_per_stage=[1, 3])
    first, = split_model(model, lay, 0)
    last, = split_model(model, lay, 1)
    assert isinstance(last.model.layers, KeptLayers) and list(last.model.layers.keys()) == ["1", "2", "3"]
    assert last.config.layer_types[:3] == kinds[1:] and first.config.layer_types[0] == kinds[0]
    assert first.model.embed_tokens is not None and last.model.embed_tokens is None
    names = {n for part in (first, last) for n, _ in part.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # every weight once, by its own name
    tokens = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, SEQ, 32)
        assert torch.allclose(last(hidden), model(tokens).logits, atol=1e-6)


@pytest.mark.slow
def test_every_case_matches_the_losses_and_every_gradient_of_one_process(tmp_path: Path) -> None:
    """One torchrun launch runs every case (start-up paid once); every rank's gradients are compared."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT),
           str(tmp_path)]
    proc = subprocess.run(cmd, check=False, env={**child_env(), "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print(f"\nhf_pipeline_check launch ({len(check.CASES)} cases): {time.perf_counter() - start:.1f} s")
    refs: dict[str, object] = {}
    for name, (family, _) in check.CASES.items():
        ref = refs.setdefault(family, reference(family, check.STEPS))
        records = [torch.load(tmp_path / name / f"rank{r}.pt", weights_only=False) for r in range(4)]
        assert records[0]["losses"] == pytest.approx(ref.losses, rel=1e-5), name
        grads: dict[str, torch.Tensor] = {}
        for rec in records:
            grads.update(rec["grads"])
        assert_grads_match(grads, ref.grads_first_step, name)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_train_a_plan_whose_groups_cross_them(tmp_path: Path) -> None:
    """``autopar run --nnodes 2``: two torchrun agents of 2 ranks each (node ranks 0 and 1, static
    rendezvous on 127.0.0.1, each node its own --out as on two hosts); the pipeline groups (ranks 0-2
    and 1-3) cross the node boundary, FSDP shards within each node. Node 0 writes the report; losses
    and every first-step gradient match one process."""
    config = four_layers("qwen3")
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = plan_of("qwen3", {"pp": 2, "dp_shard": 2, "zero_stage": 3, "schedule": "1f1b"})
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    port = str(_free_port())
    procs = []
    for node in ("0", "1"):
        cmd = [sys.executable, "-c", "from planner.cli import main; main()", "run", str(tmp_path / "plan.json"),
               "--hf-config", str(tmp_path / "config.json"), "--nnodes", "2", "--node-rank", node,
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, "--steps", "3",
               "--warmup", "0", "--record-dir", str(tmp_path / "rec"), "--out", str(tmp_path / f"r{node}.json")]
        procs.append(subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    assert "node 1 done" in results[1][1], results[1][1][-2000:]
    ref = reference("qwen3", 3)
    report = RunReport.model_validate_json((tmp_path / "r0.json").read_text())
    assert report.num_ranks == 4 and [s.loss for s in report.steps] == pytest.approx(ref.losses, rel=1e-5)
    grads: dict[str, torch.Tensor] = {}
    for r in range(4):
        grads.update(torch.load(tmp_path / "rec" / f"rank{r}.pt", weights_only=False)["grads"])
    assert_grads_match(grads, ref.grads_first_step, "two nodes")


@pytest.mark.slow
def test_a_killed_rank_of_a_3d_hf_plan_resumes_with_bit_identical_losses(tmp_path: Path) -> None:
    """OLMo 2 under PP2 x TP2+SP (a 3-D plan: pp, tp and sp over 4 ranks): rank 3 exits at step 3, torchrun
    restarts the workers, they resume from the step-2 DCP checkpoint (model-wide layer names) and end
    with the losses and the weights of an uninterrupted run, bit for bit."""
    from test_executor_run import _final_state, autopar_run

    config = four_layers("olmo2")
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = plan_of("olmo2", {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b"})
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    common = [str(tmp_path / "plan.json"), "--hf-config", str(tmp_path / "config.json"), "--steps", "5",
              "--checkpoint-every", "2", "--profile-steps", "0"]
    marker = tmp_path / "died"
    r = autopar_run(*common, "--checkpoint-dir", str(tmp_path / "a"), "--max-restarts", "1", "--out",
                    str(tmp_path / "a.json"), env=child_env(AUTOPAR_TEST_DIE=f"3:3:{marker}"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert marker.exists() and "continuing at step 2" in r.stdout, r.stdout[-3000:]
    r = autopar_run(*common, "--checkpoint-dir", str(tmp_path / "b"), "--out", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = _final_state(tmp_path / "a" / "step_4"), _final_state(tmp_path / "b" / "step_4")
    assert set(a["model"]) == set(b["model"]) and "model.layers.3.self_attn.q_norm.weight" in b["model"]
    for name in b["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    losses = [[s.loss for s in RunReport.model_validate_json((tmp_path / f).read_text()).steps]
              for f in ("a.json", "b.json")]
    assert losses[0] == losses[1]

"""Plans, launches and references shared by tests/test_executor_run.py and test_executor_checkpoint.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from planner.contracts import ModelSpec, ParallelLayout, Plan, TrainingConfig
from planner.reference import reference_profile
from planner.tune import plan_for

ROOT = Path(__file__).resolve().parents[2]
SEQ, GBS = 16, 8
SPEC = ModelSpec(name="tiny", num_layers=4, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=64, vocab_size=64)
TRAINING = TrainingConfig(seq_length=SEQ, global_batch_size=GBS, precision="fp32")


def profile_for(num_ranks: int):
    base = reference_profile("dgx-a100-80gb", 1)
    return base.model_copy(update={"gpus_per_node": num_ranks, "name": f"test-{num_ranks}"})


def write_plan(path: Path, **layout: object) -> Plan:
    lay = ParallelLayout(**layout)
    plan = plan_for(SPEC, TRAINING, lay, profile_for(lay.num_gpus))
    path.write_text(plan.model_dump_json(indent=2))
    return plan


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def torchrun_worker(plan: Path, nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N -m executor.train --plan PLAN ARGS`` (asserts success)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "executor.train", "--plan", str(plan), *args]
    r = subprocess.run(cmd, check=False, env=child_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def reference_losses(steps: int, seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 losses of the tiny model and its final weights (executor.reference)."""
    from executor.data import SyntheticTokens
    from executor.reference import reference_run

    res = reference_run(SPEC, SyntheticTokens(SPEC.vocab_size, SEQ, seed), steps=steps, global_batch=GBS,
                        micro_batch_size=1, seed=seed)
    return res.losses, res.final_state

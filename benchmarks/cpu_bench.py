"""What the CPU benchmarks of the executor share (``benchmarks/executor.py``, ``benchmarks/run_calibration.py``):
the small model and training they run, the layouts they compare, and running torchrun on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.contracts import ClusterProfile, ModelSpec, TrainingConfig  # noqa: E402

SPEC = ModelSpec(name="bench", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=192, vocab_size=256)
TRAINING = TrainingConfig(seq_length=64, global_batch_size=16, precision="fp32")
LAYOUTS = {
    "dp4": {"dp_shard": 4}, "zero1": {"dp_shard": 4, "zero_stage": 1}, "zero2": {"dp_shard": 4, "zero_stage": 2},
    "zero3": {"dp_shard": 4, "zero_stage": 3}, "dp4-mb2": {"dp_shard": 4, "micro_batch_size": 2},
    "tp2dp2": {"dp_shard": 2, "tp": 2}, "tp2dp2-sp": {"dp_shard": 2, "tp": 2, "sp": True}, "tp4": {"tp": 4},
    "pp2dp2": {"pp": 2, "dp_shard": 2}, "pp4-mb2": {"pp": 4, "micro_batch_size": 2}, "pp2tp2": {"pp": 2, "tp": 2},
    "hsdp": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3},
}


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # and packages found there
    return {**clean, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}


def torchrun(nproc: int, *args: str) -> None:
    """Run under ``torchrun --standalone`` on ``nproc`` ranks; SystemExit with the end of its errors if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    r = subprocess.run(cmd, check=False, env=env(), capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{r.stderr[-3000:]}")


def cpu_profile(path: str | None, tmp: Path) -> ClusterProfile:
    """The profile at ``path``, or this machine's (``autopar profile --quick`` on 4 ranks)."""
    if path:
        return ClusterProfile.model_validate_json(Path(path).read_text())
    out = tmp / "profile.json"
    print("profiling this machine: autopar profile --quick under torchrun (4 ranks) ...", flush=True)
    t0 = time.perf_counter()
    torchrun(4, str(Path(sys.executable).parent / "autopar"), "profile", "--quick", "--out", str(out))
    print(f"    done in {time.perf_counter() - t0:.0f} s")
    return ClusterProfile.model_validate_json(out.read_text())

"""Hugging Face models under pipeline plans through the worker's own Runtime, every case in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node 4 hf_pipeline_check.py OUT_DIR [CASE ...]

For each case of :data:`CASES` (all when none are named) every rank builds :class:`executor.train.Runtime`
for the case's plan (the family's tiny config with 4 layers, random weights from the seed) exactly as
``autopar run`` does, runs :data:`STEPS` optimizer steps and writes OUT_DIR/<case>/rank<r>.pt: the step
losses and its parts' first-step gradients by plan-independent name (``Runtime.full_grads``).
tests/test_executor_hf_pipeline.py compares them with :func:`executor.reference.reference_run`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_grads_check import CONFIGS  # noqa: E402
from run_plans import profile_for  # noqa: E402

from executor.train import RunOptions, Runtime  # noqa: E402
from planner.contracts import ParallelLayout, Plan, TrainingConfig  # noqa: E402
from planner.hf_config import model_spec_from_hf_config  # noqa: E402
from planner.tune import plan_for  # noqa: E402

SEQ, GBS, STEPS = 16, 8, 2
TRAINING = TrainingConfig(seq_length=SEQ, global_batch_size=GBS, precision="fp32")
CASES: dict[str, tuple[str, dict]] = {  # name -> (family, layout fields); every case runs on 4 ranks
    "llama_pp4_gpipe": ("llama", {"pp": 4, "schedule": "gpipe"}),
    "llama_pp2_fsdp2_zero_bubble": ("llama", {"pp": 2, "dp_shard": 2, "zero_stage": 3, "schedule": "zero_bubble"}),
    "qwen3_pp2_zero2_zero_bubble": ("qwen3", {"pp": 2, "dp_shard": 2, "zero_stage": 2, "schedule": "zero_bubble"}),
    "gemma2_pp2_dp2_1f1b": ("gemma2", {"pp": 2, "dp_replicate": 2, "schedule": "1f1b"}),
    "qwen3_pp2_dp2_zero_bubble": ("qwen3", {"pp": 2, "dp_replicate": 2, "schedule": "zero_bubble"}),
    "granite_pp2_fsdp2_interleaved": ("granite", {"pp": 2, "dp_shard": 2, "zero_stage": 3,
                                                  "schedule": "interleaved_1f1b", "virtual_stages": 2}),
    "olmo2_pp2_tp2_sp_uneven": ("olmo2", {"pp": 2, "tp": 2, "sp": True, "schedule": "1f1b",
                                          "layers_per_stage": [1, 3]}),
    "gemma3_pp2_dp2_recompute": ("gemma3", {"pp": 2, "dp_shard": 2, "zero_stage": 1, "schedule": "1f1b",
                                            "recompute": "full"}),
    "mixtral_pp2_fsdp2_1f1b": ("mixtral", {"pp": 2, "dp_shard": 2, "zero_stage": 3, "schedule": "1f1b"}),
    "qwen3_moe_pp2_ep2_1f1b": ("qwen3_moe", {"pp": 2, "dp_shard": 2, "ep": 2, "schedule": "1f1b"}),
    "mixtral_pp2_tp2_sp_1f1b": ("mixtral", {"pp": 2, "tp": 2, "sp": True, "etp": 1, "schedule": "1f1b"}),
    "gemma3_pp2_cp2_1f1b": ("gemma3", {"pp": 2, "cp": 2, "schedule": "1f1b"}),
    "deepseek_v3_pp2_cp2_gpipe": ("deepseek_v3", {"pp": 2, "cp": 2, "schedule": "gpipe",
                                                  "layers_per_stage": [1, 3]}),
}


def four_layers(family: str) -> dict:
    """The family's tiny config with 4 layers (a ``layer_types`` list repeated to match)."""
    config = {**CONFIGS[family], "num_hidden_layers": 4}
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"] * 2
    return config


def plan_of(family: str, fields: dict) -> Plan:
    spec = model_spec_from_hf_config(four_layers(family))
    lay = ParallelLayout(**fields, micro_batch_size=1)
    return plan_for(spec, TRAINING, lay, profile_for(lay.num_gpus))


def run_case(name: str, out: Path) -> None:
    family, fields = CASES[name]
    where = out / name
    if dist.get_rank() == 0:
        where.mkdir(parents=True, exist_ok=True)
        (where / "config.json").write_text(json.dumps(four_layers(family)))
    dist.barrier()
    rt = Runtime(plan_of(family, fields), RunOptions(steps=STEPS, warmup=0, hf_config=str(where / "config.json"),
                                                     profile_steps=0))
    losses, grads = [], None
    for step in range(STEPS):
        losses.append(rt.step(step))
        grads = grads if grads is not None else rt.full_grads()
        rt.optimizer.step()
    torch.save({"losses": losses, "grads": grads}, where / f"rank{rt.rank}.pt")
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for name in sys.argv[2:] or list(CASES):
        run_case(name, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

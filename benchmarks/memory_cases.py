"""The one-GPU memory cases ``memory_measure.py`` runs on a GPU and ``memory_check.py`` predicts.

Built-in Llama-style models (random weights), bf16 mixed precision with AdamW, one rank: every
data-parallel stage the executor implements (ZeRO-0 with autocast; ZeRO-2/3 with FSDP2 on a one-rank
mesh, which still gathers into separate unsharded buffers), each recompute kind, two micro-batch
sizes, and a 128k vocabulary where the loss's logits dominate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from planner.contracts import ClusterProfile, ModelSpec, ParallelLayout, Plan, TrainingConfig
from planner.cost.predict import predict
from planner.reference import reference_profile

GPU_1B = ModelSpec(name="llama-0.9b", num_layers=16, hidden_size=2048, num_attention_heads=16, num_kv_heads=8,
                   ffn_hidden_size=5632, vocab_size=32000)
GPU_3B = ModelSpec(name="llama-1.8b", num_layers=16, hidden_size=3072, num_attention_heads=24, num_kv_heads=8,
                   ffn_hidden_size=8192, vocab_size=32000)
WIDE_VOCAB = ModelSpec(name="llama-0.7b-v128k", num_layers=4, hidden_size=2048, num_attention_heads=16,
                       num_kv_heads=8, ffn_hidden_size=5632, vocab_size=128256)
TINY_SPEC = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=192, vocab_size=256)


def one_gpu_profile(system: str = "dgx-h100") -> ClusterProfile:
    """A reference profile of one GPU of ``system`` (the memory terms do not depend on the links)."""
    return reference_profile(system).model_copy(update={"gpus_per_node": 1, "num_nodes": 1})


def plan_of(model: ModelSpec, seq: int, gbs: int, profile: ClusterProfile, **layout) -> Plan:
    training = TrainingConfig(seq_length=seq, global_batch_size=gbs, precision="bf16")
    lay = ParallelLayout(**{"micro_batch_size": 1, **layout})
    return Plan(model=model, training=training, cluster=profile.name, num_gpus=1, layout=lay,
                precision=training.precision, prediction=predict(model, training, profile, lay))


def _cases(spec_rows: list[tuple[str, ModelSpec, int, int, dict]], system: str) -> Iterator[tuple[str, Plan]]:
    profile = one_gpu_profile(system)
    for name, model, seq, gbs, layout in spec_rows:
        yield name, plan_of(model, seq, gbs, profile, **layout)


ROWS: list[tuple[str, ModelSpec, int, int, dict]] = [
    ("1b-z0-none-mb1", GPU_1B, 4096, 2, {}),
    ("1b-z0-none-mb2", GPU_1B, 4096, 4, {"micro_batch_size": 2}),
    ("1b-z0-selective", GPU_1B, 4096, 2, {"recompute": "selective"}),
    ("1b-z0-full-mb4", GPU_1B, 4096, 4, {"recompute": "full", "micro_batch_size": 4}),
    ("1b-z2-none", GPU_1B, 4096, 2, {"zero_stage": 2}),
    ("1b-z3-reshard", GPU_1B, 4096, 2, {"zero_stage": 3}),
    ("1b-z3-keep", GPU_1B, 4096, 2, {"zero_stage": 3, "reshard_after_forward": False}),
    ("3b-z3-reshard-full", GPU_3B, 8192, 2, {"zero_stage": 3, "recompute": "full"}),
    ("3b-z3-keep-full", GPU_3B, 8192, 2, {"zero_stage": 3, "reshard_after_forward": False, "recompute": "full"}),
    ("3b-z0-selective", GPU_3B, 4096, 2, {"recompute": "selective"}),
    ("v128k-z0-none-s8k", WIDE_VOCAB, 8192, 2, {}),
    ("v128k-z3-full-s8k", WIDE_VOCAB, 8192, 2, {"zero_stage": 3, "recompute": "full"}),
]

TINY_ROWS = [("tiny-z0", TINY_SPEC, 64, 2, {}), ("tiny-z3-keep", TINY_SPEC, 64, 2,
                                                  {"zero_stage": 3, "reshard_after_forward": False})]


def CASES(system: str = "dgx-h100") -> Iterator[tuple[str, Plan]]:  # noqa: N802 - the case list
    return _cases(ROWS, system)


def TINY(system: str = "dgx-h100") -> Iterator[tuple[str, Plan]]:  # noqa: N802
    return _cases(TINY_ROWS, system)


CaseList = Callable[[str], Iterator[tuple[str, Plan]]]

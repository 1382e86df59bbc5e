"""planner/export/: plans exported as Megatron-LM, DeepSpeed (Megatron-DeepSpeed) and torchtitan
launch files.

Plans are built without the search: a fixed ParallelLayout, ``predict`` for the prediction. Shell scripts
are run under bash with a stand-in ``torchrun`` that prints its argv, so the flags checked are exactly
what the framework would receive after shell quoting.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
from typing import ClassVar

import pytest

from planner.contracts import (
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Plan,
    Precision,
    StageRecompute,
    TrainingConfig,
)
from planner.cost.predict import predict
from planner.errors import AutoparError, UnknownNameError
from planner.export import TARGETS, export_plan
from planner.presets import get_preset
from planner.reference import reference_profile

BASH = shutil.which("bash")


def make_plan(
    model: str | ModelSpec = "llama3-8b",
    gpus: int = 16,
    gbs: int = 64,
    seq: int = 4096,
    precision: Precision = Precision.bf16,
    training: dict | None = None,
    **layout,
) -> Plan:
    spec = get_preset(model) if isinstance(model, str) else model
    train = TrainingConfig(seq_length=seq, global_batch_size=gbs, precision=precision, **(training or {}))
    profile = reference_profile("dgx-h100", max(1, gpus // 8))
    lay = ParallelLayout(**layout)
    return Plan(
        model=spec,
        training=train,
        cluster="dgx-h100",
        num_gpus=gpus,
        layout=lay,
        precision=precision,
        prediction=predict(spec, train, profile, lay),
    )


def run_script(text: str, tmp_path, env: dict[str, str] | None = None) -> list[str]:
    """Run an exported script with a fake torchrun; return the argv torchrun received."""
    if BASH is None:
        pytest.skip("bash is not installed")
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    torchrun = fake / "torchrun"
    torchrun.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\n\' "$a"; done\n')
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "launch.sh"
    script.write_text(text)
    full_env = {"PATH": f"{fake}:{os.environ.get('PATH', '/usr/bin:/bin')}", **(env or {})}
    out = subprocess.run([BASH, str(script)], capture_output=True, text=True, env=full_env, check=True)
    return out.stdout.splitlines()


def flags(argv: list[str]) -> dict[str, list[str]]:
    """``--flag v1 v2`` -> {"--flag": ["v1", "v2"]}; asserts that no flag is given twice."""
    out: dict[str, list[str]] = {}
    current = None
    for word in argv:
        if word.startswith("--"):
            assert word not in out, f"{word} given twice"
            out[word] = []
            current = word
        elif current is not None:
            out[current].append(word)
    return out


def one(f: dict[str, list[str]], flag: str) -> str:
    assert flag in f, f"{flag} missing"
    assert len(f[flag]) == 1, f"{flag} has values {f[flag]}"
    return f[flag][0]


def megatron_flags(plan: Plan, tmp_path) -> dict[str, list[str]]:
    return flags(run_script(export_plan(plan, "megatron")["megatron_args.sh"], tmp_path))


def deepspeed_files(plan: Plan, tmp_path) -> tuple[dict, dict[str, list[str]]]:
    files = export_plan(plan, "deepspeed")
    assert set(files) == {"ds_config.json", "megatron_deepspeed_args.sh"}
    argv = run_script(files["megatron_deepspeed_args.sh"], tmp_path, env={"DATA_PATH": "/data/tokens"})
    return json.loads(files["ds_config.json"]), flags(argv)


def titan_argv(plan: Plan) -> list[str]:
    """The torchtitan.train arguments of an exported torchtitan_train.sh."""
    files = export_plan(plan, "torchtitan")
    assert set(files) == {"torchtitan_train.sh"}
    text = files["torchtitan_train.sh"]
    return shlex.split(text[text.index("-m torchtitan.train") :].replace("\\\n", " "))[2:]


def titan(plan: Plan) -> dict[str, list[str]]:
    """{flag: values} of the overrides, with the activation-checkpoint subcommand under "ac"."""
    argv = titan_argv(plan)
    assert argv[-1].startswith("activation_checkpoint:")
    return flags(argv[:-1]) | {"ac": [argv[-1].split(":")[1]]}


def raises(plan: Plan, target: str, field: str, value: str) -> str:
    with pytest.raises(AutoparError) as info:
        export_plan(plan, target)
    assert info.value.field == field
    message = str(info.value)
    assert message.startswith(f"{field}="), message
    assert value in message, message
    return message


def megatron_layout_counts(layout: str) -> list[int]:
    """Transformer layers per stage of a --pipeline-model-parallel-layout string (Megatron's grammar)."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda x: x.group(1) * int(x.group(2)), text)
    stages = text.split("|")
    assert stages[0].startswith("E") and stages[-1].endswith("L") and text.count("E") == text.count("L") == 1
    return [s.count("t") for s in stages]


# ============================================================================================
# Megatron-LM
# ============================================================================================
class TestMegatron:
    def test_core_flags(self, tmp_path):
        plan = make_plan(
            tp=4, sp=True, pp=2, dp_shard=2, zero_stage=1, micro_batch_size=2, recompute="selective"
        )
        f = megatron_flags(plan, tmp_path)
        # launch: 16 GPUs = 2 nodes x 8
        assert one(f, "--nnodes") == "2" and one(f, "--nproc-per-node") == "8"
        # model
        assert one(f, "--num-layers") == "32" and one(f, "--hidden-size") == "4096"
        assert one(f, "--ffn-hidden-size") == "14336" and one(f, "--num-attention-heads") == "32"
        assert f["--group-query-attention"] == [] and one(f, "--num-query-groups") == "8"
        assert f["--swiglu"] == [] and one(f, "--normalization") == "RMSNorm"
        assert (
            one(f, "--position-embedding-type") == "rope" and f["--untie-embeddings-and-output-weights"] == []
        )
        assert one(f, "--seq-length") == "4096" and one(f, "--max-position-embeddings") == "4096"
        # batch and precision
        assert one(f, "--micro-batch-size") == "2" and one(f, "--global-batch-size") == "64"
        assert f["--bf16"] == [] and "--fp16" not in f and "--fp8-format" not in f
        # parallelism: dp = 16 / (tp 4 x pp 2 x cp 1) = 2
        assert one(f, "--tensor-model-parallel-size") == "4" and f["--sequence-parallel"] == []
        assert one(f, "--pipeline-model-parallel-size") == "2"
        assert "--context-parallel-size" not in f and "--expert-model-parallel-size" not in f
        assert 16 // (4 * 2 * 1) == plan.layout.dp
        assert (
            "--num-layers-per-virtual-pipeline-stage" not in f and "--pipeline-model-parallel-layout" not in f
        )
        assert f["--use-distributed-optimizer"] == [] and "--use-megatron-fsdp" not in f
        assert f["--overlap-grad-reduce"] == [] and f["--overlap-param-gather"] == []
        assert one(f, "--recompute-granularity") == "selective" and "--recompute-method" not in f
        # mock data with a NullTokenizer of the model's vocabulary (it adds one EOD token)
        assert f["--mock-data"] == [] and one(f, "--tokenizer-type") == "NullTokenizer"
        assert one(f, "--vocab-size") == str(128256 - 1)

    def test_script_sets_cuda_connections_and_passes_extra_args(self, tmp_path):
        text = export_plan(make_plan(tp=8, sp=True, dp_shard=2, zero_stage=1), "megatron")["megatron_args.sh"]
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
        assert text.startswith("#!/usr/bin/env bash\n# Generated by autopar")
        argv = run_script(text.replace('"$@"', '"$@" --seed 7'), tmp_path)
        assert argv[-2:] == ["--seed", "7"]

    def test_interleaved_sets_layers_per_virtual_stage(self, tmp_path):
        # 32 layers over pp=4 x 2 virtual stages = 4 layers per virtual stage
        plan = make_plan(tp=2, sp=True, pp=4, dp_shard=2, schedule="interleaved_1f1b", virtual_stages=2)
        f = megatron_flags(plan, tmp_path)
        assert one(f, "--pipeline-model-parallel-size") == "4"
        assert one(f, "--num-layers-per-virtual-pipeline-stage") == "4"
        assert "--pipeline-model-parallel-layout" not in f and "--decoder-first-pipeline-num-layers" not in f

    def test_uneven_first_and_last_stage(self, tmp_path):
        plan = make_plan(tp=4, sp=True, pp=4, layers_per_stage=[7, 9, 9, 7])
        f = megatron_flags(plan, tmp_path)
        assert one(f, "--decoder-first-pipeline-num-layers") == "7"
        assert one(f, "--decoder-last-pipeline-num-layers") == "7"
        assert "--pipeline-model-parallel-layout" not in f

    def test_default_split_that_is_not_even_is_written_out(self, tmp_path):
        # 32 layers over pp=3: the planner's default split is [10, 11, 11]
        plan = make_plan(gpus=24, tp=8, sp=True, pp=3)
        f = megatron_flags(plan, tmp_path)
        assert one(f, "--decoder-first-pipeline-num-layers") == "10"
        assert one(f, "--decoder-last-pipeline-num-layers") == "11"
        assert one(f, "--nnodes") == "3"

    def test_arbitrary_split_uses_layout(self, tmp_path):
        plan = make_plan(tp=4, sp=True, pp=4, layers_per_stage=[6, 10, 9, 7])
        f = megatron_flags(plan, tmp_path)
        layout = one(f, "--pipeline-model-parallel-layout")
        assert megatron_layout_counts(layout) == [6, 10, 9, 7]
        assert "--decoder-first-pipeline-num-layers" not in f

    def test_uneven_interleaved_uses_layout_in_stage_order(self, tmp_path):
        counts = [3, 4, 4, 4, 4, 4, 4, 5]  # stage chunk * pp + rank
        plan = make_plan(
            tp=2,
            sp=True,
            pp=4,
            dp_shard=2,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            layers_per_stage=counts,
        )
        f = megatron_flags(plan, tmp_path)
        assert megatron_layout_counts(one(f, "--pipeline-model-parallel-layout")) == counts
        assert "--num-layers-per-virtual-pipeline-stage" not in f

    def test_uniform_full_recompute(self, tmp_path):
        f = megatron_flags(make_plan(tp=8, sp=True, pp=2, recompute="full"), tmp_path)
        assert one(f, "--recompute-granularity") == "full"
        assert one(f, "--recompute-method") == "uniform" and one(f, "--recompute-num-layers") == "1"

    def test_equal_partial_recompute_per_stage_is_block(self, tmp_path):
        per_stage = [StageRecompute(kind="full", num_layers=4), StageRecompute(kind="full", num_layers=4)]
        f = megatron_flags(make_plan(tp=8, sp=True, pp=2, recompute_per_stage=per_stage), tmp_path)
        assert one(f, "--recompute-method") == "block" and one(f, "--recompute-num-layers") == "4"

    def test_block_recompute_counts_per_model_chunk(self, tmp_path):
        # 2 chunks of 4 layers per rank; 4 recomputed layers per rank = the first 2 of each chunk
        per_stage = [StageRecompute(kind="full", num_layers=4)] * 4
        plan = make_plan(
            tp=2,
            sp=True,
            pp=4,
            dp_shard=2,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            recompute_per_stage=per_stage,
        )
        f = megatron_flags(plan, tmp_path)
        assert one(f, "--recompute-method") == "block" and one(f, "--recompute-num-layers") == "2"

    def test_recompute_that_differs_between_stages_is_rejected(self):
        per_stage = [StageRecompute(kind="full", num_layers=4), StageRecompute(kind="full", num_layers=2)]
        msg = raises(
            make_plan(tp=8, sp=True, pp=2, recompute_per_stage=per_stage),
            "megatron",
            "recompute_per_stage",
            "full:4, full:2",
        )
        assert "every stage" in msg

    def test_mixed_recompute_kinds_are_rejected(self):
        per_stage = [StageRecompute(kind="full"), StageRecompute(kind="selective")]
        raises(
            make_plan(tp=8, sp=True, pp=2, recompute_per_stage=per_stage),
            "megatron",
            "recompute_per_stage",
            "selective",
        )

    def test_context_and_expert_parallel(self, tmp_path):
        f = megatron_flags(make_plan(tp=4, sp=True, cp=2, dp_shard=2, zero_stage=1), tmp_path)
        assert one(f, "--context-parallel-size") == "2" and one(f, "--cp-comm-type") == "p2p"
        moe = make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, zero_stage=1)
        f = megatron_flags(moe, tmp_path)
        assert one(f, "--num-experts") == "8" and one(f, "--moe-router-topk") == "2"
        assert one(f, "--expert-model-parallel-size") == "8" and one(f, "--moe-ffn-hidden-size") == "14336"
        assert one(f, "--moe-token-dispatcher-type") == "alltoall" and "--moe-layer-freq" not in f
        assert one(f, "--vocab-size") == str(32000 - 1)
        assert one(f, "--expert-tensor-parallel-size") == "2"  # etp unset: the experts split over tp, stated

    def test_expert_tensor_parallel_size(self, tmp_path):
        # MoE parallel folding: ep=8 x etp=1 over the dp=8 x tp=2 ranks (ep=8 does not divide dp x cp alone)
        folded = make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, etp=1, zero_stage=1)
        f = megatron_flags(folded, tmp_path)
        assert one(f, "--expert-tensor-parallel-size") == "1" and one(f, "--expert-model-parallel-size") == "8"
        assert one(f, "--tensor-model-parallel-size") == "2" and f["--sequence-parallel"] == []
        # without EP the experts fold too (whole experts on every rank of the TP group), through the
        # all-to-all dispatcher the plan priced
        f = megatron_flags(make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, etp=1, zero_stage=1), tmp_path)
        assert one(f, "--expert-tensor-parallel-size") == "1" and "--expert-model-parallel-size" not in f
        assert one(f, "--moe-token-dispatcher-type") == "alltoall"
        # and with the experts split over tp (etp unset, ep 1): the plan priced the all-to-all dispatcher's
        # gathered routed rows, not Megatron's default allgather dispatcher
        f = megatron_flags(make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, zero_stage=1), tmp_path)
        assert one(f, "--moe-token-dispatcher-type") == "alltoall"
        # a dense model writes none
        assert "--expert-tensor-parallel-size" not in megatron_flags(make_plan(tp=2, sp=True, dp_shard=8), tmp_path)
        # Megatron-Core keeps MoE biases to ETP 1
        biased = get_preset("mixtral-8x7b").model_copy(update={"linear_bias": True})
        raises(make_plan(biased, tp=2, sp=True, dp_shard=8, ep=8, zero_stage=1), "megatron", "etp", "2")

    def test_moe_layer_pattern_and_shared_experts(self, tmp_path):
        spec = ModelSpec(
            name="tiny-moe",
            num_layers=9,
            hidden_size=1024,
            num_attention_heads=16,
            ffn_hidden_size=4096,
            vocab_size=32000,
            moe=MoESpec(
                num_experts=8,
                top_k=2,
                expert_ffn_hidden_size=512,
                num_shared_experts=2,
                first_dense_layers=1,
                layer_frequency=2,
            ),
        )
        f = megatron_flags(
            make_plan(spec, gpus=8, gbs=16, seq=2048, tp=1, dp_shard=8, ep=4, zero_stage=1), tmp_path
        )
        pattern = one(f, "--moe-layer-freq")
        assert re.fullmatch(r"[\d\[\]\(\)\+\*,]+", pattern)  # the characters Megatron's parser accepts
        assert eval(pattern) == [int(spec.is_moe_layer(i)) for i in range(9)]  # safe: checked just above
        assert one(f, "--moe-shared-expert-intermediate-size") == str(2 * 512)

    def test_precision_flags(self, tmp_path):
        f = megatron_flags(make_plan(tp=8, sp=True, dp_shard=2, precision=Precision.fp8), tmp_path)
        assert f["--bf16"] == [] and one(f, "--fp8-format") == "hybrid"
        f = megatron_flags(make_plan(tp=8, sp=True, dp_shard=2, precision=Precision.fp16), tmp_path)
        assert f["--fp16"] == [] and "--bf16" not in f and f["--accumulate-allreduce-grads-in-fp32"] == []
        f = megatron_flags(
            make_plan(tp=8, sp=True, dp_shard=2, training={"grad_reduce_in_fp32": False}), tmp_path
        )
        assert f["--grad-reduce-in-bf16"] == []

    def test_hybrid_sharded_distributed_optimizer(self, tmp_path):
        f = megatron_flags(make_plan(tp=4, sp=True, dp_replicate=2, dp_shard=2, zero_stage=1), tmp_path)
        assert (
            f["--use-distributed-optimizer"] == [] and one(f, "--num-distributed-optimizer-instances") == "2"
        )

    def test_zero3_without_pipeline_is_megatron_fsdp(self, tmp_path):
        plan = make_plan(tp=2, sp=True, dp_shard=8, zero_stage=3)
        text = export_plan(plan, "megatron")["megatron_args.sh"]
        f = flags(run_script(text, tmp_path))
        assert (
            f["--use-megatron-fsdp"] == []
            and one(f, "--data-parallel-sharding-strategy") == "optim_grads_params"
        )
        assert one(f, "--ckpt-format") == "fsdp_dtensor" and f["--use-distributed-optimizer"] == []
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" not in text
        f = megatron_flags(make_plan(tp=2, sp=True, dp_shard=8, zero_stage=2), tmp_path)
        assert one(f, "--data-parallel-sharding-strategy") == "optim_grads"

    def test_hybrid_sharded_megatron_fsdp(self, tmp_path):
        # ZeRO-2/3 with dp_replicate > 1: Megatron-FSDP's HSDP (num_distributed_optimizer_instances > 1,
        # megatron/core/distributed/fsdp/mcore_fsdp_adapter.py, Megatron Core >= 0.14)
        for zero, strategy in ((3, "optim_grads_params"), (2, "optim_grads")):
            plan = make_plan(tp=2, sp=True, dp_replicate=2, dp_shard=4, zero_stage=zero)
            f = megatron_flags(plan, tmp_path)
            assert f["--use-megatron-fsdp"] == [] and one(f, "--data-parallel-sharding-strategy") == strategy
            assert one(f, "--num-distributed-optimizer-instances") == "2"
        f = megatron_flags(make_plan(tp=2, sp=True, dp_shard=8, zero_stage=3), tmp_path)
        assert "--num-distributed-optimizer-instances" not in f

    def test_no_dp_overlap_flags_when_planned_without_overlap(self, tmp_path):
        f = megatron_flags(
            make_plan(tp=4, sp=True, pp=2, dp_shard=2, zero_stage=1, dp_comm_overlap=False), tmp_path
        )
        assert "--overlap-grad-reduce" not in f and "--overlap-param-gather" not in f

    def test_optimizer_offload(self, tmp_path):
        f = megatron_flags(
            make_plan(tp=8, sp=True, dp_shard=2, zero_stage=1, offload_optimizer=True), tmp_path
        )
        assert f["--optimizer-cpu-offload"] == [] and f["--use-precision-aware-optimizer"] == []
        raises(
            make_plan(tp=8, sp=True, dp_shard=2, zero_stage=0, offload_optimizer=True),
            "megatron",
            "offload_optimizer",
            "True",
        )

    def test_tp_comm_overlap(self, tmp_path):
        f = megatron_flags(make_plan(tp=8, sp=True, dp_shard=2, tp_comm_overlap=True), tmp_path)
        assert f["--tp-comm-overlap"] == []
        raises(
            make_plan(tp=8, sp=False, dp_shard=2, tp_comm_overlap=True), "megatron", "tp_comm_overlap", "True"
        )

    def test_rejections(self):
        msg = raises(make_plan(tp=4, sp=True, pp=2, dp_shard=2, zero_stage=3), "megatron", "zero_stage", "3")
        assert "pipeline" in msg
        raises(make_plan(tp=8, sp=True, pp=2, schedule="zero_bubble"), "megatron", "schedule", "zero_bubble")
        raises(make_plan(tp=8, sp=True, pp=2, schedule="gpipe"), "megatron", "schedule", "gpipe")
        raises(
            make_plan(tp=2, sp=True, dp_shard=8, zero_stage=3, reshard_after_forward=False),
            "megatron",
            "reshard_after_forward",
            "False",
        )
        raises(make_plan("mixtral-8x7b", tp=2, sp=False, dp_shard=8, ep=8), "megatron", "sp", "False")

    def test_unsplittable_kv_heads_are_rejected(self):
        # llama3-8b has 8 KV heads; the planner allows tp=16 (KV heads replicated), the frameworks do not
        plan = make_plan(gpus=16, tp=16, sp=True)
        for target in TARGETS:
            raises(plan, target, "tp", "16")


# ============================================================================================
# DeepSpeed (Megatron-DeepSpeed)
# ============================================================================================
class TestDeepSpeed:
    def test_config_and_args(self, tmp_path):
        plan = make_plan(
            tp=2,
            sp=True,
            pp=2,
            dp_shard=4,
            zero_stage=1,
            micro_batch_size=2,
            dp_comm_overlap=False,
            recompute="full",
        )
        cfg, f = deepspeed_files(plan, tmp_path)
        # batch: dp = 16 / (2 x 2) = 4; accumulation = 64 / (2 x 4) = 8
        assert cfg["train_batch_size"] == 64 and cfg["train_micro_batch_size_per_gpu"] == 2
        assert cfg["gradient_accumulation_steps"] == 8
        assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
        assert cfg["zero_optimization"]["stage"] == 1 and cfg["zero_optimization"]["overlap_comm"] is False
        assert "offload_optimizer" not in cfg["zero_optimization"]
        # sequence parallel: each rank sends its own shard; DeepSpeed's partitioning would mix the ranks' shards
        assert cfg["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
        assert any("num_gpus=16" in line for line in cfg["_autopar"])
        # Megatron-DeepSpeed arguments
        assert one(f, "--tensor-model-parallel-size") == "2" and f["--sequence-parallel"] == []
        assert one(f, "--pipeline-model-parallel-size") == "2" and "--no-pipeline-parallel" not in f
        assert one(f, "--micro-batch-size") == "2" and one(f, "--global-batch-size") == "64"
        assert one(f, "--zero-stage") == "1" and f["--bf16"] == []
        assert one(f, "--num-key-value-heads") == "8" and f["--use-rotary-position-embeddings"] == []
        assert one(f, "--normalization") == "rmsnorm" and f["--swiglu"] == []
        assert one(f, "--recompute-granularity") == "full" and one(f, "--recompute-method") == "uniform"
        assert one(f, "--recompute-num-layers") == "1"
        assert f["--deepspeed"] == [] and one(f, "--deepspeed_config") == "ds_config.json"
        assert one(f, "--data-path") == "/data/tokens" and one(f, "--nnodes") == "2"

    def test_zero3_offload_without_pipeline(self, tmp_path):
        plan = make_plan(
            tp=2, sp=True, dp_shard=8, zero_stage=3, offload_optimizer=True, recompute="selective"
        )
        cfg, f = deepspeed_files(plan, tmp_path)
        zero = cfg["zero_optimization"]
        assert zero["stage"] == 3 and zero["overlap_comm"] is True
        assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
        assert "pipeline" not in cfg and cfg["gradient_accumulation_steps"] == 64 // 8
        assert (
            f["--no-pipeline-parallel"] == [] and f["--cpu-optimizer"] == [] and one(f, "--zero-stage") == "3"
        )
        assert one(f, "--recompute-granularity") == "selective"

    def test_zero_bubble_is_zbh1(self, tmp_path):
        plan = make_plan(tp=2, pp=4, dp_shard=2, schedule="zero_bubble", dp_comm_overlap=False)
        _, f = deepspeed_files(plan, tmp_path)
        assert f["--enable-zbh1-pipeline"] == []
        raises(
            make_plan(tp=2, sp=True, pp=4, dp_shard=2, schedule="zero_bubble", dp_comm_overlap=False),
            "deepspeed",
            "sp",
            "True",
        )

    def test_moe_without_pipeline(self, tmp_path):
        plan = make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, zero_stage=1)
        _, f = deepspeed_files(plan, tmp_path)
        assert (
            one(f, "--num-experts") == "8" and one(f, "--topk") == "2" and one(f, "--expert-interval") == "1"
        )
        assert one(f, "--moe-expert-parallel-size") == "8" and f["--disable-moe-token-dropping"] == []
        assert f["--enable-expert-tensor-parallelism"] == []  # experts split over tp=2, as planned (etp = tp)
        _, f = deepspeed_files(make_plan("mixtral-8x7b", dp_shard=16, ep=8, zero_stage=1), tmp_path)
        assert "--enable-expert-tensor-parallelism" not in f
        message = raises(make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, etp=1, zero_stage=1),
                         "deepspeed", "etp", "1")
        assert "tp=2" in message and "--to megatron" in message
        raises(
            make_plan(
                "mixtral-8x7b", tp=2, sp=True, pp=2, dp_shard=4, ep=4, zero_stage=1, dp_comm_overlap=False
            ),
            "deepspeed",
            "pp",
            "2",
        )

    def test_fp16(self, tmp_path):
        cfg, f = deepspeed_files(
            make_plan(tp=8, sp=True, dp_shard=2, zero_stage=1, precision=Precision.fp16), tmp_path
        )
        assert cfg["fp16"]["enabled"] is True and "bf16" not in cfg and f["--fp16"] == []

    def test_rejections(self):
        raises(
            make_plan(
                tp=2,
                sp=True,
                pp=4,
                dp_shard=2,
                schedule="interleaved_1f1b",
                virtual_stages=2,
                dp_comm_overlap=False,
            ),
            "deepspeed",
            "schedule",
            "interleaved_1f1b",
        )
        msg = raises(
            make_plan(tp=4, sp=True, pp=2, dp_shard=2, zero_stage=2, dp_comm_overlap=False),
            "deepspeed",
            "zero_stage",
            "2",
        )
        assert "pipeline" in msg
        raises(make_plan(tp=4, sp=True, cp=2, dp_shard=2, zero_stage=1), "deepspeed", "cp", "2")
        raises(
            make_plan(tp=4, sp=True, pp=4, layers_per_stage=[7, 9, 9, 7], dp_comm_overlap=False),
            "deepspeed",
            "layers_per_stage",
            "[7, 9, 9, 7]",
        )
        raises(
            make_plan(tp=2, sp=True, pp=2, dp_shard=4, zero_stage=1), "deepspeed", "dp_comm_overlap", "True"
        )
        raises(
            make_plan(tp=4, sp=True, dp_replicate=2, dp_shard=2, zero_stage=1),
            "deepspeed",
            "dp_replicate",
            "2",
        )
        raises(
            make_plan(tp=8, sp=True, dp_shard=2, precision=Precision.fp8, zero_stage=1),
            "deepspeed",
            "precision",
            "fp8",
        )
        raises(
            make_plan(tp=8, sp=True, dp_shard=2, zero_stage=1, tp_comm_overlap=True),
            "deepspeed",
            "tp_comm_overlap",
            "True",
        )
        per_stage = [StageRecompute(kind="full", num_layers=4), StageRecompute(kind="full", num_layers=4)]
        raises(
            make_plan(tp=8, sp=True, pp=2, recompute_per_stage=per_stage),
            "deepspeed",
            "recompute_per_stage",
            "full:4",
        )


# ============================================================================================
# torchtitan
# ============================================================================================
class TestTorchtitan:
    def test_hsdp_tp_full_recompute(self):
        f = titan(
            make_plan(
                tp=2, sp=True, dp_replicate=2, dp_shard=4, zero_stage=3, micro_batch_size=2, recompute="full"
            )
        )
        assert one(f, "--module") == "llama3" and one(f, "--config") == "llama3_8b"
        assert one(f, "--training.local_batch_size") == "2" and one(f, "--training.global_batch_size") == "64"
        assert (
            one(f, "--training.seq_len") == "4096"
            and one(f, "--training.mixed_precision_param") == "bfloat16"
        )
        assert one(f, "--parallelism.data_parallel_replicate_degree") == "2"
        assert one(f, "--parallelism.data_parallel_shard_degree") == "4"
        assert one(f, "--parallelism.tensor_parallel_degree") == "2"
        assert one(f, "--parallelism.pipeline_parallel_degree") == "1"
        assert one(f, "--parallelism.fsdp_reshard_after_forward") == "always"
        assert "--compile.enable" not in f and "--parallelism.module_fqns_per_model_part" not in f
        assert "--training.disable_cuda_graphs" not in f and f["ac"] == ["full"]

    def test_uneven_pipeline_split(self):
        f = titan(
            make_plan(
                tp=4,
                sp=True,
                pp=2,
                dp_shard=2,
                zero_stage=3,
                layers_per_stage=[15, 17],
                reshard_after_forward=False,
            )
        )
        assert one(f, "--parallelism.pipeline_parallel_schedule") == "1F1B"
        assert one(f, "--parallelism.pipeline_parallel_microbatch_size") == "1"
        assert one(f, "--parallelism.fsdp_reshard_after_forward") == "never"
        parts = [p.split(",") for p in f["--parallelism.module_fqns_per_model_part"]]
        assert parts[0] == ["tok_embeddings"] + [f"layers.{i}" for i in range(15)]
        assert parts[1] == [f"layers.{i}" for i in range(15, 32)] + ["norm", "lm_head"]
        # the whole per-rank batch is split into pipeline micro-batches: 64 / dp 2 = 32
        assert one(f, "--training.local_batch_size") == "32" and f["ac"] == ["none"]
        assert f["--training.disable_cuda_graphs"] == []  # CUDA graphs refuse pipeline parallelism

    def test_interleaved_pipeline(self):
        f = titan(
            make_plan(
                tp=2, sp=True, pp=4, dp_shard=2, zero_stage=3, schedule="interleaved_1f1b", virtual_stages=2
            )
        )
        assert one(f, "--parallelism.pipeline_parallel_schedule") == "Interleaved1F1B"
        assert one(f, "--parallelism.pipeline_parallel_degree") == "4"
        parts = [p.split(",") for p in f["--parallelism.module_fqns_per_model_part"]]
        assert len(parts) == 8 and parts[3] == [f"layers.{i}" for i in range(12, 16)]
        assert [n for part in parts for n in part if n.startswith("layers.")] == [
            f"layers.{i}" for i in range(32)
        ]

    @pytest.mark.parametrize(("schedule", "name"), [("zero_bubble_v", "ZBVZeroBubble"), ("dualpipe_v", "DualPipeV")])
    def test_v_schedules_keep_the_stage_order_torchtitan_places_in_a_v(self, schedule, name):
        f = titan(make_plan(tp=2, sp=True, pp=4, dp_shard=2, zero_stage=3, schedule=schedule, virtual_stages=2))
        assert one(f, "--parallelism.pipeline_parallel_schedule") == name
        parts = [p.split(",") for p in f["--parallelism.module_fqns_per_model_part"]]
        # stage order: torchtitan puts stages r and 2pp-1-r on rank r itself (style "v")
        assert len(parts) == 8 and parts[0][0] == "tok_embeddings" and parts[7][-1] == "lm_head"

    def test_gpipe_and_ddp(self):
        f = titan(make_plan(tp=8, sp=True, pp=2, schedule="gpipe"))
        assert one(f, "--parallelism.pipeline_parallel_schedule") == "GPipe"
        f = titan(make_plan(tp=2, sp=True, dp_shard=8, zero_stage=0))
        assert one(f, "--parallelism.data_parallel_replicate_degree") == "8"
        assert one(f, "--parallelism.data_parallel_shard_degree") == "1"

    def test_async_tp_compiles_the_model(self):
        f = titan(make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3, tp_comm_overlap=True))
        assert f["--compile.enable"] == [] and f["--compile.enable_async_tensor_parallel"] == []
        assert one(f, "--compile.components") == "model,loss"

    def test_context_and_expert_parallel(self):
        f = titan(make_plan(tp=4, sp=True, cp=2, dp_shard=2, zero_stage=3))
        assert one(f, "--parallelism.context_parallel_degree") == "2"
        plan = make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, etp=1, zero_stage=3)
        f = titan(plan)
        assert one(f, "--parallelism.expert_parallel_degree") == "8"
        # torchtitan runs expert-parallel experts whole: experts split over tp=2 (etp unset) are refused
        message = raises(plan.model_copy(update={"layout": plan.layout.model_copy(update={"etp": None})}),
                         "torchtitan", "etp", "2")
        assert "etp=1" in message
        assert f["--training.disable_cuda_graphs"] == []  # CUDA graphs refuse EP's token dispatcher
        assert one(f, "--module") == "deepseek_v3" and one(f, "--config") == "autopar_mixtral_8x7b"
        text = export_plan(plan, "torchtitan")["torchtitan_train.sh"]
        assert (
            "add a function\n# autopar_mixtral_8x7b() to torchtitan/models/deepseek_v3/config_registry.py"
            in text
        )

    def test_a_registry_entry_to_add_names_what_llama3_blocks_lack(self):
        """A model unlike torchtitan's llama3 blocks: the note says what the entry must build (or the run would
        train another model); a Llama needs nothing said."""
        qwen2 = get_preset("llama3-8b").model_copy(update={"name": "qwen2-like", "qkv_bias": True})
        plan = make_plan(qwen2, tp=8, sp=True, dp_shard=2, zero_stage=3)
        text = export_plan(plan, "torchtitan")["torchtitan_train.sh"]
        assert "bias on wq, wk, wv" in text
        gpt = export_plan(make_plan("gpt3-1.3b", gpus=8, gbs=16, seq=2048, tp=2, sp=True, dp_shard=4, zero_stage=3),
                          "torchtitan")["torchtitan_train.sh"]
        facts = ("norm=layernorm", "position_embedding=learned", "ffn=gelu", "bias on every linear")
        assert all(f in gpt for f in facts)
        assert not any(f in export_plan(make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3, precision=Precision.fp8),
                                        "torchtitan")["torchtitan_train.sh"] for f in ("norm=", "bias on"))

    def test_float8_and_adam_come_from_a_registry_entry(self):
        plan = make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3, precision=Precision.fp8)
        f = titan(plan)
        assert one(f, "--config") == "autopar_llama3_8b_float8"  # llama3_8b has no float8 converter
        text = export_plan(plan, "torchtitan")["torchtitan_train.sh"]
        assert "converters=[Float8LinearConverter.Config()]" in text
        plan = make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3, training={"optimizer": "adam"})
        assert (
            "optimizer is adam: set optimizer.param_groups"
            in export_plan(plan, "torchtitan")["torchtitan_train.sh"]
        )

    def test_async_tp_off_is_written_since_registry_entries_may_turn_it_on(self):
        f = titan(make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3, tp_comm_overlap=False))
        assert f["--compile.no-enable_async_tensor_parallel"] == [] and "--compile.enable" not in f
        assert f["--compile.no-enable"] == []  # priced eager (the loss at 12 B per logit): written off

    def test_a_compiled_plan_compiles_model_and_loss(self):
        f = titan(make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3, compile=True))
        assert f["--compile.enable"] == [] and one(f, "--compile.components") == "model,loss"
        assert f["--compile.no-enable_async_tensor_parallel"] == []

    def test_names_the_release(self):
        text = export_plan(make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3), "torchtitan")[
            "torchtitan_train.sh"
        ]
        assert "for torchtitan 0.3.0." in text and "checked against torchtitan 0.3.0" in text

    def test_rejections(self):
        msg = raises(make_plan(tp=2, sp=True, dp_shard=8, zero_stage=1), "torchtitan", "zero_stage", "1")
        assert "FSDP" in msg
        raises(make_plan(tp=2, sp=False, dp_shard=8, zero_stage=3), "torchtitan", "sp", "False")
        raises(
            make_plan(tp=2, sp=True, dp_shard=8, zero_stage=3, offload_optimizer=True),
            "torchtitan",
            "offload_optimizer",
            "True",
        )
        raises(
            make_plan(tp=2, sp=True, dp_shard=8, zero_stage=3, recompute="selective"),
            "torchtitan",
            "recompute",
            "selective",
        )
        raises(
            make_plan(tp=8, sp=True, pp=2, schedule="zero_bubble"), "torchtitan", "schedule", "zero_bubble"
        )
        raises(
            make_plan(tp=8, sp=True, dp_shard=2, zero_stage=3, precision=Precision.fp16),
            "torchtitan",
            "precision",
            "fp16",
        )
        raises(make_plan(tp=4, sp=True, cp=2, dp_shard=2, zero_stage=0), "torchtitan", "zero_stage", "0")
        raises(
            make_plan(tp=2, sp=True, dp_shard=8, zero_stage=3, dp_comm_overlap=False),
            "torchtitan",
            "dp_comm_overlap",
            "False",
        )
        per_stage = [StageRecompute(kind="full", num_layers=4), StageRecompute(kind="full", num_layers=2)]
        raises(
            make_plan(tp=8, sp=True, pp=2, recompute_per_stage=per_stage),
            "torchtitan",
            "recompute_per_stage",
            "full:4, full:2",
        )

    def test_partial_recompute_is_refused_whole_recompute_per_stage_is_full(self):
        # torchtitan 0.3.0 has no every-N-th layer mode (v0.2.2's selective_ac_option="N" is gone)
        per_stage = [StageRecompute(kind="full", num_layers=4)] * 2
        raises(
            make_plan(tp=8, sp=True, pp=2, zero_stage=3, recompute_per_stage=per_stage),
            "torchtitan",
            "recompute_per_stage",
            "full:4, full:4",
        )
        whole = [StageRecompute(kind="full")] * 2
        assert titan(make_plan(tp=8, sp=True, pp=2, recompute_per_stage=whole))["ac"] == ["full"]


# ============================================================================================
# all targets
# ============================================================================================
class TestAllTargets:
    PLAN_KW: ClassVar[dict] = {
        "tp": 4,
        "sp": True,
        "pp": 2,
        "dp_shard": 2,
        "zero_stage": 1,
        "dp_comm_overlap": False,
        "recompute": "full",
    }

    def plan_for(self, target: str) -> Plan:
        """One layout every target can run: torchtitan needs FSDP (zero 3) and DP overlap, DeepSpeed with PP
        needs DP overlap off."""
        if target == "torchtitan":
            return make_plan(**dict(self.PLAN_KW, zero_stage=3, dp_comm_overlap=True))
        return make_plan(**self.PLAN_KW)

    def test_unknown_target(self):
        with pytest.raises(UnknownNameError) as info:
            export_plan(make_plan(tp=8, sp=True, dp_shard=2), "jax")
        assert info.value.field == "target" and "megatron" in str(info.value)

    def test_targets_and_aliases(self):
        assert TARGETS == ("megatron", "deepspeed", "torchtitan")
        plan = make_plan(tp=8, sp=True, dp_shard=2, zero_stage=1, dp_comm_overlap=False)
        assert export_plan(plan, "Megatron-LM") == export_plan(plan, "megatron")

    @pytest.mark.parametrize("target", ["megatron", "deepspeed", "torchtitan"])
    def test_deterministic(self, target):
        plan = self.plan_for(target)
        first = export_plan(plan, target)
        assert export_plan(plan, target) == first
        assert export_plan(Plan.model_validate_json(plan.model_dump_json()), target) == first

    @pytest.mark.parametrize("target", ["megatron", "deepspeed", "torchtitan"])
    def test_header_names_the_plan(self, target):
        plan = self.plan_for(target)
        pred = plan.prediction
        for name, text in export_plan(plan, target).items():
            head = text[:1500]
            assert "cluster=dgx-h100" in head and "num_gpus=16" in head, name
            assert f"{pred.step_time_s:.4g} s" in head and f"{pred.tokens_per_s:,.0f} tokens/s" in head, name
            if name.endswith((".sh", ".toml")):
                first = text.splitlines()[1] if name.endswith(".sh") else text.splitlines()[0]
                assert first.startswith("# Generated by autopar"), name

    def test_scripts_are_valid_bash(self, tmp_path):
        if BASH is None:
            pytest.skip("bash is not installed")
        files = {
            **export_plan(make_plan(**self.PLAN_KW), "megatron"),
            **export_plan(make_plan(**self.PLAN_KW), "deepspeed"),
        }
        for name, text in files.items():
            if name.endswith(".sh"):
                path = tmp_path / name
                path.write_text(text)
                subprocess.run([BASH, "-n", str(path)], check=True)

    def test_partial_node_is_rejected_for_shell_targets(self):
        # 12 GPUs cannot be started as equal torchrun groups on 8-GPU nodes
        spec = get_preset("llama3-8b")
        train = TrainingConfig(seq_length=4096, global_batch_size=48)
        lay = ParallelLayout(tp=4, sp=True, dp_shard=3, zero_stage=1, dp_comm_overlap=False)
        pred = predict(
            spec, train, reference_profile("dgx-h100", 2), ParallelLayout(tp=8, sp=True, dp_shard=2)
        )
        plan = Plan(
            model=spec,
            training=train,
            cluster="dgx-h100",
            num_gpus=12,
            layout=lay,
            precision=Precision.bf16,
            prediction=pred,
        )
        raises(plan, "megatron", "num_gpus", "12")

"""Exports read back by the frameworks' own parsers (``pip install -e '.[frameworks]'``).

torchtitan 0.3.0: the arguments of ``torchtitan_train.sh`` parsed by ``torchtitan.config.ConfigManager``
(which loads the ``--module/--config`` registry entry and validates the overrides), and the parsed
parallelism checked by ``ParallelDims`` at the plan's GPU count (the product of the degrees is the world
size).

DeepSpeed 0.19.8 ``deepspeed.runtime.config.DeepSpeedConfig(config, mpu)`` checks
``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``, where
``world_size`` is ``mpu.get_data_parallel_world_size()`` (Megatron-DeepSpeed passes its model-parallel
unit), so each config is read at the plan's data-parallel size. DeepSpeedConfig asks ``deepspeed.comm`` for
the rank first and falls back to world size 1 without a process group, so the module starts a one-process
gloo group.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
from test_export import make_plan, titan_argv

from planner.cost.pipeline import SCHEDULES
from planner.export import export_plan

TITAN_PLANS = {
    "dense fsdp": (
        "llama3-8b",
        16,
        {"dp_shard": 16, "zero_stage": 3, "micro_batch_size": 2, "recompute": "full"},
    ),
    "dense fsdp tp per-op sac": (
        "llama3-8b",
        16,
        {"dp_shard": 8, "tp": 2, "sp": True, "zero_stage": 3, "micro_batch_size": 2, "recompute": "op"},
    ),
    "fsdp tp pp interleaved": (
        "llama3-8b",
        16,
        {
            "tp": 2,
            "sp": True,
            "pp": 4,
            "dp_shard": 2,
            "zero_stage": 3,
            "schedule": "interleaved_1f1b",
            "virtual_stages": 2,
        },
    ),
    "zero-bubble v": ("llama3-8b", 16, {"tp": 2, "sp": True, "pp": 4, "dp_shard": 2, "zero_stage": 3,
                                        "schedule": "zero_bubble_v", "virtual_stages": 2}),
    "ddp async tp": (
        "llama3-8b",
        16,
        {"tp": 8, "sp": True, "dp_shard": 2, "zero_stage": 0, "tp_comm_overlap": True},
    ),
    "cp": ("llama3-8b", 16, {"tp": 4, "sp": True, "cp": 2, "dp_shard": 2, "zero_stage": 3}),
    "fsdp compiled": ("llama3-8b", 16, {"dp_shard": 16, "zero_stage": 3, "compile": True}),
    # experts folded over the dp_shard x tp = 32 ranks: ep=32, etp=1 (torchtitan's efsdp = 32/32 = 1)
    "moe ep": ("deepseek-v3", 256, {"tp": 8, "sp": True, "pp": 8, "dp_shard": 4, "ep": 32, "etp": 1, "zero_stage": 3}),
}


@pytest.mark.parametrize("name", list(TITAN_PLANS))
def test_torchtitan_config_manager_parses_the_export(name):
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    model, gpus, layout = TITAN_PLANS[name]
    plan = make_plan(model, gpus=gpus, gbs=128 if gpus > 16 else 64, **layout)
    lay = plan.layout
    cfg = ConfigManager().parse_args(titan_argv(plan))
    par, train = cfg.parallelism, cfg.training
    dp = (lay.dp_replicate, lay.dp_shard) if lay.zero_stage == 3 else (lay.dp, 1)  # zero_stage 0: DDP
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree) == dp
    assert (par.tensor_parallel_degree, par.context_parallel_degree) == (lay.tp, lay.cp)
    assert (par.pipeline_parallel_degree, par.expert_parallel_degree) == (lay.pp, lay.ep)
    assert (
        train.global_batch_size == plan.training.global_batch_seqs
        and train.seq_len == plan.training.seq_length
    )
    if lay.pp > 1:
        assert (
            par.pipeline_parallel_schedule == SCHEDULES[lay.schedule].torchtitan
        )
        assert par.pipeline_parallel_microbatch_size == lay.micro_batch_size
        assert len(par.module_fqns_per_model_part) == lay.pp * lay.virtual_stages
        assert train.local_batch_size == plan.training.global_batch_seqs // lay.dp
    else:
        assert train.local_batch_size == lay.micro_batch_size
    assert type(cfg.activation_checkpoint).__qualname__ == {
        "full": "FullAC.Config", "op": "SelectiveAC.Config"}.get(lay.recompute.value, "NoneType")
    assert cfg.compile.enable_async_tensor_parallel == (lay.tp_comm_overlap and lay.tp > 1)
    compiled = lay.compile or (lay.tp_comm_overlap and lay.tp > 1)
    assert cfg.compile.enable == compiled and (not compiled or set(cfg.compile.components) == {"model", "loss"})
    dims = ParallelDims.from_config(par, world_size=plan.num_gpus)
    assert dims.world_size == plan.num_gpus
    if lay.ep > 1:  # torchtitan's expert data-parallel degree (its sparse mesh) is the plan's expert_dp
        assert dims.dp_shard * dims.cp * dims.tp // dims.ep == lay.expert_dp and lay.expert_tp == 1


def test_torchtitan_config_manager_refuses_a_2025_toml_style_key():
    """The check above can fail: an option name torchtitan 0.3.0 dropped is refused by its parser."""
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    argv = titan_argv(make_plan(tp=2, sp=True, dp_shard=8, zero_stage=3))
    with pytest.raises(SystemExit):
        ConfigManager().parse_args([*argv[:-1], "--parallelism.expert_tensor_parallel_degree", "2", argv[-1]])


deepspeed_config = pytest.importorskip("deepspeed.runtime.config")


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.comm.torch as ds_torch

    # DeepSpeed JIT-compiles a shared-memory all-reduce kernel for CPU ranks when it initialises (90 s of
    # the suite on 2 cores); reading a config never calls it, so the group starts without it
    ds_torch.build_shm_op = lambda: None
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        os.environ.update(env | {"MASTER_PORT": str(port)})
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield


class _DataParallelUnit:
    """The one ``mpu`` method DeepSpeedConfig calls: the data-parallel world size."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


DEEPSPEED_PLANS = {
    "zero1 tp pp": {"tp": 4, "sp": True, "pp": 2, "dp_shard": 2, "zero_stage": 1, "dp_comm_overlap": False},
    "zero3 dp": {"dp_shard": 16, "zero_stage": 3, "micro_batch_size": 2, "reshard_after_forward": True},
    "zero2 tp": {"tp": 2, "sp": True, "dp_shard": 8, "zero_stage": 2, "micro_batch_size": 4},
    "ddp tp pp": {"tp": 4, "sp": True, "pp": 4, "zero_stage": 0},
    "zero3 offload a share": {"dp_shard": 16, "zero_stage": 3, "offload_optimizer": True,
                              "optimizer_offload_fraction": 0.5},
}


@pytest.mark.parametrize("name", list(DEEPSPEED_PLANS))
def test_deepspeed_config_loads_at_the_plans_world_size(name):
    plan = make_plan(**DEEPSPEED_PLANS[name])
    lay = plan.layout
    raw = json.loads(export_plan(plan, "deepspeed")["ds_config.json"])
    cfg = deepspeed_config.DeepSpeedConfig(raw, mpu=_DataParallelUnit(lay.dp))
    assert cfg.world_size == lay.dp
    assert cfg.train_batch_size == plan.training.global_batch_seqs
    assert cfg.train_micro_batch_size_per_gpu == lay.micro_batch_size
    assert cfg.gradient_accumulation_steps == plan.training.global_batch_seqs // (
        lay.micro_batch_size * lay.dp
    )
    assert cfg.zero_optimization_stage == lay.zero_stage
    assert cfg.bfloat16_config.enabled
    if lay.offload_optimizer:  # the share offloaded (ZeRO-Offload++ Twin-Flow's ratio)
        assert cfg.zero_config.offload_optimizer.ratio == lay.optimizer_offload_fraction


def test_deepspeed_itself_refuses_an_offloaded_share_below_zero_3():
    """Why the DeepSpeed table refuses a share below 1 with ZeRO-1/2: DeepSpeed's own config check."""
    plan = make_plan(**DEEPSPEED_PLANS["zero3 offload a share"])
    raw = json.loads(export_plan(plan, "deepspeed")["ds_config.json"])
    raw["zero_optimization"]["stage"] = 1
    with pytest.raises(Exception, match="Partial offloading only supported for ZeRO Stage 3"):
        deepspeed_config.DeepSpeedConfig(raw, mpu=_DataParallelUnit(plan.layout.dp))


def test_deepspeed_refuses_the_config_at_another_world_size():
    """The check above can fail: the same file read at twice the data-parallel size is refused."""
    plan = make_plan(**DEEPSPEED_PLANS["zero2 tp"])
    raw = json.loads(export_plan(plan, "deepspeed")["ds_config.json"])
    with pytest.raises(AssertionError, match="train_batch_size"):
        deepspeed_config.DeepSpeedConfig(raw, mpu=_DataParallelUnit(2 * plan.layout.dp))

"""Exported DeepSpeed configs read back by DeepSpeed's own parser (``pip install -e '.[frameworks]'``).

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
from test_export import make_plan

from planner.export import export_plan

deepspeed_config = pytest.importorskip("deepspeed.runtime.config")


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    import deepspeed
    import deepspeed.comm as dist

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
    assert cfg.gradient_accumulation_steps == plan.training.global_batch_seqs // (lay.micro_batch_size * lay.dp)
    assert cfg.zero_optimization_stage == lay.zero_stage
    assert cfg.bfloat16_config.enabled


def test_deepspeed_refuses_the_config_at_another_world_size():
    """The check above can fail: the same file read at twice the data-parallel size is refused."""
    plan = make_plan(**DEEPSPEED_PLANS["zero2 tp"])
    raw = json.loads(export_plan(plan, "deepspeed")["ds_config.json"])
    with pytest.raises(AssertionError, match="train_batch_size"):
        deepspeed_config.DeepSpeedConfig(raw, mpu=_DataParallelUnit(2 * plan.layout.dp))

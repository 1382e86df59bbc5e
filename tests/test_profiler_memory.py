"""The memory terms the profiler measures (profiler/memory.py): a CPU rank's, here; a GPU's on a GPU."""

from __future__ import annotations

import pytest
import torch

from profiler.memory import measured_assumptions, resident_bytes


def test_a_cpu_has_no_device_to_idle_on_a_host_sync():
    from profiler.timing import host_sync_s

    assert host_sync_s(torch.device("cpu")) is None


def test_a_cpu_rank_measures_its_resident_memory_and_holds_no_nccl_buffers():
    a = measured_assumptions(torch.device("cpu"), cpu_resident_bytes=123 << 20)
    assert a.runtime_bytes == 123 << 20 and a.communicator_bytes == 0 and a.all_to_all_communicator_bytes == 0
    assert "123 MiB measured" in a.notes[0]
    assert resident_bytes() > 50 << 20  # this process: the interpreter and torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: runtime, optimizer and loss bytes")
def test_a_gpu_measures_runtime_optimizer_and_loss_bytes():
    a = measured_assumptions(torch.device("cuda", 0))
    assert 200 << 20 < a.runtime_bytes < 4 << 30
    assert 3.5 < a.optimizer_temp_bytes_per_param < 8.5  # foreach AdamW: sqrt(v) for every parameter, 4 B
    assert 6 < a.loss_bytes_per_logit < 24
    assert 5e-6 < a.moe_host_sync_s < 500e-6  # 31-67 us on lent H100 VMs (benchmarks/data/moe_h100.log)

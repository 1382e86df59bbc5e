"""Where the ranks of a run live: one CUDA GPU each, or CPU cores.

Decided without importing torch where the answer is known without it (about 1 s of start-up on a
small host): ``AUTOPAR_FORCE_CPU=1``, or a Linux host with no GPU device node at all, runs on the
CPU; otherwise torch says whether CUDA (or ROCm, which torch also calls ``cuda``) is available.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# device nodes of the drivers torch.cuda runs on: NVIDIA, AMD ROCm (kfd), WSL2's GPU paravirtualisation
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def cuda_ranks() -> bool:
    """Whether the ranks run on CUDA GPUs (one per local rank), else on the CPU: CUDA where this host
    has it, unless ``AUTOPAR_FORCE_CPU=1``."""
    if os.environ.get("AUTOPAR_FORCE_CPU") == "1":
        return False
    if sys.platform == "linux" and not any(Path(p).exists() for p in GPU_DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()

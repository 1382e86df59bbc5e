"""The ZeRO/FSDP column is free text; these are the phrasings in published_runs.csv."""

import pytest

from planner.validate import zero_stage_from_text


@pytest.mark.parametrize(
    ("text", "stage"),
    [
        ("DDP / distributed optimizer (FSDP=0)", 1),
        ("ZeRO-1 data parallelism", 1),
        ("ZeRO-1 equivalent (DeepSpeed BF16_Optimizer; ds zero_stage flag = 0)", 1),
        ("FSDP FULL_SHARD (ZeRO-3)", 3),
        ("FSDP2", 3),
        ("FSDP2 (1D)", 3),
        ("FSDP: shards optimizer states and gradients; model params NOT resharded after forward (ZeRO-2-like)", 2),
        ("DDP", 0),
        ("", None),
    ],
)
def test_zero_stage_from_text(text, stage):
    assert zero_stage_from_text(text) == stage

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


@pytest.mark.parametrize(
    ("row_model", "preset"),
    [("LLAMA3-70B", "llama3-70b"), ("LLAMA2-70B", "llama2-70b"), ("LLAMA3-8B", "llama3-8b")],
)
def test_preset_match_prefers_the_rows_model_family(row_model, preset):
    """Llama 2 70B and Llama 3 70B share their shapes; the vocabulary must come from the right one."""
    from planner.presets import PRESETS
    from planner.validate import _matching_preset

    spec = PRESETS[preset]
    name, _ = _matching_preset(row_model, spec.num_layers, spec.hidden_size, spec.num_attention_heads, swiglu=True)
    assert PRESETS[name].vocab_size == spec.vocab_size


def test_a_row_with_a_non_numeric_or_zero_degree_is_skipped_with_the_cell_named():
    from planner.validate import COLUMNS, Skipped, build_case

    row = dict.fromkeys(COLUMNS, "")
    row.update(run_id="x_bad", num_layers="24", hidden_size="2048", num_attention_heads="16", seq_length="2048",
               gpu_type="A100 80GB", num_gpus="8", tp="eight", pp="1", global_batch_size_seqs="8")
    skipped = build_case(row)
    assert isinstance(skipped, Skipped) and "tp='eight'" in skipped.reason
    row.update(tp="1", num_gpus="0")
    skipped = build_case(row)
    assert isinstance(skipped, Skipped) and "num_gpus='0'" in skipped.reason

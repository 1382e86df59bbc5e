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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none stated", ""), ("Not stated", ""), ("unknown", ""), ("n/a", ""), ("-", ""), ("", ""),
        (None, ""),
        ("3", "3"), ("none", "none"),
        ("interleaved schedule used (number of stages not stated)",
         "interleaved schedule used (number of stages not stated)"),
    ],
)
def test_a_cell_that_only_says_nothing_was_stated_reads_as_blank(text, expected):
    """'none stated' means the source is silent, not that the value is none; a cell that states
    something (a number, 'none', a schedule with an unstated depth) is kept."""
    from planner.validate import unstated

    assert unstated(text) == expected


def _pipeline_row(vp: str) -> dict[str, str]:
    from planner.validate import COLUMNS

    row = dict.fromkeys(COLUMNS, "")
    row.update(run_id="x_pp2", source="Korthikanti et al. (hand-made row)", model="GPT 22B", num_layers="48",
               hidden_size="6144", num_attention_heads="64", vocab_size="51200", seq_length="2048",
               gpu_type="A100-SXM4-80GB", num_gpus="8", gpus_per_node="8", global_batch_size_seqs="8",
               micro_batch_size="1", tp="4", pp="2", dp="1", virtual_pipeline_stages=vp,
               activation_recompute="full", iteration_time_s_reported="10", framework="Megatron-LM",
               config_completeness="complete")
    return row


def test_an_unstated_interleaving_depth_is_chosen_like_a_blank_cell_and_said_so():
    """Megatron row, pp=2, VP cell 'none stated': same layout as a blank cell (interleaved, depth by
    fastest prediction, listed as a default); a stated '1' keeps plain 1F1B with no such default."""
    from planner.contracts import Schedule
    from planner.validate import RowCase, build_case

    silent, blank, one = (build_case(_pipeline_row(vp)) for vp in ("none stated", "", "1"))
    assert isinstance(silent, RowCase) and isinstance(blank, RowCase) and isinstance(one, RowCase)
    assert silent.layout == blank.layout
    assert silent.layout.schedule is Schedule.interleaved_1f1b and silent.layout.virtual_stages >= 2
    chosen = f"virtual_stages={silent.layout.virtual_stages} (fastest predicted; the source does not say)"
    assert chosen in silent.defaults
    assert one.layout.schedule is Schedule.one_f_one_b and one.layout.virtual_stages == 1
    assert not any(d.startswith("virtual_stages=") for d in one.defaults)

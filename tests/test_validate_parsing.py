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



@pytest.mark.parametrize("vp, source, expected", [
    ("1", "PyTorch torchtitan H100 benchmarks (Dec 2024)", {1: 4}),  # local batch 32 over pp=8 micro-batches
    ("Interleaved 1F1B (stages per rank not stated)", "PyTorch torchtitan H100 benchmarks (Dec 2024)", {2: 2, 4: 1}),
    ("1", "PyTorch torchtitan H100 benchmarks (Jun 2025)", None),  # later releases: not this default
])
def test_a_2024_torchtitan_pipeline_splits_the_local_batch_into_as_many_micro_batches_as_stages(vp, source, expected):
    """torchtitan of 2024 ran pp x (stages per rank) micro-batches unless told (its pipeline_parallel_microbatches
    defaulted to the number of stages): an unstated micro-batch size is the local batch over that, not the
    fastest the model predicts (which would price a far smaller bubble)."""
    from planner.validate import RowCase, build_case

    row = _pipeline_row(vp)
    row.update(run_id="t_pp8", source=source, framework="torchtitan", micro_batch_size="", num_gpus="64", tp="1",
               pp="8", dp="8", global_batch_size_seqs="256", num_layers="48")
    case = build_case(row)
    assert isinstance(case, RowCase)
    lay = case.layout
    if expected is None:
        assert not any("pipeline_parallel_microbatches" in d for d in case.defaults)
        return
    assert lay.micro_batch_size == expected[lay.virtual_stages]
    assert any(d.startswith("micro_batch_size=local batch 32 / (pp x stages per rank)") for d in case.defaults)

# ---------------------------------------------------------------- numbers in cells
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the formats of shared/data/published_runs.csv
        ("128K (report: 'extended vocabulary of 128K tokens')", 128_000),
        ("250880 (padded; 250,680 real tokens)", 250880),
        ("15360 (ramped from 3072 over first 469B tokens)", 15360),
        ("18432 (first 3 dense layers)", 18432),
        ("64 (spanning 8 nodes)", 64),
        ("3 (interleaving stages, 175B and 530B only)", 3),
        ("4.2M (slurm comment)", 4_200_000),
        ("16M", 16_000_000),
        ("408.8", 408.8),
        ("1,920", 1920),
        ("1,234,567.5", 1_234_567.5),
        # signs and exponents are part of the number
        ("-408.8", -408.8),
        ("+8", 8),
        ("1e3", 1000),
        ("1E-3", 0.001),
        ("1.4e2", 140),
        ("-24", -24),
        # approximate, bare decimals, multiplier words
        ("~100", 100),
        (".5", 0.5),
        ("2 million tokens", 2_000_000),
        ("41%", 41),
    ],
)
def test_num_reads_the_whole_number_of_a_cell(text, expected):
    from planner.validate import _num

    assert _num(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("abc", "is not a number"), ("nan", "is not a number"), ("inf", "is not a number"),
        ("fast", "is not a number"), ("about 100", "is not a number"),
        ("1.42s", "is not a number"),  # the old reader gave 1.0
        ("8/16", "is not a number"), ("12,34", "is not a number"), ("1e", "is not a number"),
        ("1e999", "is not a finite number"),
    ],
)
def test_num_refuses_a_cell_that_is_not_a_number(text, problem):
    from planner.validate import _num

    with pytest.raises(ValueError, match=problem):
        _num(text)


@pytest.mark.parametrize(("text", "expected"), [("1e2", 100), ("24", 24), ("-24", -24), ("4.8e1", 48), ("", None)])
def test_int_reads_whole_numbers(text, expected):
    from planner.validate import _int

    assert _int(text) == expected


@pytest.mark.parametrize("text", ["1.5", "48.9", "1e-1"])
def test_int_refuses_a_fraction(text):
    from planner.validate import _int

    with pytest.raises(ValueError, match="is not a whole number"):
        _int(text)


@pytest.mark.parametrize(
    ("text", "precision"),
    [
        # every phrasing of shared/data/published_runs.csv
        ("BF16", "bf16"), ("BF16 (FSDP2 mixed precision)", "bf16"), ("BF16 mixed precision", "bf16"),
        ("BF16 + Float8 linears (FSDP float8 all-gather)", "fp8"), ("FP8", "fp8"), ("FP8 (hybrid)", "fp8"),
        ("FP8 mixed precision (fine-grained block quantization), BF16/FP32 for sensitive ops", "fp8"),
        ("FP8-CS", "fp8"), ("amp_bf16", "bf16"), ("mixed precision", "bf16"),
        ("mixed precision (16-bit; peak quoted as 312 TFLOP/s 16-bit)", "bf16"),
        # others the planner models
        ("FP16", "fp16"), ("fp16 and bf16", "bf16"), ("half precision", "fp16"), ("FP32", "fp32"),
        # formats it does not model, and words that name no format
        ("fp64", None), ("FP64 mixed", None), ("int8", None), ("nvfp4", None), ("double", None), ("fast", None),
    ],
)
def test_precision_of_a_cell(text, precision):
    from planner.validate import _precision

    got = _precision(text)
    assert (got.value if got else None) == precision


def test_mixed_precision_beside_fp32_is_16_bit_and_tf32_is_fp32():
    from planner.contracts import Precision
    from planner.validate import _precision

    assert _precision("mixed precision (fp32 master weights)") is Precision.bf16
    assert _precision("mixed precision, fp32 accumulation") is Precision.bf16
    assert _precision("TF32") is Precision.fp32 and _precision("fp32") is Precision.fp32


def test_a_trailing_comma_is_not_a_ragged_row():
    from planner.validate import _ragged

    assert _ragged({"run_id": "x", "tp": "8", None: [""]}) is None  # 'x,8,' : one blank cell past the header
    assert _ragged({"run_id": "x", "tp": "8", None: ["  ", ""]}) is None
    assert "row has 3 cells but the header has 2 columns" in _ragged({"run_id": "x", "tp": "8", None: ["9"]})


# ---------------------------------------------------------- phrasings found building planner/data/published_runs.csv
@pytest.mark.parametrize(
    ("text", "stage"),
    [
        ("ZeRO stage 3 (DeepSpeed)", 3),
        ("DeepSpeed ZeRO stage 2", 2),
        ("stage 3", 3),
        ("ZeRO-2", 2),
        ("ZeRO 3", 3),
        ("zero_stage=1", 1),
        ("FSDP SHARD_GRAD_OP (ZeRO-2)", 2),
        ("FSDP SHARD_GRAD_OP", 2),
        ("FSDP HYBRID_SHARD", 3),
        ("FSDP2 (FULL_SHARD)", 3),
        ("distributed optimizer (USE_DIST_OPTIMIZER=True)", 1),
        ("Megatron distributed optimizer", 1),
        ("Megatron FSDP, sharding group 8 GPUs (FSDP=8)", 3),
        ("PyTorch DDP", 0),
    ],
)
def test_zero_stage_of_common_phrasings(text, stage):
    assert zero_stage_from_text(text) == stage


def test_a_per_node_interconnect_figure_is_shared_by_the_node_gpus():
    """MosaicML's A100 tables: "1600 Gbps node-node interconnect (RoCE)" is 8 x 200 Gb/s per node."""
    from planner.validate import _nic_gbit_per_gpu

    assert _nic_gbit_per_gpu("1600 Gbps node-node interconnect (RoCE)", 8) == 200
    assert _nic_gbit_per_gpu("3200 Gb/s per node", 8) == 400
    assert _nic_gbit_per_gpu("backend RDMA network, 400 Gb/s per GPU", 8) == 400


@pytest.mark.parametrize(
    ("gpu_type", "system"),
    [
        ('H100 95GB HBM2e, lower-TDP SXM (doc: "H100 (94GB memory)")', "gt-h100-96gb-500w"),
        ("H100 94GB", "gt-h100-96gb-500w"),
        ("H100 NVL 94GB", None),  # a PCIe card: no reference system has its power and links
        ("H100 PCIe 80GB", None),
        ("GB200 NVL72", None),  # not a B200
        ("GH200", None),  # not an H200
        ("B200 (DGX-B200)", "dgx-b200"),
        ("NVIDIA H100-SXM5-80GB (64xNVIDIA DGX H100)", "dgx-h100"),
        ("H100 80GB HBM3, 700W TDP (Grand Teton)", "dgx-h100"),
    ],
)
def test_system_of_gpu_variants(gpu_type, system):
    from planner.validate import _system

    assert _system(gpu_type) == system


def test_a_gpu_without_a_reference_system_skips_the_row_naming_it():
    from planner.validate import Skipped, build_case

    skipped = build_case({**_pipeline_row("1"), "gpu_type": "GB200 NVL72"})
    assert isinstance(skipped, Skipped) and "GB200 NVL72" in skipped.reason


def test_not_applicable_virtual_stages_is_no_interleaving():
    """'n/a' in the VP column (Megatron-Bridge tables) means no interleaving: plain 1F1B, as a stated 1."""
    from planner.contracts import Schedule
    from planner.validate import RowCase, build_case

    na, one = build_case(_pipeline_row("n/a")), build_case(_pipeline_row("1"))
    assert isinstance(na, RowCase) and isinstance(one, RowCase)
    assert na.layout.schedule is Schedule.one_f_one_b and na.layout.virtual_stages == 1
    assert na.layout == one.layout
    assert not any(d.startswith("virtual_stages=") for d in na.defaults)


def test_model_family_joins_a_version_written_apart():
    """'Llama 3.1 8B' is of the llama3 family: with unstated vocabulary it takes Llama 3's 128k, not Llama 2's
    32k from a preset of the same shapes."""
    from planner.validate import _family, _matching_preset

    assert _family("Llama 3.1 8B") == _family("llama3.1-8b") == "llama3"
    assert _family("Llama 2 70B") == "llama2" and _family("MPT-7B") == "mpt"
    name, spec = _matching_preset("Llama 3.1 8B", 32, 4096, 32, True)
    assert name.startswith("llama3") and spec.vocab_size == 128256

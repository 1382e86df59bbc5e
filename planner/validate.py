"""Judge the cost model against published training runs (``published_runs.csv`` columns).

Each row becomes a (ModelSpec, TrainingConfig, ClusterProfile, ParallelLayout). Every field the
source did not print gets a stated default (``RowCase.defaults``), and the prediction is compared
in the row's own convention: iteration time where given; tokens/s for FP8 rows and where
tokens/s is the reported figure; TFLOP/s per GPU with the source's FLOP count (SC21 and BLOOM
count the recompute forward); MFU last. Rows that cannot be judged are returned with the reason.
"""

from __future__ import annotations

import csv
import io
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from planner.contracts import (
    ClusterProfile,
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Precision,
    Prediction,
    Recompute,
    Schedule,
    StageRecompute,
    TrainingConfig,
)
from planner.cost.predict import predict
from planner.errors import AutoparError, validation_problems
from planner.files import read_input
from planner.presets import PRESETS
from planner.reference import reference_profile, system_family
from planner.targets import planned_scatter_gather, recompute_text

COLUMNS = (
    "run_id", "source", "source_location", "source_ref", "source_quality", "model", "arch_type", "num_layers",
    "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_length",
    "moe_num_experts", "moe_top_k", "moe_shared_experts", "moe_expert_ffn_hidden_size", "total_params",
    "active_params", "gpu_type", "num_gpus", "gpus_per_node", "intra_node_interconnect", "inter_node_interconnect",
    "precision", "global_batch_size_seqs", "global_batch_size_seqs_derived", "global_batch_tokens",
    "micro_batch_size", "grad_accum_steps", "tp", "pp", "dp", "dp_derived", "cp", "ep", "virtual_pipeline_stages",
    "sequence_parallel", "zero_or_fsdp", "activation_recompute", "tflops_per_gpu_reported", "mfu_pct_reported",
    "hfu_pct_reported", "tokens_per_sec_per_gpu_reported", "tokens_per_sec_total_reported",
    "iteration_time_s_reported", "aggregate_pflops_reported", "other_throughput_reported",
    "tokens_per_sec_per_gpu_derived", "flop_convention", "framework", "config_completeness", "missing_fields", "notes",
    "etp",
)
"""Columns of published_runs.csv, the format ``autopar validate`` reads."""
ADDED_COLUMNS = ("etp",)
"""Columns appended to the format after its first release (``shared/data/published_runs.csv`` ends before
them): a file may leave them out, and their cells then read as unstated. ``etp``: the expert
tensor-parallel degree (Megatron-Core --expert-tensor-parallel-size; blank: not stated)."""
PUBLISHED_RUNS = Path(__file__).resolve().parent / "data" / "published_runs.csv"
"""The published-runs set shipped with the planner (sources: ``published_runs_SOURCES.md`` beside it);
``autopar validate`` reads it when no file is given."""

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "gpu_type", "num_gpus", "tp", "pp")

# Software of the time, by source: what a field left blank meant in that code base.
#  - Megatron-LM 2021-22 (SC21, Korthikanti, BLOOM, MT-NLG) had unfused attention, no distributed
#    optimizer (plain DDP all-reduce) and no sequence parallelism before Korthikanti et al.
#  - Megatron-Core / NeMo / Megatron-Bridge: flash attention, distributed optimizer (ZeRO-1), SP with TP.
#  - torchtitan and Meta's Llama 3 stack: flash attention, FSDP, SP with TP.
_ERA_2021 = re.compile(r"Narayanan|Korthikanti|BLOOM|bigscience|MT-NLG|Megatron-Turing", re.I)
_MCORE = re.compile(r"Megatron-Core|NeMo|Megatron-Bridge", re.I)
# torchtitan of 2024 split a rank's batch into as many pipeline micro-batches as there are stages in all
# (pp x stages per rank) unless told otherwise: ``experimental.pipeline_parallel_microbatches`` defaulted to
# None, read as ``num_total_stages`` by its ``build_pipeline_schedule`` (torchtitan/config_manager.py and
# torchtitan/parallelisms/pipelining_utils.py of late 2024); later releases take a micro-batch size instead.
_TITAN_2024 = re.compile(r"torchtitan.*\b2024\b|\b2024\b.*torchtitan", re.I)
# A cell that only says the source gives no value ("none stated", "not stated", "unknown", "n/a", "-")
# is a blank cell: the value is unstated, not "none".
_UNSTATED = re.compile(r"(?:(?:none|not)\s+(?:stated|given|reported)|unknown|n/?a|-+|\?)", re.I)


def unstated(text: str | None) -> str:
    """The cell's text, or ``""`` when it only says the source does not state a value."""
    t = (text or "").strip()
    return "" if _UNSTATED.fullmatch(t) else t


@dataclass
class RowCase:
    run_id: str
    source: str
    family: str  # GPU family of the reference profile (calibration group)
    model: ModelSpec
    training: TrainingConfig
    profile: ClusterProfile
    layout: ParallelLayout
    metric: str  # iteration_time_s | tokens_per_s_per_gpu | tflops_per_gpu | mfu
    reported: float
    flop_convention: str  # model | hardware
    defaults: list[str] = field(default_factory=list)
    primary_source: bool = True  # source_quality: primary, or a secondary transcription/quote
    target: str = "autopar"  # the target whose facts the run's framework matches (:func:`framework_target`)


@dataclass
class RowResult:
    case: RowCase
    predicted: float
    error: float  # signed relative error of the predicted figure in the row's metric
    prediction: Prediction


@dataclass
class Skipped:
    run_id: str
    source: str
    reason: str


def source_key(run_id: str) -> str:
    """Short source name of a row: the run id up to its first underscore."""
    return run_id.split("_", 1)[0]


# A cell's number: optional "~" (approximately), sign, digits with optional thousands separators
# ("1,920") and decimals, optional exponent ("1e3"), optional multiplier ("128K", "4.2M", "2 million"), then
# nothing or a note after a space, "(", ";" or ", " ("15360 (ramped ...)", "64 (spanning 8 nodes)").
_NUMBER = re.compile(
    r"[~\u2248]?\s*(?P<sign>[+-]?)"
    r"(?P<digits>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?|[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:[eE](?P<exp>[+-]?[0-9]+))?"
    r"(?:\s*(?P<suffix>[KkMm]|(?i:thousand|million|billion))(?![A-Za-z0-9]))?"
    r"(?P<rest>.*)",
    re.S,
)
_NOTE_START = re.compile(r"(?:\s|[(\[;%*]|,\s)")
_MULTIPLIERS = {"k": 1000, "m": 1_000_000, "thousand": 1000, "million": 1_000_000, "billion": 10**9}
MAX_COUNT = 10**12
"""Largest count a cell may give (GPUs, tokens, sizes): more is a unit mix-up, not a training run."""


def _num(text: str | None) -> float | None:
    """The number a cell states ('128K (...)' -> 128000, '15360 (ramped ...)' -> 15360, '1,920' -> 1920,
    '1e3' -> 1000, '-2' -> -2); None when the cell is blank or says the source gives none.

    Raises ValueError (its text: what is wrong, e.g. "is not a number") when the cell does not start
    with a number, or the number runs on into text ('1.42s', '8/16', '12,34').
    """
    t = unstated(text)
    if not t:
        return None
    match = _NUMBER.fullmatch(t)
    if not match or (match.group("rest") and not _NOTE_START.match(match.group("rest"))):
        raise ValueError("is not a number")
    digits = match.group("digits").replace(",", "")
    value = float(match.group("sign") + digits + (f"e{match.group('exp')}" if match.group("exp") else ""))
    suffix = (match.group("suffix") or "").lower()
    value = value * _MULTIPLIERS.get(suffix, 1)
    if not math.isfinite(value):
        raise ValueError("is not a finite number")
    return value


def _int(text: str | None) -> int | None:
    """The whole number a cell states (see :func:`_num`); ValueError when it has a fraction."""
    value = _num(text)
    if value is None:
        return None
    if not value.is_integer():
        raise ValueError("is not a whole number")
    return int(value)


class CellError(AutoparError):
    """A cell of a row that cannot be used: ``str()`` names the column, the value and the fix."""


def _count(row: dict[str, str | None], column: str, *, required: bool = False,
           allow_zero: bool = False) -> int | None:
    """A whole-number cell: > 0 (>= 0 with ``allow_zero``), None when blank or unstated."""
    text = row.get(column)
    fix = f"give a whole number {'0 or more' if allow_zero else 'above 0'}"
    if not required:
        fix += ", or leave the cell blank if the source does not state it"
    try:
        value = _int(text)
    except ValueError as exc:
        raise CellError(column, text, fix, problem=str(exc)) from None
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise CellError(column, text, fix, problem="is negative" if allow_zero else "is not a positive number")
    if value is not None and value > MAX_COUNT:
        raise CellError(column, text, "check the units (a count, not thousands or millions of it)",
                        problem=f"is more than {MAX_COUNT:,}, which no training run has")
    return value


def _figure(row: dict[str, str | None], column: str, *, at_most: float | None = None) -> float | None:
    """A published measurement (TFLOP/s, MFU %, tokens/s, seconds): > 0, None when blank or unstated."""
    text = row.get(column)
    fix = "give the published figure as a number above 0, or leave the cell blank if the source does not state it"
    try:
        value = _num(text)
    except ValueError as exc:
        raise CellError(column, text, fix, problem=str(exc)) from None
    if value is not None and value <= 0:
        raise CellError(column, text, fix, problem="is not a positive number")
    if value is not None and at_most is not None and value > at_most:
        raise CellError(column, text, f"give a percentage from 0 to {at_most:g}", problem=f"is more than {at_most:g}")
    return value


COUNT_COLUMNS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_length",
    "moe_num_experts", "moe_top_k", "moe_expert_ffn_hidden_size", "num_gpus", "gpus_per_node",
    "global_batch_size_seqs", "global_batch_size_seqs_derived", "global_batch_tokens", "micro_batch_size",
    "tp", "pp", "dp", "dp_derived", "cp", "ep", "etp",
)
"""Columns read as whole numbers above 0 (blank: not stated). ``moe_shared_experts`` may also be 0."""
FIGURE_COLUMNS = (
    "tflops_per_gpu_reported", "mfu_pct_reported", "tokens_per_sec_per_gpu_reported", "iteration_time_s_reported",
    "tokens_per_sec_per_gpu_derived",
)
"""Published measurements the comparison reads: numbers above 0 (MFU at most 100 %), blank: not stated."""


def _numbers(row: dict[str, str | None]) -> dict[str, float | int | None]:
    """Every number the row's judgement reads, checked; raises :class:`CellError` on the first bad cell."""
    numbers: dict[str, float | int | None] = {
        c: _count(row, c, required=c in REQUIRED) for c in COUNT_COLUMNS
    }
    numbers["moe_shared_experts"] = _count(row, "moe_shared_experts", allow_zero=True)
    for c in FIGURE_COLUMNS:
        numbers[c] = _figure(row, c, at_most=100 if c == "mfu_pct_reported" else None)
    vp = _vp_text(row)
    # a number of stages, or words ("DualPipe ...", "interleaved schedule used (... not stated)")
    numbers["virtual_pipeline_stages"] = (
        _count({"virtual_pipeline_stages": vp}, "virtual_pipeline_stages")
        if re.match(r"[~\u2248]?\s*[+-]?\.?[0-9]", vp) else None
    )
    return numbers


_NOT_APPLICABLE = re.compile(r"n/?a|not applicable", re.I)


def _vp_text(row: dict[str, str | None]) -> str:
    """The virtual_pipeline_stages cell; "n/a" (no interleaving applies) reads as "1", a cell that
    says nothing is stated reads as ``""``."""
    raw = (row.get("virtual_pipeline_stages") or "").strip()
    return "1" if _NOT_APPLICABLE.fullmatch(raw) else unstated(raw)


def _text(row: dict[str, str | None], column: str) -> str:
    """A text cell; ``""`` when blank or absent (a CSV with fewer columns, or a short row)."""
    return row.get(column) or ""


def _one_line(exc: Exception) -> str:
    """An exception as one line: pydantic errors as 'field=value: problem; ...' without their help URL."""
    if isinstance(exc, ValidationError):
        return f"{exc.title}: " + "; ".join(validation_problems(exc, None))
    return " ".join(str(exc).split())


_H100_HBM2E = re.compile(r"\b9[4-6]\s*GB|HBM2E|LOWER[-\s]TDP|\b500\s*W")


# what tells one part of a GPU name from another: memory size, SXM/PCIe/NVL, the DGX/HGX/Grand Teton system
_PART_NAMED = re.compile(r"\d+\s*GB|SXM|PCIE|NVL|HBM|DGX|HGX|Grand Teton|\d+\s*W\b", re.IGNORECASE)


def _system(gpu_type: str) -> str | None:
    """The reference system (:data:`planner.reference.SYSTEMS`) of a gpu_type cell; None when none fits.

    GPU names match as whole words ("GB200" is not a B200). An H100 with 94-96 GB of HBM2e or a lower
    TDP (Grand Teton, "H100 94GB") is the 500 W HBM2e part; H100 NVL and PCIe cards have no reference
    system (their power, clocks and links differ from every SXM node in SYSTEMS).
    """
    g = gpu_type.upper()
    if re.search(r"\bA100\b", g):
        return "dgx-a100-40gb" if "40GB" in g.replace(" ", "") else "dgx-a100-80gb"
    if re.search(r"\bH100\b", g):
        if re.search(r"\bNVL\b|\bPCIE\b", g):
            return None
        return "gt-h100-96gb-500w" if _H100_HBM2E.search(g) else "dgx-h100"
    for name, system in (("H200", "hgx-h200"), ("H800", "hgx-h800"), ("B200", "dgx-b200")):
        if re.search(rf"\b{name}\b", g):
            return system
    return None


def _nic_gbit_per_gpu(text: str, gpus_per_node: int) -> float | None:
    """Network line rate per GPU from the row's inter-node description, if it gives one.

    "N x ... R Gb/s ... per node" -> N*R / gpus_per_node; a single "R Gb/s per node" or "R Gb/s
    node-node" figure -> R / gpus_per_node; "N OPA links per node" -> N*100 / gpus_per_node;
    "B GB/s" -> 8*B; any other "R Gb/s" is per GPU.
    """
    if not text:
        return None
    t = text.replace("Gbps", "Gb/s")
    m = re.search(r"(\d+)x[^,;]*?(\d+)\s*Gb/s[^,;]*per node", t)
    if m:
        return int(m.group(1)) * int(m.group(2)) / gpus_per_node
    m = re.search(r"(\d+)\s*Gb/s[^,;]*?(?:per node|node-(?:to-)?node)", t)
    if m:  # one figure for the whole node ("1600 Gbps node-node interconnect")
        return int(m.group(1)) / gpus_per_node
    m = re.search(r"(\d+)\s*OPA links per node", t)
    if m:  # Omni-Path: 100 Gb/s per link
        return int(m.group(1)) * 100 / gpus_per_node
    m = re.search(r"(\d+)\s*GB/s", t)
    if m:
        return int(m.group(1)) * 8
    m = re.search(r"(\d+)\s*Gb/s", t)
    if m:
        return float(m.group(1))
    return None


def _family(name: str) -> str:
    """'LLAMA3-70B', 'llama3.1-70b', 'Llama 3.1 8B' -> 'llama3'; 'GPT 7.1B', 'gpt3-175b' -> 'gpt';
    'Qwen3_30B_a3B' -> 'qwen3' (a version number written apart from the name joins it)."""
    found = re.match(r"\s*([a-z]+)(?:[\s_-]*(\d+)(?![\d.]*\s*[bm]\b))?", name.lower())
    family = (found.group(1) + (found.group(2) or "")) if found else ""
    return "gpt" if family.startswith("gpt") else family


def _matching_preset(
    row_model: str, layers: int, hidden: int, heads: int, swiglu: bool
) -> tuple[str, ModelSpec] | None:
    """The preset with the row's shapes and FFN kind, preferring one of the row's model family
    (Llama 2 70B and Llama 3 70B share their shapes but not their vocabulary)."""
    same = [(name, spec) for name, spec in PRESETS.items()
            if (spec.num_layers, spec.hidden_size, spec.num_attention_heads) == (layers, hidden, heads)
            and (spec.ffn_kind == "swiglu") == swiglu]
    family = _family(row_model)
    for name, spec in same:
        if family and _family(name) == family:
            return name, spec
    return same[0] if same else None


def _model(row: dict[str, str], defaults: list[str], n: dict[str, float | int | None]) -> ModelSpec:
    """The row's ModelSpec from its checked numbers ``n`` (:func:`_numbers`) and its text cells."""
    layers, hidden, heads = n["num_layers"], n["hidden_size"], n["num_attention_heads"]
    name_text = (_text(row, "model") + " " + _text(row, "arch_type")).lower()
    llama_like = n["num_kv_heads"] is not None or any(
        w in name_text for w in ("llama", "qwen", "mixtral", "deepseek", "mistral"))
    preset = _matching_preset(_text(row, "model"), layers, hidden, heads, swiglu=llama_like)
    base = preset[1] if preset else None
    if preset is not None:
        defaults.append(f"unstated architecture details from preset {preset[0]}")
    elif llama_like:
        defaults.append("architecture: Llama-style (RoPE, RMSNorm, SwiGLU, no biases, untied, no dropout)")
    else:
        defaults.append("architecture: GPT-style (learned positions, LayerNorm, biases, tied embeddings, dropout 0.1)"
                        if "alibi" not in name_text else
                        "architecture: MPT-style (ALiBi, LayerNorm without biases, tied embeddings, no dropout)")
    kv = n["num_kv_heads"]
    if kv is None:
        kv = base.kv_heads if base else heads
        if not base:
            defaults.append(f"num_kv_heads={kv} (MHA)")
    ffn = n["ffn_hidden_size"]
    if ffn is None:
        ffn = base.ffn_hidden_size if base else 4 * hidden
        if not base:
            defaults.append(f"ffn_hidden_size={ffn} (4h GeLU MLP)")
    vocab = n["vocab_size"]
    if vocab is None:
        vocab = base.vocab_size if base else 51200
        defaults.append(f"vocab_size={vocab}" + (" (preset)" if base else " (GPT-2 BPE padded, Megatron default)"))
    gpt_style = not llama_like
    moe = None
    if n["moe_num_experts"] is not None:
        unset = " and ".join(c for c in ("moe_top_k", "moe_expert_ffn_hidden_size") if n[c] is None)
        if unset:
            raise CellError("moe_num_experts", row.get("moe_num_experts"),
                            f"fill in {unset} (or leave moe_num_experts blank for a dense model)",
                            problem=f"makes the model MoE but {unset} {'are' if ' and ' in unset else 'is'} blank")
        dense_first = re.search(r"first (\d+) dense", _text(row, "ffn_hidden_size"))
        moe = MoESpec(
            num_experts=n["moe_num_experts"], top_k=n["moe_top_k"],
            expert_ffn_hidden_size=n["moe_expert_ffn_hidden_size"],
            num_shared_experts=n["moe_shared_experts"] or 0,
            first_dense_layers=int(dense_first.group(1)) if dense_first else 0,
        )
        if n["ffn_hidden_size"] is None and base is None:
            ffn = moe.expert_ffn_hidden_size
    alibi = "alibi" in name_text
    stated_head_dim = re.search(r"head_dim\s*(\d+)", _text(row, "arch_type"))  # "MoE (GQA, head_dim 128)"
    head_dim = int(stated_head_dim.group(1)) if stated_head_dim else (base.head_dim if base else None)
    return ModelSpec(
        name=row.get("model") or row.get("run_id") or "?", num_layers=layers, hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, ffn_hidden_size=ffn,
        ffn_kind="gelu" if gpt_style else "swiglu", vocab_size=vocab,
        tied_embeddings=base.tied_embeddings if base else gpt_style,
        position_embedding="alibi" if alibi else ("learned" if gpt_style else "rope"),
        max_position_embeddings=n["seq_length"] if gpt_style and not alibi else None,
        norm="layernorm" if gpt_style else "rmsnorm", linear_bias=gpt_style and not alibi,
        dropout=0.1 if gpt_style and not alibi else 0.0, moe=moe, mla=base.mla if base else None,
    )


def zero_stage_from_text(text: str) -> int | None:
    """ZeRO stage named by a free-text zero_or_fsdp cell; None when it names none.

    In order: a stated stage ("ZeRO-3", "ZeRO stage 3", "stage 2") -> that stage; FSDP SHARD_GRAD_OP,
    HYBRID_SHARD_ZERO2 or parameters "not resharded" -> 2; FSDP FULL_SHARD / HYBRID_SHARD / FSDP2 /
    "fully sharded" / plain FSDP (not "FSDP=0") -> 3; "distributed optimizer" -> 1; DDP -> 0.
    """
    z = re.sub(r"[\s-]+", "_", text.lower())  # "ZeRO stage 3", "zero-3", "SHARD GRAD OP" -> one spelling
    stage = re.search(r"(?<![a-z0-9])(?:zero_?(?:stage[_=:]*)?|stage[_=:]*)([0-3])(?![0-9])", z)
    if stage:
        return int(stage.group(1))
    if re.search(r"shard_?grad_?op|hybrid_shard_zero2|not_resharded|reshard_after_forward_?=_?false", z):
        return 2
    if re.search(r"full_?shard|hybrid_?shard|fully_sharded|fsdp(?!_?=_?0)", z):
        return 3
    if re.search(r"distributed_optimizer|dist_optimizer", z):
        return 1
    if re.search(r"(?<![a-z0-9])ddp(?![a-z0-9])", z):
        return 0
    return None


def _precision(text: str) -> Precision | None:
    """'FP8 (hybrid)', 'BF16 + Float8 linears' -> fp8; fp16 ('half') only when bf16 is not named;
    'mixed precision', '16-bit', 'amp' -> bf16 (even beside 'fp32 master weights'); fp32 (or TF32) when
    only that is named. None when the cell names no format the planner models ('fp64', 'int4', 'fast')."""
    t = (text or "").lower()
    if "fp8" in t or "float8" in t:
        return Precision.fp8
    if "bf16" in t or "bfloat16" in t:
        return Precision.bf16
    if "fp16" in t or "float16" in t or re.search(r"\bhalf\b", t):
        return Precision.fp16
    if any(f not in ("fp32", "float32") for f in _OTHER_FORMAT.findall(t)):  # 'FP64 mixed': not a format we model
        return None
    if re.search(r"\b(?:mixed|amp|16-bit)\b", t):  # 'mixed precision (fp32 master weights)' trains in 16 bits
        return Precision.bf16
    if "fp32" in t or "float32" in t or "tf32" in t:
        return Precision.fp32
    return None


# numeric formats the planner does not model ('fp64', 'int8', 'nvfp4', 'double')
_OTHER_FORMAT = re.compile(r"(?:fp|float|int)\d+|\bdouble\b")


def build_case(row: dict[str, str], fitted: dict | None = None) -> RowCase | Skipped:
    """Turn one CSV row into a prediction case, or say why it cannot be judged (never raises for a bad row).

    ``fitted``: the calibration document to build reference profiles with (default: the packaged one).
    """
    run_id = row.get("run_id") or "?"
    ragged = _ragged(row)
    if ragged:
        return Skipped(run_id, source_key(run_id), ragged)
    try:
        return _build_case(row, fitted)
    except CellError as exc:
        return Skipped(run_id, source_key(run_id), str(exc))
    except (AutoparError, ValueError, TypeError, ZeroDivisionError) as exc:  # ValidationError is a ValueError
        return Skipped(run_id, source_key(run_id), f"row not usable: {_one_line(exc)}")


def _ragged(row: dict) -> str | None:
    """Why a row whose cells do not line up with the header cannot be read, or None.

    ``csv.DictReader`` files cells past the header under the key None and fills a short row with None.
    """
    extra = [c for c in row.get(None) or [] if c and c.strip()]  # a trailing comma adds blank cells: harmless
    short = sum(1 for k, value in row.items() if k is not None and value is None)
    if not extra and not short:
        return None
    header = sum(1 for k in row if k is not None)
    cells = header - short + len(extra)
    return (f"row has {cells} cells but the header has {header} columns; put every cell in its column "
            "(quote a cell that contains a comma)")


def _build_case(row: dict[str, str], fitted: dict | None) -> RowCase | Skipped:
    run_id = row.get("run_id") or "?"
    source = source_key(run_id)
    missing = [c for c in REQUIRED if not unstated(row.get(c))]
    if missing:
        return Skipped(run_id, source, "missing " + ", ".join(missing))
    n = _numbers(row)  # CellError (the row's reason) on a cell that is not a usable number
    defaults: list[str] = []
    era2021 = bool(_ERA_2021.search(_text(row, "source") + _text(row, "framework")))
    mcore = bool(_MCORE.search(_text(row, "framework") + _text(row, "source")))
    try:
        model = _model(row, defaults, n)
    except CellError:
        raise
    except (AutoparError, ValueError) as exc:
        return Skipped(run_id, source, f"model not buildable: {_one_line(exc)}")

    training = _training(row, n, era2021, defaults)
    if training is None:
        return Skipped(run_id, source, "global batch not stated (global_batch_size_seqs and derived columns empty)")
    gbs, precision = training.global_batch_seqs, training.precision

    system = _system(row["gpu_type"])
    if system is None:
        return Skipped(run_id, source, f"no reference profile for gpu_type '{row['gpu_type']}'")
    if not _PART_NAMED.search(row["gpu_type"]):
        defaults.append(f"gpu={system} (the cell names no memory size, form factor or system)")
    gpus = n["num_gpus"]
    gpn = n["gpus_per_node"] or 8
    nic = _nic_gbit_per_gpu(_text(row, "inter_node_interconnect"), gpn)
    if gpus > gpn and gpus % gpn:
        return Skipped(run_id, source, f"num_gpus={gpus} is more than one {gpn}-GPU node but not whole nodes")
    profile = reference_profile(system, nic_gbit_per_gpu=nic, fitted=fitted, gpus=gpus)

    tp, pp = n["tp"], n["pp"]
    cp, ep = n["cp"] or 1, n["ep"] or 1
    dp = n["dp"] or n["dp_derived"] or gpus // (tp * pp * cp)
    if dp * tp * pp * cp != gpus:
        return Skipped(run_id, source, f"tp x pp x cp x dp = {dp * tp * pp * cp} does not equal num_gpus={gpus}")
    mbs = n["micro_batch_size"]
    mbs_options = [mbs] if mbs else [b for b in (1, 2, 4, 8) if gbs % (dp * b) == 0]
    if not mbs_options or gbs % (dp * mbs_options[0]):
        return Skipped(run_id, source, f"global batch {gbs} is not divisible by dp x micro_batch = {dp * (mbs or 1)}")

    vp_text = _vp_text(row)
    schedule, v = _schedule(row, n, pp, vp_text, defaults)

    sp_text = unstated(row.get("sequence_parallel")).lower()
    sp = sp_text.startswith("on") if sp_text else (tp > 1 and not era2021)
    if not sp_text and tp > 1:
        defaults.append(f"sequence_parallel={'on' if sp else 'off'}")

    zero = zero_stage_from_text(row.get("zero_or_fsdp") or "")
    if zero is None:
        zero = 1 if mcore else 0
        defaults.append(f"zero_stage={zero} ({'distributed optimizer' if zero else 'DDP'})")

    fw = (_text(row, "framework") + " " + _text(row, "other_throughput_reported")).lower()
    tp_overlap = "tp-comm-overlap" in fw or "async tp" in fw
    if tp_overlap:
        defaults.append("tp_comm_overlap=on (the row's framework/throughput notes name TP-comm-overlap or async TP)")
    # Megatron-LM of 2021-22 all-reduced gradients after the backward pass (no overlap)
    dp_overlap = not era2021 and "no overlap of gradient" not in _text(row, "notes").lower()
    if era2021 and dp > 1:
        defaults.append("dp_comm_overlap=off (Megatron-LM 2021-22 reduced gradients after backward)")

    etp = _expert_tp(n["etp"], mcore, tp=tp, cp=cp, ep=ep, dp_shard=dp if zero else 1, defaults=defaults)

    target = framework_target(row, era2021, mcore, defaults)
    sends = _pp_sends(target, model, sp, era2021, pp > 1 and tp > 1, defaults)
    layout_kwargs = dict(
        dp_replicate=1 if zero else dp, dp_shard=dp if zero else 1, tp=tp, sp=sp, cp=cp, pp=pp, ep=ep, etp=etp,
        zero_stage=zero,
        tp_comm_overlap=tp_overlap, dp_comm_overlap=dp_overlap, pp_scatter_gather=sends,
        ep_comm_overlap="dualpipe" in vp_text.lower(),
    )
    recompute = _stated_recompute(row, fw, model, pp, layout_kwargs, defaults)
    per_stage = None if mbs else _titan_2024_micro_batches(row, gbs // dp, pp, defaults)
    found = _fill_unstated(model, training, profile, layout_kwargs, schedule, v, mbs_options, recompute,
                           target=target, mbs_of_v=per_stage)
    if isinstance(found, AutoparError):
        return Skipped(run_id, source, f"layout not valid: {found}")
    layout = found
    _state_chosen(layout, schedule, v, stated_mbs=mbs is not None or per_stage is not None,
                  stated_recompute=recompute is not None,
                  defaults=defaults)

    comparison = _comparison(row, precision, n)
    if comparison is None:
        return Skipped(run_id, source, "no throughput figure comparable in this row's convention")
    metric, reported, flop_convention = comparison
    primary = not (row.get("source_quality") or "").strip().lower().startswith("secondary")
    return RowCase(run_id, source, system_family(system), model, training, profile, layout, metric, reported,
                   flop_convention, defaults, primary, target)


def _training(row: dict[str, str], n: dict, era2021: bool, defaults: list[str]) -> TrainingConfig | None:
    """The row's sequence, global batch (sequences, or tokens / sequence) and precision; None when the
    global batch is not stated. CellError on a batch below one sequence or an unknown format."""
    seq = n["seq_length"]
    gbs = n["global_batch_size_seqs"] or n["global_batch_size_seqs_derived"]
    if gbs is None and n["global_batch_tokens"] is not None:
        gbs = n["global_batch_tokens"] // seq
        if gbs == 0:
            raise CellError("global_batch_tokens", row.get("global_batch_tokens"),
                            f"give the tokens per optimizer step (at least seq_length={seq})",
                            problem=f"is less than one sequence of seq_length={seq}")
    if gbs is None:
        return None
    precision_text = unstated(row.get("precision"))
    precision = _precision(precision_text) if precision_text else Precision.bf16
    if precision is None:
        raise CellError("precision", row.get("precision"), "name bf16, fp16, fp8 or fp32 (or 'mixed precision')",
                        problem="names no numeric format the planner models")
    if not precision_text:
        defaults.append("precision=bf16")
    defaults.append("attention=" + ("unfused (Megatron 2021-22)" if era2021 else "flash"))
    return TrainingConfig(seq_length=seq, global_batch_size=gbs, precision=precision, flash_attention=not era2021)


def _schedule(row: dict[str, str], n: dict, pp: int, vp_text: str, defaults: list[str]) -> tuple[Schedule, int]:
    """(schedule, virtual stages; 0 = interleaving depth still to choose) of the row's pipeline."""
    if pp == 1:
        return Schedule.one_f_one_b, 1
    if "dualpipe" in vp_text.lower():
        defaults.append("schedule=zero_bubble (stands in for DualPipe)")
        defaults.append("ep_comm_overlap=on (DualPipe overlaps the expert all-to-all with computation)")
        return Schedule.zero_bubble, 1
    if n["virtual_pipeline_stages"] and n["virtual_pipeline_stages"] > 1:
        return Schedule.interleaved_1f1b, n["virtual_pipeline_stages"]
    if "interleav" in vp_text.lower():
        return Schedule.interleaved_1f1b, 0
    if not vp_text and "deepspeed" in (row.get("framework") or "").lower():
        defaults.append("schedule=1f1b (DeepSpeed's pipeline engine has no interleaved schedule)")
        return Schedule.one_f_one_b, 1
    if not vp_text:
        return Schedule.interleaved_1f1b, 0  # unpublished: interleaving depth chosen later
    return Schedule.one_f_one_b, 1


def _stated_recompute(row: dict[str, str], fw: str, model: ModelSpec, pp: int, layout_kwargs: dict,
                      defaults: list[str]) -> Recompute | None:
    """The recompute the row states (None: unstated). torchtitan's per-op selective AC ("selective op",
    "per-op SAC") is ``op``; its layer-selective AC ("selective layer") goes into ``layout_kwargs`` as full
    recompute of every other layer."""
    rc_text = unstated(row.get("activation_recompute")).lower()
    if "torchtitan" in fw and rc_text.startswith("selective"):
        if "op" in re.findall(r"[a-z]+", rc_text):
            return Recompute.op
        layout_kwargs["recompute_per_stage"] = [
            StageRecompute(kind=Recompute.full, num_layers=model.num_layers // (2 * pp))] * pp
        defaults.append("recompute: torchtitan layer-selective AC as full recompute of every other layer")
    for kind in (Recompute.full, Recompute.selective, Recompute.none):
        if rc_text.startswith(kind.value):
            return kind
    return None


def _state_chosen(layout: ParallelLayout, schedule: Schedule, v: int, *, stated_mbs: bool, stated_recompute: bool,
                  defaults: list[str]) -> None:
    """The defaults :func:`_fill_unstated` chose, as stated lines."""
    if schedule is Schedule.interleaved_1f1b and layout.schedule is not schedule:
        defaults.append("schedule=1f1b (no interleaving depth divides the layers and micro-batches)")
    elif schedule is Schedule.interleaved_1f1b and v <= 1:
        defaults.append(f"virtual_stages={layout.virtual_stages} (fastest predicted; the source does not say)")
    if not stated_mbs:
        defaults.append(f"micro_batch_size={layout.micro_batch_size} "
                        "(fastest predicted that fits; the source does not say)")
    if not stated_recompute:
        per = layout.recompute_per_stage
        text = recompute_text(layout) if per is None else f"full on {per[0].num_layers} layers of each stage"
        defaults.append(f"recompute={text} (the least that fits in memory)")


def framework_target(row: dict[str, str], era2021: bool, mcore: bool, defaults: list[str]) -> str:
    """The target (:mod:`planner.targets`) whose facts a row's framework runs with: DeepSpeed rows (Megatron-
    DeepSpeed, MT-NLG's Megatron-LM + DeepSpeed) ``deepspeed``, torchtitan ``torchtitan``, Megatron-LM /
    Megatron-Core / NeMo ``megatron``; another framework the closest, stated in ``defaults``: PyTorch FSDP
    stacks (llm-foundry's Composer, Meta's internal 4D stack) ``torchtitan``, the rest ``megatron``."""
    fw = _text(row, "framework").lower()
    if "deepspeed" in fw:
        return "deepspeed"
    if "torchtitan" in fw:
        return "torchtitan"
    if mcore or era2021 or "megatron" in fw:
        return "megatron"
    closest = "torchtitan" if re.search(r"fsdp|composer|llm-foundry|meta internal", fw) else "megatron"
    defaults.append(f"target facts={closest} (the closest to '{_text(row, 'framework')}': loss memory, "
                    "model states and pipeline sends)")
    return closest


def _pp_sends(target: str, model: ModelSpec, sp: bool, era2021: bool, tp_pp: bool, defaults: list[str]) -> bool:
    """The row's ``pp_scatter_gather``: what ``target``'s pipeline sends (``TargetFacts.pp_sends``) except
    Megatron-LM 2021-22, whose scatter/gather optimisation sent 1/tp per TP rank without sequence parallelism
    (Narayanan et al. 2021 §4.1; ``--no-scatter-gather-tensors-in-pipeline`` turned it off); stated in
    ``defaults`` where it decides the sends (pp > 1 and tp > 1)."""
    if era2021 and target == "megatron":
        sends, why = True, "Megatron-LM 2021-22's scatter/gather: each TP rank sends 1/tp"
    else:
        sends = planned_scatter_gather(target, model, sp)
        why = f"what {target} sends with sp={'on' if sp else 'off'}"
    if tp_pp:
        defaults.append(f"pp_scatter_gather={'on' if sends else 'off'} ({why})")
    return sends


def _expert_tp(stated: int | None, mcore: bool, *, tp: int, cp: int, ep: int, dp_shard: int,
               defaults: list[str]) -> int | None:
    """The layout's ``etp`` (None: tp): the row's, else 1 for a Megatron-Core row whose ep does not fold
    over its ``dp_shard x cp`` ranks with the experts split over tp but does over ``dp_shard x cp x tp``
    with whole experts (:meth:`ParallelLayout.expert_fold_problem`; Megatron-Core's
    --expert-tensor-parallel-size 1, what its MoE recipes set), stated in ``defaults``."""
    if stated is not None:
        return None if stated == tp else stated
    if not mcore or ep == 1 or tp == 1:
        return None

    def fold(etp: int | None) -> str | None:
        return ParallelLayout.model_construct(dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, etp=etp).expert_fold_problem()

    unfolded = fold(None)
    if unfolded is None or fold(1) is not None:
        return None
    defaults.append(f"etp=1 (not stated; with the experts split over tp={tp}, {unfolded})")
    return 1


def _titan_2024_micro_batches(row: dict[str, str], local: int, pp: int,
                              defaults: list[str]) -> Callable[[int], list[int]] | None:
    """A 2024 torchtitan row's micro-batch size at each interleaving depth v: the rank's ``local`` batch over
    pp x v micro-batches (:data:`_TITAN_2024`); None for other rows or without a pipeline."""
    if pp <= 1 or not _TITAN_2024.search(_text(row, "source") + " " + _text(row, "framework")):
        return None
    defaults.append(f"micro_batch_size=local batch {local} / (pp x stages per rank) (torchtitan 2024: "
                    "pipeline_parallel_microbatches defaulted to the number of stages)")
    return lambda v: [local // (pp * v)] if local % (pp * v) == 0 else []


def _fill_unstated(
    model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, layout_kwargs: dict,
    schedule: Schedule, v: int, mbs_options: list[int], recompute: Recompute | None, *, target: str = "autopar",
    mbs_of_v: Callable[[int], list[int]] | None = None,
) -> ParallelLayout | AutoparError:
    """The layout for the knobs a source left unstated: interleaving depth and micro-batch size by
    fastest prediction, recompute the least that fits (:func:`_least_recompute`). A stated v or micro-batch
    is kept; plain 1F1B is the fallback when no interleaving depth is valid. ``mbs_of_v``: the micro-batch
    sizes a framework's own default gives at depth v, in place of ``mbs_options``. Returns the last error
    if none is."""
    sizes = mbs_of_v or (lambda _v: mbs_options)
    if schedule is Schedule.interleaved_1f1b:
        depths = [v] if v > 1 else range(2, model.num_layers // layout_kwargs["pp"] + 1)
        combos = [((schedule, d), b) for d in depths for b in sizes(d)]
        fallback = [((Schedule.one_f_one_b, 1), b) for b in sizes(1)]
    else:
        combos, fallback = [((schedule, 1), b) for b in sizes(1)], []
    best: tuple[float, ParallelLayout] | None = None
    last_error = AutoparError("layout", "none", "check the row's degrees", problem="found no valid combination")
    for options in (combos, fallback):
        for (sched_try, v_try), mbs_try in options:
            kwargs = {**layout_kwargs, "schedule": sched_try, "virtual_stages": v_try, "micro_batch_size": mbs_try}
            try:
                step, layout = _least_recompute(model, training, profile, kwargs, recompute, target)
            except AutoparError as exc:
                last_error = exc
                continue
            if best is None or step < best[0]:
                best = (step, layout)
        if best is not None:
            return best[1]
    return last_error


def _least_recompute(model: ModelSpec, training: TrainingConfig, profile: ClusterProfile, kwargs: dict,
                     recompute: Recompute | None, target: str = "autopar") -> tuple[float, ParallelLayout]:
    """(step time, layout) with the row's recompute, or, where the source does not say, the least
    recompute that fits: none, selective, full recompute of the first N layers of every stage for the
    smallest N that fits (Megatron's ``--recompute-method block --recompute-num-layers N``; memory
    falls as N grows, so N is bisected), else full. AutoparError when the layout is not valid."""
    def priced(**rc) -> tuple[float, ParallelLayout, bool]:
        layout = ParallelLayout(**kwargs, **rc)
        pred = predict(model, training, profile, layout, target=target)
        return pred.step_time_s, layout, pred.memory.fits

    if recompute is not None:
        return priced(recompute=recompute)[:2]
    for kind in (Recompute.none, Recompute.selective):
        step, layout, fits = priced(recompute=kind)
        if fits:
            return step, layout
    pp = kwargs["pp"]
    lo, hi, found = 1, -(-model.num_layers // pp) - 1, None
    while lo <= hi:
        n = (lo + hi) // 2
        step, layout, fits = priced(recompute_per_stage=[StageRecompute(kind=Recompute.full, num_layers=n)] * pp)
        if fits:
            found, hi = (step, layout), n - 1
        else:
            lo = n + 1
    return found if found is not None else priced(recompute=Recompute.full)[:2]


def _comparison(row: dict[str, str], precision: Precision, n: dict[str, float | int | None] | None = None,
                ) -> tuple[str, float, str] | None:
    """(metric, reported value, FLOP convention) in the row's own convention: iteration time where
    given; tokens/s for FP8 rows and where it is the published figure; TFLOP/s with the source's
    FLOP count; MFU; derived tokens/s last. None when the row has no comparable figure.

    ``n``: the row's checked numbers (:func:`_numbers`); read here when not given (CellError on a bad figure).
    """
    if n is None:
        n = {c: _figure(row, c, at_most=100 if c == "mfu_pct_reported" else None) for c in FIGURE_COLUMNS}
    conv = _text(row, "flop_convention").lower()
    flop_convention = "hardware" if ("includes the recompute" in conv or "hardware flops" in conv) else "model"
    tokens_reported, tflops = n["tokens_per_sec_per_gpu_reported"], n["tflops_per_gpu_reported"]
    if n["iteration_time_s_reported"] is not None:
        return "iteration_time_s", n["iteration_time_s_reported"], flop_convention
    if tokens_reported is not None and (precision is Precision.fp8 or tflops is None):
        return "tokens_per_s_per_gpu", tokens_reported, flop_convention
    if tflops is not None and precision is not Precision.fp8:
        return "tflops_per_gpu", tflops, flop_convention
    if n["mfu_pct_reported"] is not None and precision is not Precision.fp8:
        return "mfu", n["mfu_pct_reported"] / 100, flop_convention
    if n["tokens_per_sec_per_gpu_derived"] is not None:
        return "tokens_per_s_per_gpu", n["tokens_per_sec_per_gpu_derived"], flop_convention
    return None


def predicted_metric(case: RowCase, pred: Prediction) -> float:
    """The prediction expressed in the row's metric and FLOP convention."""
    n = case.profile.num_gpus
    if case.metric == "iteration_time_s":
        return pred.step_time_s
    if case.metric == "tokens_per_s_per_gpu":
        return pred.tokens_per_s_per_gpu
    flops = pred.hardware_flops_per_step if case.flop_convention == "hardware" else pred.model_flops_per_step
    if case.metric == "tflops_per_gpu":
        return flops / pred.step_time_s / n / 1e12
    return pred.mfu


def evaluate(case: RowCase, profile: ClusterProfile | None = None) -> RowResult:
    """Predict one case (optionally on another profile, e.g. with refitted assumptions)."""
    pred = predict(case.model, case.training, profile or case.profile, case.layout, target=case.target)
    value = predicted_metric(case, pred)
    return RowResult(case, value, value / case.reported - 1.0, pred)



def load_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a published-runs CSV (UTF-8, with or without a byte-order mark), as ``csv.DictReader``
    gives them. AutoparError naming FILE for a file that cannot be read as such a CSV."""
    p = Path(path)
    # Excel's "CSV UTF-8" starts with a byte-order mark
    text = read_input(p, "FILE", "CSV with the columns of published_runs.csv").removeprefix("\ufeff")
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    rows: list[dict[str, str]] = []
    line = 0  # last line of the last record read
    try:
        header = reader.fieldnames
        line = reader.line_num
        if not header or "run_id" not in header:
            raise AutoparError("FILE", str(p), "the CSV needs a header with run_id and the published_runs.csv "
                               "columns", problem="has no run_id column")
        for row in reader:
            rows.append(row)
            line = reader.line_num
    except csv.Error as exc:
        where = f"in the {'header' if not line else 'row'} starting on line {line + 1}"
        if "field larger than field limit" in str(exc):
            raise AutoparError("FILE", str(p), "a cell is a number or a short note; look for an unclosed quote "
                               "(it runs a cell on to the end of the file)",
                               problem=f"has a cell longer than {csv.field_size_limit():,} characters {where}"
                               ) from None
        raise AutoparError("FILE", str(p), "quote a cell as a whole (\"like, this\") and double a quote inside "
                           "it (\"\"); an unclosed quote runs a cell on to the end of the file",
                           problem=f"is not valid CSV {where} ({exc})") from None
    return rows


def build_cases(rows: list[dict[str, str]], fitted: dict | None = None) -> tuple[list[RowCase], list[Skipped]]:
    cases, skipped = [], []
    for row in rows:
        if not _ragged(row) and (row.get("config_completeness") or "complete") != "complete":
            run_id = row.get("run_id") or "?"
            skipped.append(Skipped(run_id, source_key(run_id),
                                   f"config_completeness={row.get('config_completeness')}: "
                                   f"missing {row.get('missing_fields')}"))
            continue
        result = build_case(row, fitted)
        (cases if isinstance(result, RowCase) else skipped).append(result)
    return cases, skipped


@dataclass
class Summary:
    rows: int
    median_abs_err: float
    p90_abs_err: float
    max_abs_err: float
    mean_abs_err: float


def summarize(errors: list[float]) -> Summary:
    abs_err = sorted(abs(e) for e in errors)
    if not abs_err:
        return Summary(0, math.nan, math.nan, math.nan, math.nan)
    p90 = abs_err[min(len(abs_err) - 1, math.ceil(0.9 * len(abs_err)) - 1)]
    return Summary(len(abs_err), statistics.median(abs_err), p90, abs_err[-1], statistics.fmean(abs_err))


NOISE = 0.02
"""Measured step times of one job closer than this (relative) are a tie, not an order to get right."""


def release(run_id: str) -> str:
    """The software release (and MLPerf submitter) a run id names after its source, '' where none: runs of
    one job on different releases differ by more than their layouts (``mbridge_26.02_...``,
    ``mlperf_v4.0_gpt3_smc_...``)."""
    tokens = run_id.split("_")
    if len(tokens) > 1 and re.fullmatch(r"v?\d+(\.\d+)+", tokens[1]):
        return "_".join(tokens[1:2] + (tokens[3:4] if tokens[0] == "mlperf" else []))
    return ""


def same_job(case: RowCase) -> tuple:
    """What makes two published rows the same job run two ways: source and software release, model, GPUs,
    sequence, batch, precision. Their layouts differ."""
    t = case.training
    return (case.source, release(case.run_id), case.model.model_dump_json(), case.profile.name,
            case.profile.num_gpus, t.seq_length, t.global_batch_seqs, t.precision.value)


def layout_order(results: list[RowResult]) -> tuple[int, int, list[str]]:
    """(pairs ordered as measured, pairs compared, the misordered pairs) over every two rows of the same job
    (:func:`same_job`) whose layouts differ and whose measured step times differ by more than
    :data:`NOISE`. The measured step time is the prediction's divided by the row's step-time ratio."""
    groups: dict[tuple, list[tuple[RowResult, float]]] = {}
    for res in results:
        ratio = 1 + res.error if res.case.metric == "iteration_time_s" else 1 / (1 + res.error)
        groups.setdefault(same_job(res.case), []).append((res, res.prediction.step_time_s / ratio))
    right = total = 0
    wrong: list[str] = []
    for members in groups.values():
        for i, (a, ma) in enumerate(members):
            for b, mb in members[i + 1:]:
                if a.case.layout == b.case.layout or abs(ma / mb - 1) <= NOISE:
                    continue
                total += 1
                if (a.prediction.step_time_s < b.prediction.step_time_s) == (ma < mb):
                    right += 1
                else:
                    wrong.append(f"{a.case.run_id} vs {b.case.run_id}: measured {ma / mb:.2f}x, "
                                 f"predicted {a.prediction.step_time_s / b.prediction.step_time_s:.2f}x")
    return right, total, wrong

"""Compute measurements on one device: GEMMs, attention, bandwidth-bound ops → a ``ComputeProfile``.

Runs in one process on one device (the orchestrator calls it on one rank per node while the others
wait). What is measured is a :class:`ComputeGrid`: by default the GEMM shapes a transformer block
produces, each in the operand layout torch's linear runs it in (weight stored [out×in]; forward
``Y = X·Wᵀ`` as ``(tokens, out, in, nt)``, input gradient ``dX = dY·W`` as ``(tokens, in, out, nn)``,
weight gradient ``dW = dYᵀ·X`` as ``(out, in, tokens, tn)``, as
:func:`planner.cost.compute.linear_gemms_s` prices them) for a model's hidden / FFN / head sizes at
each TP degree, or a model-free grid from small to large in all three layouts; causal SDPA across
sequence lengths and head layouts (forward, and backward timed on its own); and the norm / SwiGLU /
residual add / softmax-cross-entropy ops, in each precision the device runs.

``achieved_matmul_tflops[p]`` is the best GEMM rate seen in precision ``p``;
``achieved_memory_bandwidth_bytes_per_s`` is the best rate of the largest residual add (the op whose
bytes are least ambiguous: read two tensors, write one), so caches do not inflate it on CPU. The
planner prices each bandwidth-bound op from its own points (rmsnorm, silu_mul, add,
softmax_cross_entropy), never above the rate of its largest size, for the same reason
(:func:`planner.cost.compute.elementwise_time_s`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from planner.contracts import ModelSpec, Precision
from planner.contracts.cluster import (
    LINEAR_LAYOUTS,
    AttentionBlocking,
    AttentionPoint,
    ComputeProfile,
    DeviceCheck,
    ElementwisePoint,
    GemmLayout,
    GemmPoint,
    slow_checks,
    slow_device_limit,
)
from planner.cost.compute import cross_entropy_bytes, sdpa_takes_grouped_kv
from planner.errors import AutoparError
from profiler.gpustate import GpuStateSampler
from profiler.identity import available_memory_bytes, reachable_cache_bytes
from profiler.timing import HOLD_STATS, Budget, TimingResult, sync, time_fn, time_rounds

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]

# torch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp; its source and torch
# 2.13's timings here agree) takes its queries in blocks of 32 rows below q_len 192, 64 below 768 and 256
# from 768, and its keys in blocks of 512, forward and backward alike; a causal query block computes every
# key block, whole, up to its last row's. Its rate steps where the query blocks change (measured, 1
# thread, 8 heads, d=64, bf16 backward on the computed tiles: 15.0 GFLOP/s at 191, 22.6 at 192; 31.0 at
# 767, 40.2 at 768; fp32 alike). Recorded as ComputeProfile.attention_blocking of CPU profiles.
CPU_FLASH_BLOCKING = (AttentionBlocking(from_q_len=0, q_block=32, kv_block=512),
                      AttentionBlocking(from_q_len=192, q_block=64, kv_block=512),
                      AttentionBlocking(from_q_len=768, q_block=256, kv_block=512))

DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}
ELEMENTWISE_OPS = ("rmsnorm", "silu_mul", "add", "softmax_cross_entropy")
# (m, n, k, layout) of one GEMM (GemmLayout: how torch's linear lays out its three GEMMs' operands)
GemmShape = tuple[int, int, int, GemmLayout]


@dataclass
class ComputeGrid:
    """What :func:`measure_compute` measures and how carefully.

    ``gemm``: (m, n, k, layout) of ``op(A)·op(B)``, ``m×k`` by ``k×n``, operands laid out as
    ``layout`` (:class:`~planner.contracts.cluster.GemmLayout`); ``attention``: (batch, seq, heads, kv_heads, head_dim),
    causal; ``elementwise_bytes``: size in bytes of the activation each elementwise op reads.

    A time budget (CPU grids): in each precision the GEMMs, and the attention configs, are measured
    in order of FLOPs, and the walk stops at the first whose call takes longer than ``max_call_s``
    or whose timing would take the table's time past ``max_table_s`` (the GEMMs of each layout walk
    on their own, with an equal share of it) (:class:`profiler.timing.Budget`;
    the smallest is always measured): it and the larger ones are not measured, and the planner
    prices them at the rate of the nearest measured shapes; the profile's notes say where each table
    stopped. A budget in seconds, not in FLOPs, because precisions run at very different rates on one
    CPU: on a 2-vCPU AMD EPYC VM without native bf16 a 1024³ GEMM took 2.3 s in bf16 (0.9 GFLOP/s)
    and 26.5 ms in fp32, 87x apart.
    """

    gemm: list[GemmShape]
    attention: list[tuple[int, int, int, int, int]]
    elementwise_bytes: list[int]
    precisions: list[Precision]
    warmup: int = 2
    trials: int = 5
    min_time_s: float = 0.0
    max_call_s: float | None = None
    max_table_s: float | None = None
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------- precisions


def _fp8_matmul_problem(device: torch.device) -> str | None:
    """Why FP8 matmul cannot run on ``device`` (None = it can)."""
    if device.type != "cuda":
        return f"FP8 matmul needs a CUDA device (this is {device.type})"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn"
    try:
        a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
        b = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        sync(device)
    except Exception as exc:  # noqa: BLE001 - any failure means "not supported here"
        return f"torch._scaled_mm failed on {torch.cuda.get_device_name(device)}: {type(exc).__name__}: {exc}"[:300]
    return None


def cpu_bf16_is_native() -> bool | None:
    """Whether torch runs bf16 matmul on this CPU through oneDNN (AVX-512 or AMX), not its unoptimised
    fallback; None when torch cannot say."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - a private probe: unknown is not an error
        return None


def unsupported_precisions(device: torch.device) -> dict[Precision, str]:
    """Precisions ``device`` cannot measure, each with the reason."""
    device = torch.device(device)
    if device.type == "cpu":
        return {
            Precision.fp16: ("CPU fp16 matmul is an unoptimised fallback (~100x slower than bf16); "
                             "not a training precision on CPU"),
            Precision.fp8: "FP8 matmul needs a CUDA device with FP8 tensor cores",
        }
    out: dict[Precision, str] = {}
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        out[Precision.bf16] = f"{torch.cuda.get_device_name(device)} has no bf16 support"
    problem = _fp8_matmul_problem(device)
    if problem:
        out[Precision.fp8] = problem
    return out


def supported_precisions(device: torch.device) -> list[Precision]:
    """Precisions measured on ``device``: CPU fp32 and bf16; CUDA adds fp16 and fp8 where torch can run
    an FP8 matmul there (``torch._scaled_mm``); the reasons for what is left out are logged."""
    device = torch.device(device)
    missing = unsupported_precisions(device)
    for p, why in missing.items():
        log.info("precision %s not measured on %s: %s", p.value, device, why)
    return [p for p in Precision if p not in missing]


def parse_precisions(text: str, device: torch.device | None = None) -> list[Precision]:
    """``"bf16,fp32"`` → precisions, checked against what ``device`` (default: CUDA if present, else
    CPU) can run — before anything is measured."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    names = [t.strip().lower() for t in (text or "").split(",") if t.strip()]
    if not names:
        raise AutoparError(
            "--precisions", text, "give a comma-separated list, e.g. --precisions bf16,fp32", problem="is empty"
        )
    known = {p.value: p for p in Precision}
    out: list[Precision] = []
    for name in names:
        if name not in known:
            raise AutoparError(
                "--precisions", name, "choose from " + ", ".join(known), problem="is not a known precision"
            )
        out.append(known[name])
    missing = unsupported_precisions(device)
    for p in out:
        if p in missing:
            can = ",".join(q.value for q in Precision if q not in missing)
            raise AutoparError(
                "--precisions",
                p.value,
                f"this {device.type} device can measure {can} ({missing[p]})",
                problem=f"cannot run on {device.type}",
            )
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------------------------- grid


def linear_shapes(model: ModelSpec, tp: int) -> dict[str, tuple[int, int]]:
    """(out, in) features of each linear of a block (and the LM head) on one TP rank."""
    h, a, d = model.hidden_size, model.num_attention_heads, model.head_size
    up_mult = 2 if model.ffn_kind == "swiglu" else 1
    shapes: dict[str, tuple[int, int]] = {}
    if model.mla is not None:
        m = model.mla
        dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            shapes["q_down"] = (m.q_lora_rank, h)
            shapes["q_up"] = (max(a * dqk // tp, 1), m.q_lora_rank)
        else:
            shapes["q"] = (max(a * dqk // tp, 1), h)
        shapes["kv_down"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
        shapes["kv_up"] = (max(a * (m.qk_nope_head_dim + m.v_head_dim) // tp, 1), m.kv_lora_rank)
        shapes["attn_out"] = (h, max(a * m.v_head_dim // tp, 1))
    else:
        shapes["qkv"] = (max((a * d + 2 * model.kv_heads * d) // tp, 1), h)
        shapes["attn_out"] = (h, max(a * d // tp, 1))
    ffn = model.ffn_hidden_size
    if model.moe is not None:
        ffn = model.moe.expert_ffn_hidden_size  # routed experts; the dense/shared FFN added below
        shapes["expert_up"] = (max(up_mult * ffn // tp, 1), h)
        shapes["expert_down"] = (h, max(ffn // tp, 1))
    shapes["mlp_up"] = (max(up_mult * model.ffn_hidden_size // tp, 1), h)
    shapes["mlp_down"] = (h, max(model.ffn_hidden_size // tp, 1))
    shapes["lm_head"] = (max(model.vocab_size // tp, 1), h)
    return shapes


def linear_gemms(tokens: int, out_features: int, in_features: int) -> list[GemmShape]:
    """The three GEMMs of a linear layer (weight stored [out×in]) as torch runs them: (m, n, k, layout)."""
    return [
        (tokens, out_features, in_features, GemmLayout.nt),  # Y = X·Wᵀ
        (tokens, in_features, out_features, GemmLayout.nn),  # dX = dY·W
        (out_features, in_features, tokens, GemmLayout.tn),  # dW = dYᵀ·X
    ]


def _default_precisions(device_type: str) -> list[Precision]:
    if device_type == "cpu":
        return [Precision.fp32, Precision.bf16]
    if device_type == "cuda" and torch.cuda.is_available():
        return supported_precisions(torch.device("cuda"))
    return [Precision.fp32, Precision.bf16, Precision.fp16]


def default_grid(
    model: ModelSpec | None = None,
    tp_degrees: list[int] | None = None,
    micro_batch_tokens: list[int] | None = None,
    quick: bool = False,
    device_type: str = "cpu",
) -> ComputeGrid:
    """The shapes to measure: a model's (at each TP degree and micro-batch token count) or a
    model-free grid from small to large; sized for the device (a CPU does far fewer FLOP/s)."""
    cpu = device_type == "cpu"
    precisions = _default_precisions(device_type)
    if cpu:
        timing = dict(warmup=1, trials=3, min_time_s=0.002) if quick else dict(warmup=2, trials=5, min_time_s=0.02)
        # per table (one kind of operation in one precision): a quick profile has about a minute in all
        caps = dict(max_call_s=0.1, max_table_s=6.0) if quick else dict(max_call_s=2.0, max_table_s=120.0)
    else:
        timing = dict(warmup=3, trials=5, min_time_s=0.002) if quick else dict(warmup=5, trials=7, min_time_s=0.005)
        caps = dict(max_call_s=None, max_table_s=None)

    if model is not None:
        tps = tp_degrees or [t for t in (1, 2, 4, 8) if model.num_attention_heads % t == 0]
        if micro_batch_tokens:
            tokens_list = micro_batch_tokens
        elif cpu:
            tokens_list = [256] if quick else [256, 1024]
        else:
            tokens_list = [4096] if quick else [2048, 4096, 8192, 16384]
        gemm: list[GemmShape] = []
        attention: list[tuple[int, int, int, int, int]] = []
        for tp in tps:
            heads = max(model.num_attention_heads // tp, 1)
            kv_heads = heads if model.mla is not None else max(model.kv_heads // tp, 1)
            for tokens in tokens_list:
                for out_f, in_f in linear_shapes(model, tp).values():
                    gemm.extend(linear_gemms(tokens, out_f, in_f))
                attention.append((1, tokens, heads, kv_heads, model.head_size))
        elt_bytes = sorted({t * model.hidden_size * 2 for t in tokens_list}
                           | {max(tokens_list) * model.hidden_size * 8})
    else:
        if cpu:
            # 2x apart: rates are interpolated between neighbours, and 4x apart is too coarse for 15%
            sizes = [64, 128, 256, 512, 1024] if quick else [64, 128, 256, 512, 1024, 2048]
            # torch's CPU flash kernel changes its query blocks at 192 and 768 (CPU_FLASH_BLOCKING):
            # a point in each regime, and 768 itself, so no regime is priced from another's rates
            seqs = [128, 256, 512, 768, 1024] if quick else [64, 128, 256, 512, 768, 1024, 2048]
            layouts = ([(8, 8, 64), (8, 2, 64)] if quick
                       else [(4, 4, 64), (8, 2, 64), (8, 8, 64), (16, 16, 64), (8, 8, 128)])
            elt_bytes = [1 << 20, 16 << 20] if quick else [256 << 10, 2 << 20, 16 << 20, 64 << 20]
        else:
            sizes = [512, 1024, 2048, 4096, 8192] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
            seqs = [1024, 2048, 4096, 8192] if quick else [512, 1024, 2048, 4096, 8192, 16384]
            # three head counts even in a quick profile: a flash kernel's rate follows its thread blocks
            # (batch x heads x length / 128) against the SMs, and one layout's points span few of them
            # (from the H200 full table's points at the quick lengths, the 24 attention times neither
            # grid holds: median error 27.6% from 32/8 alone, 16.8% from these three)
            layouts = [(8, 8, 128), (32, 8, 128), (64, 8, 128)] if quick else \
                [(8, 8, 128), (32, 8, 128), (64, 8, 128), (16, 16, 64)]
            elt_bytes = [16 << 20, 256 << 20] if quick else [1 << 20, 16 << 20, 256 << 20, 1 << 30]
        # every shape in each linear GEMM's layout: a library's speed can depend on it (GemmLayout)
        gemm = [(m, n, k, lay) for m in sizes for n in sizes for k in sizes for lay in LINEAR_LAYOUTS]
        attention = [(1, s, h, kv, d) for (h, kv, d) in layouts for s in seqs]
    return ComputeGrid(
        gemm=list(dict.fromkeys(gemm)),
        attention=list(dict.fromkeys(attention)),
        elementwise_bytes=sorted(set(elt_bytes)),
        precisions=precisions,
        **timing,
        **caps,
    )


# ------------------------------------------------------------------------------------------ measure


def _time(fn: Callable[[], object], device: torch.device, grid: ComputeGrid) -> TimingResult:
    return time_fn(fn, device=device, warmup=grid.warmup, trials=grid.trials, min_time_s=grid.min_time_s)


def _gemm_fn(m: int, n: int, k: int, precision: Precision, device: torch.device,
             layout: GemmLayout = GemmLayout.nn) -> Callable[[], object] | None:
    """A closure running one GEMM of ``m×k`` by ``k×n`` in ``precision``, operands laid out as
    ``layout`` (``nt``: ``A·Bᵀ`` with B stored [n×k], ``tn``: ``Aᵀ·B`` with A stored [k×m]); None if
    the shape cannot run in it. FP8 runs ``nt`` whatever ``layout`` says: ``torch._scaled_mm`` takes
    only a row-major A and a column-major B, and FP8 recipes transpose their operands to get that."""
    if precision is Precision.fp8:
        if k % 16 or n % 16:
            return None  # torch._scaled_mm needs k and n multiples of 16
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    dtype = DTYPES[precision]
    a, b = gemm_operands(m, n, k, layout, dtype, device)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return lambda: torch.matmul(a, b, out=out)


def timed_layout(layout: GemmLayout, precision: Precision) -> GemmLayout:
    """The layout a GEMM of ``precision`` is timed (and recorded) in: FP8 runs ``nt`` whatever the
    GEMM's own layout (:func:`_gemm_fn`)."""
    return GemmLayout.nt if precision is Precision.fp8 else layout


def gemm_operands(m: int, n: int, k: int, layout: GemmLayout, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(A as m×k, B as k×n), random, each a stored tensor or the transposed view of one as ``layout`` says."""
    a = torch.randn(k, m, device=device, dtype=dtype).t() if layout is GemmLayout.tn \
        else torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).t() if layout is GemmLayout.nt \
        else torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def measure_gemm(m: int, n: int, k: int, precision: Precision, device: torch.device,
                 grid: ComputeGrid) -> GemmPoint | None:
    return measure_gemms([((m, n, k, GemmLayout.nn), precision)], device, grid)[0]


ROUNDS_BUDGET_BYTES = 2 << 30  # operands kept alive at once for interleaved rounds (a batch of shapes)


def _batches(sizes: list[int], budget: int = ROUNDS_BUDGET_BYTES) -> list[range]:
    """Consecutive index ranges whose summed ``sizes`` stay within ``budget`` (one item at least each)."""
    out, start, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and held + size > budget:
            out.append(range(start, i))
            start, held = i, 0
        held += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _element_bytes(precision: Precision) -> int:
    return 1 if precision is Precision.fp8 else DTYPES[precision].itemsize


def _timed_in_rounds(sizes: list[int], make_fns: Callable[[int], list[Callable[[], object]] | None],
                     device: torch.device, grid: ComputeGrid,
                     on_progress: Callable[[int], None] | None,
                     budget: Budget | None = None) -> list[list[TimingResult] | None]:
    """Job ``i``'s operations (``make_fns(i)``; None: nothing to run) timed in interleaved rounds
    (:func:`~profiler.timing.time_rounds`), in batches of jobs whose operands (``sizes``, bytes) fit
    :data:`ROUNDS_BUDGET_BYTES` (each batch's tensors are freed before the next is built).
    ``on_progress(n)``: about ``n`` jobs are done. With a ``budget`` the jobs come in order of cost
    and the walk stops where it says (``budget.stopped`` names the job). Returns each job's timings,
    or None (nothing to run, or past the budget)."""
    out: list[list[TimingResult] | None] = []
    for batch in _batches(sizes):
        if budget is not None and budget.stopped is not None:  # stopped: build nothing more
            out += [None] * len(batch)
            continue
        per_job = [make_fns(i) for i in batch]
        flat = [fn for fns in per_job if fns is not None for fn in fns]
        groups = [i for i, fns in zip(batch, per_job) if fns is not None for _ in fns]

        def on_round(r: int, first: int = batch.start, count: int = len(batch)) -> None:
            if on_progress is not None:
                on_progress(first + count * (r + 1) // grid.trials)

        timed = iter(time_rounds(flat, device=device, warmup=grid.warmup, trials=grid.trials,
                                 min_time_s=grid.min_time_s, on_round=on_round, budget=budget, groups=groups))
        for fns in per_job:
            results = None if fns is None else [next(timed) for _ in fns]
            out.append(None if results is None or any(r is None for r in results) else results)
        del per_job, flat
    return out


def budget_for(grid: ComputeGrid, share: float = 1.0) -> Budget | None:
    """A fresh time budget for one table of ``grid``, or for ``share`` of one (None: measure every shape)."""
    if grid.max_call_s is None and grid.max_table_s is None:
        return None
    return Budget(max_call_s=grid.max_call_s,
                  max_total_s=None if grid.max_table_s is None else grid.max_table_s * share)


# what a quick CPU profile's compute phase costs besides its GEMM tables, per precision (attention and
# elementwise tables, measured on the AVX2 VM: 3.9 s and 1.6 s for fp32 and bf16, 2.75 s a precision)
# and once (the host copies: 0.7 s), and how far the GEMM walks run past their budget (warm-ups of the
# shape that stops them: 13.4 s for two 6 s tables)
QUICK_OTHER_TABLES_S = 3.0
QUICK_HOST_COPIES_S = 1.0
GEMM_WALK_OVERRUN = 1.15
MIN_QUICK_TABLE_S = 2.0  # below this a precision's GEMM table is too thin to interpolate from


def fit_table_budget(grid: ComputeGrid, seconds_left: float) -> None:
    """Shrink ``grid.max_table_s`` so the compute phase, by the estimates above, takes about
    ``seconds_left`` (never below :data:`MIN_QUICK_TABLE_S`, never above the grid's own), noting the
    cut in ``grid.notes``. A quick profile's links run first, at the machine's pace of the moment:
    this keeps the whole run within its minute on a slow one."""
    if grid.max_table_s is None or not grid.precisions:
        return
    n = len(grid.precisions)
    per_table = (seconds_left - QUICK_HOST_COPIES_S - n * QUICK_OTHER_TABLES_S) / (n * GEMM_WALK_OVERRUN)
    if per_table >= grid.max_table_s:
        return
    before, grid.max_table_s = grid.max_table_s, max(MIN_QUICK_TABLE_S, per_table)
    grid.notes.append(f"QUICK DEADLINE: {max(seconds_left, 0.0):.0f} s were left for compute, so each table's budget "
                      f"was cut from {before:g} s to {grid.max_table_s:.1f} s (a table that reaches it stops at a "
                      "smaller shape, as its note says, and the planner prices the larger ones at the nearest "
                      "measured rates)")


def measure_gemms(jobs: list[tuple[GemmShape, Precision]], device: torch.device, grid: ComputeGrid,
                  on_progress: Callable[[int], None] | None = None,
                  budget: Budget | None = None) -> list[GemmPoint | None]:
    """Every GEMM of ``jobs`` ((m, n, k, layout), precision), timed in interleaved rounds
    (:func:`_timed_in_rounds`); None where a shape cannot run in its precision or is past the
    ``budget`` (the jobs then come in order of FLOPs). FP8 points say ``nt``, the layout FP8 runs in."""
    def make(i: int) -> list[Callable[[], object]] | None:
        (m, n, k, layout), p = jobs[i]
        fn = _gemm_fn(m, n, k, p, device, layout)
        return None if fn is None else [fn]

    sizes = [(m * k + k * n + m * n) * _element_bytes(p) for (m, n, k, _), p in jobs]
    return [None if t is None else GemmPoint(precision=p, m=m, n=n, k=k, time_s=max(t[0].estimate_s, 1e-12),
                                             layout=timed_layout(layout, p))
            for t, ((m, n, k, layout), p)
            in zip(_timed_in_rounds(sizes, make, device, grid, on_progress, budget), jobs)]


def _attention_dtype(precision: Precision) -> torch.dtype:
    # FP8 recipes keep the attention core in bf16 (Transformer Engine, torchao float8)
    return torch.bfloat16 if precision is Precision.fp8 else DTYPES[precision]


def kv_heads_to_run(heads: int, kv_heads: int, dtype: torch.dtype, device_type: str, head_dim: int = 128,
                    sm_major: int = 9) -> tuple[int, bool]:
    """(K/V heads to allocate, ``enable_gqa``) for SDPA with ``kv_heads`` K/V heads: grouped where SDPA
    has a fused kernel for them, else expanded to the query heads
    (:func:`planner.cost.compute.sdpa_takes_grouped_kv`, the executor's rule too): the same FLOPs, on
    the kernel such a model gets. ``sm_major``: the CUDA device's compute capability (ignored on CPU)."""
    sixteen = dtype in (torch.float16, torch.bfloat16)
    if kv_heads != heads and not sdpa_takes_grouped_kv(device_type, sixteen, sm_major, head_dim):
        return heads, False
    return kv_heads, kv_heads != heads


def _sm_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0


def _attention_fns(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, precision: Precision,
                   device: torch.device) -> tuple[Callable[[], object], Callable[[], object]]:
    """(causal SDPA forward without autograd, its backward alone: autograd.grad on a retained graph)."""
    dtype = _attention_dtype(precision)
    kv_run, gqa = kv_heads_to_run(heads, kv_heads, dtype, device.type, head_dim, _sm_major(device))
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_run, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kv_run, seq, head_dim, device=device, dtype=dtype, requires_grad=True)

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def forward_only() -> torch.Tensor:
        with torch.no_grad():
            return forward()

    out = forward()
    grad = torch.randn_like(out)
    return forward_only, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)


def measure_attention(
    batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, precision: Precision,
    device: torch.device, grid: ComputeGrid,
) -> AttentionPoint:
    """Causal SDPA forward, and its backward timed on its own (autograd.grad on a retained graph)."""
    point = measure_attentions([((batch, seq, heads, kv_heads, head_dim), precision)], device, grid)[0]
    assert point is not None  # no budget: always measured
    return point


def measure_attentions(jobs: list[tuple[tuple[int, int, int, int, int], Precision]], device: torch.device,
                       grid: ComputeGrid, on_progress: Callable[[int], None] | None = None,
                       budget: Budget | None = None) -> list[AttentionPoint | None]:
    """Every attention config of ``jobs`` ((batch, seq, heads, kv_heads, head_dim), precision),
    forward and backward, timed in interleaved rounds (:func:`_timed_in_rounds`; a config's tensors
    — inputs, output, its gradient and the graph kept for the backward — taken as about 8
    query-sized tensors); None past the ``budget`` (the jobs then come in order of FLOPs)."""
    def make(i: int) -> list[Callable[[], object]]:
        (b, s, h, kv, d), p = jobs[i]
        return list(_attention_fns(b, s, h, kv, d, p, device))

    sm = _sm_major(device) if jobs else 0
    expanded = sorted({(p.value, h, kv, d) for (_, _, h, kv, d), p in jobs
                       if kv_heads_to_run(h, kv, _attention_dtype(p), device.type, d, sm)[0] != kv})
    if expanded:
        layouts = ", ".join(f"{p} {h}/{kv} heads of {d}" for p, h, kv, d in expanded)
        grid.notes.append(f"attention with grouped K/V where CUDA's flash kernel cannot run ({layouts}; it takes "
                          "16-bit formats from Ampere, head dims to 256): timed with K/V expanded to the query heads, "
                          "on a fused kernel that takes no grouped K/V (SDPA's math fallback would hold the whole "
                          "score matrix), as the executor runs them")

    sizes = [8 * b * s * max(h, kv) * d * _attention_dtype(p).itemsize for (b, s, h, kv, d), p in jobs]
    timed = _timed_in_rounds(sizes, make, device, grid, on_progress, budget)
    return [None if t is None else
            AttentionPoint(precision=p, batch=b, seq_length=s, num_heads=h, num_kv_heads=kv, head_dim=d, causal=True,
                           forward_time_s=max(t[0].estimate_s, 1e-12), backward_time_s=max(t[1].estimate_s, 1e-12))
            for t, ((b, s, h, kv, d), p) in zip(timed, jobs)]


def _elementwise_case(op: str, nbytes: int, precision: Precision,
                      device: torch.device) -> tuple[Callable[[], object], int]:
    """(closure, bytes read + written) for ``op`` on an activation of about ``nbytes`` bytes.

    Bytes follow the planner's accounting of the same op: rmsnorm reads x and writes y (2E),
    silu_mul reads gate and up and writes the product (3E), add reads two and writes one (3E);
    softmax_cross_entropy over (tokens × vocab) logits upcasts to fp32 if needed (read E, write 4
    bytes per logit) then log-softmax reads and writes fp32 (8 bytes per logit); the loss is negligible
    (:func:`planner.cost.compute.cross_entropy_bytes`). The planner prices each op at its table's
    rate (:func:`planner.cost.compute.elementwise_time_s`).
    """
    dtype = DTYPES[precision]
    elt = torch.finfo(dtype).bits // 8
    numel = max(nbytes // elt, 1024)
    hidden = 1024 if numel >= 1024 * 16 else 64
    rows = max(numel // hidden, 1)
    E = rows * hidden * elt
    if op == "rmsnorm":
        x = torch.randn(rows, hidden, device=device, dtype=dtype)
        w = torch.ones(hidden, device=device, dtype=dtype)
        return (lambda: F.rms_norm(x, (hidden,), w, 1e-5)), 2 * E
    if op == "silu_mul":
        g = torch.randn(rows, hidden, device=device, dtype=dtype)
        u = torch.randn(rows, hidden, device=device, dtype=dtype)
        return (lambda: F.silu(g) * u), 3 * E
    if op == "add":
        a = torch.randn(rows, hidden, device=device, dtype=dtype)
        b = torch.randn(rows, hidden, device=device, dtype=dtype)
        out = torch.empty_like(a)
        return (lambda: torch.add(a, b, out=out)), 3 * E
    if op == "softmax_cross_entropy":
        vocab = 32768 if device.type != "cpu" else 4096
        vocab = min(vocab, numel)
        tokens = max(numel // vocab, 1)
        logits = torch.randn(tokens, vocab, device=device, dtype=dtype)
        target = torch.randint(0, vocab, (tokens,), device=device)
        return (lambda: F.cross_entropy(logits.float(), target)), int(cross_entropy_bytes(tokens * vocab, elt))
    raise ValueError(f"op={op!r} is not one of {ELEMENTWISE_OPS}")


def measure_elementwise(op: str, nbytes: int, precision: Precision, device: torch.device,
                        grid: ComputeGrid) -> ElementwisePoint:
    fn, moved = _elementwise_case(op, nbytes, precision, device)
    result = _time(fn, device, grid)
    return ElementwisePoint(op=op, precision=precision, bytes=moved, time_s=max(result.estimate_s, 1e-12))


def _check_precisions(grid: ComputeGrid, device: torch.device) -> None:
    missing = unsupported_precisions(device)
    for p in grid.precisions:
        if p in missing:
            raise AutoparError(
                "precisions", p.value,
                "measure only " + ",".join(q.value for q in Precision if q not in missing) + f" here ({missing[p]})",
                problem=f"cannot run on {device.type}",
            )


def _attention_flops(b: int, s: int, h: int, kv: int, d: int) -> float:
    """Forward FLOPs of a full (non-causal) attention: the order of attention configs' costs."""
    return 4.0 * b * s * s * h * d


def regime_gaps(points: list[AttentionPoint], blocking: tuple[AttentionBlocking, ...]) -> list[str]:
    """The kernel regimes (``blocking``) without a measurement, per precision (the planner reads one
    precision's table): e.g. ``["bf16 at q_len 768 and up"]``."""
    starts = [b.from_q_len for b in blocking]
    edges = (*starts, math.inf)
    names = [f"below {edges[1]}", *(f"{lo}-{hi - 1}" for lo, hi in zip(edges[1:-2], edges[2:-1])),
             f"{edges[-2]} and up"] if len(starts) > 1 else ["any"]
    gaps = []
    for p in dict.fromkeys(a.precision for a in points):
        lengths = [a.seq_length for a in points if a.precision is p]
        missing = [name for name, lo, hi in zip(names, edges, edges[1:]) if not any(lo <= s < hi for s in lengths)]
        if missing:
            gaps.append(f"{p.value} at q_len {', '.join(missing)}")
    return gaps


def _note_budget_stop(grid: ComputeGrid, table: str, unit: str, names: list[str], results: list[str | None],
                      budget: Budget | None) -> None:
    """Say in ``grid.notes`` where a table's walk stopped (:class:`~profiler.timing.Budget`), if it did.
    ``names``: the jobs in walk order; ``results``: what each measured one did (None: not measured)."""
    if budget is None or budget.stopped is None:
        return
    at, _, why = budget.stopped
    last = max((i for i in range(at) if results[i] is not None), default=None)
    largest = f"; the largest measured, {names[last]}, {results[last]}" if last is not None else ""
    grid.notes.append(f"{table}: {sum(r is not None for r in results)} of {len(names)} {unit} measured, in order of "
                      f"FLOPs; the walk stopped at {names[at]} ({why}), so the planner prices it and the "
                      f"{len(names) - at - 1} larger ones at the rate of the nearest measured ones{largest}")


def gemm_state_sampler(device: torch.device) -> GpuStateSampler | None:
    """What watches the GEMM tables: the GPU's clock and power on CUDA (:mod:`profiler.gpustate`),
    nothing elsewhere (a CPU's clock is not the story of its tables)."""
    return GpuStateSampler(device) if device.type == "cuda" else None


class _Walk:
    """Progress over one compute profile's jobs: ``done`` of ``total`` reported to ``progress(label,
    done, total)``; :meth:`table` measures one table within its own budget."""

    def __init__(self, device: torch.device, grid: ComputeGrid, total: int, progress: Progress | None):
        self.device, self.grid, self.total, self.progress, self.done = device, grid, total, progress, 0

    def tick(self, label: str) -> None:
        if self.progress is not None:
            self.progress(label, self.done, self.total)

    def _advance(self, section: str, start: int) -> Callable[[int], None]:
        def on_progress(n: int) -> None:
            if start + n > self.done:
                self.done = start + n
                self.tick(f"{section}: {n} timed")
        return on_progress

    def table(self, table: str, unit: str, jobs: list, cost: Callable, measure: Callable, name: Callable,
              result: Callable, share: float = 1.0) -> list:
        """One table (one kind of operation in one precision) measured in order of ``cost`` within
        a fresh budget (:func:`budget_for`; ``share`` of it), the stop noted; each job's point, or None."""
        jobs.sort(key=cost)
        budget, start = budget_for(self.grid, share), self.done
        points = measure(jobs, self.device, self.grid, self._advance(table, start), budget)
        _note_budget_stop(self.grid, table, unit, [name(*j[0]) for j in jobs],
                          [None if x is None else result(x) for x in points], budget)
        self.done = start + len(jobs)
        return points


def measure_compute(device: torch.device, grid: ComputeGrid, progress: Progress | None = None) -> ComputeProfile:
    """Measure ``grid`` on ``device`` (this process only) and return the tables and achieved peaks.

    ``progress(label, done, total)`` is called before each measurement (done = finished so far) and
    once at the end with done == total. GEMMs and attention are timed in rounds (every shape one trial
    per round, grid.trials rounds: see time_rounds), each precision's table its own walk in order of
    FLOPs within the grid's time budget (ComputeGrid): the progress advances as rounds finish.
    """
    device = torch.device(device)
    _check_precisions(grid, device)
    HOLD_STATS.update(held=0, host_paced=0)
    # FP8 runs every GEMM as nt: one job per shape
    gemm_jobs = list(dict.fromkeys(((m, n, k, timed_layout(lay, p)), p)
                                   for p in grid.precisions for m, n, k, lay in grid.gemm))
    attn_jobs = [(c, p) for p in grid.precisions for c in grid.attention]
    elt_precisions = [p for p in grid.precisions if p is not Precision.fp8]  # fp8 recipes keep bf16 activations
    elt_jobs = [(op, b, p) for p in elt_precisions for b in grid.elementwise_bytes for op in ELEMENTWISE_OPS]
    walk = _Walk(device, grid, len(gemm_jobs) + len(attn_jobs) + len(elt_jobs), progress)
    profile = ComputeProfile()
    if gemm_jobs:
        profile.gemm += _gemm_tables(walk, gemm_jobs)
    if attn_jobs:
        profile.attention += _attention_tables(walk, attn_jobs)
        walk.done = len(gemm_jobs) + len(attn_jobs)
    with torch.no_grad():
        for op, nbytes, p in elt_jobs:
            walk.tick(f"{op} {p.value} {nbytes / 2**20:.1f} MiB")
            profile.elementwise.append(measure_elementwise(op, nbytes, p, device, grid))
            walk.done += 1
    walk.tick("compute done")
    _note_timing(profile, grid, device)
    _achieved_rates(profile, grid, device)
    return ComputeProfile.model_validate(profile.model_dump())


def _gemm_tables(walk: _Walk, gemm_jobs: list) -> list[GemmPoint]:
    """Every precision's GEMM tables; each layout its own walk with an equal share of the precision's
    budget: one layout's slow calls (torch's CPU bf16 fallback runs nn 3-16x slower) do not stop the others."""
    grid, out = walk.grid, []
    walk.tick(f"GEMMs: {len(gemm_jobs)} shapes in rounds of {grid.trials} trials")
    state = gemm_state_sampler(walk.device)
    with torch.no_grad(), state or contextlib.nullcontext():
        for p in grid.precisions:
            if state:
                state.section(f"{p.value} GEMMs")
            layouts = list(dict.fromkeys(j[0][3] for j in gemm_jobs if j[1] is p))
            for lay in layouts:
                points = walk.table(f"{p.value} {lay.value} GEMMs", "shapes",
                                    [j for j in gemm_jobs if j[1] is p and j[0][3] is lay],
                                    lambda j: math.prod(j[0][:3]), measure_gemms, lambda m, n, k, _: f"{m}x{n}x{k}",
                                    lambda x: f"ran at {2e-9 * x.m * x.n * x.k / x.time_s:.3g} GFLOP/s",
                                    share=1.0 / len(layouts))
                out += [point for point in points if point is not None]
    if state:
        grid.notes.append(state.note("GEMM tables"))
    return out


def _attention_tables(walk: _Walk, attn_jobs: list) -> list[AttentionPoint]:
    """Every precision's attention table. FP8 recipes run attention in bf16: an fp8 config reuses the
    bf16 measurement of it."""
    attn_run = [(c, p) for c, p in attn_jobs if p is not Precision.fp8 or (c, Precision.bf16) not in attn_jobs]
    walk.tick(f"attention: {len(attn_run)} configs in rounds of {walk.grid.trials} trials")
    measured: dict = {}
    for p in walk.grid.precisions:
        jobs = [j for j in attn_run if j[1] is p]
        if jobs:
            points = walk.table(f"{p.value} attention", "configs", jobs, lambda j: _attention_flops(*j[0]),
                                measure_attentions, lambda b, s, h, kv, d: f"b={b} s={s} h={h}/{kv} d={d}",
                                lambda x: f"took {x.forward_time_s * 1e3:.3g} ms forward and "
                                          f"{x.backward_time_s * 1e3:.3g} ms backward")
            measured.update((j, x) for j, x in zip(jobs, points) if x is not None)
    out = []
    for (b, s, h, kv, d), p in attn_jobs:
        point = measured.get(((b, s, h, kv, d), p))
        if point is None and p is Precision.fp8 and ((b, s, h, kv, d), Precision.bf16) in measured:
            # the same bf16 kernel: reuse the measurement
            point = measured[((b, s, h, kv, d), Precision.bf16)].model_copy(update={"precision": Precision.fp8})
        if point is not None:
            out.append(point)
    return out


def _note_timing(profile: ComputeProfile, grid: ComputeGrid, device: torch.device) -> None:
    """The grid's notes on how the tables were timed: CUDA operations held behind a spin kernel, CPU
    flash-attention regimes without a measurement."""
    if device.type == "cuda" and HOLD_STATS["held"]:
        paced = HOLD_STATS["host_paced"]
        grid.notes.append(f"CUDA timing: {HOLD_STATS['held']} operations that the host launches more slowly than the "
                          "GPU runs them (small GEMMs, short attention) were timed queued behind a spin kernel, so "
                          "their calls ran back to back as in a training step: the tables hold GPU time, and launch "
                          "latency is the planner's Assumptions.kernel_overhead_s"
                          + (f"; {paced} of their trials still ran at the host's pace (the hold ended first)"
                             if paced else ""))
    if device.type == "cpu" and profile.attention:
        profile.attention_blocking = list(CPU_FLASH_BLOCKING)
        gaps = regime_gaps(profile.attention, CPU_FLASH_BLOCKING)
        if gaps:
            grid.notes.append(f"attention: torch's CPU flash kernel changes its query blocks at q_len "
                              f"{' and '.join(str(b.from_q_len) for b in CPU_FLASH_BLOCKING[1:])}; nothing was "
                              f"measured for {'; '.join(gaps)}, so the planner prices those at the rates of the "
                              "nearest measured lengths' regime")


def _achieved_rates(profile: ComputeProfile, grid: ComputeGrid, device: torch.device) -> None:
    """The best GEMM rate per precision and the memory bandwidth of the largest adds."""
    rates: dict[Precision, float] = {}
    for g in profile.gemm:
        rates[g.precision] = max(rates.get(g.precision, 0.0), 2.0 * g.m * g.n * g.k / g.time_s / 1e12)
    profile.achieved_matmul_tflops = rates
    if device.type == "cpu" and Precision.bf16 in grid.precisions and cpu_bf16_is_native() is False:
        grid.notes.append(_bf16_fallback_note(profile.gemm, rates.get(Precision.fp32)))
    adds = [e for e in profile.elementwise if e.op == "add"]
    if adds:
        largest = max(grid.elementwise_bytes)
        big = [e for e in adds if e.bytes >= 3 * largest * 0.99] or adds
        profile.achieved_memory_bandwidth_bytes_per_s = max(e.bytes / e.time_s for e in big)


def _bf16_fallback_note(gemm: list[GemmPoint], fp32_tflops: float | None) -> str:
    """What the profile says of bf16 GEMMs on a CPU without oneDNN bf16, with the best rate of each layout."""
    best: dict[GemmLayout, float] = {}
    for g in gemm:
        if g.precision is Precision.bf16:
            best[g.layout] = max(best.get(g.layout, 0.0), 2e-9 * g.m * g.n * g.k / g.time_s)
    rates = ", ".join(f"{lay.role} {best[lay]:.3g}" for lay in LINEAR_LAYOUTS if lay in best)
    than = f" against fp32's {fp32_tflops * 1e3:.3g}" if fp32_tflops else ""
    measured = f", at best {rates} GFLOP/s{than}," if rates else ""
    return (f"bf16 on this CPU: torch has no oneDNN bf16 matmul here (CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}), so bf16 GEMMs ran its unoptimised fallback{measured} at "
            "rates that depend on the operand layout and jump from shape to shape; the planner's interpolation "
            "between the bf16 table's shapes may be far off (fp32 is this CPU's training precision)")


# The per-rank device check: one GEMM large enough to run near the device's peak, and an add over
# buffers beyond the caches, measured as the tables are (measure_gemm, measure_elementwise)
CHECK_GEMM = {"cuda": ((8192, 8192, 8192), Precision.bf16), "cpu": ((512, 512, 512), Precision.fp32)}
CHECK_ADD_BUFFER_BYTES = {"cuda": 256 << 20, "cpu": 64 << 20}  # each of three (read two, write one), at least


def check_add_buffer_bytes(kind: str, cache_bytes: int, available_bytes: int,
                           quick: bool = False) -> tuple[int, str | None]:
    """Bytes of each of the device check's three add buffers, and a note when the check may not
    stream past the caches.

    A CPU's buffers are each at least the last-level cache the kernel reports (so the add streams
    three times the cache, each byte evicted before it comes round again), within 1/12 of the
    available memory. A quick profile keeps the 64 MiB floor instead: a VM's first touch of memory
    can be slow (on a 2-vCPU Firecracker VM reporting a 480 MiB L3: 5.1 s to fill 1.8 GiB the first
    time, 0.6 s again right after), and every rank of a host checks in turn; the figure the ranks are
    compared by there flattened out at 64 MiB (one thread: 15.8 GB/s at 64 MiB per buffer, 15.0-15.5
    GB/s from 128 MiB to 960 MiB, 28 GB/s at 16 MiB), but another machine's may not, which the note says."""
    floor = CHECK_ADD_BUFFER_BYTES["cuda" if kind == "cuda" else "cpu"]
    if kind == "cuda":
        return floor, None
    size = min(floor if quick else max(floor, cache_bytes), max(available_bytes // 12, 1 << 20))
    if cache_bytes <= size:
        return size, None
    why = ("a quick profile keeps them small; the ranks are still compared at the same buffers, and a full "
           "profile streams buffers of the cache's size" if quick else "held to 1/12 of the available memory")
    return size, (f"{'QUICK CHECK: ' if quick else ''}each rank's memory check adds {size >> 20} MiB buffers, below "
                  f"the {cache_bytes >> 20} MiB last-level cache the kernel reports ({why}), so its bandwidth may be "
                  "partly the cache's")


def check_buffer_for(device: torch.device, quick: bool = False) -> tuple[int, str | None]:
    """:func:`check_add_buffer_bytes` for this process on ``device``: the cache its threads can fill
    (:func:`~profiler.identity.reachable_cache_bytes`) and the memory available now."""
    if device.type == "cuda":
        return check_add_buffer_bytes("cuda", 0, 0, quick)
    cache = reachable_cache_bytes(threads=torch.get_num_threads())
    return check_add_buffer_bytes("cpu", cache, available_memory_bytes(device), quick)


def device_check(device: torch.device, rank: int, host: str, local_rank: int, name: str,
                 memory_bytes: int, add_buffer_bytes: int | None = None) -> DeviceCheck:
    """This rank's device at the fixed check GEMM and memory-bound add (:data:`CHECK_GEMM`; the add's
    three buffers ``add_buffer_bytes`` each, by default a full profile's :func:`check_buffer_for`)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    (m, n, k), precision = CHECK_GEMM[kind]
    if kind == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        precision = Precision.fp16  # before Ampere bf16 is emulated: time the 16-bit format the GPU runs
    buffer = add_buffer_bytes if add_buffer_bytes is not None else check_buffer_for(device)[0]
    grid = ComputeGrid(gemm=[], attention=[], elementwise_bytes=[], precisions=[precision], warmup=2, trials=5,
                       min_time_s=0.01 if kind == "cuda" else 0.02)
    with torch.no_grad():
        gemm = measure_gemm(m, n, k, precision, device, grid)
        add = measure_elementwise("add", buffer, Precision.fp32, device, grid)
    assert gemm is not None  # bf16 / fp16 / fp32 GEMMs run at any shape
    return DeviceCheck(rank=rank, host=host, local_rank=local_rank, device=name, memory_bytes=memory_bytes,
                       precision=precision, gemm=(m, n, k), gemm_tflops=2.0 * m * n * k / gemm.time_s / 1e12,
                       memory_bandwidth_bytes_per_s=add.bytes / add.time_s)


def device_check_notes(checks: list[DeviceCheck], device_type: str) -> list[str]:
    """What the ranks' checks say: devices that differ from rank 0's, and devices slower than the
    median by more than :func:`~planner.contracts.cluster.slow_device_limit` at the GEMM or the add
    (the planner's straggler rule, :func:`planner.cost.compute.device_pace`)."""
    if not checks:
        return []
    notes = []
    first = min(checks, key=lambda c: c.rank)
    # memory within 2%: identical hosts differ by kernel reservations, GPUs by ECC mode
    other = [c for c in checks if c.device != first.device
             or abs(c.memory_bytes - first.memory_bytes) > 0.02 * first.memory_bytes]
    if other:
        kinds = sorted({f"{c.device} ({c.memory_bytes / 2**30:.0f} GiB)" for c in other})
        notes.append(f"MIXED DEVICES: {len(other)} of {len(checks)} ranks have a device other than rank 0's "
                     f"{first.device} ({first.memory_bytes / 2**30:.0f} GiB): {', '.join(kinds)} (ranks "
                     f"{', '.join(str(c.rank) for c in other[:16])}{', ...' if len(other) > 16 else ''}); the compute "
                     "tables are rank 0's")
    cpu = device_type != "cuda"
    limit = slow_device_limit(cpu)
    for what, value, unit, scale in (("GEMM", lambda c: c.gemm_tflops, "TFLOP/s", 1.0),
                                     ("memory bandwidth", lambda c: c.memory_bandwidth_bytes_per_s, "GB/s", 1e-9)):
        median, slow = slow_checks(checks, value, cpu)
        if slow:
            listed = "; ".join(f"rank {c.rank} ({c.host}, local rank {c.local_rank}) {value(c) * scale:.4g} {unit}, "
                               f"{(1 - value(c) / median) * 100:.0f}% below" for c in slow[:8])
            notes.append(f"SLOW DEVICES ({what}): {len(slow)} of {len(checks)} ranks more than {limit:.0%} below the "
                         f"median {median * scale:.4g} {unit}: {listed}{'; ...' if len(slow) > 8 else ''}. "
                         "Synchronous training runs at the slowest device's pace: the planner prices every device "
                         "at the slowest one's (the compute tables, rank 0's, scaled by rank 0's check over its)")
    return notes


__all__ = [
    "ComputeGrid",
    "check_add_buffer_bytes",
    "check_buffer_for",
    "device_check",
    "device_check_notes",
    "default_grid",
    "kv_heads_to_run",
    "linear_gemms",
    "linear_shapes",
    "measure_attention",
    "measure_attentions",
    "measure_compute",
    "measure_elementwise",
    "gemm_operands",
    "measure_gemm",
    "timed_layout",
    "measure_gemms",
    "parse_precisions",
    "supported_precisions",
    "unsupported_precisions",
]

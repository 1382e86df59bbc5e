"""Time of one operator on one GPU, from the profile's measured tables or from a roofline.

Reference profiles have no tables: a GEMM takes ``max(flops / (peak · matmul_efficiency · waves ·
K/(K+K0)), bytes / (hbm · memory_efficiency))``. These are times of the work itself; the fixed cost of
launching each kernel is added per kernel by the caller (:mod:`planner.cost.layer`). Measured profiles interpolate the achieved
rate of the nearest measured shapes (in log space), so the datasheet never enters.
"""

from __future__ import annotations

import functools
import math


from planner.contracts import ClusterProfile, Precision


def peak_flops(profile: ClusterProfile, precision: Precision) -> float:
    """Dense datasheet peak in FLOP/s; fp32 falls back to half the 16-bit peak (TF32 tensor cores)."""
    peaks = profile.device.peak_tflops
    if precision in peaks:
        return peaks[precision] * 1e12
    if precision is Precision.fp8:
        return peak_flops(profile, Precision.bf16)
    if precision is Precision.fp32:
        return peak_flops(profile, Precision.bf16) / 2
    return next(iter(peaks.values())) * 1e12


@functools.lru_cache(maxsize=65536)
def wave_efficiency(m: int, n: int, sm_count: int | None, tiles: tuple[tuple[int, int], ...]) -> float:
    """Useful fraction of the GPU's tile slots for an (m×n) output, best over the library's tiles.

    ``(m·n) / (waves · sm_count · tile_m · tile_n)`` with ``waves = ceil(ceil(m/tm)·ceil(n/tn) / sms)``:
    partial tiles and a last partial wave leave SMs idle.
    """
    if not sm_count:
        return 1.0
    best = 0.0
    for tm, tn in tiles:
        count = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / sm_count)
        best = max(best, (m * n) / (waves * sm_count * tm * tn))
    return best


def k_efficiency(k: int, k_overhead: float) -> float:
    """Share of a tile's time spent in its K loop: ``K / (K + K0)``; the fixed prologue (first
    loads) and epilogue (conversion, store) cost as much as ``K0`` more iterations of the loop."""
    return k / (k + k_overhead)


def memory_time_s(profile: ClusterProfile, nbytes: float) -> float:
    """Bandwidth-bound work: ``bytes / (achieved or datasheet·efficiency HBM bandwidth)``."""
    measured = profile.compute.achieved_memory_bandwidth_bytes_per_s
    bw = measured or profile.device.hbm_bandwidth_bytes_per_s * profile.assumptions.memory_bandwidth_efficiency
    return nbytes / bw


def _matmul_rate(profile: ClusterProfile, precision: Precision) -> float:
    """Achieved FLOP/s of a large GEMM: measured peak, else datasheet × assumed efficiency."""
    measured = profile.compute.achieved_matmul_tflops.get(precision)
    if measured:
        return measured * 1e12
    a = profile.assumptions
    eff = a.fp8_matmul_efficiency if precision is Precision.fp8 else a.matmul_efficiency
    return peak_flops(profile, precision) * eff


def gemm_time_s(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, count: int = 1) -> float:
    """Time of ``count`` GEMMs of (m×k)·(k×n) on one GPU."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    table = [p for p in profile.compute.gemm if p.precision is precision]
    if table:
        return count * _interpolated_gemm_time(table, m, n, k)
    return count * _roofline_gemm_time(profile, m, n, k, precision)


def gemm_fwd_bwd_s(
    profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, count: int = 1
) -> tuple[float, float]:
    """(forward, backward) time of a linear layer ``Y[m×n] = X[m×k] · W[k×n]``, ``count`` times.

    Backward is the input gradient ``dX = dY · Wᵀ`` (an m×k output reducing over n) plus the weight
    gradient ``dW = Xᵀ · dY`` (a k×n output reducing over the m tokens): same FLOPs as forward
    each, but different shapes and so different efficiency.
    """
    fwd = gemm_time_s(profile, m, n, k, precision, count)
    bwd = gemm_time_s(profile, m, k, n, precision, count) + gemm_time_s(profile, k, n, m, precision, count)
    return fwd, bwd


def _roofline_gemm_time(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision) -> float:
    a = profile.assumptions
    flops = 2.0 * m * n * k
    waves = wave_efficiency(m, n, profile.device.sm_count, tuple(tuple(t) for t in a.gemm_tiles))
    compute = flops / (_matmul_rate(profile, precision) * waves * k_efficiency(k, a.gemm_k_overhead))
    elt = 1 if precision is Precision.fp8 else precision.bytes
    out = 4 if precision is Precision.fp32 else 2  # FP8 GEMMs write 16-bit outputs
    traffic = memory_time_s(profile, elt * (m * k + k * n) + out * m * n)
    # FP8 input casts are fused into the producing norm / activation kernels (Transformer Engine),
    # so they add no separate HBM pass here.
    return max(compute, traffic)


def _interpolated_gemm_time(table, m: int, n: int, k: int) -> float:  # noqa: ANN001
    """Achieved rate of the nearest measured shapes (inverse-distance in log m, log n, log k)."""
    target = (math.log(m), math.log(n), math.log(k))
    scored = []
    for p in table:
        d = math.dist(target, (math.log(p.m), math.log(p.n), math.log(p.k)))
        rate = 2.0 * p.m * p.n * p.k / p.time_s
        if d < 1e-9:
            return 2.0 * m * n * k / rate
        scored.append((d, rate))
    scored.sort()
    nearest = scored[:4]
    weights = [1.0 / d**2 for d, _ in nearest]
    log_rate = sum(w * math.log(r) for w, (_, r) in zip(weights, nearest)) / sum(weights)
    return 2.0 * m * n * k / math.exp(log_rate)


def causal_work_fraction(seq_length: int, block: int = 128) -> float:
    """Share of the s×s score matrix a causal flash kernel computes: ``(s + block) / 2s`` (≤ 1)."""
    return min(1.0, (seq_length + block) / (2.0 * seq_length))


def attention_time_s(
    profile: ClusterProfile,
    *,
    batch: int,
    q_len: int,
    kv_len: int,
    heads: int,
    kv_heads: int,
    qk_dim: int,
    v_dim: int,
    precision: Precision,
    causal: bool,
    flash: bool,
) -> tuple[float, float]:
    """(forward, backward) time of the attention core for ``heads`` local heads.

    Fused (flash): forward FLOPs ``2·b·q·kv·a·(d_qk + d_v)`` times the causal fraction, at
    ``peak · attention_efficiency`` (16-bit even in FP8 recipes); backward runs 5 of those matmuls
    instead of 2 (it recomputes the scores), i.e. 2.5× forward.
    Unfused (Megatron 2021): two batched GEMMs plus the scale-mask-softmax and dropout streaming
    the ``b·a·q·kv`` scores through HBM: 9 bytes per score forward, 11 backward.
    """
    table = [p for p in profile.compute.attention if p.precision is precision and p.causal == causal]
    flops = 2.0 * batch * q_len * kv_len * heads * (qk_dim + v_dim)
    if table and flash:
        fwd, bwd = _interpolated_attention(table, batch, q_len, heads, qk_dim, flops)
        return fwd, bwd
    if flash:
        frac = causal_work_fraction(kv_len) if causal and q_len == kv_len else (0.5 if causal else 1.0)
        rate = peak_flops(profile, Precision.bf16) * profile.assumptions.attention_efficiency
        fwd = flops * frac / rate
        return fwd, 2.5 * fwd
    p16 = Precision.bf16 if precision is Precision.fp8 else precision
    # one batched GEMM each for QK^T and PV (one launch, batch·heads problems)
    gemms = gemm_time_s(profile, q_len * batch * heads, kv_len, qk_dim, p16) + gemm_time_s(
        profile, q_len * batch * heads, v_dim, kv_len, p16
    )
    scores = batch * heads * q_len * kv_len
    # forward: fused scale-mask-softmax (read 2 B, write 2 B) and dropout (read 2, write 2, mask 1)
    # backward: dropout (read grad 2 + mask 1, write 2) and softmax (read y 2, dy 2, write 2)
    return gemms + memory_time_s(profile, 9.0 * scores), 2.0 * gemms + memory_time_s(profile, 11.0 * scores)


def _interpolated_attention(table, batch, seq, heads, head_dim, flops):  # noqa: ANN001
    """Measured attention: achieved FLOP rate of the nearest measured (seq, heads·batch, head_dim)."""
    target = (math.log(seq), math.log(batch * heads), math.log(head_dim))
    best = min(
        table,
        key=lambda p: math.dist(target, (math.log(p.seq_length), math.log(p.batch * p.num_heads), math.log(p.head_dim))),
    )
    ref_flops = 4.0 * best.batch * best.seq_length**2 * best.num_heads * best.head_dim
    return flops * best.forward_time_s / ref_flops, flops * best.backward_time_s / ref_flops



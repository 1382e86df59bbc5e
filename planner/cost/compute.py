"""Time of one operator on one GPU, from the profile's measured tables or from a roofline, at the
slowest checked device's pace where the profile's device checks found a straggler (:func:`device_pace`).

Reference profiles have no tables: a GEMM takes ``max(flops / (peak · matmul_efficiency · waves ·
K/(K+K0)), bytes / (hbm · memory_efficiency))``. These are times of the work itself; the fixed cost of
launching each kernel is added per kernel by the caller (:mod:`planner.cost.layer`). Measured profiles
interpolate the achieved rate of the nearest measured shapes with a local linear fit in log space
(:func:`local_log_fit`),
so the datasheet enters only to scale a GPU's table of one 16-bit precision to the other where that
one has none (:func:`_sibling_table`); bandwidth-bound ops at their own table's rates
(:func:`elementwise_time_s`). A precision without a table or a sibling (an fp32 or fp8 GEMM with
only bf16 points) is priced by the roofline.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from typing import NamedTuple

from planner.contracts import AttentionBlocking, AttentionPoint, ClusterProfile, GemmLayout, Precision
from planner.contracts.cluster import slow_checks
from planner.cost.memo import memo_for


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
def wave_efficiency(m: int, n: int, sm_count: int | None, tiles: tuple[tuple[int, int], ...],
                    copies: int = 1) -> float:
    """Useful fraction of the GPU's tile slots for an (m×n) output, best over the library's tiles.

    ``(m·n) / (waves · sm_count · tile_m · tile_n)`` with ``waves = ceil(ceil(m/tm)·ceil(n/tn) / sms)``:
    partial tiles and a last partial wave leave SMs idle. ``copies`` GEMMs of that output running at
    once (a grouped GEMM's experts on concurrent streams) share the waves: ``copies`` times the tiles.
    """
    if not sm_count:
        return 1.0
    best = 0.0
    for tm, tn in tiles:
        count = copies * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / sm_count)
        best = max(best, (copies * m * n) / (waves * sm_count * tm * tn))
    return best


def k_efficiency(k: int, k_overhead: float) -> float:
    """Share of a tile's time spent in its K loop: ``K / (K + K0)``; the fixed prologue (first
    loads) and epilogue (conversion, store) cost as much as ``K0`` more iterations of the loop."""
    return k / (k + k_overhead)


class DevicePace(NamedTuple):
    """How much slower than the device the compute tables were measured on (rank 0's) the slowest
    checked device runs (``ClusterProfile.device_checks``), at GEMMs and at memory-bound work: >= 1."""

    compute: float = 1.0
    memory: float = 1.0
    compute_rank: int | None = None  # the slowest rank at the GEMM check (None: no slower one)
    memory_rank: int | None = None


_NO_PACE = DevicePace()


def device_pace(profile: ClusterProfile) -> DevicePace:
    """Synchronous training runs at its slowest device's pace, and the compute tables are rank 0's:
    where a rank's check ran more than ``SLOW_DEVICE_LIMIT`` below the checks' median (the profile's
    ``SLOW DEVICES`` note: a straggler, not timing noise), every device is priced at the slowest
    one's: rank 0's times × rank 0's check / the slowest's (GEMMs and attention by the GEMM check,
    memory-bound work by the add), in every precision (the check runs one: bf16 on GPUs, fp32 on CPUs)."""
    checks = profile.device_checks
    if not checks:
        return _NO_PACE
    memo = memo_for(profile)
    if memo is not None and "pace" in memo:
        return memo["pace"]
    first = next(c for c in checks if c.rank == 0)  # the contract requires rank 0's check
    factors: list[tuple[float, int | None]] = []
    for value in (lambda c: c.gemm_tflops, lambda c: c.memory_bandwidth_bytes_per_s):
        _, slow = slow_checks(checks, value, profile.is_cpu)
        if slow and value(slow[0]) < value(first):
            factors.append((value(first) / value(slow[0]), slow[0].rank))
        else:
            factors.append((1.0, None))
    pace = DevicePace(factors[0][0], factors[1][0], factors[0][1], factors[1][1])
    if memo is not None:
        memo["pace"] = pace
    return pace


def memory_time_s(profile: ClusterProfile, nbytes: float) -> float:
    """Bandwidth-bound work: ``bytes / (achieved or datasheet·efficiency HBM bandwidth)``, at the
    slowest checked device's pace (:func:`device_pace`)."""
    if profile.device_checks:
        return nbytes / _bandwidth(profile) * device_pace(profile).memory
    return nbytes / _bandwidth(profile)


def cross_entropy_bytes(logits: float, elt: int) -> float:
    """Bytes the softmax cross-entropy forward moves over ``logits`` logits of ``elt`` bytes, as
    the profiler counts its ``softmax_cross_entropy`` op: an upcast to fp32 (read ``elt``, write 4
    per logit) unless already fp32, then the fp32 log-softmax (read and write: 8 per logit)."""
    return logits * ((elt + 4 if elt < 4 else 0) + 8)


def elementwise_time_s(profile: ClusterProfile, op: str, nbytes: float, precision: Precision) -> float:
    """Time of one bandwidth-bound operator moving ``nbytes`` (read + written, counted as the
    profiler counts ``op``: ``rmsnorm`` 2E, ``add`` and ``silu_mul`` 3E, ``softmax_cross_entropy``
    :func:`cross_entropy_bytes`).

    From the profile's measured table of ``op`` (``ComputeProfile.elementwise``): its achieved rate
    (bytes / time) interpolated linearly in log size between the neighbouring measured sizes, held
    at the end points' rates beyond them and never above the largest size's (a point small enough
    to stay in a CPU's caches, timed over and over on the same buffers, reads faster than a step's
    activations, which other kernels have evicted: so caches do not inflate it, as for the
    achieved bandwidth; a GPU's small points run slower, launch-bound, and keep their rate), in
    ``precision``'s points, else another precision's (a bandwidth-bound op moves bytes at about the
    same rate whatever they hold). ``nbytes`` is one kernel's: a size's rate is that of one call. An op runs as the
    profiled torch ran it: a norm kernel reads and writes at 70-75% of an add's rate on an H200 and
    the unfused ``silu(g) * u`` at 55-60% (it writes and reads its intermediate). Where the table has
    no points of ``op`` (reference profiles): :func:`memory_time_s`. At the slowest checked device's
    pace (:func:`device_pace`)."""
    if nbytes <= 0:
        return 0.0
    rates = _elementwise_rates(profile, op, precision)
    if not rates:
        return memory_time_s(profile, nbytes)
    sizes = [b for b, _ in rates]
    i = bisect.bisect_left(sizes, nbytes)
    if i == 0:
        rate = rates[0][1]
    elif i == len(rates):
        rate = rates[-1][1]
    else:
        (b0, r0), (b1, r1) = rates[i - 1], rates[i]
        w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
        rate = math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
    pace = device_pace(profile).memory if profile.device_checks else 1.0
    return nbytes / rate * pace


def _elementwise_rates(profile: ClusterProfile, op: str, precision: Precision) -> list[tuple[float, float]]:
    """(bytes, bytes/s) of ``op``'s measured points in ``precision``, else in the precision nearest it
    in element size, sorted by size (one rate per size: the median of repeats); [] when none."""
    memo = memo_for(profile)
    key = ("elementwise", op, precision)
    if memo is not None and key in memo:
        return memo[key]
    points = [p for p in profile.compute.elementwise if p.op == op]
    if points:
        have = {p.precision for p in points}
        use = precision if precision in have else min(have, key=lambda q: (abs(q.bytes - precision.bytes), q.value))
        by_size: dict[int, list[float]] = {}
        for p in points:
            if p.precision is use:
                by_size.setdefault(p.bytes, []).append(p.bytes / p.time_s)
        rates = [(float(b), statistics.median(r)) for b, r in sorted(by_size.items())]
        top = rates[-1][1]
        rates = [(b, min(r, top)) for b, r in rates]
    else:
        rates = []
    if memo is not None:
        memo[key] = rates
    return rates


def _bandwidth(profile: ClusterProfile) -> float:
    """Rank 0's memory-bound bytes/s: achieved, else datasheet HBM bandwidth × efficiency."""
    measured = profile.compute.achieved_memory_bandwidth_bytes_per_s
    return measured or profile.device.hbm_bandwidth_bytes_per_s * profile.assumptions.memory_bandwidth_efficiency


def _matmul_rate(profile: ClusterProfile, precision: Precision) -> float:
    """Achieved FLOP/s of a large GEMM: measured peak, else datasheet × assumed efficiency."""
    measured = profile.compute.achieved_matmul_tflops.get(precision)
    if measured:
        return measured * 1e12
    a = profile.assumptions
    eff = a.fp8_matmul_efficiency if precision is Precision.fp8 else a.matmul_efficiency
    return peak_flops(profile, precision) * eff


def gemm_time_s(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, count: int = 1,
                layout: GemmLayout = GemmLayout.nn) -> float:
    """Time of ``count`` GEMMs of (m×k)·(k×n) on one GPU, operands laid out as ``layout``, at the
    slowest checked device's pace (:func:`device_pace`)."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    memo = memo_for(profile)
    if memo is not None:
        key = ("gemm", m, n, k, precision, layout)
        one = memo.get(key)
        if one is None:
            one = memo[key] = _one_gemm_time(profile, m, n, k, precision, layout)
        return count * one
    return count * _one_gemm_time(profile, m, n, k, precision, layout)


# where a profile has no points of the layout asked for: the one it has, in this order (profiles
# before GemmPoint.layout timed every GEMM as nn, FP8 runs every GEMM as nt)
_FALLBACK_LAYOUTS = (GemmLayout.nn, GemmLayout.nt, GemmLayout.tn)


# on a GPU a 16-bit precision without a table of its own is priced from the other's: bf16 and fp16
# run on the same tensor cores, at the same datasheet rate on every GPU listed. Not on a CPU, where
# fp16 matmul has no AMX/AVX-512 bf16 path to share (torch runs it far slower than bf16 without AMX-FP16)
_SIBLING = {Precision.fp16: Precision.bf16, Precision.bf16: Precision.fp16}


def _sibling_table(points, precision: Precision, profile: ClusterProfile):  # noqa: ANN001, ANN202
    """(points of ``precision``, 1.0), else on a GPU (its 16-bit sibling's points, datasheet peak of the
    sibling / of ``precision`` where the device lists both, else 1.0), else ([], 1.0)."""
    table = [p for p in points if p.precision is precision]
    sibling = _SIBLING.get(precision)
    if table or sibling is None or profile.is_cpu:
        return table, 1.0
    table = [p for p in points if p.precision is sibling]
    peaks = profile.device.peak_tflops
    scale = peaks[sibling] / peaks[precision] if sibling in peaks and precision in peaks else 1.0
    return table, scale


def _one_gemm_time(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, layout: GemmLayout) -> float:
    pace = device_pace(profile) if profile.device_checks else _NO_PACE
    table, scale = _sibling_table(profile.compute.gemm, precision, profile)
    if not table:
        return _roofline_gemm_time(profile, m, n, k, precision, pace)
    have = {p.layout for p in table}
    use = layout if layout in have else next(x for x in _FALLBACK_LAYOUTS if x in have)
    if layout is GemmLayout.tn and use is GemmLayout.nn:
        # the weight gradient from nn points: as its transposed product Cᵀ = Bᵀ·Aᵀ, the same work, which
        # is how profiles before layouts timed it ((in, out, tokens) nn, not (out, in, tokens) tn)
        m, n = n, m
    return _interpolated_gemm_time([p for p in table if p.layout is use], m, n, k) * scale * pace.compute


def gemm_fwd_bwd_s(
    profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, count: int = 1
) -> tuple[float, float]:
    """(forward, backward) time of a linear layer ``Y[m×n] = X[m×k] · W[k×n]``, ``count`` times:
    :func:`linear_gemms_s` with the backward's two GEMMs added up."""
    fwd, dgrad, wgrad = linear_gemms_s(profile, m, n, k, precision, count)
    return fwd, dgrad + wgrad


def linear_gemms_s(
    profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, count: int = 1
) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) time of a linear layer ``Y[m×n] = X[m×k] · W[k×n]``,
    ``count`` times.

    Each GEMM in the operand layout torch's linear runs it in (:class:`GemmLayout`; W stored
    ``[n×k]``): forward ``X·Wᵀ`` (nt); the input gradient ``dX = dY·W`` (an m×k output reducing over
    n, nn); the weight gradient ``dW = dYᵀ·X`` (an n×k output reducing over the m tokens, tn): the
    same FLOPs each, but other shapes and layouts, so other speeds.
    """
    return (gemm_time_s(profile, m, n, k, precision, count, GemmLayout.nt),
            gemm_time_s(profile, m, k, n, precision, count, GemmLayout.nn),
            gemm_time_s(profile, n, k, m, precision, count, GemmLayout.tn))


def grouped_gemm_time_s(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, count: int,
                        concurrent: int, layout: GemmLayout = GemmLayout.nn) -> float:
    """Time of ``count`` GEMMs of (m×k)·(k×n), each on its own operands (the local experts of a grouped
    GEMM), issued round-robin on ``concurrent`` streams, so up to that many run at once and share the
    GPU's tile slots (Transformer Engine's GroupedLinear: ``Assumptions.grouped_gemm_streams``).

    Rounds of ``c = min(concurrent, count)`` GEMMs (the last one of what remains). A round fills the waves
    with ``c`` times one GEMM's output tiles (:func:`wave_efficiency` with ``copies=c``): a reference
    profile prices its compute at that fill and its traffic as ``c`` GEMMs' bytes; a measured table gives
    one GEMM at the per-expert shape (its tail effects included), scaled by the fill of one GEMM over that
    of ``c`` (the profile's ``sm_count`` and ``gemm_tiles``; no change where ``sm_count`` is unknown). One
    stream, or one GEMM: ``count`` × :func:`gemm_time_s`. At the slowest checked device's pace."""
    c = max(1, min(concurrent, count))
    if c == 1 or m <= 0 or n <= 0 or k <= 0:
        return gemm_time_s(profile, m, n, k, precision, count, layout)
    memo = memo_for(profile)
    key = ("grouped", m, n, k, precision, count, c, layout)
    if memo is not None and key in memo:
        return memo[key]
    rounds, rest = divmod(count, c)
    total = rounds * _concurrent_gemms_s(profile, m, n, k, precision, c, layout)
    if rest:
        total += _concurrent_gemms_s(profile, m, n, k, precision, rest, layout)
    if memo is not None:
        memo[key] = total
    return total


def _concurrent_gemms_s(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, copies: int,
                        layout: GemmLayout) -> float:
    """One round of :func:`grouped_gemm_time_s`: ``copies`` GEMMs running at once."""
    one = gemm_time_s(profile, m, n, k, precision, 1, layout)
    if copies == 1:
        return one
    table, _ = _sibling_table(profile.compute.gemm, precision, profile)
    if not table:
        pace = device_pace(profile) if profile.device_checks else _NO_PACE
        return _roofline_gemm_time(profile, m, n, k, precision, pace, copies)
    sm, tiles = profile.device.sm_count, tuple(tuple(t) for t in profile.assumptions.gemm_tiles)
    return copies * one * wave_efficiency(m, n, sm, tiles) / wave_efficiency(m, n, sm, tiles, copies)


def _roofline_gemm_time(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision,
                        pace: DevicePace = _NO_PACE, copies: int = 1) -> float:
    """``copies`` such GEMMs at once, each on its own operands (:func:`grouped_gemm_time_s`): their tiles
    share the waves, their bytes add up."""
    a = profile.assumptions
    flops = 2.0 * m * n * k * copies
    waves = wave_efficiency(m, n, profile.device.sm_count, tuple(tuple(t) for t in a.gemm_tiles), copies)
    compute = flops / (_matmul_rate(profile, precision) * waves * k_efficiency(k, a.gemm_k_overhead))
    elt = 1 if precision is Precision.fp8 else precision.bytes
    out = 4 if precision is Precision.fp32 else 2  # FP8 GEMMs write 16-bit outputs
    traffic = copies * (elt * (m * k + k * n) + out * m * n) / _bandwidth(profile)
    # FP8 input casts are fused into the producing norm / activation kernels (Transformer Engine),
    # so they add no separate HBM pass here.
    return max(compute * pace.compute, traffic * pace.memory)


def _interpolated_gemm_time(table, m: int, n: int, k: int) -> float:  # noqa: ANN001
    """Measured GEMMs: achieved rate fitted locally in log space (see :func:`local_log_fit`) on
    (log m, log n, log k); the measured time itself at a measured shape."""
    target = (math.log(m), math.log(n), math.log(k))
    points = [((math.log(p.m), math.log(p.n), math.log(p.k)), math.log(2.0 * p.m * p.n * p.k / p.time_s))
              for p in table]
    return 2.0 * m * n * k / math.exp(local_log_fit(points, target))


def local_log_fit(points: list[tuple[tuple[float, ...], float]], target: tuple[float, ...]) -> float:
    """Value at ``target`` of a weighted local linear fit through the nearest ``points`` (x, y).

    Used on x = logs of the shape, y = log of the achieved rate: between measured shapes this is
    multilinear interpolation in log space (on a cell of a rectilinear grid, the fit through its
    2^d corners; weights ``1/distance⁴`` keep points beyond the cell from tilting it), so a shape
    halfway between a slow small GEMM and a fast large one gets the geometric mean of their rates
    instead of the nearest one's.
    Neighbours: the 2^d + d nearest (with ties); a small ridge keeps slopes along directions the
    neighbours do not span at zero (one point: its rate everywhere); the result is clamped to the
    neighbours' range, so it never extrapolates a rate beyond what was measured.
    """
    scored = sorted((math.dist(target, x), x, y) for x, y in points)
    if scored[0][0] < 1e-9:
        return scored[0][2]
    dim = len(target)
    want = min(len(scored), 2**dim + dim)
    cutoff = scored[want - 1][0] * (1 + 1e-9)
    near = [s for s in scored if s[0] <= cutoff]
    # normal equations of min sum w (y - c - b.(x - target))^2 + ridge |b|^2, unknowns (c, b)
    size = dim + 1
    a = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    total_w = 0.0
    for d, x, y in near:
        w = 1.0 / d**4
        total_w += w
        row = [1.0, *(xi - ti for xi, ti in zip(x, target))]
        for r in range(size):
            rhs[r] += w * row[r] * y
            for c in range(size):
                a[r][c] += w * row[r] * row[c]
    for r in range(1, size):
        a[r][r] += 1e-3 * total_w
    value = _solve(a, rhs)[0]
    ys = [y for _, _, y in near]
    return min(max(value, min(ys)), max(ys))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small, well-conditioned system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


FLASH_MAX_HEAD_DIM = 256  # torch's CUDA flash kernel: head dims up to 256


def sdpa_takes_grouped_kv(device_type: str, sixteen_bit: bool, sm_major: int, head_dim: int) -> bool:
    """Whether torch's SDPA runs grouped K/V (``enable_gqa``) on a fused kernel: on a CPU always (its
    flash kernel takes any dtype); on CUDA only the flash kernel does, which runs 16-bit formats, from
    Ampere (sm80), head dims up to 256 (the memory-efficient kernel takes no grouped K/V; which CUDA
    kernels take them on a given card, ``benchmarks/attention_kernels.py`` lists). Anywhere else
    SDPA would fall back to its math kernel, which holds the whole score matrix (32 GiB for 32 heads at
    16k tokens), so ``autopar profile`` times and ``autopar run`` runs K/V expanded to the query heads
    there, as a model without a grouped kernel does: one rule for both, so the table prices the kernel
    the executor gets."""
    if device_type != "cuda":
        return True
    return sixteen_bit and sm_major >= 8 and head_dim <= FLASH_MAX_HEAD_DIM


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
    """(forward, backward) time of the attention core for ``heads`` local heads, at the slowest checked
    device's pace (:func:`device_pace`).

    Fused (flash): forward FLOPs ``2·b·q·kv·a·(d_qk + d_v)`` times the causal fraction, at
    ``peak · attention_efficiency`` (16-bit even in FP8 recipes); backward runs 5 of those matmuls
    instead of 2 (it recomputes the scores), i.e. 2.5× forward.
    A measured table (fused kernels) gives the rate instead: that of the nearest measurements in the
    same regime of the kernel's tiling, on the score elements it computes (:func:`same_regime`,
    :func:`attention_work`); FP8 recipes' attention from the bf16 points, a 16-bit precision without
    points from the other 16-bit one's (:func:`_sibling_table`).
    Unfused (Megatron 2021): two batched GEMMs plus the scale-mask-softmax and dropout streaming
    the ``b·a·q·kv`` scores through HBM: 9 bytes per score forward, 11 backward.
    """
    flops = 2.0 * batch * q_len * kv_len * heads * (qk_dim + v_dim)
    if flash:
        pace = device_pace(profile).compute if profile.device_checks else 1.0
        # FP8 recipes run attention in 16 bits: an fp8 table (the profiler's copies of bf16 points), else bf16's
        asked = Precision.bf16 if precision is Precision.fp8 and not any(
            p.precision is Precision.fp8 for p in profile.compute.attention) else precision
        table, scale = _sibling_table([p for p in profile.compute.attention if p.causal == causal], asked, profile)
        if table:
            blocking = profile.compute.attention_blocking
            work = 2.0 * batch * heads * (qk_dim + v_dim) * attention_work(q_len, kv_len, causal, blocking)
            fwd, bwd = _interpolated_attention(same_regime(table, q_len, blocking), blocking, profile.is_cpu, batch,
                                               q_len, heads, kv_heads, qk_dim, work)
            return fwd * scale * pace, bwd * scale * pace
        frac = causal_work_fraction(kv_len) if causal and q_len == kv_len else (0.5 if causal else 1.0)
        rate = peak_flops(profile, Precision.bf16) * profile.assumptions.attention_efficiency
        fwd = flops * frac / rate * pace
        return fwd, 2.5 * fwd
    # unfused: its GEMMs and memory passes are each priced at the pace (gemm_time_s, memory_time_s)
    p16 = Precision.bf16 if precision is Precision.fp8 else precision
    # one batched GEMM each for QK^T (nt: K stored [kv×d]) and PV (nn) (one launch, batch·heads problems)
    gemms = gemm_time_s(profile, q_len * batch * heads, kv_len, qk_dim, p16, layout=GemmLayout.nt) + gemm_time_s(
        profile, q_len * batch * heads, v_dim, kv_len, p16
    )
    # backward: dP = dO·Vᵀ (nt), dV = Pᵀ·dO (tn), dQ = dS·K (nn), dK = dSᵀ·Q (tn): twice the forward's
    # FLOPs, priced as twice its two GEMMs (the calibration's attention constants were fitted so)
    scores = batch * heads * q_len * kv_len
    # forward: fused scale-mask-softmax (read 2 B, write 2 B) and dropout (read 2, write 2, mask 1)
    # backward: dropout (read grad 2 + mask 1, write 2) and softmax (read y 2, dy 2, write 2)
    return gemms + memory_time_s(profile, 9.0 * scores), 2.0 * gemms + memory_time_s(profile, 11.0 * scores)


def blocking_regime(blocking: list[AttentionBlocking], q_len: int) -> int:
    """Index of the kernel regime (``ComputeProfile.attention_blocking``) a query length runs in."""
    return max(0, bisect.bisect_right([b.from_q_len for b in blocking], q_len) - 1)


@functools.lru_cache(maxsize=65536)
def _causal_tiles(seq: int, q_block: int, kv_block: int) -> int:
    """Score-matrix elements a blocked causal kernel computes for ``seq`` queries against ``seq``
    keys (top-left aligned): each block of up to ``q_block`` query rows computes every key block,
    whole, up to the one holding its last row's key."""
    work, start = 0, 0
    while start < seq:
        rows = min(q_block, seq - start)
        work += rows * min(-(-(start + rows) // kv_block) * kv_block, seq)
        start += rows
    return work


def attention_work(q_len: int, kv_len: int, causal: bool, blocking: list[AttentionBlocking]) -> float:
    """Score-matrix elements the attention kernel computes: all ``q_len · kv_len`` without causal
    masking or a known tiling (``blocking`` empty: GPU flash kernels, whose small tiles the measured
    rate absorbs); else the tiles of the regime ``q_len`` runs in (:func:`_causal_tiles`). With fewer
    queries than keys (context parallelism: this rank's queries, spread over the sequence, against all
    ``kv_len`` keys) all ``q_len · kv_len``: a CPU has no ring attention (torch's is GPU-only), and
    this project's all-gather CP (:mod:`executor.cp`) passes the causal mask as a tensor, with which
    the kernel skips no key block (measured, fp32, 8 heads, d=64, 1 thread: 1.06x, 1.10x and 1.17x the
    unmasked call at 512, 1024 and 2048, where is_causal took 1.01x, 0.76x and 0.63x).

    Torch's CPU kernel computes whole 512-key blocks: at q_len 512 the causal mask saves nothing, at
    2048 it saves 37.5%, so its rate on all ``q·kv`` scores rises 69 → 124 GFLOP/s from 192 to 2048
    (bf16, forward, 1 thread) while its rate on the computed tiles stays 69-78."""
    if not causal or not blocking or q_len != kv_len:
        return float(q_len) * kv_len
    b = blocking[blocking_regime(blocking, q_len)]
    return _causal_tiles(kv_len, b.q_block, b.kv_block) * (q_len / kv_len)


def same_regime(table: list[AttentionPoint], q_len: int, blocking: list[AttentionBlocking]) -> list[AttentionPoint]:
    """The attention measurements to interpolate ``q_len`` from: those in its regime of the kernel's
    tiling (``ComputeProfile.attention_blocking``). Torch's CPU kernel changes its query blocks at
    192 and 768, and its rate steps there even on the computed tiles (1 thread, bf16, 8 heads, d=64:
    backward 15.0 GFLOP/s at 191, 22.6 at 192; 31.0 at 767, 40.2 at 768), so a fit across a switch
    would miss on both sides of it. With no measurement in the regime, those of the regime of the
    nearest measured length (priced at their rates, as beyond the table's ends)."""
    if not blocking or not table:
        return table
    regime = blocking_regime(blocking, q_len)
    same = [p for p in table if blocking_regime(blocking, p.seq_length) == regime]
    if same:
        return same
    nearest = min(table, key=lambda p: abs(math.log(p.seq_length / q_len)))
    regime = blocking_regime(blocking, nearest.seq_length)
    return [p for p in table if blocking_regime(blocking, p.seq_length) == regime]


GPU_ATTENTION_QUERY_TILE = 128  # query rows per thread block of a GPU flash kernel (FA2/FA3, cuDNN)


def heads_coords(b: int, s: int, h: int, kv: int, d: int) -> tuple[float, ...]:
    """Attention fit coordinates of a CPU table (a known tiling): (log seq, log batch·heads,
    log batch·kv_heads, log head_dim)."""
    return (math.log(s), math.log(b * h), math.log(b * kv), math.log(d))


def thread_block_coords(b: int, s: int, h: int, kv: int, d: int) -> tuple[float, ...]:
    """Attention fit coordinates of a GPU table: (log seq, log batch·heads·seq/128, log head_dim)."""
    return (math.log(s), math.log(b * h * s / GPU_ATTENTION_QUERY_TILE), math.log(d))


def attention_coords(cpu: bool):  # noqa: ANN201
    """The coordinates :func:`_interpolated_attention` fits a table on: :func:`heads_coords` for a CPU
    profile (:attr:`ClusterProfile.is_cpu`, whether or not its kernel's tiling is recorded), else
    :func:`thread_block_coords`."""
    return heads_coords if cpu else thread_block_coords


def _interpolated_attention(table, blocking, cpu, batch, seq, heads, kv_heads, head_dim, work):  # noqa: ANN001
    """Measured attention: forward and backward rates (FLOPs of the computed score elements,
    :func:`attention_work`, per second) fitted locally in log space (:func:`local_log_fit`);
    ``work`` is the target's FLOPs.

    The coordinates follow how the kernel spreads its work (:func:`attention_coords`). A CPU kernel
    (``cpu``): (log seq, log batch·heads, log batch·kv_heads, log head_dim). A GPU flash kernel runs
    one thread block per (sequence, head, query tile), so its rate follows
    the number of those blocks against the GPU's SMs (wave fill) and the work of each (its keys, its
    head dim): (log seq, log batch·heads·seq/128, log head_dim), K/V heads left out. On the lent
    H200's full table (24 bf16 points) that took the leave-one-out error from a median of 8.9% to
    6.3%, and with each whole head layout left out (as a model's heads the grid never measured) from
    12.5% to 7.1%; the executor's step (batch 2 and 8, 16/8 heads) was priced 21% and 20% high
    instead of 45% and 108%. On a CPU's table the old coordinates had the lower medians, so they
    stay there (a one-thread CPU profile measured then, not kept: README, "On a GPU").
    ``benchmarks/attention_fit.py`` prints these figures for a profile, both fits side by side."""

    coords = attention_coords(cpu)
    target = coords(batch, seq, heads, kv_heads, head_dim)
    fwd_pts, bwd_pts = [], []
    for p in table:
        x = coords(p.batch, p.seq_length, p.num_heads, p.num_kv_heads, p.head_dim)
        ref = 4.0 * p.batch * p.num_heads * p.head_dim * attention_work(p.seq_length, p.seq_length, p.causal, blocking)
        fwd_pts.append((x, math.log(ref / p.forward_time_s)))
        bwd_pts.append((x, math.log(ref / p.backward_time_s)))
    return work / math.exp(local_log_fit(fwd_pts, target)), work / math.exp(local_log_fit(bwd_pts, target))

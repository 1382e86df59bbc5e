"""profiler.compute and profiler.timing: real measurements on this CPU with a tiny grid."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch

from planner.contracts import ClusterProfile, ComputeProfile, GemmLayout, Precision
from planner.cost.compute import attention_time_s, elementwise_time_s, gemm_fwd_bwd_s, gemm_time_s
from planner.errors import AutoparError
from planner.presets import get_preset
from planner.reference import reference_profile
from profiler.compute import (
    ComputeGrid,
    _attention_fns,
    default_grid,
    kv_heads_to_run,
    linear_gemms,
    linear_shapes,
    measure_attentions,
    measure_compute,
    measure_gemms,
    parse_precisions,
    supported_precisions,
)
from profiler.timing import time_fn

CPU = torch.device("cpu")

TINY = ComputeGrid(
    gemm=[(64, 64, 64, GemmLayout.nt), (256, 256, 256, GemmLayout.nt), (512, 512, 512, GemmLayout.nt)],
    attention=[(1, 128, 4, 4, 32), (1, 256, 4, 2, 32)],
    elementwise_bytes=[1 << 20],
    precisions=[Precision.fp32, Precision.bf16],
    warmup=1,
    trials=5,
    min_time_s=0.002,
)


@pytest.fixture(scope="module")
def measured() -> ComputeProfile:
    # One intra-op thread: on the shared 2-core test machine (xdist workers beside torchrun tests) a
    # multi-threaded GEMM waits at its thread barrier for a descheduled sibling, a ~16 ms stall that
    # can swamp a 64^3 matmul's microseconds in most trials. The profiler itself pins threads per rank.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    calls: list[tuple[str, int, int]] = []
    try:
        profile = measure_compute(
            CPU, TINY, progress=lambda label, done, total: calls.append((label, done, total))
        )
    finally:
        torch.set_num_threads(threads)
    total = calls[0][2]
    assert total == 3 * 2 + 2 * 2 + 4 * 2
    assert calls[-1][1:] == (total, total)
    assert [c[1] for c in calls] == sorted(c[1] for c in calls)
    return profile


def cluster_with(compute: ComputeProfile) -> ClusterProfile:
    base = reference_profile("dgx-h100", 1)
    device = {"name": "test cpu", "memory_bytes": 8 << 30, "peak_tflops": {"bf16": 1.0, "fp32": 0.5},
              "hbm_bandwidth_bytes_per_s": 50e9}
    return ClusterProfile.model_validate(
        {**base.model_dump(), "kind": "measured", "name": "test-cpu", "device": device,
         "compute": compute.model_dump(), "gpus_per_node": 1}
    )


def test_time_fn_repeats_tiny_ops_to_min_time():
    x = torch.ones(16)
    result = time_fn(lambda: x.add_(1), device=CPU, warmup=3, trials=4, min_time_s=0.005)
    assert len(result.trials) == 4
    assert result.calls_per_trial > 1
    assert 0 < result.median_s < 0.005
    assert result.iqr_s >= 0


def test_time_fn_measures_a_sleep():
    result = time_fn(lambda: time.sleep(0.01), device=CPU, warmup=1, trials=3)
    assert 0.009 < result.median_s < 0.05


def test_a_cpu_profile_records_the_fastest_trial_and_a_gpu_one_the_median(monkeypatch):
    """Wall clocks on a shared host only ever run slow: a CPU point is its fastest trial."""
    from profiler.timing import estimate

    assert estimate([3.0, 1.0, 2.0, 9.0], "cpu") == 1.0
    assert estimate([3.0, 1.0, 2.0, 9.0], "cuda") == 2.5
    calls = itertools.count()  # one call in four undisturbed (1 ms), the rest slowed (20 ms)
    result = time_fn(lambda: time.sleep(0.001 if next(calls) % 4 == 0 else 0.02), device=CPU, warmup=1, trials=5)
    assert result.estimate_s == min(result.trials) < 0.01 < result.median_s
    # and that is what the tables record
    import profiler.timing

    monkeypatch.setattr(profiler.timing, "estimate", lambda trials, device_type: 0.125)
    assert measure_gemms([((8, 8, 8, GemmLayout.nn), Precision.fp32)], CPU, TINY)[0].time_s == 0.125


def test_points_positive_finite_and_bigger_gemms_take_longer(measured):
    for g in measured.gemm:
        assert math.isfinite(g.time_s) and g.time_s > 0
    for a in measured.attention:
        assert math.isfinite(a.forward_time_s) and a.forward_time_s > 0 and a.backward_time_s > 0
    for e in measured.elementwise:
        assert math.isfinite(e.time_s) and e.time_s > 0 and e.bytes > 0
    assert {e.op for e in measured.elementwise} == {"rmsnorm", "silu_mul", "add", "softmax_cross_entropy"}
    for p in TINY.precisions:
        times = {(g.m, g.n, g.k): g.time_s for g in measured.gemm if g.precision is p}
        assert len(times) == 3
        # 8x and 512x the FLOPs of the smaller shapes: a 64^3 GEMM takes microseconds, and under
        # `make test` a torchrun test on the other xdist worker has spoiled all its trials to 0.1 ms
        # (more than the 256^3 one took), so neighbours 64x apart are not compared
        assert times[(64, 64, 64)] < times[(512, 512, 512)]
        assert times[(256, 256, 256)] < times[(512, 512, 512)]
    gqa = [a for a in measured.attention if a.num_kv_heads == 2]
    assert len(gqa) == 2


def test_achieved_peaks_plausible_and_profile_validates(measured):
    assert set(measured.achieved_matmul_tflops) == {Precision.fp32, Precision.bf16}
    for tflops in measured.achieved_matmul_tflops.values():
        assert 0 < tflops < 10
    bw = measured.achieved_memory_bandwidth_bytes_per_s
    assert bw is not None and 1e8 < bw < 1e13
    ComputeProfile.model_validate(measured.model_dump(mode="json"))
    cluster_with(measured)


def test_planner_returns_measured_time_at_measured_shape(measured):
    cluster = cluster_with(measured)
    for g in measured.gemm:
        assert gemm_time_s(cluster, g.m, g.n, g.k, g.precision, layout=g.layout) == pytest.approx(g.time_s, rel=1e-9)
    for a in measured.attention:
        fwd, bwd = attention_time_s(
            cluster, batch=a.batch, q_len=a.seq_length, kv_len=a.seq_length, heads=a.num_heads,
            kv_heads=a.num_kv_heads, qk_dim=a.head_dim, v_dim=a.head_dim, precision=a.precision,
            causal=True, flash=True,
        )
        assert fwd == pytest.approx(a.forward_time_s, rel=1e-9)
        assert bwd == pytest.approx(a.backward_time_s, rel=1e-9)
    for e in measured.elementwise:
        assert elementwise_time_s(cluster, e.op, e.bytes, e.precision) == pytest.approx(e.time_s, rel=1e-9)


def test_supported_and_parsed_precisions():
    assert supported_precisions(CPU) == [Precision.fp32, Precision.bf16]
    assert parse_precisions("bf16, fp32", CPU) == [Precision.bf16, Precision.fp32]
    with pytest.raises(AutoparError) as err:
        parse_precisions("bf16,int4", CPU)
    assert err.value.field == "--precisions" and err.value.value == "int4"
    assert "fp32" in err.value.fix and "bf16" in err.value.fix
    with pytest.raises(AutoparError) as err:
        parse_precisions("fp8", CPU)
    assert err.value.field == "--precisions" and err.value.value == "fp8"
    assert "fp32,bf16" in err.value.fix
    with pytest.raises(AutoparError):
        parse_precisions(" ", CPU)


def test_gemm_operands_lie_in_memory_as_their_layout_says():
    """nt: B is the transpose of a stored [n×k] weight (a linear's forward); tn: A the transpose of a
    stored [k×m] tensor (its weight gradient dYᵀ·X); nn: both as stored (its input gradient)."""
    from profiler.compute import gemm_operands

    m, n, k = 48, 80, 32
    for layout in GemmLayout:
        a, b = gemm_operands(m, n, k, layout, torch.float32, CPU)
        assert a.shape == (m, k) and b.shape == (k, n)
        assert a.is_contiguous() == (layout is not GemmLayout.tn) and a.t().is_contiguous() == (layout is GemmLayout.tn)
        assert b.is_contiguous() == (layout is not GemmLayout.nt) and b.t().is_contiguous() == (layout is GemmLayout.nt)


def test_each_layout_of_a_shape_is_its_own_point_and_the_planner_returns_it():
    grid = ComputeGrid(gemm=[(96, 160, 128, lay) for lay in GemmLayout], attention=[], elementwise_bytes=[],
                       precisions=[Precision.fp32], warmup=1, trials=2)
    compute = measure_compute(CPU, grid)
    assert sorted(g.layout.value for g in compute.gemm) == ["nn", "nt", "tn"]
    cluster = cluster_with(compute)
    for g in compute.gemm:
        assert gemm_time_s(cluster, 96, 160, 128, Precision.fp32, layout=g.layout) == pytest.approx(g.time_s)
    by = {g.layout: g.time_s for g in compute.gemm}
    # a linear layer Y[96x160] = X[96x128]·Wᵀ: forward is the nt point; its backward GEMMs have other
    # shapes, priced from the nn and tn tables
    fwd, _ = gemm_fwd_bwd_s(cluster, 96, 160, 128, Precision.fp32)
    assert fwd == pytest.approx(by[GemmLayout.nt])


def test_measure_refuses_unsupported_precision_before_measuring():
    grid = ComputeGrid(gemm=[(8, 8, 8, GemmLayout.nt)], attention=[], elementwise_bytes=[], precisions=[Precision.fp8])
    with pytest.raises(AutoparError, match="fp8"):
        measure_compute(CPU, grid, progress=lambda *a: pytest.fail("measured before validating"))


def test_default_grid_for_a_model_has_every_linear_gemm_at_each_tp():
    model = get_preset("llama3-8b")
    grid = default_grid(model, tp_degrees=[1, 2, 4, 8], micro_batch_tokens=[4096])
    shapes = set(grid.gemm)
    h, ffn, a, kv, d = 4096, 14336, 32, 8, 128
    for tp in (1, 2, 4, 8):
        expected = {
            "qkv": ((a + 2 * kv) * d // tp, h), "attn_out": (h, a * d // tp),
            "mlp_up": (2 * ffn // tp, h), "mlp_down": (h, ffn // tp), "lm_head": (128256 // tp, h),
        }
        assert linear_shapes(model, tp) == expected
        for out_f, in_f in expected.values():
            fwd, dgrad, wgrad = linear_gemms(4096, out_f, in_f)
            assert fwd == (4096, out_f, in_f, GemmLayout.nt) and dgrad == (4096, in_f, out_f, GemmLayout.nn)
            assert wgrad == (out_f, in_f, 4096, GemmLayout.tn)
            assert {fwd, dgrad, wgrad} <= shapes
        assert (1, 4096, a // tp, max(kv // tp, 1), d) in grid.attention
    assert len(grid.gemm) == len(shapes)  # no duplicates
    assert grid.precisions == [Precision.fp32, Precision.bf16]


def test_a_cpu_profile_records_the_flash_kernels_tiling_and_the_regimes_it_missed(measured):
    from profiler.compute import CPU_FLASH_BLOCKING

    assert measured.attention_blocking == list(CPU_FLASH_BLOCKING)
    # TINY measures q_len 128 and 256: the 256-row regime from 768 has no measurement, and says so
    (note,) = [n for n in TINY.notes if "query blocks" in n]
    assert "nothing was measured for fp32 at q_len 768 and up; bf16 at q_len 768 and up" in note
    assert "below 192" not in note


def test_regime_gaps_are_found_per_precision():
    from planner.contracts import AttentionPoint
    from profiler.compute import CPU_FLASH_BLOCKING, regime_gaps

    def at(s: int, p: Precision) -> AttentionPoint:
        return AttentionPoint(precision=p, batch=1, seq_length=s, num_heads=2, num_kv_heads=2, head_dim=32,
                              forward_time_s=1e-3, backward_time_s=2e-3)

    # fp32 reached 1024, the bf16 walk stopped before 768: the bf16 table alone lacks the top regime
    points = [at(s, Precision.fp32) for s in (128, 256, 768, 1024)] + [at(s, Precision.bf16) for s in (128, 256)]
    assert regime_gaps(points, CPU_FLASH_BLOCKING) == ["bf16 at q_len 768 and up"]
    assert regime_gaps([at(512, Precision.fp32)], CPU_FLASH_BLOCKING) == ["fp32 at q_len below 192, 768 and up"]
    assert regime_gaps(points[:4], CPU_FLASH_BLOCKING) == []


def test_default_cpu_grids_measure_every_regime_of_the_flash_kernel():
    from profiler.compute import CPU_FLASH_BLOCKING

    starts = [b.from_q_len for b in CPU_FLASH_BLOCKING]
    for quick in (True, False):
        seqs = {a[1] for a in default_grid(quick=quick, device_type="cpu").attention}
        for lo, hi in zip(starts, [*starts[1:], math.inf]):
            # a full profile brackets lengths in every regime; a quick one measures each at least once
            assert sum(lo <= s < hi for s in seqs) >= (1 if quick else 2), (quick, lo)


def test_device_check_notes_name_mixed_and_slow_devices():
    from planner.contracts import DeviceCheck
    from profiler.compute import device_check, device_check_notes

    def check(rank: int, tflops: float, gbps: float = 3000.0, name: str = "NVIDIA H100 80GB HBM3") -> DeviceCheck:
        return DeviceCheck(rank=rank, host=f"node{rank // 8}", local_rank=rank % 8, device=name,
                           memory_bytes=80 << 30, precision=Precision.bf16, gemm=(8192, 8192, 8192),
                           gemm_tflops=tflops, memory_bandwidth_bytes_per_s=gbps * 1e9)

    even = [check(r, 700.0 + r) for r in range(16)]
    assert device_check_notes(even, "cuda") == []
    # one GPU 14% below the median GEMM rate: slow on a GPU cluster (10%), within a CPU's noise (25%)
    slow = [*even[:5], check(5, 610.0), *even[6:]]
    (note,) = device_check_notes(slow, "cuda")
    assert note.startswith("SLOW DEVICES (GEMM): 1 of 16 ranks more than 10% below the median")
    assert "rank 5 (node0, local rank 5) 610 TFLOP/s, 14% below" in note
    assert device_check_notes(slow, "cpu") == []
    # a device with less bandwidth, and one of another kind
    odd = [*even[:9], check(9, 709.0, gbps=2000.0), *even[10:15], check(15, 715.0, name="NVIDIA H100 PCIe")]
    mixed, bandwidth = device_check_notes(odd, "cuda")
    assert mixed.startswith("MIXED DEVICES: 1 of 16 ranks have a device other than rank 0's NVIDIA H100 80GB HBM3")
    assert "NVIDIA H100 PCIe (80 GiB) (ranks 15)" in mixed
    assert bandwidth.startswith("SLOW DEVICES (memory bandwidth)")
    assert "rank 9 (node1, local rank 1) 2000 GB/s" in bandwidth
    # the real check on this CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        real = device_check(CPU, 0, "here", 0, "CPU: test", 1 << 30)
    finally:
        torch.set_num_threads(threads)
    assert real.gemm == (512, 512, 512) and real.precision is Precision.fp32
    assert 1e-3 < real.gemm_tflops < 10 and 1e8 < real.memory_bandwidth_bytes_per_s < 1e13


def test_the_memory_check_streams_past_the_cache_unless_quick_and_says_so():
    from profiler.compute import check_add_buffer_bytes

    MiB, GiB = 1 << 20, 1 << 30
    # a full profile: each of the three buffers at least the last-level cache (the add streams 3x it)
    assert check_add_buffer_bytes("cpu", 32 * MiB, 16 * GiB) == (64 * MiB, None)
    assert check_add_buffer_bytes("cpu", 480 * MiB, 22 * GiB) == (480 * MiB, None)
    # ... within 1/12 of the memory available, said when that leaves the buffers below the cache
    size, note = check_add_buffer_bytes("cpu", 480 * MiB, 3 * GiB)
    assert size == 256 * MiB and "below the 480 MiB last-level cache" in note
    # a quick profile keeps the 64 MiB floor and says so where the cache is larger
    size, note = check_add_buffer_bytes("cpu", 480 * MiB, 22 * GiB, quick=True)
    assert size == 64 * MiB and note.startswith("QUICK CHECK: each rank's memory check adds 64 MiB buffers, below "
                                                "the 480 MiB last-level cache")
    assert check_add_buffer_bytes("cpu", 32 * MiB, 22 * GiB, quick=True) == (64 * MiB, None)
    assert check_add_buffer_bytes("cpu", 0, 22 * GiB, quick=True) == (64 * MiB, None)  # cache unknown
    # a GPU's buffers are far beyond its L2 whatever the mode
    assert check_add_buffer_bytes("cuda", 0, 0) == check_add_buffer_bytes("cuda", 0, 0, quick=True) == (256 * MiB, None)


def test_device_checks_take_turns_by_host_and_a_failure_names_the_rank(monkeypatch):
    import profiler.compute
    from profiler.run import Dist, _device_checks, check_turns

    # two torchrun agents on host a (ranks 0, 1, 3) and one on b: three turns, b's rank goes first
    names = ["a", "a", "b", "a"]
    assert [check_turns(names, r) for r in range(4)] == [(3, 0), (3, 1), (3, 0), (3, 2)]
    assert check_turns(["a", "b"], 1) == (1, 0)

    class OneRank:  # the collectives of a world of one
        barriers = 0

        def barrier(self, group=None):  # noqa: ANN001
            OneRank.barriers += 1

        def all_gather_object(self, out, obj, group=None):  # noqa: ANN001
            out[0] = obj

    d = Dist(0, 1, 0, 1, False)
    (ok,), _ = _device_checks(OneRank(), None, d, CPU, ["here"], quick=True)
    assert ok.rank == 0 and ok.host == "here" and ok.gemm_tflops > 0 and OneRank.barriers == 0
    # the quick check's buffers, and what they leave to say, come from one sizing
    seen: list[int | None] = []
    real_check = profiler.compute.device_check

    def spy(*args, add_buffer_bytes=None, **kwargs):  # noqa: ANN001, ANN002, ANN003
        seen.append(add_buffer_bytes)
        return real_check(*args, add_buffer_bytes=add_buffer_bytes, **kwargs)

    monkeypatch.setattr(profiler.compute, "reachable_cache_bytes", lambda threads=None: 480 << 20)
    monkeypatch.setattr(profiler.compute, "device_check", spy)
    _, note = _device_checks(OneRank(), None, d, CPU, ["here"], quick=True)
    assert seen == [64 << 20] and note.startswith("QUICK CHECK: each rank's memory check adds 64 MiB buffers, "
                                                  "below the 480 MiB last-level cache")

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003
        raise RuntimeError("CUDA error: out of memory\nmore")

    monkeypatch.setattr(profiler.compute, "device_check", broken)
    with pytest.raises(RuntimeError, match=r"the device check failed on rank 0 \(here\): RuntimeError: CUDA error: "
                                           r"out of memory$"):
        _device_checks(OneRank(), None, d, CPU, ["here"])


def test_default_grids_without_a_model():
    quick = default_grid(quick=True)
    full = default_grid()
    assert len(quick.gemm) < len(full.gemm)
    assert len(quick.attention) <= len(full.attention)
    for grid in (quick, full):
        assert grid.gemm and grid.attention and grid.elementwise_bytes
        assert min(m * n * k for m, n, k, _ in grid.gemm) < max(m * n * k for m, n, k, _ in grid.gemm) / 1000
        # every shape in each of the linear layer's three layouts
        assert {lay for *_, lay in grid.gemm} == set(GemmLayout)
        assert len(grid.gemm) == 3 * len({s[:3] for s in grid.gemm})


def test_planner_interpolates_log_rate_between_measured_shapes():
    """Halfway (in log space) between a slow small GEMM and a fast large one: the geometric mean of
    their rates; beyond the table: no rate above the fastest neighbour measured."""
    from planner.contracts import GemmPoint

    def point(s: int, tflops: float) -> GemmPoint:
        return GemmPoint(precision=Precision.bf16, m=s, n=s, k=s, time_s=2 * s**3 / (tflops * 1e12))

    cluster = cluster_with(ComputeProfile(gemm=[point(64, 0.01), point(256, 0.04)]))
    rate = 2 * 128**3 / gemm_time_s(cluster, 128, 128, 128, Precision.bf16) / 1e12
    assert rate == pytest.approx(0.02, rel=0.01)
    big = 2 * 4096**3 / gemm_time_s(cluster, 4096, 4096, 4096, Precision.bf16) / 1e12
    assert big == pytest.approx(0.04, rel=1e-6)


def test_time_rounds_interleaves_the_trials_of_every_operation():
    """After each operation's warm-up and sizing, round r times one trial of each in turn: a burst of
    other load spoils one trial of several operations, not every trial of one."""
    from profiler.timing import time_rounds

    log: list[str] = []
    results = time_rounds([lambda: log.append("a"), lambda: log.append("b"), lambda: log.append("c")],
                          device=CPU, warmup=1, trials=3, min_time_s=0.0)
    assert [r.calls_per_trial for r in results] == [1, 1, 1]
    assert all(len(r.trials) == 3 for r in results)
    assert log == ["a", "b", "c"] + ["a", "b", "c"] * 3  # warm-ups first, then three rounds


def test_rounds_are_batched_within_the_memory_budget():
    from profiler.compute import _batches

    assert _batches([5, 5, 5, 5], budget=10) == [range(0, 2), range(2, 4)]
    assert _batches([30, 1, 1], budget=10) == [range(0, 1), range(1, 3)]  # one item over budget still runs alone
    assert _batches([], budget=10) == []


def test_fp32_grouped_attention_on_cuda_runs_on_expanded_kv():
    # CUDA's only fused fp32 kernel (memory-efficient) takes no grouped K/V: expand them there
    assert kv_heads_to_run(32, 8, torch.float32, "cuda") == (32, False)
    # 16-bit on CUDA (flash takes grouped K/V), any CPU run, and plain multi-head stay as they are
    assert kv_heads_to_run(32, 8, torch.bfloat16, "cuda") == (8, True)
    assert kv_heads_to_run(32, 8, torch.float32, "cpu") == (8, True)
    assert kv_heads_to_run(8, 8, torch.float32, "cuda") == (8, False)
    # flash is the one grouped kernel on CUDA: not before Ampere, nor past head_dim 256
    assert kv_heads_to_run(32, 8, torch.float16, "cuda", head_dim=128, sm_major=7) == (32, False)
    assert kv_heads_to_run(32, 8, torch.bfloat16, "cuda", head_dim=512, sm_major=9) == (32, False)
    assert kv_heads_to_run(32, 8, torch.bfloat16, "cuda", head_dim=256, sm_major=8) == (8, True)
    assert kv_heads_to_run(32, 8, torch.bfloat16, "cpu", head_dim=512, sm_major=0) == (8, True)


def test_grouped_attention_on_cpu_keeps_grouped_kv_and_adds_no_note():
    _, backward = _attention_fns(1, 64, 8, 2, 16, Precision.fp32, CPU)
    _, grad_k, grad_v = backward()
    assert grad_k.shape[1] == 2 and grad_v.shape[1] == 2  # K/V ran with their 2 heads, not expanded to 8
    grid = default_grid(quick=True)
    grid.warmup, grid.trials, grid.min_time_s = 0, 1, 0.0
    point = measure_attentions([((1, 64, 8, 2, 16), Precision.fp32)], CPU, grid)[0]
    assert point.forward_time_s > 0 and point.backward_time_s > 0
    assert not any("expanded" in n for n in grid.notes)


def test_budget_stops_at_the_first_call_over_its_limit_and_stays_stopped():
    from profiler.timing import Budget

    b = Budget(max_call_s=0.1, max_total_s=1.0)
    assert b.call_limit_s(0) is None  # the first operation is kept whatever it costs: no limit yet
    assert b.admit(0, 0.01, 0.2) and b.call_limit_s(1) == 0.1 and b.admit(1, 0.05, 0.3)
    assert b.spent_s == pytest.approx(0.5)
    assert not b.admit(2, 0.2, 0.3)  # one call over 0.1 s
    assert b.stopped is not None and b.stopped[0] == 2 and "over the 0.1 s a call budget" in b.stopped[2]
    assert not b.admit(3, 0.001, 0.001)  # stopped: nothing more, however cheap
    assert b.call_limit_s(4) is None and b.kept == 2
    total = Budget(max_total_s=1.0)
    assert total.admit(0, 0.1, 0.6) and not total.admit(1, 0.1, 0.6)  # 1.2 s projected > 1 s
    assert total.stopped[0] == 1 and "past its 1 s budget" in total.stopped[2]
    first = Budget(max_call_s=0.1, max_total_s=1.0)
    assert first.admit(0, 5.0, 20.0)  # a table is never empty: its first operation stays
    assert not first.admit(1, 0.01, 0.01) and "past its 1 s budget" in first.stopped[2]
    # ... and the rest of its group: an attention forward keeps its backward, however slow
    pair = Budget(max_call_s=0.1, max_total_s=1.0)
    assert pair.admit(4, 0.01, 0.02) and pair.call_limit_s(4) is None and pair.call_limit_s(5) == 0.1
    assert pair.admit(4, 0.3, 2.0) and pair.kept == 2 and pair.stopped is None
    assert not pair.admit(5, 0.01, 0.01) and pair.stopped[0] == 5
    # the first group closes at the next group: a later batch's group id 0 gets no free pass
    batches = Budget(max_call_s=0.1)
    assert batches.admit(0, 0.01, 0.02) and batches.admit(1, 0.01, 0.02)
    assert batches.call_limit_s(0) == 0.1 and not batches.admit(0, 0.5, 1.0)


def test_time_rounds_within_a_budget_drops_the_rest_and_the_stopped_group():
    """Operations in order of cost: the walk stops at the first over the call budget after two
    calls of it (not its 3 warm-ups; the second confirms the first was no one-off cost); it, every
    later one, and the earlier operations of its group get None and are never timed in a round."""
    from profiler.timing import Budget, time_rounds

    calls = {name: 0 for name in "abcde"}

    def op(name: str, seconds: float):
        def run() -> None:
            calls[name] += 1
            time.sleep(seconds)
        return run

    fns = [op("a", 0.001), op("b", 0.002), op("c", 0.003), op("d", 0.15), op("e", 0.001)]
    budget = Budget(max_call_s=0.05)  # 17x and more around the fast calls: CI hosts oversleep
    results = time_rounds(fns, device=CPU, warmup=3, trials=3, budget=budget, groups=[0, 1, 2, 2, 3])
    assert [r is not None for r in results] == [True, True, False, False, False]
    assert budget.stopped is not None and budget.stopped[0] == 2 and budget.stopped[1] >= 0.15
    assert calls == {"a": 6, "b": 6, "c": 3, "d": 2, "e": 0}  # c: its warm-ups only; d: two calls; e never ran
    assert all(len(r.trials) == 3 for r in results[:2])
    # a walk whose first operation is over the call budget still times it (a table is never empty)
    slow_first = time_rounds([op("a", 0.08), op("b", 0.001)], device=CPU, warmup=1, trials=2,
                             budget=Budget(max_call_s=0.05))
    assert slow_first[0] is not None and len(slow_first[0].trials) == 2
    # a walk whose first group is a forward and its backward keeps both, the backward however slow
    pair = time_rounds([op("a", 0.001), op("b", 0.08), op("c", 0.001)], device=CPU, warmup=1, trials=2,
                       budget=Budget(max_call_s=0.05), groups=[0, 0, 1])
    assert [r is not None for r in pair] == [True, True, True]
    # a first call slowed by a one-off cost (lazy initialisation) does not stop the walk: a second,
    # fast call clears it
    first_calls = {"n": 0}

    def lazy() -> None:
        first_calls["n"] += 1
        time.sleep(0.15 if first_calls["n"] == 1 else 0.001)

    lazy_budget = Budget(max_call_s=0.05)
    cleared = time_rounds([op("a", 0.001), lazy, op("b", 0.001)], device=CPU, warmup=1, trials=2, budget=lazy_budget)
    assert [r is not None for r in cleared] == [True, True, True] and lazy_budget.stopped is None
    assert cleared[1].median_s < 0.05


def test_measure_compute_walks_each_precision_in_order_of_flops_within_the_budget():
    """A call budget between the small and the large GEMM's time: in each precision's table the
    walk keeps the shapes below it and stops at the first above, whatever the grid's order, and a
    note says where (the planner prices the rest at the nearest measured rate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(768, 768)
        single = min(time_fn(lambda: x @ x, device=CPU, warmup=1, trials=3).trials)
        grid = ComputeGrid(gemm=[(768, 768, 768, GemmLayout.nn), (32, 32, 32, GemmLayout.nn),
                                 (64, 64, 64, GemmLayout.nn)],
                           attention=[], elementwise_bytes=[],
                           precisions=[Precision.fp32], warmup=1, trials=2, min_time_s=0.0, max_call_s=single / 8)
        compute = measure_compute(CPU, grid)
    finally:
        torch.set_num_threads(threads)
    assert sorted((g.m, g.n, g.k) for g in compute.gemm) == [(32, 32, 32), (64, 64, 64)]
    (note,) = grid.notes
    assert note.startswith("fp32 nn GEMMs: 2 of 3 shapes measured, in order of FLOPs; the walk stopped at 768x768x768 ")
    assert "64x64x64, ran at" in note


def test_each_gemm_layout_walks_on_its_own_share_of_the_budget(monkeypatch):
    """A layout whose calls are over the call budget stops its own walk only: the others are measured
    (on an AVX2 CPU torch's bf16 fallback runs nn 3-16x slower than nt and tn)."""
    import profiler.compute as compute

    def fake(m, n, k, precision, device, layout=GemmLayout.nn):  # noqa: ANN001, ANN202
        # margins of 3x and 300x around the call budget: a loaded CI host oversleeps by milliseconds
        return lambda: time.sleep(0.09 if layout is GemmLayout.nn else 0.0001)

    monkeypatch.setattr(compute, "_gemm_fn", fake)
    grid = ComputeGrid(gemm=[(s, s, s, lay) for s in (16, 32, 64) for lay in GemmLayout], attention=[],
                       elementwise_bytes=[], precisions=[Precision.fp32], warmup=1, trials=2, max_call_s=0.03,
                       max_table_s=30.0)
    measured = measure_compute(CPU, grid)
    got = sorted((g.layout.value, g.m) for g in measured.gemm)
    assert got == [("nn", 16), ("nt", 16), ("nt", 32), ("nt", 64), ("tn", 16), ("tn", 32), ("tn", 64)]
    (note,) = grid.notes
    assert note.startswith("fp32 nn GEMMs: 1 of 3 shapes measured, in order of FLOPs; the walk stopped at 32x32x32 ")

    # the table budget is shared: three shapes of ~3 x 40 ms fit 0.6 s alone, one in a third of it
    # (0.6 s is 5 shapes' worth: room for a loaded host's oversleep; a slower host keeps fewer in the third)
    monkeypatch.setattr(compute, "_gemm_fn", lambda *a, **k: lambda: time.sleep(0.04))

    def walked(layouts: list[GemmLayout]) -> dict[GemmLayout, int]:
        g = ComputeGrid(gemm=[(s, s, s, lay) for s in (16, 32, 64) for lay in layouts], attention=[],
                        elementwise_bytes=[], precisions=[Precision.fp32], warmup=1, trials=2, max_table_s=0.6)
        points = measure_compute(CPU, g).gemm
        return {lay: sum(p.layout is lay for p in points) for lay in layouts}

    assert walked([GemmLayout.nt]) == {GemmLayout.nt: 3}
    assert walked(list(GemmLayout)) == {lay: 1 for lay in GemmLayout}


def test_default_grids_carry_a_time_budget_on_cpu_only():
    quick, full = default_grid(quick=True), default_grid()
    assert quick.max_call_s < full.max_call_s and quick.max_table_s < full.max_table_s
    gpu = default_grid(quick=True, device_type="cuda")
    assert gpu.max_call_s is None and gpu.max_table_s is None


@pytest.mark.parametrize("native", [False, True, None])
def test_a_cpu_without_native_bf16_says_so(monkeypatch, native):
    """Without oneDNN bf16 (an AVX2-only CPU) torch's bf16 matmul is an unoptimised fallback, 4-70x
    slower than fp32 by operand layout and shape: the profile notes it, with each layout's best rate."""
    import profiler.compute as compute

    monkeypatch.setattr(compute, "cpu_bf16_is_native", lambda: native)
    grid = ComputeGrid(gemm=[(32, 32, 32, lay) for lay in GemmLayout], attention=[], elementwise_bytes=[],
                       precisions=[Precision.fp32, Precision.bf16], warmup=1, trials=1)
    measure_compute(CPU, grid)
    notes = [n for n in grid.notes if n.startswith("bf16 on this CPU")]
    if native is False:
        (note,) = notes
        assert "unoptimised fallback" in note and "GFLOP/s against fp32's" in note
        # the best rate of each layout, in a linear layer's order
        at = [note.find(r) for r in ("forward X·Wᵀ (nt) ", "input grad dY·W (nn) ", "weight grad dYᵀ·X (tn) ")]
        assert all(i >= 0 for i in at) and at == sorted(at)
    else:
        assert not notes


def test_the_bf16_probe_answers_on_this_cpu():
    from profiler.compute import cpu_bf16_is_native

    assert cpu_bf16_is_native() in (True, False)  # torch 2.13 has the probe: not "unknown"


# ------------------------------------------------------------------ a GPU's DeviceSpec: datasheet peaks


@pytest.mark.parametrize("cuda_name, key", [
    ("NVIDIA H200", "hgx-h200"), ("NVIDIA H100 80GB HBM3", "dgx-h100"), ("NVIDIA A100-SXM4-40GB", "dgx-a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "dgx-a100-80gb"), ("NVIDIA B200", "dgx-b200"), ("NVIDIA H800", "hgx-h800"),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA L40S", None),
    ("NVIDIA H100 96GB HBM2e", "gt-h100-96gb-500w"), ("NVIDIA A100 80GB PCIe", None),
    # other chips whose names contain a listed number, and MIG slices of listed ones
    ("NVIDIA GH200 480GB", None), ("NVIDIA GB200", None), ("NVIDIA RTX A1000", None), ("NVIDIA A100X", None),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", None),
])
def test_datasheet_for_matches_sxm_parts_only(cuda_name, key):
    from planner.reference import datasheet_for

    found = datasheet_for(cuda_name)
    assert (found[0] if found else None) == key
    if found:
        assert found[1].peak_tflops == reference_profile(key).device.peak_tflops


def _fake_cuda_props(monkeypatch, name: str) -> None:
    class Props:
        total_memory = 150_000_000_000
        multi_processor_count = 132

    Props.name = name
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())


def test_gpu_device_spec_takes_datasheet_peaks_and_says_what_was_reached(monkeypatch):
    from profiler.identity import device_spec

    _fake_cuda_props(monkeypatch, "NVIDIA H200")
    compute = ComputeProfile(achieved_matmul_tflops={Precision.bf16: 742.0, Precision.fp32: 51.0},
                             achieved_memory_bandwidth_bytes_per_s=4.1e12)
    spec, notes = device_spec(torch.device("cuda", 0), compute, 1)
    assert spec.peak_tflops[Precision.bf16] == pytest.approx(989.0)  # hardware.csv's H200, not the 742 reached
    assert spec.peak_tflops[Precision.fp32] == 51.0  # run without TF32: the datasheet's fp32 entry is TF32's
    assert Precision.fp8 not in spec.peak_tflops  # not measured: the planner's FP8 gate stays shut
    assert "fp32 (without TF32) reached 51" in notes[0]
    assert spec.hbm_bandwidth_bytes_per_s == pytest.approx(4.1e12)  # measured: what memory-bound work gets
    assert spec.sm_count == 132 and spec.memory_bytes == 150_000_000_000
    assert "bf16 GEMM 742 TFLOP/s = 75% of 989" in notes[0] and "4.1 TB/s = 85% of 4.8" in notes[0]


def test_gpu_device_spec_takes_the_fp8_peak_where_fp8_ran(monkeypatch):
    from profiler.identity import device_spec

    _fake_cuda_props(monkeypatch, "NVIDIA H200")
    compute = ComputeProfile(achieved_matmul_tflops={Precision.bf16: 736.0, Precision.fp8: 1384.0},
                             achieved_memory_bandwidth_bytes_per_s=4.34e12)
    spec, notes = device_spec(torch.device("cuda", 0), compute, 1)
    assert spec.peak_tflops[Precision.fp8] == pytest.approx(2 * 989.0)
    assert Precision.fp32 not in spec.peak_tflops
    assert "fp8 GEMM 1384 TFLOP/s = 70% of 1978" in notes[0]


def test_gpu_device_spec_without_a_datasheet_keeps_the_measured_rates(monkeypatch):
    from profiler.identity import device_spec

    _fake_cuda_props(monkeypatch, "NVIDIA H100 PCIe")  # 756 TFLOP/s datasheet, not the SXM's 989
    compute = ComputeProfile(achieved_matmul_tflops={Precision.bf16: 600.0},
                             achieved_memory_bandwidth_bytes_per_s=1.9e12)
    spec, notes = device_spec(torch.device("cuda", 0), compute, 1)
    assert spec.peak_tflops == {Precision.bf16: 600.0}
    assert "no datasheet" in notes[0]


# ------------------------------------------------------- CUDA timing: the GPU held while the host queues


def test_hold_only_where_the_host_is_about_as_slow_as_the_gpu():
    from profiler.timing import HOLD_MAX_S, hold_seconds

    # a 512³ bf16 GEMM on the H200 machine: ~14 µs to launch, a few µs to run
    assert hold_seconds(140, 14e-6, 3e-6) == pytest.approx(1.5 * 140 * 14e-6 + 50e-6)
    assert hold_seconds(3, 20e-6, 800e-6) == 0.0  # an 8192³ GEMM: the GPU stays ahead of the host anyway
    assert hold_seconds(10, 9e-6, 10e-6) == 0.0  # launched within the GPU's time: back to back already
    assert hold_seconds(10**6, 1e-3, 1e-6) == HOLD_MAX_S


def test_a_hold_that_ended_too_soon_is_lengthened_and_the_trial_run_again(monkeypatch):
    import profiler.timing as timing

    seen = []

    def fake(fn, calls, device, hold_s):  # (gpu, host queueing, held): the first hold ends before the host is done
        seen.append(hold_s)
        return (0.5e-3, 2e-3, hold_s) if len(seen) == 1 else (0.3e-3, 2e-3, hold_s)

    monkeypatch.setattr(timing, "_time_cuda", fake)
    assert timing._time_calls(lambda: None, 100, torch.device("cuda"), 1e-3) == 0.3e-3
    assert seen == [1e-3, pytest.approx(1.5 * 2e-3 + 50e-6)]
    seen.clear()
    assert timing._time_calls(lambda: None, 100, torch.device("cuda"), 0.0) == 0.5e-3  # no hold: one trial
    assert seen == [0.0]


def test_a_hold_that_never_outlasts_the_host_is_counted(monkeypatch):
    import profiler.timing as timing

    monkeypatch.setattr(timing, "_time_cuda", lambda fn, calls, device, hold_s: (1e-3, 5e-3, min(hold_s, 1e-3)))
    monkeypatch.setitem(timing.HOLD_STATS, "host_paced", 0)
    assert timing._time_calls(lambda: None, 100, torch.device("cuda"), 1e-3) == 1e-3
    assert timing.HOLD_STATS["host_paced"] == 1


@pytest.mark.parametrize("first, second, expected", [
    ((4e-3, 1e-3, 0.0), None, (400, 0.0)),  # the GPU is slower than the host: no hold, one look
    ((0.6e-3, 5.6e-3, 0.0), (0.3e-3, 3.6e-3, 5.4e-3), (256, 1.5 * 256 * 14e-6 + 50e-6)),  # host-paced: held
    ((30e-3, 30e-3, 0.0), (30e-3, 40e-3, 20e-3), (400, 0.0)),  # blocks behind the hold (it syncs): not held
])
def test_which_operations_are_held_and_with_how_many_calls(monkeypatch, first, second, expected):
    import profiler.timing as timing

    seen = []

    def fake(fn, calls, device, hold_s):
        seen.append((calls, hold_s))
        return first if len(seen) == 1 else second

    monkeypatch.setattr(timing, "_time_cuda", fake)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)
    calls, hold = timing._hold_for(lambda: None, 400, torch.device("cuda"))
    assert (calls, hold) == (expected[0], pytest.approx(expected[1]))
    assert len(seen) == (1 if second is None else 2)
    assert timing._hold_for(lambda: None, 400, torch.device("cpu")) == (400, 0.0)


def test_a_quick_profile_cuts_the_table_budget_to_the_time_the_links_left():
    """Compute runs after the links: its GEMM tables get what is left of the quick profile's minute,
    by the phase's cost model (per_table = (left - host copies - other tables) / (n x overrun)), never
    below the floor, never above the grid's own budget, the cut noted; a GPU grid (no budget) is left alone."""
    from profiler.compute import (
        GEMM_WALK_OVERRUN,
        MIN_QUICK_TABLE_S,
        QUICK_HOST_COPIES_S,
        QUICK_OTHER_TABLES_S,
        fit_table_budget,
    )

    roomy = default_grid(quick=True)
    fit_table_budget(roomy, 120.0)
    assert roomy.max_table_s == 6.0 and not roomy.notes

    grid = default_grid(quick=True)
    n = len(grid.precisions)
    left = QUICK_HOST_COPIES_S + n * QUICK_OTHER_TABLES_S + n * GEMM_WALK_OVERRUN * 3.0  # room for 3 s tables
    fit_table_budget(grid, left)
    assert grid.max_table_s == pytest.approx(3.0)
    (note,) = grid.notes
    assert note.startswith(f"QUICK DEADLINE: {left:.0f} s were left for compute") and "from 6 s to 3.0 s" in note

    late = default_grid(quick=True)
    fit_table_budget(late, -5.0)
    assert late.notes[0].startswith("QUICK DEADLINE: 0 s were left") and late.max_table_s == MIN_QUICK_TABLE_S

    gpu = default_grid(quick=True, device_type="cuda")
    fit_table_budget(gpu, 1.0)
    assert gpu.max_table_s is None and not gpu.notes

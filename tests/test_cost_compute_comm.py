"""Operator times (planner/cost/compute.py) and communication (planner/cost/comm.py) by hand.

The toy profile makes the arithmetic easy: 100 TFLOP/s bf16, 1e12 B/s HBM, every efficiency 1, no
K overhead, no wave quantisation (sm_count=None), so a GEMM takes ``max(2mnk / 1e14, bytes / 1e12)``.
"""

from __future__ import annotations

import pytest

from planner.contracts import (
    Assumptions,
    AttentionBlocking,
    AttentionPoint,
    ClusterProfile,
    Collective,
    ComputeProfile,
    DeviceSpec,
    ElementwisePoint,
    GemmLayout,
    GemmPoint,
    LinkLevel,
    LinkProfile,
    ParallelLayout,
    Precision,
)
from planner.cost.comm import (
    GroupPlacement,
    collective_time_s,
    find_link,
    hidden_time_s,
    host_copy_time_s,
    mesh_groups,
    placement,
    ring_factor,
)
from planner.cost.compute import (
    attention_time_s,
    causal_work_fraction,
    cross_entropy_bytes,
    elementwise_time_s,
    gemm_fwd_bwd_s,
    gemm_time_s,
    k_efficiency,
    linear_gemms_s,
    memory_time_s,
    peak_flops,
    wave_efficiency,
)
from planner.reference import reference_profile

INTRA_ALPHA, INTER_ALPHA, HOST_ALPHA = 1e-5, 2e-5, 1e-5


def toy_links(intra_busbw: float = 100e9, inter_busbw: float = 10e9) -> list[LinkProfile]:
    """All-reduce entries only (every other collective falls back to them) plus host copies."""
    return [
        LinkProfile(level=LinkLevel.intra_node, collective=Collective.all_reduce, alpha_s=INTRA_ALPHA,
                    busbw_bytes_per_s=intra_busbw),
        LinkProfile(level=LinkLevel.inter_node, collective=Collective.all_reduce, alpha_s=INTER_ALPHA,
                    busbw_bytes_per_s=inter_busbw),
        LinkProfile(level=LinkLevel.host_device, collective=Collective.host_to_device, alpha_s=HOST_ALPHA,
                    busbw_bytes_per_s=20e9),
        LinkProfile(level=LinkLevel.host_device, collective=Collective.device_to_host, alpha_s=HOST_ALPHA,
                    busbw_bytes_per_s=10e9),
    ]


def toy_profile(*, nodes: int = 1, sm_count: int | None = None, links: list[LinkProfile] | None = None,
                peaks: dict | None = None, compute: ComputeProfile | None = None, **assume) -> ClusterProfile:
    values = dict(matmul_efficiency=1.0, fp8_matmul_efficiency=1.0, attention_efficiency=0.5,
                  memory_bandwidth_efficiency=1.0, gemm_k_overhead=0.0, kernel_overhead_s=0.0,
                  gemm_tiles=[(128, 128)])
    values.update(assume)
    return ClusterProfile(
        kind="reference", name="toy",
        device=DeviceSpec(name="toy-gpu", memory_bytes=80 * 2**30, hbm_bandwidth_bytes_per_s=1e12, sm_count=sm_count,
                          peak_tflops=peaks or {Precision.bf16: 100.0, Precision.fp16: 100.0}),
        gpus_per_node=8, num_nodes=nodes, links=toy_links() if links is None else links,
        assumptions=Assumptions(**values), compute=compute or ComputeProfile(),
    )


# ============================================================================================
# compute.py
# ============================================================================================
class TestPeakAndMemory:
    def test_peak(self):
        assert peak_flops(toy_profile(), Precision.bf16) == 100e12

    def test_fp32_falls_back_to_half_16bit_peak(self):
        assert peak_flops(toy_profile(), Precision.fp32) == 50e12

    def test_fp8_falls_back_to_16bit_peak_when_absent(self):
        assert peak_flops(toy_profile(), Precision.fp8) == 100e12

    def test_fp8_listed(self):
        p = toy_profile(peaks={Precision.bf16: 100.0, Precision.fp8: 200.0})
        assert peak_flops(p, Precision.fp8) == 200e12

    def test_memory_time(self):
        # bytes / (hbm * efficiency) = 1e9 / (1e12 * 0.5)
        assert memory_time_s(toy_profile(memory_bandwidth_efficiency=0.5), 1e9) == pytest.approx(2e-3)

    def test_memory_time_uses_measured_bandwidth(self):
        p = toy_profile(memory_bandwidth_efficiency=0.5,
                        compute=ComputeProfile(achieved_memory_bandwidth_bytes_per_s=4e11))
        assert memory_time_s(p, 1e9) == pytest.approx(1e9 / 4e11)


class TestElementwiseTable:
    """Bandwidth-bound ops at their own measured rates (ComputeProfile.elementwise)."""

    @staticmethod
    def table(*points: tuple[str, Precision, int, float]) -> ClusterProfile:
        return toy_profile(compute=ComputeProfile(
            achieved_memory_bandwidth_bytes_per_s=4e11,
            elementwise=[ElementwisePoint(op=op, precision=p, bytes=b, time_s=t) for op, p, b, t in points]))

    def test_a_measured_size_is_its_time_and_between_sizes_the_rate_is_log_interpolated(self):
        # rmsnorm: 1e11 B/s at 1 MB, 4e11 at 100 MB; at 10 MB (halfway in log size) 2e11 B/s
        p = self.table(("rmsnorm", Precision.bf16, 10**6, 1e-5), ("rmsnorm", Precision.bf16, 10**8, 2.5e-4))
        assert elementwise_time_s(p, "rmsnorm", 10**6, Precision.bf16) == pytest.approx(1e-5)
        assert elementwise_time_s(p, "rmsnorm", 10**7, Precision.bf16) == pytest.approx(1e7 / 2e11)
        # beyond the table: its end points' rates, not the memory bandwidth
        assert elementwise_time_s(p, "rmsnorm", 10**9, Precision.bf16) == pytest.approx(1e9 / 4e11)
        assert elementwise_time_s(p, "rmsnorm", 10**5, Precision.bf16) == pytest.approx(1e5 / 1e11)

    def test_a_small_point_faster_than_the_largest_is_held_at_the_largest_rate(self):
        # in cache on a CPU: 8e11 B/s at 1 MB, 4e11 at 100 MB; a step's activations are not cache-hot
        p = self.table(("add", Precision.fp32, 10**6, 1.25e-6), ("add", Precision.fp32, 10**8, 2.5e-4))
        assert elementwise_time_s(p, "add", 10**6, Precision.fp32) == pytest.approx(1e6 / 4e11)
        assert elementwise_time_s(p, "add", 10**7, Precision.fp32) == pytest.approx(1e7 / 4e11)

    def test_another_precision_of_the_op_before_the_bandwidth(self):
        p = self.table(("silu_mul", Precision.fp32, 10**8, 1e-3), ("silu_mul", Precision.fp16, 10**8, 5e-4))
        # bf16: the other 2-byte precision's rate (2e11), not fp32's (1e11) or the add's 4e11
        assert elementwise_time_s(p, "silu_mul", 10**8, Precision.bf16) == pytest.approx(5e-4)
        assert elementwise_time_s(p, "silu_mul", 10**8, Precision.fp32) == pytest.approx(1e-3)
        # an op with no points: the achieved memory bandwidth
        assert elementwise_time_s(p, "rmsnorm", 10**8, Precision.bf16) == pytest.approx(1e8 / 4e11)
        assert elementwise_time_s(p, "rmsnorm", 0, Precision.bf16) == 0.0

    def test_a_block_prices_its_norms_and_activation_from_the_table(self):
        from planner.contracts import ModelSpec
        from planner.cost.layer import MicroBatch, block_cost, lm_head_cost

        model = ModelSpec(name="m", num_layers=2, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096,
                          vocab_size=32000)
        mb = MicroBatch(1, 1024, 1, 1, False, Precision.bf16, True)
        layout = ParallelLayout()
        groups = mesh_groups(layout, 8)
        plain = toy_profile(compute=ComputeProfile(achieved_memory_bandwidth_bytes_per_s=4e11))
        # every op measured at the add's 4e11 B/s: the same price as from the bandwidth alone
        same = self.table(*[(op, Precision.bf16, 10**7, 1e7 / 4e11)
                            for op in ("rmsnorm", "silu_mul", "add", "softmax_cross_entropy")])
        base = block_cost(plain, model, 0, mb, layout, groups).forward.memory_s
        assert block_cost(same, model, 0, mb, layout, groups).forward.memory_s == pytest.approx(base)
        # norms (2 x 2E of bf16) and the SwiGLU product (3 x tokens x ffn x 2 bytes) at half the rate
        slow = self.table(("rmsnorm", Precision.bf16, 10**7, 1e7 / 2e11),
                          ("silu_mul", Precision.bf16, 10**7, 1e7 / 2e11),
                          ("add", Precision.bf16, 10**7, 1e7 / 4e11))
        E = 1024 * 1024
        extra = (2 * 2 * 2 * E + 3 * 2 * 1024 * 4096) / 4e11  # their bytes once more at 4e11 B/s
        assert block_cost(slow, model, 0, mb, layout, groups).forward.memory_s == pytest.approx(base + extra)
        # each norm is its own kernel, priced at its own size's rate (not the two norms' bytes as one
        # bigger, faster kernel): 1e11 B/s at 1 MB, 4e11 at 100 MB, log-interpolated between
        sized = self.table(("rmsnorm", Precision.bf16, 10**6, 1e-5), ("rmsnorm", Precision.bf16, 10**8, 2.5e-4))
        one = elementwise_time_s(sized, "rmsnorm", 2 * 2 * E, Precision.bf16)
        assert one > elementwise_time_s(sized, "rmsnorm", 2 * 2 * 2 * E, Precision.bf16) / 2
        assert block_cost(sized, model, 0, mb, layout, groups).forward.memory_s == pytest.approx(
            base - 2 * 2 * 2 * E / 4e11 + 2 * one)
        # the loss: logits at the softmax_cross_entropy rate (14 bytes per bf16 logit forward)
        ce = self.table(("softmax_cross_entropy", Precision.bf16, 10**8, 10**8 / 1e11))
        head = lm_head_cost(ce, model, mb, groups)[0].memory_s
        norm = 2 * 2 * E / 4e11
        assert head == pytest.approx(norm + cross_entropy_bytes(1024 * 32000, 2) / 1e11)
        assert cross_entropy_bytes(1, 2) == 14 and cross_entropy_bytes(1, 4) == 8


class TestSiblingPrecision:
    """A 16-bit precision with no table of its own is priced from the other 16-bit one's points."""

    @staticmethod
    def measured(peaks: dict) -> ClusterProfile:
        gemm = [GemmPoint(precision=Precision.bf16, m=s, n=s, k=s, layout=GemmLayout.nn, time_s=2 * s**3 / 50e12)
                for s in (1024, 2048)]
        attention = [AttentionPoint(precision=Precision.bf16, batch=1, seq_length=s, num_heads=8, num_kv_heads=8,
                                    head_dim=64, forward_time_s=1e-3 * s / 1024, backward_time_s=2.5e-3 * s / 1024)
                     for s in (1024, 2048)]
        return toy_profile(peaks=peaks, compute=ComputeProfile(gemm=gemm, attention=attention))

    def test_fp16_from_bf16_points_at_the_datasheet_ratio(self):
        same = self.measured({Precision.bf16: 100.0, Precision.fp16: 100.0})
        bf16 = gemm_time_s(same, 1024, 1024, 1024, Precision.bf16)
        assert bf16 == pytest.approx(2 * 1024**3 / 50e12)
        assert gemm_time_s(same, 1024, 1024, 1024, Precision.fp16) == pytest.approx(bf16)
        # not the roofline (100 TFLOP/s at efficiency 1 would be twice as fast as measured)
        half = self.measured({Precision.bf16: 100.0, Precision.fp16: 50.0})
        assert gemm_time_s(half, 1024, 1024, 1024, Precision.fp16) == pytest.approx(2 * bf16)
        # fp32 has no 16-bit sibling: the roofline, at half the bf16 peak (TF32) and efficiency 0.5 (the
        # bf16 points' own 50 TFLOP/s would give half this)
        roof = self.measured({Precision.bf16: 100.0, Precision.fp16: 100.0}).model_copy(
            update={"assumptions": same.assumptions.model_copy(update={"matmul_efficiency": 0.5})})
        assert gemm_time_s(roof, 1024, 1024, 1024, Precision.fp32) == pytest.approx(2 * 1024**3 / 25e12)
        # a CPU profile keeps the roofline for fp16: its fp16 matmul shares no kernel with bf16
        cpu = same.model_copy(update={"device": same.device.model_copy(update={"name": "CPU: toy"})})
        assert gemm_time_s(cpu, 1024, 1024, 1024, Precision.fp16) == pytest.approx(2 * 1024**3 / 100e12)

    def test_attention_of_fp16_and_fp8_from_bf16_points(self):
        p = self.measured({Precision.bf16: 100.0, Precision.fp16: 100.0})
        kw = dict(batch=1, q_len=1024, kv_len=1024, heads=8, kv_heads=8, qk_dim=64, v_dim=64, causal=True, flash=True)
        bf16 = attention_time_s(p, precision=Precision.bf16, **kw)
        assert bf16 == pytest.approx((1e-3, 2.5e-3))
        assert attention_time_s(p, precision=Precision.fp16, **kw) == pytest.approx(bf16)
        # FP8 recipes: 16-bit attention
        assert attention_time_s(p, precision=Precision.fp8, **kw) == pytest.approx(bf16)


class TestWaveAndK:
    def test_no_sm_count_means_no_waves(self):
        assert wave_efficiency(100, 100, None, ((128, 128),)) == 1.0

    def test_full_single_wave(self):
        # 256x256 in 128x128 tiles = 2*2 = 4 tiles on 4 SMs: 1 wave, all slots used
        assert wave_efficiency(256, 256, 4, ((128, 128),)) == 1.0

    def test_partial_last_wave(self):
        # 384x128 = 3 tiles on 2 SMs -> 2 waves: 384*128 / (2 waves * 2 SMs * 128*128) = 0.75
        assert wave_efficiency(384, 128, 2, ((128, 128),)) == pytest.approx(0.75)

    def test_partial_tile(self):
        # 192x128 -> ceil(192/128)=2 tiles on 1 SM: 192*128 / (2 * 1 * 128*128) = 0.75
        assert wave_efficiency(192, 128, 1, ((128, 128),)) == pytest.approx(0.75)

    def test_best_tile_wins(self):
        # 256x128 on 4 SMs: 128x128 tiles -> 2 tiles, 1 wave: 32768/(4*16384) = 0.5;
        # 256x128 tiles -> 1 tile: 32768/(4*32768) = 0.25. Best is 0.5.
        assert wave_efficiency(256, 128, 4, ((256, 128), (128, 128))) == pytest.approx(0.5)

    def test_many_waves(self):
        # 4096x4096 / 128x128 = 1024 tiles on 108 SMs -> ceil(1024/108) = 10 waves
        assert wave_efficiency(4096, 4096, 108, ((128, 128),)) == pytest.approx(
            4096 * 4096 / (10 * 108 * 128 * 128))

    def test_k_efficiency(self):
        assert k_efficiency(256, 256.0) == 0.5  # K/(K+K0)
        assert k_efficiency(768, 256.0) == 0.75
        assert k_efficiency(100, 0.0) == 1.0


class TestGemm:
    def test_compute_bound(self):
        # 2*4096^3 FLOPs at 1e14 FLOP/s; traffic 2*(2*4096^2) + 2*4096^2 = 6*4096^2 B = 1.0e-4 s
        flops_s = 2 * 4096**3 / 100e12  # 1.374e-3 s
        traffic_s = 6 * 4096**2 / 1e12
        assert flops_s > traffic_s
        assert gemm_time_s(toy_profile(), 4096, 4096, 4096, Precision.bf16) == pytest.approx(flops_s)

    def test_count_multiplies(self):
        assert gemm_time_s(toy_profile(), 4096, 4096, 4096, Precision.bf16, count=3) == pytest.approx(
            3 * 2 * 4096**3 / 100e12)

    def test_memory_bound(self):
        # m=n=4096, k=8: 2*4096*4096*8 FLOPs = 2.7e-6 s; bytes 2*(4096*8 + 8*4096) + 2*4096*4096
        flops_s = 2 * 4096 * 4096 * 8 / 100e12
        traffic_s = (2 * (4096 * 8 + 8 * 4096) + 2 * 4096 * 4096) / 1e12  # 33,685,504 B
        assert traffic_s > flops_s
        assert gemm_time_s(toy_profile(), 4096, 4096, 8, Precision.bf16) == pytest.approx(traffic_s)

    def test_matmul_efficiency(self):
        p = toy_profile(matmul_efficiency=0.5)
        assert gemm_time_s(p, 4096, 4096, 4096, Precision.bf16) == pytest.approx(2 * 4096**3 / (100e12 * 0.5))

    def test_k_overhead(self):
        # K0 = K = 4096 -> K/(K+K0) = 1/2
        p = toy_profile(gemm_k_overhead=4096.0)
        assert gemm_time_s(p, 4096, 4096, 4096, Precision.bf16) == pytest.approx(2 * 2 * 4096**3 / 100e12)

    def test_wave_quantisation(self):
        # 384x128 on 2 SMs, 128x128 tiles -> waves 0.75; K large enough to stay compute-bound
        p = toy_profile(sm_count=2)
        m, n, k = 384, 128, 65536
        flops_s = 2 * m * n * k / (100e12 * 0.75)  # 8.59e-5 s
        traffic_s = (2 * (m * k + k * n) + 2 * m * n) / 1e12  # 6.72e-5 s
        assert flops_s > traffic_s
        assert gemm_time_s(p, m, n, k, Precision.bf16) == pytest.approx(flops_s)

    def test_fp8_compute_bound(self):
        p = toy_profile(peaks={Precision.bf16: 100.0, Precision.fp8: 200.0}, fp8_matmul_efficiency=0.5)
        # 2*4096^3 at 200e12 * 0.5
        assert gemm_time_s(p, 4096, 4096, 4096, Precision.fp8) == pytest.approx(2 * 4096**3 / 100e12)

    def test_fp8_memory_bound_reads_one_byte_inputs(self):
        p = toy_profile(peaks={Precision.bf16: 100.0, Precision.fp8: 200.0})
        # inputs 1 byte each, output 2 bytes: 1*(4096*8 + 8*4096) + 2*4096*4096
        expected = (65536 + 2 * 4096 * 4096) / 1e12
        assert gemm_time_s(p, 4096, 4096, 8, Precision.fp8) == pytest.approx(expected)

    def test_fp32_compute_bound(self):
        # fp32 has no peak listed: 100/2 = 50 TFLOP/s
        assert gemm_time_s(toy_profile(), 4096, 4096, 4096, Precision.fp32) == pytest.approx(2 * 4096**3 / 50e12)

    def test_empty(self):
        assert gemm_time_s(toy_profile(), 0, 4096, 4096, Precision.bf16) == 0.0
        assert gemm_time_s(toy_profile(), 4096, 4096, 4096, Precision.bf16, count=0) == 0.0

    def test_measured_table_exact_point(self):
        table = ComputeProfile(gemm=[GemmPoint(precision=Precision.bf16, m=1024, n=1024, k=1024, time_s=1e-4)])
        p = toy_profile(compute=table)
        assert gemm_time_s(p, 1024, 1024, 1024, Precision.bf16) == pytest.approx(1e-4)

    def test_measured_table_single_point_scales_by_flops(self):
        # the achieved rate 2*1024^3 / 1e-4 applies to a (2048 x 1024 x 1024) GEMM: twice the FLOPs
        table = ComputeProfile(gemm=[GemmPoint(precision=Precision.bf16, m=1024, n=1024, k=1024, time_s=1e-4)])
        p = toy_profile(compute=table)
        assert gemm_time_s(p, 2048, 1024, 1024, Precision.bf16) == pytest.approx(2e-4)

    def test_each_linear_gemm_priced_from_its_layouts_table(self):
        """Forward from the nt points, input gradient from nn, weight gradient from tn: torch's CPU
        bf16 fallback ran nn 3-16x slower than the others on an AVX2 VM, so one table cannot stand
        for all three."""
        rates = {GemmLayout.nt: 10e9, GemmLayout.nn: 1e9, GemmLayout.tn: 20e9}
        pts = [GemmPoint(precision=Precision.bf16, m=s, n=s, k=s, layout=lay, time_s=2 * s**3 / r)
               for lay, r in rates.items() for s in (256, 512)]
        p = toy_profile(compute=ComputeProfile(gemm=pts))
        for lay, r in rates.items():
            assert gemm_time_s(p, 384, 384, 384, Precision.bf16, layout=lay) == pytest.approx(2 * 384**3 / r)
        fwd, bwd = gemm_fwd_bwd_s(p, 512, 256, 384, Precision.bf16)  # Y[512x256] = X[512x384]·W
        flops = 2 * 512 * 256 * 384
        assert fwd == pytest.approx(flops / 10e9)
        assert bwd == pytest.approx(flops / 1e9 + flops / 20e9)

    def test_a_missing_layout_is_priced_from_one_other_layout_never_a_mix(self):
        # a walk stopped before any tn point: the weight gradient from the nn points alone
        pts = [GemmPoint(precision=Precision.bf16, m=512, n=512, k=512, layout=lay, time_s=2 * 512**3 / r)
               for lay, r in ((GemmLayout.nt, 10e9), (GemmLayout.nn, 1e9))]
        p = toy_profile(compute=ComputeProfile(gemm=pts))
        assert gemm_time_s(p, 512, 512, 512, Precision.bf16, layout=GemmLayout.tn) == pytest.approx(2 * 512**3 / 1e9)
        # FP8 points are all nt, timed at each linear GEMM's own shape: each priced from its own point
        tokens, out_f, in_f = 4096, 1024, 512
        times = {(tokens, out_f, in_f): 1e-4, (tokens, in_f, out_f): 2e-4, (out_f, in_f, tokens): 3e-4}
        fp8 = [GemmPoint(precision=Precision.fp8, m=m, n=n, k=k, layout=GemmLayout.nt, time_s=t)
               for (m, n, k), t in times.items()]
        p = toy_profile(compute=ComputeProfile(gemm=fp8), peaks={Precision.bf16: 100.0, Precision.fp8: 200.0})
        assert linear_gemms_s(p, tokens, out_f, in_f, Precision.fp8) == pytest.approx((1e-4, 2e-4, 3e-4))

    def test_an_older_model_grid_profile_prices_a_linear_layer_from_its_own_points(self):
        """Profiles before layouts timed a linear's weight gradient as (in, out, tokens) nn: the
        planner still hits those points exactly (the transposed product is the same work)."""
        tokens, out_f, in_f = 256, 512, 128
        times = {(tokens, out_f, in_f): 1e-4, (tokens, in_f, out_f): 2e-4, (in_f, out_f, tokens): 3e-4}
        pts = [GemmPoint(precision=Precision.bf16, m=m, n=n, k=k, time_s=t) for (m, n, k), t in times.items()]
        p = toy_profile(compute=ComputeProfile(gemm=pts))
        assert gemm_fwd_bwd_s(p, tokens, out_f, in_f, Precision.bf16) == pytest.approx((1e-4, 5e-4))

    def test_a_table_of_one_layout_stands_for_every_layout(self):
        # profiles measured before GemmPoint.layout timed every GEMM as nn
        table = ComputeProfile(gemm=[GemmPoint(precision=Precision.bf16, m=1024, n=1024, k=1024, time_s=1e-4)])
        assert table.gemm[0].layout is GemmLayout.nn
        p = toy_profile(compute=table)
        fwd, bwd = gemm_fwd_bwd_s(p, 1024, 1024, 1024, Precision.bf16)
        assert fwd == pytest.approx(1e-4) and bwd == pytest.approx(2e-4)


class TestAttention:
    def test_causal_work_fraction(self):
        assert causal_work_fraction(2048) == pytest.approx((2048 + 128) / (2 * 2048))  # 0.53125
        assert causal_work_fraction(128) == 1.0  # (128+128)/256
        assert causal_work_fraction(64) == 1.0  # capped
        assert causal_work_fraction(1024, block=64) == pytest.approx(1088 / 2048)

    def _flash(self, profile, **kw):
        args = dict(batch=1, q_len=2048, kv_len=2048, heads=16, kv_heads=16, qk_dim=64, v_dim=64,
                    precision=Precision.bf16, causal=True, flash=True)
        args.update(kw)
        return attention_time_s(profile, **args)

    def test_flash_causal(self):
        # flops 2*b*q*kv*a*(d_qk+d_v) = 2*1*2048*2048*16*128; causal fraction 0.53125;
        # rate peak * attention_efficiency = 100e12 * 0.5
        flops = 2 * 1 * 2048 * 2048 * 16 * 128
        fwd = flops * 0.53125 / 50e12
        f, b = self._flash(toy_profile())
        assert f == pytest.approx(fwd)  # 1.8254e-4 s
        assert b == pytest.approx(2.5 * fwd)

    def test_flash_non_causal(self):
        flops = 2 * 2 * 1024 * 1024 * 8 * (128 + 64)
        f, b = self._flash(toy_profile(), batch=2, q_len=1024, kv_len=1024, heads=8, qk_dim=128, v_dim=64,
                           causal=False)
        assert f == pytest.approx(flops / 50e12)
        assert b == pytest.approx(2.5 * flops / 50e12)

    def test_flash_causal_with_context_parallel_halves(self):
        # q_len != kv_len (CP chunk): causal fraction 1/2
        flops = 2 * 1 * 512 * 2048 * 16 * 128
        f, _ = self._flash(toy_profile(), q_len=512)
        assert f == pytest.approx(flops * 0.5 / 50e12)

    def test_flash_fp8_runs_at_16bit_rate(self):
        p = toy_profile(peaks={Precision.bf16: 100.0, Precision.fp8: 200.0})
        assert self._flash(p, precision=Precision.fp8) == pytest.approx(self._flash(p))
        flops = 2 * 1 * 2048 * 2048 * 16 * 128
        assert self._flash(p, precision=Precision.fp8)[0] == pytest.approx(flops * 0.53125 / 50e12)

    def test_unfused(self):
        # b=1, q=kv=256, 2 heads, d=64, bf16.
        # QK^T: one GEMM m=q*b*a=512, n=kv=256, k=64: flops 2*512*256*64 = 1.68e-7 s,
        #   bytes 2*(512*64 + 64*256) + 2*512*256 = 360448 -> 3.60448e-7 s (memory bound)
        qk = max(2 * 512 * 256 * 64 / 100e12, (2 * (512 * 64 + 64 * 256) + 2 * 512 * 256) / 1e12)
        # PV: m=512, n=d_v=64, k=kv=256: same FLOPs, bytes 2*(512*256 + 256*64) + 2*512*64 = 360448
        pv = max(2 * 512 * 64 * 256 / 100e12, (2 * (512 * 256 + 256 * 64) + 2 * 512 * 64) / 1e12)
        assert qk == pv == pytest.approx(3.60448e-7)
        scores = 1 * 2 * 256 * 256  # b*a*q*kv = 131072
        fwd = qk + pv + 9 * scores / 1e12  # 9 bytes per score forward
        bwd = 2 * (qk + pv) + 11 * scores / 1e12  # 11 bytes per score backward
        f, b = attention_time_s(toy_profile(), batch=1, q_len=256, kv_len=256, heads=2, kv_heads=2, qk_dim=64,
                                v_dim=64, precision=Precision.bf16, causal=True, flash=False)
        assert f == pytest.approx(fwd)  # 1.900544e-6
        assert b == pytest.approx(bwd)  # 2.883584e-6


class TestMeasuredAttentionBlocking:
    """A measured table with the kernel's tiling (torch's CPU flash kernel): rates on the computed
    tiles, interpolated only within a regime of query blocks."""

    CPU = [AttentionBlocking(from_q_len=0, q_block=32, kv_block=512),
           AttentionBlocking(from_q_len=192, q_block=64, kv_block=512),
           AttentionBlocking(from_q_len=768, q_block=256, kv_block=512)]

    def test_causal_tiles_by_hand(self):
        from planner.cost.compute import _causal_tiles

        assert _causal_tiles(512, 64, 512) == 512 * 512  # one key block: the mask saves nothing
        # 640 = 10 blocks of 64 rows: blocks 0-7 end by 512 and compute 512 keys, blocks 8-9 all 640
        assert _causal_tiles(640, 64, 512) == 8 * 64 * 512 + 2 * 64 * 640  # 344064
        # 2048 = 8 blocks of 256: key columns 512, 512, 1024, 1024, 1536, 1536, 2048, 2048
        assert _causal_tiles(2048, 256, 512) == 256 * 10240  # 2621440: 62.5% of 2048^2
        # 776: 3 whole blocks and 8 rows, which compute all 776 keys
        assert _causal_tiles(776, 256, 512) == 256 * (512 + 512 + 776) + 8 * 776

    def test_attention_work(self):
        from planner.cost.compute import _causal_tiles, attention_work

        assert attention_work(640, 640, True, []) == 640 * 640  # no tiling known: every score
        assert attention_work(640, 640, False, self.CPU) == 640 * 640  # no mask: every score
        assert attention_work(640, 640, True, self.CPU) == _causal_tiles(640, 64, 512)
        assert attention_work(1024, 1024, True, self.CPU) == _causal_tiles(1024, 256, 512)
        # a context-parallel share, masked by a tensor: every key block of its 512 queries is computed
        assert attention_work(512, 2048, True, self.CPU) == 512 * 2048

    @staticmethod
    def _point(s: int, fwd_rate: float, bwd_rate: float, blocking) -> AttentionPoint:
        from planner.cost.compute import attention_work

        flops = 4.0 * 8 * 64 * attention_work(s, s, True, blocking)  # 2·b·h·(d_qk + d_v)·tiles
        return AttentionPoint(precision=Precision.bf16, batch=1, seq_length=s, num_heads=8, num_kv_heads=8,
                              head_dim=64, forward_time_s=flops / fwd_rate, backward_time_s=flops / bwd_rate)

    def _profile(self, lengths_rates: dict[int, tuple[float, float]], blocking=None) -> ClusterProfile:
        blocking = self.CPU if blocking is None else blocking
        points = [self._point(s, f, b, blocking) for s, (f, b) in lengths_rates.items()]
        return toy_profile(compute=ComputeProfile(attention=points, attention_blocking=blocking))

    @staticmethod
    def _time(profile: ClusterProfile, q: int, kv: int | None = None) -> tuple[float, float]:
        return attention_time_s(profile, batch=1, q_len=q, kv_len=kv or q, heads=8, kv_heads=8, qk_dim=64, v_dim=64,
                                precision=Precision.bf16, causal=True, flash=True)

    def test_each_regime_priced_at_its_own_rates_on_the_computed_tiles(self):
        from planner.cost.compute import attention_work

        # regime of 64-row blocks at 70 / 30 GFLOP/s, regime of 256-row blocks at 80 / 40
        table = {256: (70e9, 30e9), 512: (70e9, 30e9), 1024: (80e9, 40e9), 2048: (80e9, 40e9)}
        prof = self._profile(table)
        for s, (rf, rb) in table.items():  # a measured point is its own measurement
            p = self._point(s, rf, rb, self.CPU)
            assert self._time(prof, s) == pytest.approx((p.forward_time_s, p.backward_time_s))
        # 640 and 767 sit between 512 and 1024 but run 64-row blocks: 70 / 30, not a mix with 80 / 40
        for s in (640, 767):
            work = 4.0 * 8 * 64 * attention_work(s, s, True, self.CPU)
            assert self._time(prof, s) == pytest.approx((work / 70e9, work / 30e9))
        work = 4.0 * 8 * 64 * attention_work(768, 768, True, self.CPU)
        assert self._time(prof, 768) == pytest.approx((work / 80e9, work / 40e9))
        # nothing measured below 192: the nearest measured regime's rates (256's), on 32-row tiles
        work = 4.0 * 8 * 64 * attention_work(128, 128, True, self.CPU)
        assert self._time(prof, 128) == pytest.approx((work / 70e9, work / 30e9))
        # context parallelism: 512 queries of a 2048 sequence, every score, at the 64-row regime's rates
        work = 4.0 * 8 * 64 * 512 * 2048
        assert self._time(prof, 512, 2048) == pytest.approx((work / 70e9, work / 30e9))

    def test_without_a_tiling_the_table_is_interpolated_on_every_score(self):
        # the same times read by a profile that does not know the tiling (a GPU profile's reading)
        timed = self._profile({512: (70e9, 30e9), 1024: (80e9, 40e9)})
        blind = toy_profile(compute=ComputeProfile(attention=timed.compute.attention))
        f512, f1024 = timed.compute.attention[0].forward_time_s, timed.compute.attention[1].forward_time_s
        assert self._time(blind, 512)[0] == pytest.approx(f512) and self._time(blind, 1024)[0] == pytest.approx(f1024)
        # in between: one rate from both ends on all q·kv scores, not the 64-row regime's own
        fwd = self._time(blind, 640)[0]
        assert fwd != pytest.approx(self._time(timed, 640)[0], rel=0.01)

    def test_a_cpu_profile_is_fitted_on_its_heads_whether_or_not_its_tiling_is_recorded(self):
        """K/V heads are a coordinate of a CPU fit (heads_coords), not of a GPU one (thread_block_coords):
        two points that differ only in K/V heads keep their own times on a CPU profile, even one that
        records no tiling, and are one rate on a GPU profile."""
        flops = 4.0 * 8 * 64 * 512 * 512

        def point(kv: int, rate: float) -> AttentionPoint:
            return AttentionPoint(precision=Precision.bf16, batch=1, seq_length=512, num_heads=8, num_kv_heads=kv,
                                  head_dim=64, forward_time_s=flops / rate, backward_time_s=2.5 * flops / rate)

        table = ComputeProfile(attention=[point(8, 70e9), point(2, 35e9)])  # no attention_blocking
        gpu = toy_profile(compute=table)
        cpu = gpu.model_copy(update={"device": gpu.device.model_copy(update={"name": "CPU: toy"})})
        assert cpu.is_cpu and not gpu.is_cpu

        def fwd(profile: ClusterProfile, kv: int) -> float:
            return attention_time_s(profile, batch=1, q_len=512, kv_len=512, heads=8, kv_heads=kv, qk_dim=64,
                                    v_dim=64, precision=Precision.bf16, causal=True, flash=True)[0]

        assert fwd(cpu, 8) == pytest.approx(flops / 70e9) and fwd(cpu, 2) == pytest.approx(flops / 35e9)
        assert fwd(gpu, 8) == pytest.approx(fwd(gpu, 2))

    def test_blocking_must_ascend(self):
        from pydantic import ValidationError

        with pytest.raises(ValidationError, match=r"attention_blocking from_q_len=\[0, 768, 192\] must be strictly "
                                                  r"ascending"):
            ComputeProfile(attention_blocking=[self.CPU[0], self.CPU[2], self.CPU[1]])
        with pytest.raises(ValidationError, match=r"from_q_len=\[192, 768\] must start at 0"):
            ComputeProfile(attention_blocking=self.CPU[1:])


# ============================================================================================
# comm.py
# ============================================================================================
class TestPlacement:
    def test_single_rank(self):
        assert placement(1, 8, 8) == GroupPlacement(1, 1)

    def test_tp8_on_8_gpu_node_is_intra(self):
        g = placement(8, 1, 8)
        assert (g.size, g.per_node, g.level) == (8, 8, LinkLevel.intra_node)

    def test_stride_of_a_node_is_one_per_node(self):
        g = placement(4, 8, 8)
        assert (g.size, g.per_node, g.level) == (4, 1, LinkLevel.inter_node)

    def test_dp8_after_tp2(self):
        # ranks 0,2,4,...,14: 8 // 2 = 4 per node, spans 2 nodes
        g = placement(8, 2, 8)
        assert (g.size, g.per_node, g.level) == (8, 4, LinkLevel.inter_node)

    def test_small_group_within_node(self):
        g = placement(4, 2, 8)  # ranks 0,2,4,6
        assert (g.per_node, g.level) == (4, LinkLevel.intra_node)

    def test_mesh_tp8_dp4(self):
        groups = mesh_groups(ParallelLayout(tp=8, dp_shard=4), 8)
        assert groups["tp"] == GroupPlacement(8, 8) and groups["tp"].level is LinkLevel.intra_node
        assert groups["dp_shard"] == GroupPlacement(4, 1) and groups["dp"] == GroupPlacement(4, 1)
        assert groups["pp"] == GroupPlacement(1, 1)

    def test_mesh_tp2_dp8(self):
        groups = mesh_groups(ParallelLayout(tp=2, dp_shard=8), 8)
        assert groups["dp"] == GroupPlacement(8, 4)
        assert groups["dp"].level is LinkLevel.inter_node

    def test_mesh_cp_and_replicas(self):
        # order pp, dp_replicate, dp_shard, cp, tp: cp stride 2, dp_shard stride 4, dp_replicate stride 8
        layout = ParallelLayout(tp=2, cp=2, dp_shard=2, dp_replicate=2)
        groups = mesh_groups(layout, 8)
        assert groups["cp"] == GroupPlacement(2, 2)  # 8 // 2 = 4 > 2 -> all 2 on one node
        assert groups["dp_shard"] == GroupPlacement(2, 2)  # 8 // 4 = 2
        assert groups["dp_replicate"] == GroupPlacement(2, 1)  # stride 8 = one node apart
        assert groups["dp"] == GroupPlacement(4, 2)  # stride tp*cp = 4 -> 2 per node
        assert groups["ep"] == GroupPlacement(1, 1)

    def test_mesh_pp_across_nodes(self):
        groups = mesh_groups(ParallelLayout(tp=8, pp=2), 8)
        assert groups["pp"] == GroupPlacement(2, 1)
        assert groups["pp"].level is LinkLevel.inter_node


class TestCollectives:
    def test_ring_factors(self):
        assert ring_factor(Collective.all_reduce, 8) == pytest.approx(2 * 7 / 8)  # 1.75
        assert ring_factor(Collective.all_gather, 8) == pytest.approx(7 / 8)
        assert ring_factor(Collective.reduce_scatter, 4) == pytest.approx(3 / 4)
        assert ring_factor(Collective.all_to_all, 2) == pytest.approx(1 / 2)
        assert ring_factor(Collective.p2p, 2) == 1.0
        assert ring_factor(Collective.host_to_device, 1) == 1.0

    def test_intra_node_all_reduce(self):
        # alpha + 2(n-1)/n * bytes / busbw = 1e-5 + 1.75 * 1e9 / 100e9
        t = collective_time_s(toy_profile(), Collective.all_reduce, GroupPlacement(8, 8), 1e9)
        assert t == pytest.approx(1e-5 + 0.0175)

    def test_intra_all_gather_falls_back_to_all_reduce_link(self):
        # no all_gather entry: the all_reduce link's alpha and busbw with the all-gather factor 7/8
        t = collective_time_s(toy_profile(), Collective.all_gather, GroupPlacement(8, 8), 1e9)
        assert t == pytest.approx(1e-5 + 0.875 * 1e9 / 100e9)

    def test_collective_specific_link(self):
        links = toy_links() + [LinkProfile(level=LinkLevel.intra_node, collective=Collective.all_gather,
                                           alpha_s=3e-6, busbw_bytes_per_s=50e9)]
        t = collective_time_s(toy_profile(links=links), Collective.all_gather, GroupPlacement(8, 8), 1e9)
        assert t == pytest.approx(3e-6 + 0.875 * 1e9 / 50e9)

    def test_nearest_group_size(self):
        links = toy_links() + [
            LinkProfile(level=LinkLevel.intra_node, collective=Collective.reduce_scatter, group_size=2, alpha_s=0,
                        busbw_bytes_per_s=50e9),
            LinkProfile(level=LinkLevel.intra_node, collective=Collective.reduce_scatter, group_size=8, alpha_s=0,
                        busbw_bytes_per_s=150e9),
        ]
        p = toy_profile(links=links)
        # n=3: |2-3| < |8-3| -> the group-2 entry; n=6 -> the group-8 entry
        assert find_link(p, LinkLevel.intra_node, Collective.reduce_scatter, 3).busbw_bytes_per_s == 50e9
        t = collective_time_s(p, Collective.reduce_scatter, GroupPlacement(6, 6), 6e9)
        assert t == pytest.approx(5 / 6 * 6e9 / 150e9)

    def test_inter_node_one_per_node(self):
        # 4 ranks on 4 nodes: alpha_inter + 2*3/4 * bytes / net = 2e-5 + 1.5 * 1e9 / 10e9
        t = collective_time_s(toy_profile(nodes=4), Collective.all_reduce, GroupPlacement(4, 1), 1e9)
        assert t == pytest.approx(2e-5 + 0.15)

    def test_inter_node_rails(self):
        # 8 ranks, 4 per node: busbw = min(intra 100e9, 4 * 10e9) = 40e9
        t = collective_time_s(toy_profile(nodes=2), Collective.all_reduce, GroupPlacement(8, 4), 1e9)
        assert t == pytest.approx(2e-5 + 1.75 * 1e9 / 40e9)

    def test_inter_node_rails_capped_by_intra(self):
        # 16 ranks, 8 per node, 25 GB/s per GPU: 8 * 25e9 = 200e9 > intra 100e9 -> 100e9
        p = toy_profile(nodes=2, links=toy_links(inter_busbw=25e9))
        t = collective_time_s(p, Collective.all_reduce, GroupPlacement(16, 8), 1e9)
        assert t == pytest.approx(2e-5 + 2 * 15 / 16 * 1e9 / 100e9)

    def test_p2p(self):
        # p2p: alpha + bytes / busbw, factor 1
        intra = collective_time_s(toy_profile(), Collective.p2p, GroupPlacement(2, 2), 1e8)
        assert intra == pytest.approx(1e-5 + 1e8 / 100e9)
        inter = collective_time_s(toy_profile(nodes=2), Collective.p2p, GroupPlacement(2, 1), 1e8)
        assert inter == pytest.approx(2e-5 + 1e8 / 10e9)

    def test_trivial(self):
        assert collective_time_s(toy_profile(), Collective.all_reduce, GroupPlacement(1, 1), 1e9) == 0.0
        assert collective_time_s(toy_profile(), Collective.all_reduce, GroupPlacement(8, 8), 0) == 0.0

    def test_missing_level_raises(self):
        with pytest.raises(ValueError, match="inter_node"):
            collective_time_s(toy_profile(links=toy_links()[:1]), Collective.all_reduce, GroupPlacement(4, 1), 1e9)

    def test_reference_dgx_a100_dp16(self):
        # DGX A100: 200 Gb/s per GPU * 0.95 = 23.75 GB/s; 8 rails -> 190 GB/s < 232 GB/s NVSwitch;
        # all-reduce of 1 GB over 16 ranks: 25 us + 2*15/16 * 1e9 / 190e9
        p = reference_profile("dgx-a100-80gb", 2)
        g = mesh_groups(ParallelLayout(dp_shard=16), 8)["dp"]
        assert g == GroupPlacement(16, 8)
        t = collective_time_s(p, Collective.all_reduce, g, 1e9)
        assert t == pytest.approx(25e-6 + 1.875 * 1e9 / 190e9)

    def test_reference_dgx_a100_tp8(self):
        # intra-node all-reduce: 12 us + 1.75 * bytes / 232e9
        p = reference_profile("dgx-a100-80gb", 1)
        t = collective_time_s(p, Collective.all_reduce, GroupPlacement(8, 8), 64 * 2**20)
        assert t == pytest.approx(12e-6 + 1.75 * 64 * 2**20 / 232e9)


class TestHostAndOverlap:
    def test_host_to_device(self):
        assert host_copy_time_s(toy_profile(), 1e9, to_device=True) == pytest.approx(1e-5 + 1e9 / 20e9)

    def test_device_to_host(self):
        assert host_copy_time_s(toy_profile(), 1e9, to_device=False) == pytest.approx(1e-5 + 1e9 / 10e9)

    def test_nothing_to_copy(self):
        assert host_copy_time_s(toy_profile(), 0, to_device=True) == 0.0

    def test_hidden_time(self):
        assert hidden_time_s(1.0, 0.5, 0.8) == pytest.approx(0.4)  # 0.8 * min(1.0, 0.5)
        assert hidden_time_s(0.2, 1.0, 0.85) == pytest.approx(0.17)  # 0.85 * min(0.2, 1.0)
        assert hidden_time_s(1.0, -3.0, 0.85) == 0.0  # no window
        assert hidden_time_s(1.0, 5.0, 0.0) == 0.0  # overlap off


def test_sdpa_takes_grouped_kv_on_cpus_and_on_cuda_flash_only():
    from planner.cost.compute import sdpa_takes_grouped_kv

    assert sdpa_takes_grouped_kv("cpu", False, 0, 512)  # a CPU's flash kernel takes any dtype and head dim
    assert sdpa_takes_grouped_kv("cuda", True, 9, 128) and sdpa_takes_grouped_kv("cuda", True, 8, 256)
    assert not sdpa_takes_grouped_kv("cuda", False, 9, 128)  # fp32: memory-efficient only
    assert not sdpa_takes_grouped_kv("cuda", True, 7, 128)  # before Ampere: no flash
    assert not sdpa_takes_grouped_kv("cuda", True, 9, 512)  # past flash's head dims


def test_the_mesh_order_is_one_fact_the_cost_model_and_the_executor_read():
    """ParallelLayout.MESH_ORDER (pp, dp_replicate, dp_shard, cp, tp; TP innermost) sets each group's stride
    by hand here, the cost model's placements (mesh_groups) and the executor's device mesh alike."""
    from executor.parallelize import expert_mesh_shape, mesh_shape
    from planner.contracts import ParallelLayout
    from planner.cost.comm import mesh_groups

    lay = ParallelLayout(pp=2, dp_replicate=3, dp_shard=2, cp=2, tp=4, ep=2, etp=2)
    assert lay.mesh_strides() == {"tp": 1, "cp": 4, "dp_shard": 8, "dp_replicate": 16, "pp": 48,
                                  "etp": 1, "ep": 2, "edp": 4}
    assert lay.expert_dp == 4  # dp_shard x cp x tp = 16 ranks over ep x etp = 4
    groups = mesh_groups(lay, gpus_per_node=8)
    # a group with stride s on 8-GPU nodes: min(size, 8 // s) of its ranks share a node (1 once s >= 8)
    assert (groups["tp"].size, groups["tp"].per_node) == (4, 4)
    assert (groups["cp"].size, groups["cp"].per_node) == (2, 2)
    assert (groups["dp_shard"].size, groups["dp_shard"].per_node) == (2, 1)
    assert (groups["ep"].size, groups["ep"].per_node) == (2, 2)
    assert (groups["expert_dp"].size, groups["expert_dp"].per_node) == (4, 2)
    assert mesh_shape(lay) == ((2, 3, 2, 2, 4), ParallelLayout.MESH_ORDER)
    assert expert_mesh_shape(lay) == ((2, 3, 4, 2, 2), ParallelLayout.EXPERT_MESH_ORDER)

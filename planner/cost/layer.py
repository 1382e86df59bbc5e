"""Time of one transformer block (and of the embedding and LM head) for one micro-batch on one GPU.

Forward = GEMMs + attention core + bandwidth-bound ops + the exposed part of the block's own
collectives (TP all-reduce or SP all-gather/reduce-scatter, CP key/value all-gather, EP
all-to-all, and with MoE parallel folding the experts' own TP all-gather/reduce-scatter). Backward
runs the input- and weight-gradient GEMM of each linear layer (their own shapes), the attention
backward, 1.25x the elementwise traffic, and the mirrored collectives; recompute adds a forward
(full), the attention-core forward (selective) or what per-op SAC does not keep (op, :func:`op_recompute_pass`).

MoE parallel folding (``ParallelLayout.etp`` < tp; Liu et al. 2025, Megatron-Core's alltoall token
dispatcher: permute, all-to-all over ep, all-gather over etp, grouped GEMMs, then the mirror): a rank
routes its ``T/(cp·tp)`` sequence-parallel tokens (``T = b·s``), its experts compute
``T·k·etp/(cp·tp)`` rows (:func:`expert_rows`) over ``E/ep`` local experts at width ``f/etp``, the
all-to-all moves ``T·k·h/(cp·tp)`` elements per rank over ep ranks spaced etp apart, the experts'
all-gather/reduce-scatter moves the gathered rows over etp consecutive ranks, and only the
attention (and shared experts) keep the TP pair (:func:`tp_pairs`). With etp = tp the same formulas
hold: the dispatcher all-gathers the ``T·k/cp`` routed rows over the TP group (k times the hidden
states), and the FFN's own TP pair is gone.

The rest of an MoE layer's dispatch, each a named term: the router's fp32 score kernels
(:data:`ROUTER_BYTES_PER_SCORE`), the token permutation, sorting by local expert and unpermutation
(:func:`dispatch_traffic`), the routing probabilities' all-to-all beside the tokens', the
tokens-per-expert all-gather over the TP×EP group and the host synchronisation that waits for it
(``Assumptions.moe_host_sync_s``, :func:`_dispatch_sync`), and the grouped GEMM as Transformer Engine runs
it: one GEMM per local expert on concurrent streams (:func:`routed_expert_gemms`, one launch each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.contracts import (
    ClusterProfile,
    Collective,
    GemmLayout,
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Precision,
    Recompute,
    TrainingConfig,
)
from planner.contracts.limits import ONE_KERNEL
from planner.cost.comm import GroupPlacement, collective_time_s, hidden_time_s, placement
from planner.cost.compute import (
    attention_time_s,
    cross_entropy_bytes,
    elementwise_time_s,
    gemm_fwd_bwd_s,
    grouped_gemm_time_s,
    linear_gemms_s,
    memory_time_s,
)
from planner.cost.flops import attention_window_share
from planner.cost.sac import kept_gemm_share

ELEMENTWISE_BACKWARD_RATIO = 1.25
"""Backward / forward HBM traffic of the bandwidth-bound ops: LayerNorm backward reads x and dy
and writes dx (1.5x its forward), dropout/residual backward reads dy and the mask and writes dx
(~1x), activation-function backward reads input and dy and writes dx (1.5x)."""


@dataclass
class PassCost:
    """Seconds of one pass (forward or backward) split by what takes them."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    memory_s: float = 0.0
    loss_s: float = 0.0  # of memory_s, the cross-entropy's (for the breakdown by term; not added again)
    overhead_s: float = 0.0  # kernel launches (count x kernel_overhead_s) and, MoE, the exposed host sync
    comm_s: dict[str, float] = field(default_factory=dict)  # total collective time by kind
    exposed_comm_s: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)  # buffer bytes by kind
    kernels: float = 0.0  # kernels launched (what the host issues: :meth:`calibrated`'s host-bound time)

    @property
    def compute_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s + self.overhead_s

    @property
    def total_s(self) -> float:
        return self.compute_s + sum(self.exposed_comm_s.values())

    def calibrated(self, profile: ClusterProfile) -> PassCost:
        """This pass with ``profile``'s run calibration (``ClusterProfile.term_factor``, fitted by
        ``planner.run_calibration``) applied in place: each operator class and collective kind times its factor,
        kernel launches (and the MoE host sync) by ``other``'s; then, on a GPU, the device waits for a host slower
        than it (:func:`host_seconds_per_kernel` x the kernels launched)."""
        host = host_seconds_per_kernel(profile)
        if profile.calibration is not None:
            self._apply_factors(profile)
        if host:
            self.overhead_s += max(0.0, host * self.kernels - self.compute_s)  # the device waits for a slower host
        return self

    def _apply_factors(self, profile: ClusterProfile) -> None:
        f = profile.term_factor
        self.gemm_s *= f("gemm")
        self.attention_s *= f("attention")
        self.memory_s = (self.memory_s - self.loss_s) * f("elementwise") + self.loss_s * f("loss")
        self.loss_s *= f("loss")
        self.overhead_s *= f("other")
        for kind in self.comm_s:
            self.comm_s[kind] *= f(kind)
            self.exposed_comm_s[kind] *= f(kind)

    def launch(self, kernels: float, profile: ClusterProfile) -> None:
        """This pass launches ``kernels`` kernels: each costs the device ``kernel_overhead_s`` (and the host
        the calibration's ``host_s_per_kernel``, in :meth:`calibrated`)."""
        self.kernels = kernels
        self.overhead_s = kernels * profile.assumptions.kernel_overhead_s

    def add_comm(self, kind: str, time_s: float, exposed_s: float, nbytes: float) -> None:
        """Record collectives of ``kind``: total time, the part on the critical path, buffer bytes."""
        self.comm_s[kind] = self.comm_s.get(kind, 0.0) + time_s
        self.exposed_comm_s[kind] = self.exposed_comm_s.get(kind, 0.0) + exposed_s
        self.comm_bytes[kind] = self.comm_bytes.get(kind, 0.0) + nbytes


def host_seconds_per_kernel(profile: ClusterProfile) -> float:
    """The host's seconds per counted kernel a GPU pass waits on: the run calibration's fitted figure, else the
    target's default (``assumptions.host_s_per_kernel``, :func:`planner.targets.priced_profile`); 0 on a CPU,
    where host and device are one."""
    if profile.is_cpu:
        return 0.0
    fitted = profile.calibration.host_s_per_kernel if profile.calibration is not None else None
    return fitted if fitted is not None else (profile.assumptions.host_s_per_kernel or 0.0)


def without_host(profile: ClusterProfile) -> ClusterProfile:
    """``profile`` stating a host that keeps ahead (``host_s_per_kernel`` 0: no target default applies): what a
    run calibration fits its host time against, and what compares terms that the host's wait would mask."""
    return profile.model_copy(update={"assumptions": profile.assumptions.model_copy(update={"host_s_per_kernel": 0.0})})


@dataclass
class BlockCost:
    forward: PassCost
    backward: PassCost  # without recompute
    attention_core_forward_s: float  # what selective recompute re-runs
    op_again: PassCost = field(default_factory=PassCost)  # what per-op SAC re-runs (:func:`op_recompute_pass`)

    def again(self, recompute: Recompute) -> PassCost | None:
        """What the backward runs again under ``recompute`` (None: nothing): the whole forward (full), the
        attention core (selective), the ops per-op SAC does not keep (op)."""
        if recompute is Recompute.full:
            return self.forward
        if recompute is Recompute.selective:
            return PassCost(attention_s=self.attention_core_forward_s)
        return self.op_again if recompute is Recompute.op else None

    def passes(self, recompute: Recompute) -> list[PassCost]:
        """The block's passes of one micro-batch: forward, backward and what ``recompute`` runs again."""
        again = self.again(recompute)
        return [self.forward, self.backward] + ([again] if again is not None else [])

    def backward_s(self, recompute: Recompute) -> float:
        again = self.again(recompute)
        return self.backward.total_s + (again.total_s if again is not None else 0.0)


def op_recompute_pass(model: ModelSpec, index: int, mb: MicroBatch, fwd: PassCost) -> PassCost:
    """What per-op SAC (:mod:`planner.cost.sac`) runs again of block ``index``'s forward ``fwd``: the GEMMs whose
    outputs it does not keep (their share of the forward's GEMM FLOPs: every second bias-free matmul, the
    router, the routed experts), the attention core unless a fused kernel's output is kept (flash), every
    bandwidth-bound kernel and launch, and the collectives whose outputs are not kept: with SP the TP
    all-gathers (half the TP traffic; the reduce-scatters are kept), without SP the TP all-reduces, the CP
    exchanges; not the EP all-to-alls (kept)."""
    moe = model.moe if model.is_moe_layer(index) else None
    other = 0.0  # GEMM FLOPs per token the policy never keeps
    if moe is not None:
        h, f, etp = model.hidden_size, moe.expert_ffn_hidden_size, mb.expert_tp
        up = (2 if model.ffn_kind == "swiglu" else 1) * f / etp
        other = 2.0 * h * moe.num_experts + expert_rows(moe, mb) / mb.tokens * 2.0 * h * (up + f / etp)
    again = PassCost(gemm_s=fwd.gemm_s * (1.0 - kept_gemm_share(model, index, mb.tp, other)),
                     attention_s=0.0 if mb.flash else fwd.attention_s, memory_s=fwd.memory_s,
                     overhead_s=fwd.overhead_s, kernels=fwd.kernels)
    for kind, seconds in fwd.comm_s.items():
        share = {"ep": 0.0, "tp": 0.5 if mb.sp else 1.0}.get(kind, 1.0)
        again.add_comm(kind, share * seconds, share * fwd.exposed_comm_s[kind], share * fwd.comm_bytes[kind])
    return again


@dataclass(frozen=True)
class MicroBatch:
    """What one GPU sees of one micro-batch."""

    batch: int  # sequences
    seq: int  # full sequence length
    cp: int
    tp: int
    sp: bool
    precision: Precision
    flash: bool
    moe_imbalance: float = 1.0  # routed tokens on the busiest expert rank / a perfect balance
    etp: int | None = None  # the routed experts' TP degree (ParallelLayout.etp); None = tp

    @classmethod
    def of(cls, layout: ParallelLayout, training: TrainingConfig, batch: int | None = None) -> MicroBatch:
        """What one GPU of ``layout`` sees of a micro-batch of ``training`` (``batch`` sequences, default
        the layout's micro-batch size). ``etp`` is kept only where it differs from tp (folded experts)."""
        etp = layout.expert_tp
        return cls(layout.micro_batch_size if batch is None else batch, training.seq_length, layout.cp, layout.tp,
                   layout.sp, training.precision, training.flash_attention, training.moe_load_imbalance,
                   None if etp == layout.tp else etp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def folded(self) -> bool:
        """The routed experts run on fewer TP ranks than attention (MoE parallel folding, etp < tp)."""
        return self.expert_tp != self.tp

    @property
    def local_seq(self) -> int:
        return self.seq // self.cp

    @property
    def tokens(self) -> int:
        """Rows of every GEMM: b·s/cp (SP gathers the sequence back before the TP GEMMs)."""
        return self.batch * self.local_seq

    @property
    def elt(self) -> int:
        return self.precision.bytes


def routed_token_count(moe, tokens: float, imbalance: float) -> float:
    """Token copies the busiest expert rank processes: ``T · top_k`` times the capacity factor when
    experts are padded to a fixed capacity (drops beyond it), else times the load imbalance."""
    if moe.capacity_factor is not None:
        return tokens * moe.top_k * moe.capacity_factor
    return tokens * moe.top_k * imbalance


def expert_rows(moe: MoESpec, mb: MicroBatch) -> float:
    """Routed rows the experts of one rank compute per micro-batch: ``T·k·etp/(cp·tp)`` (times the
    imbalance or capacity, :func:`routed_token_count`), ``T = b·s``.

    With SP a rank's MoE input is its ``T/(cp·tp)`` tokens; the EP all-to-all brings it the ``k``
    copies routed to its experts from the ep ranks of its EP group (``T·k/(cp·tp)`` in balance), and
    the ETP all-gather adds those of its etp - 1 expert-TP peers (Megatron-Core's alltoall dispatcher:
    permute, A2A over ep, AG over etp). With ``etp = tp`` that is ``T·k/cp`` (``mb.tokens · k``), the
    rows priced before folding."""
    routed = routed_token_count(moe, mb.tokens, mb.moe_imbalance)
    return routed if not mb.folded else routed * mb.expert_tp / mb.tp


Gemms = tuple[float, float, float]  # (forward, input gradient, weight gradient) seconds


def _mlp_gemms(profile: ClusterProfile, model: ModelSpec, tokens: int, ffn: int, split: int,
               precision: Precision, count: int = 1) -> Gemms:
    """(fwd, dgrad, wgrad) of the up (fused gate+up for SwiGLU) and down projections, ``ffn`` split over ``split``."""
    h = model.hidden_size
    up = (2 if model.ffn_kind == "swiglu" else 1) * ffn // split
    return _sum(linear_gemms_s(profile, tokens, up, h, precision, count),
                linear_gemms_s(profile, tokens, h, ffn // split, precision, count))


def local_experts(moe: MoESpec, ep: int) -> int:
    """Routed experts on one rank: ``E/ep``, at least 1."""
    return max(moe.num_experts // ep, 1)


def routed_expert_gemms(profile: ClusterProfile, model: ModelSpec, moe: MoESpec, mb: MicroBatch,
                        ep: int) -> Gemms:
    """(fwd, dgrad, wgrad) of one rank's routed experts: its ``E/ep`` local experts (at least 1), each
    on an even share of :func:`expert_rows` (``int(rows / (E/ep))``, at least 1), at FFN width ``f/etp``.

    Each of the experts' linear layers (up, fused gate+up for SwiGLU; down) is one grouped GEMM as
    Megatron-Core's TEGroupedMLP runs it (--moe-grouped-gemm): Transformer Engine's GroupedLinear launches
    one cuBLAS GEMM per local expert, round-robin on ``Assumptions.grouped_gemm_streams`` streams, so that
    many run at once and fill each other's last wave (:func:`planner.cost.compute.grouped_gemm_time_s`:
    the profile's GEMM at the per-expert shape, its tail shared). Other targets run them otherwise (one
    ``torch._grouped_mm`` kernel, a loop): the profile they price with says so
    (``planner.targets.priced_profile``). Its launches: one per expert GEMM, or one per grouped linear for a
    single kernel (:func:`forward_kernel_count`)."""
    h, f, etp = model.hidden_size, moe.expert_ffn_hidden_size, mb.expert_tp
    experts = local_experts(moe, ep)
    rows = max(int(expert_rows(moe, mb) / experts), 1)
    up = (2 if model.ffn_kind == "swiglu" else 1) * f // etp
    streams = profile.assumptions.grouped_gemm_streams
    return _sum(_grouped_linear(profile, rows, up, h, mb.precision, experts, streams),
                _grouped_linear(profile, rows, h, f // etp, mb.precision, experts, streams))


def _grouped_linear(profile: ClusterProfile, m: int, n: int, k: int, precision: Precision, experts: int,
                    streams: int) -> Gemms:
    """(fwd, dgrad, wgrad) of a grouped linear ``Y[m×n] = X[m×k]·W[k×n]`` per expert, ``experts`` of them
    (the shapes and layouts of :func:`planner.cost.compute.linear_gemms_s`, each GEMM grouped)."""
    g = grouped_gemm_time_s
    return (g(profile, m, n, k, precision, experts, streams, GemmLayout.nt),
            g(profile, m, k, n, precision, experts, streams, GemmLayout.nn),
            g(profile, n, k, m, precision, experts, streams, GemmLayout.tn))


ROUTER_BYTES_PER_SCORE = 22
"""HBM bytes the router moves per (token, expert) score in forward, its GEMM aside: Megatron-Core's
TopKRouter with Transformer Engine's fused router kernels (--moe-router-fusion, set by Megatron-Bridge's
MoE performance recipes), fp32 scores. The top-k kernel reads the fp32 logits and writes the dense
routing probabilities (fp32) and map (bool): 4 + 4 + 1; the aux-loss scores kernel the same again
(compute_routing_scores_for_aux_loss): 4 + 4 + 1; the load-balancing loss reads those scores: 4."""

PROB_BYTES = 4
"""Bytes of one routed copy's router probability, all-to-all'd beside the token (fp32; Megatron-Core's
alltoall dispatcher since core_v0.13.0, token_dispatch)."""

COUNT_BYTES = 8
"""Bytes of one tokens-per-expert count (int64) in the dispatcher's metadata all-gather."""


@dataclass(frozen=True)
class DispatchTraffic:
    """HBM bytes of one MoE layer's token dispatch on one rank in forward, by kernel (:func:`dispatch_traffic`)."""

    router: float  # score function, top-k and aux-loss kernels
    permute: float  # tokens into expert order before the all-to-all
    sort_chunks: float  # each of the sort by local expert after the all-to-all and the unsort before the combine
    unpermute: float  # the k copies back into token order, summed


def dispatch_traffic(model: ModelSpec, moe: MoESpec, mb: MicroBatch, ep: int) -> DispatchTraffic:
    """Bytes one rank's dispatcher moves per forward: Megatron-Core's MoEAlltoAllTokenDispatcher with fused
    permutation (--moe-permute-fusion; Transformer Engine's moe_permute, moe_sort_chunks_by_index and
    moe_unpermute kernels). The rank routes ``T_r`` tokens (``T/(cp·tp)`` with SP, else ``T/cp``), each to
    ``k`` experts (``k·capacity_factor`` copies when padded to capacity):

    - router: :data:`ROUTER_BYTES_PER_SCORE` per score, ``T_r × E`` of them;
    - permute: each token read once, its copies written: ``(1 + k)·T_r·h`` elements;
    - sort (and, before the combine, unsort) by local expert, when the rank holds more than one expert:
      read and write the :func:`expert_rows` ``R`` it computes: ``2·R·h`` each;
    - unpermute: the copies read back and summed into their token: ``(k + 1)·T_r·h`` (the routing
      probabilities are applied in the experts' activation, so no separate weighting pass).

    Backward moves the same in reverse (priced as every bandwidth-bound op, x ``ELEMENTWISE_BACKWARD_RATIO``)."""
    h, elt = model.hidden_size, mb.elt
    routed = mb.tokens / (mb.tp if mb.sp else 1)
    copies = routed_token_count(moe, 1, 1.0)
    sort = 2 * expert_rows(moe, mb) * h * elt if local_experts(moe, ep) > 1 else 0.0
    return DispatchTraffic(router=ROUTER_BYTES_PER_SCORE * routed * moe.num_experts,
                           permute=(1 + copies) * routed * h * elt, sort_chunks=sort,
                           unpermute=(copies + 1) * routed * h * elt)


def tp_pairs(model: ModelSpec, is_moe: bool, mb: MicroBatch) -> int:
    """(all-gather, reduce-scatter) pairs (all-reduces without SP) a block runs on the attention's TP
    group per pass: a dense block's attention and FFN, 2. An MoE block with SP: the attention's pair,
    and one more for the shared experts, which Megatron-Core runs as a TP-split MLP; the routed experts'
    rows come by the EP all-to-all and the all-gather over their own TP group (:func:`_expert_tp_comm`),
    for every etp <= tp: with etp = tp Megatron-Core's alltoall dispatcher all-gathers the routed rows
    over the TP group (dispatch_postprocess, core_v0.15.0), k times the hidden states, in place of the
    FFN's pair. Without SP (etp = tp; Megatron-Core refuses MoE with TP but no SP in training,
    MoELayer.forward): 2 all-reduces, as a dense block."""
    if not (is_moe and mb.sp):
        return 2
    moe = model.moe
    assert moe is not None
    return 1 + (1 if moe.num_shared_experts else 0)


def _sum(*parts: Gemms) -> Gemms:
    return sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)


def _attention_gemms(profile: ClusterProfile, model: ModelSpec, tokens: int, t: int,
                     precision: Precision) -> Gemms:
    """(fwd, dgrad, wgrad) of the attention projections on one TP rank."""
    h, a = model.hidden_size, model.num_attention_heads
    g = linear_gemms_s
    if model.mla is not None:
        m = model.mla
        dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = _sum(g(profile, tokens, m.q_lora_rank, h, precision),
                 g(profile, tokens, a * dqk // t, m.q_lora_rank, precision)) if m.q_lora_rank \
            else g(profile, tokens, a * dqk // t, h, precision)
        kv = _sum(g(profile, tokens, m.kv_lora_rank + m.qk_rope_head_dim, h, precision),
                  g(profile, tokens, a * (m.qk_nope_head_dim + m.v_head_dim) // t, m.kv_lora_rank, precision))
        return _sum(q, kv, g(profile, tokens, h, a * m.v_head_dim // t, precision))
    d, k = model.head_size, model.kv_heads
    qkv = (a * d + 2 * k * d) // t
    return _sum(g(profile, tokens, qkv, h, precision), g(profile, tokens, h, a * d // t, precision))


def block_cost(
    profile: ClusterProfile,
    model: ModelSpec,
    index: int,
    mb: MicroBatch,
    layout: ParallelLayout,
    groups: dict[str, GroupPlacement],
) -> BlockCost:
    """Forward and backward cost of block ``index`` for one micro-batch on one GPU: its GEMMs, attention
    core and bandwidth-bound kernels, the exposed part of its TP, CP and EP collectives, and its launches."""
    fwd, bwd = PassCost(), PassCost()
    async_eff = profile.assumptions.async_overlap_efficiency
    moe = model.moe if model.is_moe_layer(index) else None
    fwd_g, dgrad_s, wgrad_s = _block_gemms(profile, model, moe, mb, layout)
    fwd.gemm_s, bwd.gemm_s = fwd_g, dgrad_s + wgrad_s
    heads = max(model.num_attention_heads // mb.tp, 1)
    kv_heads = heads if model.mla is not None else max(model.kv_heads // mb.tp, 1)
    # attention core: local heads, this rank's queries against the whole sequence
    core_f, core_b = attention_time_s(
        profile, batch=mb.batch, q_len=mb.local_seq, kv_len=mb.seq, heads=heads, kv_heads=kv_heads,
        qk_dim=model.head_size, v_dim=model.value_head_size, precision=mb.precision, causal=True, flash=mb.flash,
    )
    share = attention_window_share(model, mb.seq)  # sliding-window blocks: fewer keys per query
    core_f, core_b = core_f * share, core_b * share
    fwd.attention_s, bwd.attention_s = core_f, core_b
    fwd.memory_s = _elementwise_s(profile, model, moe, mb, layout, heads + kv_heads)
    bwd.memory_s = ELEMENTWISE_BACKWARD_RATIO * fwd.memory_s
    if mb.tp > 1:
        _tp_comm(profile, model, moe, mb, layout, groups["tp"], fwd, bwd, (dgrad_s, wgrad_s))
    if mb.cp > 1:
        _cp_comm(profile, model, mb, groups["cp"], fwd, bwd, kv_heads)
    if moe is not None:
        _ep_comm(profile, model, moe, mb, layout, groups, fwd, bwd)
    kernels = forward_kernel_count(model, moe is not None, mb, layout, profile.assumptions.grouped_gemm_streams)
    fwd.launch(kernels, profile)
    bwd.launch(2 * kernels, profile)
    if moe is not None:
        _dispatch_sync(profile, fwd, moe, mb, layout, async_eff if layout.ep_comm_overlap else 0.0)
    fwd, bwd = fwd.calibrated(profile), bwd.calibrated(profile)
    return BlockCost(fwd, bwd, attention_core_forward_s=core_f * profile.term_factor("attention"),
                     op_again=op_recompute_pass(model, index, mb, fwd))


def _block_gemms(profile: ClusterProfile, model: ModelSpec, moe: MoESpec | None, mb: MicroBatch,
                 layout: ParallelLayout) -> Gemms:
    """(forward, input-gradient, weight-gradient) GEMM seconds of a block: attention projections, and the
    MLP or the router, shared experts and routed experts (backward GEMMs with their own shapes)."""
    t, tokens = mb.tp, mb.tokens
    gemm = _attention_gemms(profile, model, tokens, t, mb.precision)
    if moe is None:
        return _sum(gemm, _mlp_gemms(profile, model, tokens, model.ffn_hidden_size, t, mb.precision))
    gemm = _sum(gemm, linear_gemms_s(profile, tokens, moe.num_experts, model.hidden_size, Precision.bf16))  # router
    if moe.num_shared_experts:
        gemm = _sum(gemm, _mlp_gemms(profile, model, tokens, moe.shared_ffn, t, mb.precision, moe.num_shared_experts))
    return _sum(gemm, routed_expert_gemms(profile, model, moe, mb, layout.ep))


def _elementwise_s(profile: ClusterProfile, model: ModelSpec, moe: MoESpec | None, mb: MicroBatch,
                   layout: ParallelLayout, rope_heads: int) -> float:
    """Forward seconds of the bandwidth-bound kernels: 2 norms (2E each) and ``model.extra_norms`` more, 2
    residual adds with dropout (3E + mask each) in the replicated region (split by t only with SP);
    activation function, RoPE and q/k norms (``model.qk_norm``; the local query and key heads,
    ``rope_heads``, read + write) in the TP region; an MoE layer's dispatcher kernels.
    Each at its own measured rate for its own size where the profile has an elementwise table (norms as
    rmsnorm, the SwiGLU product as silu_mul, the rest as adds), else at the memory bandwidth."""
    t, elt, tokens, p = mb.tp, mb.elt, mb.tokens, mb.precision
    rep = t if mb.sp else 1
    E = tokens * model.hidden_size
    dropout = E if model.dropout > 0 else 0
    norm = 2 * elt * E / rep
    add = (3 * elt * E + dropout) / rep
    if moe is not None:
        ffn = (moe.expert_ffn_hidden_size * routed_token_count(moe, 1, mb.moe_imbalance)
               + moe.shared_ffn * moe.num_shared_experts)
    else:
        ffn = model.ffn_hidden_size
    swiglu = model.ffn_kind == "swiglu"
    act = (3 if swiglu else 2) * elt * tokens * ffn / t
    rope = 2 * elt * tokens * rope_heads * model.head_size if model.position_embedding == "rope" else 0
    qk = 2 * elt * tokens * rope_heads * model.head_size if model.qk_norm else 0  # per-head norms, read + write
    total = ((2 + model.extra_norms) * elementwise_time_s(profile, "rmsnorm", norm, p)
             + elementwise_time_s(profile, "rmsnorm", qk, p)
             + elementwise_time_s(profile, "silu_mul" if swiglu else "add", act, p)
             + 2 * elementwise_time_s(profile, "add", add, p)
             + elementwise_time_s(profile, "add", rope, p))
    if moe is not None:  # the token dispatcher's kernels, each at its own size
        d = dispatch_traffic(model, moe, mb, layout.ep)
        total += (elementwise_time_s(profile, "add", d.router, p) + elementwise_time_s(profile, "add", d.permute, p)
                  + 2 * elementwise_time_s(profile, "add", d.sort_chunks, p)
                  + elementwise_time_s(profile, "add", d.unpermute, p))
    return total


def _tp_comm(profile: ClusterProfile, model: ModelSpec, moe: MoESpec | None, mb: MicroBatch, layout: ParallelLayout,
             group: GroupPlacement, fwd: PassCost, bwd: PassCost, backward_gemms: tuple[float, float]) -> None:
    """Tensor parallel: 2 all-reduces (or all-gather + reduce-scatter with SP) per pass. Backward: each
    column-parallel linear's input-gradient all-reduce (reduce-scatter with SP) runs beside its
    weight-gradient GEMM (Megatron's async TP all-reduce), and with SP the sharded input is all-gathered
    again beside the input-gradient GEMM (Korthikanti et al. §4.2.2). Forward collectives are hidden only
    by decomposed GEMMs (async TP / TP-comm-overlap)."""
    dgrad_s, wgrad_s = backward_gemms
    async_eff = profile.assumptions.async_overlap_efficiency
    size = mb.tokens * model.hidden_size * mb.elt
    pairs = tp_pairs(model, moe is not None, mb)
    decomposed = profile.assumptions.tp_overlap_efficiency if layout.tp_comm_overlap else 0.0
    if mb.sp:
        gather = collective_time_s(profile, Collective.all_gather, group, size)
        scatter = collective_time_s(profile, Collective.reduce_scatter, group, size)
        tp_fwd = pairs * (gather + scatter)
        # backward: a reduce-scatter beside wgrad, an output-gradient all-gather on the critical
        # path and a re-gather of the sharded input beside dgrad, per pair
        beside_wgrad, critical, beside_dgrad = pairs * scatter, pairs * gather, pairs * gather
    else:
        tp_fwd = pairs * collective_time_s(profile, Collective.all_reduce, group, size)
        beside_wgrad, critical, beside_dgrad = tp_fwd, 0.0, 0.0
    fwd.add_comm("tp", tp_fwd, tp_fwd - hidden_time_s(tp_fwd, fwd.gemm_s, decomposed),
                 (2 if mb.sp else 1) * pairs * size)
    hidden = hidden_time_s(beside_wgrad, wgrad_s, async_eff) + hidden_time_s(beside_dgrad, dgrad_s, async_eff)
    total = beside_wgrad + critical + beside_dgrad
    bwd.add_comm("tp", total, total - max(hidden, hidden_time_s(total, bwd.gemm_s, decomposed)),
                 (3 if mb.sp else 1) * pairs * size)


def _cp_comm(profile: ClusterProfile, model: ModelSpec, mb: MicroBatch, group: GroupPlacement, fwd: PassCost,
             bwd: PassCost, kv_heads: int) -> None:
    """Context parallel: all-gather K and V forward (not overlapped: attention needs all of them),
    reduce-scatter their gradients backward."""
    kv_dim = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim if model.mla else kv_heads * (
        model.head_size + model.value_head_size)
    size = mb.batch * mb.seq * kv_dim * mb.elt  # full-sequence K and V of the local heads
    gather = collective_time_s(profile, Collective.all_gather, group, size)
    scatter = collective_time_s(profile, Collective.reduce_scatter, group, size)
    fwd.add_comm("cp", gather, gather, size)
    bwd.add_comm("cp", scatter, scatter, size)


def _ep_comm(profile: ClusterProfile, model: ModelSpec, moe: MoESpec, mb: MicroBatch, layout: ParallelLayout,
             groups: dict[str, GroupPlacement], fwd: PassCost, bwd: PassCost) -> None:
    """Expert parallel: the dispatch and combine all-to-all of the tokens per pass and of their routing
    probabilities (backward: their gradients), beside another micro-batch's compute with ep_comm_overlap;
    and the folded experts' own TP pair (:func:`_expert_tp_comm`)."""
    eff = profile.assumptions.async_overlap_efficiency if layout.ep_comm_overlap else 0.0
    h, elt = model.hidden_size, mb.elt
    if layout.ep > 1:
        copies = routed_token_count(moe, mb.tokens, mb.moe_imbalance) / (mb.tp if mb.sp else 1)
        size, probs = copies * h * elt, copies * PROB_BYTES
        a2a = (2 * collective_time_s(profile, Collective.all_to_all, groups["ep"], size)
               + collective_time_s(profile, Collective.all_to_all, groups["ep"], probs))
        for p in (fwd, bwd):
            p.add_comm("ep", a2a, a2a - hidden_time_s(a2a, p.compute_s, eff), 2 * size + probs)
    if mb.sp and mb.expert_tp > 1:
        _expert_tp_comm(profile, fwd, bwd, expert_rows(moe, mb) * h * elt, groups["etp"], eff)


def _dispatch_sync(profile: ClusterProfile, fwd: PassCost, moe: MoESpec, mb: MicroBatch, layout: ParallelLayout,
                   eff: float) -> None:
    """The dispatcher's metadata and host synchronisation, forward only (backward reuses the counts).

    Megatron-Core's alltoall dispatcher (preprocess, core_v0.15.0) all-gathers each rank's tokens-per-expert
    counts (``E`` int64) over the TP×EP group (``ep·etp`` consecutive ranks) when ``ep·etp > 1`` (kind "ep",
    or "tp" without EP), then copies them to the host and waits (``Assumptions.moe_host_sync_s``, under
    ``overhead_s``): the GPU idles until the host has sized and launched the all-to-all. Not when padded
    to a capacity (``capacity_factor``; --moe-pad-expert-input-to-capacity: sizes known on the host). With
    ``ep_comm_overlap`` both run beside another micro-batch's compute (``eff``), as the all-to-all."""
    group = placement(layout.ep * mb.expert_tp, 1, profile.gpus_per_node)
    if group.size > 1:
        size = COUNT_BYTES * moe.num_experts * group.size
        gather = collective_time_s(profile, Collective.all_gather, group, size)
        fwd.add_comm("ep" if layout.ep > 1 else "tp", gather, gather - hidden_time_s(gather, fwd.compute_s, eff), size)
    if moe.capacity_factor is None:
        sync = profile.assumptions.moe_host_sync_s
        fwd.overhead_s += sync - hidden_time_s(sync, fwd.compute_s, eff)


def _expert_tp_comm(profile: ClusterProfile, fwd: PassCost, bwd: PassCost, size: float, group: GroupPlacement,
                    eff: float) -> None:
    """The folded experts' own TP collectives (etp < tp, etp > 1), under kind "tp": Megatron-Core's
    alltoall dispatcher all-gathers the routed rows over the etp group after the EP all-to-all and
    reduce-scatters them before the combine (``size``: the gathered rows' bytes, :func:`expert_rows`);
    backward runs the mirrored reduce-scatter and all-gather. They sit between the all-to-all and the
    grouped GEMMs, so they are exposed, unless ``ep_comm_overlap`` runs the dispatcher's communication
    beside another micro-batch's compute (``eff``), as the all-to-all."""
    pair = (collective_time_s(profile, Collective.all_gather, group, size)
            + collective_time_s(profile, Collective.reduce_scatter, group, size))
    for p in (fwd, bwd):
        p.add_comm("tp", pair, pair - hidden_time_s(pair, p.compute_s, eff), 2 * size)


def forward_kernel_count(model: ModelSpec, is_moe: bool, mb: MicroBatch, layout: ParallelLayout,
                         expert_streams: int = 1) -> int:
    """Kernels one block launches in forward (backward launches about twice as many).

    2 norms, 2 residual adds (dropout fused), RoPE, the attention projections (2; MLA 5), the
    attention core (flash 1; unfused: 2 batched GEMMs, softmax, dropout), the FFN (2 GEMMs and the
    activation; MoE: router GEMM, score/top-k/aux-loss 3, permute and unpermute 2, sort and unsort by
    local expert 2 when a rank holds more than one, the grouped expert GEMMs one launch per local expert
    each (2·E/ep) and their activation 1, shared experts 3 each (2 GEMMs and the activation), with EP the
    tokens' dispatch and combine all-to-all and the probabilities' 3, with ep·etp > 1 the counts'
    all-gather 1; one launch per grouped linear instead for a single grouped kernel, ``expert_streams`` =
    :data:`~planner.contracts.limits.ONE_KERNEL`: Transformer Engine's streams launch every expert's
    GEMM), TP collectives (2 per :func:`tp_pairs` pair, 1 without SP; MoE with SP: 2 for the
    experts' own all-gather/reduce-scatter when etp > 1), CP key/value gather 1. FP8 input casts are
    fused into the producing norm / activation kernels (Transformer Engine): no extra launches.
    """
    gemms = 5 if model.mla is not None else 2
    count = 4 + (1 if model.position_embedding == "rope" else 0) + (1 if mb.flash else 4)
    if is_moe:
        moe = model.moe
        assert moe is not None
        experts = local_experts(moe, layout.ep)
        launches = 1 if expert_streams >= ONE_KERNEL else experts  # per grouped linear
        ffn_gemms = 1 + 2 * launches + 2 * moe.num_shared_experts
        count += 3 + 2 + (2 if experts > 1 else 0) + 1 + moe.num_shared_experts  # + shared activations
        count += (3 if layout.ep > 1 else 0) + (1 if layout.ep * mb.expert_tp > 1 else 0)
    else:
        ffn_gemms = 2
        count += 1
    gemms += ffn_gemms
    count += gemms
    if mb.tp > 1:
        count += (2 if mb.sp else 1) * tp_pairs(model, is_moe, mb)
    if is_moe and mb.sp and mb.expert_tp > 1:
        count += 2  # the experts' all-gather and reduce-scatter
    if mb.cp > 1:
        count += 1
    return count


def embedding_cost(
    profile: ClusterProfile, model: ModelSpec, mb: MicroBatch, groups: dict[str, GroupPlacement]
) -> tuple[PassCost, PassCost]:
    """Token (and position) lookup: a write of ``T·h`` forward, a scatter-add backward. With TP the
    vocab-parallel lookup is summed over ranks: all-reduce forward (reduce-scatter with SP, whose
    backward all-gathers the output gradient)."""
    fwd, bwd = PassCost(), PassCost()
    size = mb.tokens * model.hidden_size * mb.elt
    fwd.memory_s = memory_time_s(profile, 2 * size)
    bwd.memory_s = memory_time_s(profile, 3 * size)
    fwd.launch(1 + (mb.tp > 1), profile)
    bwd.launch(2 + (mb.tp > 1 and mb.sp), profile)
    if mb.tp > 1:
        kind = Collective.reduce_scatter if mb.sp else Collective.all_reduce
        time = collective_time_s(profile, kind, groups["tp"], size)
        fwd.add_comm("tp", time, time, size)
        if mb.sp:
            back = collective_time_s(profile, Collective.all_gather, groups["tp"], size)
            bwd.add_comm("tp", back, back, size)
    return fwd.calibrated(profile), bwd.calibrated(profile)


def lm_head_cost(
    profile: ClusterProfile, model: ModelSpec, mb: MicroBatch, groups: dict[str, GroupPlacement]
) -> tuple[PassCost, PassCost]:
    """Final norm, the vocab-parallel output GEMM and the fp32 softmax cross-entropy (an upcast and
    the log-softmax forward, :func:`cross_entropy_bytes`: 14 bytes per 16-bit logit; 8 backward). With
    TP the head's input is replicated: with SP it is all-gathered forward and its gradient
    reduce-scattered backward; without SP the gradient is all-reduced."""
    fwd, bwd = PassCost(), PassCost()
    t, h, tokens = mb.tp, model.hidden_size, mb.tokens
    fwd.gemm_s, bwd.gemm_s = gemm_fwd_bwd_s(profile, tokens, model.vocab_size // t, h, mb.precision)
    logits = tokens * model.vocab_size / t
    norm = 2 * mb.elt * tokens * h / (t if mb.sp else 1)
    p = mb.precision
    # the loss's backward (softmax minus one-hot) reads and writes the fp32 logits once
    fwd.loss_s = elementwise_time_s(profile, "softmax_cross_entropy", cross_entropy_bytes(logits, mb.elt), p)
    bwd.loss_s = elementwise_time_s(profile, "softmax_cross_entropy", 8 * logits, p)
    # soft-capped logits (model.logit_softcap): divide, tanh, multiply, each reading and writing the logits
    cap = 3 * 2 * mb.elt * logits if model.logit_softcap is not None else 0
    fwd.memory_s = (elementwise_time_s(profile, "rmsnorm", norm, p) + fwd.loss_s
                    + elementwise_time_s(profile, "add", cap, p))
    bwd.memory_s = (elementwise_time_s(profile, "rmsnorm", 2 * norm, p) + bwd.loss_s
                    + elementwise_time_s(profile, "add", cap, p))
    fwd.launch(5, profile)  # norm, GEMM, max, exp-sum, loss
    bwd.launch(10, profile)
    if t > 1:
        size = tokens * h * mb.elt
        if mb.sp:
            gather = collective_time_s(profile, Collective.all_gather, groups["tp"], size)
            scatter = collective_time_s(profile, Collective.reduce_scatter, groups["tp"], size)
            fwd.add_comm("tp", gather, gather, size)
            bwd.add_comm("tp", scatter, scatter, size)
        else:
            reduce = collective_time_s(profile, Collective.all_reduce, groups["tp"], size)
            bwd.add_comm("tp", reduce, reduce, size)
    return fwd.calibrated(profile), bwd.calibrated(profile)

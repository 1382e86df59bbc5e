"""Time of one transformer block (and of the embedding and LM head) for one micro-batch on one GPU.

Forward = GEMMs + attention core + bandwidth-bound ops + the exposed part of the block's own
collectives (TP all-reduce or SP all-gather/reduce-scatter, CP key/value all-gather, EP
all-to-all, and with MoE parallel folding the experts' own TP all-gather/reduce-scatter). Backward
runs the input- and weight-gradient GEMM of each linear layer (their own shapes), the attention
backward, 1.25x the elementwise traffic, and the mirrored collectives; recompute adds a forward
(full) or the attention-core forward (selective).

MoE parallel folding (``ParallelLayout.etp`` < tp; Liu et al. 2025, Megatron-Core's alltoall token
dispatcher: permute, all-to-all over ep, all-gather over etp, grouped GEMMs, then the mirror): a rank
routes its ``T/(cp·tp)`` sequence-parallel tokens (``T = b·s``), its experts compute
``T·k·etp/(cp·tp)`` rows (:func:`expert_rows`) over ``E/ep`` local experts at width ``f/etp``, the
all-to-all moves ``T·k·h/(cp·tp)`` elements per rank over ep ranks spaced etp apart, the experts'
all-gather/reduce-scatter moves the gathered rows over etp consecutive ranks, and only the
attention (and shared experts) keep the TP pair (:func:`tp_pairs`). With etp = tp every formula is
the unfolded one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.contracts import (
    ClusterProfile,
    Collective,
    ModelSpec,
    MoESpec,
    ParallelLayout,
    Precision,
    Recompute,
    TrainingConfig,
)
from planner.cost.comm import GroupPlacement, collective_time_s, hidden_time_s
from planner.cost.compute import (
    attention_time_s,
    cross_entropy_bytes,
    elementwise_time_s,
    gemm_fwd_bwd_s,
    linear_gemms_s,
    memory_time_s,
)

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
    overhead_s: float = 0.0  # kernel launches: count x kernel_overhead_s
    comm_s: dict[str, float] = field(default_factory=dict)  # total collective time by kind
    exposed_comm_s: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)  # buffer bytes by kind

    @property
    def compute_s(self) -> float:
        return self.gemm_s + self.attention_s + self.memory_s + self.overhead_s

    @property
    def total_s(self) -> float:
        return self.compute_s + sum(self.exposed_comm_s.values())

    def add_comm(self, kind: str, time_s: float, exposed_s: float, nbytes: float) -> None:
        """Record collectives of ``kind``: total time, the part on the critical path, buffer bytes."""
        self.comm_s[kind] = self.comm_s.get(kind, 0.0) + time_s
        self.exposed_comm_s[kind] = self.exposed_comm_s.get(kind, 0.0) + exposed_s
        self.comm_bytes[kind] = self.comm_bytes.get(kind, 0.0) + nbytes


@dataclass
class BlockCost:
    forward: PassCost
    backward: PassCost  # without recompute
    attention_core_forward_s: float  # what selective recompute re-runs

    def backward_s(self, recompute: Recompute) -> float:
        extra = {Recompute.none: 0.0, Recompute.selective: self.attention_core_forward_s,
                 Recompute.full: self.forward.total_s}[recompute]
        return self.backward.total_s + extra


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


def routed_token_count(moe, tokens: float, imbalance: float) -> float:  # noqa: ANN001 - MoESpec
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


def routed_expert_gemms(profile: ClusterProfile, model: ModelSpec, moe: MoESpec, mb: MicroBatch,
                        ep: int) -> Gemms:
    """(fwd, dgrad, wgrad) of one rank's routed experts: its ``E/ep`` local experts (at least 1), each
    on an even share of :func:`expert_rows` (``int(rows / (E/ep))``, at least 1), at FFN width ``f/etp``."""
    local_experts = max(moe.num_experts // ep, 1)
    per_expert = max(int(expert_rows(moe, mb) / local_experts), 1)
    return _mlp_gemms(profile, model, per_expert, moe.expert_ffn_hidden_size, mb.expert_tp, mb.precision,
                      local_experts)


def tp_pairs(model: ModelSpec, is_moe: bool, mb: MicroBatch) -> int:
    """(all-gather, reduce-scatter) pairs (all-reduces without SP) a block runs on the attention's TP
    group per pass: the attention's and the FFN's, 2. With folded experts (etp < tp) the routed experts
    leave the TP group (their rows come by the EP all-to-all and the ETP all-gather instead): the
    attention's pair, and one more for the shared experts, which Megatron-Core runs as a TP-split MLP."""
    if not (is_moe and mb.folded):
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
    """Forward and backward cost of block ``index`` for one micro-batch on one GPU."""
    t, h, elt, tokens = mb.tp, model.hidden_size, mb.elt, mb.tokens
    fwd, bwd = PassCost(), PassCost()
    async_eff = profile.assumptions.async_overlap_efficiency

    # GEMMs (backward: input-gradient and weight-gradient GEMMs with their own shapes)
    gemm = _attention_gemms(profile, model, tokens, t, mb.precision)
    moe = model.moe if model.is_moe_layer(index) else None
    if moe is None:
        gemm = _sum(gemm, _mlp_gemms(profile, model, tokens, model.ffn_hidden_size, t, mb.precision))
    else:
        gemm = _sum(gemm, linear_gemms_s(profile, tokens, moe.num_experts, h, Precision.bf16))  # router
        if moe.num_shared_experts:
            gemm = _sum(gemm, _mlp_gemms(profile, model, tokens, moe.shared_ffn, t, mb.precision,
                                         moe.num_shared_experts))
        gemm = _sum(gemm, routed_expert_gemms(profile, model, moe, mb, layout.ep))
    fwd.gemm_s, bwd.gemm_s = gemm[0], gemm[1] + gemm[2]
    dgrad_s, wgrad_s = gemm[1], gemm[2]

    # attention core: local heads, this rank's queries against the whole sequence
    heads = max(model.num_attention_heads // t, 1)
    kv_heads = heads if model.mla is not None else max(model.kv_heads // t, 1)
    core_f, core_b = attention_time_s(
        profile, batch=mb.batch, q_len=mb.local_seq, kv_len=mb.seq, heads=heads, kv_heads=kv_heads,
        qk_dim=model.head_size, v_dim=model.value_head_size, precision=mb.precision, causal=True, flash=mb.flash,
    )
    fwd.attention_s, bwd.attention_s = core_f, core_b

    # bandwidth-bound ops: 2 norms (2E each), 2 residual adds with dropout (3E + mask each) in the
    # replicated region (split by t only with SP); activation function and RoPE in the TP region.
    # Each kernel at its own measured rate for its own size where the profile has an elementwise
    # table (norms as rmsnorm, the SwiGLU product as silu_mul, the rest as adds), else at the memory
    # bandwidth
    rep = t if mb.sp else 1
    E = tokens * h
    dropout = E if model.dropout > 0 else 0
    norm = 2 * elt * E / rep
    add = (3 * elt * E + dropout) / rep
    if moe is not None:
        ffn = moe.expert_ffn_hidden_size * routed_token_count(moe, 1, mb.moe_imbalance) + moe.shared_ffn * moe.num_shared_experts
    else:
        ffn = model.ffn_hidden_size
    swiglu = model.ffn_kind == "swiglu"
    act = (3 if swiglu else 2) * elt * tokens * ffn / t
    # RoPE rotates the local query and key heads (read + write)
    rope = 2 * elt * tokens * (heads + kv_heads) * model.head_size if model.position_embedding == "rope" else 0
    # MoE token dispatcher: permute the T·k routed copies into expert order and back (read + write
    # each), and weight them by the router probabilities on the way back
    permute = 0.0
    if moe is not None:
        permute = (2 * 2 + 1) * elt * routed_token_count(moe, tokens, mb.moe_imbalance) * h / rep
    p = mb.precision
    fwd.memory_s = (2 * elementwise_time_s(profile, "rmsnorm", norm, p)
                    + elementwise_time_s(profile, "silu_mul" if swiglu else "add", act, p)
                    + 2 * elementwise_time_s(profile, "add", add, p)
                    + elementwise_time_s(profile, "add", rope, p) + elementwise_time_s(profile, "add", permute, p))
    bwd.memory_s = ELEMENTWISE_BACKWARD_RATIO * fwd.memory_s

    # tensor parallel: 2 all-reduces (or all-gather + reduce-scatter with SP) per pass.
    # Backward: each column-parallel linear's input-gradient all-reduce (reduce-scatter with SP)
    # runs beside its weight-gradient GEMM (Megatron's async TP all-reduce), and with SP the sharded
    # input is all-gathered again beside the input-gradient GEMM (Korthikanti et al. §4.2.2).
    # Forward collectives are hidden only by decomposed GEMMs (async TP / TP-comm-overlap).
    if t > 1:
        size = tokens * h * elt
        pairs = tp_pairs(model, moe is not None, mb)
        decomposed = profile.assumptions.tp_overlap_efficiency if layout.tp_comm_overlap else 0.0
        if mb.sp:
            gather = collective_time_s(profile, Collective.all_gather, groups["tp"], size)
            scatter = collective_time_s(profile, Collective.reduce_scatter, groups["tp"], size)
            tp_fwd = pairs * (gather + scatter)
            # backward: a reduce-scatter beside wgrad, an output-gradient all-gather on the critical
            # path and a re-gather of the sharded input beside dgrad, per pair
            beside_wgrad, critical, beside_dgrad = pairs * scatter, pairs * gather, pairs * gather
        else:
            tp_fwd = pairs * collective_time_s(profile, Collective.all_reduce, groups["tp"], size)
            beside_wgrad, critical, beside_dgrad = tp_fwd, 0.0, 0.0
        fwd.add_comm("tp", tp_fwd, tp_fwd - hidden_time_s(tp_fwd, fwd.gemm_s, decomposed),
                     (2 if mb.sp else 1) * pairs * size)
        hidden = hidden_time_s(beside_wgrad, wgrad_s, async_eff) + hidden_time_s(beside_dgrad, dgrad_s, async_eff)
        total = beside_wgrad + critical + beside_dgrad
        bwd.add_comm("tp", total, total - max(hidden, hidden_time_s(total, bwd.gemm_s, decomposed)),
                     (3 if mb.sp else 1) * pairs * size)

    # context parallel: all-gather K and V forward, reduce-scatter their gradients backward
    if mb.cp > 1:
        kv_dim = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim if model.mla else kv_heads * (
            model.head_size + model.value_head_size)
        size = mb.batch * mb.seq * kv_dim * elt  # full-sequence K and V of the local heads
        gather = collective_time_s(profile, Collective.all_gather, groups["cp"], size)
        scatter = collective_time_s(profile, Collective.reduce_scatter, groups["cp"], size)
        fwd.add_comm("cp", gather, gather, size)  # not overlapped: attention needs all of K and V
        bwd.add_comm("cp", scatter, scatter, size)

    # expert parallel: dispatch and combine all-to-all per pass
    if moe is not None and layout.ep > 1:
        size = routed_token_count(moe, tokens, mb.moe_imbalance) * h * elt / rep
        a2a = 2 * collective_time_s(profile, Collective.all_to_all, groups["ep"], size)
        for p in (fwd, bwd):
            # with ep_comm_overlap the dispatch/combine of one micro-batch runs beside another's compute
            hidden = hidden_time_s(a2a, p.compute_s, async_eff) if layout.ep_comm_overlap else 0.0
            p.add_comm("ep", a2a, a2a - hidden, 2 * size)
    if moe is not None and mb.folded and mb.expert_tp > 1:
        _expert_tp_comm(profile, fwd, bwd, expert_rows(moe, mb) * h * elt, groups["etp"],
                        async_eff if layout.ep_comm_overlap else 0.0)

    kernels = forward_kernel_count(model, moe is not None, mb, layout)
    fwd.overhead_s = kernels * profile.assumptions.kernel_overhead_s
    bwd.overhead_s = 2 * fwd.overhead_s
    return BlockCost(fwd, bwd, attention_core_forward_s=core_f)


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


def forward_kernel_count(model: ModelSpec, is_moe: bool, mb: MicroBatch, layout: ParallelLayout) -> int:
    """Kernels one block launches in forward (backward launches about twice as many).

    2 norms, 2 residual adds (dropout fused), RoPE, the attention projections (2; MLA 5), the
    attention core (flash 1; unfused: 2 batched GEMMs, softmax, dropout), the FFN (2 GEMMs and the
    activation; MoE: router GEMM, softmax/top-k/aux-loss 3, permute and unpermute 4, grouped
    expert GEMMs and their activation 3, shared experts 3 each (2 GEMMs and the activation),
    all-to-all 2 with EP), TP collectives (2, or 4 with SP; folded experts: 2 per :func:`tp_pairs` pair
    and 2 for the experts' own all-gather/reduce-scatter when etp > 1), CP key/value gather 1. FP8 input casts
    are fused into the producing norm / activation kernels (Transformer Engine): no extra launches.
    """
    gemms = 5 if model.mla is not None else 2
    count = 4 + (1 if model.position_embedding == "rope" else 0) + (1 if mb.flash else 4)
    if is_moe:
        moe = model.moe
        assert moe is not None
        ffn_gemms = 1 + 2 + 2 * moe.num_shared_experts
        count += 3 + 4 + moe.num_shared_experts + 1 + (2 if layout.ep > 1 else 0)  # + shared activations
    else:
        ffn_gemms = 2
        count += 1
    gemms += ffn_gemms
    count += gemms
    if mb.tp > 1:
        count += (2 if mb.sp else 1) * tp_pairs(model, is_moe, mb)
    if is_moe and mb.folded and mb.expert_tp > 1:
        count += 2  # the experts' all-gather and reduce-scatter
    if mb.cp > 1:
        count += 1
    return count


def embedding_cost(profile: ClusterProfile, model: ModelSpec, mb: MicroBatch, groups: dict[str, GroupPlacement]) -> tuple[PassCost, PassCost]:
    """Token (and position) lookup: a write of ``T·h`` forward, a scatter-add backward. With TP the
    vocab-parallel lookup is summed over ranks: all-reduce forward (reduce-scatter with SP, whose
    backward all-gathers the output gradient)."""
    fwd, bwd = PassCost(), PassCost()
    size = mb.tokens * model.hidden_size * mb.elt
    fwd.memory_s = memory_time_s(profile, 2 * size)
    bwd.memory_s = memory_time_s(profile, 3 * size)
    fwd.overhead_s = profile.assumptions.kernel_overhead_s * (1 + (mb.tp > 1))
    bwd.overhead_s = profile.assumptions.kernel_overhead_s * (2 + (mb.tp > 1 and mb.sp))
    if mb.tp > 1:
        kind = Collective.reduce_scatter if mb.sp else Collective.all_reduce
        time = collective_time_s(profile, kind, groups["tp"], size)
        fwd.add_comm("tp", time, time, size)
        if mb.sp:
            back = collective_time_s(profile, Collective.all_gather, groups["tp"], size)
            bwd.add_comm("tp", back, back, size)
    return fwd, bwd


def lm_head_cost(profile: ClusterProfile, model: ModelSpec, mb: MicroBatch, groups: dict[str, GroupPlacement]) -> tuple[PassCost, PassCost]:
    """Final norm, the vocab-parallel output GEMM and the fp32 softmax cross-entropy (an upcast and
    the log-softmax forward, :func:`cross_entropy_bytes`: 14 bytes per 16-bit logit; 8 backward). With TP the head's input is replicated: with SP it is all-gathered
    forward and its gradient reduce-scattered backward; without SP the gradient is all-reduced."""
    fwd, bwd = PassCost(), PassCost()
    t, h, tokens = mb.tp, model.hidden_size, mb.tokens
    fwd.gemm_s, bwd.gemm_s = gemm_fwd_bwd_s(profile, tokens, model.vocab_size // t, h, mb.precision)
    logits = tokens * model.vocab_size / t
    norm = 2 * mb.elt * tokens * h / (t if mb.sp else 1)
    p = mb.precision
    # the loss's backward (softmax minus one-hot) reads and writes the fp32 logits once
    fwd.memory_s = (elementwise_time_s(profile, "rmsnorm", norm, p)
                    + elementwise_time_s(profile, "softmax_cross_entropy", cross_entropy_bytes(logits, mb.elt), p))
    bwd.memory_s = (elementwise_time_s(profile, "rmsnorm", 2 * norm, p)
                    + elementwise_time_s(profile, "softmax_cross_entropy", 8 * logits, p))
    fwd.overhead_s = 5 * profile.assumptions.kernel_overhead_s  # norm, GEMM, max, exp-sum, loss
    bwd.overhead_s = 2 * fwd.overhead_s
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
    return fwd, bwd

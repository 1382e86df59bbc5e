"""CP-SAT: give layers to pipeline stages and choose recompute per stage for one candidate layout.

The decision: ``c_j`` layers in each (virtual) stage ``j`` (contiguous, ``≥ 1``, summing to the
model's layers) and, per pipeline rank, a recompute kind (those the target admits) with a count of its
layers. Layers are not equal: the model's blocks come in at most two kinds laid out as a prefix
(DeepSeek-V3's first dense layers, then MoE), rank 0 also holds the embedding and the last rank
the LM head, and the first 1F1B stage keeps more micro-batches in flight than the last. Every
stage must fit its own memory; the objective is the schedule's step formula
(:mod:`planner.cost.pipeline`) plus the slowest stage's once-per-step tail — the same numbers
:class:`~planner.search.stages.StageModel` computes, as integers.

Units: times are integers of ``unit`` seconds (a stage is ~10⁶ of them) multiplied by ``S`` where
the overlap efficiency multiplies a time; memory is in 64-byte units, rounded up (a solution never
claims to fit when it does not). Rounding moves the objective by ~10⁻⁶; the search re-prices
every solution exactly with ``predict``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.contracts import Recompute
from planner.cost.memory import recompute_transient
from planner.cost.pipeline import SCHEDULES
from planner.search.stages import KindCost, StageModel

S = 10_000  # scale of the overlap efficiency
MEM_UNIT = 64.0


@dataclass
class StageSolution:
    chunks: list[int]
    recompute: list[tuple[Recompute, int]]
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN | MODEL_INVALID
    objective_s: float | None
    wall_s: float


def layer_kind_prefix(sm: StageModel) -> tuple[bool, int] | None:
    """(first kind, how many leading blocks have it) when the blocks are one kind then the other."""
    kinds = sm.kinds
    first = kinds[0]
    d = next((i for i, k in enumerate(kinds) if k != first), len(kinds))
    if any(k == first for k in kinds[d:]):
        return None
    return first, d


def solve_stages(sm: StageModel, time_limit_s: float = 2.0, workers: int = 2, upper_bound_s: float | None = None, *,
                 even_split: bool = False, uniform_recompute: bool = False) -> StageSolution:
    """Best split and per-stage recompute of ``sm``'s candidate; INFEASIBLE if no split fits memory.
    ``even_split``: only the default split; ``uniform_recompute``: one kind and count on every rank (what a
    target that cannot run more accepts, ``planner.targets.TargetSpec``)."""
    cx = _context(sm)
    chunks, a_in_chunk = _chunk_vars(cx)
    ranks = []
    for r in range(cx.p):
        rk = _rank_vars(cx, r, chunks, a_in_chunk)
        _rank_time(cx, rk)
        _rank_memory(cx, rk)
        ranks.append(rk)
    _restrict(cx, chunks, ranks, even_split=even_split, uniform_recompute=uniform_recompute)
    objective, scale = _objective(cx, chunks, ranks)
    if upper_bound_s is not None:
        cx.mdl.Add(objective <= int(upper_bound_s / cx.unit * S * scale) + 1)
    cx.mdl.Minimize(objective)
    return _solve(cx, chunks, ranks, scale, time_limit_s, workers)


@dataclass
class _Context:
    """What every part of one candidate's model reads: the stage model, the CP-SAT model being built,
    the two block kinds (``ka`` the leading ``d_count`` blocks, ``kb`` the rest or None) and the units."""
    sm: StageModel
    mdl: cp_model.CpModel
    ka: KindCost
    kb: KindCost | None
    d_count: int
    unit: float  # seconds per time unit: a rank's average forward+backward is ~1e6 units
    ub_units: int = 0  # a bound on any stage's time, base units
    big_time: int = 0  # the same bound, scaled by S

    @property
    def L(self) -> int:
        return self.sm.model.num_layers

    @property
    def p(self) -> int:
        return self.sm.p

    @property
    def v(self) -> int:
        return self.sm.v

    @property
    def single(self) -> bool:
        """One block kind: the decision is one layer count per rank (see :func:`_chunk_vars`)."""
        return self.d_count == self.L

    @property
    def eff_int(self) -> int:
        return int(round(self.sm.eff * S))

    @property
    def dense_params(self) -> tuple[float, float]:
        """Dense parameters per GPU of one block of kind a, of kind b (0 with one kind)."""
        return self.ka.dense_params, (self.kb.dense_params if self.kb else 0.0)

    @property
    def expert_params(self) -> tuple[float, float]:
        """Expert parameters per GPU of one block of kind a, of kind b (0 with one kind)."""
        return self.ka.expert_params, (self.kb.expert_params if self.kb else 0.0)

    def q(self, seconds: float) -> int:
        return int(round(seconds / self.unit))


@dataclass
class _Rank:
    """One pipeline rank's decision variables: ``n`` layers (``na`` of kind a, ``nb`` of kind b) and, per
    recompute kind the target admits (``sm.recompute_kinds``; at most one used), the recomputed layers
    ``rec[kind]``, ``rec_a[kind]`` of them of kind a."""
    r: int
    n: cp_model.LinearExprT
    na: cp_model.LinearExprT
    nb: cp_model.LinearExprT
    rec: dict[Recompute, cp_model.IntVar]
    rec_a: dict[Recompute, cp_model.IntVar]
    T: cp_model.IntVar | None = None  # forward+backward of one micro-batch, scaled by S
    F: cp_model.IntVar | None = None  # its forward
    tail: cp_model.LinearExprT = 0  # once-per-step tail, scaled by S

    @property
    def first(self) -> bool:
        return self.r == 0

    def last(self, cx: _Context) -> bool:
        return self.r == cx.sm.head_rank

    def const_dense(self, cx: _Context) -> float:
        """Dense parameters outside the blocks: the embedding on rank 0, the LM head on the last."""
        return (cx.sm.emb_params if self.first else 0.0) + (cx.sm.head_params if self.last(cx) else 0.0)


def _context(sm: StageModel) -> _Context:
    """The CP-SAT model's context; unit = (L·(forward + backward) + embedding + head) / p / 10⁶ seconds."""
    prefix = layer_kind_prefix(sm)
    if prefix is None:
        raise ValueError("blocks are not a prefix of one kind followed by the other; use the default split")
    kind_a, d_count = prefix
    ka, kb = sm.kind_cost[kind_a], sm.kind_cost.get(not kind_a)
    L, p, v = sm.model.num_layers, sm.p, sm.v
    total = L * (ka.forward_s + ka.backward_s[Recompute.none]) + sum(sm.emb) + sum(sm.head)
    cx = _Context(sm, cp_model.CpModel(), ka, kb, d_count, max(total / p / 1e6, 1e-12))
    # a bound on any stage's time (base units): every layer fully recomputed, all traffic exposed
    all_dense = L * max(ka.dense_params, kb.dense_params if kb else 0.0) + sm.emb_params + sm.head_params
    all_expert = L * max(ka.expert_params, kb.expert_params if kb else 0.0)
    worst_s = (L * max(k.forward_s + k.backward_s[Recompute.full] for k in sm.kind_cost.values()) + sum(sm.emb)
               + sum(sm.head) + 2 * v * sm.p2p_s + 3 * sum(sm.traffic(all_dense, all_expert, L + 1, L))
               + sm.optimizer_s(all_dense, all_expert))
    cx.ub_units = 2 * cx.q(worst_s) + 10
    cx.big_time = S * cx.ub_units
    return cx


def _chunk_vars(cx: _Context) -> tuple[list[cp_model.IntVar], list[cp_model.LinearExprT] | None]:
    """The split's variables and, with two kinds, each chunk's kind-a blocks ``min(B_{j+1}, D) - min(B_j, D)``
    (``B_j`` the blocks before chunk ``j``, ``D`` = ``d_count``).

    One block kind: a rank's time and memory depend only on how many blocks it holds, not on how
    they fall into its v chunks, so the decision is one count per rank (p variables instead of
    p·v interchangeable chunk sizes, which only slow the proof down); the chunks are then as
    even as each rank's count allows."""
    mdl, L, p, v, d_count = cx.mdl, cx.L, cx.p, cx.v, cx.d_count
    if cx.single:
        rank_n = [mdl.NewIntVar(v, L, f"n{r}") for r in range(p)]
        mdl.Add(sum(rank_n) == L)
        return rank_n, None
    n_chunks = p * v
    chunks = [mdl.NewIntVar(1, L, f"c{j}") for j in range(n_chunks)]
    mdl.Add(sum(chunks) == L)
    bounds = [mdl.NewConstant(0)]
    for j in range(n_chunks):
        b = mdl.NewIntVar(0, L, f"B{j + 1}")
        mdl.Add(b == bounds[-1] + chunks[j])
        bounds.append(b)
    capped = []
    for j, b in enumerate(bounds):
        cb = mdl.NewIntVar(0, d_count, f"mB{j}")
        mdl.AddMinEquality(cb, [b, mdl.NewConstant(d_count)])
        capped.append(cb)
    return chunks, [capped[j + 1] - capped[j] for j in range(n_chunks)]


def _rank_vars(cx: _Context, r: int, chunks: list[cp_model.IntVar],
               a_in_chunk: list[cp_model.LinearExprT] | None) -> _Rank:
    """Rank ``r``'s layer counts (its chunks: ``sm.placement[r]``) and recompute: one kind per rank, a count of
    its layers (kind-a blocks come first in the rank)."""
    mdl, L, d_count = cx.mdl, cx.L, cx.d_count
    if cx.single:
        n = na = chunks[r]
        nb = mdl.NewConstant(0)
    else:
        mine = cx.sm.placement[r]
        n = mdl.NewIntVar(1, L, f"n{r}")
        mdl.Add(n == sum(chunks[j] for j in mine))
        na = mdl.NewIntVar(0, min(L, d_count), f"na{r}")
        mdl.Add(na == sum(a_in_chunk[j] for j in mine))
        nb = mdl.NewIntVar(0, L - d_count, f"nb{r}")
        mdl.Add(nb == n - na)
    rec, rec_a, used = {}, {}, []
    for kind in cx.sm.recompute_kinds:
        count = mdl.NewIntVar(0, L, f"R{kind.value}{r}")
        on = mdl.NewBoolVar(f"z{kind.value}{r}")
        mdl.Add(count == 0).OnlyEnforceIf(on.Not())
        of_a = mdl.NewIntVar(0, L, f"Ra{kind.value}{r}")
        mdl.AddMinEquality(of_a, [count, na])
        rec[kind], rec_a[kind] = count, of_a
        used.append(on)
    mdl.Add(sum(rec.values()) <= n)
    mdl.Add(sum(used) <= 1)  # one recompute kind per rank
    return _Rank(r, n, na, nb, rec, rec_a)


def _rank_compute(cx: _Context, rk: _Rank) -> tuple[cp_model.LinearExprT, cp_model.LinearExprT]:
    """(F, B) compute of one micro-batch in base units: per-block forward/backward by kind, the backward's
    recompute surcharge per recomputed block, the embedding/head on the end ranks and v p2p transfers."""
    sm, ka, kb, q = cx.sm, cx.ka, cx.kb, cx.q
    na, nb = rk.na, rk.nb
    fa, fb = ka.forward_s, (kb.forward_s if kb else 0.0)
    ba, bb = ka.backward_s[Recompute.none], (kb.backward_s[Recompute.none] if kb else 0.0)
    surcharge = sum(q(ka.backward_s[k] - ba) * rk.rec_a[k]
                    + (q(kb.backward_s[k] - bb) * (rk.rec[k] - rk.rec_a[k]) if kb else 0) for k in rk.rec)
    first, last = rk.first, rk.last(cx)
    const_f = (sm.emb[0] if first else 0.0) + (sm.head[0] if last else 0.0) + cx.v * sm.p2p_s
    const_b = (sm.emb[1] if first else 0.0) + (sm.head[1] if last else 0.0) + cx.v * sm.p2p_s
    F = q(fa) * na + q(fb) * nb + q(const_f)
    B = q(ba) * na + q(bb) * nb + surcharge + q(const_b)
    return F, B


def _dp_collectives(cx: _Context, rk: _Rank) -> dict[str, cp_model.LinearExprT]:
    """The rank's data-parallel collectives (grad, replica, gather) in base units: ``alpha + slope·params``
    for the dense parameters, plus the expert ones' (and their ``alpha`` when it holds any MoE block), and
    ZeRO-2/3's ``per_call`` for each further call (one per block and root unit; per MoE block)."""
    sm, mdl, q = cx.sm, cx.mdl, cx.q
    (pda, pdb), (pea, peb) = cx.dense_params, cx.expert_params
    const_dense = rk.const_dense(cx)
    moe_count = None
    if pea > 0 or peb > 0:
        moe_count = rk.na if pea > 0 else rk.nb
    has_experts = mdl.NewBoolVar(f"exp{rk.r}")
    if moe_count is None:
        mdl.Add(has_experts == 0)
    else:
        mdl.Add(moe_count >= 1).OnlyEnforceIf(has_experts)
        mdl.Add(moe_count == 0).OnlyEnforceIf(has_experts.Not())
    out = {}
    root = 1 if rk.first or rk.last(cx) else 0
    for which in ("grad", "replica", "gather"):
        d, e = sm.dense_dp[which], sm.expert_dp[which]
        expr = q(d.slope * pda) * rk.na + q(d.slope * pdb) * rk.nb + q(d.alpha + d.slope * const_dense)
        if d.per_call:  # ZeRO-2/3: a call per block and one for the root unit (predict.dp_units)
            expr += q(d.per_call) * (rk.na + rk.nb) + q(d.per_call * (root - 1))
        if moe_count is not None:
            expr += q(e.slope * pea) * rk.na + q(e.slope * peb) * rk.nb + q(e.alpha) * has_experts
            if e.per_call:  # a call per MoE block
                expr += q(e.per_call) * moe_count - q(e.per_call) * has_experts
        out[which] = expr
    return out


def _exposed_scaled(cx: _Context, comm: cp_model.LinearExprT, window: cp_model.LinearExprT,
                    name: str) -> cp_model.LinearExprT:
    """S·(comm - eff·min(comm, window)) for base-unit expressions."""
    if isinstance(comm, int) and comm == 0:
        return 0
    h = cx.mdl.NewIntVar(0, cx.ub_units, f"h_{name}")
    # h <= min(comm, window): every objective term grows with the exposed time, so the
    # solver sets h to the minimum itself (no equality needed)
    cx.mdl.Add(h <= comm)
    cx.mdl.Add(h <= window)
    return S * comm - cx.eff_int * h


def _rank_time(cx: _Context, rk: _Rank) -> None:
    """Sets ``rk.T`` (forward+backward of one micro-batch), ``rk.F`` (its forward) and ``rk.tail`` (the
    once-per-step collectives and optimizer step), all scaled by S, traffic exposed beyond ``eff`` of its
    compute window."""
    sm, mdl, q, r = cx.sm, cx.mdl, cx.q, rk.r
    F, B = _rank_compute(cx, rk)
    dp = _dp_collectives(cx, rk)
    grad, replica, gather = dp["grad"], dp["replica"], dp["gather"]
    gpm = sm.gathers_per_mb
    gather_f = gather if gpm else 0
    gather_b = (gpm - 1) * gather if gpm else 0
    grad_mb = grad if sm.grads_per_mb else 0
    Fs = S * F + _exposed_scaled(cx, gather_f, F, f"f{r}")
    Bs = S * B + _exposed_scaled(cx, gather_b + grad_mb, B, f"b{r}")
    rk.T = mdl.NewIntVar(0, cx.big_time, f"T{r}")
    mdl.Add(rk.T == Fs + Bs)
    rk.F = mdl.NewIntVar(0, cx.big_time, f"F{r}")
    mdl.Add(rk.F == Fs)
    # once-per-step tail: windows are the stage's own backward / forward (base units, floored)
    grad_step = replica + (0 if sm.grads_per_mb else grad)
    gather_step = 0 if gpm else gather
    (pda, pdb), (pea, peb) = cx.dense_params, cx.expert_params
    na, nb = rk.na, rk.nb
    opt_d, opt_e, opt_a = _optimizer_affine(sm)
    opt = (q(opt_a + opt_d * rk.const_dense(cx)) + q(opt_d * pda) * na + q(opt_d * pdb) * nb
           + q(opt_e * pea) * na + q(opt_e * peb) * nb)
    # once-per-step traffic hides behind the stage's compute (the per-micro-batch traffic's links are busy)
    rk.tail = (_exposed_scaled(cx, grad_step, B, f"gs{r}") + _exposed_scaled(cx, gather_step, F, f"ps{r}")
               + S * opt)


def _mq(nbytes: float) -> int:
    """Bytes in 64-byte units, rounded up."""
    return int(-(-nbytes // MEM_UNIT))


def _rank_memory(cx: _Context, rk: _Rank) -> None:
    """The rank fits its budget in both phases: with its activations (model states + in-flight activations
    less what recompute drops + a fully recomputed block's transient + ZeRO-2/3's block buffer), and at
    the optimizer step (model states and its temporaries; the activations are gone by then)."""
    sm, mdl, ka, kb, r = cx.sm, cx.mdl, cx.ka, cx.kb, rk.r
    na, nb = rk.na, rk.nb
    (pda, pdb), (pea, peb) = cx.dense_params, cx.expert_params
    const_dense = rk.const_dense(cx)
    per_dense, per_expert = sm._state_dense, sm._state_expert
    fl = sm.in_flight[r]
    Aa, Ab = ka.activations, (kb.activations if kb else {k: 0.0 for k in Recompute})
    none = Recompute.none
    mem = (_mq(per_dense * pda + per_expert * pea + fl * Aa[none]) * na
           + _mq(per_dense * pdb + per_expert * peb + fl * Ab[none]) * nb
           - sum(int((fl * (Aa[none] - Aa[k])) // MEM_UNIT) * rk.rec_a[k]
                 + int((fl * (Ab[none] - Ab[k])) // MEM_UNIT) * (rk.rec[k] - rk.rec_a[k]) for k in rk.rec)
           + _mq(per_dense * const_dense + (fl * sm.emb_act if rk.first else 0.0)
                 + (sm.logits + sm.root if rk.last(cx) else 0.0)))
    # a recomputed block rebuilds what it did not keep for a moment (planner.cost.memory.recompute_transient)
    peaks = [(rk.rec_a[k], _mq(recompute_transient(Aa, k))) for k in rk.rec]
    peaks += [(rk.rec[k] - rk.rec_a[k], _mq(recompute_transient(Ab, k))) for k in rk.rec]
    peaks = [(count, need) for count, need in peaks if need > 0]
    transient = mdl.NewIntVar(0, max((need for _, need in peaks), default=0), f"tr{r}")
    for i, (count, need) in enumerate(peaks):
        u = mdl.NewBoolVar(f"u{r}_{i}")
        mdl.Add(count == 0).OnlyEnforceIf(u.Not())
        mdl.Add(transient >= need).OnlyEnforceIf(u)
    mem += transient
    if sm.block_buffer > 0:  # ZeRO-2/3: the biggest held block's gathered weights / unsharded gradients
        ga, gb = mdl.NewBoolVar(f"ga{r}"), mdl.NewBoolVar(f"gb{r}")
        mdl.Add(na == 0).OnlyEnforceIf(ga.Not())
        mdl.Add(nb == 0).OnlyEnforceIf(gb.Not())
        w = sm.block_buffer
        gbuf = mdl.NewIntVar(0, _mq(w * max(ka.gather_params, kb.gather_params if kb else 0.0)), f"gbuf{r}")
        mdl.Add(gbuf >= _mq(w * ka.gather_params)).OnlyEnforceIf(ga)
        if kb is not None:
            mdl.Add(gbuf >= _mq(w * kb.gather_params)).OnlyEnforceIf(gb)
        mem += gbuf
    budget = int(sm.alloc_capacity // MEM_UNIT)
    mdl.Add(mem <= budget)
    od, oe = sm._step_state
    mdl.Add(_mq(od * pda + oe * pea) * na + _mq(od * pdb + oe * peb) * nb + _mq(od * const_dense) <= budget)


def _chunk_values(cx: _Context, chunks: list[int]) -> list[int]:
    """Values of :func:`_chunk_vars`' variables for layers per (virtual) stage ``chunks``."""
    return [sum(chunks[c] for c in mine) for mine in cx.sm.placement] if cx.single else chunks


def _restrict(cx: _Context, chunks: list[cp_model.IntVar], ranks: list[_Rank], *, even_split: bool,
              uniform_recompute: bool) -> None:
    """``even_split``: the default split only; ``uniform_recompute``: rank 0's recompute on every rank."""
    if even_split:
        for var, value in zip(chunks, _chunk_values(cx, cx.sm.default_chunks())):
            cx.mdl.Add(var == value)
    if uniform_recompute:
        for rk in ranks[1:]:
            for kind, count in rk.rec.items():
                cx.mdl.Add(count == ranks[0].rec[kind])


def _objective(cx: _Context, chunks: list[cp_model.IntVar],
               ranks: list[_Rank]) -> tuple[cp_model.LinearExprT, int]:
    """(objective, scale): the schedule's step formula over the ranks' T (F for zero-bubble) plus the
    slowest tail, in units of ``unit / S / scale`` seconds, plus tie-breakers worth < 1e-9 of it."""
    mdl, p, v, m, big_time = cx.mdl, cx.p, cx.v, cx.sm.m, cx.big_time
    stage_T = [rk.T for rk in ranks]
    t_max = mdl.NewIntVar(0, big_time, "Tmax")
    for t in stage_T:
        mdl.Add(t_max >= t)
    tail_max = mdl.NewIntVar(0, big_time, "Tail")
    for rk in ranks:
        mdl.Add(tail_max >= rk.tail)
    if p == 1:
        objective, scale = m * t_max + tail_max, 1
    else:  # the schedule's step formula (planner.cost.pipeline.SCHEDULES)
        objective, scale = SCHEDULES[cx.sm.layout.schedule].cpsat(mdl, stage_T, [rk.F for rk in ranks], t_max,
                                                                  tail_max, m, v, big_time)
    # among equally fast solutions prefer the one recomputing least (adds < 1e-9 of the objective)
    # and, for interleaving, chunks (one kind: ranks' counts) as even as the step time allows
    c_max = mdl.NewIntVar(1, cx.L, "cmax")
    for c in chunks:
        mdl.Add(c_max >= c)
    objective = objective + sum(count for rk in ranks for count in rk.rec.values()) + c_max
    return objective, scale


def _solve(cx: _Context, chunks: list[cp_model.IntVar], ranks: list[_Rank], scale: int, time_limit_s: float,
           workers: int) -> StageSolution:
    """Solve the model and read the split (one kind: each rank's count spread over its chunks r, r+p, ...
    as evenly as possible, larger first) and each rank's recompute back."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_search_workers = workers
    # the full linearization of the enforced constraints (recompute kind, exposed-comm minima,
    # the zero-bubble F*) into the LP: on the 63 leaves the benchmark's fast and expert searches
    # send to CP-SAT, 1.6 s in all instead of 3.6 s (worst leaf 0.14 s instead of 0.53 s), the
    # same status and objective on every leaf; with the F* bound alone two leaves stop FEASIBLE
    solver.parameters.linearization_level = 2
    status = solver.Solve(cx.mdl)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return StageSolution([], [], name, None, solver.WallTime())
    v = cx.v
    sol_chunks = [solver.Value(c) for c in chunks]
    if cx.single:  # each rank's count over its chunks, as even as it allows (the first ones one larger)
        per_rank, sol_chunks = sol_chunks, [0] * (cx.p * v)
        for n, mine in zip(per_rank, cx.sm.placement):
            for k, c in enumerate(mine):
                sol_chunks[c] = n // v + (1 if k < n % v else 0)
    rec: list[tuple[Recompute, int]] = []
    for rk in ranks:
        used = [(kind, solver.Value(count)) for kind, count in rk.rec.items() if solver.Value(count)]
        rec.append(used[0] if used else (Recompute.none, 0))
    objective_s = solver.ObjectiveValue() * cx.unit / S / scale
    return StageSolution(sol_chunks, rec, name, objective_s, solver.WallTime())


def _optimizer_affine(sm: StageModel) -> tuple[float, float, float]:
    """Optimizer step seconds as ``alpha + sd·dense + se·experts`` (a rank always holds some dense params)."""
    x1, x2 = 1e6, 1e9
    sd = (sm.optimizer_s(x2, 0.0) - sm.optimizer_s(x1, 0.0)) / (x2 - x1)
    alpha = sm.optimizer_s(x1, 0.0) - sd * x1
    se = (sm.optimizer_s(x1, x2) - sm.optimizer_s(x1, x1)) / (x2 - x1)
    return sd, se, alpha

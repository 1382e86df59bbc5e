"""CP-SAT: give layers to pipeline stages and choose recompute per stage for one candidate layout.

The decision: ``c_j`` layers in each (virtual) stage ``j`` (contiguous, ``≥ 1``, summing to the
model's layers) and, per pipeline rank, a recompute kind (selective or full) with a count of its
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

from planner.contracts import Recompute, Schedule
from planner.search.stages import StageModel

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


def solve_stages(sm: StageModel, time_limit_s: float = 2.0, hint: tuple[list[int], list[tuple[Recompute, int]]] | None = None,
                 workers: int = 2, upper_bound_s: float | None = None, *, even_split: bool = False,
                 uniform_recompute: bool = False) -> StageSolution:
    """Best split and per-stage recompute of ``sm``'s candidate; INFEASIBLE if no split fits memory.
    ``even_split``: only the default split; ``uniform_recompute``: one kind and count on every rank (what a
    target that cannot run more accepts, ``planner.targets.TargetSpec``)."""
    prefix = layer_kind_prefix(sm)
    if prefix is None:
        raise ValueError("blocks are not a prefix of one kind followed by the other; use the default split")
    kind_a, d_count = prefix
    kind_b = not kind_a
    L, p, v, m = sm.model.num_layers, sm.p, sm.v, sm.m
    n_chunks = p * v
    ka = sm.kind_cost[kind_a]
    kb = sm.kind_cost.get(kind_b)

    # unit: a rank's average forward+backward is ~1e6 units
    total = L * (ka.forward_s + ka.backward_s[Recompute.none]) + sum(sm.emb) + sum(sm.head)
    unit = max(total / p / 1e6, 1e-12)

    def q(seconds: float) -> int:
        return int(round(seconds / unit))

    eff_int = int(round(sm.eff * S))
    mdl = cp_model.CpModel()
    # one block kind: a rank's time and memory depend only on how many blocks it holds, not on how
    # they fall into its v chunks, so the decision is one count per rank (p variables instead of
    # p·v interchangeable chunk sizes, which only slow the proof down); the chunks are then as
    # even as each rank's count allows
    single = d_count == L
    if single:
        rank_n = [mdl.NewIntVar(v, L, f"n{r}") for r in range(p)]
        mdl.Add(sum(rank_n) == L)
        chunks = rank_n
    else:
        chunks = [mdl.NewIntVar(1, L, f"c{j}") for j in range(n_chunks)]
        mdl.Add(sum(chunks) == L)
        bounds = [mdl.NewConstant(0)]
        for j in range(n_chunks):
            b = mdl.NewIntVar(0, L, f"B{j + 1}")
            mdl.Add(b == bounds[-1] + chunks[j])
            bounds.append(b)
        # blocks of kind a in each chunk: min(B_{j+1}, D) - min(B_j, D)
        capped = []
        for j, b in enumerate(bounds):
            cb = mdl.NewIntVar(0, d_count, f"mB{j}")
            mdl.AddMinEquality(cb, [b, mdl.NewConstant(d_count)])
            capped.append(cb)
        a_in_chunk = [capped[j + 1] - capped[j] for j in range(n_chunks)]

    # a bound on any stage's time (base units): every layer fully recomputed, all traffic exposed
    all_dense = L * max(ka.dense_params, kb.dense_params if kb else 0.0) + sm.emb_params + sm.head_params
    all_expert = L * max(ka.expert_params, kb.expert_params if kb else 0.0)
    worst_s = (L * max(k.forward_s + k.backward_s[Recompute.full] for k in sm.kind_cost.values()) + sum(sm.emb)
               + sum(sm.head) + 2 * v * sm.p2p_s + 3 * sum(sm.traffic(all_dense, all_expert))
               + sm.optimizer_s(all_dense, all_expert))
    ub_units = 2 * q(worst_s) + 10
    big_time = S * ub_units
    stage_T, stage_F, tails, rs_vars, rf_vars = [], [], [], [], []
    for r in range(p):
        first, last = r == 0, r == p - 1
        if single:
            n = na = rank_n[r]
            nb = mdl.NewConstant(0)
        else:
            mine = [c * p + r for c in range(v)]
            n = mdl.NewIntVar(1, L, f"n{r}")
            mdl.Add(n == sum(chunks[j] for j in mine))
            na = mdl.NewIntVar(0, min(L, d_count), f"na{r}")
            mdl.Add(na == sum(a_in_chunk[j] for j in mine))
            nb = mdl.NewIntVar(0, L - d_count, f"nb{r}")
            mdl.Add(nb == n - na)
        # recompute: one kind per rank, a count of its layers (kind-a blocks come first in the rank)
        zsel = mdl.NewBoolVar(f"sel{r}")
        rs = mdl.NewIntVar(0, L, f"Rs{r}")
        rf = mdl.NewIntVar(0, L, f"Rf{r}")
        mdl.Add(rs + rf <= n)
        mdl.Add(rs == 0).OnlyEnforceIf(zsel.Not())
        mdl.Add(rf == 0).OnlyEnforceIf(zsel)
        ras = mdl.NewIntVar(0, L, f"ras{r}")
        raf = mdl.NewIntVar(0, L, f"raf{r}")
        mdl.AddMinEquality(ras, [rs, na])
        mdl.AddMinEquality(raf, [rf, na])
        rbs, rbf = rs - ras, rf - raf

        def kcoef(attr_a: float, attr_b: float) -> tuple[float, float]:
            return attr_a, (attr_b if kb is not None else 0.0)

        fa, fb = kcoef(ka.forward_s, kb.forward_s if kb else 0.0)
        ba, bb = kcoef(ka.backward_s[Recompute.none], kb.backward_s[Recompute.none] if kb else 0.0)
        dsa = ka.backward_s[Recompute.selective] - ba
        dfa = ka.backward_s[Recompute.full] - ba
        dsb = (kb.backward_s[Recompute.selective] - bb) if kb else 0.0
        dfb = (kb.backward_s[Recompute.full] - bb) if kb else 0.0
        const_f = (sm.emb[0] if first else 0.0) + (sm.head[0] if last else 0.0) + v * sm.p2p_s
        const_b = (sm.emb[1] if first else 0.0) + (sm.head[1] if last else 0.0) + v * sm.p2p_s
        F = q(fa) * na + q(fb) * nb + q(const_f)
        B = q(ba) * na + q(bb) * nb + q(dsa) * ras + q(dsb) * rbs + q(dfa) * raf + q(dfb) * rbf + q(const_b)

        # parameters the rank holds (as linear expressions of na, nb)
        pda, pdb = ka.dense_params, (kb.dense_params if kb else 0.0)
        pea, peb = ka.expert_params, (kb.expert_params if kb else 0.0)
        const_dense = (sm.emb_params if first else 0.0) + (sm.head_params if last else 0.0)
        moe_count = None
        if pea > 0 or peb > 0:
            moe_count = na if pea > 0 else nb
        has_experts = mdl.NewBoolVar(f"exp{r}")
        if moe_count is None:
            mdl.Add(has_experts == 0)
        else:
            mdl.Add(moe_count >= 1).OnlyEnforceIf(has_experts)
            mdl.Add(moe_count == 0).OnlyEnforceIf(has_experts.Not())

        def affine_time(which: str) -> cp_model.LinearExpr:
            """``which`` data-parallel collective of this rank, in base units."""
            d, e = sm.dense_dp[which], sm.expert_dp[which]
            expr = q(d.slope * pda) * na + q(d.slope * pdb) * nb + q(d.alpha + d.slope * const_dense)
            if moe_count is not None:
                expr += q(e.slope * pea) * na + q(e.slope * peb) * nb + q(e.alpha) * has_experts
            return expr

        grad, replica, gather = affine_time("grad"), affine_time("replica"), affine_time("gather")
        gpm = sm.gathers_per_mb
        gather_f = gather if gpm else 0
        gather_b = (gpm - 1) * gather if gpm else 0
        grad_mb = grad if sm.grads_per_mb else 0

        def exposed_scaled(comm, window, name: str):  # noqa: ANN001, ANN202
            """S·(comm - eff·min(comm, window)) for base-unit expressions."""
            if isinstance(comm, int) and comm == 0:
                return 0
            h = mdl.NewIntVar(0, ub_units, f"h_{name}{r}")
            # h <= min(comm, window): every objective term grows with the exposed time, so the
            # solver sets h to the minimum itself (no equality needed)
            mdl.Add(h <= comm)
            mdl.Add(h <= window)
            return S * comm - eff_int * h

        Fs = S * F + exposed_scaled(gather_f, F, "f")
        Bs = S * B + exposed_scaled(gather_b + grad_mb, B, "b")
        T = mdl.NewIntVar(0, big_time, f"T{r}")
        mdl.Add(T == Fs + Bs)
        Fv = mdl.NewIntVar(0, big_time, f"F{r}")
        mdl.Add(Fv == Fs)
        # once-per-step tail: windows are the stage's own backward / forward (base units, floored)
        grad_step = replica + (0 if sm.grads_per_mb else grad)
        gather_step = 0 if gpm else gather
        opt_d, opt_e, opt_a = _optimizer_affine(sm)
        opt = q(opt_a + opt_d * const_dense) + q(opt_d * pda) * na + q(opt_d * pdb) * nb + q(opt_e * pea) * na + q(opt_e * peb) * nb
        # once-per-step traffic hides behind the stage's compute (the per-micro-batch traffic's links are busy)
        tail = exposed_scaled(grad_step, B, "gs") + exposed_scaled(gather_step, F, "ps") + S * opt
        stage_T.append(T)
        rs_vars.append(rs)
        rf_vars.append(rf)
        stage_F.append(Fv)
        tails.append(tail)

        # memory (64-byte units, rounded up)
        def mq(nbytes: float) -> int:
            return int(-(-nbytes // MEM_UNIT))

        lay = sm.layout
        per_dense, per_expert = sm._state_dense, sm._state_expert
        fl = sm.in_flight[r]
        Aa, Ab = ka.activations, (kb.activations if kb else {k: 0.0 for k in Recompute})
        mem = (mq(per_dense * pda + per_expert * pea + fl * Aa[Recompute.none]) * na
               + mq(per_dense * pdb + per_expert * peb + fl * Ab[Recompute.none]) * nb
               - int((fl * (Aa[Recompute.none] - Aa[Recompute.selective])) // MEM_UNIT) * ras
               - int((fl * (Ab[Recompute.none] - Ab[Recompute.selective])) // MEM_UNIT) * rbs
               - int((fl * (Aa[Recompute.none] - Aa[Recompute.full])) // MEM_UNIT) * raf
               - int((fl * (Ab[Recompute.none] - Ab[Recompute.full])) // MEM_UNIT) * rbf
               + mq(per_dense * const_dense + (fl * sm.emb_act if first else 0.0)
                    + (sm.logits if last else 0.0)))
        # a fully recomputed block rebuilds all of its activations for a moment
        ua, ub = mdl.NewBoolVar(f"ua{r}"), mdl.NewBoolVar(f"ub{r}")
        mdl.Add(raf == 0).OnlyEnforceIf(ua.Not())
        mdl.Add(rbf == 0).OnlyEnforceIf(ub.Not())
        transient = mdl.NewIntVar(0, mq(max(Aa[Recompute.none], Ab[Recompute.none])), f"tr{r}")
        mdl.Add(transient >= mq(Aa[Recompute.none])).OnlyEnforceIf(ua)
        mdl.Add(transient >= mq(Ab[Recompute.none])).OnlyEnforceIf(ub)
        mem += transient
        if sm.block_buffer > 0:  # ZeRO-2/3: the biggest held block's gathered weights / unsharded gradients
            ga, gb = mdl.NewBoolVar(f"ga{r}"), mdl.NewBoolVar(f"gb{r}")
            mdl.Add(na == 0).OnlyEnforceIf(ga.Not())
            mdl.Add(nb == 0).OnlyEnforceIf(gb.Not())
            w = sm.block_buffer
            gbuf = mdl.NewIntVar(0, mq(w * max(ka.gather_params, kb.gather_params if kb else 0.0)), f"gbuf{r}")
            mdl.Add(gbuf >= mq(w * ka.gather_params)).OnlyEnforceIf(ga)
            if kb is not None:
                mdl.Add(gbuf >= mq(w * kb.gather_params)).OnlyEnforceIf(gb)
            mem += gbuf
        budget = int(sm.alloc_capacity // MEM_UNIT)
        mdl.Add(mem <= budget)
        # the optimizer step: model states and its temporaries (the activations are gone by then)
        od, oe = sm._step_state
        mdl.Add(mq(od * pda + oe * pea) * na + mq(od * pdb + oe * peb) * nb + mq(od * const_dense) <= budget)

        if hint is not None:
            kind, count = hint[1][r]
            mdl.AddHint(zsel, kind is Recompute.selective)
            mdl.AddHint(rs, count if kind is Recompute.selective else 0)
            mdl.AddHint(rf, count if kind is Recompute.full else 0)

    if even_split:
        default = sm.default_chunks()
        fixed = [sum(default[c * p + r] for c in range(v)) for r in range(p)] if single else default
        for var, value in zip(chunks, fixed):
            mdl.Add(var == value)
    if uniform_recompute:
        for r in range(1, p):
            mdl.Add(rs_vars[r] == rs_vars[0])
            mdl.Add(rf_vars[r] == rf_vars[0])
    if hint is not None:
        values = [sum(hint[0][c * p + r] for c in range(v)) for r in range(p)] if single else hint[0]
        for var, value in zip(chunks, values):
            mdl.AddHint(var, value)

    t_max = mdl.NewIntVar(0, big_time, "Tmax")
    for t in stage_T:
        mdl.Add(t_max >= t)
    tail_max = mdl.NewIntVar(0, big_time, "Tail")
    for t in tails:
        mdl.Add(tail_max >= t)
    schedule = sm.layout.schedule
    if p == 1:
        objective = m * t_max + tail_max
        scale = 1
    elif schedule is Schedule.interleaved_1f1b:
        objective = (v * m - 1) * t_max + sum(stage_T) + v * tail_max
        scale = v
    elif schedule is Schedule.zero_bubble:
        z = [mdl.NewBoolVar(f"z{r}") for r in range(p)]
        mdl.AddExactlyOne(z)
        f_star = mdl.NewIntVar(0, big_time, "Fstar")
        for r in range(p):
            mdl.Add(stage_T[r] >= t_max).OnlyEnforceIf(z[r])
            mdl.Add(f_star <= stage_F[r]).OnlyEnforceIf(z[r])
        # redundant (F* is the forward of a rank at t_max, and a rank's forward is part of its
        # time), but without it the LP relaxation lets F* run to its domain's end and the
        # objective bound goes negative: the solver then proves optimality by search alone
        # (0.25-0.5 s for DeepSeek-V3's pp32 leaves; 0.06 s with it)
        mdl.Add(f_star <= t_max)
        objective = m * t_max + sum(stage_F) - f_star + tail_max
        scale = 1
    else:
        objective = (m - 1) * t_max + sum(stage_T) + tail_max
        scale = 1
    # among equally fast solutions prefer the one recomputing least (adds < 1e-9 of the objective)
    # and, for interleaving, chunks (one kind: ranks' counts) as even as the step time allows
    c_max = mdl.NewIntVar(1, L, "cmax")
    for c in chunks:
        mdl.Add(c_max >= c)
    objective = objective + sum(rs_vars) + sum(rf_vars) + c_max
    if upper_bound_s is not None:
        mdl.Add(objective <= int(upper_bound_s / unit * S * scale) + 1)
    mdl.Minimize(objective)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_search_workers = workers
    # the full linearization of the enforced constraints (recompute kind, exposed-comm minima,
    # the zero-bubble F*) into the LP: on the 63 leaves the benchmark's fast and expert searches
    # send to CP-SAT, 1.6 s in all instead of 3.6 s (worst leaf 0.14 s instead of 0.53 s), the
    # same status and objective on every leaf; with the F* bound alone two leaves stop FEASIBLE
    solver.parameters.linearization_level = 2
    status = solver.Solve(mdl)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return StageSolution([], [], name, None, solver.WallTime())
    sol_chunks = [solver.Value(c) for c in chunks]
    if single:  # rank r's count over its chunks r, r+p, ...: as even as possible, larger first
        per_rank = sol_chunks
        sol_chunks = [per_rank[j % p] // v + (1 if j // p < per_rank[j % p] % v else 0) for j in range(n_chunks)]
    rec: list[tuple[Recompute, int]] = []
    for r in range(p):
        rs_v, rf_v = solver.Value(rs_vars[r]), solver.Value(rf_vars[r])
        if rf_v:
            rec.append((Recompute.full, rf_v))
        elif rs_v:
            rec.append((Recompute.selective, rs_v))
        else:
            rec.append((Recompute.none, 0))
    return StageSolution(sol_chunks, rec, name, solver.ObjectiveValue() * unit / S / scale, solver.WallTime())


def _optimizer_affine(sm: StageModel) -> tuple[float, float, float]:
    """Optimizer step seconds as ``alpha + sd·dense + se·experts`` (a rank always holds some dense params)."""
    x1, x2 = 1e6, 1e9
    sd = (sm.optimizer_s(x2, 0.0) - sm.optimizer_s(x1, 0.0)) / (x2 - x1)
    alpha = sm.optimizer_s(x1, 0.0) - sd * x1
    se = (sm.optimizer_s(x1, x2) - sm.optimizer_s(x1, x1)) / (x2 - x1)
    return sd, se, alpha

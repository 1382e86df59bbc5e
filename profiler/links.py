"""Link measurements: collectives and point-to-point per level and group size, fitted to α-β.

Contract: :func:`measure_links` runs on every rank with the same :class:`LinkPlan` and returns, on every
rank, the fitted :class:`~planner.contracts.LinkProfile` entries. Every collective is timed on the *full
buffer* the planner prices (:func:`planner.cost.comm.collective_time_s`): the all-reduce input, the
all-gather output, the reduce-scatter input, each rank's all-to-all buffer, the point-to-point message.
A rank's time for a size is its fastest trial; the time recorded is the maximum over ranks.

The points are fitted by :mod:`profiler.fit` (α-β, minimax in the relative error, piecewise).
How the trials are scheduled on shared machines (interleaved rounds, one group per crowded host,
re-measurement of spoiled points) and why: ``docs/profiler.md``, "How links are timed".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from planner.contracts import Collective, LinkLevel, LinkProfile
from planner.contracts.cluster import TimedPoint
from profiler.fit import fit_link_segments

COLLECTIVES = (Collective.all_reduce, Collective.all_gather, Collective.reduce_scatter, Collective.all_to_all,
               Collective.p2p)
KIB, MIB = 1024, 1024 * 1024
DEFAULT_MIN_BYTES = 4 * KIB
DEFAULT_MAX_BYTES = 256 * MIB
QUICK_MAX_BYTES = 16 * MIB
HOST_MIN_MAX_BYTES = 64 * MIB  # host<->device copies are measured to this size at least


# ------------------------------------------------------------------------------------------- sizes


QUICK_DENSE_FROM_BYTES = MIB  # a quick profile steps 4x below this size and 2x from it


def message_sizes(min_bytes: int = DEFAULT_MIN_BYTES, max_bytes: int = DEFAULT_MAX_BYTES,
                  quick: bool = False) -> list[int]:
    """Powers of two from ``min_bytes`` to ``max_bytes`` (both included): every 2x; when quick, every
    4x below 1 MiB and 2x from there. Large messages are where the buffers leave the caches (a few
    MiB on a CPU) and transports switch protocol, and where the planner's gradient and parameter
    traffic lives; a segment of the piecewise fit needs 3 points past such a step."""
    sizes, s = [], max(1, int(min_bytes))
    while s < max_bytes:
        sizes.append(s)
        s *= 4 if quick and s < QUICK_DENSE_FROM_BYTES else 2
    sizes.append(int(max_bytes))
    return sorted(set(sizes))


def reps_for(nbytes: int) -> int:
    """Back-to-back calls per trial: many for small messages (latency-bound), one for large ones."""
    if nbytes <= 64 * KIB:
        return 8
    if nbytes <= MIB:
        return 4
    if nbytes <= 8 * MIB:
        return 2
    return 1


def reps_within(nbytes: int, call_s: float, min_trial_s: float) -> int:
    """Back-to-back calls per trial for a size whose call takes ``call_s``: :func:`reps_for`'s count,
    cut to the fewest calls that last ``min_trial_s`` (at least 1). The count by size is there so the
    barrier's exit skew does not dominate a trial of fast calls; a slow call needs fewer to outlast it
    (a 4 KiB all-reduce of 4 gloo ranks on 2 vCPUs took 2-5 ms a call, so its 8 calls a trial took
    40 ms where 2 outlast the 1.6 ms barrier several times over, and the 4-rank group's jobs took
    16 s of a quick profile's 41 s first pass). Shorter trials did not read slower there: the fastest of
    15 trials (max over ranks, median of 4 repeats) was 3.9 ms a call with 1 call per trial, 4.2 with 2
    and 4.9 with 8; longer trials catch more of the scheduler's slices than the barrier's skew adds to
    short ones."""
    most = reps_for(nbytes)
    if min_trial_s <= 0 or not math.isfinite(call_s):
        return most
    return max(1, min(most, math.ceil(min_trial_s / max(call_s, 1e-9))))


SMALL_TRIALS_MAX_BYTES = 256 * KIB
SMALL_TRIALS_FACTOR = 3


def trials_for(nbytes: int, trials: int) -> int:
    """Trials of one size: 3x for messages up to 256 KiB. Those calls are latency-bound and cheap
    (8 calls of well under a millisecond each on an idle link), and their time is the one a busy
    host spoils most: the fastest of more trials is what the link can do."""
    return trials * SMALL_TRIALS_FACTOR if nbytes <= SMALL_TRIALS_MAX_BYTES else trials


INTERLEAVE_MAX_BYTES = 16 * MIB  # sizes up to this are timed in round-robin rounds (their buffers stay allocated)


def buffer_bytes_per_rank(collective: Collective, nbytes: int, group_size: int) -> int:
    """Bytes of tensors one rank allocates to run ``collective`` on an ``nbytes`` buffer."""
    if collective is Collective.all_gather:
        return nbytes + nbytes // group_size  # output + input shard
    if collective is Collective.reduce_scatter:
        return nbytes + nbytes // group_size
    return 2 * nbytes  # all-reduce (tensor + spare), all-to-all in/out, p2p send/recv


# --------------------------------------------------------------------------------------------- fit


@dataclass
class GroupSpec:
    """A set of disjoint groups measured concurrently (every rank is in at most one of them)."""

    level: LinkLevel
    size: int
    per_node: int
    ranks: list[list[int]]
    label: str
    collectives: tuple[Collective, ...] = COLLECTIVES


@dataclass
class LinkPlan:
    """What :func:`measure_links` times. ``one_group_at_a_time``: of the disjoint groups of a spec
    that share a host, only one is timed, with the other ranks of that host idle, instead of all
    side by side (:func:`oversubscribed`: when a host runs more ranks than it has cores, side-by-side
    groups time the OS scheduler, not the link, and the groups all run on the same cores); groups on
    different hosts still run side by side (the first wave of :func:`host_waves`). ``hosts``: each
    rank's host name (None: all on one host)."""

    specs: list[GroupSpec]
    sizes: list[int]
    trials: int = 5
    warmup: int = 1
    notes: list[str] = field(default_factory=list)
    one_group_at_a_time: bool = False
    hosts: list[str] | None = None
    crowded_hosts: set[str] | None = None  # the hosts with more ranks than cores (None: all of them)
    timeout: timedelta | None = None  # of the sub-groups' collectives (None: torch's default for the backend)
    min_trial_s: float = 0.0  # > 0: calls per trial cut to what lasts this long (:func:`reps_within`)


def host_waves(groups: list[list[int]], hosts: list[str] | None) -> list[list[list[int]]]:
    """The groups split into waves in which no two groups share a host, in order (first fit): the
    groups of one wave are timed side by side, the waves one after the other. Intra-node pairs of
    different machines share a wave; every group gets a wave of its own when all ranks sit on one
    host (``hosts`` None, or emulated nodes). Groups that span several hosts stay side by side in
    one wave: in training they share each host's network link, and timed alone each would have it
    to itself (its bandwidth overstated by up to the ranks per host)."""
    if hosts is not None and any(len({hosts[r] for r in group}) > 1 for group in groups):
        return [groups]
    waves: list[tuple[set[str], list[list[int]]]] = []
    for group in groups:
        used = {hosts[r] for r in group} if hosts is not None else {""}
        for taken, members in waves:
            if not taken & used:
                taken |= used
                members.append(group)
                break
        else:
            waves.append((set(used), [group]))
    return [members for _, members in waves]


def timed_groups(waves: list[list[list[int]]], hosts: list[str] | None,
                 crowded: set[str] | None) -> list[list[int]]:
    """The groups timed, side by side, from :func:`host_waves`' ``waves``: the first wave (one group
    per host; the groups of later waves share those hosts, first fit), plus every later group whose
    hosts all have a core per rank (not in ``crowded``; None: every host is crowded), which has the
    cores to run beside the others."""
    if crowded is None or hosts is None:
        return waves[0]
    return [*waves[0], *(g for w in waves[1:] for g in w if not any(hosts[r] in crowded for r in g))]


def oversubscribed(local_ranks: int, cores: int) -> bool:
    """Whether a host's ranks outnumber its cores. gloo's receive thread polls its sockets while a
    message it has no buffer posted for is waiting (568 µs of CPU per 581 µs 2-rank 4 KiB all-reduce
    on this 2-vCPU VM), so each rank keeps a core busy while it waits; with more ranks
    than cores, a rank whose turn it is waits for a scheduler time slice. Measured here: a 4 KiB
    ping-pong between two ranks took 43-61 µs with the other pair idle and 0.1-1.7 ms, varying from
    trial to trial, with both pairs at it at once (4 ranks, 2 vCPUs)."""
    return local_ranks > max(1, cores)


def plan_groups(world: int, ranks_per_node: int, emulated: bool = False) -> list[GroupSpec]:
    """Intra-node groups of every power of two up to the node size, and the whole node where its size
    is not one (a 6-GPU node's TP or expert group of 6 is priced from its own measurement, not a
    group of 4's); across nodes one rank per node (and all ranks, if nodes hold more than one).
    Consecutive blocks of ``ranks_per_node`` ranks are nodes; an intra-node group never crosses one
    (a node of 6 holds one group of 4, ranks 0-3, not 4-7 reaching into the next node)."""
    nodes = world // ranks_per_node
    tag = " (emulated nodes)" if emulated else ""
    no_p2p = tuple(c for c in COLLECTIVES if c is not Collective.p2p)
    specs: list[GroupSpec] = []
    sizes = [1 << i for i in range(1, ranks_per_node.bit_length()) if 1 << i <= ranks_per_node]
    if ranks_per_node > 1 and ranks_per_node not in sizes:
        sizes.append(ranks_per_node)
    for size in sizes:
        groups = [list(range(node * ranks_per_node + start, node * ranks_per_node + start + size))
                  for node in range(nodes) for start in range(0, ranks_per_node - size + 1, size)]
        specs.append(GroupSpec(LinkLevel.intra_node, size, size, groups, f"intra-node x{size}{tag}",
                               collectives=COLLECTIVES if size == 2 else no_p2p))
    if nodes > 1:
        per_node_groups = [[node * ranks_per_node + local for node in range(nodes)] for local in range(ranks_per_node)]
        specs.append(GroupSpec(LinkLevel.inter_node, nodes, 1, per_node_groups,
                               f"across {nodes} nodes, 1 rank each{tag}",
                               collectives=COLLECTIVES if nodes == 2 else no_p2p))
        if nodes > 2:  # point-to-point between neighbouring nodes, pairs side by side
            pairs = [[2 * k * ranks_per_node + local, (2 * k + 1) * ranks_per_node + local]
                     for k in range(nodes // 2) for local in range(ranks_per_node)]
            specs.append(GroupSpec(LinkLevel.inter_node, 2, 1, pairs, f"across 2 nodes, pairs{tag}",
                                   collectives=(Collective.p2p,)))
        if ranks_per_node > 1:
            specs.append(GroupSpec(LinkLevel.inter_node, world, ranks_per_node, [list(range(world))],
                                   f"across {nodes} nodes, all {world} ranks{tag}", collectives=no_p2p))
    return specs


def _op(collective: Collective, nbytes: int, group, group_ranks: list[int], rank: int, device) -> Callable[[], None]:
    """One call of ``collective`` on an ``nbytes`` buffer in ``group`` (bytes as the planner counts them)."""
    import torch
    import torch.distributed as dist

    n = len(group_ranks)
    numel = max(n, nbytes // 4) // n * n  # float32, divisible by the group size
    if collective is Collective.all_reduce:
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if collective is Collective.all_gather:
        out = torch.empty(numel, device=device)
        inp = torch.ones(numel // n, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp, group=group)
    if collective is Collective.reduce_scatter:
        inp = torch.ones(numel, device=device)
        out = torch.empty(numel // n, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp, group=group)
    if collective is Collective.all_to_all:
        inp = torch.ones(numel, device=device)
        out = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    # p2p: ping-pong between the pair; one call = one message each way, timed as two one-way trips
    buf = torch.ones(numel, device=device)
    me = group_ranks.index(rank)
    peer = group_ranks[1 - me]

    def pingpong() -> None:
        if me == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)

    return pingpong


def _trial(op: Callable[[], None], reps: int, group, device, warm: int = 0) -> float:
    """One trial: ``warm`` untimed calls, a barrier of the group, then ``reps`` back-to-back calls;
    seconds per call."""
    import torch.distributed as dist

    from profiler.timing import sync

    for _ in range(warm):
        op()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(reps):
        op()
    sync(device)
    return (time.perf_counter() - t0) / reps


REMEASURE_ABOVE = 0.10  # a point more than 10% above what its neighbours say gets more trials ...
REMEASURE_ROUNDS = 2  # ... in up to 2 extra rounds (each as many trials as the first pass)


def remeasure_candidates(sizes: list[int], times: list[float], above: float = REMEASURE_ABOVE) -> list[int]:
    """Indices of the points that look inflated by other work on the machine: slower than a larger
    message of the same link (time cannot fall as the message grows), or more than ``above`` slower
    than its neighbours say: the interpolation between them with log time linear in log size (the
    largest size: extrapolated from the two below it, or proportional to size from the one below,
    whichever is slower). Judged against neighbours, not a fit through
    all the points, so one spoiled point neither drags the reference up nor hides in a segment of
    its own. Deterministic in ``times``, so every rank, holding the same all-reduced times, picks the
    same sizes. A true step (leaving a cache) may be timed again too; that costs trials, not accuracy."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    lb = [math.log(sizes[i]) for i in order]
    lt = [math.log(max(times[i], 1e-12)) for i in order]
    out: set[int] = set()
    n = len(order)
    for j in range(n - 1):
        if lt[j] > lt[j + 1]:
            out.add(order[j])
    for j in range(1, n):
        a, b = (j - 1, j + 1) if j + 1 < n else (j - 2, j - 1)
        if a < 0:
            continue
        ref = lt[a] + (lt[b] - lt[a]) * (lb[j] - lb[a]) / (lb[b] - lb[a])
        if j == n - 1:  # extrapolated: at least proportional to size (bandwidth-bound) from the one below
            ref = max(ref, lt[j - 1] + lb[j] - lb[j - 1])
        if lt[j] > ref + math.log1p(above):
            out.add(order[j])
    return sorted(out)


def remeasured_fastest(series: int, sizes: list[int], time_sizes: Callable[[int, list[int], int], list[float]],
                       reduce: Callable[[int, list[float]], list[float]] = lambda s, ts: ts,
                       rounds: int = REMEASURE_ROUNDS) -> tuple[list[list[float]], list[list[int]]]:
    """Time every size of every series (a link, a copy direction), then re-time the suspects
    (:func:`remeasure_candidates`) and keep the fastest of all trials: the first pass's estimator,
    given more trials where it looks spoiled. The extra rounds run after *all* series' first
    passes, so a point spoiled by a burst of other work is timed again seconds later, not inside
    the same burst.

    ``time_sizes(series, indices, round)`` returns this process's fastest trial of each size it is
    given (round 0: all of them); ``reduce(series, times)`` turns this process's times into the
    ones everybody agrees on (max over ranks). Returns the times and the extra rounds each size got.
    """
    local = [time_sizes(s, list(range(len(sizes))), 0) for s in range(series)]
    times = [reduce(s, list(local[s])) for s in range(series)]
    extra = [[0] * len(sizes) for _ in range(series)]
    for r in range(1, rounds + 1):
        for s in range(series):
            suspects = remeasure_candidates(sizes, times[s])
            if not suspects:
                continue
            for i, t in zip(suspects, time_sizes(s, suspects, r)):
                local[s][i] = min(local[s][i], t)
                extra[s][i] += 1
            times[s] = reduce(s, list(local[s]))
    return times, extra


def _interleaved_fastest(ops: dict[int, tuple[Callable[[], None], int, int]], group, device) -> dict[int, float]:
    """Round-robin trials: each round times every size that still has trials to go once, so a burst
    of other work spoils one trial of several sizes rather than every trial of one size; the fastest
    trial of each. ``ops``: size index -> (call, reps per trial, trials)."""
    best = {j: math.inf for j in ops}
    for round_ in range(max((t for _, _, t in ops.values()), default=0)):
        for j, (op, reps, trials) in ops.items():
            if round_ >= trials:
                continue
            # one untimed call first: the size before it (a 16 MiB one, for the 4 KiB that
            # opens a round) left the caches cold for this buffer
            best[j] = min(best[j], _trial(op, reps, group, device, warm=1))
    return best


def _remeasure_note(extra: list[int], trials: int) -> str:
    """What a link's ``source`` says of its re-measurement (:func:`remeasured_fastest`)."""
    again = sum(1 for x in extra if x)
    return (f"{again} of {len(extra)} sizes re-measured after all links (slower than a larger size or more than "
            f"{REMEASURE_ABOVE:.0%} above its neighbours' log-log interpolation; up to {max(extra, default=0)} more "
            f"round(s) of {trials} trials); piecewise α-β, minimax relative error")


def measure_links(plan: LinkPlan, device, progress: Callable[[str, int, int], None] | None = None,
                  fail_hook: Callable[[str], None] | None = None) -> list[LinkProfile]:
    """Run on every rank of the world (all ranks must call it with the same plan); returns the fitted
    links on every rank (times are reduced to the slowest rank with an all-reduce MAX)."""
    import torch
    import torch.distributed as dist

    from profiler.timing import sync

    rank, world = dist.get_rank(), dist.get_world_size()
    jobs, leaders, timed = _link_jobs(plan, rank, world)
    # the ranks sitting a job out wait on the rendezvous store, not in a collective: a collective's
    # messages would reach the busy ranks before they post a receive, and gloo's receive thread
    # polls until they do (oversubscribed); the store lives in torchrun's agent, apart from the ranks.
    # Without a store, all ranks meet in a barrier after each job instead.
    store = _store() if any(leaders) else None
    global _CALLS
    _CALLS += 1
    total = len(jobs) * len(plan.sizes)
    done = 0
    reps_by_job: dict[int, dict[int, int]] = {}
    sizes = plan.sizes

    def time_sizes(job: int, indices: list[int], round_: int) -> list[float]:
        """This rank's fastest trial of each size (0 on a rank outside every group of the job)."""
        nonlocal done
        spec, group, mine, collective = jobs[job]
        best: dict[int, float] = {}
        reps_of = reps_by_job.setdefault(job, {})  # set in the first pass, kept by the re-measurements
        ops: dict[int, tuple[Callable[[], None], int, int]] = {}  # small sizes: timed in interleaved rounds
        for i in indices:
            label = (f"{collective.value} {spec.label} {_human(sizes[i])}"
                     + (f" (again, round {round_})" if round_ else ""))
            if round_ == 0 and progress is not None:
                progress(label, done, total)
            if fail_hook is not None:
                fail_hook(label)
            if mine is None:
                best[i] = 0.0
            else:
                op = _op(collective, sizes[i], group, mine, rank, device)
                warm = plan.warmup * (reps_for(sizes[i]) if i == indices[0] else 1)  # the first also warms the group up
                call_s = math.inf
                for _ in range(warm):
                    t0 = time.perf_counter()
                    op()
                    sync(device)
                    call_s = min(call_s, time.perf_counter() - t0)
                if i not in reps_of:
                    reps_of[i] = reps_within(sizes[i], call_s, plan.min_trial_s)
                    if plan.min_trial_s > 0:  # the group agrees on the calls per trial: the most any rank wants
                        want = torch.tensor([reps_of[i]], device=device)
                        dist.all_reduce(want, op=dist.ReduceOp.MAX, group=group)
                        reps_of[i] = int(want.item())
                reps = reps_of[i]
                if sizes[i] <= INTERLEAVE_MAX_BYTES:
                    ops[i] = (op, reps, trials_for(sizes[i], plan.trials) if round_ == 0 else plan.trials)
                else:
                    best[i] = min(_trial(op, reps, group, device) for _ in range(plan.trials))
                del op
            if round_ == 0:
                done += 1
        if ops:
            best.update(_interleaved_fastest(ops, group, device))
        if leaders[job] and store is not None:
            key = f"autopar/links/{_CALLS}/{job}/{round_}/"
            if mine is None:  # a wave lasts far longer than one collective: not the collective timeout
                store.wait([key + str(lead) for lead in leaders[job]], STORE_WAIT)
            elif rank == mine[0]:
                store.set(key + str(rank), "done")
        elif leaders[job]:  # no store to wait on: everyone meets in a barrier after each job
            dist.barrier()
        p2p = collective is Collective.p2p
        return [best[i] / 2.0 if p2p else best[i] for i in indices]  # ping-pong: a trial is two messages

    def slowest_rank(job: int, local: list[float]) -> list[float]:
        t = torch.tensor(local, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # slowest rank of any group at this level
        return t.tolist()

    # the slowest rank of the groups timed (idle ranks reported 0)
    all_times, all_extra = remeasured_fastest(len(jobs), sizes, time_sizes, slowest_rank)
    links = _fitted_links(plan, jobs, all_times, all_extra, timed)
    if progress is not None:
        progress("links done", total, total)
    return links


LinkJob = tuple[GroupSpec, object, "list[int] | None", Collective]


def _link_jobs(plan: LinkPlan, rank: int, world: int) -> tuple[list[LinkJob], list[list[int]], list[int]]:
    """(jobs, leaders, timed): a job is one collective of one spec, all of its groups side by side or
    (one_group_at_a_time) the first wave of them (one per host) while the other ranks wait; a link's
    times are the max over the groups timed (its slowest group). ``leaders``: per job the first rank of
    each group that runs where some ranks sit it out; ``timed``: per job how many of its groups are timed.
    Every subgroup is created on every rank, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    handles: list[tuple[GroupSpec, object, list[int] | None]] = []
    for spec in plan.specs:
        mine = None
        my_group = None
        for ranks in spec.ranks:
            g = dist.new_group(ranks, timeout=plan.timeout) if len(ranks) < world else dist.group.WORLD
            if rank in ranks:
                mine, my_group = ranks, g
        handles.append((spec, my_group, mine))
    jobs: list[LinkJob] = []
    leaders: list[list[int]] = []
    timed: list[int] = []
    for spec, group, mine in handles:
        waves = host_waves(spec.ranks, plan.hosts) if plan.one_group_at_a_time else [spec.ranks]
        wave = timed_groups(waves, plan.hosts, plan.crowded_hosts)
        on = mine is not None and mine in wave
        for c in spec.collectives:
            jobs.append((spec, group if on else None, mine if on else None, c))
            leaders.append([g[0] for g in wave] if len(waves) > 1 else [])
            timed.append(len(wave))
    return jobs, leaders, timed


def _fitted_links(plan: LinkPlan, jobs: list[LinkJob], all_times: list, all_extra: list,
                  timed: list[int]) -> list[LinkProfile]:
    """Each job's times (slowest rank, fastest trial) fitted into link segments, with their source."""
    links: list[LinkProfile] = []
    per_trial = (f"calls per trial by size, cut to what lasts {plan.min_trial_s * 1e3:g} ms"
                 if plan.min_trial_s > 0 else "calls per trial by size")
    for (spec, _, _, collective), times, extra, n_timed in zip(jobs, all_times, all_extra, timed):
        points = [TimedPoint(bytes=b, time_s=max(float(t), 1e-9)) for b, t in zip(plan.sizes, times)]
        size = 2 if collective is Collective.p2p else spec.size
        side = (f"{n_timed} timed, one per host, the others' ranks idle (more ranks than cores on a host: side by "
                "side they would time the scheduler, and in turn they repeat the timed group's measurement on "
                "the same cores)" if n_timed < len(spec.ranks) else "timed side by side")
        source = (f"measured: {spec.label}, {len(spec.ranks)} group(s), {side}, {per_trial}, {plan.trials} trials "
                  f"({trials_for(1, plan.trials)} up to {_human(SMALL_TRIALS_MAX_BYTES)}; interleaved rounds up to "
                  f"{_human(INTERLEAVE_MAX_BYTES)}), fastest trial per rank, max over ranks; "
                  + _remeasure_note(extra, plan.trials))
        links.extend(fit_link_segments(spec.level, collective, size, spec.per_node, points, source))
    return links


_CALLS = 0  # measure_links calls in this process (every rank makes the same ones): store keys stay fresh
STORE_WAIT = timedelta(hours=1)  # a rank that dies ends the run sooner: torchrun stops the others


def _store():  # noqa: ANN202
    """The process group's rendezvous store, or None (then all ranks meet in a barrier after each job)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor; guarded
    except Exception:  # noqa: BLE001
        return None


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f} {unit}" if math.isclose(v, round(v)) else f"{v:.1f} {unit}"
    return f"{nbytes} B"


# ------------------------------------------------------------------------------------ host/device


COPY_MIN_TRIAL_S = 2e-4  # a copy trial repeats the copy for at least this long (profiler.timing sizes it)
COLD_CACHE_MULTIPLE = 2  # a CPU stand-in copy streams through arenas this many times the last-level cache
COLD_FALLBACK_CACHE_BYTES = 256 * MIB  # assumed when the cache size cannot be read
COLD_ARENA_MAX_BYTES = 4 * 1024 * MIB
COLD_ARENA_MEMORY_SHARE = 8  # each of the two arenas takes at most 1/8 of the available memory
PAGE_ELEMENTS = 1024  # float32 elements in 4 KiB: consecutive copies start on pages of their own


def cold_arena_bytes(max_copy_bytes: int, cache_bytes: int, available_bytes: int) -> int:
    """Bytes of each arena (source and destination) a CPU stand-in copy streams through: twice the
    last-level cache (``COLD_FALLBACK_CACHE_BYTES`` when unknown) and 4 copies of the largest size, at
    most ``COLD_ARENA_MAX_BYTES`` and 1/``COLD_ARENA_MEMORY_SHARE`` of the available memory, never
    less than the largest copy (then the two arenas take what its source and destination took, the
    2 buffers the memory check of ``autopar profile`` allows for). A multiple of 4 KiB."""
    want = max(COLD_CACHE_MULTIPLE * (cache_bytes or COLD_FALLBACK_CACHE_BYTES), 4 * max_copy_bytes)
    size = min(want, COLD_ARENA_MAX_BYTES, max(available_bytes, 0) // COLD_ARENA_MEMORY_SHARE)
    return _round_up(max(size, max_copy_bytes), 4 * PAGE_ELEMENTS)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ColdCopies:
    """Copies that read and write memory no recent copy touched, as a device's DMA engine does.

    In RAM a copy of a buffer that was just copied is served by the CPU caches (a 4 KiB copy in
    0.7 µs, 64 KiB at 34 GB/s, 1 MiB at 80 GB/s, then 29 GB/s out to 32 MiB and 22 GB/s at 64 MiB
    on a 2-vCPU VM with 2 threads), a curve no host link has and no line follows. So each copy takes
    the next slice of two arenas of ``arena_bytes`` (source and destination, starting on a page
    boundary, wrapping to the start): with arenas twice the last-level cache, a slice is touched again
    only after more than the cache's worth of other slices, so every copy streams DRAM (on the same
    VM: 3.8 µs + bytes / 7.3 GB/s from 4 KiB to 256 MiB, one thread). The slope is DRAM's, the rate
    an offloaded optimizer's states, far larger than any cache, move at; of the 3.8 µs, about 2.8 µs
    is building the two slices' views and the rest the copy's dispatch and DRAM latency (a real
    host-to-device ``copy_`` pays several µs of dispatch too)."""

    def __init__(self, arena_bytes: int) -> None:
        import torch

        self.numel = arena_bytes // 4
        self.a = torch.empty(self.numel)
        self.b = torch.empty(self.numel)
        self.a.fill_(1.0)  # touch every page now, not inside a timed copy
        self.b.fill_(0.0)
        self.offset = 0

    def slot(self, numel: int) -> int:
        """Start of the next slice of ``numel`` elements (page-aligned; wraps to 0 at the end)."""
        if numel > self.numel:
            raise ValueError(f"a copy of {numel * 4} B does not fit the {self.numel * 4} B arena")
        off = self.offset if self.offset + numel <= self.numel else 0
        self.offset = off + _round_up(numel, PAGE_ELEMENTS)
        return off

    def copy_fn(self, nbytes: int, forward: bool) -> Callable[[], None]:
        """One copy of ``nbytes`` per call, each from and to a fresh slice (``forward``: a to b)."""
        numel = max(1, nbytes // 4)
        src, dst = (self.a, self.b) if forward else (self.b, self.a)

        def copy() -> None:
            off = self.slot(numel)
            dst.narrow(0, off, numel).copy_(src.narrow(0, off, numel))

        return copy


def measure_host_device(device, sizes: list[int], trials: int = 5) -> tuple[list[LinkProfile], list[str]]:
    """Host↔device copy bandwidth (pinned; pageable noted). On CPU there is no device: host memory
    copies stand in (a "device" that *is* host memory), each streaming memory no recent copy touched
    (:class:`ColdCopies`), said in the source."""
    import torch

    from profiler.identity import available_memory_bytes, reachable_cache_bytes
    from profiler.timing import time_fn

    notes: list[str] = []
    is_cuda = getattr(device, "type", str(device)) == "cuda"
    out: list[LinkProfile] = []
    directions = [(Collective.host_to_device, True), (Collective.device_to_host, False)]
    pageable: dict[str, float] = {}
    cold: ColdCopies | None = None
    cold_text = ""
    if not is_cuda:
        cache = reachable_cache_bytes(threads=torch.get_num_threads())
        arena = cold_arena_bytes(max(sizes), cache, available_memory_bytes(device))
        cold = ColdCopies(arena)
        covers = cache and arena >= COLD_CACHE_MULTIPLE * cache
        cold_text = (f"; each copy streams a fresh page-aligned slice of two {_human(arena)} arenas "
                     + (f"({arena / cache:.1f}x the {_human(cache)} last-level cache), so it reads and writes "
                        "DRAM as a device's DMA would, not the cache" if covers else
                        f"(the last-level cache is {_human(cache) if cache else 'unknown'}: copies may partly hit it)"))

    def time_sizes(series: int, indices: list[int], round_: int) -> list[float]:
        to_device = directions[series][1]
        out_t = []
        for i in indices:
            if cold is not None:
                fn = cold.copy_fn(sizes[i], to_device)
            else:
                numel = max(1, sizes[i] // 4)
                host = torch.empty(numel, pin_memory=True)
                dev = torch.empty(numel, device=device)
                dst, src = (dev, host) if to_device else (host, dev)
                src.fill_(1.0)

                def fn(dst=dst, src=src) -> None:  # noqa: ANN001
                    dst.copy_(src, non_blocking=True)
            # a small copy takes microseconds: repeated until a trial lasts COPY_MIN_TRIAL_S, so
            # the trial times the copy, not the clock; the fastest trial
            out_t.append(time_fn(fn, device=device, warmup=1, trials=trials, min_time_s=COPY_MIN_TRIAL_S,
                                 hold=False).min_s)  # a copy's launch is part of its latency (alpha)
        return out_t

    all_times, all_extra = remeasured_fastest(len(directions), sizes, time_sizes)
    for (collective, to_device), times, extra in zip(directions, all_times, all_extra):
        points = [TimedPoint(bytes=max(1, b // 4) * 4, time_s=max(t, 1e-9)) for b, t in zip(sizes, times)]
        if is_cuda:
            # pageable, largest size only (what offload without pinning gets); written, so the copy
            # reads real pages rather than the kernel's shared zero page
            host = torch.ones(max(1, sizes[-1] // 4))
            dev = torch.ones_like(host, device=device)
            dst, src = (dev, host) if to_device else (host, dev)
            pageable[collective.value] = sizes[-1] / time_fn(lambda dst=dst, src=src: dst.copy_(src), device=device,
                                                             warmup=1, trials=trials, min_time_s=COPY_MIN_TRIAL_S,
                                                             hold=False).min_s
        src_text = ("measured: pinned host memory, tensor.copy_ on the device's stream" if is_cuda else
                    "CPU stand-in: no device on a CPU rank; host memory copy (tensor.copy_ in RAM) measured as "
                    "the host link so optimizer-offload plans can still be priced" + cold_text)
        src_text += f"; fastest of {trials} trials, " + _remeasure_note(extra, trials)
        out.extend(fit_link_segments(LinkLevel.host_device, collective, 1, 1, points, src_text))
    if is_cuda:
        notes.append("host<->device pageable (unpinned) copy bandwidth at the largest size: "
                     + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in pageable.items()))
    else:
        notes.append("CPU profile: there is no device, so no real host<->device link exists; the host_device "
                     "entries are RAM-to-RAM copies (pinned vs pageable does not apply) standing in for it")
    return out, notes


"""`autopar profile` under torchrun: validate, measure links on every rank and compute on rank 0,
assemble and validate a measured ``ClusterProfile`` on rank 0.

Order: everything that can be checked is checked *before* the process group starts (device count,
precisions, --ranks-per-node, message sizes against memory, preset, TP degrees), so an impossible
request stops with one line naming the field on every rank at once. The process group is created
with ``--timeout``: a rank that dies or hangs makes the others' collectives raise instead of waiting
forever; each surviving rank prints which phase failed and exits non-zero, and torchrun names the
rank that failed first ("Root Cause") and stops the rest.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from planner.contracts import Assumptions, ClusterProfile, Collective, ComputeProfile, ModelSpec
from planner.errors import AutoparError, UnknownNameError
from profiler import identity
from profiler.links import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MIN_BYTES,
    HOST_MIN_MAX_BYTES,
    QUICK_MAX_BYTES,
    LinkPlan,
    buffer_bytes_per_rank,
    measure_host_device,
    measure_links,
    message_sizes,
    oversubscribed,
    plan_groups,
)

DIE_ENV = "AUTOPAR_PROFILE_TEST_DIE_RANK"  # test hook: this rank exits abruptly during the link phase


@dataclass
class ProfileOptions:
    name: str | None = None
    quick: bool = False
    model: str | None = None
    tp_degrees: str | None = None
    precisions: str | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None
    ranks_per_node: int | None = None
    timeout_s: float = 300.0
    threads: int | None = None
    checkpoint_dir: str | None = None


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    local_world: int
    under_torchrun: bool


@dataclass
class Checked:
    """Everything validated, ready to measure."""

    dist: Dist
    device_type: str
    ranks_per_node: int
    num_nodes: int
    emulated: bool
    model: ModelSpec | None
    tp_degrees: list[int] | None
    precisions: list | None
    sizes: list[int]
    threads: int
    notes: list[str] = field(default_factory=list)


# a quick CPU profile measures for at most about this long (from the process group's start): torchrun's
# launch (5.8 s on the AVX2 VM) and the command's start-up and assembly (3.5 s) take most of the rest
# of the minute; the compute tables get what the links left (profiler.compute.fit_table_budget)
QUICK_MEASURE_S = 45.0
MAX_TIMEOUT_S = 86400.0  # --timeout: longer than this no collective should wait (and timedelta stays finite)
LINK_MIN_TRIAL_S = 0.008  # a link trial's calls: no more than last 8 ms (profiler.links.reps_within)


def dist_env() -> Dist:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return Dist(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world)),
                    True)
    return Dist(0, 1, 0, 1, False)


def _parse_tp(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        tps = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise AutoparError("--tp-degrees", text, "give comma-separated integers, e.g. 1,2,4",
                           problem="is not a list of integers") from None
    if not tps or any(t < 1 for t in tps):
        raise AutoparError("--tp-degrees", text, "give positive integers, e.g. 1,2,4", problem="is not valid")
    return tps


def writable_folder(path: str) -> None:
    """``--checkpoint-dir`` is a folder this user can write (made if missing), else AutoparError."""
    folder = Path(path)
    fix = "give a folder this user can write on the storage your checkpoints go to, or leave it out"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AutoparError("--checkpoint-dir", path, fix, problem=f"cannot be made ({exc.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AutoparError("--checkpoint-dir", path, fix, problem="is not writable")


def check(opts: ProfileOptions, d: Dist | None = None) -> Checked:
    """Validate the request against this machine; raises AutoparError (field, value, fix) before anything runs."""
    import torch

    from profiler.compute import parse_precisions

    d = d or dist_env()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    notes: list[str] = []
    if opts.name is not None and not opts.name.strip():
        raise AutoparError("--name", opts.name, "give the cluster a name, or leave --name out for one made from the "
                           "device and shape", problem="is empty")
    if opts.checkpoint_dir is not None:
        writable_folder(opts.checkpoint_dir)
    if device_type == "cuda" and d.local_world > torch.cuda.device_count():
        raise AutoparError("--nproc-per-node", d.local_world,
                           f"start at most {torch.cuda.device_count()} ranks per node (one per GPU)",
                           problem=f"is more ranks than the {torch.cuda.device_count()} GPUs on this node")
    if device_type == "cuda":
        # before anything touches CUDA (the fp8 probe of --precisions): else every rank opens a
        # context on GPU 0, which holds memory there all run and fails on exclusive-process GPUs
        torch.cuda.set_device(d.local_rank)
    rpn = opts.ranks_per_node if opts.ranks_per_node is not None else d.local_world
    if rpn < 1 or d.world % rpn:
        divisors = [k for k in range(1, d.world + 1) if d.world % k == 0]
        raise AutoparError("--ranks-per-node", rpn, f"choose a divisor of the world size {d.world}: "
                           + ", ".join(map(str, divisors)), problem=f"does not divide the {d.world} ranks into nodes")
    emulated = rpn != d.local_world
    if emulated:
        notes.append(f"EMULATED NODES: --ranks-per-node {rpn} treats consecutive blocks of {rpn} ranks as nodes "
                     f"(torchrun started {d.local_world} per host); inter_node links are not a real network")
    if not math.isfinite(opts.timeout_s) or opts.timeout_s <= 0:
        raise AutoparError("--timeout", opts.timeout_s, "give seconds > 0, e.g. --timeout 300",
                           problem="is not a positive number of seconds")
    if opts.timeout_s > MAX_TIMEOUT_S:
        raise AutoparError("--timeout", opts.timeout_s,
                           f"give at most {MAX_TIMEOUT_S:.0f} s (a day), e.g. --timeout 300",
                           problem="is longer than a collective should ever wait")
    model = None
    if opts.model is not None:  # an empty --model is not a left-out one: the lookup names it
        from planner.presets import get_preset

        try:
            model = get_preset(opts.model)
        except UnknownNameError as err:  # the preset lookup names its own field: this command's flag is --model
            raise UnknownNameError("--model", opts.model, err.known) from None
    tps = _parse_tp(opts.tp_degrees)
    if tps and model is None:
        raise AutoparError("--tp-degrees", opts.tp_degrees,
                           "give --model too (the degrees split that model's layers), or leave --tp-degrees out "
                           "for the model-free grid", problem="has no --model to split")
    if tps:
        bad = [t for t in tps if model.num_attention_heads % t]
        if bad:
            raise AutoparError("--tp-degrees", opts.tp_degrees,
                               f"use degrees dividing {model.name}'s {model.num_attention_heads} attention heads",
                               problem="does not divide the attention heads")
    here = torch.device("cuda", d.local_rank) if device_type == "cuda" else torch.device("cpu")
    precisions = parse_precisions(opts.precisions, here) if opts.precisions is not None else None
    min_b = opts.min_bytes if opts.min_bytes is not None else DEFAULT_MIN_BYTES
    max_b = opts.max_bytes if opts.max_bytes is not None else (QUICK_MAX_BYTES if opts.quick else DEFAULT_MAX_BYTES)
    if min_b < 4:
        raise AutoparError("--min-bytes", min_b, "give at least 4 bytes (one float32)", problem="is too small")
    if max_b < min_b:
        raise AutoparError("--max-bytes", max_b, f"give at least --min-bytes={min_b}", problem="is below --min-bytes")
    # memory: the largest message's buffers on every rank sharing this host's (or this GPU's) memory
    def per_rank_bytes(nbytes: int) -> int:
        return max(max(buffer_bytes_per_rank(coll, nbytes, max(d.world, 2)) for coll in Collective), 2 * nbytes)

    per_rank = per_rank_bytes(max_b)
    sharing = d.local_world if device_type == "cpu" else 1
    need = per_rank * sharing
    avail = identity.available_memory_bytes(torch.device(device_type, d.local_rank) if device_type == "cuda"
                                            else torch.device("cpu"))
    if need > 0.8 * avail:
        fits = max_b
        while fits > min_b and per_rank_bytes(fits) * sharing > 0.8 * avail:
            fits //= 2
        raise AutoparError("--max-bytes", max_b,
                           f"use --max-bytes {fits} or less ({sharing} rank(s) x ~2 buffers of the largest message "
                           f"= {need / 2**30:.1f} GiB; {avail / 2**30:.1f} GiB available)",
                           problem="does not fit in memory")
    sizes = message_sizes(min_b, max_b, quick=opts.quick)
    if opts.quick:
        notes.append(f"QUICK MODE: messages {min_b} B to {max_b} B every 4x below 1 MiB and 2x from there "
                     f"({len(sizes)} sizes), 5 trials (15 up to 256 KiB; interleaved rounds; spoiled-looking sizes "
                     "re-measured); "
                     "a full profile goes to 256 MiB every 2x with 7 trials; quick compute grid")
    cores = len(identity.usable_cpus())
    threads = opts.threads if opts.threads is not None else max(1, cores // max(1, d.local_world))
    if threads < 1:
        raise AutoparError("--threads", threads, "give a positive thread count", problem="is not positive")
    if threads > cores:  # more threads than CPUs time the scheduler's slices, not the device
        raise AutoparError("--threads", threads, f"give at most {cores}, or leave --threads out for the CPUs shared "
                           "among this host's ranks", problem=f"is more than the {cores} CPUs this rank may use")
    return Checked(d, device_type, rpn, d.world // rpn, emulated, model, tps, precisions, sizes, threads, notes)


def crowded_hosts(ranks: list[tuple[str, list[int]]]) -> set[str]:
    """The hosts that run more ranks than the CPUs their ranks may use together (the union of
    their affinities: ranks pinned to cores of their own do not count as sharing). ``ranks``: each
    rank's (host name, CPUs). CPU quotas of a container are not seen."""
    hosts: dict[str, tuple[int, set[int]]] = {}
    for host, cpus in ranks:
        n, union = hosts.get(host, (0, set()))
        hosts[host] = (n + 1, union | set(cpus))
    return {h for h, (n, union) in hosts.items() if oversubscribed(n, len(union))}



def _die_hook(rank: int):
    want = os.environ.get(DIE_ENV)
    if want is None or int(want) != rank:
        return None
    count = {"n": 0}

    def hook(label: str) -> None:
        count["n"] += 1
        if count["n"] == 3:  # a few measurements in: the others are mid-collective
            sys.stderr.write(f"[test hook {DIE_ENV}] rank {rank} exits abruptly during '{label}'\n")
            sys.stderr.flush()
            os._exit(17)

    return hook


def run_profile(opts: ProfileOptions, progress_factory=None) -> ClusterProfile | None:  # noqa: ANN001
    """Measure and return the profile on rank 0 (None on the other ranks). ``progress_factory()``
    (rank 0 only) returns a context manager whose value is a ``progress(label, done, total)`` callable."""
    import contextlib

    import torch.distributed as dist

    c = check(opts)
    d = c.dist
    device, backend, timeout = _start_process_group(c, opts)
    phase = "start"
    t_start = time.perf_counter()
    try:
        # waits for rank 0's compute go over a gloo group of their own, also when the collectives
        # are NCCL: an NCCL barrier runs under the group's timeout, and the watchdog aborts the
        # waiting ranks when rank 0's compute takes longer (minutes with --model); a gloo monitored
        # barrier takes its own timeout and names the ranks that did not arrive (one code path,
        # tested on CPU). On NCCL clusters gloo needs its own TCP connections between the nodes.
        phase = ("gloo group for the waits (on a GPU cluster, set GLOO_SOCKET_IFNAME to the network interface "
                 "if the host name resolves to a loopback address)")
        wait_group = dist.new_group(backend="gloo", timeout=timeout)
        phase = "identity (gather hostnames)"
        gathered, node_hosts = _gather_hosts(c)
        hostnames = [h for h, _ in gathered]
        phase = "memory beside the tensors (every rank: CUDA context, optimizer step, loss, a new communicator)"
        from profiler.memory import measured_assumptions

        memory_assumptions = measured_assumptions(device)
        ctx = progress_factory() if (progress_factory is not None and d.rank == 0) else contextlib.nullcontext(None)
        with ctx as progress:
            report = _stage_reporter(progress)
            phase = "links"
            links = _measure_link_table(c, opts, device, gathered, timeout, report)
            phase = "device check (every rank: one GEMM, one add)"
            checks = _check_devices(dist, wait_group, c, device, hostnames, opts.quick, report)
            phase = "checkpoint saves (every rank, the executor's checkpointer)"
            from profiler.checkpoint import measure_checkpoint

            checkpoint = measure_checkpoint(device, opts.checkpoint_dir, opts.quick, report("checkpoint"))
            phase = "compute (rank 0 measures, the others wait)"
            measured = _rank0_compute(c, opts, device, t_start, report) if d.rank == 0 else None
            # the others wait here for rank 0's compute, on wait_group (see above)
            _wait_for_rank0(dist, wait_group, rank0_wait_s(opts.quick, opts.timeout_s))
        if d.rank != 0:
            dist.destroy_process_group()
            return None
        phase = "assemble"
        profile = _assemble(c, opts, device, backend, node_hosts, memory_assumptions, links, checks, measured,
                            t_start).model_copy(update={"checkpoint": checkpoint})
        dist.destroy_process_group()
        return profile
    except AutoparError:
        raise
    except Exception as exc:  # noqa: BLE001 - collective failures: name the rank and the phase, then stop
        text = str(exc).strip()
        msg = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
        raise RankFailure(d.rank, d.world, phase, msg) from exc


def _start_process_group(c: Checked, opts: ProfileOptions):  # noqa: ANN202 - (torch.device, backend, timeout)
    """This rank's device and the default process group: NCCL on GPUs, gloo on CPUs (a one-rank group
    outside torchrun)."""
    import torch
    import torch.distributed as dist

    d = c.dist
    torch.set_num_threads(c.threads)
    backend = "nccl" if c.device_type == "cuda" else "gloo"
    if c.device_type == "cuda":
        torch.cuda.set_device(d.local_rank)
        device = torch.device("cuda", d.local_rank)
    else:
        device = torch.device("cpu")
    timeout = timedelta(seconds=opts.timeout_s)
    if d.under_torchrun:
        dist.init_process_group(backend, timeout=timeout, **({"device_id": device} if backend == "nccl" else {}))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device, backend, timeout


def _gather_hosts(c: Checked) -> tuple[list, list[str]]:
    """Every rank's (host name, usable CPUs), and one host name per node: the host of its first rank
    (torchrun numbers a node's ranks consecutively). Nodes that report one host name are noted."""
    import torch.distributed as dist

    gathered: list = [None] * c.dist.world
    dist.all_gather_object(gathered, (identity.hostname(), identity.usable_cpus()))
    hostnames = [h for h, _ in gathered]
    node_hosts = [hostnames[n * c.ranks_per_node] for n in range(c.num_nodes)]
    shared = {h: node_hosts.count(h) for h in node_hosts if node_hosts.count(h) > 1}
    if shared and not c.emulated:
        c.notes.append("SHARED HOSTS: " + ", ".join(f"{k} torchrun nodes report host name {h}" for h, k in
                                                    shared.items())
                       + "; if they are one machine, the inter_node links between them are its loopback, "
                         "not a network")
    return gathered, node_hosts


def _stage_reporter(progress):  # noqa: ANN001, ANN202
    """``report(stage)``: a progress callable whose labels start with the stage, or None without progress."""
    def report(stage: str):  # noqa: ANN202
        if progress is None:
            return None
        return lambda label, done, total: progress(f"{stage}: {label}", done, total)
    return report


def _measure_link_table(c: Checked, opts: ProfileOptions, device, gathered: list, timeout: timedelta,  # noqa: ANN001
                        report) -> list:  # noqa: ANN001
    """Every level's links, measured on every rank; every rank holds the same gathered (host, cores)
    and so builds the same jobs."""
    crowded = crowded_hosts(gathered)
    one_at_a_time = bool(crowded)
    plan = LinkPlan(plan_groups(c.dist.world, c.ranks_per_node, c.emulated), c.sizes,
                    trials=5 if opts.quick else 7, warmup=2 if opts.quick else 3,
                    one_group_at_a_time=one_at_a_time, hosts=[h for h, _ in gathered], timeout=timeout,
                    min_trial_s=LINK_MIN_TRIAL_S, crowded_hosts=crowded)
    if one_at_a_time:
        c.notes.append("links: a host runs more ranks than it has cores, so of the disjoint groups of "
                       "each level that share such a host only one was timed, the host's other ranks idle "
                       "(side by side, each rank's polling receive thread holds a core and the ranks wait "
                       "for time slices; the groups left out run on the same cores)")
    return measure_links(plan, device, progress=report("links"), fail_hook=_die_hook(c.dist.rank))


def _check_devices(dist, wait_group, c: Checked, device, hostnames: list[str], quick: bool,  # noqa: ANN001
                   report) -> list:  # noqa: ANN001
    """Every rank's device check (one GEMM, one add); what this rank's check streamed goes in the notes."""
    tick = report("check")
    if tick is not None:
        tick(f"every rank's device: one GEMM, one add ({c.dist.world} ranks)", 0, 1)
    checks, check_note = _device_checks(dist, wait_group, c.dist, device, hostnames, quick=quick)
    if tick is not None:
        tick("devices checked", 1, 1)
    if check_note:  # rank 0's goes in the profile
        c.notes.append(check_note)
    return checks


@dataclass
class _Rank0Compute:
    compute: ComputeProfile
    host_links: list
    host_notes: list[str]
    grid_notes: list[str]


def _rank0_compute(c: Checked, opts: ProfileOptions, device, t_start: float, report) -> _Rank0Compute:  # noqa: ANN001
    """Rank 0's compute tables and host-device copies (the other ranks wait)."""
    from profiler.compute import default_grid, fit_table_budget, measure_compute

    grid = default_grid(c.model, c.tp_degrees, quick=opts.quick, device_type=c.device_type)
    if c.precisions:
        grid.precisions = c.precisions
    if opts.quick:
        fit_table_budget(grid, QUICK_MEASURE_S - (time.perf_counter() - t_start))
    compute = measure_compute(device, grid, progress=report("compute"))
    # every 2x and to 64 MiB at least: copies are cheap, and a fit wants the bulk rate
    # (offloaded optimizer states are far larger than any message) under many points
    host_sizes = message_sizes(c.sizes[0], max(c.sizes[-1], HOST_MIN_MAX_BYTES))
    host_links, host_notes = measure_host_device(device, host_sizes, trials=3 if opts.quick else 5)
    return _Rank0Compute(compute, host_links, host_notes, list(grid.notes))


def _assemble(c: Checked, opts: ProfileOptions, device, backend: str, node_hosts: list[str],  # noqa: ANN001
              assumptions: Assumptions, links: list, checks: list, measured: _Rank0Compute,
              t_start: float) -> ClusterProfile:
    """Rank 0's ClusterProfile from what every phase measured, with the sources that say how."""
    from profiler.compute import device_check_notes

    d, compute = c.dist, measured.compute
    spec, dev_notes = identity.device_spec(device, compute, c.ranks_per_node)
    env = identity.environment(node_hosts, backend, c.emulated, c.device_type)
    sources = [
        f"autopar profile on {d.world} rank(s), {c.ranks_per_node} per node x {c.num_nodes} node(s), "
        f"backend {backend}",
        f"links: {len(c.sizes)} message sizes {c.sizes[0]} B..{c.sizes[-1]} B, all ranks; "
        "compute: rank 0 only (one table stands for every device, scaled to the slowest where a device check "
        "finds a straggler)",
        *c.notes, *dev_notes, *measured.host_notes, *measured.grid_notes,
    ]
    if c.device_type == "cpu":
        assumptions = assumptions.model_copy(update={"notes": [*assumptions.notes, (
            f"cpu_optimizer_bytes_per_s left at the default; device memory bandwidth measured "
            f"{(compute.achieved_memory_bandwidth_bytes_per_s or 0) / 1e9:.1f} GB/s")]})
    name = opts.name or (f"{'emulated-' if c.emulated else ''}"
                         f"{spec.name.split(' (')[0].replace('CPU: ', 'cpu-').replace(' ', '-').lower()}"
                         f"-{c.num_nodes}x{c.ranks_per_node}")
    profile = ClusterProfile(kind="measured", name=name[:200], device=spec, gpus_per_node=c.ranks_per_node,
                             num_nodes=c.num_nodes, environment=env, compute=compute,
                             links=[*links, *measured.host_links], assumptions=assumptions, device_checks=checks,
                             sources=[*sources, *device_check_notes(checks, c.device_type),
                                      f"measured in {time.perf_counter() - t_start:.1f} s"])
    return ClusterProfile.model_validate(profile.model_dump())


def check_turns(hostnames: list[str], rank: int) -> tuple[int, int]:
    """(turns, this rank's turn) for checks one rank per host at a time: as many turns as the most
    ranks on one host; a rank's turn is how many ranks of its host come before it. Every rank
    computes the same from the same gathered names."""
    return max(hostnames.count(h) for h in hostnames), hostnames[:rank].count(hostnames[rank])


def _device_checks(dist, group, d, device, hostnames: list[str], quick: bool = False) -> tuple[list, str | None]:  # noqa: ANN001
    """Every rank's :func:`~profiler.compute.device_check`, gathered on every rank (over the gloo
    ``group``). GPUs check side by side, each its own; CPU ranks of one host (by the gathered host
    names, whatever the launcher says of local ranks: two torchrun agents may share a machine) one
    at a time, since they would time each other on shared cores; hosts side by side. A rank whose
    check fails does not leave the others waiting: every rank raises, naming it and why. Returns the
    checks and what this rank's add buffers leave to say (:func:`~profiler.compute.check_buffer_for`)."""
    import torch

    from profiler.compute import check_buffer_for, device_check

    host = hostnames[d.rank]
    turns, my_turn = check_turns(hostnames, d.rank) if device.type != "cuda" else (1, 0)
    mine: object = None
    buffer, note = check_buffer_for(device, quick)
    for turn in range(turns):
        if turn == my_turn:
            try:
                if device.type == "cuda":
                    props = torch.cuda.get_device_properties(device)
                    name, memory = props.name, int(props.total_memory)
                else:
                    name, memory = f"CPU: {identity.cpu_name()}", max(identity.host_memory_bytes(), 1)
                mine = device_check(device, d.rank, host, d.local_rank, name, memory, add_buffer_bytes=buffer)
            except Exception as exc:  # noqa: BLE001 - reported by every rank below
                mine = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        if turns > 1:
            dist.barrier(group=group)
    gathered: list = [None] * d.world
    dist.all_gather_object(gathered, mine, group=group)
    failed = [(r, x) for r, x in enumerate(gathered) if isinstance(x, str)]
    if failed:
        raise RuntimeError("the device check failed on " + "; ".join(
            f"rank {r} ({hostnames[r]}): {why}" for r, why in failed[:8]) + ("; ..." if len(failed) > 8 else ""))
    return sorted(gathered, key=lambda c: c.rank), note


QUICK_RANK0_WAIT_S = 900.0  # a quick profile's compute: 45 s on CPUs (QUICK_MEASURE_S), 41 s on an H200
FULL_RANK0_WAIT_S = 3600.0  # a full one's: 96 s on an H200, 6 min on a 2-vCPU VM; slower GPUs and larger grids more


def rank0_wait_s(quick: bool, timeout_s: float) -> float:
    """How long the other ranks wait for rank 0's compute tables before the run stops naming rank 0
    as hung: ``--timeout`` where that is longer, else 15 minutes for a quick profile (twenty times
    what its compute takes) and an hour for a full one."""
    return max(timeout_s, QUICK_RANK0_WAIT_S if quick else FULL_RANK0_WAIT_S)


def _wait_for_rank0(dist, group, timeout_s: float) -> None:  # noqa: ANN001
    """Wait up to ``timeout_s`` for every rank of ``group`` (a gloo group). wait_all_ranks: rank 0
    reports every rank that did not arrive (died or hung), by number."""
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


class RankFailure(RuntimeError):
    """This rank failed during a phase of the run: its own error, or a collective's because another
    rank died, hung or raised (a rank cannot tell which from the exception alone)."""

    def __init__(self, rank: int, world: int, phase: str, detail: str):
        self.rank, self.phase, self.detail = rank, phase, detail
        if world == 1:  # no other rank: the error is this process's own
            super().__init__(f"rank {rank}/{world} failed during {phase}: {detail}")
        else:
            super().__init__(f"rank {rank}/{world} failed during {phase}: {detail} — if that is a collective's "
                             "error, another rank died, hung or raised: torchrun's report names the rank that "
                             "failed first")

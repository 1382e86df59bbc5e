"""`autopar profile` for real: 4 gloo ranks under torchrun on CPU, 2 emulated nodes of 2.

One quick run (module fixture) is reused: it writes --out and uploads to a live server at once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from planner.contracts import ClusterProfile, Collective, LinkLevel, TrainingConfig
from planner.cost.goodput import line_time_s
from planner.errors import AutoparError
from planner.presets import get_preset
from planner.search import search
from profiler.fit import link_fit_report

VENV_BIN = Path(sys.executable).parent
AUTOPAR = str(VENV_BIN / "autopar")
TORCHRUN = str(VENV_BIN / "torchrun")
FIVE = {Collective.all_reduce, Collective.all_gather, Collective.reduce_scatter, Collective.all_to_all, Collective.p2p}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


def torchrun(nproc: int, *args: str, timeout: float = 180, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), AUTOPAR, "profile", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(**env))
    return proc, time.perf_counter() - t0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    from conftest import LiveServer

    tmp = tmp_path_factory.mktemp("profile")
    out = tmp / "profile.json"
    with LiveServer(f"sqlite:///{tmp}/x.db", AUTOPAR_TOKENS="s3cret") as server:
        proc, wall = torchrun(4, "--quick", "--ranks-per-node", "2", "--out", str(out), "--server", server.url,
                              "--token", "s3cret", "--name", "ci-cpu", timeout=420)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        listing = httpx.get(f"{server.url}/v1/profiles").json()
        stored = [httpx.get(f"{server.url}/v1/profiles/{item['id']}").json() for item in listing["items"]
                  if item.get("cluster", item.get("name")) == "ci-cpu" or "ci-cpu" in json.dumps(item)]
    print(f"\nautopar profile --quick on 4 ranks: {wall:.1f} s wall")
    return {"out": out, "wall": wall, "proc": proc, "stored": stored,
            "profile": ClusterProfile.model_validate_json(out.read_text())}


@pytest.mark.slow
def test_quick_profile_validates_and_has_every_link(quick_run):
    p: ClusterProfile = quick_run["profile"]
    assert p.kind == "measured" and p.num_nodes == 2 and p.gpus_per_node == 2
    assert p.environment.backend == "gloo" and len(p.environment.hostnames) == 2
    assert p.environment.gloo_version.startswith("bundled with torch ") and p.environment.driver_version is None
    assert p.environment.devices_per_node == len(os.sched_getaffinity(0))  # the CPUs a rank may use
    assert any("emulated" in h for h in p.environment.hostnames)
    assert any("EMULATED NODES" in s for s in p.sources) and any("QUICK MODE" in s for s in p.sources)
    for level in (LinkLevel.intra_node, LinkLevel.inter_node):
        got = {link.collective for link in p.links if link.level is level}
        assert got == FIVE, level
    for link in p.links:
        assert len(link.points) >= 7 and link.fit_r2 is not None, link
        if link.level is not LinkLevel.host_device:
            assert link.points[0].bytes == 4096 and link.points[-1].bytes == 16 << 20
    assert {link.collective for link in p.links if link.level is LinkLevel.host_device} == {
        Collective.host_to_device, Collective.device_to_host}
    assert p.compute.gemm and p.compute.achieved_matmul_tflops
    assert p.device.peak_tflops and p.assumptions.reserved_memory_bytes == 0
    # a CPU rank's runtime is its measured resident memory (interpreter and torch: 100 MiB to 2 GiB), no NCCL
    assert 100 << 20 < p.assumptions.runtime_bytes < 2 << 30 and p.assumptions.communicator_bytes == 0
    assert any("runtime_bytes=" in n and "measured" in n for n in p.assumptions.notes)
    # how each measured group sat is recorded, so the planner prices exactly that placement as measured
    for link in p.links:
        if link.level is LinkLevel.inter_node:
            assert link.ranks_per_node == (1 if link.group_size == 2 else 2), link
    # 4 ranks on this host: with fewer cores than that, one group of each level was timed (they all
    # share this host's cores), else both side by side
    cores = len(os.sched_getaffinity(0))
    one_per_host = [s for s in p.sources if "only one was timed" in s]
    assert bool(one_per_host) == (cores < 4), (cores, p.sources)
    intra = next(x for x in p.links if x.level is LinkLevel.intra_node and x.collective is Collective.all_reduce)
    assert ("2 group(s), 1 timed, one per host" in intra.source) == (cores < 4), intra.source
    assert ("2 group(s), timed side by side" in intra.source) == (cores >= 4), intra.source
    # the calls per trial were cut by time (the group's agreement on them ran: the run ended)
    assert all("cut to what lasts 8 ms" in x.source for x in p.links if x.level is not LinkLevel.host_device)
    # every rank checked its device at the same GEMM and add; one host, one CPU: no MIXED DEVICES
    assert [c.rank for c in p.device_checks] == [0, 1, 2, 3] and [c.local_rank for c in p.device_checks] == [0, 1, 2, 3]
    assert all(c.gemm == (512, 512, 512) and c.gemm_tflops > 0 and c.memory_bandwidth_bytes_per_s > 1e8
               for c in p.device_checks)
    assert len({(c.device, c.memory_bytes, c.host) for c in p.device_checks}) == 1
    assert not any("MIXED DEVICES" in s for s in p.sources)
    # the executor's checkpointer measured on every rank: both modes at each configuration, a line per mode
    ck = p.checkpoint
    assert ck is not None and ck.ranks == 4 and ck.storage
    assert sorted((q.bytes >> 20, q.tensors, q.mode) for q in ck.points) == sorted(
        (b, n, m) for b, n in ((3, 16), (3, 64), (127, 16), (127, 64))  # 4 and 128 MiB, less
        for m in ("sync", "async"))
    assert all(q.blocking_s <= q.write_s for q in ck.points)
    for mode, line in (("sync", ck.sync), ("async", ck.async_blocking)):  # each line comes near its own points
        assert max(abs(line_time_s(line, q.bytes, q.tensors) / q.blocking_s - 1)
                   for q in ck.points if q.mode == mode) < 1.0, (mode, line, ck.points)
    assert not list(Path(ck.storage).glob("autopar-profile-checkpoint-*"))  # every save deleted
    # rank 0's rich progress bar named each stage as it measured, and each reached its total
    bars = quick_run["proc"].stderr
    for stage in ("links:", "checkpoint:", "compute:"):
        assert stage in bars, bars[-2000:]
    done = re.findall(r"(\d+)/(\d+)", bars)
    assert done and any(a == b for a, b in done), bars[-2000:]


@pytest.mark.slow
def test_planner_plans_from_measured_profile(quick_run):
    model = get_preset("llama3-8b").model_copy(update={"num_layers": 4})
    plan = search(model, TrainingConfig(seq_length=512, global_batch_size=8), quick_run["profile"])
    assert plan.prediction.step_time_s > 0
    assert plan.layout.tp * plan.layout.pp * plan.layout.cp * plan.layout.dp_shard * plan.layout.dp_replicate == 4


@pytest.mark.slow
def test_link_fit_report_on_measured_profile(quick_run):
    rows = link_fit_report(quick_run["profile"], print_table=True)
    levels = {(r["level"], r["collective"]) for r in rows}
    assert {("intra_node", c.value) for c in FIVE} <= levels and {("inter_node", c.value) for c in FIVE} <= levels
    for r in rows:
        assert r["fit_r2"] is not None and r["worst_rel_err"] >= 0


@pytest.mark.slow
def test_benchmark_judges_every_link_in_every_run(quick_run, monkeypatch, capsys):
    # for this test only: left on sys.path, benchmarks/executor.py would shadow the executor package
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import argparse

    import profile_accuracy

    p: ClusterProfile = quick_run["profile"]
    # run 2 lacks the intra-node p2p link; run 3 has one point of the 4-rank all-reduce 3x slower
    no_p2p = p.model_copy(update={"links": [x for x in p.links if not (
        x.level is LinkLevel.intra_node and x.collective is Collective.p2p)]})
    spoiled = p.model_copy(deep=True)
    for x in spoiled.links:
        if x.level is LinkLevel.inter_node and x.collective is Collective.all_reduce and x.group_size == 4:
            x.points[len(x.points) // 2].time_s *= 3
    runs = iter([p, no_p2p, spoiled])
    monkeypatch.setattr(profile_accuracy, "quick_profile_run", lambda args: (next(runs), 41.0))
    rows = profile_accuracy.link_runs(argparse.Namespace(profile=None, link_runs=3, ranks=4))
    by_name = {name.split(" (R2")[0]: (value, ok) for name, value, _, ok in rows}
    assert by_name["link intra_node p2p n=2"][1] is False and "/3 runs" in by_name["link intra_node p2p n=2"][0]
    assert by_name["link inter_node all_reduce n=4"][1] is False
    # a link the first run fitted and the later runs did not touch passes in all three runs
    for r in link_fit_report(p):
        name = f"link {r['level']} {r['collective']} n={r['group_size'] or '-'}"
        if r["worst_rel_err"] <= 0.2 and name not in ("link intra_node p2p n=2", "link inter_node all_reduce n=4"):
            assert by_name[name] == (by_name[name][0], True) and by_name[name][0].endswith("3/3 runs")
    full = by_name["links: runs with every link within 20%"]
    assert full[1] is False and full[0].endswith("of 3") and not full[0].startswith(("2", "3"))
    assert rows[0][1] == "41.0-41.0 s wall (3 runs)"
    assert "quick profile 2 against 1" in capsys.readouterr().out


@pytest.mark.slow
def test_upload_stores_the_same_profile(quick_run):
    assert len(quick_run["stored"]) == 1
    stored = ClusterProfile.model_validate(quick_run["stored"][0]["profile"])
    assert stored == quick_run["profile"]
    assert "uploaded to" in quick_run["proc"].stderr


def _no_measuring(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode != 0
    assert "links:" not in proc.stderr and "compute:" not in proc.stderr


@pytest.mark.slow
def test_ranks_per_node_must_divide_world(tmp_path):
    proc, wall = torchrun(4, "--quick", "--ranks-per-node", "3", "--out", str(tmp_path / "p.json"), timeout=60)
    _no_measuring(proc)
    assert "--ranks-per-node=3" in proc.stderr and "1, 2, 4" in proc.stderr, proc.stderr
    assert not (tmp_path / "p.json").exists()


def _single(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([AUTOPAR, "profile", *args], capture_output=True, text=True, timeout=60, env=_env(**env))


def test_unknown_precision_stops_before_measuring(tmp_path):
    proc = _single("--quick", "--precisions", "bf16,fp9", "--out", str(tmp_path / "p.json"))
    _no_measuring(proc)
    assert proc.returncode == 2 and "--precisions='fp9'" in proc.stderr, proc.stderr


def test_max_bytes_too_large_for_memory_stops(tmp_path):
    proc = _single("--max-bytes", str(1 << 40), "--out", str(tmp_path / "p.json"))
    _no_measuring(proc)
    assert (proc.returncode == 2 and "--max-bytes" in proc.stderr
            and "does not fit in memory" in proc.stderr), proc.stderr


def test_message_sizes_take_units_and_refuse_what_is_not_a_size(tmp_path):
    from profiler.cli import parse_bytes

    assert parse_bytes("--max-bytes", "256MiB") == parse_bytes("--max-bytes", "256M") == 256 << 20
    assert parse_bytes("--min-bytes", "64 KiB") == 65536 and parse_bytes("--min-bytes", "4096") == 4096
    assert parse_bytes("--max-bytes", "1GB") == 10**9 and parse_bytes("--max-bytes", "1.5k") == 1536
    assert parse_bytes("--max-bytes", None) is None
    assert parse_bytes("--min-bytes", "16.1KB") == 16100 and parse_bytes("--min-bytes", "2.01KB") == 2010  # exact
    with pytest.raises(AutoparError, match=r"--min-bytes='1.3' is not whole bytes; give a whole number of bytes"):
        parse_bytes("--min-bytes", "1.3")
    with pytest.raises(AutoparError, match=r"--min-bytes='2.0001K' is not whole bytes; .*e\.g\. 2048"):
        parse_bytes("--min-bytes", "2.0001K")
    with pytest.raises(AutoparError, match=r"is larger than any message; give at most 1 TiB"):
        parse_bytes("--max-bytes", "1" + "0" * 400)
    proc = _single("--quick", "--max-bytes", "16 apples", "--out", str(tmp_path / "p.json"))
    _no_measuring(proc)
    assert proc.returncode == 2 and "--max-bytes='16 apples' is not a size" in proc.stderr and "256MiB" in proc.stderr
    # a size with a unit reaches the memory check like bytes do
    proc = _single("--max-bytes", "1TiB", "--out", str(tmp_path / "p.json"))
    _no_measuring(proc)
    assert proc.returncode == 2 and "--max-bytes=1099511627776 does not fit in memory" in proc.stderr, proc.stderr


def test_zero_threads_and_an_empty_name_are_refused(tmp_path):
    for args, said in ((("--threads", "0"), "--threads=0 is not positive"), (("--name", " "), "--name=' ' is empty")):
        proc = _single("--quick", *args, "--out", str(tmp_path / "p.json"))
        _no_measuring(proc)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_checkpoint_dir_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    (tmp_path / "afile").write_text("x")
    proc = _single("--quick", "--checkpoint-dir", str(tmp_path / "afile"), "--out", str(tmp_path / "p.json"))
    _no_measuring(proc)
    assert proc.returncode == 2 and "--checkpoint-dir=" in proc.stderr and "cannot be made" in proc.stderr, \
        proc.stderr


def test_an_out_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    """The cases are planner.files.check_out's (tests/test_files.py); here: the command checks before measuring."""
    proc = _single("--quick", "--out", str(tmp_path))
    _no_measuring(proc)
    assert proc.returncode == 2 and f"--out='{tmp_path}' is a folder" in proc.stderr, proc.stderr
    (tmp_path / "afile").write_text("x")
    proc = _single("--quick", "--out", str(tmp_path / "afile" / "p.json"))
    _no_measuring(proc)
    assert proc.returncode == 2 and "cannot be written" in proc.stderr and "afile is a file" in proc.stderr


def test_a_profile_whose_out_fails_at_the_end_is_kept_and_the_error_says_where(tmp_path, monkeypatch):
    """The disk filled or the folder went while measuring: the profile goes to autopar-profile-<time>.json
    in the working folder, byte for byte, and the error names --out and that file."""
    from profiler.cli import publish

    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    gone = tmp_path / "afile"
    gone.write_text("x")  # --out's folder is now a file
    with pytest.raises(AutoparError) as err:
        publish('{"profile": 1}', gone / "p.json", None, None)
    (kept,) = here.iterdir()
    assert kept.name.startswith("autopar-profile-") and kept.read_text() == '{"profile": 1}'
    assert err.value.field == "--out" and f"the profile is kept in {kept}" in str(err.value)
    assert "could not be written" in str(err.value)


def test_more_threads_than_cpus_are_refused(monkeypatch):
    import profiler.identity
    from profiler.run import Dist, ProfileOptions, check

    monkeypatch.setattr(profiler.identity, "usable_cpus", lambda: [0, 1])
    one = Dist(0, 1, 0, 1, False)
    with pytest.raises(AutoparError, match=r"--threads=3 is more than the 2 CPUs this rank may use; give at most 2"):
        check(ProfileOptions(quick=True, threads=3), one)
    assert check(ProfileOptions(quick=True, threads=2), one).threads == 2
    assert check(ProfileOptions(quick=True), Dist(0, 4, 0, 4, True)).threads == 1  # 2 CPUs among 4 ranks


def test_impossible_requests_are_refused_before_anything_runs(monkeypatch):
    """check() is the gate every rank passes before the process group: each of these names its flag."""
    import torch

    from profiler.run import Dist, ProfileOptions, check

    one = Dist(0, 1, 0, 1, False)
    for value in (float("nan"), float("inf"), -1.0, 1e12):
        with pytest.raises(AutoparError) as err:
            check(ProfileOptions(quick=True, timeout_s=value), one)
        assert err.value.field == "--timeout" and "e.g. --timeout 300" in err.value.fix, value
    with pytest.raises(AutoparError, match=r"--precisions='' is empty; give a comma-separated list"):
        check(ProfileOptions(quick=True, precisions=""), one)  # given empty is not left out
    with pytest.raises(AutoparError, match=r"--model='' is not known"):
        check(ProfileOptions(quick=True, model=""), one)
    with pytest.raises(AutoparError, match=r"--tp-degrees='' is not valid; give positive integers"):
        check(ProfileOptions(quick=True, model="llama3-8b", tp_degrees=""), one)
    with pytest.raises(AutoparError, match=r"--tp-degrees='1,2' has no --model to split; give --model too"):
        check(ProfileOptions(quick=True, tp_degrees="1,2"), one)
    with pytest.raises(AutoparError, match=r"--model='llama-9z' is not known; known: .*llama3-8b"):
        check(ProfileOptions(quick=True, model="llama-9z"), one)
    # more ranks on a node than it has GPUs (a CUDA machine stood in: the check runs before any CUDA call)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(AutoparError, match=r"--nproc-per-node=4 is more ranks than the 2 GPUs on this node; "
                                           r"start at most 2 ranks per node"):
        check(ProfileOptions(quick=True), Dist(0, 4, 0, 4, True))


def test_the_wait_for_rank_0s_compute_is_bounded_by_the_profile_it_makes():
    from profiler.run import rank0_wait_s

    assert rank0_wait_s(True, 300.0) == 900.0 and rank0_wait_s(False, 300.0) == 3600.0
    assert rank0_wait_s(True, 2000.0) == 2000.0  # a longer --timeout wins


def test_missing_output_stops(tmp_path):
    proc = _single("--quick")
    assert proc.returncode == 2 and "--out" in proc.stderr


@pytest.mark.slow
def test_dead_rank_ends_the_run_naming_it(tmp_path):
    proc, wall = torchrun(4, "--quick", "--ranks-per-node", "2", "--timeout", "20", "--out", str(tmp_path / "p.json"),
                          timeout=240, AUTOPAR_PROFILE_TEST_DIE_RANK="2")
    text = proc.stdout + proc.stderr
    print(f"dead rank: exit {proc.returncode} after {wall:.1f} s")
    assert proc.returncode != 0
    assert wall < 150  # the 20 s collective timeout fires; a hang would run into the 240 s limit
    assert re.search(r"rank\s*:\s*2 \(local_rank: 2\)", text), text[-3000:]
    assert not (tmp_path / "p.json").exists()


@pytest.mark.slow
def test_two_torchrun_nodes_read_from_torchrun_not_emulated(tmp_path):
    """A real 2-node launch: two torchrun agents (--nnodes 2, one per node rank) of 2 ranks each.
    The profiler takes the nodes from torchrun (LOCAL_WORLD_SIZE), not --ranks-per-node: a
    2x2 profile that is not labelled emulated, with one host name per node, and a note that the two
    nodes report one host name, so their inter_node links may be its loopback."""
    from conftest import free_port

    port = str(free_port())
    out = tmp_path / "p.json"
    agents = []
    for node_rank in ("0", "1"):
        cmd = [TORCHRUN, "--nnodes", "2", "--node-rank", node_rank, "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", port, AUTOPAR, "profile", "--quick", "--max-bytes", "65536",
               "--precisions", "fp32", "--out", str(out)]  # the topology is under test: few sizes, one precision
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=_env(OMP_NUM_THREADS="1")))
    try:
        results = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for a, (_stdout, stderr) in zip(agents, results):
        assert a.returncode == 0, stderr[-3000:]
    p = ClusterProfile.model_validate_json(out.read_text())
    assert (p.num_nodes, p.gpus_per_node) == (2, 2)
    assert not p.name.startswith("emulated") and not any("EMULATED" in s for s in p.sources)
    assert len(p.environment.hostnames) == 2 and not any("emulated" in h for h in p.environment.hostnames)
    assert any(s.startswith("SHARED HOSTS: 2 torchrun nodes report host name") for s in p.sources), p.sources
    across = {(x.collective, x.group_size, x.ranks_per_node) for x in p.links if x.level is LinkLevel.inter_node}
    assert (Collective.p2p, 2, 1) in across and (Collective.all_reduce, 4, 2) in across


WAVES_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from planner.contracts import Collective, LinkLevel
from profiler.links import GroupSpec, LinkPlan, measure_links

dist.init_process_group("gloo")
hosts = ["a"] * 4 + ["b"] * 4  # two machines of 4 ranks: pairs sharing a machine take turns
spec = GroupSpec(LinkLevel.intra_node, 2, 2, [[0, 1], [2, 3], [4, 5], [6, 7]], "pairs",
                 collectives=(Collective.all_reduce,))
plan = LinkPlan([spec], [4096, 65536], trials=2, warmup=1, one_group_at_a_time=True, hosts=hosts,
                min_trial_s=0.008)  # each timed pair agrees on its calls per trial, the others idle
links = measure_links(plan, torch.device("cpu"))
import profiler.links as L
L._store = lambda: None  # no rendezvous store: the ranks meet in a barrier after each job instead
again = measure_links(plan, torch.device("cpu"))
if dist.get_rank() == 0:
    print(json.dumps([{"source": x.source, "times": [p.time_s for p in x.points]} for x in [*links, *again]]))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_one_group_per_host_is_timed_side_by_side(tmp_path):
    """8 ranks on two (named) machines, one group per machine: the pairs [0,1] and [4,5] run side
    by side, [2,3] and [6,7] idle, waiting on the store for both leaders (and, without a store, in a
    barrier); the run ends (no rank waits for a key nobody sets) and every point was timed."""
    script = tmp_path / "waves.py"
    script.write_text(WAVES_SCRIPT)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "8", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out) >= 2
    for link in out:  # with the store and without it
        assert "4 group(s), 2 timed, one per host" in link["source"]
        assert all(t > 0 for t in link["times"])


def test_python_m_profiler_runs_from_a_checkout_that_was_never_installed():
    """A GPU machine's own Python with the repository on PYTHONPATH has no ``autopar.commands``
    entry points: ``python -m profiler`` must still find its command (it did not, on the H200)."""
    code = ("import importlib.metadata as m; m.entry_points = lambda **kw: []; "
            "import runpy, sys; sys.argv = ['profiler', '--help']; runpy.run_module('profiler', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--quick" in r.stdout and "No such command" not in r.stdout + r.stderr


def test_a_ranks_own_error_is_not_blamed_on_another_rank():
    from profiler.run import RankFailure

    alone = str(RankFailure(0, 1, "compute", "ModuleNotFoundError: No module named 'ortools'"))
    # seen on the H200 as "a collective failed ... another rank died"
    assert alone == "rank 0/1 failed during compute: ModuleNotFoundError: No module named 'ortools'"
    many = str(RankFailure(2, 4, "links", "Connection closed by peer"))
    assert "rank 2/4 failed during links: Connection closed by peer" in many and "another rank died" in many

"""``autopar profile``: measure this cluster (under torchrun) and write / upload a ClusterProfile."""

from __future__ import annotations

import contextlib
import re
import time
from fractions import Fraction
from pathlib import Path
from typing import Annotated

import typer

from planner.console import make_console, styled
from planner.errors import AutoparError
from planner.files import check_out, kept_name, write_or_keep

err = make_console(stderr=True)  # markup off: --name, paths and server answers are user text


def _progress_factory():  # noqa: ANN202
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def make():  # noqa: ANN202
        with Progress(TextColumn("{task.description:<70}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=False) as bar:
            tasks: dict[str, int] = {}

            def progress(label: str, done: int, total: int) -> None:
                stage = label.split(":", 1)[0]
                if stage not in tasks:
                    tasks[stage] = bar.add_task(label, total=total)
                bar.update(tasks[stage], description=label[:70], completed=done, total=total)

            yield progress

    return make


MAX_MESSAGE_BYTES = 1 << 40
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(field: str, text: str | None) -> int | None:
    """A message size: bytes (``268435456``), or a number with a unit: K/M/G/T and KiB/MiB/GiB/TiB are
    powers of 1024 (as nccl-tests' ``-b 8 -e 128M``), KB/MB/GB/TB powers of 1000."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise AutoparError(field, text, "give bytes or a size with a unit, e.g. 268435456, 256MiB, 256M or 64KiB",
                           problem="is not a size")
    value = Fraction(m.group(1)) * _UNITS[unit]  # exact: 16.1KB is 16100 bytes, not a float near it
    if value.denominator != 1:
        raise AutoparError(field, text, f"give a whole number of bytes, e.g. {max(4, round(value))}",
                           problem="is not whole bytes")
    if value > MAX_MESSAGE_BYTES:
        raise AutoparError(field, text, "give at most 1 TiB (no host holds a larger message)",
                           problem="is larger than any message")
    return int(value)


def publish(profile_json: str, out: Path | None, server: str | None, token: str | None) -> dict | None:
    """Write the JSON to ``out`` and POST the very same bytes to ``{server}/v1/profiles``. An upload
    that fails keeps the profile: in ``out``, or without one in ``autopar-profile-<time>.json`` here,
    and the error says how to send it (:func:`planner.client.post_or_keep`). An ``out`` that cannot be
    written after all (the disk filled, the folder went) is tried once more after any upload, and then
    the profile is kept there too and the error says where (:func:`planner.files.write_or_keep`): a
    profile is never lost to a path."""
    in_out = False
    if out is not None:
        with contextlib.suppress(OSError):
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(profile_json)
            in_out = True
    uploaded = None
    if server is not None:
        from planner.client import post_or_keep

        keep = out if in_out else Path.cwd() / kept_name("autopar-profile")
        uploaded = post_or_keep(server, "/v1/profiles", profile_json.encode(), token, "profile", keep,
                                already_kept=in_out)
    if out is not None and not in_out:
        stored = f"; the service stored it as profile #{uploaded.get('id')}" if uploaded else ""
        write_or_keep(out, profile_json, "--out", "profile", "autopar-profile", also=stored)
    return uploaded


def profile(
    out: Annotated[Path | None, typer.Option("--out", help="write the ClusterProfile JSON here")] = None,
    server: Annotated[str | None, typer.Option(help="POST the profile to {server}/v1/profiles")] = None,
    token: Annotated[str | None, typer.Option(help="bearer token for --server", envvar="AUTOPAR_TOKEN")] = None,
    name: Annotated[str | None, typer.Option(help="cluster name (default from the device and shape)")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="fewer sizes (links up to 16 MiB, every 4x below 1 MiB and 2x above), "
                        "quick compute grid")] = False,
    model: Annotated[str | None, typer.Option(help="measure the GEMM/attention shapes of this preset")] = None,
    tp_degrees: Annotated[str | None, typer.Option(help="TP degrees for --model shapes, e.g. 1,2,4")] = None,
    precisions: Annotated[str | None, typer.Option(help="e.g. bf16,fp32 (default: all the device runs)")] = None,
    min_bytes: Annotated[str | None, typer.Option(
        help="smallest message: bytes, or with a unit (64KiB, 4K; K/M/G = 1024-based, KB/MB/GB = 1000); "
             "default 4K")] = None,
    max_bytes: Annotated[str | None, typer.Option(
        help="largest message, e.g. 256MiB or 268435456 (default 256 MiB, quick 16 MiB)")] = None,
    ranks_per_node: Annotated[int | None, typer.Option(
        help="treat consecutive blocks of K ranks as nodes (emulated nodes, labelled so in the profile); "
             "default torchrun's LOCAL_WORLD_SIZE")] = None,
    timeout: Annotated[float, typer.Option(
        help="seconds a collective may wait before the run stops (dead/hung rank)")] = 300.0,
    threads: Annotated[int | None, typer.Option(
        help="torch threads per rank (default cores / ranks on the host)")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(
        help="where the checkpoint saves are measured: the storage your training checkpoints to (default: the "
             "system's temporary folder on each node); each save is deleted after it")] = None,
) -> None:
    """Measure this cluster: links on every rank (all-reduce, all-gather, reduce-scatter, all-to-all,
    p2p; within and across nodes, fitted to α-β), compute on rank 0; write/upload a ClusterProfile.

    Run it under torchrun, one rank per GPU (or several CPU ranks):

      torchrun --standalone --nproc-per-node 4 $(which autopar) profile --quick --out p.json

      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint host:29500 -m profiler --server URL --token T

    Started without torchrun it measures a world of one process (compute and host copies, no links).
    """
    from profiler.run import ProfileOptions, RankFailure, dist_env, run_profile

    d = dist_env()
    t0 = time.perf_counter()
    try:
        opts = ProfileOptions(name=name, quick=quick, model=model, tp_degrees=tp_degrees, precisions=precisions,
                              min_bytes=parse_bytes("--min-bytes", min_bytes),
                              max_bytes=parse_bytes("--max-bytes", max_bytes), ranks_per_node=ranks_per_node,
                              timeout_s=timeout, threads=threads,
                              checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir))
        if out is None and server is None:
            raise AutoparError("--out", None, "give --out PATH and/or --server URL",
                               problem="and --server are both missing")
        if out is not None and d.rank == 0:  # rank 0 writes it: refused before anyone measures
            check_out(out, "profile.json")
        if server is not None and d.rank == 0:  # rank 0 uploads: it asks before anyone measures
            from planner.client import check_writable

            check_writable(server, token)
        result = run_profile(opts, progress_factory=_progress_factory())
    except AutoparError as exc:
        if d.local_rank == 0:  # every rank finds the same problem: say it once per host
            err.print(styled(("error:", "bold red"), " ", str(exc)), highlight=False)
        raise typer.Exit(2) from None
    except RankFailure as exc:
        err.print(styled(("error:", "bold red"), " ", str(exc)), highlight=False)
        raise typer.Exit(1) from None
    if result is None:
        return
    text = result.model_dump_json(indent=2)
    try:
        uploaded = publish(text, out, server, token)
    except AutoparError as exc:
        err.print(styled(("error:", "bold red"), " ", str(exc)), highlight=False)
        raise typer.Exit(2) from None
    from profiler.fit import link_fit_report

    rows = link_fit_report(result)
    worst = max((r["worst_rel_err"] for r in rows if r["level"] != "host_device"), default=0.0)
    err.print(
        f"profile '{result.name}': {result.num_nodes} node(s) x {result.gpus_per_node} rank(s), "
        f"{len(result.links)} links (worst α-β error {worst:.0%}), {len(result.compute.gemm)} GEMM points, "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    if out is not None:
        err.print(f"wrote {out}")
    if uploaded is not None:
        err.print(
            f"uploaded to {server}: profile #{uploaded.get('id')} "
            f"({'new' if uploaded.get('created') else 'already stored'})"
        )

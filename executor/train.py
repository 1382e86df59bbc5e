"""The executor's worker: apply a Plan to a real model inside each torchrun process, train, report.

``python -m executor.train --plan PLAN.json [...]`` under torchrun (``autopar run`` launches it).
Order: process group -> device mesh -> model on the meta device -> pipeline split -> tensor/sequence
parallel -> context parallel -> expert parallel -> recompute -> FSDP (ZeRO-2/3, HSDP) ->
materialise the plan-independent weights -> DDP / gradient all-reduce (ZeRO-0/1) -> optimizer ->
(resume from a checkpoint) -> N steps -> RunReport on rank 0.

Loss convention (the reference's, :mod:`executor.reference`): the loss of a step is the mean
next-token cross-entropy over every token of the global batch; each micro-batch contributes its
token-loss sum / the step's global token count (times the data-parallel averaging factor, so the
reduced gradient is the single-process one). The logged loss is that sum over all micro-batches
of all ranks, identical on every rank.

Step time: from a barrier before the step to a barrier after the optimizer update (CUDA
synchronised), so it is the slowest rank's time. Median after ``warmup`` steps; tokens/s =
global tokens per step / median; MFU = ``plan.prediction.model_flops_per_step`` / (median x ranks
x peak FLOP/s of one rank), the peak from ``--profile`` as the prediction's MFU takes it
(:func:`planner.cost.predict.mfu_peak_flops`: the dense 16-bit peak, or the fp32 one where faster,
as on a CPU without native bf16) or, on a known GPU without a profile, the reference datasheet in
the plan's precision; None otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from executor.devices import cuda_ranks
from executor.measure import StepProfiler, label
from planner.contracts import (
    ClusterProfile,
    Environment,
    Plan,
    Precision,
    RunReport,
    StepRecord,
)
from planner.errors import AutoparError
from planner.files import write_or_keep

DIE_ENV = "AUTOPAR_TEST_DIE"  # "RANK:STEP:MARKER_FILE": that rank exits at that step once (restart tests)


@dataclass
class RunOptions:
    """What ``autopar run`` passes to every worker besides the plan."""

    steps: int = 10
    warmup: int = 2
    seed: int = 0
    lr: float = 1e-3
    data: str | None = None
    hf_config: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    async_checkpoint: bool = False
    resume: bool = False
    out: str | None = None
    record_dir: str | None = None  # tests: per-rank losses, first-step gradients, final weights
    profile: str | None = None
    plan_id: str | None = None
    profile_steps: int = 2  # the last steps run under torch.profiler for the breakdown (0: none)


def profiled_from(opts: RunOptions, start: int) -> int:
    """The first step run under the profiler: the last ``opts.profile_steps`` steps, where at least one step this
    run times after its warm-up (it starts at ``start``: 0, or the step it resumed at) is left unprofiled for
    the median; else none (``opts.steps``)."""
    timed_from = start + min(opts.warmup, opts.steps - start - 1)  # the report's first step in the median
    first = opts.steps - opts.profile_steps
    return first if opts.profile_steps > 0 and first > timed_from else opts.steps


def check_plan(plan: Plan, *, hf_config: dict | None = None) -> None:
    """Everything the executor refuses, checked before any process starts (AutoparError with the fix)."""
    from executor.parallelize import check_supported
    from executor.pipeline import check_pipeline

    lay = plan.layout
    if lay.num_gpus != plan.num_gpus:
        raise AutoparError("plan.num_gpus", plan.num_gpus, f"use a plan whose mesh covers {lay.num_gpus} ranks",
                           problem=f"differs from pp x dp x cp x tp = {lay.num_gpus}")
    check_supported(lay, plan.model, plan.training, hf=hf_config is not None)
    if hf_config is None:
        from executor.model import check_builtin

        check_builtin(plan.model)
    else:
        from executor.hf import build_hf_model, check_parallelisable

        with torch.device("meta"):
            check_parallelisable(build_hf_model(hf_config), lay)
    gbs = plan.training.global_batch_seqs
    if gbs % (lay.dp * lay.micro_batch_size):
        raise AutoparError("training.global_batch_size", gbs,
                           f"use a multiple of dp x micro_batch_size = {lay.dp * lay.micro_batch_size}",
                           problem="does not split into equal micro-batches")
    check_pipeline(lay, plan.model, gbs // (lay.dp * lay.micro_batch_size), hf=hf_config is not None)
    if lay.sp and plan.training.seq_length % (lay.tp * lay.cp * (2 if lay.cp > 1 else 1)):
        raise AutoparError("training.seq_length", plan.training.seq_length,
                           f"use a multiple of tp x cp{' x 2' if lay.cp > 1 else ''}",
                           problem="does not split over the sequence-parallel ranks")


def _device() -> torch.device:
    if cuda_ranks():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _init_process_group(backend: str) -> None:
    """The default process group. After torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT > 0),
    on a store namespace of this attempt: the agent's store still holds the failed attempt's gloo
    addresses, which a fresh group would otherwise try to connect to."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timedelta(minutes=5))
    dist.init_process_group(backend, store=dist.PrefixStore(f"autopar_attempt_{attempt}/", store), rank=rank,
                            world_size=world)


def _give_positions(part: nn.Module, positions: torch.Tensor, hf: bool, cp: int) -> None:
    """The rank's global sequence positions (RoPE, causal mask): the built-in model reads ``.positions``;
    a Hugging Face one gets them under CP (:func:`executor.hf_cp.set_positions`)."""
    if not hf:
        part.positions = positions
    elif cp > 1:
        from executor.hf_cp import set_positions

        set_positions(part, positions)


def _build(plan: Plan, opts: RunOptions) -> tuple[nn.Module, dict[str, torch.Tensor], bool]:
    """The model on the meta device, its plan-independent full weights by name, and whether it is HF."""
    if opts.hf_config is not None:
        from executor.hf import build_hf_model, hf_full_state

        config = json.loads(Path(opts.hf_config).read_text())
        full_sd = hf_full_state(config, seed=opts.seed)
        with torch.device("meta"):
            model = build_hf_model(config, seed=opts.seed)
        return model, full_sd, True
    from executor.model import build_model, full_state_dict

    return build_model(plan.model, device="meta"), full_state_dict(plan.model, opts.seed), False


class Runtime:
    """One process's share of a plan: model chunks, optimizer, data, and the step function."""

    def __init__(self, plan: Plan, opts: RunOptions) -> None:
        from executor.data import SyntheticTokens, TokenFile
        from executor.parallelize import (
            GradAllReduce,
            build_mesh,
            build_optimizer,
            cp_shard_batch,
            data_rank,
            grad_scale,
            materialise,
            parallelize,
        )
        from executor.pipeline import build_schedule, last_rank, split_model

        self.plan, self.opts, self.layout = plan, opts, plan.layout
        lay = plan.layout
        self.device = _device()
        if not dist.is_initialized():
            _init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.meshes = build_mesh(lay, self.world, self.device.type)
        self.pp_rank, _ = self.meshes.coord("pp")
        self.dp_rank, self.dp_size = data_rank(self.meshes)
        torch.manual_seed(opts.seed)

        model, full_sd, self.hf = _build(plan, opts)
        parts = split_model(model, lay, self.pp_rank) if lay.pp > 1 else [model]
        seq = plan.training.seq_length
        self._cp_shard = cp_shard_batch
        _, _, self.positions = cp_shard_batch(torch.zeros(1, seq, dtype=torch.long),
                                              torch.zeros(1, seq, dtype=torch.long), self.meshes)
        choice = lay.recompute_per_stage[self.pp_rank] if lay.recompute_per_stage else None
        wrapped = []
        for part in parts:
            wrapped.append(parallelize(part, lay, self.meshes, training=plan.training, stage_recompute=choice))
            _give_positions(part, self.positions, self.hf, lay.cp)
        materialise(parts, full_sd, self.device, offload=lay.offload_optimizer)
        self.parts = parts
        self.sync = [w for w in wrapped if isinstance(w, GradAllReduce)]
        self.model = wrapped[0]
        self.optimizer = build_optimizer(parts, lay, self.meshes, opts.lr)
        self.scale = grad_scale(lay)
        gbs = plan.training.global_batch_seqs
        self.global_batch = gbs
        self.n_micro_local = gbs // (self.dp_size * lay.micro_batch_size)
        self.n_micro_global = gbs // lay.micro_batch_size
        self.global_tokens = gbs * seq
        vocab = plan.model.vocab_size
        self.data = TokenFile(opts.data, seq, vocab) if opts.data else SyntheticTokens(vocab, seq, opts.seed)
        self.moe = not self.hf and plan.model.moe is not None
        self.schedule = self.stages = None
        if lay.pp > 1:
            self.schedule, self.stages = build_schedule(
                parts, lay, self.meshes["pp"].get_group(), self.pp_rank, n_microbatches=self.n_micro_local,
                loss_fn=self._pp_loss, device=self.device, grad_scale=float(self.scale),
                aux_weight=1.0 / self.n_micro_global if self.moe else 0.0)
        self.first = self.pp_rank == 0
        self.last = self.pp_rank == last_rank(lay)  # pp - 1, or 0 under the V schedules
        self._ready: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # prefetch()

    def prefetch(self, step: int) -> None:
        """Prepare step ``step``'s batch now, outside the timed step (a data loader's workers would
        have it ready; generating it inside put 2048 host-side positions into every GPU step)."""
        self._ready = (step, self._local_batch(step))

    def _local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step ``step``'s global batch (its sequence positions under CP)."""
        from executor.data import split_batch

        rows = torch.cat(split_batch(self.data.batch(step, self.global_batch), self.dp_rank, self.dp_size,
                                     self.layout.micro_batch_size))
        tokens, targets, _ = self._cp_shard(rows[:, :-1], rows[:, 1:], self.meshes)
        return tokens.to(self.device), targets.to(self.device)

    def _pp_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (the schedule runs inside :func:`loss_context`,
        entered once around the whole step: loss_parallel does not nest, and the schedule runs the backward)."""
        from executor.reference import lm_loss

        loss = lm_loss(output, target, self.global_tokens)
        # a DTensor under TP: the schedule backpropagates from plain tensors
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    def step(self, step: int) -> float:
        """Forward and backward of step ``step`` (gradients reduced); returns the global loss, same on every rank."""
        from executor.parallelize import autocast_context

        ready, self._ready = self._ready, None
        tokens, targets = ready[1] if ready is not None and ready[0] == step else self._local_batch(step)
        self.optimizer.zero_grad(set_to_none=True)
        with autocast_context(self.layout, self.plan.training, self.device):
            local = self._forward_backward(tokens, targets)
        for s in self.sync:
            s.sync()
        total = local.reshape(1) if isinstance(local, torch.Tensor) else \
            torch.tensor([local], dtype=torch.float64, device=self.device)
        with label("autopar.other"):  # the loss's all-reduce, for the report: not a planned collective
            dist.all_reduce(total)
        # every TP rank of a data-parallel rank computed the same loss: count it once
        return total.item() / self.layout.tp

    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> float | torch.Tensor:
        """All micro-batches of one step (pipelined or accumulated); this rank's share of the loss (a
        float64 tensor on the device when accumulated here: read once, after the step's collectives)."""
        from executor.parallelize import accumulation_cadence, add_aux_loss, loss_context
        from executor.pipeline import pipeline_step
        from executor.reference import lm_loss

        local: float | torch.Tensor = 0.0
        if self.schedule is not None:
            with loss_context(self.layout):
                local = pipeline_step(self.schedule, self.stages, tokens if self.first else None,
                                      targets if self.last else None, self.first, self.last)
        else:
            mbs, n = self.layout.micro_batch_size, self.n_micro_local
            for i in range(n):
                x, y = tokens[i * mbs:(i + 1) * mbs], targets[i * mbs:(i + 1) * mbs]
                accumulation_cadence(self.model, self.layout, i == n - 1)
                with loss_context(self.layout):
                    out = self.model(x)
                    logits = out.logits if hasattr(out, "logits") else out
                    loss = lm_loss(logits, y, self.global_tokens)
                    if self.moe:
                        loss = add_aux_loss(loss, self.parts[0].aux_loss() / self.n_micro_global)
                    value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
                    # summed on the device, read once after the last backward: an .item() here made
                    # the host wait for each forward before queueing its backward (the GPU idled)
                    local = local + value.detach().double()
                    (loss * self.scale).backward()
        return local

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient of this rank's parts as a full tensor (collective over the sharding meshes)."""
        return {name: t for name, t in self._named_full("grad")}

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter of this rank's parts as a full tensor (collective over the sharding meshes)."""
        return {name: t for name, t in self._named_full("param")}

    def _named_full(self, what: str):
        from executor.parallelize import clean_fqn

        for part in self.parts:
            for name, p in part.named_parameters():
                t = p.grad if what == "grad" else p
                if t is None:
                    continue
                t = t.full_tensor() if hasattr(t, "full_tensor") else t
                yield clean_fqn(name), t.detach().cpu().clone()


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak: CUDA max allocated, or the RSS high-water mark (ru_maxrss, KiB on Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "rss"


def peak_tflops(profile: ClusterProfile | None, device: torch.device, precision: Precision) -> float | None:
    """Peak TFLOP/s of one rank for MFU: the profile's, as the prediction's MFU takes it (so predicted
    and measured MFU share one denominator); without a profile, a known GPU's reference datasheet peak
    in ``precision``; else None."""
    if profile is not None:
        from planner.cost.predict import mfu_peak_flops

        return mfu_peak_flops(profile) / 1e12
    if device.type == "cuda":
        from planner.reference import datasheet_for

        found = datasheet_for(torch.cuda.get_device_name(device))
        return found[1].peak_tflops.get(precision) if found else None
    return None


def _maybe_die(step: int, rank: int) -> None:
    """Test hook: with AUTOPAR_TEST_DIE=RANK:STEP:MARKER, that rank exits at that step unless MARKER exists."""
    spec = os.environ.get(DIE_ENV)
    if not spec:
        return
    die_rank, at, marker = spec.split(":", 2)
    if int(die_rank) == rank and step == int(at) and not Path(marker).exists():
        Path(marker).write_text(f"rank {rank} exited at step {step}\n")
        os._exit(17)


def _console():
    from planner.console import make_console

    # markup off: paths in messages are user text ("[/]" in a folder name would crash rich's parser)
    return make_console(highlight=False, soft_wrap=True)


def _environment(device: torch.device, world: int) -> Environment:
    """The run's machine, described as a profile describes it (:func:`profiler.identity.environment`:
    hosts, driver, CUDA, torch, NCCL or gloo, devices per node), so a report and the profile it is
    judged against can be compared field by field."""
    from profiler.identity import environment

    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    cuda = device.type == "cuda"
    return environment(sorted(set(hosts)), "nccl" if cuda else "gloo", emulated_nodes=False, device_type=device.type)


def train(plan: Plan, opts: RunOptions) -> RunReport | None:
    """Run the plan in this process (one torchrun rank); the RunReport is returned (and written to
    ``opts.out``) on rank 0, None elsewhere.

    Initialises the process group unless it already is, and destroys it at the end. Resumes from
    the newest checkpoint in ``opts.checkpoint_dir`` when ``opts.resume`` or when torchrun restarted
    the workers after a failure (TORCHELASTIC_RESTART_COUNT > 0)."""
    from executor.checkpoint import Checkpointer, latest_step

    rt = Runtime(plan, opts)
    console = _console() if rt.rank == 0 else None
    ckpt = Checkpointer(opts.checkpoint_dir, every=opts.checkpoint_every, use_async=opts.async_checkpoint) \
        if opts.checkpoint_dir else None
    start, history = 0, []
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if ckpt is not None and (opts.resume or restarted) and (found := latest_step(opts.checkpoint_dir)) is not None:
        progress = ckpt.load(found, rt.parts, rt.optimizer)
        start = int(progress["step"])
        history = [StepRecord(step=i, loss=loss, time_s=t)
                   for i, (loss, t) in enumerate(zip(progress["losses"], progress["times"]))]
        if console:
            console.print(f"resumed from {ckpt.root / f'step_{found}'}: continuing at step {start}")
    records: list[StepRecord] = []
    grads = None
    prof = StepProfiler(opts.profile_steps, profiled_from(opts, start), rt.device.type, plan.layout.tp)
    for step in range(start, opts.steps):
        _maybe_die(step, rt.rank)
        prof.start(step)
        with label("autopar.data"):
            rt.prefetch(step)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        with prof.step(step):
            loss = rt.step(step)
            if opts.record_dir and grads is None:
                grads = rt.full_grads()
            with label("autopar.optimizer"):
                rt.optimizer.step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        dt = max(time.perf_counter() - t0, 1e-9)
        if not math.isfinite(loss):  # the same global loss on every rank: all stop here, alike
            raise AutoparError("--lr", opts.lr, "lower --lr (or check --data's token ids); the steps before it ran",
                               problem=f"made the loss {loss} at step {step}: the run diverged")
        records.append(StepRecord(step=step, loss=loss, time_s=dt, profiled=prof.profiled(step)))
        if console:
            console.print(f"step {step:>5}  loss {loss:.6f}  {dt * 1e3:9.1f} ms")
        if ckpt is not None and ckpt.due(step + 1):
            done = history + records
            ckpt.save(step + 1, rt.parts, rt.optimizer,
                      {"losses": [r.loss for r in done], "times": [r.time_s for r in done]})
    if ckpt is not None:
        ckpt.wait()
    if opts.record_dir:
        state = rt.full_params()
        Path(opts.record_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"losses": [r.loss for r in records], "steps": [r.step for r in records],
                    "history": [r.loss for r in history], "grads": grads, "state": state},
                   Path(opts.record_dir) / f"rank{rt.rank}.pt")
    mem, kind = peak_memory_bytes(rt.device)
    mems: list = [None] * rt.world
    dist.all_gather_object(mems, mem)
    split = prof.result(rt.rank)
    splits: list = [None] * rt.world
    dist.all_gather_object(splits, split)
    env = _environment(rt.device, rt.world)
    report = None
    if rt.rank == 0 and records:
        warm = min(opts.warmup, len(records) - 1)  # steps restored from a checkpoint are not timed either
        median = statistics.median(r.time_s for r in records[warm:] if not r.profiled)
        profile = ClusterProfile.model_validate_json(Path(opts.profile).read_text()) if opts.profile else None
        peak = peak_tflops(profile, rt.device, plan.precision)
        mfu = plan.prediction.model_flops_per_step / (median * rt.world * peak * 1e12) if peak else None
        report = RunReport(
            plan_id=opts.plan_id, layout=plan.layout,
            device=torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
            num_ranks=rt.world, warmup_steps=len(history) + warm, steps=history + records,
            median_step_time_s=median, tokens_per_s=plan.training.tokens_per_step / median, mfu=mfu,
            peak_memory_bytes_per_rank=[int(m) for m in mems], memory_kind=kind, environment=env,
            breakdown=[t for t in splits if t is not None], checkpoints=ckpt.records if ckpt is not None else [])
        if opts.out:
            try:  # a run is never lost to a path: where --out fails now, the report is kept and named
                write_or_keep(Path(opts.out), report.model_dump_json(indent=2), "--out", "run report", "autopar-run")
            except AutoparError as exc:
                _console().print(f"error: {exc}")
    dist.barrier()
    dist.destroy_process_group()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="autopar executor worker (run under torchrun; see `autopar run`)")
    ap.add_argument("--plan", required=True)
    for name, typ, default in (("steps", int, 10), ("warmup", int, 2), ("seed", int, 0), ("lr", float, 1e-3),
                               ("checkpoint-every", int, 0), ("profile-steps", int, 2)):
        ap.add_argument(f"--{name}", type=typ, default=default)
    for name in ("data", "hf-config", "checkpoint-dir", "out", "record-dir", "profile", "plan-id"):
        ap.add_argument(f"--{name}", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--async-checkpoint", action="store_true")
    a = ap.parse_args(argv)
    opts = RunOptions(steps=a.steps, warmup=a.warmup, seed=a.seed, lr=a.lr, data=a.data, hf_config=a.hf_config,
                      checkpoint_dir=a.checkpoint_dir, checkpoint_every=a.checkpoint_every,
                      async_checkpoint=a.async_checkpoint, resume=a.resume, out=a.out, record_dir=a.record_dir,
                      profile=a.profile, plan_id=a.plan_id, profile_steps=a.profile_steps)
    try:
        plan = Plan.model_validate_json(Path(a.plan).read_text())
        train(plan, opts)
    except AutoparError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def _exit_now(code: int) -> None:
    """Leave without interpreter finalisation. Process groups stay referenced by the device meshes
    and FSDP/DTensor state after ``destroy_process_group``; if they are freed while the interpreter
    is being torn down, gloo's worker threads can still hold work whose tensors need the GIL, and the
    process aborts ("terminate called without an active exception", SIGABRT) after a successful run
    (seen once in ~20 loaded runs). The report is written and the streams flushed before this."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())

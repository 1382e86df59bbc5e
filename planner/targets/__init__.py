"""What each target can run: one capability table per target, read by the search, ``autopar export`` and
the executor's refusal.

A target is where a plan is meant to run: ``autopar`` (this project's executor) or a framework that
``autopar export`` writes launch files for (``megatron``, ``deepspeed``, ``torchtitan``). Its table
(:data:`TARGETS`) is a list of :class:`Limit` rows, each one feature the target cannot run: a test
on a :class:`Job` (model, training, layout) and the :class:`~planner.errors.AutoparError` it raises
(field, value, problem, fix). :func:`refusal` returns the first row's error, :func:`check` raises it.
Adding a schedule or a feature a target lacks is one row in that target's module; nothing else decides
what a target runs.

A row's ``scope`` says which part of the job it reads, so that the search can ask before choosing a
layer split: ``model`` (model and training only), ``layout`` (the base layout's fields: degrees,
ZeRO, schedule, virtual stages, offload, resharding, overlaps, sp, micro-batch size) and ``split``
(``layers_per_stage``, ``recompute_per_stage``, micro-batch counts). ``uneven_split`` and
``per_stage_recompute`` tell the search whether it may vary the split or the recompute per stage at
all; the split rows say which particular choices are refused.

A target also prices differently (:class:`TargetFacts`, ``TargetSpec.facts``): the bytes its loss holds
per logit, what its pipeline stages send (``pp_scatter_gather`` follows from the target and ``sp``; a
``pp_sends`` row refuses any other value, so no plan prices sends the target does not do) and whether
its fp32 master copy is the parameter itself. ``predict(..., target=...)`` and the search read them
here; every fact names its source.

Each table names the framework release its rows were checked against (source paths in the row
comments); this package never imports torch.

One target is one module here, holding everything about it: its facts, its table (its ``Limit`` rows), its
``SPEC`` (:class:`TargetSpec`, with the release) and, for a framework, the writer of its launch files
(``TargetSpec.render``, which ``autopar export`` calls): :mod:`~planner.targets.autopar`,
:mod:`~planner.targets.megatron`, :mod:`~planner.targets.deepspeed`, :mod:`~planner.targets.torchtitan`.
Beside them: :mod:`~planner.targets.core` (the machinery: ``Target``, ``Job``, ``Limit``, ``TargetFacts``,
``TargetSpec``, the refusal and the lookups), :mod:`~planner.targets.split` (the layer split and recompute per
stage as the frameworks state them), :mod:`~planner.targets.rows` (rows shared by several targets) and
:mod:`~planner.targets.launch` (what the launch-file writers share). A new target is one module here with a
``SPEC``, plus one member of the :class:`Target` enum (and its line in ``_MODULES`` below).
"""

from __future__ import annotations

from planner.contracts.limits import ONE_KERNEL
from planner.targets import autopar, deepspeed, megatron, torchtitan
from planner.targets.core import (
    GPUS_PER_NODE,
    GROUPED_MM_GPUS,
    SCOPES,
    TARGETS,
    Job,
    Limit,
    Target,
    TargetFacts,
    TargetRefusal,
    TargetSpec,
    check,
    job_of,
    loss_bytes_per_logit,
    planned_scatter_gather,
    priced_profile,
    refusal,
    target_facts,
)
from planner.targets.split import (
    RecomputeSetting,
    every_nth_recompute,
    recompute_text,
    stage_layers,
    uniform_recompute,
)
from planner.targets.torchtitan import titan_compiled

__all__ = [
    "GPUS_PER_NODE",
    "GROUPED_MM_GPUS",
    "ONE_KERNEL",
    "SCOPES",
    "TARGETS",
    "Job",
    "Limit",
    "RecomputeSetting",
    "Target",
    "TargetFacts",
    "TargetRefusal",
    "TargetSpec",
    "check",
    "every_nth_recompute",
    "job_of",
    "loss_bytes_per_logit",
    "planned_scatter_gather",
    "priced_profile",
    "recompute_text",
    "refusal",
    "stage_layers",
    "titan_compiled",
    "target_facts",
    "uniform_recompute",
]

_MODULES = {
    Target.autopar: autopar,
    Target.megatron: megatron,
    Target.deepspeed: deepspeed,
    Target.torchtitan: torchtitan,
}

TARGETS.update({t: _MODULES[t].SPEC for t in Target})  # core's registry, which refusal() and the rest read

"""Export an autopar :class:`~planner.contracts.Plan` as launch configuration for a training framework.

``export_plan(plan, target)`` returns ``{file name: file text}``:

- ``megatron``: ``megatron_args.sh``, a bash script that runs Megatron-LM's ``pretrain_gpt.py`` under
  ``torchrun`` with one argument per line.
- ``deepspeed``: ``ds_config.json`` (the DeepSpeed runtime config) and ``megatron_deepspeed_args.sh``
  (Megatron-DeepSpeed's ``pretrain_gpt.py`` arguments for TP/PP and the model).
- ``torchtitan``: ``torchtitan_train.sh``, ``torchrun -m torchtitan.train`` with a torchtitan 0.3.0 config
  registry entry (``--module``/``--config``) and ``--section.key`` overrides.

Each target's writer is its ``TargetSpec.render``, in the target's own module beside its capability table
(``planner/targets/megatron.py``, ``deepspeed.py``, ``torchtitan.py``; what they share is
``planner/targets/launch.py``); this package checks the plan and dispatches.

Every layout field a target can express is written out. What a target cannot express is a row of its
capability table (:mod:`planner.targets`, read before anything is rendered): the export raises
:class:`~planner.errors.AutoparError` naming the field, its value and what to change, so an export
never silently runs something other than the plan that was predicted.

Option names were checked against the frameworks' sources (flags are only names here; nothing is
copied): NVIDIA/Megatron-LM ``megatron/training/arguments.py`` and
``megatron/core/transformer/pipeline_parallel_layer_layout.py``; deepspeedai/Megatron-DeepSpeed
``megatron/arguments.py``, ``pretrain_gpt.py`` and microsoft/Megatron-DeepSpeed
``megatron/model/gpt_model.py``; deepspeedai/DeepSpeed ``deepspeed/runtime/constants.py``,
``deepspeed/runtime/zero/config.py``, ``deepspeed/runtime/config.py`` and
``deepspeed/runtime/pipe/engine.py``; torchtitan 0.3.0 ``torchtitan/config/manager.py``,
``torchtitan/config/configs.py``, ``torchtitan/trainer.py`` and ``torchtitan/models/*/config_registry.py``.
"""

from __future__ import annotations

from planner.contracts import Plan
from planner.cost.checks import check_plan
from planner.errors import UnknownNameError
from planner.targets import GPUS_PER_NODE, Target, job_of, refusal
from planner.targets import TARGETS as SPECS

TARGETS = ("megatron", "deepspeed", "torchtitan")

__all__ = ["GPUS_PER_NODE", "TARGETS", "export_plan"]


def export_plan(plan: Plan, target: str) -> dict[str, str]:
    """Launch configuration for ``plan`` on ``target`` (one of :data:`TARGETS`): ``{file name: text}``.

    The target's capability table (:mod:`planner.targets`) decides what it can run; a plan made for
    another target that the table refuses gets an error naming the blocking feature."""
    key = str(target).strip().lower().replace("-", "").replace("_", "")
    aliases = {
        "megatron": "megatron",
        "megatronlm": "megatron",
        "deepspeed": "deepspeed",
        "megatrondeepspeed": "deepspeed",
        "torchtitan": "torchtitan",
    }
    if key not in aliases:
        raise UnknownNameError("target", target, list(TARGETS))
    check_plan(plan)  # a hand-edited plan would give launch arguments that cannot run
    planned = _planned_for(plan)
    err = refusal(aliases[key], job_of(plan))
    if err is not None:
        raise err.for_plan_made_for(planned)
    render = SPECS[Target(aliases[key])].render
    assert render is not None  # every export target's SPEC has its writer
    return render(plan)


def _planned_for(plan: Plan) -> Target:
    try:
        return Target(plan.target)
    except ValueError:
        raise UnknownNameError("plan.target", plan.target, [t.value for t in Target]) from None


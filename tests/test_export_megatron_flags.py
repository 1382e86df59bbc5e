"""Every flag planner/targets/megatron.py writes for Megatron-LM exists in the release its SPEC names.

The release's options (names, how many values each takes, the accepted values of enumerated options) are
facts read from Megatron-LM's own parser at that tag by benchmarks/megatron_flags.py and stored in
tests/data/megatron_<tag>_flags.json; no network at test time. Each plan below is exported, the script runs
under bash with a stand-in ``torchrun`` (tests/test_export.py), and the argv ``pretrain_gpt.py`` would get
is checked the way Megatron's argparse parser (``allow_abbrev=False``) would: unknown flag, missing or
stray value, a value that is not an int/float where one is wanted, a value outside ``choices``.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
from test_export import make_plan, run_script

from planner.contracts import ModelSpec, MoESpec, Precision, StageRecompute
from planner.export import export_plan
from planner.presets import get_preset
from planner.targets import TARGETS, Target, launch, megatron

DATA = Path(__file__).parent / "data"

# Flags the exporter may write although the release lacks them: flag -> why (e.g. only on Megatron-LM
# main). Empty: --overlap-moe-expert-parallel-comm, which the Megatron exporter calls main-only, is in core_v0.19.0.
NOT_IN_RELEASE: dict[str, str] = {}

# Flags the export's comments name although the release lacks them: flag -> why.
NAMED_IN_NOTES_ONLY = {
    "--use-custom-fsdp": "the notes give it as the older releases' name of --use-megatron-fsdp"
}


def release() -> str:
    """The Megatron-Core tag the capability table names (its one home: TargetSpec.framework)."""
    found = re.findall(r"core_v\d+\.\d+\.\d+\w*", TARGETS[Target.megatron].framework)
    assert len(found) == 1, TARGETS[Target.megatron].framework
    return found[0]


def load_table() -> dict:
    path = DATA / f"megatron_{release()}_flags.json"
    assert path.exists(), f"{path} missing: run benchmarks/megatron_flags.py on a {release()} checkout"
    return json.loads(path.read_text())


TABLE = load_table()
FLAGS: dict[str, dict] = TABLE["flags"]


def _value_problem(flag: str, row: dict, value: str) -> str | None:
    kind = row.get("type", "str")
    try:
        {"int": int, "float": float}.get(kind, str)(value)
    except ValueError:
        return f"{flag} {value!r}: not of type {kind}"
    if "choices" in row and value not in row["choices"]:
        return f"{flag} {value!r}: not one of {row['choices']}"
    return None


def _arity_problem(flag: str, nargs: int | str, values: list[str]) -> str | None:
    n = len(values)
    ok = {"?": n <= 1, "*": True, "+": n >= 1}[nargs] if isinstance(nargs, str) else n == nargs
    return None if ok else f"{flag}: takes {nargs} value(s), given {values}"


def flag_problems(argv: list[str], flags: dict[str, dict], allowed: dict[str, str]) -> list[str]:
    """What Megatron's parser would refuse in ``argv`` (the words after ``pretrain_gpt.py``)."""
    problems: list[str] = []
    if argv and not argv[0].startswith("--"):
        problems.append(f"{argv[0]!r}: a value before any flag")
    groups: list[tuple[str, list[str]]] = []
    for word in argv:
        if word.startswith("--"):
            groups.append((word, []))
        elif groups:
            groups[-1][1].append(word)
    for flag, values in groups:
        if flag in allowed:
            continue
        if flag not in flags:
            problems.append(f"{flag}: not an option of Megatron-LM {TABLE['tag']}")
            continue
        row = flags[flag]
        arity = _arity_problem(flag, row["nargs"], values)
        problems += [arity] if arity else []
        if row["nargs"] != 0 and not arity:
            problems += [p for v in values if (p := _value_problem(flag, row, v))]
    return problems


def pretrain_argv(plan, tmp_path) -> list[str]:
    argv = run_script(export_plan(plan, "megatron")["megatron_args.sh"], tmp_path)
    script = next(i for i, w in enumerate(argv) if w.endswith("/pretrain_gpt.py"))
    return argv[script + 1 :]


def _tiny_moe() -> ModelSpec:
    moe = MoESpec(
        num_experts=8,
        top_k=2,
        expert_ffn_hidden_size=512,
        num_shared_experts=2,
        first_dense_layers=1,
        layer_frequency=2,
        capacity_factor=1.25,
    )
    return ModelSpec(
        name="tiny-moe",
        num_layers=9,
        hidden_size=1024,
        num_attention_heads=16,
        ffn_hidden_size=4096,
        vocab_size=32000,
        moe=moe,
    )


def _gpt_unfused_fp16():
    return make_plan(
        "gpt3-1.3b",
        gpus=8,
        gbs=16,
        seq=2048,
        precision=Precision.fp16,
        tp=2,
        sp=True,
        dp_shard=4,
        training={"flash_attention": False, "optimizer": "sgd"},
    )


BLOCK4 = [StageRecompute(kind="full", num_layers=4)] * 2
BLOCK2_INTERLEAVED = [StageRecompute(kind="full", num_layers=4)] * 4
INTERLEAVED = {
    "tp": 2,
    "sp": True,
    "pp": 4,
    "dp_shard": 2,
    "schedule": "interleaved_1f1b",
    "virtual_stages": 2,
}

CASES = {
    "dense tp pp zero1 selective": lambda: make_plan(
        tp=4, sp=True, pp=2, dp_shard=2, zero_stage=1, micro_batch_size=2, recompute="selective"
    ),
    "zero0 no dp overlap": lambda: make_plan(tp=8, sp=True, dp_shard=2, zero_stage=0, dp_comm_overlap=False),
    "interleaved": lambda: make_plan(**INTERLEAVED),
    "interleaved uneven layout": lambda: make_plan(**INTERLEAVED, layers_per_stage=[3, 4, 4, 4, 4, 4, 4, 5]),
    "uneven first last": lambda: make_plan(tp=4, sp=True, pp=4, layers_per_stage=[7, 9, 9, 7]),
    "arbitrary split layout": lambda: make_plan(tp=4, sp=True, pp=4, layers_per_stage=[6, 10, 9, 7]),
    # without SP Megatron-Core sends whole activations (schedules.py get_tensor_shapes): no flag to write
    "pp no scatter gather": lambda: make_plan(tp=4, pp=2, dp_shard=2, pp_scatter_gather=False),
    "full uniform recompute": lambda: make_plan(tp=8, sp=True, pp=2, recompute="full"),
    "full block recompute": lambda: make_plan(tp=8, sp=True, pp=2, recompute_per_stage=BLOCK4),
    "block recompute interleaved": lambda: make_plan(**INTERLEAVED, recompute_per_stage=BLOCK2_INTERLEAVED),
    "cp zero1": lambda: make_plan(tp=4, sp=True, cp=2, dp_shard=2, zero_stage=1),
    "hybrid distributed optimizer": lambda: make_plan(
        tp=4, sp=True, dp_replicate=2, dp_shard=2, zero_stage=1
    ),
    "megatron-fsdp zero2": lambda: make_plan(tp=2, sp=True, dp_shard=8, zero_stage=2),
    "megatron-fsdp zero3 hsdp": lambda: make_plan(tp=2, sp=True, dp_replicate=2, dp_shard=4, zero_stage=3),
    "optimizer offload": lambda: make_plan(tp=8, sp=True, dp_shard=2, zero_stage=1, offload_optimizer=True),
    "tp comm overlap": lambda: make_plan(tp=8, sp=True, dp_shard=2, tp_comm_overlap=True),
    "fp8": lambda: make_plan(tp=8, sp=True, dp_shard=2, precision=Precision.fp8),
    "bf16 grads in bf16": lambda: make_plan(
        tp=8, sp=True, dp_shard=2, training={"grad_reduce_in_fp32": False}
    ),
    "gpt learned fp16 unfused sgd": _gpt_unfused_fp16,
    "moe ep alltoall": lambda: make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, zero_stage=1),
    "moe ep etp": lambda: make_plan("mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, etp=1, zero_stage=1),
    "moe ep overlap": lambda: make_plan(
        "mixtral-8x7b", tp=2, sp=True, dp_shard=8, ep=8, zero_stage=1, ep_comm_overlap=True
    ),
    "moe pattern shared capacity": lambda: make_plan(
        _tiny_moe(), gpus=8, gbs=16, seq=2048, tp=1, dp_shard=8, ep=4, zero_stage=1
    ),
    "moe pp": lambda: make_plan("qwen3-30b-a3b", tp=2, sp=True, pp=2, dp_shard=4, ep=4, zero_stage=1),
    "qwen2 qkv bias": lambda: make_plan(
        get_preset("llama3-8b").model_copy(update={"qkv_bias": True}), tp=4, sp=True, dp_shard=4, zero_stage=1
    ),
    "deepseek mla": lambda: make_plan(
        "deepseek-v3", gpus=256, gbs=512, tp=2, sp=True, pp=8, dp_shard=16, ep=16, zero_stage=1
    ),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, list[str]]:
    out = {}
    for name, build in CASES.items():
        out[name] = pretrain_argv(build(), tmp_path_factory.mktemp("megatron"))
    return out


def test_the_data_file_is_the_release_the_target_names():
    assert TABLE["repository"] == "NVIDIA/Megatron-LM" and TABLE["tag"] == release()
    assert re.fullmatch(r"[0-9a-f]{40}", TABLE["commit"]) and TABLE["path"].startswith("megatron/")
    # facts any Megatron-LM release has, by hand: a switch, an int, and the recompute choices
    assert FLAGS["--bf16"]["nargs"] == 0 and FLAGS["--num-layers"]["type"] == "int"
    assert FLAGS["--recompute-granularity"]["choices"] == ["full", "selective"]


@pytest.mark.parametrize("name", list(CASES))
def test_every_flag_is_in_the_release(name, exported):
    assert flag_problems(exported[name], FLAGS, NOT_IN_RELEASE) == []


def test_the_cases_write_every_flag_the_megatron_exporter_can_write(exported):
    """A flag added to the exporter without a plan here that writes it fails this test."""
    source = (inspect.getsource(megatron) + inspect.getsource(launch.run_lines)
              + inspect.getsource(launch.recompute_flags) + inspect.getsource(launch.block_flags))
    written = set(re.findall(r"\.(?:add|raw)\(\s*[\"'](--[a-z0-9-]+)", source))
    seen = {w for argv in exported.values() for w in argv if w.startswith("--")}
    assert written and written - seen == set(), "add a case to CASES that writes these"


def test_flags_the_notes_name_are_in_the_release():
    text = export_plan(CASES["tp comm overlap"](), "megatron")["megatron_args.sh"]
    text += export_plan(CASES["megatron-fsdp zero3 hsdp"](), "megatron")["megatron_args.sh"]
    text += export_plan(CASES["fp8"](), "megatron")["megatron_args.sh"]
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    named = set(re.findall(r"--[a-z0-9]+(?:-[a-z0-9]+)*(?![-*/\w])", comments))
    assert {"--tp-comm-bootstrap-backend", "--fp8-recipe", "--transformer-impl"} <= named
    assert named - set(FLAGS) - set(NAMED_IN_NOTES_ONLY) == set()


def test_allow_lists_name_only_flags_the_release_lacks():
    assert set(NOT_IN_RELEASE) & set(FLAGS) == set() and set(NAMED_IN_NOTES_ONLY) & set(FLAGS) == set()


def test_the_checker_refuses_what_megatron_would():
    ok = ["--num-layers", "32", "--bf16", "--recompute-granularity", "full", "--cp-comm-type", "p2p"]
    assert flag_problems(ok, FLAGS, {}) == []
    assert flag_problems(["--made-up-flag", "1"], FLAGS, {}) == [
        f"--made-up-flag: not an option of Megatron-LM {release()}"
    ]
    assert flag_problems(["--made-up-flag"], FLAGS, {"--made-up-flag": "test"}) == []
    assert flag_problems(["--num-layer", "32"], FLAGS, {})  # no abbreviations (allow_abbrev=False)
    assert flag_problems(["--recompute-granularity", "partial"], FLAGS, {})  # not a choice
    assert flag_problems(["--num-layers", "3.5"], FLAGS, {})  # not an int
    assert flag_problems(["--bf16", "true"], FLAGS, {})  # a switch takes no value
    assert flag_problems(["--num-layers"], FLAGS, {})  # a value is missing

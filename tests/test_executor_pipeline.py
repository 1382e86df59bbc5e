"""executor.pipeline: the layer split, the per-rank model copies and the refusals in one process; every
schedule under torchrun (4 gloo ranks, tests/dist_scripts/pipeline_check.py) against the
single-process reference run: the 3 step losses and each rank's first-step gradients within 1e-5."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.data import SyntheticTokens
from executor.model import build_model
from executor.pipeline import _AuxLossGrad, check_pipeline, last_rank, rank_chunks, split_model, stage_layer_ids
from executor.reference import ReferenceResult, reference_run
from planner.contracts import ModelSpec, ParallelLayout
from planner.errors import AutoparError

SCRIPT = Path(__file__).parent / "dist_scripts" / "pipeline_check.py"
TOLERANCE = 1e-5  # fp32: |pipeline - ref| <= TOLERANCE * (1 + |ref|) for losses and every gradient element

_spec = importlib.util.spec_from_file_location("pipeline_check", SCRIPT)
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

SPEC = ModelSpec(name="t", num_layers=8, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=64, vocab_size=128)


# ---------------------------------------------------------------- one process
def test_even_split_is_the_planners_default_and_interior_stages_take_the_extra_layers() -> None:
    assert stage_layer_ids(ParallelLayout(pp=4), 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layer_ids(ParallelLayout(pp=4), 10) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert stage_layer_ids(ParallelLayout(), 3) == [[0, 1, 2]]


def test_uneven_split_follows_layers_per_stage() -> None:
    assert stage_layer_ids(ParallelLayout(pp=2, layers_per_stage=[1, 3]), 4) == [[0], [1, 2, 3]]


def test_interleaved_chunks_are_consecutive_and_chunk_c_runs_on_rank_c_mod_pp() -> None:
    layout = ParallelLayout(pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                            layers_per_stage=[1, 2, 2, 1])
    assert stage_layer_ids(layout, 6) == [[0], [1, 2], [3, 4], [5]]
    assert rank_chunks(layout, 0) == [0, 2] and rank_chunks(layout, 1) == [1, 3]
    assert rank_chunks(ParallelLayout(pp=4, virtual_stages=2, schedule="interleaved_1f1b"), 3) == [3, 7]


@pytest.mark.parametrize("schedule", ["zero_bubble_v", "dualpipe_v"])
def test_v_schedules_put_chunks_r_and_2pp_minus_1_minus_r_on_rank_r(schedule) -> None:
    layout = ParallelLayout(pp=2, virtual_stages=2, schedule=schedule, layers_per_stage=[2, 1, 1, 2])
    assert [rank_chunks(layout, r) for r in range(2)] == [[0, 3], [1, 2]]
    assert last_rank(layout) == 0  # rank 0 holds the embedding and the head
    first, last = split_model(build_model(SPEC.model_copy(update={"num_layers": 6}), device="meta"), layout, 0)
    assert list(first.layers) == ["0", "1"] and first.output is None
    assert list(last.layers) == ["4", "5"] and last.tok_embeddings is None and last.output is not None
    assert ParallelLayout(pp=2, schedule=schedule).virtual_stages == 2  # unstated: the schedule's own depth
    with pytest.raises(ValueError, match="virtual_stages=3 does not fit.*set virtual_stages=2"):
        ParallelLayout(pp=2, schedule=schedule, virtual_stages=3)


@pytest.mark.parametrize(("layout", "layers", "words"), [
    (ParallelLayout(pp=2, layers_per_stage=[1, 2]), 4, ["layout.layers_per_stage=[1, 2]", "sums to 3",
                                                         "num_layers=4"]),
    (ParallelLayout(pp=2, layers_per_stage=[0, 4]), 4, ["layout.layers_per_stage=[0, 4]", "stage 0 empty",
                                                         "at least one layer"]),
    (ParallelLayout(pp=4), 3, ["pp x virtual_stages=4", "at most num_layers=3"]),
])
def test_split_errors_name_the_field_the_value_and_the_fix(layout, layers, words) -> None:
    with pytest.raises(AutoparError) as info:
        stage_layer_ids(layout, layers)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_split_model_keeps_names_embedding_first_head_last() -> None:
    model = build_model(SPEC, device="meta")
    layout = ParallelLayout(pp=2, virtual_stages=2, schedule="interleaved_1f1b",
                            layers_per_stage=[1, 3, 2, 2])
    first, third = split_model(model, layout, 0)
    second, last = split_model(model, layout, 1)
    assert list(first.layers) == ["0"] and list(third.layers) == ["4", "5"]
    assert list(second.layers) == ["1", "2", "3"] and list(last.layers) == ["6", "7"]
    assert first.tok_embeddings is not None and all(p.tok_embeddings is None for p in (second, third, last))
    assert last.norm is not None and last.output is not None and last.has_head
    assert all(p.norm is None and p.output is None and not p.has_head for p in (first, second, third))
    names = [n for p in (first, second, third, last) for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each weight once, same name
    assert len(model.layers) == 8  # the original is untouched


def test_a_middle_stage_maps_hidden_states_to_hidden_states() -> None:
    model = build_model(SPEC, device="cpu")
    middle = split_model(model, ParallelLayout(pp=4), 1)[0]
    h = torch.randn(2, 16, SPEC.hidden_size)
    assert middle(h).shape == (2, 16, SPEC.hidden_size)


def test_split_model_refuses_hugging_face_and_tied_embeddings() -> None:
    with pytest.raises(AutoparError, match="layout.pp=2.*Hugging Face"):
        split_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), ParallelLayout(pp=2), 0)
    tied = build_model(SPEC.model_copy(update={"tied_embeddings": True}), device="meta")
    with pytest.raises(AutoparError, match="model.tied_embeddings=True.*untied"):
        split_model(tied, ParallelLayout(pp=2), 0)


@pytest.mark.parametrize(("layout", "n", "words"), [
    (ParallelLayout(pp=4, schedule="1f1b"), 3, ["micro-batches per pipeline=3", "Schedule1F1B", "at least 4"]),
    (ParallelLayout(pp=4, schedule="zero_bubble"), 9, ["micro-batches per pipeline=9", "multiple of pp=4"]),
    (ParallelLayout(pp=2, schedule="interleaved_1f1b", virtual_stages=2), 5, ["=5", "2 rounds"]),
    (ParallelLayout(pp=4, schedule="dualpipe_v", virtual_stages=2), 7,
     ["micro-batches per pipeline=7", "fewer than the 8", "ScheduleDualPipeV", "at least 8"]),
])
def test_check_pipeline_refuses_micro_batch_counts_torch_cannot_schedule(layout, n, words) -> None:
    with pytest.raises(AutoparError) as info:
        check_pipeline(layout, SPEC, n)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_check_pipeline_accepts_what_the_schedules_run() -> None:
    check_pipeline(ParallelLayout(pp=4, schedule="gpipe"), SPEC, 2)
    check_pipeline(ParallelLayout(pp=4, schedule="zero_bubble"), SPEC, 6)  # one round of 6
    check_pipeline(ParallelLayout(pp=4, schedule="interleaved_1f1b", virtual_stages=2), 8, 2)
    check_pipeline(ParallelLayout(pp=4, schedule="zero_bubble_v", virtual_stages=2), SPEC, 4)
    check_pipeline(ParallelLayout(pp=4, schedule="dualpipe_v", virtual_stages=2), SPEC, 8)
    check_pipeline(ParallelLayout(), SPEC.model_copy(update={"tied_embeddings": True}), 1)


def test_check_pipeline_refuses_tied_and_a_bad_split_before_start() -> None:
    check_pipeline(ParallelLayout(pp=2), SPEC, 4, hf=True)  # Hugging Face models pipeline too
    with pytest.raises(AutoparError, match="model.tied_embeddings"):
        check_pipeline(ParallelLayout(pp=2), SPEC.model_copy(update={"tied_embeddings": True}), 4)
    with pytest.raises(AutoparError, match="layout.layers_per_stage"):
        check_pipeline(ParallelLayout(pp=2, layers_per_stage=[4, 3]), SPEC, 4)
    for zero in (1, 2, 3):  # FSDP2 keeps the stage's weights gathered for the split weight pass
        check_pipeline(ParallelLayout(pp=2, dp_shard=2, zero_stage=zero, schedule="zero_bubble"), SPEC, 4)


def test_aux_loss_node_is_identity_forward_and_adds_the_weighted_aux_gradient() -> None:
    w = torch.randn(3, requires_grad=True)
    hidden = w * 2.0
    aux = (w ** 2).sum()
    out = _AuxLossGrad.apply(hidden, aux, 0.25)
    assert torch.equal(out, hidden)
    out.sum().backward()
    expected = torch.full((3,), 2.0) + 0.25 * 2 * w.detach()  # d(sum(2w) + 0.25 sum(w^2))/dw
    torch.testing.assert_close(w.grad, expected)


# ---------------------------------------------------------------- torchrun, 4 gloo ranks
@pytest.fixture(scope="module")
def dist_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@functools.cache
def _reference(layers: int, moe: bool, global_batch: int) -> ReferenceResult:
    """The single-process run of a case's model and batch (cases sharing both share it), on one
    intra-op thread: tiny matrices on the shared 2-core machine run ~5x slower on two."""
    spec = check.spec(layers, moe)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_run(spec, SyntheticTokens(spec.vocab_size, check.SEQ, check.SEED),
                             steps=check.STEPS, global_batch=global_batch, micro_batch_size=check.MBS,
                             lr=check.LR, seed=check.SEED)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(check.CASES))
def test_pipeline_matches_the_single_process_reference(dist_run, case) -> None:
    out = dist_run
    spec, layout, global_batch = check.case_setup(case)
    ref = _reference(spec.num_layers, spec.moe is not None, global_batch)
    ids = stage_layer_ids(layout, spec.num_layers)
    seen: set[str] = set()
    for rank in range(4):
        report = json.loads((out / case / f"rank{rank}.json").read_text())
        assert report["layers"] == [[str(i) for i in ids[c]] for c in rank_chunks(layout, report["pp_rank"])]
        for got, want in zip(report["losses"], ref.losses, strict=True):
            assert abs(got - want) <= TOLERANCE * (1 + abs(want)), (case, rank, report["losses"], ref.losses)
        grads = torch.load(out / case / f"grads{rank}.pt")
        assert set(grads) == set(report["params"])  # every parameter of the rank got a gradient
        for name, g in grads.items():
            want = ref.grads_first_step[name]
            err = ((g - want).abs() - TOLERANCE * (1 + want.abs())).max().item()
            assert err <= 0, (case, rank, name)
        seen |= set(grads)
    assert seen == set(ref.grads_first_step)  # the pp ranks together hold the whole model

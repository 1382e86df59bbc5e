"""executor.moe: routing, dropless and capacity dispatch, aux loss by hand; expert parallel under torchrun."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from executor.moe import MoE
from planner.contracts import MoESpec
from planner.errors import AutoparError

ROOT = Path(__file__).resolve().parents[1]
EP_SCRIPT = ROOT / "tests" / "dist_scripts" / "ep_check.py"


def seeded_moe(spec: MoESpec, dim: int = 16, kind: str = "swiglu", seed: int = 0) -> MoE:
    moe = MoE(dim, spec, kind)
    moe.init_weights(lambda name: torch.Generator().manual_seed(seed + sum(map(ord, name))))
    return moe


def expert_by_hand(moe: MoE, experts: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e of ``experts`` on one token x [D], written out: SwiGLU or GeLU MLP."""
    g = getattr(moe, experts)
    h = x @ g.w1[e].T
    h = F.silu(h) * (x @ g.w3[e].T) if g.kind == "swiglu" else F.gelu(h, approximate="tanh")
    return h @ g.w2[e].T


def naive(moe: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalise, weighted sum of the kept experts, plus shared ones."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(moe.gate.weight @ x[t], dim=-1)
        top = sorted(range(moe.num_experts), key=lambda e: -float(p[e].detach()))[:moe.top_k]
        norm = sum(p[e] for e in top)
        for j, e in enumerate(top):
            if keep is None or keep[t, j]:
                out[t] += p[e] / norm * expert_by_hand(moe, "experts", e, x[t])
        if moe.shared_experts is not None:
            for s in range(moe.spec.num_shared_experts):
                out[t] += expert_by_hand(moe, "shared_experts", s, x[t])
    return out


def test_top_k_routing_and_renormalised_weights_by_hand():
    moe = MoE(2, MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=4))
    with torch.no_grad():
        moe.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[2.0, 1.0], [0.5, -3.0]])
    ids, weights, probs = moe.route(x)
    # token 0: logits (2, 1, -2, 0) -> experts 0, 1 with weights e^2 / (e^2 + e^1), e^1 / (e^2 + e^1)
    # token 1: logits (0.5, -3, -0.5, 0) -> experts 0, 3 with weights e^0.5 / (e^0.5 + 1), 1 / (e^0.5 + 1)
    assert ids.tolist() == [[0, 1], [0, 3]]
    e1, e2, eh = math.e, math.e ** 2, math.exp(0.5)
    assert torch.allclose(weights[0], torch.tensor([e2 / (e2 + e1), e1 / (e2 + e1)]))
    assert torch.allclose(weights[1], torch.tensor([eh / (eh + 1), 1 / (eh + 1)]))
    z0 = e2 + e1 + math.exp(-2) + 1
    assert torch.allclose(probs[0], torch.tensor([e2, e1, math.exp(-2), 1.0]) / z0)


@pytest.mark.parametrize("kind,shared", [("swiglu", 0), ("swiglu", 2), ("gelu", 1)])
def test_dropless_equals_naive_per_token_loop(kind, shared):
    spec = MoESpec(num_experts=6, top_k=2, expert_ffn_hidden_size=8, num_shared_experts=shared,
                   shared_expert_ffn_hidden_size=12 if shared else None)
    moe = seeded_moe(spec, kind=kind)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    y = moe(x)
    assert y.shape == x.shape
    assert torch.allclose(y.reshape(-1, 16), naive(moe, x.reshape(-1, 16)), atol=1e-6)


def _grad_users(out: torch.Tensor, leaf: torch.Tensor) -> list[str]:
    """Autograd nodes of ``out``'s graph that feed ``leaf``'s gradient accumulator directly."""
    seen, stack, users = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is leaf:
                users.append(type(node).__name__)
            stack.append(nxt)
    return users


@pytest.mark.parametrize("experts", ["experts", "shared_experts"])
def test_each_expert_weight_stack_has_one_gradient_node_not_one_per_expert(experts):
    """Indexing w[e] per expert makes E backward nodes, each writing a zero-filled gradient of the whole
    stack (E x the weights' bytes per backward: 18x the predicted step on an H100). One unbind node stacks
    the experts' gradients once."""
    moe = seeded_moe(MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=12, num_shared_experts=2))
    y = moe(torch.randn(2, 5, 16))
    for w in ("w1", "w2", "w3"):
        assert _grad_users(y, getattr(getattr(moe, experts), w)) == ["UnbindBackward0"], w


def _experts_run(experts, x: torch.Tensor, counts: list[int], grouped: bool, dtype=None):
    """(output, input gradient, weight gradients) of ``experts`` on rows x, by the loop or grouped_mm."""
    for p in experts.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = experts._grouped_mm(x, counts, dtype or x.dtype) if grouped else experts.forward_grouped(x, counts)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    return [y.float(), x.grad.float()] + [p.grad.float() for p in experts.parameters()]


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_grouped_mm_pads_each_expert_and_matches_the_loop_in_every_gradient(kind):
    """The grouped path's padding (groups to multiples of GROUP_ALIGN, an empty expert given a zero group):
    on the CPU's fp32 torch._grouped_mm, output, input and every weight gradient as the per-expert loop."""
    from executor.moe import GroupedExperts

    experts = GroupedExperts(4, 16, 24, kind)
    for i, p in enumerate(experts.parameters()):
        p.data = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1
    x, counts = torch.randn(21, 16, generator=torch.Generator().manual_seed(9)), [3, 0, 10, 8]
    for got, want in zip(_experts_run(experts, x, counts, True), _experts_run(experts, x, counts, False)):
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), (got - want).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch._grouped_mm's bf16 kernels")
def test_grouped_mm_on_a_gpu_is_as_close_to_fp32_as_the_bf16_loop():
    """On the GPU the executor's experts run as torch._grouped_mm (bf16): every gradient within twice the
    bf16 per-expert loop's own distance from the fp32 loop (unaligned counts, an empty expert)."""
    from executor.moe import GroupedExperts, grouped_mm_dtype

    x = torch.randn(1000, 256, device="cuda")
    if grouped_mm_dtype(x.bfloat16()) is None:
        pytest.skip("this GPU has no torch._grouped_mm bf16 kernel (compute capability 9 or 10)")
    experts = GroupedExperts(16, 256, 192).cuda()
    torch.nn.init.normal_(experts.w1, std=0.05), torch.nn.init.normal_(experts.w2, std=0.05)
    torch.nn.init.normal_(experts.w3, std=0.05)
    counts = [0, 7, 130, 1, 64, 33, 99, 100, 0, 250, 16, 15, 17, 100, 100, 68]
    ref = _experts_run(experts, x, counts, False)
    low = experts.to(torch.bfloat16)
    loop = _experts_run(low, x.bfloat16(), counts, False)
    grouped = _experts_run(low, x.bfloat16(), counts, True)
    for r, a, b in zip(ref, loop, grouped):
        assert (b - r).abs().max() <= 2 * (a - r).abs().max() + 1e-6 * r.abs().max()


def test_capacity_mask_keeps_first_come_by_token_index():
    moe = MoE(4, MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=4, capacity_factor=0.75))
    # T=4, k=2, E=4 -> capacity ceil(0.75 * 4 * 2 / 4) = 2 assignments per expert
    ids = torch.tensor([[0, 1], [1, 0], [0, 2], [1, 0]])
    assert moe.capacity(4) == 2
    # expert 0: tokens 0, 1 kept, 2, 3 dropped; expert 1: tokens 0, 1 kept, 3 dropped; expert 2 kept
    assert moe._keep_mask(ids).tolist() == [[True, True], [True, True], [False, True], [False, False]]
    assert MoE(4, MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=4))._keep_mask(ids) is None


def test_capacity_output_drops_exactly_the_overflow():
    spec = MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=8, num_shared_experts=1,
                   capacity_factor=0.5)
    moe = seeded_moe(spec)
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    ids, _, _ = moe.route(x)
    cap = math.ceil(0.5 * 20 * 2 / 4)
    seen = [0] * 4
    keep = torch.zeros(20, 2, dtype=torch.bool)
    for t in range(20):
        for j in range(2):
            seen[int(ids[t, j])] += 1
            keep[t, j] = seen[int(ids[t, j])] <= cap
    assert not keep.all() and keep.any()
    assert torch.equal(moe._keep_mask(ids), keep)
    assert torch.allclose(moe(x[None])[0], naive(moe, x, keep), atol=1e-6)


def test_aux_loss_by_hand_and_its_gradient_reaches_only_the_router():
    moe = MoE(2, MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=4), aux_loss_coef=0.1)
    moe.init_weights(lambda name: torch.Generator().manual_seed(3))
    with torch.no_grad():
        moe.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[2.0, 1.0], [0.5, -3.0], [-2.0, 0.5]])
    moe(x[None])
    logits = [[2.0, 1.0, -2.0, 0.0], [0.5, -3.0, -0.5, 0.0], [-2.0, 0.5, 2.0, 0.0]]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    mean_p = [sum(probs[t][e] for t in range(3)) / 3 for e in range(4)]
    # top-2: token 0 -> {0, 1}, token 1 -> {0, 3}, token 2 -> {2, 1}: f = (2, 2, 1, 1) / 6
    f = [2 / 6, 2 / 6, 1 / 6, 1 / 6]
    expect = 0.1 * 4 * sum(f[e] * mean_p[e] for e in range(4))
    assert moe.aux_loss.item() == pytest.approx(expect, rel=1e-6)
    moe.aux_loss.backward()
    assert moe.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w1.grad is None


def test_init_weights_draws_full_tensors_by_name():
    moe = MoE(8, MoESpec(num_experts=4, top_k=1, expert_ffn_hidden_size=4, num_shared_experts=1))
    names: list[str] = []

    def gen_for(name: str) -> torch.Generator:
        names.append(name)
        return torch.Generator().manual_seed(len(name))

    moe.init_weights(gen_for)
    assert names == ["gate.weight", "experts.w1", "experts.w2", "experts.w3",
                     "shared_experts.w1", "shared_experts.w2", "shared_experts.w3"]
    gen = torch.Generator().manual_seed(len("experts.w1"))
    expect = torch.empty(4, 4, 8).normal_(0.0, 0.02, generator=gen)
    assert torch.equal(moe.experts.w1, expect)


@pytest.mark.parametrize("kwargs,field",
                         [({"bias": True}, "linear_bias"), ({"ffn_kind": "relu"}, "ffn_kind")])
def test_unsupported_arguments_are_named(kwargs, field):
    with pytest.raises(AutoparError, match=field):
        MoE(8, MoESpec(num_experts=4, top_k=1, expert_ffn_hidden_size=4), **kwargs)


def _load_ep_script():
    spec = importlib.util.spec_from_file_location("ep_check", EP_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ep")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(EP_SCRIPT), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    print(f"ep_check under torchrun: {time.perf_counter() - start:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def reference(script, case: str, rank: int) -> dict[str, torch.Tensor]:
    """Unsharded module on ``rank``'s tokens: output, aux loss, input and parameter gradients of loss_r,
    and how many assignments capacity dropped."""
    moe = script.build_moe(case)
    x, c = script.rank_inputs(case, rank)
    x.requires_grad_(True)
    y = moe(x)
    ((y * c).sum() + moe.aux_loss).backward()
    keep = moe._keep_mask(moe.route(x.reshape(-1, script.DIM))[0])
    res = {"output": y.detach(), "aux_loss": moe.aux_loss.detach(), "x_grad": x.grad,
           "dropped": 0 if keep is None else int((~keep).sum())}
    res.update({name: p.grad for name, p in moe.named_parameters()})
    return res


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ep4", "ep4_shared", "ep2", "ep2_shared", "ep4_capacity", "ep2_capacity",
                                  "ep4_idle_rank"])
def test_expert_parallel_matches_single_process(ep_run, case):
    """Every rank's output, aux loss, input grad, router / shared grads equal the unsharded module on its
    own tokens. A local expert's gradient is the sum of the reference expert gradients over the tokens of
    ALL ranks of the EP group: their rows were computed on this rank, so the reverse all-to-all of the
    backward brings every rank's output gradient for them here (the DP reduction is not the MoE's job)."""
    script = _load_ep_script()
    ep = script.CASES[case][0]
    refs = [reference(script, case, r) for r in range(4)]
    if script.CASES[case][2] is not None:
        assert sum(r["dropped"] for r in refs) > 0, "capacity case drops nothing: the test would be vacuous"
    for rank in range(4):
        got = json.loads((ep_run / case / f"rank{rank}.json").read_text())
        ref = refs[rank]
        members = got["ep_group"]
        assert len(members) == ep and rank in members
        for key in ("output", "aux_loss", "x_grad", "gate.weight"):
            assert torch.allclose(torch.tensor(got[key] if key in got else got["grads"][key]), ref[key],
                                  atol=1e-5), (case, rank, key)
        for name in ("shared_experts.w1", "shared_experts.w2", "shared_experts.w3"):
            if name in ref:
                got_grad = torch.tensor(got["grads"][name])
                assert torch.allclose(got_grad, ref[name], atol=1e-5), (case, rank, name)
        local = 8 // ep
        lo = got["ep_rank"] * local
        assert got["ep_rank"] == members.index(rank)
        for name in ("experts.w1", "experts.w2", "experts.w3"):
            summed = sum(refs[r][name] for r in members)[lo:lo + local]
            assert got["local_shapes"][name.split(".")[1]][0] == local
            assert torch.allclose(torch.tensor(got["grads"][name]), summed, atol=1e-5), (case, rank, name)
    if case == "ep4_idle_rank":  # experts 6, 7 (rank 3) receive no rows: zero gradients, and no hang
        idle = json.loads((ep_run / case / "rank3.json").read_text())
        assert not torch.tensor(idle["grads"]["experts.w1"]).any()


@pytest.mark.slow
def test_meta_built_experts_shard_and_init_like_the_full_module(ep_run):
    for rank in range(4):
        diff = json.loads((ep_run / "meta" / f"rank{rank}.json").read_text())
        assert set(diff) == {"w1", "w2", "w3", "gate.weight"} and max(diff.values()) == 0.0, (rank, diff)


@pytest.mark.slow
def test_expert_parallel_refuses_ep_not_dividing_experts(ep_run):
    for rank in range(4):
        message = json.loads((ep_run / "errors" / f"rank{rank}.json").read_text())["message"]
        assert message is not None
        assert "moe.num_experts=6" in message and "layout.ep=4" in message and "divides" in message

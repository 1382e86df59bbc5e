"""The human pages: every page renders stored data (measured and reference profiles, feasible,
pipelined and infeasible plans, runs) with its SVG charts, escapes what users typed, and answers
unknown ids with an HTML 404 page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from planner.contracts import LinkProfile

EVIL = '<img src=x onerror="alert(1)">'  # a cluster name may hold no "/" (it is part of its URL)
SMALL_PLAN = {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64},
              "cluster": "dgx-h100", "num_nodes": 2}
INFEASIBLE_PLAN = {"model": {"preset": "llama3.1-405b"}, "training": {"seq_length": 8192, "global_batch_size": 64},
                   "cluster": "dgx-a100-40gb"}
# llama3-8b does not fit one 40 GB A100 without pipelining when TP, CP, ZeRO and offload are ruled out
PIPELINE_PLAN = {"model": {"preset": "llama3-8b"}, "training": {"seq_length": 4096, "global_batch_size": 64},
                 "cluster": "dgx-a100-40gb", "num_nodes": 1,
                 "options": {"max_tp": 1, "max_cp": 1, "zero_stages": [0], "offload": False, "top_k": 3}}


def measured_profile(client: TestClient, name: str = "lab-h100") -> dict:
    """A measured profile built from the dgx-h100 reference: links with points, compute tables."""
    ref_id = next(c["latest_profile_id"] for c in client.get("/v1/clusters").json()["items"] if c["name"] == "dgx-h100")
    body = client.get(f"/v1/profiles/{ref_id}").json()["profile"]
    body.update(kind="measured", name=name)
    body["environment"] = {"hostnames": ["node-a"], "backend": "nccl", "cuda_version": "12.4", "torch_version": "2.5",
                           "driver_version": "550.54", "devices_per_node": 8}
    for link in body["links"]:
        factor = {"all_reduce": 2 * 7 / 8, "all_gather": 7 / 8, "reduce_scatter": 7 / 8, "all_to_all": 7 / 8}.get(
            link["collective"], 1.0)
        link["group_size"] = 8
        link["points"] = [{"bytes": b, "time_s": link["alpha_s"] * 1.1 + b * factor / link["busbw_bytes_per_s"] * 1.05}
                          for b in (2**e for e in range(12, 31, 3))]
    body["compute"]["gemm"] = [{"precision": "bf16", "m": s, "n": s, "k": s,
                                "time_s": 2 * s**3 / (min(700, s / 20) * 1e12)}
                               for s in (256, 512, 1024, 2048, 4096, 8192)]
    body["compute"]["attention"] = [
        {"precision": "bf16", "batch": 1, "seq_length": s, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
         "causal": True, "forward_time_s": 4 * s * s * 32 * 128 * 0.5 / 300e12,
         "backward_time_s": 2.5 * 4 * s * s * 32 * 128 * 0.5 / 250e12} for s in (1024, 4096, 16384)]
    body["compute"]["elementwise"] = [
        {"op": op, "precision": "bf16", "bytes": b, "time_s": 4e-6 + b / 2.8e12}
        for op in ("rmsnorm", "silu_mul") for b in (2**20, 2**24, 2**28, 2**31)]
    body["device_checks"] = [
        {"rank": r, "host": "node-a", "local_rank": r, "device": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 << 30,
         "precision": "bf16", "gemm": [8192, 8192, 8192], "gemm_tflops": t, "memory_bandwidth_bytes_per_s": bw}
        for r, t, bw in ((0, 741.0, 2.91e12), (1, 652.5, 2.95e12))]
    line = {"fixed_s": 0.25, "per_tensor_s": 0.002, "bytes_per_s": 2.5e9}
    body["checkpoint"] = {"ranks": 8, "storage": "/lustre/ckpt", "sync": line, "async_blocking": line,
                          "async_write": line, "points": [{"mode": "sync", "bytes": 1 << 30, "tensors": 16,
                                                           "blocking_s": 0.7, "write_s": 0.7}]}
    r = client.post("/v1/profiles", json=body)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One service with a small plan, a pipelined plan, an infeasible one, a run and a measured profile."""
    db = tmp_path_factory.mktemp("pages") / "t.db"
    with TestClient(create_app(Settings(database_url=f"sqlite:///{db}"))) as c:
        small = c.post("/v1/plans", json=SMALL_PLAN).json()
        infeasible = c.post("/v1/plans", json=INFEASIBLE_PLAN).json()
        pipeline = c.post("/v1/plans", json=PIPELINE_PLAN).json()
        assert small["status"] == "ok" and infeasible["status"] == "infeasible"
        assert pipeline["plan"]["layout"]["pp"] > 1, pipeline["plan"]["layout"]
        lay = small["plan"]["layout"]
        run = c.post("/v1/runs", json={"plan_id": small["id"], "report": {
            "layout": lay, "device": "cpu", "num_ranks": small["num_gpus"], "warmup_steps": 1,
            "steps": [{"step": 0, "loss": 10.0, "time_s": 1.0}, {"step": 1, "loss": 9.5, "time_s": 1.1},
                      {"step": 2, "loss": 9.25, "time_s": 1.3, "profiled": True}],
            "median_step_time_s": 1.0, "tokens_per_s": 1000, "peak_memory_bytes_per_rank": [1],
            "checkpoints": [{"step": k, "mode": "async", "blocking_s": b, "write_s": 2.0, "bytes_per_rank": 1 << 20,
                             "tensors_per_rank": 39} for k, b in ((1, 0.9), (2, 0.25), (3, 0.35))],
            "breakdown": [{"rank": 0, "step_s": 1.25, "data_s": 0.01,
                           "terms": {"gemm": 0.5, "attention": 0.25, "dp_grad": 0.25, "other": 0.25}}],
            "environment": {"hostnames": ["box-1"], "backend": "gloo", "torch_version": "2.13.0+cpu",
                            "gloo_version": "bundled with torch 2.13.0+cpu (build 0123456789ab)",
                            "devices_per_node": 2}}})
        assert run.status_code == 201, run.text
        measured = measured_profile(c)
        evil = measured_profile(c, name=EVIL)
        evil_plan = c.post("/v1/plans", json={**SMALL_PLAN, "cluster": EVIL, "num_nodes": None,
                                              "training": {"seq_length": 2048, "global_batch_size": 8}}).json()
        yield dict(client=c, small=small, infeasible=infeasible, pipeline=pipeline, run=run.json(),
                   measured=measured, evil=evil, evil_plan=evil_plan)


def html(site: dict, url: str, status: int = 200) -> str:
    r = site["client"].get(url)
    assert r.status_code == status, (url, r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html")
    return r.text


def svg_shapes(page: str) -> int:
    assert "<svg" in page
    return len(re.findall(r"<(?:path|rect|circle)\b", page))


def test_index_lists_clusters_plans_and_filters(site: dict) -> None:
    page = html(site, "/")
    for name in ("dgx-h100", "dgx-a100-40gb", "lab-h100", "llama3-8b", "/runs", "/docs"):
        assert name in page
    assert f'href="/profiles/{site["measured"]["id"]}"' in page
    def clusters(url: str) -> str:  # the clusters table, before the recent plans
        return html(site, url).split("Recent plans")[0]

    filtered = clusters("/?kind=measured")
    assert "lab-h100" in filtered and "dgx-a100-40gb" not in filtered
    assert "dgx-a100-40gb" in clusters("/?gpu=a100") and "lab-h100" not in clusters("/?gpu=a100")
    assert "No clusters match" in html(site, "/?gpu=nothing-like-this")
    html(site, "/?kind=bogus&gpu=%00")  # odd filters are ignored, never a 500


def test_reference_profile_page_draws_fits_and_model(site: dict) -> None:
    ref_id = next(c["latest_profile_id"] for c in site["client"].get("/v1/clusters").json()["items"]
                  if c["name"] == "dgx-h100")
    page = html(site, f"/profiles/{ref_id}")
    assert svg_shapes(page) > 20
    assert page.count("<svg") >= 6  # three link levels, GEMM, attention, elementwise
    assert "no measured points" in page and "model (no measurements)" in page
    assert "matmul efficiency" in page and "H100" in page


def test_measured_profile_page_draws_points(site: dict) -> None:
    page = html(site, f"/profiles/{site['measured']['id']}")
    assert len(re.findall(r"<circle\b", page)) > 40  # measured points of links and compute
    assert "bf16 measured" in page and "rmsnorm measured" in page and "forward measured" in page
    assert "model (no measurements)" not in page
    assert "node-a" in page and "12.4" in page and "driver 550.54" in page and "8 GPUs per node" in page
    # the measured checkpoint lines and their points
    assert "Checkpoints" in page and "/lustre/ckpt" in page and "2.50 GB/s" in page and "1 measured points" in page
    assert ("every device checked</th><td>2 ranks, bf16 GEMM 8192×8192×8192: 652.5–741 TFLOP/s · add 2910–2950 GB/s"
            in page)


def test_a_flat_link_segment_reads_as_latency_only(site: dict) -> None:
    """The shipped H200 profile's host copies are piecewise, their first segment flat (α alone):
    the link table says so instead of a 10⁹ GB/s bandwidth and a negative R²."""
    shipped = Path(__file__).resolve().parents[1] / "planner" / "data" / "measured" / "nvidia-h200-1x1.json"
    body = json.loads(shipped.read_text())
    body["name"] = "h200-flat-check"
    flat = [link for link in body["links"] if LinkProfile.model_validate(link).is_flat]
    assert flat and all(link["fit_r2"] < 0.5 for link in flat)  # what the table must not show as a fit quality
    r = site["client"].post("/v1/profiles", json=body)
    assert r.status_code == 201, r.text
    page = html(site, f"/profiles/{r.json()['id']}")
    table = page[page.index("<summary>Link table</summary>"):]
    assert table.count("flat (α only)") == len(flat) and table.count("— (flat)") == len(flat)
    assert "1000000000.0 GB/s" not in table and "GB/s" in table  # the other segments keep their bandwidth


def test_a_cpu_profile_page_shows_the_attention_kernels_tiles(site: dict) -> None:
    c = site["client"]
    body = c.get(f"/v1/profiles/{site['measured']['id']}").json()["profile"]
    body.update(name="lab-cpu", device_checks=[])
    body["compute"]["attention_blocking"] = [{"from_q_len": 0, "q_block": 32, "kv_block": 512},
                                             {"from_q_len": 192, "q_block": 64, "kv_block": 512},
                                             {"from_q_len": 768, "q_block": 256, "kv_block": 512}]
    r = c.post("/v1/profiles", json=body)
    assert r.status_code == 201, r.text
    page = html(site, f"/profiles/{r.json()['id']}")
    assert "attention kernel tiles" in page and "q_len 192+: 64 × 512" in page and "q_len 768+: 256 × 512" in page
    assert "forward measured" in page
    assert "every device checked" not in page  # none recorded
    # one that does not ascend is refused, naming the field
    body["compute"]["attention_blocking"].reverse()
    bad = c.post("/v1/profiles", json=body)
    assert bad.status_code == 422 and "attention_blocking" in bad.text and "must start at 0" in bad.text


def test_a_profile_with_gemm_layouts_draws_a_series_per_layout(site: dict) -> None:
    c = site["client"]
    body = c.get(f"/v1/profiles/{site['measured']['id']}").json()["profile"]
    body.update(name="lab-layouts", device_checks=[])
    rate = {"nt": 600e12, "nn": 500e12, "tn": 400e12}
    body["compute"]["gemm"] = [{"precision": "bf16", "m": s, "n": s, "k": s, "layout": lay, "time_s": 2 * s**3 / r}
                               for lay, r in rate.items() for s in (1024, 4096)]
    r = c.post("/v1/profiles", json=body)
    assert r.status_code == 201, r.text
    page = html(site, f"/profiles/{r.json()['id']}")
    names = ["bf16 forward X·Wᵀ (nt) measured", "bf16 input grad dY·W (nn) measured",
             "bf16 weight grad dYᵀ·X (tn) measured"]
    at = [page.find(n) for n in names]
    assert all(i >= 0 for i in at) and at == sorted(at)  # a linear layer's order
    assert "bf16 tn 4096x4096x4096: 400 TFLOP/s" in page
    assert "bf16 measured" not in page
    # one layout only (profiles before layouts): one series, as before
    assert "bf16 measured" in html(site, f"/profiles/{site['measured']['id']}")
    assert "bf16 nn " not in html(site, f"/profiles/{site['measured']['id']}")
    # a layout not in the enum is refused, naming the field and the choices
    body["compute"]["gemm"][0]["layout"] = "tt"
    bad = c.post("/v1/profiles", json=body)
    assert bad.status_code == 422 and "layout" in bad.text and "'nn', 'nt' or 'tn'" in bad.text


def test_profile_versions_are_linked(site: dict) -> None:
    c = site["client"]
    body = c.get(f"/v1/profiles/{site['measured']['id']}").json()["profile"]
    body["assumptions"]["matmul_efficiency"] = 0.5
    v2 = c.post("/v1/profiles", json=body).json()
    page = html(site, f"/profiles/{v2['id']}")
    assert f'href="/profiles/{site["measured"]["id"]}"' in page and "v2" in page


def test_plan_page_shows_layout_prediction_and_charts(site: dict) -> None:
    plan = site["small"]
    page = html(site, f"/plans/{plan['id']}")
    assert svg_shapes(page) > 10
    for text in ("Memory per GPU", "capacity", "exposed", "Timeline of one step", "Alternatives",
                 "candidates considered", "Removed by rule", "MFU", "tokens/s", "ZeRO-"):
        assert text in page, text
    assert f'href="/runs/{site["run"]["id"]}"' in page


def test_pipeline_plan_page_draws_a_timeline(site: dict) -> None:
    plan = site["pipeline"]
    pp = plan["plan"]["layout"]["pp"]
    page = html(site, f"/plans/{plan['id']}")
    timeline = page[page.index('class="chart timeline"'):]
    timeline = timeline[:timeline.index("</svg>")]
    for i in range(pp):
        assert f">stage {i}<" in timeline
    assert len(re.findall(r"<rect\b", timeline)) > pp * 16  # forward and backward boxes on every stage
    assert "micro-batch 0" in timeline


def test_a_v_schedule_plan_page_draws_both_chunks_of_every_stage(site: dict) -> None:
    body = {**PIPELINE_PLAN, "options": {**PIPELINE_PLAN["options"], "schedules": ["zero_bubble_v"]}}
    plan = site["client"].post("/v1/plans", json=body).json()
    assert plan["plan"]["layout"]["schedule"] == "zero_bubble_v", plan["plan"]["layout"]
    page = html(site, f"/plans/{plan['id']}")
    timeline = page[page.index('class="chart timeline"'):]
    timeline = timeline[:timeline.index("</svg>")]
    assert "lighter: odd model chunk" in timeline and "input gradient (B)" in timeline
    assert "simulated greedily" in page and "stage 0 holds the embedding and the head" in page


def test_infeasible_plan_page_explains(site: dict) -> None:
    plan = site["infeasible"]
    page = html(site, f"/plans/{plan['id']}")
    assert "No layout: why" in page
    for key in ("field", "value", "problem", "fix"):
        text = str(plan["explanation"][key])
        assert text.replace("'", "&#39;").replace('"', "&#34;").replace("<", "&lt;").replace(">", "&gt;")[:40] in page


def test_plans_and_runs_lists(site: dict) -> None:
    page = html(site, "/plans")
    assert f'href="/plans/{site["infeasible"]["id"]}"' in page and "infeasible" in page
    assert "llama3.1-405b" in html(site, "/plans?status=infeasible")
    assert "llama3.1-405b" not in html(site, "/plans?status=ok")
    html(site, "/plans?offset=100000&status=nope")
    runs = html(site, "/runs")
    assert "<circle" in runs and "y = x" in runs
    assert f'href="/plans/{site["small"]["id"]}"' in runs
    run = html(site, f"/runs/{site['run']['id']}")
    assert "Step time per step" in run and "Loss per step" in run and "<circle" in run
    # predicted and measured per term of the step: the measured shares are the breakdown's over its step
    assert "Where the step goes" in run
    # the checkpoints: the median of the saves after the first (0.25, 0.35 -> 0.3 s), the first apart
    row = re.search(r"<th>async</th>(.*?)</tr>", run, re.S).group(1)
    assert "39 tensors" in row and "300 ms" in row and "900 ms" in row and ">2 s<" in row, row
    assert "this plan has no goal" in run
    gemm_row = re.search(r"<th[^>]*>gemm</th>(.*?)</tr>", run, re.S).group(1)
    assert "40.0%" in gemm_row, gemm_row  # 0.5 of 1.25 s
    assert re.search(r"<th[^>]*>dp_grad</th>.*?20.0%", run, re.S)
    # the machine it ran on, in the words of a profile's page
    assert ("backend gloo · torch 2.13.0+cpu · gloo bundled with torch 2.13.0+cpu (build 0123456789ab) · "
            "2 CPUs per node · 1 host (box-1)") in run


def test_user_text_is_escaped(site: dict) -> None:
    assert site["evil_plan"]["status"] in ("ok", "infeasible")
    for url in ("/", f"/profiles/{site['evil']['id']}", f"/plans/{site['evil_plan']['id']}", "/plans",
                "/?gpu=" + EVIL):
        page = html(site, url)
        assert EVIL not in page, url
        assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in page, url


@pytest.mark.parametrize("url", ["/profiles/999999", "/plans/999999", "/runs/999999", "/plans/abc", "/profiles/0",
                                 "/runs/99999999999999999999", "/profiles/-1"])
def test_unknown_ids_are_html_404_pages(site: dict, url: str) -> None:
    page = html(site, url, 404)
    assert "Not found" in page and "<nav>" in page


def test_static_files(site: dict) -> None:
    c = site["client"]
    r = c.get("/static/style.css")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/css")
    assert c.get("/static/nope.css").status_code == 404
    assert c.get("/static/..%2Fpages.py").status_code == 404


def test_pages_with_nothing_stored(tmp_path) -> None:  # noqa: ANN001
    settings = Settings(database_url=f"sqlite:///{tmp_path}/empty.db", load_reference=False)
    with TestClient(create_app(settings)) as c:
        for url in ("/", "/plans", "/runs"):
            r = c.get(url)
            assert r.status_code == 200, url
        assert "no runs with a prediction yet" in c.get("/runs").text


def test_pages_are_not_in_the_api_schema(site: dict) -> None:
    paths = site["client"].get("/openapi.json").json()["paths"]
    assert not any(p == "/" or p.startswith(("/plans", "/profiles", "/runs", "/static")) for p in paths)


def test_unknown_paths_get_an_html_404_and_the_api_keeps_json(tmp_path) -> None:  # noqa: ANN001
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings

    with TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'x.db'}", load_reference=False))) as c:
        page = c.get("/no/such/page")
        assert page.status_code == 404 and "text/html" in page.headers["content-type"] and "/no/such/page" in page.text
        api = c.get("/v1/no-such-endpoint")
        assert api.status_code == 404 and api.json() == {"detail": "Not Found"}
        assert c.post("/v1/presets").status_code == 405


def test_a_step_of_128_micro_batches_is_drawn_with_few_and_priced_with_all(site: dict) -> None:
    """A long step's timeline draws enough micro-batches for the warm-up, a steady state and the cool-down (128
    drew a barcode), and its bubble is the whole step's."""
    from api.pages import MIN_TIMELINE_MICROBATCHES, timeline_view
    from planner.contracts import Plan

    plan = Plan.model_validate(site["pipeline"]["plan"])
    lay = plan.layout
    rows = 128 * lay.dp_replicate * lay.dp_shard * lay.micro_batch_size
    long = plan.model_copy(update={"training": plan.training.model_copy(update={"global_batch_size": rows})})
    view = timeline_view(long)
    assert view["microbatches"] == 128
    assert view["shown"] == max(MIN_TIMELINE_MICROBATCHES, 2 * len(plan.prediction.stages)) < 128
    assert any("drawn with" in n for n in view["notes"])
    short = timeline_view(long.model_copy(update={"training": long.training.model_copy(
        update={"global_batch_size": rows * view["shown"] // 128})}))
    assert view["bubble"] < short["bubble"]  # more micro-batches, a smaller share of bubble


def test_a_cpu_profile_page_speaks_of_ranks_and_plain_rates(site: dict) -> None:
    from pathlib import Path

    body = json.loads((Path(__file__).parent / "data" / "cpu_runs" / "profile.json").read_text())
    body["name"] = "cpu-box"
    r = site["client"].post("/v1/profiles", json=body)
    assert r.status_code in (200, 201), r.text
    page = html(site, f"/profiles/{r.json()['id']}")
    assert "nodes × ranks/node" in page and "memory per rank" in page and "HBM bandwidth" not in page
    assert "datasheet peak 0<" not in page and "datasheet peak 0.1" in page  # fp32 0.1 TFLOP/s, not "0"
    ticks = re.findall(r">(-?[\d.,]+[a-zµ]?)</text>", page)
    assert not [t for t in ticks if t[-1] in "mµ"], ticks  # TFLOP/s and GB/s without SI prefixes (no "250m")


def test_a_link_chart_gives_each_link_one_legend_entry_in_its_own_colour(site: dict) -> None:
    page = html(site, f"/profiles/{site['measured']['id']}")
    chart = page[page.index("Bus bandwidth, intra-node"):]
    chart = chart[:chart.index("</svg>")]
    legend = re.findall(r'<g><(?:path|circle)[^>]*(?:stroke|fill)="(#[0-9a-f]{6})"[^>]*/>(?:<circle[^>]*/>)?<text[^>]*>'
                        r'([^<]+)</text></g>', chart)
    names = [n for _, n in legend]
    assert names and not [n for n in names if n.endswith((" fit", " measured"))], names  # fit + points: one entry
    assert len({c for c, _ in legend}) == len(legend), legend


def test_per_stage_recompute_reads_as_its_stages_in_the_alternatives() -> None:
    from api.pages import templates
    from planner.contracts import ParallelLayout, StageRecompute

    lay = ParallelLayout(pp=2, micro_batch_size=1, recompute_per_stage=[
        StageRecompute(kind="full", num_layers=3), StageRecompute(kind="none")])
    assert templates.env.filters["recompute"](lay) == "[full:3, none]"

"""``dsa-dcp inspect`` and ``dsa_dcp.inspect``: counts, memory plan, JSON, HTML in Chromium, PNG.

The two 78-layer inspections (GLM-5.2 tiny on the CPU, full size on the meta device) run once per
module through the CLI's ``main`` in this process; the other tests use the small model below,
which a model author would write with the decorator (and which ``module:factory`` loads).
"""

import contextlib
import io
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import dsa_dcp
from dsa_dcp import cli
from dsa_dcp.inspection.memory import memory_plan
from dsa_dcp.inspection.report import NO_KERNEL_COUNT, NO_KERNEL_COUNT_DCP, SCHEMA, Inspection
from dsa_dcp.inspection.targets import fake_group
from dsa_dcp.kv_cache import allocate_kv_cache


HERE = os.path.dirname(os.path.abspath(__file__))
GLM52_LAYERS, GLM52_INDEXERS = 78, 21


# ---------------------------------------------------------------------- a user's model


@dsa_dcp.sparse_attention
def toy_sparse_attention(q_nope, q_pe, kv, topk, sm_scale):
    dc = q_nope.shape[-1]
    rows = kv[topk.clamp(min=0).long()].float()
    score = torch.einsum("bhc,bkc->bhk", q_nope.float(), rows[..., :dc])
    score = (score + torch.einsum("bhr,bkr->bhk", q_pe.float(), rows[..., dc:])) * sm_scale
    score = score.masked_fill((topk < 0)[:, None, :], -math.inf)
    lse = torch.logsumexp(score, -1)
    p = torch.exp(score - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("bhk,bkc->bhc", p, rows[..., :dc]).to(q_nope.dtype), lse


class ToyModel(nn.Module):
    """Three layers attending with one top-k (an input), KV caches allocated for the DCP group."""

    def __init__(self, num_slots=32, dcp_size=1, interleave=1, layers=3, heads=2, dc=8, dr=4, hidden=16):
        super().__init__()
        self.heads, self.dc, self.dr = heads, dc, dr
        gen = torch.Generator().manual_seed(0)
        self.wkv = nn.ParameterList(nn.Parameter(torch.randn(dc + dr, hidden, generator=gen) * 0.2) for _ in range(layers))
        self.wq = nn.ParameterList(nn.Parameter(torch.randn(heads * (dc + dr), hidden, generator=gen) * 0.2)
                                   for _ in range(layers))
        self.wo = nn.ParameterList(nn.Parameter(torch.randn(hidden, heads * dc, generator=gen) * 0.2) for _ in range(layers))
        for i in range(layers):
            self.register_buffer(f"kv_{i}", allocate_kv_cache(num_slots, dc + dr, dcp_size=dcp_size, interleave=interleave),
                                 persistent=False)

    def forward(self, x, slots, topk):
        for i, (wkv, wq, wo) in enumerate(zip(self.wkv, self.wq, self.wo)):
            cache = getattr(self, f"kv_{i}")
            torch.ops.dsa_dcp.kv_store.default(cache, slots, torch.nn.functional.linear(x, wkv))
            q = torch.nn.functional.linear(x, wq).view(x.shape[0], self.heads, self.dc + self.dr)
            q_nope, q_pe = q.split([self.dc, self.dr], dim=-1)
            out, _ = toy_sparse_attention(q_nope.contiguous(), q_pe.contiguous(), cache, topk, 0.3)
            x = x + torch.nn.functional.linear(out.flatten(1), wo)
        return x


def make_toy(dcp_size=1):
    """``module:factory`` target: ``(model, example_inputs)`` for a DCP group of ``dcp_size``."""
    model = ToyModel(dcp_size=dcp_size)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([3, 9, 17, -1])
    topk = torch.tensor([[3, 9, 17, -1], [9, 3, -1, -1], [17, 3, 9, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    return model, (x, slots, topk)


# ---------------------------------------------------------------------- the CLI on GLM-5.2


def _run_cli(argv):
    out = io.StringIO()
    torch._dynamo.reset()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The CLI's text, its output folder, report.json, and the backend's report of the compilation."""
    out_dir = str(tmp_path_factory.mktemp("glm52_tiny"))
    text = _run_cli(["inspect", "glm5.2-tiny", "--dcp", "4", "--out", out_dir])
    report = dsa_dcp.backend_report()
    with open(os.path.join(out_dir, "report.json")) as f:
        data = json.load(f)
    return text, out_dir, data, report


@pytest.fixture(scope="module")
def full():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text = _run_cli(["inspect", "glm5.2", "--dcp", "4", "--kv-dtype", "fp8"])
    return text, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before


def test_glm52_tiny_counts(tiny):
    text, _, data, _ = tiny
    s = data["summary"]
    assert "rank 0 of a 4-rank DCP group" in text and "fake process group" in text
    assert re.search(r"sparse attention nodes\s+78\n", text)
    assert s["sparse_attention_nodes"] == GLM52_LAYERS
    assert s["remaps"]["before_sharing"] == GLM52_LAYERS
    assert any(p["name"] == "share_remaps" for p in data["passes"])  # on by default
    assert s["remaps"]["after_sharing"] == GLM52_INDEXERS
    assert re.search(rf"remaps after sharing\s+{GLM52_INDEXERS} ", text)
    assert len(s["remaps"]["groups"]) == GLM52_INDEXERS
    assert sorted(l for g in s["remaps"]["groups"] for l in g) == list(range(GLM52_LAYERS))
    # one merge per layer, and a2a's two collectives per layer (all-to-all + epilogue all-reduce)
    assert s["merges"] == {"a2a": GLM52_LAYERS}
    assert all(flow["merge"] is not None for flow in data["dataflow"]["layers"])
    assert all(len(flow["collectives"]) == 2 for flow in data["dataflow"]["layers"])
    assert s["collectives"]["per_step"] == 2 * GLM52_LAYERS
    assert set(s["collectives"]["by_op"]) == {"all_to_all_single", "all_reduce"}
    assert s["kernels_per_step"] == NO_KERNEL_COUNT
    # all 78 layers write the step's tokens through one slots tensor: localized once, not per layer
    localize = next(p for p in data["passes"] if p["name"] == "localize_kv_writes")
    assert localize["stats"]["kv_writes_localized"] == GLM52_LAYERS
    assert localize["stats"]["slot_localizations"] == 1
    assert localize["graph_after"].count("localize_slots(") == 1
    assert len(data["dataflow"]["sources"]) == GLM52_INDEXERS
    assert [src["first_layer"] for src in data["dataflow"]["sources"]] == [0, 1, 2] + list(range(6, 78, 4))


def test_glm52_tiny_shares_21_remaps_each_fused_into_its_selection(tiny):
    """GLM-5.2 whole (78 layers, 21 indexers): 21 remaps, each fused into its indexer's selection, one
    group of layers a top-k (the share_remaps test of the whole model, on this module's compile)."""
    from dsa_dcp.inspection.render import jsonable
    from dsa_dcp.models import get_config

    _, _, data, report = tiny
    cfg = get_config("glm5.2-tiny")
    assert cfg.n_layers == GLM52_LAYERS and len(cfg.indexer_layers) == GLM52_INDEXERS
    assert report.summary["sparse_attention_nodes"] == GLM52_LAYERS and report.summary["remaps"] == GLM52_INDEXERS
    stats = report.stats()
    assert jsonable(stats) == {p["name"]: p["stats"] for p in data["passes"]}  # report.json's compilation
    assert stats["indexer_kernels"]["indexers_matched"] == GLM52_INDEXERS
    assert stats["fuse_remaps"] == {"remaps_fused": GLM52_INDEXERS, "remaps_kept": []}
    targets = [n.target for n in report.graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.dsa_dcp.topk_select_remap.default) == GLM52_INDEXERS
    assert torch.ops.dsa_dcp.topk_remap.default not in targets and torch.ops.dsa_dcp.topk_select.default not in targets
    share = stats["share_remaps"]
    assert (share["remaps_before"], share["remaps_after"]) == (GLM52_LAYERS, GLM52_INDEXERS)
    groups = {}
    for layer in range(cfg.n_layers):
        groups.setdefault(cfg.topk_source(layer), []).append(layer)
    assert share["layer_groups"] == list(groups.values())
    assert len(share["groups"]) == GLM52_INDEXERS and sum(map(len, share["groups"])) == GLM52_LAYERS
    assert len(share["refusals"]) == GLM52_INDEXERS - 1  # each indexer layer after the first has its own top-k
    assert all("a different tensor" in r for r in share["refusals"])


def test_collective_bytes_follow_the_shapes(tiny):
    _, _, data, _ = tiny
    # 4 rows, 4 heads packed by 4 head groups: [N=4, B=4, H/N=1, Dc + 1 word of LSE = 17] fp32
    a2a = [c for c in data["collectives"] if c["op"] == "all_to_all_single"]
    assert {tuple(c["input_shape"]) for c in a2a} == {(4, 4, 1, 17)}
    assert all(c["input_bytes"] == 4 * 4 * 1 * 17 * 4 and c["sent_bytes_per_rank"] == c["input_bytes"] * 3 // 4
               for c in a2a)
    ar = [c for c in data["collectives"] if c["op"] == "all_reduce"]
    assert {tuple(c["input_shape"]) for c in ar} == {(4, 32)}  # [rows, hidden]
    assert all(c["sent_bytes_per_rank"] == 2 * c["input_bytes"] * 3 // 4 for c in ar)
    by_op = data["summary"]["collectives"]["by_op"]
    assert data["summary"]["collectives"]["sent_bytes_per_rank_per_step"] == sum(e["sent_bytes_per_rank"] for e in by_op.values())


def test_full_size_memory_plan_matches_facts_without_allocating(full):
    text, rss_growth_kib = full
    assert "meta device (no memory allocated" in text
    assert re.search(r"bytes per token per rank\s+14,004 \(= 44,928/4 \+ 2,772\)", text)
    assert re.search(r"KV bytes per token per rank\s+11,232 ", text)
    assert re.search(r"index-key bytes per token per rank\s+2,772 ", text)
    assert re.search(r"capacity a replicated index cache costs\s+17\.4%", text)
    assert re.search(r"sparse attention nodes\s+78\n", text)
    assert rss_growth_kib < 4 * 1024 * 1024  # the real model is tens of GB


@pytest.mark.parametrize("n, percent", [(2, 5.8), (4, 17), (8, 41)])
def test_replicated_index_cost_matches_facts(n, percent):
    plan = memory_plan("glm5.3", "fp8", n, gpu_mem_gib=80)
    assert plan.kv_bytes_per_token == 44928 and plan.index_bytes_per_token == 2772
    assert plan.bytes_per_token_per_rank == 44928 / n + 2772
    assert plan.bytes_per_token_per_rank_split_index == (44928 + 2772) / n
    assert round(100 * plan.replicated_index_cost, 1 if n == 2 else 0) == percent
    assert plan.tokens_that_fit == int((80 * 2**30 - 4 * 78) // plan.bytes_per_token_per_rank)
    bf16 = memory_plan("glm5.2", "bf16", n, slots=1000)
    assert bf16.kv_bytes_per_token_layer == 1152 and bf16.index_bytes_per_token_layer == 256
    assert bf16.bytes_per_rank_for_slots == math.ceil(1000 / n) * 78 * 1152 + 1000 * 21 * 256


def test_memory_plan_keeps_whole_interleave_blocks():
    # 1001 slots, N = 2, I = 2: rank 0 owns blocks 0, 2, ..., 250 (251 blocks of 2 = 502 rows), not 501
    plan = memory_plan("glm5.2", "bf16", 2, slots=1001, interleave=2)
    assert plan.bytes_per_rank_for_slots == 502 * 78 * 1152 + 1001 * 21 * 256


# ---------------------------------------------------------------------- JSON

# The schema (docs/inspect.md): every key and the type of its value.
EXPECTED_TOP = {
    "schema": str, "target": dict, "options": dict, "compilations": int, "summary": dict, "collectives": list,
    "dataflow": dict, "graph_input": str, "passes": list, "memory": (dict, type(None)),
    "capacity": (dict, type(None)), "note": str,
}
EXPECTED_SUMMARY = {
    "sparse_attention_nodes": int, "remaps": dict, "merges": dict, "collectives": dict,
    "kernels_per_step": (str, dict), "kv_writes": int, "weights": dict,
}
EXPECTED_REMAPS = {"before_sharing": int, "after_sharing": int, "sharing": str, "groups": list, "refusals": list}
EXPECTED_COLLECTIVES = {"per_step": int, "sent_bytes_per_rank_per_step": int, "by_op": dict, "shapes_known": bool}
EXPECTED_COLLECTIVE = {"node": str, "op": str, "layer": (int, type(None)), "input_shape": list, "dtype": str,
                       "input_bytes": int, "sent_bytes_per_rank": int}
EXPECTED_LAYER = {"layer": int, "node": str, "op": str, "topk_source": str, "remap": (str, type(None)),
                  "merge": (str, type(None)), "collectives": list}
EXPECTED_PASS = {"name": str, "stats": dict, "nodes_added": list, "nodes_removed": list, "graph_after": str}
EXPECTED_OPTIONS = {"dcp_size": int, "rank": int, "merge": str, "interleave": int, "lowering": str}


def _check(obj, expected):
    assert set(obj) == set(expected), (sorted(obj), sorted(expected))
    for key, kind in expected.items():
        assert isinstance(obj[key], kind), (key, type(obj[key]))


def _check_schema(data):
    _check(data, EXPECTED_TOP)
    assert data["schema"] == SCHEMA
    _check(data["options"], EXPECTED_OPTIONS)
    _check(data["summary"], EXPECTED_SUMMARY)
    _check(data["summary"]["remaps"], EXPECTED_REMAPS)
    _check(data["summary"]["collectives"], EXPECTED_COLLECTIVES)
    for c in data["collectives"]:
        _check(c, EXPECTED_COLLECTIVE)
    assert set(data["dataflow"]) == {"layers", "sources", "remaps", "merge"}
    for flow in data["dataflow"]["layers"]:
        _check(flow, EXPECTED_LAYER)
    for p in data["passes"]:
        _check(p, EXPECTED_PASS)
    assert set(data["target"]) == {"name", "how", "process_group"}


def test_json_schema_of_the_glm52_report(tiny):
    _, _, data, _ = tiny
    _check_schema(data)
    assert data["options"] == {"dcp_size": 4, "rank": 0, "merge": "a2a", "interleave": 1, "lowering": "fx"}
    names = [p["name"] for p in data["passes"]]
    assert names == ["canonicalize", "indexer_kernels", "index_cache", "localize_kv_writes", "dcp_rewrite",
                     "share_remaps", "fuse_remaps", "slot_bounds"]
    rewrite = data["passes"][names.index("dcp_rewrite")]
    assert "topk_remap" in rewrite["graph_after"] and "topk_remap" not in data["graph_input"]
    assert data["memory"]["dcp_size"] == 4 and data["memory"]["kv_dtype"] == "bf16"
    # every rank holds the model's weights once: the head-sharded epilogue reads views of them
    assert data["summary"]["weights"]["held_by_compiled_step"] == 0
    assert data["summary"]["weights"]["bytes_per_rank"] > 0


def test_factory_target_json_is_stable(monkeypatch):
    monkeypatch.syspath_prepend(HERE)
    argv = ["inspect", "test_inspect:make_toy", "--dcp", "2", "--merge", "ag", "--format", "json"]
    first, second = _run_cli(argv), _run_cli(argv)
    assert first == second
    data = json.loads(first)
    assert first.strip() == json.dumps(data, sort_keys=True, indent=2)
    _check_schema(data)
    s = data["summary"]
    assert s["sparse_attention_nodes"] == 3 and s["merges"] == {"ag": 3}
    assert s["collectives"]["per_step"] == 3 and set(s["collectives"]["by_op"]) == {"all_gather_into_tensor"}
    # the decorated op is the attention node; all three layers read one top-k input
    assert all("toy_sparse_attention" in flow["op"] for flow in data["dataflow"]["layers"])
    assert len(data["dataflow"]["sources"]) == 1
    assert any(p["name"] == "share_remaps" for p in data["passes"])
    assert s["remaps"]["after_sharing"] == 1 and s["remaps"]["groups"] == [[0, 1, 2]]
    assert data["memory"] is None  # no DSAConfig for a user's model
    # ag over 2 ranks: [B=4, H=2, Dc=8 + 1 LSE word] fp32 per rank, sent to the other rank
    assert {tuple(c["input_shape"]) for c in data["collectives"]} == {(1, 4, 2, 9)}  # one head group
    assert all(c["sent_bytes_per_rank"] == 4 * 2 * 9 * 4 for c in data["collectives"])


# ---------------------------------------------------------------------- HTML, SVG, PNG


def _svg_nodes(html, kind):
    return re.findall(rf'<g class="node {kind}"', html)


def test_html_svg_has_the_dataflow_nodes(tiny):
    _, out_dir, data, _ = tiny
    with open(os.path.join(out_dir, "report.html")) as f:
        html = f.read()
    svg = re.search(r"<svg.*?</svg>", html, re.S).group(0)
    assert len(_svg_nodes(svg, "layer")) == GLM52_LAYERS
    assert len(_svg_nodes(svg, "source")) == GLM52_INDEXERS
    assert len(_svg_nodes(svg, "remap")) == data["summary"]["remaps"]["after_sharing"]
    assert len(_svg_nodes(svg, "merge")) == GLM52_LAYERS
    layer_ids = re.findall(r'<g class="node layer" id="layer-(\d+)"', svg)
    assert [int(i) for i in layer_ids] == list(range(GLM52_LAYERS))
    with open(os.path.join(out_dir, "dataflow.svg")) as f:
        assert f.read() == svg


def test_png_is_written(tiny):
    _, out_dir, _, _ = tiny
    path = os.path.join(out_dir, "dataflow.png")
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.shape[0] > 1000 and img.shape[1] > 600  # 78 rows
    assert (img[..., :3] < 0.9).any(axis=-1).mean() > 0.02  # boxes and text, not a blank page


def _chromium():
    installing = os.environ.get("DSA_DCP_CHROMIUM_INSTALLING")  # .ci/run installs it meanwhile
    deadline = time.monotonic() + 1200  # past the install's own time limits
    while installing and not os.path.exists(installing) and time.monotonic() < deadline:
        time.sleep(1)
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_renders_in_headless_chromium(tiny, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on this machine (Debian package 'chromium'; .ci/run installs it)")
    _, out_dir, _, _ = tiny
    shot = tmp_path / "shot.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1000,1600",
           f"--screenshot={shot}", "file://" + os.path.join(out_dir, "report.html")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    import matplotlib.image

    img = matplotlib.image.imread(str(shot))
    assert img.shape[:2] == (1600, 1000)
    rgb = img[..., :3]
    assert rgb.std() > 0.05  # not blank
    # the picture's colored boxes are on screen: the layer boxes' green (#d1fae5)
    green = (abs(rgb[..., 0] - 0xD1 / 255) < 0.02) & (abs(rgb[..., 1] - 0xFA / 255) < 0.02) & (abs(rgb[..., 2] - 0xE5 / 255) < 0.02)
    assert green.sum() > 500


# ---------------------------------------------------------------------- the Python API


def test_inspect_finds_each_compiled_model_after_a_real_run():
    torch._dynamo.reset()
    with fake_group(2):
        model_a, inputs = make_toy(dcp_size=2)
        model_b = ToyModel(dcp_size=2, interleave=2)
        a = torch.compile(model_a, backend="dsa_dcp", options={"dcp_size": 2, "merge": "ag", "lowering": "fx"},
                          fullgraph=True)
        b = torch.compile(model_b, backend="dsa_dcp",
                          options={"dcp_size": 2, "merge": "ag", "interleave": 2, "lowering": "fx"},
                          fullgraph=True)
        with pytest.raises(LookupError, match="call it once"):
            dsa_dcp.inspect(a)
        with torch.no_grad():
            a(*inputs)
            b(*inputs)
    for obj in (a, model_a):
        report = dsa_dcp.inspect(obj)
        assert report.report.options.interleave == 1 and report.summary()["sparse_attention_nodes"] == 3
    assert dsa_dcp.inspect(b).report.options.interleave == 2
    assert "def forward" not in dsa_dcp.inspect(a).to_text()  # the code is in the html, json and graphs/*.py
    assert "fake backend, rank 0 of 2" in dsa_dcp.inspect(a).target["process_group"]


def test_inspect_a_compiled_function():
    torch._dynamo.reset()

    def layer(q_nope, q_pe, kv, topk):
        out, _ = toy_sparse_attention(q_nope, q_pe, kv, topk, 0.1)
        return out

    compiled = torch.compile(layer, backend="dsa_dcp", options={"lowering": "fx"}, fullgraph=True)
    compiled(torch.randn(2, 4, 16), torch.randn(2, 4, 8), torch.randn(32, 24), torch.tensor([[3, 7], [-1, 1]]))
    insp = dsa_dcp.inspect(compiled)
    assert insp.report.options.dcp_size == 1 and [p.name for p in insp.report.passes] == ["indexer_kernels"]
    assert insp.summary()["sparse_attention_nodes"] == 1 and insp.summary()["merges"] == {}
    assert dsa_dcp.inspect(layer).report is insp.report


def test_cli_entry_point_factory_and_torch_trace(tmp_path):
    """The installed ``dsa-dcp`` script on a factory in this file; the passes' graphs land in TORCH_TRACE."""
    exe = shutil.which("dsa-dcp")
    cmd = [exe] if exe else [sys.executable, "-m", "dsa_dcp.cli"]
    trace_dir = tmp_path / "trace"
    env = {**os.environ, "TORCH_TRACE": str(trace_dir)}
    run = subprocess.run(cmd + ["inspect", "test_inspect:make_toy", "--dcp", "2", "--merge", "ag", "--out",
                                str(tmp_path / "out")], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "test_inspect:make_toy() -> ToyModel (called with dcp_size=2)" in run.stdout
    assert re.search(r"sparse attention nodes\s+3\n", run.stdout)
    assert (tmp_path / "out" / "dataflow.png").exists() and (tmp_path / "out" / "graphs" / "00_input.py").exists()
    logs = "".join(p.read_text() for p in trace_dir.iterdir())
    for name in ("dsa_dcp_input_graph", "dsa_dcp_pass_localize_kv_writes", "dsa_dcp_pass_dcp_rewrite"):
        assert f'"name": "{name}"' in logs
    assert "all_gather_into_tensor" in logs  # the rewritten graph's code is the payload


def test_registry_falls_back_to_parameters_without_dynamos_frame(monkeypatch):
    from dsa_dcp import registry

    monkeypatch.setattr(registry, "traced_frame", lambda: (None, None))
    torch._dynamo.reset()
    model, inputs = make_toy()
    compiled = torch.compile(model, backend="dsa_dcp", options={"lowering": "fx"}, fullgraph=True)
    with torch.no_grad():  # the backend compiles inference steps
        compiled(*inputs)
    assert dsa_dcp.inspect(compiled).summary()["sparse_attention_nodes"] == 3
    with pytest.raises(LookupError):
        dsa_dcp.inspect(make_toy()[0])  # another instance: nothing compiled


class _CountingStep:
    """Stands in for a CUDA-graph step (which needs a GPU): records whether it was asked to count."""

    def __init__(self):
        self.asked = 0

    def kernels_per_step(self):
        self.asked += 1
        return {("sig",): 123}


@pytest.mark.parametrize("dcp_size, expected", [(1, {"('sig',)": 123}), (2, NO_KERNEL_COUNT_DCP)])
def test_kernel_count_is_not_taken_for_a_dcp_group(dcp_size, expected):
    """Counting runs the step once more on the rank that asks; in a DCP group its collectives
    would wait for the ranks that do not, so the count is not taken there."""
    from dsa_dcp.config import DCPOptions
    from dsa_dcp.report import CompileReport

    step = _CountingStep()
    report = CompileReport(DCPOptions(dcp_size=dcp_size), rank=0, graph_before="", passes=[])
    report.hold_lowered(step)
    inspection = Inspection(report, target={})
    kernels = inspection.summary()["kernels_per_step"]
    assert step.asked == (1 if dcp_size == 1 else 0)
    assert kernels == expected
    del step  # the report holds the step weakly: it never keeps a compiled step (or its CUDA graphs) alive
    assert report.lowered is None

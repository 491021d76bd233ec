"""The backend's front door: options, registration, and dcp_size=1 equal to eager."""

import dataclasses
import importlib.metadata
import subprocess
import sys

import pytest
import torch

import dsa_dcp
from dsa_dcp.config import DCPOptions, OptionsError
from dsa_dcp.models import DSAModel, generate, get_config, standard_test_batch


def test_backend_is_registered_as_entry_point():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("dsa_dcp") == "dsa_dcp.backend:dsa_dcp_backend"
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("dsa_dcp") is dsa_dcp.backend


_WITHOUT_ENTRY_POINT = """
import importlib.metadata as md
real = md.entry_points
def entry_points(**kw):  # as in a source tree on PYTHONPATH: no entry point of ours
    eps = real(**kw)
    return [ep for ep in eps if ep.name != "dsa_dcp"] if "group" in kw else eps
md.entry_points = entry_points
import dsa_dcp
from torch._dynamo.backends.registry import lookup_backend
assert lookup_backend("dsa_dcp") is dsa_dcp.backend
print("ok")
"""

_ENTRY_POINT_FIRST = """
from torch._dynamo.backends.registry import lookup_backend
fn = lookup_backend("dsa_dcp")  # loads the entry point, which imports the package
import dsa_dcp
assert fn is dsa_dcp.backend
print("ok")
"""


@pytest.mark.parametrize("script", [_WITHOUT_ENTRY_POINT, _ENTRY_POINT_FIRST], ids=["source-tree", "installed"])
def test_backend_name_resolves_with_and_without_the_entry_point(script):
    """Importing the package registers the name only where no entry point does (no duplicate)."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dcp": 2}, r"unknown dsa_dcp option\(s\) \['dcp'\]; valid options are \['dcp_size'"),
        ({"merge": "allgather"}, r"merge must be one of \['ag', 'a2a', 'ag_rs', 'fused_a2a'\], got 'allgather'"),
        ({"dcp_size": 0}, r"dcp_size must be an integer >= 1, got 0"),
        ({"dcp_size": True}, r"dcp_size must be an integer >= 1, got True"),
        ({"interleave": 2.0}, r"interleave must be an integer >= 1, got 2.0"),
        ({"lowering": "tensorrt"}, r"lowering must be one of \['fx', 'inductor'\]"),
        ({"dcp_size": 2, "rank": 2}, r"rank must be None or in \[0, dcp_size\), got 2"),
        ({"batch_sizes": [8, 4]}, r"batch_sizes must be a non-empty increasing list"),
    ],
)
def test_bad_options_name_what_is_valid(options, message):
    with pytest.raises(OptionsError, match=message):
        DCPOptions.parse(options)


def test_all_option_problems_are_reported_together():
    with pytest.raises(OptionsError) as err:
        DCPOptions.parse({"dcp_size": -1, "merge": "x", "interleave": 0})
    text = str(err.value)
    assert "dcp_size" in text and "merge" in text and "interleave" in text


def test_bad_option_fails_at_compile_time_through_torch_compile():
    f = torch.compile(lambda x: x + 1, backend="dsa_dcp", options={"merge": "nope"})
    with pytest.raises(Exception, match=r"merge must be one of"):
        f(torch.zeros(2))


def test_dcp_size_above_one_needs_a_group():
    f = torch.compile(lambda x: x + 1, backend="dsa_dcp", options={"dcp_size": 2})
    with pytest.raises(Exception, match=r"dcp_size=2 needs an initialized torch.distributed process group"):
        f(torch.zeros(2))


# one valid, non-default value per option (dcp_size 2 where the option needs a group of several)
OPTION_CHANGES = {
    "dcp_size": {"dcp_size": 2}, "group": {"dcp_size": 2, "group": "dcp"}, "rank": {"dcp_size": 2, "rank": 1},
    "merge": {"merge": "ag"}, "interleave": {"interleave": 2}, "lowering": {"lowering": "fx"},
    "share_remaps": {"share_remaps": False}, "cuda_graphs": {"cuda_graphs": False},
    "batch_sizes": {"batch_sizes": [1, 8]}, "page_size": {"page_size": 64}, "allow_multi_host": {"allow_multi_host": True},
    "debug_checks": {"debug_checks": True}, "mode": {"mode": "reduce-overhead"},
    "indexer_kernels": {"indexer_kernels": False}, "index_cache": {"index_cache": "sharded"},
    "replicate_q": {"replicate_q": False},
    "replicated_modules": {"replicated_modules": ["mtp"]}, "draft_length": {"draft_length": 3},
}  # fmt: skip
SINGLE_VALUED = {"draft_topk"}  # 1 is its only valid value (a draft chain): nothing to tell apart


def test_options_cache_key_covers_every_option():
    assert set(OPTION_CHANGES) | SINGLE_VALUED == {f.name for f in dataclasses.fields(DCPOptions)}
    keys = {DCPOptions.parse({}).cache_key()} | {DCPOptions.parse(c).cache_key() for c in OPTION_CHANGES.values()}
    assert len(keys) == len(OPTION_CHANGES) + 1


# the FX lowering; Inductor at dcp_size 1: examples/one_device.py (tests/test_examples.py)
@pytest.mark.parametrize("family, layers", [("deepseek-v3.2-tiny", 3), ("glm5.2-tiny", 5)])
def test_dcp_size_one_equals_eager(family, layers):
    torch._dynamo.reset()
    cfg = get_config(family, n_layers=layers)
    batch = standard_test_batch(cfg, max_new_tokens=8, seed=1)
    eager = DSAModel(cfg, batch.num_slots, seed=3)
    compiled_model = DSAModel(cfg, batch.num_slots, seed=3)
    compiled = torch.compile(compiled_model, backend="dsa_dcp", options={"dcp_size": 1, "lowering": "fx"},
                             fullgraph=True)
    with torch.no_grad():
        ref = generate(eager, batch, 8, pad_to=16)
        out = generate(compiled, batch, 8, pad_to=16)
    assert out.tokens == ref.tokens
    assert len(out.step_logits) == len(ref.step_logits) >= 8
    for a, b in zip(out.step_logits, ref.step_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    report = dsa_dcp.backend_report()
    assert report.summary["sparse_attention_nodes"] == layers
    # dcp_size=1 keeps the graph as written, but for the indexer's kernels (tests/test_indexer_pass.py)
    assert [p.name for p in report.passes] == ["indexer_kernels"]


def test_pass_uuid_covers_options_rank_and_group():
    from dsa_dcp.passes import DCPRewrite, LocalizeKVWrites
    from dsa_dcp.passes.base import CompileContext

    def ctx(rank=0, group="g0", **options):
        return CompileContext(options=DCPOptions.parse({"dcp_size": 2, **options}), rank=rank, group_name=group)

    base = ctx()
    assert DCPRewrite().uuid(base) == DCPRewrite().uuid(ctx())  # stable for the same inputs
    variants = [ctx(rank=1), ctx(group="g1"), ctx(merge="ag"), ctx(interleave=2)]
    keys = {DCPRewrite().uuid(c) for c in variants} | {DCPRewrite().uuid(base), LocalizeKVWrites().uuid(base)}
    assert len(keys) == len(variants) + 2

"""The measured sparse_mla dispatch table: lookup rules and refusal of malformed tables."""

import json

import pytest
import torch

from dsa_dcp.kernels import dispatch

TILES = {"block_h": 64, "block_k": 32, "num_warps": 8, "num_stages": 2, "num_splits": 4}


def _table(device="GPU-X"):
    entries = []
    for b in (1, 8, 128):
        for k in (512, 2048):
            backend = "fa3" if (b, k) == (8, 2048) else "triton"
            entries.append({"H": 64, "B": b, "K": k, "kv": "bf16", "backend": backend,
                            "tiles": dict(TILES, num_splits=b * 1000 + k)})
    entries.append({"H": 64, "B": 1, "K": 512, "kv": "fp8", "backend": "triton", "tiles": dict(TILES, num_splits=7)})
    return {"device": device, "entries": entries}


@pytest.mark.parametrize("B,K,expect", [
    (1, 512, 1512),  # exact
    (2, 300, 8512),  # between batches: the next measured batch at or above; top-k likewise
    (8, 1024, 10048),  # K between 512 and 2048 -> 2048's entry (measured B = 8)
    (500, 4096, 130048),  # past the end: the largest measured
])  # fmt: skip
def test_lookup_takes_nearest_measured_at_or_above(B, K, expect):
    choice = dispatch.lookup(_table(), "GPU-X", 64, B, K, "bf16")
    assert choice.tiles["num_splits"] == expect
    assert choice.backend == ("fa3" if expect == 10048 else "triton")


def test_lookup_only_on_the_measured_device_heads_and_dtype():
    t = _table()
    assert dispatch.lookup(t, "GPU-Y", 64, 1, 512, "bf16") is None
    assert dispatch.lookup(t, "GPU-X", 128, 1, 512, "bf16") is None
    assert dispatch.lookup(t, "GPU-X", 64, 1, 512, "fp16") is None
    assert dispatch.lookup(t, "GPU-X", 64, 1, 512, "fp8").tiles["num_splits"] == 7


def test_lookup_on_another_device_of_the_architecture_the_table_names():
    """A table that names its architecture applies to any device of it (an H100 SXM takes an
    H200's table), not to another compute capability or SM count; one without applies to its
    device only."""
    hopper = {"capability": [9, 0], "sms": 132}
    t = dict(_table(), arch=hopper)
    assert dispatch.lookup(t, "GPU-Y", 64, 1, 512, "bf16", hopper).tiles["num_splits"] == 1512
    for other in ({"capability": [9, 0], "sms": 114}, {"capability": [10, 0], "sms": 132}, None):
        assert dispatch.lookup(t, "GPU-Y", 64, 1, 512, "bf16", other) is None
        assert dispatch.lookup(t, "GPU-X", 64, 1, 512, "bf16", other).tiles["num_splits"] == 1512
    assert dispatch.lookup(_table(), "GPU-Y", 64, 1, 512, "bf16", hopper) is None
    assert dispatch.memo_lookup(t, "GPU-Y", 64, 8, 600, torch.bfloat16, hopper).tiles["num_splits"] == 10048
    assert dispatch.memo_lookup(t, "GPU-Y", 64, 8, 600, torch.bfloat16, dict(hopper, sms=114)) is None


def test_memo_lookup_agrees_with_lookup_and_follows_the_table():
    t = _table()
    for b in (1, 2, 8, 9, 128, 500):
        for k in (1, 512, 513, 2048, 4096):
            for dtype, kv in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8"), (torch.float16, "fp16")):
                assert dispatch.memo_lookup(t, "GPU-X", 64, b, k, dtype) == dispatch.lookup(t, "GPU-X", 64, b, k, kv)
    first = dispatch.memo_lookup(t, "GPU-X", 64, 1, 512, torch.bfloat16)
    assert dispatch.memo_lookup(t, "GPU-X", 64, 1, 512, torch.bfloat16) is first  # remembered
    with pytest.raises(TypeError):
        first.tiles["num_splits"] = 3  # shared, so read-only
    other = _table()  # a table loaded anew (e.g. another file) is looked up afresh
    other["entries"][0]["tiles"]["num_splits"] = 99
    assert dispatch.memo_lookup(other, "GPU-X", 64, 1, 512, torch.bfloat16).tiles["num_splits"] == 99


def test_choose_is_none_off_cuda():
    assert dispatch.choose(64, 1, 512, torch.bfloat16, torch.device("cpu")) is None


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.pop("device"), "needs 'device'"),
    (lambda t: t["entries"][0].pop("tiles"), r"entry 0 lacks \['tiles'\]"),
    (lambda t: t["entries"][1].update(backend="cutlass"), "entry 1 has backend 'cutlass'"),
    (lambda t: t["entries"][2]["tiles"].update(block_m=4), r"entry 2 has unknown tile keys \['block_m'\]"),
    (lambda t: t.update(arch={"capability": "9.0", "sms": 132}), "'arch' must be"),
    (lambda t: t.update(arch={"capability": [9, 0]}), "'arch' must be"),
])  # fmt: skip
def test_malformed_table_is_refused(tmp_path, monkeypatch, mutate, match):
    t = _table()
    mutate(t)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(t))
    monkeypatch.setenv(dispatch.ENV, str(path))
    dispatch.load_table.cache_clear()
    try:
        with pytest.raises(ValueError, match=match):
            dispatch.load_table()
    finally:
        dispatch.load_table.cache_clear()


def test_table_from_env_and_missing_file(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table()))
    monkeypatch.setenv(dispatch.ENV, str(path))
    dispatch.load_table.cache_clear()
    try:
        assert dispatch.load_table()["device"] == "GPU-X"
        monkeypatch.setenv(dispatch.ENV, str(tmp_path / "nope.json"))
        dispatch.load_table.cache_clear()
        with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
            dispatch.load_table()
    finally:
        dispatch.load_table.cache_clear()


def test_shipped_table_is_well_formed():
    """The table shipped with the package (if any) passes the same checks the loader makes."""
    if not dispatch.TABLE_PATH.exists():
        pytest.skip("no table shipped")
    t = dispatch.validate_table(json.loads(dispatch.TABLE_PATH.read_text()), str(dispatch.TABLE_PATH))
    assert t["entries"], "an empty table"
    assert t["arch"] == {"capability": [9, 0], "sms": 132}  # an H200's: H100 SXMs take it too


def test_lookup_reads_the_captured_choice_and_the_hopper_tiles():
    t = _table()
    t["entries"][0].update(backend="hopper", graph_backend="hopper", hopper_tiles={"num_splits": 8, "block_k": 32})
    t["entries"][2].update(backend="fa3", graph_backend="hopper", hopper_tiles={"num_splits": 2})
    dispatch.validate_table(t, "t")
    first = dispatch.lookup(t, "GPU-X", 64, 1, 512, "bf16")
    assert (first.backend, first.graph_backend, dict(first.hopper_tiles)) == ("hopper", "hopper",
                                                                              {"num_splits": 8, "block_k": 32})
    assert first.tiles["block_h"] == 64  # the Triton tiles stay beside them (the fallback)
    fa = dispatch.lookup(t, "GPU-X", 64, 8, 512, "bf16")
    assert (fa.backend, fa.graph_backend) == ("fa3", "hopper")
    # an entry of an older table (no graph_backend): captured on its backend if it can be, else on Triton
    old_fa = dispatch.lookup(t, "GPU-X", 64, 8, 2048, "bf16")
    assert (old_fa.backend, old_fa.graph_backend, dict(old_fa.hopper_tiles)) == ("fa3", "triton", {})
    old_triton = dispatch.lookup(t, "GPU-X", 64, 128, 512, "bf16")
    assert (old_triton.backend, old_triton.graph_backend) == ("triton", "triton")


def _choice(backend, graph_backend):
    return dispatch.Choice(backend, dispatch.MappingProxyType({}), graph_backend)


def _never():
    raise AssertionError("asked about a backend that is not the choice")


@pytest.mark.parametrize("backend,graph_backend,capturing,fi,hop,expect", [
    ("hopper", "hopper", False, False, True, "hopper"),
    ("hopper", "hopper", True, False, True, "hopper"),
    ("hopper", "hopper", False, False, False, "triton"),  # Hopper kernel cannot run here
    ("fa3", "hopper", False, True, True, "fa3"),
    ("fa3", "hopper", True, True, True, "hopper"),  # FlashInfer plans on the host: never captured
    ("fa2", "hopper", False, False, True, "hopper"),  # FlashInfer not installed: the captured choice
    ("fa2", "hopper", False, False, False, "triton"),
    ("triton", "hopper", False, True, True, "triton"),
    ("triton", "triton", True, True, True, "triton"),
])  # fmt: skip
def test_runnable_backend(backend, graph_backend, capturing, fi, hop, expect):
    got = dispatch.runnable_backend(_choice(backend, graph_backend), capturing,
                                    flashinfer_ok=lambda: fi, hopper_ok=lambda: hop)
    assert got == expect


def test_runnable_backend_asks_only_about_the_choice():
    assert dispatch.runnable_backend(None, False, _never, _never) == "triton"
    assert dispatch.runnable_backend(_choice("triton", "triton"), False, _never, _never) == "triton"
    assert dispatch.runnable_backend(_choice("hopper", "hopper"), False, _never, lambda: True) == "hopper"


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t["entries"][0].update(graph_backend="fa3"), "entry 0 has graph_backend 'fa3'"),
    (lambda t: t["entries"][1].update(hopper_tiles={"block_h": 64}), r"entry 1 has unknown hopper tile keys \['block_h'\]"),
])  # fmt: skip
def test_malformed_hopper_fields_are_refused(mutate, match):
    t = _table()
    mutate(t)
    with pytest.raises(ValueError, match=match):
        dispatch.validate_table(t, "t")


def test_shipped_table_captures_only_what_can_be_captured():
    if not dispatch.TABLE_PATH.exists():
        pytest.skip("no table shipped")
    t = dispatch.validate_table(json.loads(dispatch.TABLE_PATH.read_text()), str(dispatch.TABLE_PATH))
    for e in t["entries"]:
        assert e.get("graph_backend", "triton") in dispatch.GRAPH_BACKENDS
        if "hopper" in (e["backend"], e.get("graph_backend")):
            assert e.get("hopper_tiles"), e

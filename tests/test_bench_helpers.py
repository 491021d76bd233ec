"""The pure parts of the kernel bench and tuner (the timing itself needs a GPU)."""

import itertools
import math

import pytest

from dsa_dcp.bench.kernels import format_tables
from dsa_dcp.bench.tune import TILE_CANDIDATES, _split_candidates


@pytest.mark.parametrize("b,h,k,tile", itertools.product((1, 8, 32, 128), (64, 128), (512, 2048), TILE_CANDIDATES))
def test_split_candidates_fill_half_to_two_waves(b, h, k, tile):
    sms = 132
    programs = b * math.ceil(h / tile["block_h"])
    most = k // tile["block_k"]
    got = _split_candidates(b, h, k, tile["block_h"], tile["block_k"], sms)
    assert got[0] == 1 and got == sorted(set(got))
    for s in got[1:]:
        assert s <= most, "a split with no K tile"
        assert s == most or sms / 2 <= programs * s <= 2 * sms, (s, programs)


def test_format_tables_marks_missing_values_and_capture_errors():
    rows = [
        {"kernel": "sparse_mla", "kv": "bf16", "H": 64, "B": 1, "K": 512, "triton_us": 12.345,
         "triton_graph_us": 8.9, "triton_GBps": 83.0, "fa2_graph_us": None,
         "fa2_graph_us_error": "RuntimeError: capture failed"},
        {"kernel": "topk_remap", "B": 1, "N": 2, "K": 2048, "ours_us": 6.5},
    ]
    text = format_tables(rows)
    mla = next(line for line in text.splitlines() if line.startswith("| bf16"))
    cells = [c.strip() for c in mla.strip("|").split("|")]
    assert cells[:7] == ["bf16", "64", "1", "512", "12.35", "8.90", "83.00"]
    assert cells[9] == "-", "a value that was not captured prints as -"
    assert "not captured: fa2_graph_us_error: RuntimeError: capture failed" in text
    assert "\ntopk_remap\n" in text and "| 1 | 2 | 2048 | 6.50 | - |" in text

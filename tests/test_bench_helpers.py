"""The pure parts of the kernel bench and tuner (the timing itself needs a GPU)."""

import itertools
import math

import pytest

from dsa_dcp.bench.kernels import format_tables
from dsa_dcp.bench.tune import CANDIDATE_SETS, _split_candidates
from dsa_dcp.kernels.dispatch import TILE_KEYS
from triton_env import DEVICE


@pytest.mark.parametrize("b,h,k,tile", itertools.product((1, 8, 32, 128), (64, 128), (512, 2048), CANDIDATE_SETS["all"]))
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


def _tile_id(tile):
    return "-".join(f"{v}" for v in tile.values())


# The interpreter drops a launch's num_warps and num_stages (they are no arguments of the kernel),
# so under it two candidates that differ only there are one launch: the first of them runs it.
_LAUNCH_ONLY = ("num_warps", "num_stages")
_FIRST_WITH_SAME_LAUNCH = {}
for _tile in CANDIDATE_SETS["all"]:
    _FIRST_WITH_SAME_LAUNCH.setdefault(tuple((k, v) for k, v in sorted(_tile.items()) if k not in _LAUNCH_ONLY), _tile)


@pytest.mark.parametrize("tile", CANDIDATE_SETS["all"], ids=_tile_id)
def test_every_tile_candidate_is_a_correct_launch(tile):
    """What --tune may write into the table launches and matches the reference (interpreter, tiny)."""
    import torch

    from dsa_dcp.kernels.sparse_mla import sparse_mla_reference, sparse_mla_triton

    assert set(tile) <= set(TILE_KEYS)
    first = _FIRST_WITH_SAME_LAUNCH[tuple((k, v) for k, v in sorted(tile.items()) if k not in _LAUNCH_ONLY)]
    if DEVICE == "cpu" and first is not tile:
        pytest.skip(f"the interpreter ignores num_warps and num_stages: the same launch as [{_tile_id(first)}]")
    gen = torch.Generator().manual_seed(sum(map(int, tile.values())))
    B, H, K, S, Dc, Dr = 2, 5, 40, 50, 32, 8  # Dc = 32: with dc_split=2 each program owns 16 columns
    q_nope, q_pe = torch.randn(B, H, Dc, generator=gen), torch.randn(B, H, Dr, generator=gen)
    kv = torch.randn(S, Dc + Dr, generator=gen)
    topk = torch.randint(-1, S, (B, K), generator=gen)
    args = [t.to(DEVICE) for t in (q_nope, q_pe, kv, topk)]  # the GPU where there is one, else the interpreter
    ref = sparse_mla_reference(*args, 0.5)
    got = sparse_mla_triton(*args, 0.5, **tile, num_splits=2)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_merge_entries_replaces_the_tuned_shapes_and_keeps_the_rest():
    from dsa_dcp.bench.tune import merge_entries

    def entry(kv, h, b, k, block_h):
        return {"H": h, "B": b, "K": k, "kv": kv, "backend": "triton", "tiles": {"block_h": block_h}}

    table = {"device": "D", "command": "first", "entries": [entry("bf16", 64, 1, 512, 16), entry("fp8", 128, 8, 2048, 32)]}
    merged = merge_entries(table, [entry("fp8", 128, 8, 2048, 64), entry("bf16", 128, 1, 512, 16)], "second")
    got = {(e["kv"], e["H"], e["B"], e["K"]): e["tiles"]["block_h"] for e in merged["entries"]}
    assert got == {("bf16", 64, 1, 512): 16, ("fp8", 128, 8, 2048): 64, ("bf16", 128, 1, 512): 16}
    assert merged["command"].startswith("first; then second") and table["command"] == "first"
    with pytest.raises(ValueError, match="needs 'device'"):
        merge_entries({"entries": []}, [], "x")


def test_step_floor_counts_the_weights_the_step_reads():
    """``bench step``'s HBM floor: the embedding is a lookup (the batch's rows, not the table), the
    LM head is read whole, the MTP draft's own layer is not read by the step."""
    from dsa_dcp.bench.step import hbm_floor_bytes
    from dsa_dcp.models import DSAModel, get_config

    def floor_bytes(batch=1, context=40, **overrides):
        cfg = get_config("glm5-tiny", n_layers=2, **overrides)
        model = DSAModel(cfg, 4 * 64, seed=0)
        return sum(hbm_floor_bytes(model, cfg, batch, context).values()), cfg, model

    small, cfg, model = floor_bytes(vocab_size=256)
    large, _, _ = floor_bytes(vocab_size=512)
    row = cfg.hidden_size * model.embed.element_size()
    assert large - small == 256 * row, "a larger vocabulary adds its LM-head rows only"
    with_draft, _, _ = floor_bytes(vocab_size=256, mtp_layers=1)
    assert with_draft == small, "the MTP draft's weights are not read by the step"
    two, _, _ = floor_bytes(batch=2, vocab_size=256)
    kv = cfg.n_layers * min(cfg.index_topk, 41) * cfg.kv_dim * model.kv_caches()[0].element_size()
    keys = len(cfg.indexer_layers) * 41 * cfg.index_head_dim * next(iter(model.index_caches().values())).element_size()
    assert two - small == row + kv + keys, "a request adds its token's embedding row, its KV rows and its index keys"
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name != "embed")
    assert small == weights + row + kv + keys


def test_step_floor_split_covers_every_kernel_kind_and_sums_to_the_step():
    """``bench step``'s split of the ``dsa_dcp`` step against its floor: every kind of kernel
    (bench/kinds.py) lands in exactly one part, and the parts sum to the step's time."""
    import random

    from dsa_dcp.bench.kinds import KERNEL_KINDS, kernel_us_by_kind
    from dsa_dcp.bench.step import FLOOR_PARTS, floor_split, format_step_table

    kinds = [kind for part in FLOOR_PARTS for kind in part[1]]
    assert sorted(kinds) == sorted([k for k, _ in KERNEL_KINDS] + ["other"]), "each kind in one part"
    rng = random.Random(0)
    names = ["nccl:all_to_all", "fused_a2a_merge_kernel", "_topk_remap_kernel", "_lse_combine_kernel",
             "_sparse_mla_hopper_kernel", "_index_scores_kernel", "_topk_resident_kernel", "nvjet_tst_64x8",
             "triton_red_fused_rms_norm_0"]
    kernels = [(rng.choice(names), rng.uniform(1, 50)) for _ in range(60)]
    row = {"batch": 32, "dsa_dcp_us": 1.25 * sum(us for _, us in kernels) / 3,
           "hbm_floor_parts_us": {"weights": 300.0, "keys": 40.0, "kv": 10.0}}
    row |= {f"dsa_dcp_{k}": v for k, v in kernel_us_by_kind(kernels, runs=3).items()}
    split = dict((part, (us, floor)) for part, us, floor in floor_split(row))
    assert math.isclose(sum(us for us, _ in split.values()), row["dsa_dcp_us"])
    by_name = lambda *subs: sum(us for name, us in kernels if any(s in name for s in subs)) / 3  # noqa: E731
    assert math.isclose(split["attention"][0], by_name("sparse_mla", "lse_combine")) and split["attention"][1] == 10.0
    assert math.isclose(split["indexer"][0], by_name("index_scores", "_topk_resident")) and split["indexer"][1] == 40.0
    assert math.isclose(split["dense and the rest"][0], by_name("nvjet", "triton_red"))
    assert split["DCP's collectives and remap"][1] is None
    assert math.isclose(split["between kernels"][0], row["dsa_dcp_us"] / 5)
    text = format_step_table([row | {"layers": 4, "context": 4096, "eager_us": 1.0, "stock_us": 1.0, "dsa_dcp_over_stock": 1.0,
                                     "dsa_dcp_fx_us": 1.0, "hbm_floor_us": 350.0, "stock_kernels": 1, "dsa_dcp_kernels": 1}])
    line = next(t for t in text.splitlines() if t.startswith("| 32 | indexer |"))
    assert line == f"| 32 | indexer | {split['indexer'][0]:,.0f} | 40 | {split['indexer'][0] / 40:.2f}x |"


def test_kernels_side_by_side_are_counted_once_in_the_step_split():
    """``overlap_us``: the time kernels ran at once (none for a stream's kernels one after another);
    the split takes it off once, so its 'between kernels' is the time no kernel ran, and the parts
    still sum to the step."""
    import random

    from dsa_dcp.bench.kinds import kernel_us_by_kind, overlap_us
    from dsa_dcp.bench.step import floor_split

    rng = random.Random(1)
    serial, t = [], 0.0
    for i in range(40):
        t += 1.0 if i == 6 else rng.uniform(0.0, 3.0)  # a gap, possibly none
        us = rng.uniform(8.0, 20.0)
        serial.append((rng.choice(["nvjet_a", "_index_scores_kernel"]), us, t))
        t += us
    assert math.isclose(overlap_us(serial, runs=2), 0.0, abs_tol=1e-9)
    # a second stream: one kernel inside kernel 5, one from 1 us before its end across the 1 us gap
    # into kernel 6's first 2 us, one past the end
    _, a_us, a_start = serial[5]
    _, _, b_start = serial[6]
    extra = [("_topk_resident_kernel", a_us / 2, a_start + a_us / 4),
             ("_topk_resident_kernel", 4.0, b_start - 2.0),
             ("_topk_resident_kernel", 5.0, t + 10.0)]
    inside, straddle = a_us / 2, 1.0 + 2.0
    kernels = serial + extra
    assert math.isclose(overlap_us(kernels, runs=2), (inside + straddle) / 2)
    busy = (sum(us for _, us, _ in kernels) - (inside + straddle)) / 2
    row = {"dsa_dcp_us": busy + 30.0, "hbm_floor_parts_us": {"weights": 1.0, "keys": 1.0, "kv": 1.0},
           "dsa_dcp_overlap_us": overlap_us(kernels, runs=2)}
    row |= {f"dsa_dcp_{k}": v for k, v in kernel_us_by_kind([(n, us) for n, us, _ in kernels], runs=2).items()}
    split = dict((part, us) for part, us, _ in floor_split(row))
    assert math.isclose(sum(split.values()), row["dsa_dcp_us"])
    assert math.isclose(split["between kernels"], 30.0)
    assert math.isclose(split["kernels side by side (counted twice above)"], -(inside + straddle) / 2)

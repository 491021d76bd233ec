"""Capacity under TP with DCP inside it (``dsa_dcp/inspection/capacity.py``, ``dsa-dcp inspect --tp``).

The arithmetic is checked against figures computed here from the config's fields, written out term
by term (not through ``weight_groups``); the CLI on the capacity alone (nothing compiled), and once
through a compilation of a two-layer model, whose report without ``--tp`` is the same report less
the capacity section.
"""

import contextlib
import io
import json
import os
import pathlib
import re
import shlex

import pytest
import torch

from dsa_dcp import cli
from dsa_dcp.inspection import capacity_plan
from dsa_dcp.inspection.capacity import GB, GPUS, LayoutError, layout_problems
from dsa_dcp.models import DSAModel, get_config
from dsa_dcp.models.runner import decode_step_inputs

HERE = os.path.dirname(os.path.abspath(__file__))
FP8 = 1 + 4 / 128**2  # e4m3 + an fp32 scale per 128 x 128 block


def _glm52_weights(t, n, fp8=True, replicate_q=True):
    """GLM-5.2's bytes per rank at tp t, dcp n, written out from its config (64 heads, 78 layers,
    21 indexer layers) and its published MoE (256 experts of width 2048, one shared, 3 dense layers)."""
    c = get_config("glm5.2")
    d, layers, h = c.hidden_size, c.n_layers, c.n_heads // t
    other = (n - 1) * h if replicate_q else 0
    linear = (
        layers * d * c.q_lora_rank + layers * d * (c.kv_lora_rank + c.qk_rope_head_dim)  # wq_a, wkv_a
        + layers * h * (c.qk_nope_head_dim + c.qk_rope_head_dim) * c.q_lora_rank  # wq_b
        + layers * h * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank  # wkv_b
        + layers * h * c.v_head_dim * d  # wo
        + layers * other * ((c.qk_nope_head_dim + c.qk_rope_head_dim) * c.q_lora_rank
                            + c.qk_nope_head_dim * c.kv_lora_rank)  # the DCP group's other heads
        + 21 * (c.q_lora_rank * 32 * 128 + d * 128)  # indexer wq_b, wk
        + 3 * 3 * d * c.intermediate_size // t  # dense MLPs
        + 75 * (256 // t) * 3 * d * 2048  # routed experts, EP = t
        + 75 * 3 * d * 2048 // t  # one shared expert
    )
    bf16 = (21 * (d * 32 + 2 * 128)  # indexer weights_proj, k_norm
            + 75 * 256 * d  # router gates
            + 2 * (c.vocab_size // t) * d  # embedding, LM head
            + layers * (2 * d + c.q_lora_rank + c.kv_lora_rank) + d)  # norms
    return linear * (FP8 if fp8 else 2) + 2 * bf16 + 4 * 75 * 256


def test_glm52_at_tp4_dcp2_matches_the_figures_written_out():
    plan = capacity_plan("glm5.2", 4, 2, kv_dtype="fp8", gpu="b300")
    weights = _glm52_weights(4, 2)
    assert plan.weight_bytes_per_rank == round(weights)
    assert plan.replicate_q_bytes_per_rank == round(78 * 16 * (256 * 2048 + 192 * 512) * FP8)
    assert plan.tp_alone_weight_bytes_per_rank == round(_glm52_weights(4, 1))
    # per token per rank (FACTS.md): 78 x 576 B of KV split over the DCP group, 21 x 132 B of index keys whole
    assert plan.kv_bytes_per_token_per_rank == 78 * 576 / 2 == 22464
    assert plan.index_bytes_per_token_per_rank == 21 * 132 == 2772
    assert plan.bytes_per_token_per_rank == 25236
    reserve = round(0.1 * 288e9)
    assert plan.gpu_memory_bytes == 288 * 10**9 and plan.reserve_bytes == reserve
    free = 288 * 10**9 - round(weights) - reserve - 4 * 78  # 4 B per-tensor scale per fp8 cache
    assert plan.free_bytes_per_rank == free
    assert plan.kv_tokens == free // 25236
    alone = (288 * 10**9 - round(_glm52_weights(4, 1)) - reserve - 4 * 78) // (78 * 576 + 21 * 132)
    assert plan.tp_alone_kv_tokens == alone
    assert plan.capacity_vs_tp_alone == pytest.approx(plan.kv_tokens / alone)
    # about 188 GB of weights per rank at tp 4, so the DCP group's extra Q heads cost a little capacity:
    # the ratio stays under the bytes ratio 47,700 / 25,236
    assert 188e9 < plan.weight_bytes_per_rank < 189e9
    assert 1.85 < plan.capacity_vs_tp_alone < 47700 / 25236


def test_sharded_index_cache_bf16_weights_and_replicate_q_off():
    plan = capacity_plan("glm5.2", 8, 4, kv_dtype="bf16", index_cache="sharded", weight_dtype="bf16",
                         replicate_q=False, gpu=1000, reserve_gb=20)
    assert plan.weight_bytes_per_rank == round(_glm52_weights(8, 4, fp8=False, replicate_q=False))
    assert plan.replicate_q_bytes_per_rank == 0
    assert plan.bytes_per_token_per_rank == (78 * 1152 + 21 * 256) / 4
    assert plan.index_bytes_per_token_per_rank == 21 * 256 / 4
    free = 1000 * GB - plan.weight_bytes_per_rank - 20 * GB  # bf16 caches have no scales
    assert plan.kv_tokens == int(free // plan.bytes_per_token_per_rank)


def test_whole_models_have_their_published_sizes():
    # GLM-5 is published as 744B parameters, DeepSeek-V3.2 as 671B plus its multi-token-prediction layer
    assert round(capacity_plan("glm5", 1).model_params / 1e9) == 744
    assert 671e9 < capacity_plan("deepseek-v3.2", 1).model_params < 672e9
    h200 = capacity_plan("deepseek-v3.2", 8, 8)
    assert h200.gpu == "h200" and h200.gpu_memory_bytes == GPUS["h200"].memory_bytes == 150_109_880_320


@pytest.mark.parametrize("config", ["glm5", "glm5.2", "deepseek-v3.2"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("index_cache", ["replicated", "sharded"])
def test_capacity_rises_with_the_dcp_size(config, kv_dtype, index_cache):
    for t, sizes in ((4, (1, 2, 4)), (8, (1, 2, 4, 8))):
        ratios = [capacity_plan(config, t, n, kv_dtype=kv_dtype, index_cache=index_cache, gpu="b300")
                  .capacity_vs_tp_alone for n in sizes]
        assert ratios[0] == 1 and ratios == sorted(ratios) and len(set(ratios)) == len(ratios), ratios
        assert all(r < n for r, n in zip(ratios[1:], sizes[1:]))  # never more than N: the weights stay


def test_weights_that_do_not_fit_hold_no_tokens():
    plan = capacity_plan("glm5", 4, 2, gpu="h200")  # 188 GB of fp8 weights per rank on a 150 GB GPU
    assert plan.free_bytes_per_rank < 0 and plan.kv_tokens == 0 and plan.capacity_vs_tp_alone is None
    assert dict(plan.rows())["KV tokens per GPU"].startswith("0 (the weights and the reserve do not fit)")


@pytest.mark.parametrize("t, n, words", [
    (6, 4, ["dcp_size 4 must divide tp_size 6", "tp_size 6 must divide the 64 attention heads",
            "the EP size 6", "256 routed experts"]),
    (4, 8, ["dcp_size 8 must divide tp_size 4"]),
    (128, 1, ["tp_size 128 must divide the 64 attention heads"]),
    (512, 2, ["tp_size 512 must divide the 64 attention heads", "the EP size 512", "the 256 routed experts"]),
])
def test_layouts_the_model_cannot_be_split_by_are_refused(t, n, words):
    with pytest.raises(LayoutError) as err:
        capacity_plan("glm5", t, n)
    assert str(err.value).startswith(f"cannot split glm5 at tp {t} with dcp {n}: ")
    for w in words:
        assert w in str(err.value), str(err.value)
    assert layout_problems("deepseek-v3.2", 8, 8) == [] and layout_problems("glm5.2", 4, 4) == []


def _run(argv, code=0):
    out = io.StringIO()
    torch._dynamo.reset()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == code
    return out.getvalue()


def test_cli_capacity_only_prints_the_rows():
    text = _run(["inspect", "glm5.2", "--tp", "4", "--dcp", "4", "--kv-dtype", "fp8", "--gpu", "b300",
                 "--capacity-only", "-q"])
    plan = capacity_plan("glm5.2", 4, 4, kv_dtype="fp8", gpu="b300")
    assert "capacity at tp 4, dcp 4 (from the config's shapes; nothing allocated)" in text
    assert re.search(r"config / layout\s+glm5\.2: tp 4, dcp 4 \(1 DCP group of 4 contiguous TP ranks\), EP 4", text)
    assert re.search(rf"weights per rank\s+{plan.weight_bytes_per_rank:,} B \(190\.00 GB\)", text)
    assert re.search(r"routed experts \(75 layers\)\s+181\.24 GB: EP 4: 64 of 256 experts", text)
    assert re.search(r"replicate_q: wq_b and W_UK of the DCP group's other heads\s+2\.33 GB: 48 more heads", text)
    assert re.search(r"KV bytes per token per rank\s+11,232 \(1/4 of the latent KV", text)
    assert re.search(r"index-key bytes per token per rank\s+2,772 \(replicated on every rank\)", text)
    assert re.search(r"bytes per token per rank\s+14,004 \(fp8 KV\)", text)
    assert re.search(r"GPU memory\s+288\.00 GB \(NVIDIA B300", text)
    assert re.search(r"reserve\s+28\.80 GB \(10% of the GPU memory", text)
    assert re.search(rf"KV tokens per GPU\s+{plan.kv_tokens:,} ", text)
    assert re.search(rf"tp 4 alone\s+{plan.tp_alone_kv_tokens:,} tokens", text)
    assert re.search(rf"capacity vs tp 4 alone\s+{plan.capacity_vs_tp_alone:.2f}x\n", text)
    data = json.loads(_run(["inspect", "glm5.2", "--tp", "4", "--dcp", "4", "--kv-dtype", "fp8", "--gpu", "b300",
                            "--capacity-only", "--format", "json", "-q"]))
    assert data["schema"] == "dsa-dcp-capacity/1" and data["capacity"] == json.loads(json.dumps(plan.as_dict()))
    assert data["memory"]["bytes_per_token_per_rank"] == 14004


@pytest.mark.parametrize("argv, message", [
    (["--tp", "6", "--dcp", "4"], "cannot split glm5 at tp 6 with dcp 4: dcp_size 4 must divide tp_size 6"),
    (["--tp", "4", "--dcp", "8"], "dcp_size 8 must divide tp_size 4"),
    (["--tp", "3", "--dcp", "1"], "tp_size 3 must divide the 64 attention heads of glm5"),
    (["--tp", "0"], "argument --tp: must be an integer >= 1, got 0"),
    (["--dcp", "2", "--gpu", "b300"], "--gpu needs --tp"),
    (["--tp", "4", "--gpu", "a100"], "argument --gpu: must be one of b300, h200 or a memory size in GB > 0"),
    (["--tp", "4", "--reserve-gb", "-1"], "argument --reserve-gb: must be a number >= 0, got -1"),
])
def test_cli_refuses_a_bad_layout_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["inspect", "glm5", *argv, "-q"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
    assert "Traceback" not in err and err.count("error:") == 1


def two_layer_model(dcp_size=1):
    """A ``module:factory``: GLM-5.2-tiny cut to two layers (4 heads, a dense MLP of 64)."""
    cfg = get_config("glm5.2-tiny", n_layers=2)
    inputs, num_slots = decode_step_inputs(cfg, 2, 7, "cpu")
    return DSAModel(cfg, num_slots, dcp_size=dcp_size), inputs


def test_cli_compiled_report_gains_only_the_capacity_section(monkeypatch):
    monkeypatch.chdir(HERE)
    target = "test_capacity:two_layer_model"
    plain = _run(["inspect", target, "--dcp", "2", "-q"])
    with_tp = _run(["inspect", target, "--dcp", "2", "--tp", "4", "--gpu", "80", "--reserve-gb", "8", "-q"])
    # without --tp: the report as before, its weights said to be at tp 1, no capacity section
    assert re.search(r"weight bytes per rank\s+[\d,]+ \(the model's parameters at tp 1; 0 more held", plain)
    assert "capacity at tp" not in plain
    head, section = with_tp.split("\n\ncapacity at tp 4, dcp 2 ", 1)
    assert head + "\n" == plain
    assert section.startswith("(from the config's shapes; nothing allocated; the compiled graph above is not "
                              "TP-sharded)")
    assert re.search(r"MLP \(dense SwiGLU, 2 layers: no published MoE shapes\)\s+[\d.]+ GB: split by 4", section)
    assert re.search(r"GPU memory\s+80\.00 GB \(80 GB, as given\)", section)
    data = json.loads(_run(["inspect", target, "--dcp", "2", "--format", "json", "-q"]))
    assert data["capacity"] is None
    # a model without a DSAConfig has no shapes to count
    with pytest.raises(SystemExit) as exit_:
        _run(["inspect", "test_inspect:make_toy", "--dcp", "2", "--tp", "2", "-q"])
    assert exit_.value.code == 2


def _doc_rows():
    text = pathlib.Path(HERE, "..", "docs", "capacity.md").read_text()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 9 and cells[-1].startswith("`dsa-dcp inspect "):
            yield cells


def test_every_row_of_the_doc_tables_is_what_its_command_prints():
    rows = list(_doc_rows())
    assert len(rows) == 48 + 11
    for cells in rows:
        argv = shlex.split(cells[-1].strip("`"))[1:]
        model, layout, kv, index, weights, per_token, tokens, ratio = cells[:8]
        data = json.loads(_run([*argv, "--format", "json", "-q"]))["capacity"]
        assert (data["config"], f"{data['tp_size']} x {data['dcp_size']}", data["kv_dtype"]) == \
            (model, layout, kv), cells
        assert index == ("-" if data["dcp_size"] == 1 else data["index_cache"]), cells
        assert weights == f"{data['weight_bytes_per_rank'] / GB:.2f} GB", cells
        num = lambda x: f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"
        assert per_token == (f"{num(data['kv_bytes_per_token_per_rank'])} + "
                             f"{num(data['index_bytes_per_token_per_rank'])} = {num(data['bytes_per_token_per_rank'])}")
        assert tokens == f"{data['kv_tokens']:,}", cells
        assert ratio == ("1 (baseline)" if data["dcp_size"] == 1 else f"{data['capacity_vs_tp_alone']:.2f}x"), cells

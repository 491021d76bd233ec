"""What a new user trips on, each answered where it happens: a script that starts ranks at its top
level, a compiled wrapper's ``generate``, and minutes of compiling without a word."""

import subprocess
import sys
import textwrap

import pytest
import torch


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


def test_ranks_started_at_a_scripts_top_level_are_refused_with_the_fix(tmp_path):
    proc = _run(tmp_path, """
        from dsa_dcp.launch import run_on_ranks

        def work(rank, world):
            return rank

        print(run_on_ranks(work, 2))
    """)
    assert proc.returncode != 0
    assert 'outside `if __name__ == "__main__":`' in proc.stderr and "script.py (line 7)" in proc.stderr
    assert len(proc.stderr.splitlines()) < 15  # one traceback, not one per rank


def test_a_compiled_wrappers_generate_names_the_in_place_compile():
    pytest.importorskip("transformers")
    from dsa_dcp.integrations.transformers import DCPStaticCache, left_padded_prompts, tiny_model

    model = tiny_model("glm_moe_dsa", layers=1)
    wrapper = torch.compile(model, backend="dsa_dcp", options={"dcp_size": 2})
    ids, mask = left_padded_prompts([3], model.config.vocab_size)
    cache = DCPStaticCache(model.config, max_cache_len=8, batch_size=1, dcp_size=2)
    with pytest.raises(RuntimeError) as err, torch.no_grad():
        wrapper.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False)
    assert "model.compile(backend='dsa_dcp', options=...)" in str(err.value)
    assert "a compiled wrapper's generate" in str(err.value)


def test_each_compiled_graph_gets_a_line_with_its_time(capfd, monkeypatch):
    from dsa_dcp.models import DSAModel, get_config, standard_test_batch
    from dsa_dcp.models.runner import generate

    monkeypatch.delenv("DSA_DCP_QUIET", raising=False)
    torch._dynamo.reset()
    cfg = get_config("glm5.2-tiny", n_layers=2)
    batch = standard_test_batch(cfg, max_new_tokens=1)
    step = torch.compile(DSAModel(cfg, batch.num_slots), backend="dsa_dcp", options={"lowering": "fx"},
                         fullgraph=True, dynamic=False)
    with torch.no_grad():
        generate(step, batch, 1)
    err = capfd.readouterr().err
    starts = [line for line in err.splitlines() if line.startswith("dsa_dcp: compiling graph")]
    ends = [line for line in err.splitlines() if line.startswith("dsa_dcp: compiled graph")]
    assert starts and len(starts) == len(ends), err[-2000:]
    assert "2 sparse attention layers) for rank 0 of 1, lowering fx" in starts[0]
    assert ends[0].endswith(" s") and " in " in ends[0]
    monkeypatch.setenv("DSA_DCP_QUIET", "1")
    torch._dynamo.reset()
    quiet_cfg = get_config("glm5.2-tiny", n_layers=1)  # what is printed, not the model: one layer to trace
    quiet_batch = standard_test_batch(quiet_cfg, max_new_tokens=1)
    with torch.no_grad():
        generate(torch.compile(DSAModel(quiet_cfg, quiet_batch.num_slots), backend="dsa_dcp",
                               options={"lowering": "fx"}, fullgraph=True, dynamic=False), quiet_batch, 1)
    assert "dsa_dcp: compil" not in capfd.readouterr().err

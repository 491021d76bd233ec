"""Every example script and every Python block of README.md and docs/*.md runs as written.

Examples run at tiny sizes (two layers, two tokens per request): ``one_device.py`` in this
process, ``cpu_ranks.py`` as its own process (as a user starts it: its ranks import it again),
``torchrun_dcp.py`` under ``torchrun`` with two CPU ranks over gloo. A Python block in the docs
runs in a fresh namespace, in a temporary directory. A block that cannot run here is marked by an
HTML comment on the line before it, ``<!-- no-run: why -->`` (invisible in the rendered page,
visible in the source), and is only compiled.
"""

import contextlib
import io
import os
import pathlib
import re
import runpy
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = ["--layers", "2", "--steps", "2"]

# how each example is started here; a new example needs a line (test_every_example_is_run)
COMMANDS = {
    "cpu_ranks.py": [sys.executable, "examples/cpu_ranks.py", "--ranks", "2", *TINY],
    "torchrun_dcp.py": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "examples/torchrun_dcp.py", "--device", "cpu", *TINY],
    "transformers_dcp.py": [sys.executable, "examples/transformers_dcp.py", "--ranks", "2", "--tokens", "2"],
}
IN_PROCESS = {"one_device.py": ["--device", "cpu", *TINY]}

NO_RUN = re.compile(r"<!--\s*no-run:\s*(\S.*?)\s*-->")
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", flags=re.S | re.M)


def _doc_blocks():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = NO_RUN.search(before)
            yield pytest.param(path.relative_to(ROOT).as_posix(), line, textwrap.dedent(m.group(2)),
                               marker.group(1) if marker else None, id=f"{path.relative_to(ROOT)}:{line}")


def test_every_example_is_run():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(COMMANDS) | set(IN_PROCESS)


def test_the_docs_have_python_blocks_to_run():
    blocks = list(_doc_blocks())
    assert len(blocks) >= 4 and sum(b.values[3] is None for b in blocks) >= 4


@pytest.mark.parametrize("name", sorted(IN_PROCESS))
def test_example_runs_in_process(name, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    module = runpy.run_path(str(EXAMPLES / name), run_name="example")  # its __main__ block stays out
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": None}):  # vectorized C++, as users get it (conftest.py)
        assert module["main"](IN_PROCESS[name]) == 0
    out = capsys.readouterr().out
    assert "match eager: True" in out, out
    diff = re.search(r"max \|logit diff\| (\S+)", out)  # the compiled step's logits against eager's
    assert diff and float(diff.group(1)) < 1e-4, out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_example_runs_as_a_script(name):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(COMMANDS[name], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "tokens match the single rank: True" in done.stdout, done.stdout


@pytest.mark.parametrize("doc, line, block, no_run", _doc_blocks())
def test_doc_block(doc, line, block, no_run, monkeypatch, tmp_path):
    code = compile(block, f"{doc}:{line}", "exec")
    if no_run is not None:
        return  # marked `<!-- no-run: why -->`: it must still be valid Python
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__doc_block__"})

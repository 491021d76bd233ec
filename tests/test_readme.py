"""The README's examples run as written."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_decorator_example_compiles_and_runs():
    block = next(b for b in _python_blocks() if "@dsa_dcp.sparse_attention" in b)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), {})
    assert printed.getvalue().strip() == "torch.Size([2, 4, 16])"


def test_usage_example_builds_a_local_cache():
    block = next(b for b in _python_blocks() if "DSAModel(cfg, num_slots=4096, dcp_size=2)" in b)
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert all(c.shape[0] == 2048 for c in scope["model"].kv_caches())


CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def test_quickstart_has_exactly_two_commands():
    commands = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert commands == [f"pip install torch==2.13.0 -e . {CPU_INDEX} && dsa-dcp demo\n",
                        f'pip install torch==2.13.0 -e ".[test]" {CPU_INDEX} && python -m pytest -q\n']
    ci = (README.parent / ".ci" / "run").read_text()
    assert f'pip install -q torch==2.13.0 -e ".[test]" {CPU_INDEX}' in ci and "python -m pytest -q" in ci

"""Every file or folder of this repository that ``README.md`` or a page of ``docs/`` names exists."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
# `path/to/file.py`, `dsa_dcp/passes/`, `tests/test_x.py::test_name`, `docs/ops.md` (in backticks)
QUOTED = re.compile(r"`([A-Za-z0-9_.\-/]+(?:\.(?:py|md|json|toml|txt|sh)|/))(?:::[A-Za-z0-9_\[\]\-]+)?`")
TOP = ("dsa_dcp/", "docs/", "tests/", "examples/", "tools/", ".ci/")
PACKAGE = ("passes/", "kernels/", "lowering/", "models/", "bench/", "inspect/", "inspection/", "integrations/")


def _named(page: pathlib.Path) -> list[str]:
    text = page.read_text()
    names = set()
    for match in QUOTED.finditer(text):
        name = match.group(1)
        if name.startswith(TOP) or name in ("README.md", "pyproject.toml"):
            names.add(name)
        elif name.startswith(PACKAGE):  # written inside the package: `passes/head_shard.py`
            names.add(f"dsa_dcp/{name}")
    return sorted(names)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(page):
    missing = [name for name in _named(page) if not (ROOT / name).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_pages_name_files_at_all():
    assert len(_named(ROOT / "docs" / "architecture.md")) > 10  # the pattern matches what the pages write

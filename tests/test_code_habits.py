"""The code's habits, checked with the tests (so `.ci/run` checks them): ruff finds nothing (its
configuration in pyproject.toml), and the parts' layering of ../shared/DESIGN.md holds, read from
the sources: a part imports only the parts above it in the table (anywhere in a module, deferred
imports included), `dump` knows nothing of `pi0` and `train`, `runs` nothing of `dump`, and
`compare`, `runs` and `report` import no torch when they are imported; native code lives in `.cpp`
files, not Python strings."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = Path(__file__).resolve().parent.parent / "pi0align"
# DESIGN.md's table, top to bottom: a part may import the parts of its row and the rows above.
LAYERS = [("errors", "cache", "native", "version"), ("device",), ("seed", "provenance"), ("pi0",), ("train",),
          ("dump",), ("replay",), ("compare",), ("runs",), ("attach",), ("auditing",), ("bisecting",), ("report",),
          ("cli",)]
RANK = {part: i for i, row in enumerate(LAYERS) for part in row}
KNOWS_NOTHING_OF = {"dump": {"pi0", "train"}, "attach": {"pi0", "train", "compare"},
                    "compare": {"dump.capture", "dump.dumper"}, "runs": {"dump"}}
TORCH_FREE = ("compare", "runs", "report")
# the package's face (`pi0align.curves` names runs.curves' loader), and what tests and benches share
OUTSIDE_THE_TABLE = {"__init__", "__main__", "curves", "testing"}


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _modules() -> dict[str, Path]:
    return {".".join(("pi0align", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
            for path in PACKAGE.rglob("*.py")}


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The modules `path` imports (its own package's, absolute), at module level only when asked."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _part(m) not in OUTSIDE_THE_TABLE))
def test_a_part_imports_only_the_parts_above_it(module):
    part = _part(module)
    assert part in RANK, f"{module}: its part is not in DESIGN.md's table"
    below = sorted(name for name in _imports(MODULES[module]) if name.startswith("pi0align.")
                   and _part(name) in RANK and RANK[_part(name)] > RANK[part])
    assert not below, f"{module} ({part}) imports parts below it: {below}"
    forbidden = KNOWS_NOTHING_OF.get(part, set())
    known = sorted(name for name in _imports(MODULES[module])
                   if any(name == f"pi0align.{f}" or name.startswith(f"pi0align.{f}.") for f in forbidden))
    assert not known, f"{module} ({part}) must know nothing of {sorted(forbidden)}: imports {known}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "pi0align"))
def test_nothing_inside_the_package_imports_its_root(module):
    """The package root is the face (lazy names for users): a part that imported it would put it at
    the bottom of the import graph, where the layering test cannot see it."""
    assert "pi0align" not in _imports(MODULES[module]), f"{module} imports the package root"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _part(m) in TORCH_FREE))
def test_compare_and_report_import_no_torch_at_module_level(module):
    torch = sorted(name for name in _imports(MODULES[module], top_level_only=True)
                   if name == "torch" or name.startswith("torch."))
    assert not torch, f"{module} imports torch when imported: {torch}"


def test_nothing_in_the_parts_imports_the_test_helpers():
    users = sorted(m for m in MODULES if _part(m) not in OUTSIDE_THE_TABLE
                   and any(name.startswith("pi0align.testing") for name in _imports(MODULES[m])))
    assert not users, f"parts importing pi0align.testing: {users}"


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_native_code_lives_in_source_files():
    """No C or C++ in a Python string: native sources are `csrc/*.cpp` files, compiled where they lie."""
    pattern = re.compile(r'^\s*#\s*include\s*[<"]', re.MULTILINE)
    holders = sorted(str(path.relative_to(REPO)) for folder in ("pi0align", "tests", "bench", "scripts")
                     for path in (REPO / folder).rglob("*.py") if pattern.search(path.read_text()))
    assert not holders, f"C/C++ inside Python files: {holders}"

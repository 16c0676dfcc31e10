"""The code's habits, checked with the tests (so `.ci/run` checks them): ruff finds nothing (its
configuration in pyproject.toml), and the parts' layering of ../shared/DESIGN.md holds, read from
the sources: a part imports only the parts above it in the table (anywhere in a module, deferred
imports included), `dump` knows nothing of `pi0` and `train`, `runs` nothing of `dump`, and
`compare`, `runs` and `report` import no torch when they are imported; the import graph has no
circle (package `__init__`s and deferred imports included), `compare`'s stages import only the
stages before them, no function in `compare` is longer than a screen; native code lives in `.cpp`
files, not Python strings."""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = Path(__file__).resolve().parent.parent / "pi0align"
# DESIGN.md's table, top to bottom: a part may import the parts of its row and the rows above.
LAYERS = [("errors", "cache", "native", "version"), ("device",), ("seed", "provenance", "clipping"), ("pi0",),
          ("train",), ("dump",), ("replay",), ("compare",), ("runs",), ("attach",), ("auditing",), ("bisecting",),
          ("report",), ("cli",)]
RANK = {part: i for i, row in enumerate(LAYERS) for part in row}
KNOWS_NOTHING_OF = {"dump": {"pi0", "train"}, "attach": {"pi0", "train", "compare"},
                    "compare": {"dump.capturing", "dump.dumper"}, "runs": {"dump"}}
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


def _module_imports(path: Path) -> set[str]:
    """The package's modules `path` imports anywhere in it: `from a.b import c` imports a.b.c where
    that is a module, else a.b (c a name inside it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                found.update([inner] if inner in MODULES else [node.module] if node.module in MODULES else [])
    return found


# compare's stages, in the order the data flow through them: a module imports only its own stage
# and those before it (the base: the typed values every stage passes on)
COMPARE_STAGES = {"table": 0, "rowstore": 0, "result": 0, "reading": 1, "measuring": 2, "judging": 3,
                  "conclusion": 4, "windows": 4, "engine": 5, "calibrate": 6, "__init__": 7}
LONGEST_FUNCTION = 80  # lines: one screen


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


def test_the_import_graph_has_no_circle():
    graph = graphlib.TopologicalSorter({module: _module_imports(path) - {module} for module, path in MODULES.items()})
    try:
        graph.prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"an import circle: {' -> '.join(error.args[1])}")


def _compare_stage(module: str) -> int:
    parts = module.split(".")
    return COMPARE_STAGES[parts[2] if len(parts) > 2 else "__init__"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _part(m) == "compare"))
def test_a_compare_stage_imports_only_the_stages_before_it(module):
    later = sorted(name for name in _module_imports(MODULES[module])
                   if _part(name) == "compare" and _compare_stage(name) > _compare_stage(module))
    assert not later, f"{module} imports later stages: {later}"


def test_no_function_in_compare_is_longer_than_a_screen():
    long = [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in (PACKAGE / "compare").rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION]
    assert not long, long


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


def test_help_imports_only_the_command_line():
    """`pi0align --help` answers at once: it imports the command table and nothing a command needs."""
    script = ("import sys\nfrom pi0align.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
              "    pass\nprint(sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names"
              " and not m.startswith('_')))")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == str(["pi0align", "pi0align.cli", "pi0align.cli.main", "pi0align.errors",
                                               "pi0align.version"])

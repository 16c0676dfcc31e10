"""Shared test setup: offline, a per-session cache for generated artifacts, and a CLI runner."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Nothing in the tests may reach the network, and CPU runs are bit-reproducible at a fixed thread count.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "2")
# The tests run one worker per core (pyproject's addopts), so torch's threads share the cores with
# another worker's: OpenMP threads that spin while they wait take the cores from the ones working
# (the default job ran 30 % slower beside a busy core). Waiting asleep changes no result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session", autouse=True)
def artifact_cache(tmp_path_factory) -> Path:
    """One cache (synthetic dataset, generated tokenizers) for the whole session, shared with
    subprocesses. The native builds of this machine's cache (scripts/install.sh makes them) come
    along: each is named by a hash of its sources, flags, compiler and CPU, so it is what the
    session would build."""
    from pi0align.cache import cache_root

    built = cache_root() / "kernels"
    cache = tmp_path_factory.mktemp("pi0align-cache")
    if built.is_dir():
        shutil.copytree(built, cache / "kernels", ignore=shutil.ignore_patterns("tmp*"))
    os.environ["PI0ALIGN_CACHE"] = str(cache)
    return cache


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked slow run in CI (`CI` set, as `.ci/run` does), not in a local run."""
    if os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason="slow: runs in CI (set CI=true to run it here)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def without_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel libraries loaded from now on fail to build, as on a machine without a C++ compiler."""
    monkeypatch.setenv("PI0ALIGN_CACHE", str(tmp_path / "cache-without-compiler"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`pi0align ARGS` in a fresh process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "pi0align.cli.main", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})},
    )


def run_clis(*commands: tuple) -> list[subprocess.CompletedProcess]:
    """Independent `pi0align` commands at once, as many as there are cores (each run is mostly one
    thread: a fixture's runs take half the time on two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda command: run_cli(*command), commands))


def pi0align(*args) -> tuple[int, str]:
    """`pi0align ARGS` in this process, for the torch-free commands, which are fast: exit code, stderr."""
    from pi0align.cli.main import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    return code, stderr.getvalue()


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, exit_code: int = 2) -> None:
    """Bad input: the given exit code, no traceback, and one `error:` line naming what is wrong."""
    assert result.returncode == exit_code, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


@pytest.fixture(scope="module", params=["native", "torch"])
def backend(request) -> str:
    """The dump backend a guarantee test runs on: each runs on both; native is skipped, with the
    compiler's reason, where its extension cannot be built."""
    if request.param == "native":
        require_native()
    return request.param


def require_native():
    """The native dump backend, or skip the test with the reason it cannot be built here."""
    from pi0align.dump.backends.native_backend import NativeBackend

    loaded = NativeBackend.load()
    if isinstance(loaded, str):
        pytest.skip(f"the native dump backend cannot be built here: {loaded}")
    return loaded


CHROMIUM = "/usr/bin/chromium"  # Debian's (scripts/install.sh test): playwright must not download one
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through playwright; skipped where it is missing, except in CI."""
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing: apt-get install -y chromium"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@contextlib.contextmanager
def offline_page(browser, page_file: Path):
    """`page_file` opened in a fresh browser context that may load `file:` URLs only; after the
    block, nothing else was asked for and no script of the page failed."""
    context = browser.new_context()
    blocked, errors = [], []
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else (
        blocked.append(route.request.url), route.abort()))
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(page_file.as_uri())
    yield page
    context.close()
    assert blocked == [] and errors == []

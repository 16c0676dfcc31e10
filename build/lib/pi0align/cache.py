"""Generated artifacts (the synthetic dataset, small tokenizers) built once per machine and reused.

Location: $PI0ALIGN_CACHE, else ~/.cache/pi0align. Built in a temporary folder and renamed into
place, so concurrent runs never see a half-written folder.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PI0ALIGN_CACHE") or Path.home() / ".cache" / "pi0align")


def cached_folder(name: str, build: Callable[[Path], object]) -> Path:
    """`cache_root()/name`, built by `build(folder)` the first time it is asked for."""
    final = cache_root() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    build(staging)
    try:
        staging.rename(final)
    except OSError:  # another process finished first: keep its folder
        shutil.rmtree(staging, ignore_errors=True)
    return final

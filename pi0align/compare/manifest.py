"""Coarse alignment: how the two runs' manifests differ, and what that means."""

from __future__ import annotations

from typing import Any

# key -> note when it differs: these make the runs incomparable call by call.
_MEANING = {
    "weights_sha256": "initial weights differ (weights_sha256)",
    "seed": "seeds differ",
    "dataset_fingerprint": "datasets differ (dataset_fingerprint)",
    "world_size": "world sizes differ",
}


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def manifest_diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every key whose values differ; absent = None."""
    fa, fb = flatten(a), flatten(b)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def manifest_notes(diff: list[tuple[str, Any, Any]]) -> list[str]:
    notes = []
    for key, va, vb in diff:
        if key in _MEANING and va is not None and vb is not None:
            notes.append(f"{_MEANING[key]}: {va!s:.16} vs {vb!s:.16}")
    return notes

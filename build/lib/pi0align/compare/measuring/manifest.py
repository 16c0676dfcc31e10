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


def numerics_notes(a: dict, b: dict) -> list[str]:
    """What each accelerator run's numerics switches do to float32 (TF32 / HF32): expected
    differences from a run without them, not bugs."""
    notes = []
    for side, manifest in (("A", a), ("B", b)):
        device, switches = manifest.get("device"), manifest.get("numerics") or {}
        if device == "cuda" and switches.get("cudnn_allow_tf32"):
            notes.append(f"{side} ran on cuda with torch.backends.cudnn.allow_tf32 = True (PyTorch's default): "
                         "cuDNN may compute float32 convolutions on TF32 inputs (SigLIP's patch embedding is one); "
                         "set it False to compare float32 with float32")
        if device == "cuda" and switches.get("cuda_matmul_allow_tf32"):
            notes.append(f"{side} ran on cuda with torch.backends.cuda.matmul.allow_tf32 = True: float32 matmuls "
                         "on TF32 inputs")
        if device == "npu" and (switches.get("npu_matmul_allow_hf32") or switches.get("npu_conv_allow_hf32")):
            notes.append(f"{side} ran on npu with HF32 allowed (torch.npu.matmul/conv.allow_hf32): float32 "
                         "matmuls or convolutions on HF32 inputs")
    return notes


def host_cpus_differ(diff: list[tuple[str, Any, Any]]) -> bool:
    """The runs' host CPUs compute otherwise (their architecture, model, torch's code path or BLAS:
    the manifests' `cpu`): what they draw at random rounds otherwise."""
    return any(key.startswith("cpu.") for key, _, _ in diff)


def weights_comparable(diff: list[tuple[str, Any, Any]]) -> bool:
    """Whether the manifests' weights hashes can tell the initial weights apart: taken in the same
    dtype (the same weights in fp32 and cast to bf16 hash apart), drawn by the same host CPU (one
    seed's random weights round otherwise in another CPU's kernels)."""
    return not any(key == "dtype" for key, _, _ in diff) and not host_cpus_differ(diff)


def same_initial_weights(diff: list[tuple[str, Any, Any]], a: dict, b: dict) -> bool:
    """Both manifests hash their initial weights, in the same dtype, and the hashes agree: the runs
    started from the same weights."""
    return (weights_comparable(diff) and None not in (a.get("weights_sha256"), b.get("weights_sha256"))
            and not any(key == "weights_sha256" for key, _, _ in diff))


def manifest_notes(diff: list[tuple[str, Any, Any]]) -> list[str]:
    notes = []
    for key, va, vb in diff:
        if key == "dtype":
            notes.append(f"the runs differ in dtype ({va} in A, {vb} in B): each pair is judged at the looser "
                         "dtype's limits, and the initial weights by their values, not their hashes")

        elif key in _MEANING and va is not None and vb is not None and (key != "weights_sha256"
                                                                           or weights_comparable(diff)):
            notes.append(f"{_MEANING[key]}: {va!s:.16} vs {vb!s:.16}")
    host = [f"{key.removeprefix('cpu.')} {va} in A, {vb} in B" for key, va, vb in diff if key.startswith("cpu.")]
    if host:
        notes.append(f"the runs' host CPUs compute otherwise ({'; '.join(host)}): their kernels round otherwise, "
                     "random draws included (PI0's noise, random initial weights), so no call is held to "
                     "bit-equality, and the initial weights are judged by their values, not their hashes")
    return notes

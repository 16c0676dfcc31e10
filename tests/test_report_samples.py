"""Hand-built Comparisons for the renderer tests (no tests here: the builder the report tests share).

Built by hand, not through compare_dumps, so that each renderer is tested on exactly known data:
a culprit with a known name, module and stack, one record on one side only, a manifest difference.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from pi0align.compare.result import ROW_COLUMNS, CallRef, Comparison, Culprit, CulpritGroup

CULPRIT_MODULE = "model.layers.2.mlp"
CULPRIT_NAME = f"{CULPRIT_MODULE}/Functional.gelu#0"
CULPRIT_STACK = ["train.py:88 train_step", "modeling_pi0.py:412 forward", "gemma.py:131 forward"]
BACKWARD_NAME = "model.layers.3.mlp/Functional.linear#1"
EXTRA_NAME = "model.layers.0.mlp/Tensor.contiguous#0"
GROUP_HINT = "most calls of Functional.linear introduce error: its kernel differs on one side"
THRESHOLDS = {"float32": {"rel_l2_err": 1e-5, "cosine": 0.99999}, "bfloat16": {"rel_l2_err": 8e-3, "cosine": 0.999}}


def sample_rows(n_steps: int, calls_per_step: int, *, diverged: bool) -> pd.DataFrame:
    """Per step, forward calls (an input and an output record each) cycling through 4 layers.

    In a diverged comparison, from the culprit (layer 2's gelu, step 0) on, records carry an
    error of 1e-3 (fail); before it, 1e-8 (pass).
    """
    records = []
    for step in range(n_steps):
        diverged_yet = False
        for call in range(calls_per_step):
            layer, kind = divmod(call, 2)
            module = f"model.layers.{layer % 4}.mlp"
            api = "Functional.gelu" if kind else "Functional.linear"
            name = f"{module}/{api}#{layer // 4}"
            is_culprit = diverged and step == 0 and name == CULPRIT_NAME
            error_in = 1e-3 if diverged_yet else 1e-8
            diverged_yet = diverged_yet or is_culprit
            error_out = 1e-3 if diverged_yet else 1e-8
            for role, error in (("input", error_in), ("output", error_out)):
                records.append({
                    "step": step, "seq_a": call, "seq_b": call, "name": name, "module": module, "api": api,
                    "direction": "forward", "role": role, "arg_index": 0,
                    "dtype_a": "float32", "dtype_b": "float32", "shape_a": "[4, 8]", "shape_b": "[4, 8]",
                    "pairing": "matched", "evidence": "tensor",
                    "cosine": 1 - error, "max_abs_err": 3 * error, "max_rel_err": 10 * error, "mean_rel_err": error,
                    "rel_l2_err": error, "rmse": error / 2, "within_1e-3": 1.0 if error < 1e-3 else 0.5,
                    "within_5e-3": 1.0, "nan_inf_mismatch": 0.0,
                    "min_rel_err": error, "max_val_rel_err": error, "mean_val_rel_err": error, "norm_rel_err": error,
                    "verdict": "fail" if error > 1e-5 else "pass",
                    "introduced_error": math.nan if role == "input" else error / error_in,
                    "stack": CULPRIT_STACK[-1] if name == CULPRIT_NAME else f"gemma.py:{100 + call} forward",
                    "rank": 0, "severity": error / THRESHOLDS["float32"]["rel_l2_err"],
                })
    extra = dict(records[0], seq_a=pd.NA, seq_b=1000, name=EXTRA_NAME, api="Tensor.contiguous", pairing="only_b",
                 evidence="tensor", verdict="n/a", introduced_error=math.nan, stack="", severity=math.nan)
    for metric in ("cosine", "max_abs_err", "max_rel_err", "mean_rel_err", "rel_l2_err", "rmse", "within_1e-3",
                   "within_5e-3", "nan_inf_mismatch", "min_rel_err", "max_val_rel_err", "mean_val_rel_err",
                   "norm_rel_err"):
        extra[metric] = math.nan
    records.append(extra)
    rows = pd.DataFrame.from_records(records, columns=ROW_COLUMNS)
    for column in ("seq_a", "seq_b", "arg_index", "step", "rank"):
        rows[column] = rows[column].astype("Int64")
    return rows


def sample_comparison(*, diverged: bool = True, n_steps: int = 2, calls_per_step: int = 16) -> Comparison:
    rows = sample_rows(n_steps, calls_per_step, diverged=diverged)
    culprits = []
    if diverged:
        culprits = [
            Culprit(step=0, name=CULPRIT_NAME, module=CULPRIT_MODULE, api="Functional.gelu", direction="forward",
                    stack=CULPRIT_STACK, introduced_error=1e5, input_error=1e-8, output_error=1e-3),
            Culprit(step=0, name="model.layers.3.mlp/Functional.linear#0", module="model.layers.3.mlp",
                    api="Functional.linear", direction="forward", stack=["gemma.py:106 forward"],
                    introduced_error=1.0, input_error=1e-3, output_error=1e-3),
        ]
    first = CallRef(step=0, name=CULPRIT_NAME, module=CULPRIT_MODULE, api="Functional.gelu", direction="forward",
                    stack=CULPRIT_STACK) if diverged else None
    first_backward = CallRef(step=0, name=BACKWARD_NAME, module="model.layers.3.mlp", api="Functional.linear",
                             direction="backward", stack=["gemma.py:106 forward"]) if diverged else None
    steps = np.arange(10)
    metrics_a = pd.DataFrame({"step": steps, "loss": 2.0 / (1 + steps), "grad_norm": 1.0 + 0 * steps,
                              "lr": 1e-4 + 0 * steps})
    metrics_b = metrics_a.assign(loss=metrics_a["loss"] * (1.01 if diverged else 1.0))
    return Comparison(
        verdict="diverged" if diverged else "aligned",
        rows=rows,
        coverage={"matched": int((rows["pairing"] == "matched").sum()), "only_a": 0, "only_b": 1},
        first_divergence=first,
        culprits=culprits,
        thresholds=THRESHOLDS,
        source_a="dumps/gpu/dump.h5",
        source_b="dumps/npu/dump.h5",
        metrics_a=metrics_a,
        metrics_b=metrics_b,
        manifest_diff=[("device", "cuda", "npu"), ("versions.torch_npu", None, "2.5.1")],
        notes=["sample note: initial weights agree"] if diverged else [],
        first_divergence_backward=first_backward,
        culprit_groups=[
            CulpritGroup(kind="call", api="Functional.gelu", count=1, calls=8, share_introducing=0.125,
                         median_ratio=1e5, median_output_error=1e-3, examples=[CULPRIT_NAME]),
            CulpritGroup(kind="call", api="matmul family", count=1, calls=8, share_introducing=0.5,
                         median_ratio=1.0, median_output_error=1e-3, hint=GROUP_HINT,
                         examples=["model.layers.3.mlp/Functional.linear#0"]),
        ] if diverged else [],
    )

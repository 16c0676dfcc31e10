"""Gradients at rounding level, and the parameters they drive.

Some gradients are zero in exact arithmetic and pure rounding noise in floating point -- the
bias of attention keys is the classic case (softmax ignores a constant shift). Two runs then
disagree completely on them although neither is wrong, and Adam turns that noise into
lr-sized updates, so the parameter and every later use of it disagree too. Such records are
judged `warn`, never `fail`, and named in a note: they cannot indicate a faulty kernel.

A gradient is at rounding level when, on both sides, its norm is below the dtype's relative limit
times the largest gradient of its context (the other gradients of the same backward call; for a
parameter gradient, the other parameter gradients of the module): rounding alone produces
errors of that size.
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.records import subjects
from pi0align.compare.table import Groups, Table, gather, isin, lookup
from pi0align.compare.thresholds import looser_classes

_GRADIENT_ROLES = ("grad_input", "grad_output")


def noise_driven(rows: Table, thresholds: dict) -> tuple[np.ndarray, list[str]]:
    """Mask of failing rows that only follow rounding noise, and a note about them."""
    limit = np.array([thresholds[c]["rel_l2_err"] if c else 0.0
                      for c in looser_classes(rows["dtype_a"], rows["dtype_b"]).tolist()])
    role, rank, step = rows["role"], rows["rank"], rows["step"]
    backward = (rows["direction"] == "backward") & isin(role, _GRADIENT_ROLES)
    parameter_grad = role == "parameter_grad"
    norm_a = rows["norm_a"].astype(np.float64)
    reference = np.zeros(len(rows))
    for mask, context in ((backward, rows["seq_a"]), (parameter_grad, rows["module"])):
        groups = Groups(rank[mask], step[mask], context[mask])
        reference[mask] = groups.max(np.where(np.isnan(norm_a[mask]), 0.0, norm_a[mask]))[groups.codes]
    floor = limit * reference
    with np.errstate(invalid="ignore"):
        tiny = (norm_a < floor) & (rows["norm_b"].astype(np.float64) < floor)
    rounding = tiny & (backward | parameter_grad) & (role != "grad_output")
    failing = rows["verdict"] == "fail"
    driven = rounding & failing

    # parameters updated from a rounding-level gradient at this or an earlier step (their optimizer
    # updates from then on, and the parameters after them), and their uses
    noisy = rounding & parameter_grad
    parameter = subjects(rows["name"])
    noisy_parameters = Groups(rank[noisy], parameter[noisy])
    first_noisy_step = noisy_parameters.min(step[noisy].astype(np.float64))
    keys = [rank[noisy][noisy_parameters.first], parameter[noisy][noisy_parameters.first]]
    since = gather(first_noisy_step, lookup([rank, parameter], keys), np.nan)  # NaN: never noisy
    updated = (step.astype(np.float64) >= np.nan_to_num(since, nan=np.inf)) & (rows["direction"] == "optimizer")
    params = (role == "parameter") & failing
    params &= step.astype(np.float64) >= np.nan_to_num(since, nan=np.inf)
    driven |= updated & failing
    driven |= params
    checksums = rows["checksum_a"].astype(np.int64)
    same_tensor = set(zip(rank[params].tolist(), step[params].tolist(), checksums[params].tolist()))
    if same_tensor:
        uses = np.array([c != -1 and (r, s, c) in same_tensor for r, s, c in
                         zip(rank.tolist(), step.tolist(), checksums.tolist())], bool)
        driven |= uses & failing
    if not driven.any():
        return driven, []
    names = sorted(set(rows["name"][driven].tolist()))
    note = (f"{int(driven.sum())} failing records only follow rounding noise (gradients that are zero in exact "
            f"arithmetic, the parameters they update, and their uses); judged warn: {', '.join(names[:3])}"
            + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
    return driven, [note]

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
import pandas as pd

from pi0align.compare.thresholds import looser_classes

_GRADIENT_ROLES = ("grad_input", "grad_output")


def noise_driven(rows: pd.DataFrame, thresholds: dict) -> tuple[np.ndarray, list[str]]:
    """Mask of failing rows that only follow rounding noise, and a note about them."""
    limit = np.array([thresholds[c]["rel_l2_err"] if c else 0.0
                      for c in looser_classes(rows["dtype_a"], rows["dtype_b"]).tolist()])
    backward = rows["direction"].eq("backward") & rows["role"].isin(_GRADIENT_ROLES)
    parameter_grad = rows["role"].eq("parameter_grad")
    reference = np.zeros(len(rows))
    for mask, keys in ((backward, ["rank", "step", "seq_a"]), (parameter_grad, ["rank", "step", "module"])):
        grouped = rows.loc[mask, keys].assign(norm=rows.loc[mask, "norm_a"].fillna(0.0))
        reference[mask.to_numpy()] = grouped.groupby(keys, dropna=False)["norm"].transform("max").to_numpy()
    floor = limit * reference
    with np.errstate(invalid="ignore"):
        tiny = (rows["norm_a"].to_numpy(np.float64) < floor) & (rows["norm_b"].to_numpy(np.float64) < floor)
    rounding = tiny & (backward | parameter_grad).to_numpy() & rows["role"].ne("grad_output").to_numpy()
    failing = rows["verdict"].eq("fail").to_numpy()
    driven = rounding & failing

    # parameters updated from a rounding-level gradient at this or an earlier step, and their uses
    noisy = rows.loc[rounding & parameter_grad.to_numpy(), ["rank", "name", "step"]]
    first_noisy = noisy.groupby(["rank", "name"])["step"].min()
    params = rows["role"].eq("parameter").to_numpy() & failing
    since = pd.MultiIndex.from_frame(rows[["rank", "name"]]).map(first_noisy.to_dict()).to_numpy(np.float64) \
        if len(first_noisy) else np.full(len(rows), np.nan)
    params &= rows["step"].to_numpy(np.float64) >= np.nan_to_num(since, nan=np.inf)
    driven |= params
    checksums = rows["checksum_a"].to_numpy(np.int64)
    same_tensor = set(zip(rows["rank"].to_numpy()[params], rows["step"].to_numpy()[params], checksums[params]))
    if same_tensor:
        uses = np.array([c != -1 and (r, s, c) in same_tensor for r, s, c in
                         zip(rows["rank"].to_numpy(), rows["step"].to_numpy(), checksums)])
        driven |= uses & failing
    if not driven.any():
        return driven, []
    names = sorted(set(rows["name"].to_numpy()[driven]))
    note = (f"{int(driven.sum())} failing records only follow rounding noise (gradients that are zero in exact "
            f"arithmetic, the parameters they update, and their uses); judged warn: {', '.join(names[:3])}"
            + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
    return driven, [note]

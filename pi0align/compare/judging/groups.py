"""Culprits grouped by kind and API (the matmul family as one): a pattern across calls is one finding.

Each group counts its culprits and its API's calls, the share of those calls that introduce error
(more error out than in, outputs failing), the median blame of its culprits, and a hint where the
pattern is a known one (docs/compare.md, "Culprit groups").
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.compare.reading.records import subjects
from pi0align.compare.result import CulpritGroup
from pi0align.compare.table import Coded, Table, key_codes, recoded, row_of_each
from pi0align.dump.file_format import OPTIMIZER_API, RANDOM_FUNCTIONS

# APIs whose kernels multiply matrices: TF32 / HF32 switches change all of them at once
MATMUL_FAMILY = frozenset({"linear", "matmul", "__matmul__", "__rmatmul__", "bmm", "mm", "addmm", "addbmm", "baddbmm",
                           "einsum", "mv", "tensordot", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                           "conv_transpose2d", "conv_transpose3d", "scaled_dot_product_attention"})
SYSTEMATIC_SHARE = 0.5  # most of an API's calls introduce error: its kernel, not one call
TF32_ERRORS = (1e-5, 1e-2)  # TF32 keeps 10 mantissa bits: a matmul's error ~1e-4 .. 1e-3


def family(api: str, kind: str = "call") -> str:
    """The group a culprit joins: "matmul family" for the matmul-like kernels, "Optimizer.step" for
    the optimizer's updates (recorded, or stood for by the parameters they made), else its API."""
    if kind == "optimizer":
        return OPTIMIZER_API
    return "matmul family" if api.rsplit(".", 1)[-1] in MATMUL_FAMILY else api


def _families(calls: Table) -> Coded:
    """Each call's `family`, found once per distinct API and kind."""
    return recoded(lambda api, kind: family(str(api), kind), calls.coded("api"), calls.coded("kind"))


def family_counts(calls: Table, counts: dict[tuple[str, str], tuple[int, int]] | None = None
                  ) -> dict[tuple[str, str], tuple[int, int]]:
    """(kind, family) -> (judged calls, of which introduce error: outputs failing, more error out
    than in), added to `counts` where given (the calls of other steps)."""
    counts = dict(counts or {})
    families = _families(calls)
    key, count = key_codes(calls.coded("kind"), families)
    introduces = calls["outputs_fail"] & (calls["introduced_error"] > 1)
    one = row_of_each(key, count)
    for kind, name, calls_of_key, introducing_of_key in zip(
            calls["kind"][one].tolist(), families.take(one).values.tolist(),
            np.bincount(key, minlength=count).tolist(), np.bincount(key, introduces, minlength=count).tolist()):
        total, introducing = counts.get((kind, name), (0, 0))
        counts[(kind, name)] = (total + calls_of_key, introducing + int(introducing_of_key))
    return counts


def culprit_groups(guilty: Table, blame: np.ndarray, counts: dict[tuple[str, str], tuple[int, int]],
                   hyper_parameters: list[tuple[str, object, object]]) -> list[CulpritGroup]:
    """The groups in the order of their first culprit (`guilty`: the culprits' calls in
    culprits.culprit_order, earliest step, then the step's phase, most blame first, with their
    `blame`), most culprits first among equals: the finding that parted the runs first leads.
    counts: `family_counts` of every judged call; hyper_parameters: the optimizer settings that differ."""
    if not len(guilty):
        return []
    families = _families(guilty).values
    groups, first = [], []
    for kind, api in sorted(set(zip(guilty["kind"].tolist(), families.tolist()))):
        members = np.flatnonzero((guilty["kind"] == kind) & (families == api))
        total, introducing = counts[(kind, api)]
        share = introducing / total
        unit = float(np.max(np.maximum(guilty["unit_a"][members], guilty["unit_b"][members])))
        typical_error = float(np.median(guilty["output_error"][members]))
        names = guilty["name"][members].tolist()
        unrecorded = sorted({(int(p), int(s)) for p, s in zip(guilty["previous_step"][members].tolist(),
                                                               guilty["step"][members].tolist()) if p >= 0})
        first.append(int(members[0]))
        groups.append(CulpritGroup(
            kind=kind, api=api, count=len(members), calls=total, share_introducing=share,
            median_ratio=float(np.median(blame[members])), median_output_error=typical_error,
            hint=hint(kind, api, share, total, unit, typical_error, hyper_parameters, names, unrecorded,
                      in_step=bool((guilty["direction"][members] == "in_optimizer").any())),
            examples=list(dict.fromkeys(names))[:3]))
    return [group for _, _, group in sorted(zip(first, (-g.count for g in groups), groups), key=lambda t: t[:2])]


def hint(kind: str, api: str, share: float, calls: int, unit: float, typical_error: float,
         hyper_parameters: list[tuple[str, object, object]], names: list[str],
         unrecorded: list[tuple[int, int]] = (), in_step: bool = False) -> str:
    """What a known pattern usually means ("" when the group is not one); `names`: its culprits';
    `unrecorded`: the (step, next dumped step) pairs whose updates were not recorded; `in_step`:
    culprits among them ran inside the optimizer's step (its arithmetic, recorded op by op)."""
    systematic = share >= SYSTEMATIC_SHARE and calls >= 2
    if kind == "call":
        if api == "matmul family" and systematic and unit == UNIT_ROUNDOFF["float32"] \
                and TF32_ERRORS[0] <= typical_error <= TF32_ERRORS[1]:
            return ("every matmul-family call is off by ~1e-3 in fp32: TF32 or HF32 is on for one side "
                    "(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, "
                    "torch.npu.matmul.allow_hf32; the manifests' numerics)")
        if systematic:
            return (f"most calls of {api} introduce error: its kernel differs on one side (implementation, "
                    "precision mode), not one call site")
        return ""
    if kind == "optimizer" and in_step:
        return (f"the optimizer's update differs: its arithmetic inside optimizer.step() ({names[0]}) parts "
                "while what it read agrees: compare the optimizers' settings (lr, betas, eps, weight_decay) and "
                "implementations (fused, foreach)")
    if kind == "optimizer" and unrecorded:
        between = ", ".join(f"step {a} and {b}" for a, b in unrecorded)
        gap = any(b - a > 1 for a, b in unrecorded)
        return (f"the parameters part between {between} while they and their gradients agreed before: the "
                "optimizer's update differs (its hyper-parameters or implementation"
                + (", or the steps that were not dumped" if gap else "") + "); it was not recorded: pass "
                "optimizer= to Dumper.start to see its states and hyper-parameters")
    if kind == "optimizer":
        if hyper_parameters:
            listed = ", ".join(f"{key} {a!r} in A, {b!r} in B" for key, a, b in hyper_parameters)
            return f"the optimizer's hyper-parameters differ: {listed}"
        if systematic:
            return ("every parameter's update differs while its gradients agree: the optimizer's hyper-parameters "
                    "or its implementation (fused or foreach AdamW, the order of its operations)")
        return "these parameters' updates differ while their gradients agree"
    if kind == "data" and api.rpartition(".")[2] in RANDOM_FUNCTIONS:
        return (f"a random draw ({api}) differs beyond the rounding of its transform: drawn from another generator "
                "state (another seed, or another draw before it: an extra random call, dropout left on, a data "
                "loader's workers), not two hosts' kernels")
    keys = ", ".join(dict.fromkeys(subjects(np.array(names, dtype=object)).tolist()))
    return {
        "data": f"the batch differs ({keys}) while the parameters agree: data order (sampler seed, shuffling), "
                "preprocessing, or the dataset itself (the manifests' dataset_fingerprint)",
        "initial_weights": "the runs start from other weights: another seed, checkpoint or initialisation "
                           "(the manifests' seed and weights_sha256)",
        "parameters": "parameters differ where nothing dumped changed them: the updates before the first dumped "
                      "step (dump from step 0 to see them), a checkpoint loaded, weights written in place outside "
                      "the optimizer",
        "gradient": f"parameters' gradients ({keys}) differ beyond what the backward calls that computed them "
                    "explain: gradient accumulation, all-reduce, a hook on the gradient, or a backward operation "
                    "that was not dumped",
    }.get(kind, "")

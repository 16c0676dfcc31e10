"""Which calls introduce error beyond the hardware's noise: the noise models (docs/compare.md,
"Noise models" and "Bounds").

* `replay`: both sides' results replayed in float64 from their own inputs (measuring/replayed.py).
  Side X is wrong when its local error e_X exceeds RATIO × e_other + F × u_X (u_X: unit roundoff
  of X's result dtype) -- torch dynamo's `same()` (RMSE against fp64 within 2×, 3× in half
  precision, of the eager result's) and msprobe's benchmark standard (RMSE ratio ≤ 2), with the
  noise floor of bounds.py so that two kernels both within rounding are never told apart.
* `reference`: a noise reference (A re-run with every result moved by an ulp) raises each
  record's limits to how far this model carries rounding to it (reference.py); a call is then a
  culprit when it is beyond its bound (bounds.py) under those limits and stands out.
* `intrinsic`: the same rule under the fixed dtype limits.
* `exact`: where the runs are bit-comparable (`bit_comparable`), a call handed identical inputs
  whose output bits differ is a culprit too, however small the difference.

A kernel is beyond its bound when more error leaves it than its inputs, through its API's
condition, and its own rounding explain, whatever its inputs hold; it must also stand out from
what calls of the same API introduce elsewhere (a multiple of their median, STANDOUT, by the
measure it was judged by), unless its API is off as a family (`family_off`). Downstream of the
first culprit, a call judged by statistics is blamed by its bits alone (statistics hide what a
LayerNorm's output holds, and the next call seems to amplify it). A module holding calls is
judged by what entered it from no dumped call.

The optimizer's update (kind `optimizer`) is judged as a whole: Adam's update is scale-free, so an
element whose gradient is rounding noise moves by the learning rate either way. An update is a
culprit when it moved its parameter further than one step of its optimizer can (bounds.step_bounds),
or when it introduces more than OPTIMIZER_GAIN (Adam squares the gradient) and either its inputs
hold the same bits on both sides or the step's typical update does so too (`updates_off`: another
epsilon, another formula changes every update). The data are culprits whenever they fail (they are
read, not computed); parameters and parameters' gradients when they are beyond their bounds.
Whatever the evidence, a call whose outputs fail and whose recorded non-tensor arguments differ
from the other side's (measuring/arguments.py) is a culprit, evidence `arguments`: it was asked
something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pi0align.compare.judging.calltable.bounds import MARGIN, half_precision, rounding_floor
from pi0align.compare.judging.execution import PHASES, phases
from pi0align.compare.judging.modules import enclosing_modules, innermost, is_module, is_module_api
from pi0align.compare.judging.verdict import checksums_known
from pi0align.compare.result import SAME_SHAPE_AND_DTYPE
from pi0align.compare.table import Coded, Groups, Table, isin

NOISE_MODELS = ("replay", "exact", "reference", "intrinsic")
# where a call ran: (rank, step, phase of the step (execution.PHASES), sequence number)
Position = tuple[int, int, int, float]
# introduced error ≥ this × the median of its API's calls, by the measure it was judged by: under
# noise, an API's calls spread up to 2.8× around their median when judged by statistics (the
# extremes and sums they see move with the elements they happen to hold), up to 1.5× by the
# relative L2 error of full tensors (docs/compare.md, Bounds)
STANDOUT = {"stats_rel_err": 4.0, "rel_l2_err": 2.0}
FAMILY_UNITS = 256.0  # an API whose typical output error is this many unit roundoffs is off as a family
MIN_PEERS = 4  # fewer calls of an API than this: no median to stand out from
MIN_STEPS_BEYOND = 2  # a call beyond its bound at every one of this many steps or more is no chance
# Adam's second moment squares the gradient (twice its relative error) and the update divides by
# its root; statistics such as the norm of a square weigh the largest elements' errors more still
OPTIMIZER_GAIN = 4.0


def replay_ratio_limit(unit: np.ndarray) -> np.ndarray:
    """replay: dynamo's same() multipliers (fp32 2, half precision 3) and the floor of the call's
    own rounding (bounds.rounding_floor: bf16/fp16 2 u, above the ~1.3 u of a result moved by up
    to an ulp and the ~0.4 u of rounding, below a 3 % fault, 7.7 u in bf16; fp32 16 u, room for
    reduction-order error over long sums)."""
    return np.where(half_precision(unit), 3.0, 2.0)


def wrong_sides(e_a: np.ndarray, e_b: np.ndarray, u_a: np.ndarray, u_b: np.ndarray, condition: np.ndarray = 1.0,
                rule: np.ndarray = "", api: np.ndarray | Coded = ""):
    """(B wrong, A wrong, the wrong side's local error over the other's, floored) from both sides'
    local errors and their results' unit roundoffs; the call's condition, its rule and its API, for
    how much its own rounding grows (bounds.rounding_floor: a sum's whose terms cancel)."""
    floor_a, floor_b = rounding_floor(u_a, condition, rule, api), rounding_floor(u_b, condition, rule, api)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        b_wrong = e_b > replay_ratio_limit(u_b) * e_a + floor_b
        a_wrong = (e_a > replay_ratio_limit(u_a) * e_b + floor_a) & ~b_wrong
        ratio = np.where(b_wrong, e_b / np.maximum(e_a, floor_b), e_a / np.maximum(e_b, floor_a))
    return b_wrong, a_wrong, ratio


@dataclass(frozen=True)
class Judgement:
    """Per call (rows of the calls table): culprit or not, by which evidence, which side is wrong
    (replay: "A" or "B"; "" otherwise), the blame to rank culprits by (the local error ratio
    where replayed, the introduced error elsewhere), and for the others why they are within noise
    (`within`, one of WITHIN: explain.py labels their results with it), and the innermost forward
    module call holding it (`enclosing`: its row, -1 where none; modules.enclosing_modules)."""

    culprit: np.ndarray
    evidence: np.ndarray
    wrong_side: np.ndarray
    blame: np.ndarray
    within: np.ndarray
    enclosing: np.ndarray

    def __bool__(self) -> bool:
        return bool(self.culprit.any())


# Why a call that is no culprit is within noise:
WITHIN = {
    "replay": "replayed in float64, its kernel is as close as the other side's",
    "bound": "its output error is within what its inputs and rounding explain (bounds.py)",
    "peers": "it introduces no more than the other calls of its API (its API's noise)",
    "inside": "a module whose calls are judged on their own, and nothing undumped inside it parted",
    "step": "an optimizer update that moved its parameter no further than one step of its optimizer can",
    "unsourced": "",  # what made its input is not known: nothing explains its result
}


def judge(calls: Table, fallback: str, exact: bool = False, earlier: Sequence[Position] = ()) -> Judgement:
    """Judge every call: by replay where both sides were replayed, else by its bound (bounds.py)
    under `fallback` ("reference" or "intrinsic"), and, where the runs are bit-comparable
    (`exact`), also by its bits. `earlier`: the first culprit of each rank in steps judged before
    these calls' (`Position`), which every one of them ran after."""
    e_a, e_b = calls["local_error_a"].astype(np.float64), calls["local_error_b"].astype(np.float64)
    u_a, u_b = calls["unit_a"].astype(np.float64), calls["unit_b"].astype(np.float64)
    replayed = ~np.isnan(e_a) & ~np.isnan(e_b)
    b_wrong, a_wrong, local_ratio = wrong_sides(e_a, e_b, u_a, u_b, calls["condition"], calls["condition_rule"],
                                                calls.coded("api"))
    b_wrong &= replayed
    a_wrong &= replayed
    module = is_module(calls)
    held = calls["with_calls_inside"].astype(bool)
    kind = calls["kind"]
    operation = judged_as_calls(calls)
    # bit-comparable runs compute alike: identical inputs and differing outputs prove a change,
    # however small (TF32 rounding that the statistics hardly see, two elements swapped)
    changed = calls["inputs_identical"] & calls["outputs_differ"] & ~held
    beyond = beyond_bound(calls)
    off = family_off(calls)
    peers = stands_out(calls) | off | beyond_at_every_step(calls, beyond)
    kernels = np.where(held, beyond, beyond & peers) | (changed if exact else False)
    # an update is wrong when it moved its parameter further than any step of its optimizer can
    # (bounds.step_bounds), or, beyond its gain, where its inputs agree bit for bit or every update
    # of the step is off (another epsilon); Adam's update is scale-free, so one update beyond its
    # gain within its step is the noise of its gradient's signs
    with np.errstate(invalid="ignore"):
        beyond_step = calls["outputs_fail"] & (calls["parameter_error"] > calls["step_bound"])
    updates = (beyond & (calls["inputs_identical"] | updates_off(calls))) | beyond_step
    sourced = calls["sourced"].astype(bool)
    rule = np.select([operation, kind == "optimizer", kind == "data"], [kernels, updates, calls["outputs_fail"]],
                     beyond & sourced)  # the parameters, the initial weights, the gradients
    # told other arguments (a scale, an epsilon): computes something else, however right its kernel;
    # an optimizer told other hyper-parameters is a setup that differs, whatever its outputs show
    other_arguments = calls["args_differ"] & (calls["outputs_fail"] | (kind == "optimizer")) & ~module
    by_bits = exact & changed & operation & ~replayed & ~(beyond & peers)
    judged = np.where(replayed, b_wrong | a_wrong, rule)
    # downstream of a culprit, statistics cannot tell the error a call inherited from error it
    # adds (a LayerNorm's output keeps its norm whatever its elements hold, and the calls after it
    # seem to amplify what it hid): there a call judged by statistics is blamed by its bits alone
    by_statistics = (calls["metric"] == "stats_rel_err") & ~replayed & (operation | (kind == "gradient"))
    enclosing = enclosing_modules(calls)
    inherited = by_statistics & after_first(calls, innermost(enclosing, judged), earlier)
    judged &= ~inherited | (changed & exact)
    culprit = innermost(enclosing, judged | other_arguments)
    evidence = np.where(other_arguments, "arguments", np.where(by_bits, "exact",
                        np.where(replayed, "replay", fallback))).astype(object)
    wrong = np.where(b_wrong, "B", np.where(a_wrong, "A", "")).astype(object)
    blame = np.where(replayed & ~other_arguments, local_ratio, calls["introduced_error"].astype(np.float64))
    wrong[evidence != "replay"] = ""
    update = (kind == "optimizer") & ~operation
    within = np.select([culprit, replayed, ~sourced, held & ~beyond, beyond & operation & ~peers,
                        beyond & update & np.isfinite(calls["step_bound"]), beyond & update],
                       ["", "replay", "unsourced", "inside", "peers", "step", "peers"], "bound").astype(object)
    return Judgement(culprit=culprit, evidence=evidence, wrong_side=wrong, blame=blame, within=within,
                     enclosing=enclosing)


# What decides how the same maths is computed, and so its rounding: the device and its libraries,
# the host's CPU (where PI0's noise is drawn and the batch made, whatever the device: its
# architecture, model, torch's code path and BLAS), the numerics switches, and the implementations
# chosen (a fused AdamW, DeepSpeed's engine and ZeRO stage, another transformers or LeRobot).
SAME_NUMERICS = ("device", "device_name", "cpu", "dtype", "world_size", "numerics", "versions.torch",
                 "versions.torch_npu", "versions.cann", "versions.transformers", "versions.lerobot",
                 "versions.deepspeed", "versions.accelerate", "transformers_compat", "config.optimizer",
                 "config.engine", "config.zero_stage")


# the directions of API and module calls: kernels with inputs and outputs, whatever kind they count as
CALL_DIRECTIONS = ("forward", "backward", "update", "in_optimizer")


def judged_as_calls(calls: Table) -> np.ndarray:
    """The calls judged as kernels: API and module calls, whatever their kind (the optimizer's
    arithmetic where a dump records it op by op, msprobe's calls inside `optimizer.step()`, makes
    its update: kind `optimizer`; a random draw is data), and not what was recorded whole (the
    parameters, their gradients, the batch, our `Optimizer.step` records)."""
    return calls.isin("direction", *CALL_DIRECTIONS)


def computes_alike(diff: list, manifest: dict) -> bool:
    """By their manifests, the two runs compute bit for bit alike given the same inputs: the same
    device, dtype, threads, numerics switches and torch (SAME_NUMERICS), and deterministic
    algorithms on an accelerator (atomics make its runs differ from one another). `manifest`: A's."""
    if any(key.split(".")[0] in SAME_NUMERICS or key in SAME_NUMERICS for key, _, _ in diff):
        return False
    return manifest.get("device", "cpu") == "cpu" or \
        bool((manifest.get("numerics") or {}).get("deterministic_algorithms"))


def bit_comparable(rows: Table, identical: np.ndarray, diff: list, manifest: dict) -> bool:
    """The two runs compute bit for bit alike: by their manifests (`computes_alike`), and the first
    forward API call of the first step (in a module-level dump, its first module holding no other)
    is handed and returns the same bits on both sides. `manifest`: A's."""
    if not computes_alike(diff, manifest):
        return False
    known = checksums_known(rows) & rows.isin("direction", "forward") & rows.isin("pairing", *SAME_SHAPE_AND_DTYPE)
    module_call = is_module_api(rows.coded("api"))
    first = known & ~module_call  # a module's output comes at its end
    if not first.any():
        paths = rows["module"]
        parents = {".".join(parts[:n]) for path in set(paths[known].tolist())
                   for parts in [path.split(".") if path else []] for n in range(len(parts))}
        first = known & ~isin(paths, parents)
    if not first.any():
        return False
    first &= rows["step"] == rows["step"][first].min()
    first &= rows["seq_a"] == rows["seq_a"][first].min()
    return bool(identical[first].all())


def noise_model(used: set[str], fallback: str) -> str:
    """The best evidence that judged the run (`used`: every call's Judgement.evidence): replay,
    exact (bits of bit-comparable runs), or the fallback."""
    return "replay" if "replay" in used else "exact" if "exact" in used else fallback


def beyond_bound(calls: Table) -> np.ndarray:
    """Calls whose failing outputs hold more error than their inputs (through their condition) and
    rounding explain (bounds.py), by more than MARGIN (OPTIMIZER_GAIN for the optimizer), whatever
    their inputs hold; for a module holding calls, what entered it from no dumped call."""
    gain = np.where((calls["kind"] == "optimizer") & ~judged_as_calls(calls), OPTIMIZER_GAIN, MARGIN)
    failing = np.where(calls["with_calls_inside"], calls["inside_error"] > 0, calls["outputs_fail"])
    return failing & (calls["introduced_error"] > gain)


def stands_out(calls: Table) -> np.ndarray:
    """Introduced error ≥ STANDOUT (of the measure it was judged by) × the median of its peers: the
    calls of the same API and direction under other names (the same call at another step is no
    peer: a faulty kernel is faulty at every step); every call with fewer than MIN_PEERS peers."""
    introduced = calls["introduced_error"].astype(np.float64)
    typical, peers = peer_medians(introduced, Groups(calls.coded("api"), calls.coded("direction")).codes,
                                  calls.coded("name"))
    standout = np.where(calls["metric"] == "rel_l2_err", STANDOUT["rel_l2_err"], STANDOUT["stats_rel_err"])
    with np.errstate(invalid="ignore"):
        return (peers < MIN_PEERS) | (introduced >= standout * typical)


def peer_medians(values: np.ndarray, family: np.ndarray, names: np.ndarray | Coded) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the median of the values of the rows of its family (`family`: a group code per row)
    under other names (np.nanmedian of them: NaN is no value, NaN where none is left), and how
    many such rows there are. The family's values are sorted once; a name's own values are taken
    out of them by their places (a name's rows are few, a family's many)."""
    group = Groups(family, names).codes  # a name within its family
    if not len(values):
        return np.zeros(0), np.zeros(0, np.int64)
    n_families, n_groups = int(family.max()) + 1, int(group.max()) + 1
    group_family = np.zeros(n_groups, np.int64)
    group_family[group] = family
    peers = np.bincount(family)[family] - np.bincount(group)[group]
    valid = ~np.isnan(values)
    v, f, g = values[valid], family[valid], group[valid]
    # each family's values in order, and where each value's first equal one is among them
    by_family = np.lexsort((v, f))
    sorted_values, sorted_families = v[by_family], f[by_family]
    family_start = np.searchsorted(sorted_families, np.arange(n_families))
    below = np.empty(len(v), np.int64)
    below[by_family] = _run_starts(sorted_families, sorted_values) - family_start[sorted_families]
    # each name's values in order: the places they leave in their family's, in increasing order
    by_group = np.lexsort((v, g))
    grouped = g[by_group]
    group_start = np.searchsorted(grouped, np.arange(n_groups))
    removed = np.bincount(grouped, minlength=n_groups)
    gone = below[by_group] + np.arange(len(v)) - _run_starts(grouped, v[by_group])  # equal values: the next places
    left = np.bincount(f, minlength=n_families)[group_family] - removed

    def remaining(rank: np.ndarray) -> np.ndarray:
        """The place in its family's values of the rank-th value left once its name's are taken out."""
        position = rank.copy()
        for j in range(int(removed.max())):  # each gone place at or before the position moves it on by one
            active = np.flatnonzero(removed > j)
            position[active] += gone[group_start[active] + j] <= position[active]
        return position

    some = left > 0
    base = family_start[group_family]
    low, high = (np.minimum(base + remaining(np.where(some, rank, 0)), max(len(v) - 1, 0))
                 for rank in ((left - 1) // 2, left // 2))
    median = np.where(some, (sorted_values[low] + sorted_values[high]) / 2 if len(v) else np.nan, np.nan)
    return median[group], peers


def _run_starts(*keys: np.ndarray) -> np.ndarray:
    """For rows sorted by `keys`, the first row of the run of equal keys each row is in."""
    n = len(keys[0])
    new = np.ones(n, bool)
    for key in keys:
        new[1:] |= key[1:] != key[:-1]
    return np.maximum.accumulate(np.where(new, np.arange(n), 0)) if n else np.zeros(0, np.int64)


def beyond_at_every_step(calls: Table, beyond: np.ndarray) -> np.ndarray:
    """The calls of a name (and rank and direction) beyond their bound at every step that ran them,
    two or more: noise puts a call beyond its bound now and then, a faulty kernel each time it
    runs. bf16 statistics under ulp noise, two toy models, six draws each: no call of the noise
    alone is beyond at both steps, and the faulty call (a gelu, a softmax 3 % off) is in every
    draw, where its peers hid it in two of twelve (docs/compare.md, "Bounds")."""
    name = Groups(calls["rank"], calls.coded("name"), calls.coded("direction"))
    every = name.min(beyond.astype(np.float64)) == 1.0
    return (every & (name.count() >= MIN_STEPS_BEYOND))[name.codes]


def after_first(calls: Table, selected: np.ndarray, earlier: Sequence[Position] = ()) -> np.ndarray:
    """Calls downstream of the first selected call (`downstream`, that call itself not)."""

    return downstream(calls["rank"], calls["step"], phases(calls.coded("direction")), calls["seq_a"], calls, selected,
                      earlier=earlier)


# the phases that read what every rank's backward made (DDP's all-reduced gradients)
SHARED_PHASES = ("update", "in_optimizer", "optimizer")


def first_positions(calls: Table, selected: np.ndarray) -> list[Position]:
    """The first selected call of each rank, in execution order, as a Position."""

    call_phase = phases(calls.coded("direction"))
    firsts = []
    for own in np.unique(calls["rank"][selected]).tolist():
        mine = selected & (calls["rank"] == own)
        firsts.append((own, *min(zip(calls["step"][mine].tolist(), call_phase[mine].tolist(),
                                     calls["seq_a"][mine].tolist()))))
    return firsts


def downstream(rank: np.ndarray, step: np.ndarray, phase: np.ndarray, seq: np.ndarray, calls: Table,
               selected: np.ndarray, inclusive: bool = False, earlier: Sequence[Position] = ()) -> np.ndarray:
    """Of entries at (rank, step, phase of the step, seq), those that ran after the first selected
    call of `calls` on their rank, in execution order (`inclusive`: that call's own too, and
    entries without a sequence number at its step and phase), or that another rank's reached: the
    ranks of one run train one model, so a call that parts a rank reaches every rank at the next
    step, and at its own step in the phases that read the all-reduced gradients (SHARED_PHASES).
    `earlier`: first culprits found among calls judged before (earlier steps), as if selected."""

    after = np.zeros(len(rank), bool)
    seq = np.asarray(seq, np.float64)
    first_of_rank: dict[int, tuple] = {}
    for own, *first in [*earlier, *first_positions(calls, selected)]:
        first_of_rank[own] = min(first_of_rank.get(own, tuple(first)), tuple(first))
    firsts = list(first_of_rank.values())
    for own, first in first_of_rank.items():
        later_seq = ~(seq < first[2]) if inclusive else seq > first[2]
        later = (step > first[0]) | ((step == first[0]) & ((phase > first[1]) | ((phase == first[1]) & later_seq)))
        after |= (rank == own) & later
    if firsts:
        step_first, phase_first, _ = min(firsts)
        shared = min(PHASES.index(p) for p in SHARED_PHASES)
        after |= (step > step_first) | ((step == step_first) & (phase >= shared) & (phase_first < shared))
    return after


def updates_off(calls: Table) -> np.ndarray:
    """The optimizer updates of steps whose median update introduces more than OPTIMIZER_GAIN."""
    updates = (calls["kind"] == "optimizer") & ~judged_as_calls(calls)
    introduced = np.where(updates, calls["introduced_error"].astype(np.float64), np.nan)
    step = Groups(calls["rank"], calls["step"])
    with np.errstate(invalid="ignore"):
        return (step.median(introduced) > OPTIMIZER_GAIN)[step.codes]


def family_off(calls: Table) -> np.ndarray:
    """The calls of APIs whose typical call is beyond its bound (median introduced error above
    MARGIN) and, in float32, far beyond its dtype's rounding (median output error ≥ FAMILY_UNITS
    unit roundoffs), among at least MIN_PEERS call sites: every matmul of an fp32 run on TF32
    inputs (TF32 keeps 10 mantissa bits: ~1e-4 to 1e-3 where fp32 rounding gives 1e-7), every
    layer_norm of a bf16 run 3 % off. In half precision the bound's floor (3 u) is already the
    dtype's rounding."""
    family = Groups(calls.coded("api"), calls.coded("direction"))
    unit = np.maximum(calls["unit_a"], calls["unit_b"]).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        in_units = calls["output_error"].astype(np.float64) / np.where(unit > 0, unit, np.nan)
    far_units = np.where(half_precision(unit), 0.0, FAMILY_UNITS)
    adds = family.median(calls["introduced_error"].astype(np.float64)) > MARGIN
    far = family.median(in_units) >= family.max(far_units)
    names = Groups(calls.coded("api"), calls.coded("direction"), calls.coded("name"))
    several = family.max(np.bincount(family.codes[names.first], minlength=len(family))[family.codes]) >= MIN_PEERS
    return (adds & far & several)[family.codes]

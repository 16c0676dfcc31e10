"""Which calls introduce error beyond the hardware's noise: the noise models.

Two devices never agree bit for bit, so a call is a culprit only when its error stands out from
noise, judged by the best evidence there is for it (docs/compare.md, section "Noise models"):

* `replay`: both sides' results replayed in float64 from their own inputs (replayed.py). Side X
  is wrong when its local error e_X exceeds RATIO × e_other + FLOOR_UNITS × u_X (u_X: unit
  roundoff of X's result dtype) -- torch dynamo's `same()` (RMSE against fp64 within 2×, 3× in
  half precision, of the eager result's) and msprobe's benchmark standard (RMSE ratio ≤ 2), with a
  floor of a few unit roundoffs so that two kernels both within rounding are never told apart.
* `reference`: a noise reference (A re-run with every result moved by an ulp) raises each
  record's limits to how far this model carries rounding to it (reference.py);
  a call is then a culprit when its outputs fail and its inputs pass (or it amplifies tenfold).
* `intrinsic`: the same rule under the fixed dtype limits.

Under `reference` and `intrinsic` a call's introduced error must also stand out from what calls of
the same API introduce elsewhere in the run (STANDOUT × their median), unless its API is off as a
family (`family_off`: every matmul on TF32 inputs), however alike its calls are.

The optimizer's update (kind `optimizer`) is judged as a whole: Adam's update is scale-free, so an
element whose gradient is rounding noise moves by the learning rate either way, and one update can
fail by far more than its inputs do (a sign flipped in a zero-initialised bias moves its mean). An
update is a culprit when it introduces error by more than OPTIMIZER_GAIN (Adam squares the
gradient) and either its inputs hold the same bits on both sides or the step's typical update
does so too (`updates_off`: another epsilon, another formula changes every update). The data and
the parameters have no noise to stand out from: the parameters introduce error whenever they fail
while the update that made them passes (or nothing made them: the first dumped step); the data
whenever they fail (they are read, not computed: their bits decide, explain.data_differ).

Where the two runs are bit-comparable (explain.bit_comparable: same device, threads and numerics,
and the first call's inputs and outputs hold the same bits), checksums are proof and there is no
noise: a kernel not replayed is a culprit exactly when it was handed identical inputs and its
output bits differ, however small the difference (two elements swapped: the statistics cannot see
it), evidence `exact`; a kernel handed differing inputs passes on what it was handed (statistics
cannot tell a propagated difference from an amplified one). Whatever the evidence, a
call whose outputs fail and whose recorded non-tensor arguments differ
from the other side's (arguments.py) is a culprit, evidence `arguments`: it was asked something
else. A module call (`Module.*`) that has API calls recorded inside it is judged by them: it is
explained when none of them is a culprit, and never blamed itself (its error is its calls').
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pi0align.compare.table import Groups, Table
from pi0align.compare.thresholds import UNIT_ROUNDOFF

NOISE_MODELS = ("replay", "exact", "reference", "intrinsic")
AMPLIFICATION = 10.0  # a call that multiplies the error it receives tenfold introduces error
STANDOUT = 4.0  # introduced error ≥ 4 × the median of its API's calls
FAMILY_UNITS = 256.0  # an API whose typical output error is this many unit roundoffs is off as a family
MIN_PEERS = 4  # fewer calls of an API than this: no median to stand out from
# Adam's second moment squares the gradient (twice its relative error) and the update divides by
# its root; statistics such as the norm of a square weigh the largest elements' errors more still
OPTIMIZER_GAIN = 4.0
# replay: dynamo's same() multipliers (fp32 2, half precision 3) and a floor in unit roundoffs
# (bf16/fp16: 3 u, above the ~1.3 u of a result moved by up to an ulp and the ~0.4 u of rounding,
# below a 3 % fault, 7.7 u in bf16; fp32: 16 u, room for reduction-order error over long sums)
_HALF = (UNIT_ROUNDOFF["bfloat16"], UNIT_ROUNDOFF["float16"])


def replay_ratio_limit(unit: np.ndarray) -> np.ndarray:
    return np.where(np.isin(unit, _HALF), 3.0, 2.0)


def replay_floor(unit: np.ndarray) -> np.ndarray:
    return np.where(np.isin(unit, _HALF), 3.0, 16.0) * unit


def wrong_sides(e_a: np.ndarray, e_b: np.ndarray, u_a: np.ndarray, u_b: np.ndarray):
    """(B wrong, A wrong, the wrong side's local error over the other's, floored) from both sides'
    local errors and their results' unit roundoffs."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        b_wrong = e_b > replay_ratio_limit(u_b) * e_a + replay_floor(u_b)
        a_wrong = (e_a > replay_ratio_limit(u_a) * e_b + replay_floor(u_a)) & ~b_wrong
        ratio = np.where(b_wrong, e_b / np.maximum(e_a, replay_floor(u_b)), e_a / np.maximum(e_b, replay_floor(u_a)))
    return b_wrong, a_wrong, ratio


@dataclass(frozen=True)
class Judgement:
    """Per call (rows of the calls table): culprit or not, by which evidence, which side is wrong
    (replay: "A" or "B"; "" otherwise), and the blame to rank culprits by (the local error ratio
    where replayed, the introduced error elsewhere)."""

    culprit: np.ndarray
    evidence: np.ndarray
    wrong_side: np.ndarray
    blame: np.ndarray
    explained: np.ndarray  # judged within noise: its outputs' differences are inherited or rounding
    # (explain.py leaves out the modules around a culprit, and every call after the first)

    def __bool__(self) -> bool:
        return bool(self.culprit.any())


def judge(calls: Table, fallback: str, exact: bool = False) -> Judgement:
    """Judge every call: by its bits where the runs are bit-comparable (`exact`), by replay where
    both sides were replayed, else by `fallback` ("reference" or "intrinsic")."""
    e_a, e_b = calls["local_error_a"].astype(np.float64), calls["local_error_b"].astype(np.float64)
    u_a, u_b = calls["unit_a"].astype(np.float64), calls["unit_b"].astype(np.float64)
    replayed = ~np.isnan(e_a) & ~np.isnan(e_b)
    b_wrong, a_wrong, local_ratio = wrong_sides(e_a, e_b, u_a, u_b)
    b_wrong &= replayed
    a_wrong &= replayed
    module = np.char.startswith(calls["api"].astype(str), "Module.")
    with_calls_inside = module & _with_calls_below(calls, ~module)  # judged by the calls made inside it
    # bit-comparable runs compute alike: identical inputs and differing outputs prove a change,
    # however small (TF32 rounding that the statistics hardly see, two elements swapped), and a
    # kernel handed differing inputs only passes on what it was handed
    changed = calls["inputs_identical"] & calls["outputs_differ"] & ~with_calls_inside
    kind, introduces = calls["kind"], introduces_error(calls)
    kernels = changed if exact else introduces & stands_out(calls)
    updates = introduces & (calls["inputs_identical"] | updates_off(calls))
    rule = np.select([kind == "call", kind == "optimizer", kind == "data"], [kernels, updates, calls["outputs_fail"]],
                     introduces)  # the parameters
    # told other arguments (a scale, an epsilon): computes something else, however right its kernel;
    # an optimizer told other hyper-parameters is a setup that differs, whatever its outputs show
    other_arguments = calls["args_differ"] & (calls["outputs_fail"] | (kind == "optimizer")) & ~module
    by_bits = exact & changed & (kind == "call") & ~replayed
    judged = np.where(replayed, b_wrong | a_wrong, rule & ~with_calls_inside)
    culprit = innermost(calls, judged | other_arguments)
    evidence = np.where(other_arguments, "arguments", np.where(by_bits, "exact",
                        np.where(replayed, "replay", fallback))).astype(object)
    wrong = np.where(b_wrong, "B", np.where(a_wrong, "A", "")).astype(object)
    blame = np.where(replayed & ~other_arguments, local_ratio, calls["introduced_error"].astype(np.float64))
    wrong[evidence != "replay"] = ""
    return Judgement(culprit=culprit, evidence=evidence, wrong_side=wrong, blame=blame, explained=~culprit)


def noise_model(judgement: Judgement, fallback: str) -> str:
    """The best evidence that judged the run: replay, exact (bits of bit-comparable runs), or the fallback."""
    used = set(judgement.evidence.tolist())
    return "replay" if "replay" in used else "exact" if "exact" in used else fallback


def introduces_error(calls: Table) -> np.ndarray:
    """Outputs fail while the inputs pass, or the call amplifies the error it receives tenfold; in
    both cases more error leaves the call than enters it (an exact cast from bf16 to fp32 passes
    on its bf16 input's error, judged against fp32's tighter limits, and introduces none)."""
    introduced = calls["introduced_error"]
    gain = np.where(calls["kind"] == "optimizer", OPTIMIZER_GAIN, 1.0)
    return calls["outputs_fail"] & (introduced > gain) & (calls["inputs_pass"] | (introduced >= AMPLIFICATION))


def stands_out(calls: Table) -> np.ndarray:
    """Introduced error ≥ STANDOUT × the median of its peers: the calls of the same API and
    direction under other names (the same call at another step is no peer: a faulty kernel is
    faulty at every step); every call with fewer than MIN_PEERS peers; every call of an API that is
    off as a family (`family_off`)."""
    family = Groups(calls["api"], calls["direction"])
    introduced = calls["introduced_error"].astype(np.float64)
    typical, peers = np.full(len(calls), np.nan), np.zeros(len(calls), np.int64)
    names = calls["name"]
    for members in np.split(family.order, family.starts[1:]) if len(calls) else []:
        for name in set(names[members].tolist()):
            own = names[members] == name
            others = introduced[members[~own]]
            peers[members[own]] = len(others)
            if len(others):
                typical[members[own]] = np.nanmedian(others) if not np.isnan(others).all() else np.nan
    with np.errstate(invalid="ignore"):
        return (peers < MIN_PEERS) | family_off(calls, family) | (introduced >= STANDOUT * typical)


def updates_off(calls: Table) -> np.ndarray:
    """The optimizer updates of steps whose median update introduces more than OPTIMIZER_GAIN."""
    introduced = np.where(calls["kind"] == "optimizer", calls["introduced_error"].astype(np.float64), np.nan)
    step = Groups(calls["rank"], calls["step"])
    with np.errstate(invalid="ignore"):
        return (step.median(introduced) > OPTIMIZER_GAIN)[step.codes]


def family_off(calls: Table, family: Groups) -> np.ndarray:
    """The calls of APIs whose typical call adds error (median introduced error ≥ 2) far beyond its
    dtype's rounding (median output error ≥ FAMILY_UNITS unit roundoffs): every matmul of an fp32
    run on TF32 inputs (TF32 keeps 10 mantissa bits: ~1e-4 to 1e-3 where fp32 rounding gives 1e-7).
    In half precision FAMILY_UNITS roundoffs are beyond any error this measures: the rule is fp32's."""
    unit = np.maximum(calls["unit_a"], calls["unit_b"]).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        in_units = calls["output_error"].astype(np.float64) / np.where(unit > 0, unit, np.nan)
    adds = family.median(calls["introduced_error"].astype(np.float64)) >= 2.0
    far = family.median(in_units) >= FAMILY_UNITS
    return (adds & far)[family.codes]


def _with_calls_below(calls: Table, members: np.ndarray) -> np.ndarray:
    """Calls whose module path (or one below it) holds one of `members` in the same rank, step and
    direction: in backward, a module's row may open after the rows of the calls inside it."""
    key = lambda i: (int(calls["rank"][i]), int(calls["step"][i]), str(calls["direction"][i]))
    below = set()
    for i in np.flatnonzero(members).tolist():
        parts = str(calls["module"][i]).split(".") if calls["module"][i] else []
        below.update((*key(i), ".".join(parts[:n])) for n in range(len(parts) + 1))
    return np.array([(*key(i), str(calls["module"][i])) in below for i in range(len(calls))], bool)


def innermost(calls: Table, selected: np.ndarray) -> np.ndarray:
    """`selected` without the module calls inside which another selected call ran."""
    return selected & ~containing(calls, selected)


def containing(calls: Table, members: np.ndarray) -> np.ndarray:
    """The module calls inside which one of `members` ran.

    A module invocation at path P spans the later calls (same rank, step, direction) made in P or
    below it, up to the first call elsewhere or P's next invocation. `calls` is in execution order.
    """
    module_api = np.char.startswith(calls["api"].astype(str), "Module.")
    found = np.zeros(len(calls), bool)
    modules = calls["module"].astype(str)
    for i in np.flatnonzero(module_api):
        path, seq = modules[i], calls["seq_a"][i]
        later = ((calls["rank"] == calls["rank"][i]) & (calls["step"] == calls["step"][i])
                 & (calls["direction"] == calls["direction"][i]) & (calls["seq_a"] > seq))
        inside = (modules == path) | np.char.startswith(modules, path + ".") if path else np.ones(len(modules), bool)
        ends = later & (~inside | (module_api & (modules == path)))
        end = calls["seq_a"][ends].min() if ends.any() else np.inf
        found[i] = bool((later & inside & (calls["seq_a"] < end) & members).any())
    return found

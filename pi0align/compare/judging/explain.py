"""Which failing rows the noise model explains, and by which rule (docs/compare.md, "Explained rows").

The last stage of the verdict: rows judged against their limits (verdict.py), the calls
(calls.py) and their judgement (judge.py) in, each row's final verdict and the rule that
turned it `warn` out (`explained_by`). A failing row is explained only by what made it, within a
bound: a result of a call within noise, the same tensor as an explained result, a sum or a
clipping of explained gradients (also as msprobe's `update` calls read them), a tensor made
inside a module by calls that were not dumped while the module stayed within its bound, a
gradient sent back by code that was not dumped (the loss) within what that code could read, or a
gradient at rounding level. Only rows that ran before their rank's first culprit are explained
(those after it may inherit its error), and no row of a module around a culprit. Everything else
keeps failing: the run is `diverged`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pi0align.compare.judging.calltable.bounds import MARGIN, half_precision, noise_floor, numels
from pi0align.compare.judging.calltable.calls import call_ref
from pi0align.compare.judging.calltable.channels import (
    at_least,
    channel_ratios,
    elementwise_errors,
    precision_floors,
    row_error,
    statistic_channels,
)
from pi0align.compare.judging.execution import call_directions, phases
from pi0align.compare.judging.identity import (
    RESULT_ROLES,
    accumulated_gradient_sources,
    gradient_sources,
    requires_grad,
)
from pi0align.compare.judging.judge import Judgement, Position, downstream
from pi0align.compare.judging.modules import containing, enclosing_paths, is_module_api
from pi0align.compare.judging.thresholds import class_roundoffs
from pi0align.compare.judging.verdict import checksums_known
from pi0align.compare.reading.records import OUTPUT_ROLES, subjects
from pi0align.compare.result import CallRef
from pi0align.compare.table import Groups, Table, gather, isin, lookup

# explained_by: the rule that turned a row `warn` ("" for the others)
EXPLAINED_BY = {
    "limits": "within its limits, near them (above warn_fraction of a limit)",
    "rounding": "a gradient at rounding level (noise.py)",
    "replay": "a result of a call replayed in float64 whose kernel is as close as the other side's",
    "bound": "a result of a call whose output error is within what its inputs and rounding explain",
    "peers": "a result of a call that introduces no more than the other calls of its API",
    "inside": "a result of a module whose calls are judged on their own",
    "step": "a parameter an optimizer update moved no further than one step of its optimizer can",
    "producer": "the same tensor (same bits on both sides) as an explained result",
    "gap": "an optimizer state left by updates that were not dumped, within what the states and gradients at "
           "the gap's ends explain",
    "gradient_sum": "a sum of gradients its readers sent back, within the sum's bound",
    "clipping": "an explained gradient scaled by the clipping factor, within its bound",
    "module": "made inside modules within their bounds by calls that were not dumped",
    "sent_back": "a gradient sent back by code that was not dumped (a loss after the model; at level module the "
                 "arithmetic between modules) within what that code could read",
}


@dataclass(frozen=True)
class Explanation:
    """Per row: its final verdict and the rule that explained it (a key of EXPLAINED_BY, or "")."""

    verdict: np.ndarray
    explained_by: np.ndarray

    def counts(self) -> dict[str, int]:
        """Rows turned or left `warn`, by rule."""
        labels = self.explained_by[self.verdict == "warn"].tolist()
        return {rule: labels.count(rule) for rule in EXPLAINED_BY if rule in labels}


def explain(rows: Table, verdict: np.ndarray, rounding: np.ndarray, identity: np.ndarray, producer: np.ndarray,
            calls: Table, judgement: Judgement, earlier: Sequence[Position] = (),
            states_before: Table | None = None, noisy_start: bool = False) -> Explanation:
    """The rows' final verdicts: failing rows the noise model explains become `warn`, each labelled;
    the outputs of a culprit found by exact evidence that differ, `fail`.
    `identity`, `producer`: which records hold the same tensor, and which record produced it.
    Where steps before these rows' were judged apart: `earlier`, each rank's first culprit among
    them (judge.Position); `states_before`, the optimizer's latest state outputs
    (`optimizer_states`). `noisy_start`: the runs started from the same weights and compute
    differently (their manifests)."""
    labels = np.where(verdict == "warn", "limits", "").astype(object)
    failing = verdict == "fail"
    labelled = labels != ""
    call = calls_of(rows, calls)
    open_ = failing & _before_first(rows, calls, judgement, earlier)
    open_ &= ~gather(containing(judgement.enclosing, judgement.culprit), call, False).astype(bool)
    error, _ = row_error(rows)
    sources = elementwise_errors(rows)  # what each record may carry into a sum it is a term of

    def settle(mask: np.ndarray, rule) -> None:
        chosen = open_ & mask
        labels[chosen] = rule if isinstance(rule, str) else rule[chosen]
        labelled[chosen] = True
        open_[chosen] = False

    settle(rounding, "rounding")
    within = gather(judgement.within, call, "").astype(object)
    result = rows.isin("role", *RESULT_ROLES, "parameter_grad")
    settle(result & (call >= 0) & (within != "") & (within != "unsourced"), within)

    def fine() -> np.ndarray:  # rows that do not fail, or are explained by now
        return ~failing | labelled

    settle((producer >= 0) & gather(fine(), producer, False), "producer")
    settle(_gradient_sums_within(rows, identity, error, sources, verdict, fine()), "gradient_sum")
    settle(_accumulated_within(rows, identity, producer, error, sources, verdict, fine()), "gradient_sum")
    settle(_clipped_within(rows, error, sources, fine()), "clipping")
    settle(_states_within(rows, fine(), states_before), "producer")
    settle(_states_after_gap(rows, fine(), error, sources, rounding, states_before, noisy_start), "gap")
    settle(_made_inside(rows, call, judgement, producer), "module")
    # rounding noise is no source: such a gradient may be apart by its whole size
    settle(_undumped_gradients_within(rows, identity, np.where(rounding, np.nan, sources), fine()), "sent_back")
    final = verdict.copy()
    final[failing & labelled & (labels != "limits")] = "warn"
    # a culprit found by exact evidence fails its differing outputs: a change its statistics may not see
    exact = gather(judgement.culprit & (judgement.evidence == "exact"), call, False).astype(bool)
    final[exact & rows.isin("role", *OUTPUT_ROLES) & ~rows["identical"].astype(bool)] = "fail"
    return Explanation(verdict=final, explained_by=labels)


def calls_of(rows: Table, calls: Table) -> np.ndarray:
    """Each row's call (its row in `calls`), -1 where it has none."""
    keys = ("rank", "step")
    return lookup([*(rows[k] for k in keys), call_directions(rows), rows["seq_a"].astype(np.float64)],
                  [*(calls[k] for k in keys), calls.coded("direction"), calls["seq_a"].astype(np.float64)])


def _before_first(rows: Table, calls: Table, judgement: Judgement, earlier: Sequence[Position]) -> np.ndarray:
    """Rows that ran before the first culprit reached them (judge.downstream, its own rows
    included): those after it may inherit its error, and stay failing where they exceed their
    limits."""
    return ~downstream(rows["rank"], rows["step"], phases(call_directions(rows)), rows["seq_a"], calls,
                       judgement.culprit, inclusive=True, earlier=earlier)


def _floors(rows: Table) -> np.ndarray:
    return noise_floor(class_roundoffs(rows.coded("dtype_class")))


def _gradient_sums_within(rows: Table, identity: np.ndarray, error: np.ndarray, sources: np.ndarray,
                          verdict: np.ndarray, fine: np.ndarray) -> np.ndarray:
    """Incoming gradients (`grad_output`) within MARGIN × the bound of the sum of what their
    tensor's readers sent back (identity.py; each term's error from `sources`,
    channels.elementwise_errors), every one of those explained."""
    failing_unexplained = (verdict == "fail") & ~fine
    bound, readers_fail = gradient_sources(rows, identity, sources, failing_unexplained)
    gradient = rows.isin("direction", "backward") & rows.isin("role", "grad_output")
    with np.errstate(invalid="ignore"):
        return gradient & ~readers_fail & (error <= MARGIN * np.maximum(bound, _floors(rows)))


def _accumulated_within(rows: Table, identity: np.ndarray, producer: np.ndarray, error: np.ndarray,
                        sources: np.ndarray, verdict: np.ndarray, fine: np.ndarray) -> np.ndarray:
    """Gradients the step's update reads that no dumped call produced, where no parameter
    gradient was recorded (msprobe's `update` calls): within MARGIN × the bound of the sum the
    readers of a tensor of their shape that requires a gradient sent back
    (identity.accumulated_gradient_sources), every one of those explained."""
    gradients = isin(rows["direction"], ("update", "in_optimizer")) & rows.isin("role", "input") & (producer < 0)
    if not gradients.any():
        return gradients
    # tensors read in forward that require a gradient (statistics may tell a parameter from the
    # same values elsewhere no better: every zero bias has the same statistics)
    leaves = rows.isin("direction", "forward") & rows.isin("role", "input") & (requires_grad(rows) == 1)
    bound, readers_fail = accumulated_gradient_sources(rows, identity, sources, (verdict == "fail") & ~fine,
                                                       gradients, leaves)
    with np.errstate(invalid="ignore"):
        return gradients & ~readers_fail & (error <= MARGIN * np.maximum(bound, _floors(rows)))


def _clipped_within(rows: Table, error: np.ndarray, sources: np.ndarray, fine: np.ndarray) -> np.ndarray:
    """The gradient an optimizer update reads (input 1: after clipping, which is not dumped): the
    parameter's gradient times max_norm / ‖all gradients‖, so within MARGIN × (the error the
    gradient may carry, `sources`: channels.elementwise_errors, + the error of the total norm),
    the gradient explained. (Sampled at other positions than the gradient's record, its elements'
    differences are known from the gradient's floor, not its samples.)"""
    update_grad = rows.isin("direction", "optimizer") & rows.isin("role", "input") & (rows["arg_index"] == 1)
    if not update_grad.any():
        return update_grad
    gradients = np.flatnonzero(rows.isin("role", "parameter_grad"))
    rank, step = rows["rank"], rows["step"]
    norm_a, norm_b = rows["norm_a"].astype(np.float64), rows["norm_b"].astype(np.float64)
    total_error = {}
    for key in set(zip(rank[gradients].tolist(), step[gradients].tolist())):
        mine = gradients[(rank[gradients] == key[0]) & (step[gradients] == key[1])]
        total_a, total_b = np.sqrt(np.nansum(norm_a[mine] ** 2)), np.sqrt(np.nansum(norm_b[mine] ** 2))
        total_error[key] = abs(total_b - total_a) / total_a if total_a > 0 else (0.0 if total_b == 0 else np.inf)
    subject = subjects(rows["name"])
    keys = ("rank", "step")
    own = lookup([*(rows[k] for k in keys), subject], [*(rows[k][gradients] for k in keys), subject[gradients]])
    own_row = np.where(own >= 0, gradients[np.maximum(own, 0)], -1)
    gradient_error = gather(np.where(np.isnan(sources), 0.0, sources), own_row, np.nan)
    total = np.array([total_error.get(key, np.nan) for key in zip(rank.tolist(), step.tolist())])
    with np.errstate(invalid="ignore"):
        within = error <= MARGIN * np.maximum(gradient_error + total, _floors(rows))
    return update_grad & (own_row >= 0) & gather(fine, own_row, False) & within


STATE_KEYS = ("step", "rank", "name", "arg_index", "checksum_a", "checksum_b")
# per state output, beside its keys: whether it passed or was explained, its error as a source
# (channels.elementwise_errors), its norm, whether it holds no negative element on either side,
# and the error and norm of the gradient its update read (input 1, `_gradient_errors`)
STATE_FACTS = ("fine", "error", "norm", "nonnegative", "gradient_error", "gradient_norm")


def _state_inputs(rows: Table) -> np.ndarray:
    """The state tensors an update reads (inputs 2 on: what the update before left as outputs 2 on)."""
    return rows.isin("direction", "optimizer") & rows.isin("role", "input") & (rows["arg_index"] >= 2)


def _state_outputs(rows: Table) -> np.ndarray:
    """The state tensors an update leaves (outputs 2 on)."""
    return rows.isin("direction", "optimizer") & rows.isin("role", "output") & (rows["arg_index"] >= 2)


def optimizer_states(rows: Table, verdict: np.ndarray, rounding: np.ndarray, before: Table | None = None) -> Table:
    """The latest state output of each parameter's update and index (STATE_KEYS, STATE_FACTS), of
    these rows (final verdicts `verdict`; `rounding`: gradients at rounding level) and `before` (an
    earlier result): what the next updates read (`explain`'s `states_before`)."""
    mine = _states(rows, verdict != "fail", elementwise_errors(rows), rounding)
    both = Table.concat([before, mine]) if before is not None and len(before) else mine
    latest = np.lexsort((-both["step"], both["arg_index"], both["name"], both["rank"]))
    both = both.take(latest)
    return both.take(Groups(both["rank"], both["name"], both["arg_index"]).first)


def _states(rows: Table, fine: np.ndarray, sources: np.ndarray, rounding: np.ndarray) -> Table:
    """Every state output of these rows, by STATE_KEYS and STATE_FACTS (`fine`: the rows that pass
    or are explained; `sources`: channels.elementwise_errors; `rounding`: gradients at rounding
    level)."""
    chosen = np.flatnonzero(_state_outputs(rows))
    gradient_error, gradient_norm = _gradient_errors(rows, chosen, sources, rounding)
    with np.errstate(invalid="ignore"):
        nonnegative = (rows["min_a"][chosen] >= 0) & (rows["min_b"][chosen] >= 0)
    return Table({**{key: rows[key][chosen] for key in STATE_KEYS}, "fine": fine[chosen],
                  "error": sources[chosen], "norm": rows["norm_a"][chosen].astype(np.float64),
                  "nonnegative": nonnegative, "gradient_error": gradient_error, "gradient_norm": gradient_norm},
                 length=len(chosen))


def _gradient_errors(rows: Table, at: np.ndarray, sources: np.ndarray,
                     rounding: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The error and norm of the gradient (input 1) that the update of each row `at` read (NaN
    where none): its error as a source, or, where its parameter's gradient is at rounding level
    (noise alone, noise.py), the most two tensors can differ by, ‖g_A − g_B‖ / ‖g_A‖ ≤ 1 + ‖g_B‖ / ‖g_A‖."""
    read = np.flatnonzero(rows.isin("direction", "optimizer") & rows.isin("role", "input") & (rows["arg_index"] == 1))
    found = lookup([rows[k][at] for k in ("rank", "step", "name")], [rows[k][read] for k in ("rank", "step", "name")])
    row = np.where(found >= 0, read[np.maximum(found, 0)], -1)
    noise = np.flatnonzero(rounding & rows.isin("role", "parameter_grad"))
    keys = lambda where: [rows["rank"][where], rows["step"][where], subjects(rows["name"][where])]
    of_noise = lookup(keys(at), keys(noise)) >= 0
    norm_a, norm_b = (gather(rows[f"norm_{side}"].astype(np.float64), row, np.nan) for side in "ab")
    with np.errstate(divide="ignore", invalid="ignore"):
        error = np.where(of_noise, 1.0 + norm_b / norm_a, gather(sources, row, np.nan))
    return error, norm_a


def _states_within(rows: Table, fine: np.ndarray, states_before: Table | None) -> np.ndarray:
    """An update's state tensors (inputs 2 on) hold what the update of the step before left: the
    same bits as its explained output of the same index (among these rows, or `states_before`)."""
    states = _state_inputs(rows)
    chosen = _state_outputs(rows) & fine
    explained = Table({key: rows[key][chosen] for key in STATE_KEYS}, length=int(chosen.sum()))
    if states_before is not None:
        fine_before = states_before.take(states_before["fine"].astype(bool))
        explained = Table.concat([explained, fine_before.select(STATE_KEYS)])
    if not states.any() or not len(explained):
        return np.zeros(len(rows), bool)
    keys = STATE_KEYS[1:]
    previous = lookup([rows["step"] - 1, *(rows[k] for k in keys)], [explained[k] for k in STATE_KEYS])
    return states & checksums_known(rows) & (previous >= 0)


def _states_after_gap(rows: Table, fine: np.ndarray, error: np.ndarray, sources: np.ndarray, rounding: np.ndarray,
                      states_before: Table | None, noisy_start: bool) -> np.ndarray:
    """An Adam-family update's state tensors (inputs 2 on) where the update of the step before was
    not dumped: updates that were not dumped left them, from what the last dumped update left
    (passing or explained), or, where none was dumped and the runs started from the same weights but
    compute differently (`noisy_start`), from the same start. Adam's states are averages, of weights
    summing to 1, of that start and of the gradients between (exp_avg) or their squares
    (exp_avg_sq), so a state's error is at most max(e_s ‖s‖, e_g G) / ‖s'‖ (s the state at the
    start, s' at the end, G the gradients' norm), and, where it holds no negative element,
    max(e_s, 2 e_g + e_g²) element by element. The gradients between, not dumped, are taken to carry
    the error and the norm of those read at the gap's two ends (`_gradient_errors`); within M ×
    that, or the dtype's noise floor."""
    open_ = np.flatnonzero(_state_inputs(rows) & ~fine & np.isfinite(rows["update_step"].astype(np.float64)))
    explained = np.zeros(len(rows), bool)
    if not len(open_):
        return explained
    known = _states(rows, fine, sources, rounding)
    if states_before is not None and len(states_before):
        known = Table.concat([states_before, known])
    by_state: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(known["rank"].tolist(), known["name"].tolist(), known["arg_index"].tolist())):
        by_state.setdefault(key, []).append(i)
    gradient_error, gradient_norm = _gradient_errors(rows, open_, sources, rounding)
    floors = _floors(rows)
    for row, end_error, end_norm in zip(open_.tolist(), gradient_error.tolist(), gradient_norm.tolist()):
        step = int(rows["step"][row])
        earlier = [i for i in by_state.get((rows["rank"][row], rows["name"][row], rows["arg_index"][row]), [])
                   if known["step"][i] < step]
        last = max(earlier, key=lambda i: known["step"][i]) if earlier else None
        if last is not None and (known["step"][last] == step - 1 or not known["fine"][last]):
            continue  # the update before was dumped (`_states_within`), or its state is not explained
        if last is None and not (noisy_start and step > 0):
            continue
        e_s, norm_s = (known["error"][last], known["norm"][last]) if last is not None else (0.0, 0.0)
        ends = [(end_error, end_norm)] + ([(known["gradient_error"][last], known["gradient_norm"][last])]
                                          if last is not None else [])
        e_g, norm_g = np.max(np.array(ends, np.float64), axis=0)  # NaN where one is not known: unexplained
        nonnegative = rows["min_a"][row] >= 0 and rows["min_b"][row] >= 0 and \
            (last is None or known["nonnegative"][last])
        norm = float(rows["norm_a"][row])
        with np.errstate(invalid="ignore"):  # a zero state on A: no relative bound
            bound = np.max([e_s, 2 * e_g + e_g ** 2]) if nonnegative else \
                np.max([e_s * norm_s, e_g * norm_g]) / norm if norm > 0 else 0.0
        explained[row] = bool(error[row] <= MARGIN * np.max([bound, floors[row]]))
    return explained


def _undumped_gradients_within(rows: Table, identity: np.ndarray, sources: np.ndarray,
                               fine: np.ndarray) -> np.ndarray:
    """Incoming gradients (`grad_output`) of an output no dumped call read (`unread_outputs`): code
    that was not dumped sent them back (a loss after the model, an operation filtered out, at level
    module the arithmetic between modules). Each is held channel by channel
    (channels.channel_ratios), through C = 1 as an API whose condition is not known, to what that
    code could read (`_read_by_code_not_dumped`), within MARGIN, each of those passing or explained
    (`fine`; `sources`: elementwise_errors, NaN for what is no source). A loss that amplifies its
    output's error (a target near the output) is not explained."""
    output = unread_outputs(rows, identity)
    explained = np.zeros(len(rows), bool)
    candidates = np.flatnonzero((output >= 0) & ~fine)
    if not len(candidates):
        return explained
    summed, extremes, spread = statistic_channels(rows)
    summed_sources = at_least(summed, precision_floors(rows))
    units = class_roundoffs(rows.coded("dtype_class"))
    half, floors = half_precision(units), noise_floor(units)
    for g, read in zip(candidates.tolist(), _read_by_code_not_dumped(rows, identity, output, candidates)):
        if not fine[read].all():
            continue
        ratio = channel_ratios(summed[g:g + 1], extremes[g:g + 1], numels(rows["shape_a"][g:g + 1]),
                               np.nanmax(sources[read], initial=0.0), np.nanmax(summed_sources[read], initial=0.0),
                               np.nanmax(spread[read], initial=0.0) if half[g] else 0.0, 1.0, 1.0, floors[g:g + 1])
        explained[g] = bool(ratio[0] <= MARGIN)
    return explained


def _read_by_code_not_dumped(rows: Table, identity: np.ndarray, output: np.ndarray,
                             gradients: np.ndarray) -> list[np.ndarray]:
    """For each incoming gradient of `gradients`, sent back by code that was not dumped into an
    output (its row: `output`), the rows that code could have read: the output; the gradient that
    entered the module it ran in, the one holding the outermost module that returned the output (a
    LayerNorm module returns its layer_norm's output; no module where the whole model returned it);
    and the gradients that the dumped backward calls right inside that module sent back into it
    before, none of a module around the call (made after it), never the gradient itself."""
    module_row = is_module_api(rows.coded("api"))
    seq = rows["seq_a"].astype(np.float64)
    backward = rows.isin("direction", "backward")
    # by rank, step and module: the gradients sent back into it (by an API call in it, or a module
    # right inside it), and the gradient that entered it
    into: dict[tuple, list[int]] = {}
    for r in np.flatnonzero(backward & rows.isin("role", "grad_input")).tolist():
        path = str(rows["module"][r])
        if module_row[r] and not path:
            continue  # the whole model's: sent back out of it
        holder = path.rpartition(".")[0] if module_row[r] else path
        into.setdefault((rows["rank"][r], rows["step"][r], holder), []).append(r)
    for r in np.flatnonzero(backward & rows.isin("role", "grad_output") & module_row).tolist():
        into.setdefault((rows["rank"][r], rows["step"][r], str(rows["module"][r])), []).append(r)
    returned: dict[int, set[str]] = {}  # a tensor -> the modules whose forward returned it
    for r in np.flatnonzero(rows.isin("direction", "forward") & rows.isin("role", "output") & module_row
                            & (identity >= 0)).tolist():
        returned.setdefault(int(identity[r]), set()).add(str(rows["module"][r]))
    read = []
    for g in gradients.tolist():
        path = str(rows["module"][g])  # a module's own path, or the module holding an API call
        around = enclosing_paths(path)
        returning = returned.get(int(identity[output[g]]), set()) | ({path} if module_row[g] else set())
        outer = next((p for p in around if p in returning), None)  # the outermost module that returned it
        scope = path if outer is None else outer.rpartition(".")[0] if outer else None
        held = np.array(into.get((rows["rank"][g], rows["step"][g], scope), []), np.int64)
        made_after = module_row[held] & (rows["role"][held] == "grad_input") & isin(rows["module"][held], around)
        itself = (identity[held] == identity[g]) & (identity[g] >= 0)
        read.append(np.r_[output[g], held[(seq[held] < seq[g]) & ~made_after & ~itself]])
    return read


def _made_inside(rows: Table, call: np.ndarray, judgement: Judgement, producer: np.ndarray) -> np.ndarray:
    """Forward inputs no dumped call produced (calls filtered out or on one side only, ops
    `torch.ops`, extension kernels) read inside modules, where every module around them stayed
    within its bound (judge.py: `inside`)."""
    candidates = np.flatnonzero(rows.isin("direction", "forward") & rows.isin("role", "input") & (call >= 0)
                                & (producer < 0))
    explained = np.zeros(len(rows), bool)
    if not len(candidates):
        return explained
    parent = judgement.enclosing
    for row in candidates.tolist():
        module, inside = parent[call[row]], False
        while module >= 0 and judgement.within[module] == "inside":
            inside, module = True, parent[module]
        explained[row] = inside and module < 0
    return explained


# What an unexplained failing record is, by its direction and role: where its difference came from
_SOURCES = {
    ("forward", "input"): "an input that no dumped call produced: the model's inputs, or an operation that was "
                          "not dumped",
    ("backward", "grad_output"): "a gradient flowing into the call that its readers' dumped gradients do not "
                                 "explain: a hook, gradient accumulation, or a backward operation that was not "
                                 "dumped",
    ("parameter", "parameter_grad"): "a parameter's gradient that no dumped backward call explains: gradient "
                                     "accumulation, all-reduce, a hook, or an operation that was not dumped",
    ("update", "input"): "what the step's update read differs from what its backward made (a gradient beyond the "
                         "sum of what the readers of a parameter of its shape sent back: a hook, gradient "
                         "accumulation, all-reduce), or from what the step before left (a parameter, a state)",
    ("in_optimizer", "input"): "what the optimizer's step read differs from what the backward made (a gradient beyond "
                               "the sum of what the readers of a parameter of its shape sent back: a hook, gradient "
                               "accumulation, all-reduce, clipping), or from what the step before left (a parameter, "
                               "a state)",
    ("optimizer", "input"): "what the optimizer's update read differs from what the step left (the parameter, "
                            "its gradient beyond what clipping explains, or the states of the update before): "
                            "something changed it between backward and the update (a hook, gradient "
                            "accumulation, all-reduce), or, after steps that were not dumped, the updates that "
                            "were not dumped (dump those steps to see them)",
}
# What such a gradient is where no dumped call read the output it flows back into (`unread_outputs`)
_UNREAD_GRADIENT = ("a gradient flowing into the call whose forward output no dumped call read, beyond what the "
                    "code that read it could read: that code was not dumped (a loss or other code after the model, "
                    "an operation filtered out, at level module the arithmetic between modules), and may amplify "
                    "the error (a loss, a product); dump that code (level mix, no filter), compute the loss inside "
                    "the model's forward, or compare against a noise reference (--noise)")


def first_failing(rows: Table) -> tuple[int, tuple[int, int, int, float]]:
    """The first failing row in execution order (by rank, step, the step's phase and sequence, a
    row without A's sequence number last), and its place in that order, to weigh against others'."""
    failing = np.flatnonzero(rows["verdict"] == "fail")
    rank, step, phase = rows["rank"][failing], rows["step"][failing], phases(call_directions(rows))[failing]
    seq = np.nan_to_num(rows["seq_a"][failing].astype(np.float64), nan=np.inf)
    first = np.lexsort((seq, phase, step, rank))[0]
    return int(failing[first]), (int(rank[first]), int(step[first]), int(phase[first]), float(seq[first]))


def unexplained_source(rows: Table, calls: Table, identity: np.ndarray, stack_of) -> tuple[CallRef | None, str]:
    """The call of the first failing row in execution order (`first_failing`), where no call is a
    culprit, and a note saying what that row is: the unrecorded operation or input that parted first."""

    row, _ = first_failing(rows)
    call = calls_of(rows, calls)[row]
    source = (str(rows["direction"][row]), str(rows["role"][row]))
    what = _UNREAD_GRADIENT if unread_outputs(rows, identity)[row] >= 0 else \
        _SOURCES.get(source, "a record that no call's bound explains")
    note = (f"no call introduces error beyond noise, but {rows['name'][row]} (step {rows['step'][row]}, "
            f"{rows['role'][row]} {rows['arg_index'][row]}) differs: {what}")
    return (call_ref(calls, int(call), stack_of) if call >= 0 else None), note


def unread_outputs(rows: Table, identity: np.ndarray) -> np.ndarray:
    """Per backward incoming gradient (`grad_output`), the row of the forward output it belongs to
    (same rank, step, call and index) where no dumped call read that output (its tensor known,
    and no forward input of its step holding it); -1 elsewhere."""
    found = np.full(len(rows), -1, np.int64)
    gradients = np.flatnonzero(rows.isin("direction", "backward") & rows.isin("role", "grad_output"))
    forward = rows.isin("direction", "forward")
    outputs = np.flatnonzero(forward & rows.isin("role", "output") & (identity >= 0))
    if not len(gradients) or not len(outputs):
        return found
    read = np.unique(identity[forward & rows.isin("role", "input") & (identity >= 0)])  # codes hold rank and step
    outputs = outputs[~np.isin(identity[outputs], read)]
    if not len(outputs):
        return found
    keys = ("rank", "step", "name", "arg_index")
    at = lookup([rows[k][gradients] for k in keys], [rows[k][outputs] for k in keys])
    found[gradients] = np.where(at >= 0, outputs[np.maximum(at, 0)], -1)
    return found

"""Execution order: the phases of a step and each call's kind.

A step's parts in execution order (PHASES): its parameters, its data, its forward calls, its
backward calls (in the order autograd ran them), the parameters' gradients, the API calls after its
backward (`update`: clipping and the optimizer's arithmetic, as msprobe records them), its optimizer
update. Each call has a kind (`kinds`): what a user fixes when it is the culprit.
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.reading.records import DIRECTIONS, function_name
from pi0align.compare.table import Coded, Table, isin, mapped, recoded
from pi0align.dump.file_format import RANDOM_FUNCTIONS

# kind of culprit by the direction of its call ("parameter": initial_weights or parameters)
# (a call inside the optimizer's step is the optimizer's update, though judged as any call: judge.py)
KIND_OF_DIRECTION = {"forward": "call", "backward": "call", "update": "call", "in_optimizer": "optimizer",
                     "optimizer": "optimizer", "data": "data", "gradient": "gradient"}
PHASES = DIRECTIONS  # a step's parts in execution order


def call_directions(rows: Table) -> Coded:
    """The direction of the call each record belongs to: a parameter's gradient is a call of its own."""
    gradient = rows.isin("role", "parameter_grad")
    return rows.coded("direction").gathered(np.where(gradient, -1, np.arange(len(rows))), "gradient")


def phases(directions: np.ndarray) -> np.ndarray:
    """Each record's or call's phase of its step (the index of its direction in PHASES): a dump
    may number a step's parameters after its backward calls (msprobe's do), yet they came first."""
    index = {direction: i for i, direction in enumerate(PHASES)}
    return mapped(directions, lambda direction: index.get(direction, len(PHASES)), np.int64)


def execution_order(calls: Table) -> np.ndarray:
    """The calls in execution order: by step, the step's phase, then sequence."""
    return np.lexsort((calls["seq_a"], phases(calls.coded("direction")), calls["step"]))


def kinds(calls: Table, first_step: int) -> np.ndarray:
    """Each call's kind: a parameter at step 0 holds the initial weights; later, or at a first
    dumped step past 0, the parameters (what training made of them); a parameter whose update
    was not recorded stands for that update (`optimizer`); a random draw (RANDOM_FUNCTIONS) is
    data: judged as any call (two hosts' kernels round its transform otherwise), one beyond that
    rounding was drawn from another generator state."""
    kind = mapped(calls.coded("direction"), lambda direction: KIND_OF_DIRECTION.get(direction, "parameters"))
    kind[(kind == "call") & isin(recoded(function_name, calls.coded("api")), RANDOM_FUNCTIONS)] = "data"
    kind[(kind == "parameters") & (calls["step"] == 0) & (first_step == 0)] = "initial_weights"
    kind[calls.isin("direction", "parameter") & (calls["previous_step"] >= 0)] = "optimizer"
    return kind

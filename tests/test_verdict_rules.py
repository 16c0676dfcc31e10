"""Every rule that explains a failing row, or keeps a call from being a culprit, against what it
could hide (docs/compare.md, "Bounds" and "Explained rows"): a real difference of the kind the rule
explains, a few times the dtype's limit (or the rule's own bound), placed where the rule applies,
comes out `diverged` with the right culprit. Each of these cases came out `aligned`, or named
another call, before the rule was bounded. Beside them, the judging functions on small
hand-built tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pi0align.compare.judging.calltable.bounds import MARGIN, introduced, reduction_condition, rounding_floor
from pi0align.compare.judging.calltable.calls import CALL_COLUMNS
from pi0align.compare.judging.calltable.channels import elementwise_errors, introduced_by_channel, statistic_channels
from pi0align.compare.judging.explain import _states_after_gap, _undumped_gradients_within, unread_outputs
from pi0align.compare.judging.identity import gradient_sources, tensor_identities
from pi0align.compare.judging.judge import judge, peer_medians
from pi0align.compare.judging.noise import rounding_level
from pi0align.compare.judging.reference import raised_limits
from pi0align.compare.judging.thresholds import DEFAULT_THRESHOLDS, UNIT_ROUNDOFF
from pi0align.compare.judging.verdict import metric_errors, metric_limits
from pi0align.compare.table import Groups, Table
from pi0align.testing.scenarios import Case, ToyRun, play, rule_cases

BF16, FP32 = UNIT_ROUNDOFF["bfloat16"], UNIT_ROUNDOFF["float32"]


CASES = {case.name: case for case in rule_cases()}


@pytest.fixture(scope="module")
def workbench(tmp_path_factory):
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("rules"), {}


def _play(name: str, workbench):
    case = CASES[name]
    result, right = play(case, *workbench)
    culprits = [(c.step, c.kind, c.name, c.evidence) for c in result.culprits[:4]]
    assert right, f"{case.name}: {result.verdict}, culprits {culprits}, notes {result.notes[-2:]}"
    return result


# -- end to end: one case per rule (pi0align.testing.scenarios.rule_cases) ---------------------

@pytest.mark.parametrize("mode", ["stats", pytest.param("tensor", marks=pytest.mark.slow)])
def test_an_update_not_recorded_is_the_culprit_where_the_parameters_part(mode, workbench):
    """msprobe's habit, `start(model)` without `optimizer=`: B's AdamW has eps 1e-4 (A 1e-8); step
    0 agrees bit for bit, the parameters part at step 1. Before: aligned, 0 culprits."""
    result = _play(f"mlp fp32 {mode}: AdamW eps 1e-4, updates not recorded", workbench)
    assert len(result.culprit_groups) == 1
    hint = result.culprit_groups[0].hint
    assert "between step 0 and 1" in hint and "optimizer=" in hint
    assert not _play(f"mlp fp32 {mode}: updates not recorded, same run", workbench).culprits


def test_a_gap_in_the_dumped_steps_names_the_steps_between(workbench):
    hint = _play("mlp fp32 stats: AdamW eps 1e-4, steps 0 and 2 dumped", workbench).culprit_groups[0].hint
    assert "between step 0 and 2" in hint and "steps that were not dumped" in hint


@pytest.mark.parametrize("listed, faulty", [("0, 2 and 4", 1), ("2 and 4", 0)])
def test_what_updates_not_dumped_made_of_noise_is_explained_and_a_gradient_off_among_them_is_not(listed, faulty,
                                                                                                 workbench):
    """A gap in the dumped steps, or a first dumped step past 0: the optimizer's states the next
    dumped update reads were left by updates that were not dumped. Under noise (bf16, every result
    moved by an ulp, by an emulated device that says so in its manifest) they part within what the
    gradients at the gap's ends carry: aligned (before: diverged, a state or a parameter named). A
    gradient 3x fp32's limit off in a step not dumped parts them beyond: that update is named."""
    assert _play(f"mlp bf16 stats: ulp noise, steps {listed} dumped", workbench).explained.get("gap")
    assert not _play(f"transformer fp32 stats: SDPA vs manual, steps {listed} dumped", workbench).culprits
    result = _play(f"transformer fp32 stats: SDPA vs manual + a gradient 3x the limit off at step {faulty}, "
                   f"steps {listed} dumped", workbench)
    assert any("updates that were not dumped" in note for note in result.notes)


@pytest.mark.parametrize("listed, held_by_a_only", [("every step against 2 and 4", "steps 0, 1, 3 held by A only"),
                                                    ("0, 2 and 4 against 1 to 4", "step 0 held by A only")])
def test_runs_dumped_at_other_steps_are_compared_at_the_steps_both_hold(listed, held_by_a_only, workbench):
    """`compare`'s default, "every step both dumps hold": the steps one side alone holds are said,
    not compared. Before, they were: their records listed as one side's only, an optimizer state
    after them judged against an update the other side had not dumped, and bf16 ulp noise came
    out diverged."""
    result = _play(f"mlp bf16 stats: ulp noise, steps {listed} dumped", workbench)
    assert f"{held_by_a_only}: not compared" in result.notes and not result.coverage["only_a"]


def test_parameters_parted_by_the_first_dumped_step_of_runs_that_compute_alike_are_named(workbench):
    """Runs whose manifests say they compute bit for bit alike cannot part by rounding: parameters
    that differ at a first dumped step past 0 are named, with the updates not dumped in the hint."""
    result = _play("mlp fp32 stats: AdamW eps 1e-4, updates not recorded, steps 2 and 3 dumped", workbench)
    assert "dump from step 0" in result.culprit_groups[0].hint


@pytest.mark.parametrize("times", [pytest.param(20, marks=pytest.mark.slow), 5])
def test_a_call_that_amplifies_what_it_was_handed_is_judged_whatever_its_inputs(times, workbench):
    """B's attention is SDPA (another call sequence, fp32 rounding apart), and the next Linear is
    0.2 % (20× the fp32 limit) or 0.05 % (5×) off, statistics only, bit-comparable manifests.
    Before: "diverged, 0 culprits", or aligned. Without the fault: aligned, 0 culprits."""
    result = _play(f"transformer fp32 stats: SDPA vs manual + linear {times}x the limit off", workbench)
    assert result.culprits[0].name == "layers.1.mlp.0/Functional.linear#0"
    assert not _play("transformer fp32 stats: SDPA vs manual attention", workbench).culprits


@pytest.mark.parametrize("function", ["gelu", "layer_norm"])
def test_a_module_is_blamed_for_what_it_ran_that_was_not_dumped(function, workbench):
    """An operation filtered out of the dump (as `torch.ops.*` or an extension kernel would be),
    the module's last or one in its middle, is 5e-4 off (5× the fp32 limit): the module that ran
    it is the culprit. Before: a module holding dumped calls was never blamed (aligned, or
    diverged with no culprit)."""
    result = _play(f"mlp fp32 stats: {function} not dumped, 5x the limit off", workbench)
    assert len(result.culprits) == 1 and result.culprits[0].api == "Module.Sequential"


def test_the_parameter_gradients_of_a_module_not_dumped_are_held_to_the_gradient_entering_its_parent(workbench):
    """A LayerNorm filtered out of the dump, module and all: its parameters' gradients are held to
    the gradient entering the Sequential around it, summed over the batch (the reduction
    condition). bf16 ulp noise: aligned (before: diverged, the bias's gradient bounded by nothing).
    The gradient entering the LayerNorm 2× and 5× the fp32 limit off: its weight's gradient is the
    culprit (before: diverged with no culprit)."""
    for seed in (2, 3):
        assert _play(f"mlp bf16 stats: a LayerNorm not dumped, ulp noise draw {seed}", workbench).verdict == "aligned"
    for times in (2, 5):
        _play(f"mlp fp32 stats: a LayerNorm not dumped, its gradients {times}x the limit off", workbench)


@pytest.mark.parametrize("percent", [2, 5])
def test_a_parameter_gradient_is_what_its_own_readers_sent_where_parameters_hold_the_same_bits(percent, workbench):
    """bf16, ulp noise: every LayerNorm's weight is ones at every step (its updates stay under half
    an ulp), so all of them are one tensor by their bits; one weight's gradient is 2 % or 5 % off
    on its way from its layer_norm (a hook): that gradient is the culprit. Before: aligned, the
    gradient held to what every LayerNorm's layer_norm sent."""
    result = _play(f"mlp bf16 stats: ulp noise + a LayerNorm's weight gradient {percent}% off on its way", workbench)
    assert result.culprits[0].name == "blocks.1.1.weight/Parameter#0"


def test_a_systematic_fault_in_half_precision_is_found(workbench):
    """bf16 under ulp noise, every layer_norm 3 % off (7.7 unit roundoffs): no call stands out from
    its peers, yet the API is off as a family. Before: aligned (the family rule was fp32's)."""
    _play("mlp bf16 stats: ulp noise + every layer_norm 3% off", workbench)


def test_a_linears_gradient_off_under_thread_noise_is_named_from_statistics(workbench):
    """Real PI0 tiny, bf16, statistics only, 1 against 2 threads: aligned; with the action
    expert's up_proj gradient 3 % off, that linear's backward at step 0 is the first divergence.
    Before: aligned, its floor grown by its sum's cancellation (12×) as if a GEMM rounded its
    partial sums in bf16."""
    assert not _play("PI0 tiny bf16 stats: 1 vs 2 threads", workbench).culprits
    _play("PI0 tiny bf16 stats: 2 threads + the expert's up_proj gradient 3% off", workbench)


def test_a_sampled_record_that_differs_carries_its_steps_precision_floor(workbench):
    """Real PI0 tiny, bf16, sample mode, 1 against 2 threads: aligned. A float32 gradient whose
    sampled elements agreed while its norm differed once counted as exact: its sum over the batch
    (the vision embeddings' add backward) was named at 67x its float32 floor, and the update's
    gradient, sampled elsewhere, was judged against it. With the expert's up_proj gradient 3 % off:
    that call is named."""
    assert not _play("PI0 tiny bf16 sample: 1 vs 2 threads", workbench).culprits
    _play("PI0 tiny bf16 sample: 2 threads + the expert's up_proj gradient 3% off", workbench)


def test_a_changed_batch_in_a_dump_without_checksums_or_data_records_is_the_data(workbench):
    """A dump that records neither checksums nor the batch (msprobe's): one sample of step 1's batch
    1 % off. The model's input that no dumped call produced stands for the batch. Before: a GELU
    deep in the model was the top culprit."""
    result = _play("mlp fp32 stats, no checksums or batch records: one sample 1% off at step 1", workbench)
    assert [c.kind for c in result.culprits] == ["data"]


@pytest.mark.parametrize("times", [2, 5])
def test_at_level_module_a_linears_input_gradient_off_is_that_linear_not_its_block(times, workbench):
    """Level module, fp32 under ulp noise: a block's first Linear sends its input gradient back 2e-4
    or 5e-4 off (2× and 5× the fp32 limit). That gradient is also the block's (a Sequential's), whose
    backward row opens first, at its first gradient. Before: the Sequential was named, and the
    Linear, after it in order, counted downstream of it (under noise not named at all)."""
    result = _play(f"mlp fp32 stats, level module: ulp noise + a linear's input gradient {times}x the limit off",
                   workbench)
    assert result.culprits[0].name == "blocks.1.0/Module.Linear#0"


@pytest.mark.parametrize("run, where", [
    (ToyRun(mode="stats", gradient_scaled=("blocks.1.0.weight", 1.0005, 0)), "blocks.1.0.weight/Optimizer.step#0"),
    (ToyRun(mode="stats", module_gradient_scaled=("blocks.1", 1.0005)), "blocks.0.2/Functional.gelu#0"),
    (ToyRun(mode="stats", level="module", module_gradient_scaled=("blocks.1", 1.0005)), "blocks.0.2/Module.GELU#0"),
], ids=["parameter gradient changed before the update", "a module's backward hook", "the same at level module"])
def test_gradients_changed_outside_the_dumped_calls_are_never_explained(run, where, workbench):
    """A gradient changed by 5e-4 (5× the fp32 limit) where no dumped call made it: a parameter's
    gradient between backward and the update, a module's backward hook. Before: gradients flowing
    into calls, parameter gradients and the optimizer's inputs were always `warn`: aligned. Now
    diverged, and, no call being to blame, a note names the record that parted first."""
    result, _ = play(Case("gradient changed", ToyRun(mode="stats", level=run.level), run, "diverged"), *workbench)
    assert result.verdict == "diverged" and not result.culprits
    assert any(where in note and "differs:" in note for note in result.notes), result.notes


def test_an_update_that_moves_a_parameter_beyond_one_step_is_the_culprit(workbench):
    """Under ulp noise (inputs never agree bit for bit), the optimizer leaves one weight 20 % off
    inside its step: beyond what one Adam step can move it. Before: the next step's Linear."""
    result = _play("mlp fp32 stats: ulp noise + one update leaves its weight 20% off", workbench)
    assert {c.name for c in result.culprits} == {"blocks.1.0.weight/Optimizer.step#0"}


def test_replay_names_the_side_whose_update_is_wrong(workbench):
    """B's AdamW kernel computes with eps 1e-4 while its settings (and so its records) say 1e-8:
    each side's update recomputed in float64 from its own records shows B's far off, A's within
    float64 rounding of its own."""
    result = _play("mlp fp32 tensor: AdamW kernel computes with eps 1e-4, its settings say 1e-8", workbench)
    top = result.culprits[0]
    assert (top.evidence, top.wrong_side) == ("replay", "B") and top.local_error_a < 1e-6 < 1e-3 < top.local_error_b
    rows = result.rows
    updates = rows[rows["direction"].eq("optimizer") & rows["role"].eq("output")]
    assert (updates["local_error_a"] < 1e-6).all()  # A's AdamW within float64 rounding of its records


# -- the judging functions on hand-built tables -----------------------------------------------

def _calls(**columns) -> Table:
    """A calls table (calls.CALL_COLUMNS) of len(columns' arrays) forward API calls, one
    each of distinct APIs unless given; its floor and introduced_error from its errors, as
    call_table does."""
    n = len(next(iter(columns.values())))
    unit = np.asarray(columns.pop("unit", np.full(n, FP32)), np.float64)
    columns["unit"] = unit
    defaults = {
        "rank": np.zeros(n, np.int64), "step": np.zeros(n, np.int64), "direction": np.full(n, "forward", object),
        "kind": np.full(n, "call", object), "seq_a": np.arange(n),
        "name": np.array([f"m/F.f{i}#0" for i in range(n)], object),
        "module": np.full(n, "m", object), "api": np.array([f"Functional.f{i}" for i in range(n)], object),
        "input_error": np.zeros(n), "output_error": np.zeros(n), "inputs_pass": np.ones(n, bool),
        "outputs_fail": np.ones(n, bool), "condition": np.ones(n), "condition_rule": np.full(n, "", object),
        "invariant_error": np.zeros(n),
        "metric": np.full(n, "rel_l2_err", object), "local_error_a": np.full(n, np.nan),
        "local_error_b": np.full(n, np.nan), "unit_a": unit, "unit_b": unit, "replay": np.full(n, "", object),
        "args_differ": np.zeros(n, bool), "inputs_identical": np.zeros(n, bool), "outputs_differ": np.ones(n, bool),
        "inside_error": np.zeros(n), "inside_bound": np.zeros(n), "with_calls_inside": np.zeros(n, bool),
        "sourced": np.ones(n, bool), "previous_step": np.full(n, -1, np.int64), "step_bound": np.full(n, np.nan),
        "parameter_error": np.full(n, np.nan),
    }
    table = Table({**defaults, **{k: np.asarray(v) for k, v in columns.items()}})
    table["floor"] = rounding_floor(table["unit"], table["condition"], table["condition_rule"], table["api"])
    table["bound_condition"] = table["condition"]
    table["introduced_error"] = introduced(table["output_error"], table["input_error"], table["condition"],
                                           table["floor"])
    return table.select(CALL_COLUMNS)


def test_amplification_is_judged_when_the_inputs_already_differ():
    """A 3 % fault on an input already 0.5 % off (bf16): 6× more error out than in, a culprit;
    the rule it replaces asked for 10×. The same call passing its input's error on is none."""
    calls = _calls(input_error=[5e-3, 5e-3], output_error=[np.hypot(5e-3, 3e-2), 5.2e-3], unit=[BF16, BF16],
                   inputs_pass=[False, False])
    assert list(judge(calls, "intrinsic").culprit) == [True, False]


def test_no_call_is_a_culprit_within_its_rounding_floor():
    """bf16: an output error of 3.9 unit roundoffs from exact inputs is rounding (floor 2 u, one
    ulp, × MARGIN); 4.5 u is not (a 2 % fault is 5.1 u). float32: the floor is 16 u, far below
    any failing row."""
    calls = _calls(output_error=[3.9 * BF16, 4.5 * BF16, 1.5e-4], unit=[BF16, BF16, FP32])
    assert list(judge(calls, "intrinsic").culprit) == [False, True, True]


def test_a_linear_is_judged_through_its_condition():
    """A Linear whose output cancels (C = 8, measured from the norms) may turn 1e-4 in into 1.5e-3
    out (within 2 × 8 × 1e-4), not 2e-3."""
    calls = _calls(input_error=[1e-4, 1e-4], output_error=[1.5e-3, 2e-3], condition=[8.0, 8.0],
                   api=["Functional.linear", "Functional.matmul"])
    judgement = judge(calls, "intrinsic")
    assert list(judgement.culprit) == [False, True] and judgement.within[0] == "bound"


def test_a_matmuls_rounding_does_not_grow_with_its_cancellation_in_half_precision():
    """A linear's gradient in bf16 from identical inputs: its sum over positions cancels (C = 12),
    but a GEMM accumulates in float32 and rounds once, so 3 % is no rounding (before: its floor was
    2 u × 12 = 9 %, and PI0's expert up_proj gradient 3 % off came out aligned). A layer_norm's
    gradient sum may round partial sums in bf16 (torch's CPU kernel, 2.7 % apart at 1 and 2
    threads): C grows its floor. In float32 the floor grows with C for both. A Linear module is
    its linear (msprobe's dumps may hold the module's backward alone)."""
    calls = _calls(output_error=[0.03, 0.027, 2e-3, 0.03], condition=[12.0, 6.0, 12.0, 12.0],
                   unit=[BF16, BF16, FP32, BF16], condition_rule=["gradient sum"] * 4, direction=["backward"] * 4,
                   inputs_identical=[True] * 4,
                   api=["Functional.linear", "Functional.layer_norm", "Functional.linear", "Module.Linear"])
    assert list(calls["floor"]) == [2 * BF16, 2 * BF16 * 6.0, 16 * FP32 * 12.0, 2 * BF16]
    assert list(judge(calls, "intrinsic").culprit) == [True, False, True, True]


def test_an_update_is_held_to_the_rounding_of_its_operations(workbench):
    """bf16 full tensors, every result moved by up to an ulp (another draw than the scoreboard's
    own), replayed: a bias's update came 3.5 u from float64, against 0.4 u without the noise, as
    its parameter is rounded twice (decayed, then stepped). Its floor is two roundings: aligned.
    Before: diverged, that update named as B's fault."""
    assert not _play("mlp bf16 tensor: ulp noise, another draw", workbench).culprits
    floors = rounding_floor(np.full(2, BF16), np.ones(2), np.array(["", ""], object),
                            np.array(["Optimizer.step", "Functional.gelu"], object))
    assert list(floors) == [4 * BF16, 2 * BF16]


@pytest.mark.parametrize("noise", ["mlp bf16 stats: ulp noise, draw 3, no noise reference",
                                   "mlp bf16 stats: ulp noise, draw 8, no noise reference",
                                   "transformer bf16 stats: ulp noise, draw 5, no noise reference"])
def test_the_extremes_of_noise_are_explained_by_the_spread_of_the_inputs(noise, workbench):
    """bf16 statistics under ulp noise, without a noise reference: an extreme is one element and
    moves with the elements' noise, which a norm and a mean sum away. Before, each call's output
    was judged by its largest statistic against its inputs' largest, and an extreme of the noise
    named a gelu's gradient, the head or an attention matmul's gradient (7 draws of 24): now the
    extremes are judged against the spread the inputs may carry, √N × their summed error. A fault
    that scales a result still moves its norm: the scoreboard's faults, and the hand-built rows."""
    assert not _play(noise, workbench).culprits


def test_the_attention_scores_off_are_found_through_their_condition_per_product(workbench):
    """bf16 statistics under ulp noise, the toy transformer's attention scores (q kᵀ, 4 × 4 heads)
    3 % off: named at step 0. Before, the scores' condition, read from the whole batch's norms, was
    4 (√16) where nothing cancels, and a fault up to 6 % hid under it (aligned). The noise alone
    stays aligned (the scoreboard's cases, and 16 draws without a noise reference)."""
    _play("transformer bf16 stats: ulp noise + the attention scores 3% off", workbench)


def test_a_gradient_off_in_its_norm_is_found_whatever_noise_moved_the_extremes_it_reads(workbench):
    """bf16 statistics under ulp noise, a linear's gradient 3 % off: noise moved its incoming
    gradient's min 3 % (its norm 0.4 %), which as the call's input error held every result to
    2 × 1.8 × 3 % (before: aligned in three to six draws of six). Its results' norms, which noise moves √N
    times less than their elements, are judged against that noise too: named."""
    _play("mlp bf16 stats: ulp noise + a linear's gradient 3% off", workbench)


def test_a_linears_gradient_is_found_whatever_its_bias_gradient_sums(workbench):
    """bf16 statistics under ulp noise, the toy transformer's MLP linear's gradient 2 % off: its
    bias gradient sums with C = 3.7, and held to that one C every result was within (aligned in
    six draws of six at 2, 3 and 5 %). Each result held to its own C (dX = G W: 1): named."""
    _play("transformer bf16 stats: ulp noise + an MLP linear's gradient 2% off", workbench)


def test_the_channels_of_statistics_on_hand_built_rows():
    """The head of the toy MLP under bf16 ulp noise at step 1: its input's norm 0.08 % off (768
    elements, 2 % apart each: √768 × 0.08 %), its output's min 2.7 % off: within the spread. Its
    output 3 % off in the norm, a fault's scale, or 20 % off in an extreme: beyond. The same in
    float32 (TF32 inputs' elements spread apart): beyond, as before."""
    nan = np.nan
    rows = Table({"rel_l2_err": np.array([nan, nan, 0.01]), "norm_rel_err": np.array([7.65e-4, 1.3e-3, nan]),
                  "mean_val_rel_err": np.array([1.2e-4, 3.3e-3, nan]), "min_rel_err": np.array([3.5e-4, 0.0266, nan]),
                  "max_val_rel_err": np.array([5.6e-3, 5.3e-3, nan]),
                  "shape_a": np.array(["[16, 48]", "[16, 8]", "[4]"], object)})
    summed, extremes, spread = statistic_channels(rows)
    assert list(summed) == [7.65e-4, 3.3e-3, 0.01]
    assert list(extremes[:2]) == [5.6e-3, 0.0266] and np.isnan(extremes[2]) and np.isnan(spread[2])
    assert spread[0] == pytest.approx(np.sqrt(768) * 7.65e-4)
    floor = 2 * BF16
    calls = _channel_calls(4, input_error=floor, input_spread=spread[0], unit=np.array([BF16] * 3 + [FP32]))
    results = _results(np.arange(4), summed=[3.3e-3, 0.03, 3.3e-3, 3.3e-3], extremes=[0.0266, 0.03, 0.2, 0.0266])
    # in float32 rounding's spread is within the floor: elements apart beyond it are no rounding
    assert list(introduced_by_channel(calls, results)[0] > MARGIN) == [False, True, True, True]


def test_each_result_is_held_to_its_own_condition():
    """A linear's backward, bf16 statistics: its input gradient 5 % off (C = 1 for dX = G W), its
    bias gradient, a sum that cancels (C = 3.7), as far off. Held to the call's one C, the largest,
    the input gradient was within 2 × 3.7 × its inputs' 0.8 %; held to its own, it is beyond, and
    the bound it broke is its own. The bias gradient alone as far off stays within its C."""
    floor = 2 * BF16
    calls = _channel_calls(2, input_error=floor, condition=3.7, condition_rule="gradient sum")
    both = _results([0, 0, 1, 1], summed=[0.05, 0.05, 0.0, 0.05], condition=[1.0, 3.7, 1.0, 3.7])
    introduced, bound_condition = introduced_by_channel(calls, both)
    assert list(introduced > MARGIN) == [True, False] and list(bound_condition) == [1.0, 3.7]
    without_own = _results([0, 0], summed=[0.05, 0.05], condition=[np.nan, np.nan])
    assert introduced_by_channel(calls.take(np.array([0])), without_own)[0][0] < MARGIN


def _channel_calls(n: int, **columns) -> Table:
    """Calls as introduced_by_channel reads them: a linear of bf16 results, C = 1.17, inputs
    without error or spread unless given."""
    defaults = {"group": np.arange(n), "condition": 1.17, "condition_rule": "", "api": "Functional.linear",
                "input_error": 0.0, "input_spread": 0.0, "input_summed": 2 * BF16, "unit": BF16,
                "condition_extremes": np.nan}
    return Table({k: np.broadcast_to(np.asarray(v, object if isinstance(v, str) else None), (n,)).copy()
                  for k, v in {**defaults, **columns}.items()})


def _results(call, summed, extremes=None, condition=None) -> Table:
    """Results as introduced_by_channel reads them: each its call, its summed and extreme errors,
    128 elements, its own condition (NaN: its call's)."""
    n = len(call)
    return Table({"call": np.asarray(call), "summed": np.asarray(summed, float),
                  "extremes": np.zeros(n) if extremes is None else np.asarray(extremes, float),
                  "numel": np.full(n, 128.0), "condition": np.full(n, np.nan) if condition is None else
                  np.asarray(condition, float), "condition_extremes": np.full(n, np.nan)})


def test_a_call_beyond_its_bound_at_every_step_is_a_culprit_whatever_its_peers(workbench):
    """bf16 statistics only, ulp noise of another draw, a gelu 3 % off: 2.7x its bound at both
    steps, under 4x its peers' median. Noise puts a call beyond its bound now and then, a faulty
    kernel each time it runs: named. Before: aligned. A call beyond at one step of two is not."""
    _play("mlp bf16 stats: ulp noise of another draw + gelu 3% off", workbench)
    peers = [f"m/F.f#{i}" for i in range(8)]
    calls = _calls(step=[0, 1] + [0] * 8 + [1] * 8, name=["m/F.f#9"] * 2 + peers * 2, unit=[BF16] * 18,
                   api=["Functional.f"] * 18, output_error=[2.7 * 2 * BF16] * 2 + [2 * BF16] * 16,
                   metric=["stats_rel_err"] * 18)
    assert list(np.flatnonzero(judge(calls, "intrinsic").culprit)) == [0]  # step 1's inherits it
    calls["output_error"][1] = 2 * BF16
    calls["introduced_error"][1] = 1.0
    assert not judge(calls, "intrinsic").culprit.any()


def test_peers_do_not_hide_an_api_off_as_a_whole_in_half_precision():
    """Six layer_norm calls each 3 % off in bf16, all alike: off as a family, all culprits."""
    calls = _calls(input_error=np.full(6, 1e-3), output_error=np.full(6, 3e-2), unit=np.full(6, BF16),
                   api=np.full(6, "Functional.layer_norm", object))
    assert judge(calls, "intrinsic").culprit.all()
    calm = _calls(input_error=np.full(6, 1e-3), output_error=np.r_[np.full(5, 1.2e-3), 3e-2], unit=np.full(6, BF16),
                  api=np.full(6, "Functional.layer_norm", object))
    assert list(judge(calm, "intrinsic").culprit) == [False] * 5 + [True]  # one stands out


@pytest.mark.parametrize("metric, named", [("rel_l2_err", True), ("stats_rel_err", False)])
def test_a_call_stands_out_from_its_peers_by_the_spread_of_the_measure_it_was_judged_by(metric, named):
    """Five gelu calls each introducing 1.1× their bound under noise and one 2.6× (3 % off in bf16
    on an input 1.3 % off): judged by full tensors, whose errors spread 1.5× at most around their
    median under noise, it stands out (2×); judged by statistics, which spread up to 2.8×, it does
    not (4×)."""
    gelu = dict(api=np.full(6, "Functional.gelu", object), unit=np.full(6, BF16), metric=np.full(6, metric, object))
    calls = _calls(input_error=np.full(6, 1.3e-2), output_error=np.r_[np.full(5, 1.47e-2), 3.4e-2], **gelu)
    assert list(judge(calls, "intrinsic").culprit) == [False] * 5 + [named]


def test_a_module_is_judged_by_what_entered_it_from_no_dumped_call():
    module = dict(api=["Module.Block"], with_calls_inside=[True], input_error=[1e-8], output_error=[5e-4])
    assert judge(_calls(**module, inside_error=[5e-4]), "intrinsic").culprit[0]
    held = judge(_calls(**module, inside_error=[0.0]), "intrinsic")
    assert not held.culprit[0] and held.within[0] == "inside"


def test_an_update_is_bounded_by_one_step_of_its_optimizer():
    """Adam's update is scale-free: one update far beyond its inputs' error, alone in its step,
    is explained while it stays within one step (`step`), a culprit beyond it."""
    n = 6
    common = dict(kind=np.full(n, "optimizer", object), direction=np.full(n, "optimizer", object),
                  api=np.full(n, "Optimizer.step", object), input_error=np.full(n, 1e-6),
                  output_error=np.r_[1e-3, np.full(n - 1, 1e-6)], step_bound=np.full(n, 2e-3))
    within = judge(_calls(**common, parameter_error=np.r_[1e-3, np.full(n - 1, 1e-6)]), "intrinsic")
    assert not within.culprit.any() and within.within[0] == "step"
    beyond = judge(_calls(**common, parameter_error=np.r_[5e-3, np.full(n - 1, 1e-6)]), "intrinsic")
    assert list(beyond.culprit) == [True] + [False] * (n - 1)


def _gap_rows(norm_at_end: float = 0.1, dumped_before: int = 0) -> Table:
    """A parameter's Adam update at step `dumped_before` (its gradient in, exp_avg and exp_avg_sq
    out) and at step 2 (gradient, exp_avg and exp_avg_sq in), and its gradients at both steps,
    float32; exp_avg signed with norm 0.1 (`norm_at_end` at step 2), exp_avg_sq of no negative element."""
    step = [dumped_before] * 3 + [2] * 3 + [dumped_before, 2]
    direction = ["optimizer"] * 6 + ["parameter"] * 2
    role = ["input", "output", "output", "input", "input", "input", "parameter_grad", "parameter_grad"]
    name = ["w/Optimizer.step#0"] * 6 + ["w/Parameter#0"] * 2
    n = len(step)
    return Table({"step": np.array(step), "rank": np.zeros(n, np.int64), "name": np.array(name, object),
                  "direction": np.array(direction, object), "role": np.array(role, object),
                  "arg_index": np.array([1, 2, 3, 1, 2, 3, 0, 0]), "min_a": np.array([-1.0, -1, 0, -1, -1, 0, -1, -1]),
                  "min_b": np.array([-1.0, -1, 0, -1, -1, 0, -1, -1]),
                  "norm_a": np.array([1.0, 0.1, 0.01, 1.0, norm_at_end, 0.01, 1.0, 1.0]),
                  "norm_b": np.array([1.0, 0.1, 0.01, 1.0, norm_at_end, 0.01, 1.0, 1.0]),
                  "update_step": np.r_[np.full(6, 1e-3), np.nan, np.nan], "dtype_a": np.full(n, "float32", object),
                  "dtype_b": np.full(n, "float32", object), "dtype_class": np.full(n, "float32", object),
                  "checksum_a": np.arange(n), "checksum_b": np.arange(n) + n},
                 length=n)


@pytest.mark.parametrize(("m_error", "v_error", "explained"), [(1.5e-3, 3e-4, [True, True]),
                                                                (3e-3, 5e-4, [False, False])])
def test_states_after_steps_not_dumped_are_bounded_by_the_gaps_ends(m_error, v_error, explained):
    """exp_avg (signed): max(e_s ‖s‖, e_g G) / ‖s'‖ = max(1e-5, 1e-4) / 0.1 = 1e-3; exp_avg_sq (no
    negative element): max(e_s, 2 e_g + e_g²) ≈ 2e-4; each within M = 2 times that."""
    rows = _gap_rows()
    error = np.r_[1e-4, 1e-4, 1e-4, 1e-4, m_error, v_error, 1e-4, 1e-4]
    fine = np.array([True, True, True, True, False, False, True, True])
    got = _states_after_gap(rows, fine, error, error, np.zeros(8, bool), None, noisy_start=False)
    assert list(got[4:6]) == explained and not got[:4].any()


def test_a_gap_whose_gradients_are_rounding_noise_explains_its_states_and_nothing_else_does():
    """A gradient at rounding level carries noise alone (1 + ‖g_B‖ / ‖g_A‖ = 2): the states made of
    it may part by anything. The update of the step before dumped: not this rule's. A state of
    zero norm on A: no relative bound. Nothing dumped before, runs that compute alike: none."""
    error = np.r_[1e-4, 1e-4, 1e-4, 1e-4, 0.9, 0.9, 1e-4, 1e-4]
    fine = np.array([True, True, True, True, False, False, True, True])
    noise = np.zeros(8, bool)
    noise[6] = True  # the gradient at step 0
    assert _states_after_gap(_gap_rows(), fine, error, error, noise, None, False)[4:6].all()
    assert not _states_after_gap(_gap_rows(dumped_before=1), fine, error, error, noise, None, False).any()
    assert not _states_after_gap(_gap_rows(norm_at_end=0.0), fine, error, error, noise, None, False)[4]
    alone = _gap_rows().take(np.array([3, 4, 5, 7]))
    assert not _states_after_gap(alone, fine[[3, 4, 5, 7]], error[[3, 4, 5, 7]], error[[3, 4, 5, 7]],
                                 np.zeros(4, bool), None, noisy_start=False).any()
    assert _states_after_gap(alone, fine[[3, 4, 5, 7]], np.r_[1e-4, 1e-4, 1e-4, 1e-4], np.r_[1e-4, 1e-4, 1e-4, 1e-4],
                             np.zeros(4, bool), None, noisy_start=True)[1:3].all()


def test_statistics_judge_by_bits_downstream_of_a_culprit():
    """After a culprit, a call judged by statistics that seems to amplify what it was handed is
    no culprit of its own (a LayerNorm's statistics hide its elements' error); by its bits, in
    bit-comparable runs, it still is."""
    calls = _calls(input_error=[0.0, 1e-4, 1e-4], output_error=[3e-2, 1e-3, 1e-3],
                   metric=np.full(3, "stats_rel_err", object), inputs_identical=[True, False, True])
    assert list(judge(calls, "intrinsic").culprit) == [True, False, False]
    assert list(judge(calls, "intrinsic", exact=True).culprit) == [True, False, True]


def _gradient_rows(norms_a: list[float], dtype: str) -> Table:
    """One backward call's gradients: grad_output, then grad_input 0, 1, … (norms on A; B's 1 % apart)."""
    n = len(norms_a)
    roles = ["grad_output"] + ["grad_input"] * (n - 1)
    return Table({"role": np.array(roles, object), "rank": np.zeros(n, np.int64), "step": np.zeros(n, np.int64),
                  "direction": np.full(n, "backward", object), "seq_a": np.zeros(n), "module": np.full(n, "m", object),
                  "name": np.full(n, "m/F.linear#0", object), "norm_a": np.array(norms_a),
                  "norm_b": np.array(norms_a) * 1.01, "dtype_a": np.full(n, dtype, object),
                  "dtype_b": np.full(n, dtype, object), "dtype_class": np.full(n, dtype, object)})


def test_rounding_level_is_counted_in_unit_roundoffs():
    """float32: a gradient 1e-5 of its call's largest is computed, not rounding (below 64 u, 3.8e-6,
    would be); the rule it replaces took everything under 1e-4 of the largest, 1,700 u, for noise.
    In bf16 one unit roundoff of the largest."""
    rows = _gradient_rows([1.0, 1.0, 1e-5, 1e-6], "float32")
    assert list(rounding_level(rows, np.full(4, "fail", object))) == [False, False, False, True]
    rows = _gradient_rows([1.0, 1.0, 3e-3, 5e-3], "bfloat16")
    assert list(rounding_level(rows, np.full(4, "fail", object))) == [False, False, True, False]


def test_near_zero_records_of_the_noise_reference_lift_no_limits():
    """A reference record at rounding level beside its call's largest differs by ~100 % from A by
    rounding alone; it lifted the limits of nine calls to 400 %. Now the envelope comes from the
    rest: a row 5× the fp32 limit off beside it still fails."""
    n = 4  # one call: a large output, a near-zero one; and the call after it
    reference = Table({"rank": np.zeros(n, np.int64), "step": np.zeros(n, np.int64),
                       "direction": np.full(n, "forward", object), "seq_a": np.array([0.0, 0.0, 1.0, 1.0]),
                       "norm_a": np.array([1.0, 1e-12, 1.0, 1.0]), "dtype_a": np.full(n, "float32", object),
                       "dtype_b": np.full(n, "float32", object), "dtype_class": np.full(n, "float32", object),
                       "pairing": np.full(n, "matched", object),
                       **{m: np.array([1e-7, 1.0, 1e-7, 1e-7]) for m in ("rel_l2_err", "norm_rel_err",
                                                                          "mean_val_rel_err", "min_rel_err",
                                                                          "max_val_rel_err")},
                       "nan_inf_mismatch": np.zeros(n), "cosine": np.ones(n)})
    rows = reference.select(list(reference.columns))
    limits = raised_limits(rows, metric_limits(rows, DEFAULT_THRESHOLDS), reference, metric_errors(reference))
    assert (limits["rel_l2_err"] == DEFAULT_THRESHOLDS["float32"]["rel_l2_err"]).all()
    assert (5e-4 > limits["rel_l2_err"]).all()


def test_a_gradient_sum_is_bounded_by_what_its_readers_sent():
    """A tensor read by two calls: the gradient flowing into its producer is the sum of theirs, so
    its relative error is at most Σ e_i ‖g_i‖ / ‖g‖; a module around a reader reads the same
    tensor and adds nothing (autograd sums the innermost's)."""
    n = 6
    role = ["output", "input", "input", "input", "grad_input", "grad_input"]
    rows = Table({"rank": np.zeros(n, np.int64), "step": np.zeros(n, np.int64),
                  "direction": np.array(["forward"] * 4 + ["backward"] * 2, object), "role": np.array(role, object),
                  "name": np.array(["p/F.a#0", "r/F.b#0", "s/F.c#0", "s/Module.S#0", "r/F.b#0", "s/F.c#0"], object),
                  "api": np.array(["Functional.a", "Functional.b", "Functional.c", "Module.S", "Functional.b",
                                   "Functional.c"], object),
                  "module": np.array(["p", "r", "s", "s", "r", "s"], object), "arg_index": np.zeros(n, np.int64),
                  "shape_a": np.full(n, "[4]", object), "dtype_a": np.full(n, "float32", object),
                  "pairing": np.full(n, "matched", object), "checksum_a": np.array([7, 7, 7, 7, 1, 2]),
                  "checksum_b": np.array([8, 8, 8, 8, 3, 4]), "norm_a": np.array([1.0, 1.0, 1.0, 1.0, 2.0, 1.0])})
    incoming = Table({"rank": np.zeros(1, np.int64), "step": np.zeros(1, np.int64),
                      "direction": np.array(["backward"], object), "role": np.array(["grad_output"], object),
                      "name": np.array(["p/F.a#0"], object), "api": np.array(["Functional.a"], object),
                      "module": np.array(["p"], object), "arg_index": np.zeros(1, np.int64),
                      "shape_a": np.array(["[4]"], object), "dtype_a": np.array(["float32"], object),
                      "pairing": np.array(["matched"], object), "checksum_a": np.array([5]),
                      "checksum_b": np.array([6]), "norm_a": np.array([2.5])})
    rows = Table.concat([rows, incoming])
    for side in "ab":
        for stat in ("min", "max", "mean"):
            rows[f"{stat}_{side}"] = np.full(len(rows), np.nan)
    rows["norm_b"] = rows["norm_a"]
    error = np.array([0, 0, 0, 0, 1e-3, 4e-3, 0.0])
    bound, _ = gradient_sources(rows, tensor_identities(rows), error, np.zeros(len(rows), bool))
    assert bound[-1] == pytest.approx((1e-3 * 2.0 + 4e-3 * 1.0) / 2.5)
    assert MARGIN * bound[-1] < 6e-3  # a gradient 6e-3 off there is not explained


def test_reduction_conditions_cover_a_sum_that_cancels():
    # a bias gradient summing 16 positions: random terms (‖g‖ ≈ ‖G‖) give 4, a cancelling sum more
    assert reduction_condition(1.0, 16 * 48, 1.0, 48) == pytest.approx(4.0)
    assert reduction_condition(1.0, 16 * 48, 0.1, 48) == pytest.approx(40.0)
    assert reduction_condition(1.0, 48, 2.0, 48) == 1.0


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0, 3.0, float("nan")]) | st.floats(-1e3, 1e3),
                          st.integers(0, 2), st.sampled_from("abcd")), max_size=30))
def test_the_median_of_a_names_peers_is_nanmedian_of_its_familys_other_names(rows):
    """stands_out's median of an API's calls under other names, taken from each family's sorted
    values less a name's own (repeated values, NaN, families and names of any size), is
    np.nanmedian of the rest; its peers, the family's rows under other names."""
    values = np.array([value for value, _, _ in rows], np.float64)
    families = np.array([family for _, family, _ in rows], np.int64)
    names = np.array([name for _, _, name in rows], object)
    got, peers = peer_medians(values, Groups(families).codes, names)
    for i, (_, family, name) in enumerate(rows):
        rest = values[(families == family) & (names != name)]
        expected = np.nanmedian(rest) if len(rest) and not np.isnan(rest).all() else np.nan
        assert got[i] == expected or (np.isnan(got[i]) and np.isnan(expected)), (i, rows)
        assert peers[i] == len(rest)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_at_level_module_noise_through_what_was_not_dumped_is_aligned(model, workbench):
    """At level module the loss's gradient (computed after the model) and the arithmetic between
    child modules (residual sums, attention's scores and softmax) are not dumped. bf16 noise alone,
    no noise reference: aligned, the loss's gradient within what the code that sent it back could
    read. Before: the MLP diverged (that gradient unbounded), the transformer named a Layer (its
    residual sum held to its inputs' error alone, where what it added was already 1-2 % apart in its
    extremes)."""
    result = _play(f"{model} bf16 stats, level module: ulp noise, no noise reference", workbench)
    assert result.explained.get("sent_back")


@pytest.mark.parametrize("model,dtype,times", [("mlp", "bf16", 5), ("mlp", "fp32", 2), ("transformer", "bf16", 5),
                                               ("transformer", "fp32", 2)])
def test_a_loss_off_after_the_model_is_named_where_its_gradient_enters(model, dtype, times, workbench):
    """The loss scaled (a loss scaler, a reduction gone wrong) under ulp noise, 2× (fp32) and 5×
    (bf16: its statistics' floor is 2 ulps, 0.8 %) the limit: beyond what the output's error
    explains, so diverged at the head's backward; the note says the gradient came from code that
    was not dumped and what to do."""
    result = _play(f"{model} {dtype} stats, level module: ulp noise + the loss {times}x the limit off", workbench)
    note = next(note for note in result.notes if note.startswith("no call introduces error beyond noise"))
    assert "head/Module.Linear#0" in note and "forward output no dumped call read" in note
    assert "level mix" in note and "--noise" in note


@pytest.mark.parametrize("dtype,times", [("bf16", 5), ("fp32", 2)])
def test_at_level_module_arithmetic_off_between_child_modules_is_their_parent(dtype, times, workbench):
    """Attention's softmax, not dumped at level module, off under ulp noise: its module is the
    culprit, held to the errors of its input and of its calls' outputs before the softmax."""
    result = _play(f"transformer {dtype} stats, level module: ulp noise + attention's softmax {times}x the limit off",
                   workbench)
    assert result.culprits[0].name == "layers.1.attention/Module.Attention#0"


def _undumped_rows(gradient_norm_error: float, sent_back_norm_error: float) -> Table:
    """Level module, float32 statistics: a module `m.a` (output: tensor 9, 1e-5 off in its norm)
    whose output no dumped call read, and a module `m.b` that ran after it; in backward `m.b` sends
    a gradient back (`sent_back_norm_error` off) into the code between them, which sends one back
    into `m.a` (`gradient_norm_error` off); the parent `m`'s backward row opens first, its input's
    gradient 1 off (made after `m.a`'s)."""
    n = 6
    stats = {"norm_rel_err": np.array([1e-5, 1e-5, 1e-5, 1.0, sent_back_norm_error, gradient_norm_error]),
             **{k: np.zeros(n) for k in ("mean_val_rel_err", "min_rel_err", "max_val_rel_err")}}
    return Table({"rank": np.zeros(n, int), "step": np.zeros(n, int),
                  "name": np.array(["m/Module.M#0", "m.a/Module.A#0", "m.b/Module.B#0", "m/Module.M#0",
                                    "m.b/Module.B#0", "m.a/Module.A#0"], object),
                  "module": np.array(["m", "m.a", "m.b", "m", "m.b", "m.a"], object),
                  "api": np.array(["Module.M", "Module.A", "Module.B", "Module.M", "Module.B", "Module.A"], object),
                  "direction": np.array(["forward"] * 3 + ["backward"] * 3, object),
                  "role": np.array(["output", "output", "output", "grad_input", "grad_input", "grad_output"], object),
                  "seq_a": np.array([0, 1, 2, 3, 4, 5]), "arg_index": np.zeros(n, int),
                  "shape_a": np.full(n, "[64]", object), "dtype_a": np.full(n, "torch.float32", object),
                  "dtype_b": np.full(n, "torch.float32", object), "dtype_class": np.full(n, "float32", object),
                  "rel_l2_err": np.full(n, np.nan),
                  "checksum_a": np.arange(n), "checksum_b": np.arange(n) + 100, "identical": np.zeros(n, bool),
                  "evidence": np.full(n, "statistics", object), **stats})


def test_real_pi0_at_level_module_is_aligned_under_thread_noise_and_its_faults_named(workbench):
    """Real PI0 tiny in bf16 at level module, 1 against 2 threads: aligned; with the action
    expert's up_proj gradient 3 % off, that Linear; with the first layer's attention weights times
    V 3 % off (a matmul between modules, not dumped), the module that ran it."""
    assert not _play("PI0 tiny bf16 stats, level module: 1 vs 2 threads", workbench).culprits
    _play("PI0 tiny bf16 stats, level module: 2 threads + the expert's up_proj gradient 3% off", workbench)
    _play("PI0 tiny bf16 stats, level module: 2 threads + attention's weights times V 3% off", workbench)


def test_a_gradient_from_code_not_dumped_is_held_to_what_that_code_could_read():
    """Hand-built rows (_undumped_rows): the gradient into `m.a` is held to 2 × the larger of its
    output's error and that of the gradient `m.b` sent back before it, not the parent's (made after
    it), only where both pass or are explained, and never through a gradient at rounding level (no
    source: NaN). Where the parent returned `m.a`'s output as its own, what read it ran outside `m`,
    and `m.b`'s gradient is no source."""
    identity = np.array([-1, 9, 8, -1, -1, -1])
    fine = np.array([True, True, True, False, True, False])
    for gradient, sent_back, explained in ((1.5e-5, 1e-6, True), (3e-5, 1e-6, False), (3e-5, 2e-5, True),
                                           (5e-5, 2e-5, False)):
        rows = _undumped_rows(gradient, sent_back)
        errors = elementwise_errors(rows)
        assert _undumped_gradients_within(rows, identity, errors, fine).tolist() == [False] * 5 + [explained]
    rows = _undumped_rows(1.5e-5, 1e-6)
    unexplained_output = np.array([True, False, True, False, True, False])
    assert not _undumped_gradients_within(rows, identity, elementwise_errors(rows), unexplained_output)[5]
    rows = _undumped_rows(3e-5, 2e-5)
    rounding = np.array([False, False, False, False, True, False])
    assert not _undumped_gradients_within(rows, identity, np.where(rounding, np.nan, elementwise_errors(rows)),
                                          fine)[5]
    returned_by_the_parent = np.array([9, 9, 8, -1, -1, -1])
    assert not _undumped_gradients_within(rows, returned_by_the_parent, elementwise_errors(rows), fine)[5]


def test_an_output_is_unread_only_where_no_forward_input_holds_its_tensor():
    """Hand-built rows: a call's output (tensor 7) read by the next call, another's (tensor 9) by
    none; their backward rows' incoming gradients."""
    rows = Table({"rank": np.zeros(6, int), "step": np.zeros(6, int),
                  "name": np.array(["a", "b", "b", "c", "a", "c"], object),
                  "direction": np.array(["forward", "forward", "forward", "forward", "backward", "backward"], object),
                  "role": np.array(["output", "input", "output", "output", "grad_output", "grad_output"], object),
                  "arg_index": np.zeros(6, int)})
    identity = np.array([7, 7, 8, 9, -1, -1])
    assert unread_outputs(rows, identity).tolist() == [-1, -1, -1, -1, -1, 3]
    assert (unread_outputs(rows, np.array([7, 7, 8, -1, -1, -1])) == -1).all()  # its tensor not known: not said

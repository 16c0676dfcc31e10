"""The verdict's scoreboard: emulated devices (ulp noise, TF32 matmuls, one faulty call or its
gradient, SDPA against manual attention) on toy models, runs that differ in the optimizer's eps,
one sample of the batch, the seed or the dtype, a difference placed where each explanation rule
applies (rule_cases), and real PI0 with 1 against 2 threads, each compared the way a user would: as
dumped (with its noise reference or replay), and from statistics alone (the same runs dumped in
stats mode, no reference, no replay: the intrinsic rule, as msprobe's statistics dumps are judged),
and, for full tensors, without replay (`--no-replay`). Prints per case the verdict of each and
whether it is right, with the first divergence and top culprit group where it is not; a benchmark
to read, not a test (tests/test_verdict.py and tests/test_verdict_rules.py assert the acceptance
cases).

    .venv/bin/python bench/verdict_quality.py [--pi0] [--work DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pi0align.testing.scenarios import pi0_cases, play, rule_cases, statistics_only, toy_cases, without_replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pi0", action="store_true", help="also the real PI0 small cases (minutes)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the dumps (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = toy_cases() + rule_cases() + (pi0_cases() if args.pi0 else [])
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        made: dict = {}
        labels = ("as dumped", "statistics only", "full tensors, no replay")
        print(f"{'case':60} {'expected':9} " + " ".join(f"{label:40}" for label in labels))
        scores, played = [0] * len(labels), [0] * len(labels)
        for case in cases:
            answers = []
            for column, judged in enumerate((case, statistics_only(case), without_replay(case))):
                if judged is None:  # no full tensors, or not replayed anyway
                    answers.append(None)
                    continue
                result, right = play(judged, work, made)
                scores[column] += right
                played[column] += 1
                answers.append((result, right))
            shown = [f"{_verdict(a[0])} {'right' if a[1] else 'WRONG'}" if a else "-" for a in answers]
            print(f"{case.name:60} {case.verdict:9} " + " ".join(f"{s:40}" for s in shown))
            for label, answer in zip(labels, answers):
                if answer and not answer[1]:
                    print(f"{'':60} {label}: {_first(answer[0])}; expected {_expected(case)}")
        print("score: " + ", ".join(f"{s}/{n} right {label}" for s, n, label in zip(scores, played, labels)))


def _verdict(result) -> str:
    return (f"{result.verdict}{' within noise' if result.within_noise else ''} [{result.noise_model}], "
            f"{len(result.culprits)} culprits")


def _first(result) -> str:
    """The first divergence (kind, name, direction, step, evidence) and the top culprit group."""
    first = result.first_divergence
    evidence = {(c.step, c.name, c.direction): c.evidence for c in result.culprits}
    shown = (f"{first.kind} {first.name} ({first.direction}, step {first.step}, "
             f"{evidence.get((first.step, first.name, first.direction), 'no culprit')})" if first else "-")
    if result.culprit_groups:
        shown += f"; {result.culprit_groups[0].api} ×{result.culprit_groups[0].count}"
    return shown


def _expected(case) -> str:
    return ", ".join(f"{k} {v}" for k, v in (("verdict", case.verdict), ("name", case.top), ("kind", case.kind),
                                             ("direction", case.direction), ("step", case.step),
                                             ("group", case.group)) if v is not None)


if __name__ == "__main__":
    main()

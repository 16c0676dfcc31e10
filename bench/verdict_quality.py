"""The verdict's scoreboard: emulated devices (ulp noise, TF32 matmuls, one faulty call or its
gradient, SDPA against manual attention) on toy models, runs that differ in the optimizer's eps,
one sample of the batch, the seed or the dtype, a difference placed where each explanation rule
applies (rule_cases), and real PI0 with 1 against 2 threads, each compared the way a user would:
as dumped (with its noise reference or replay), and from statistics alone (the same runs dumped
in stats mode, no reference, no replay: the intrinsic rule, as msprobe's statistics dumps are
judged). Prints per case the verdict of each and whether it is right, with the first divergence
and top culprit group where it is not; a benchmark to read, not a test (tests/test_verdict.py and
tests/test_verdict_rules.py assert the acceptance cases).

    .venv/bin/python bench/verdict_quality.py [--pi0] [--work DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pi0align.testing.scenarios import pi0_cases, play, rule_cases, statistics_only, toy_cases


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
        print(f"{'case':60} {'expected':9} {'as dumped':40} statistics only")
        scores = [0, 0]
        for case in cases:
            answers = []
            for column, judged in enumerate((case, statistics_only(case))):
                result, right = play(judged, work, made)
                scores[column] += right
                answers.append((result, right))
            shown = [f"{_verdict(result)} {'right' if right else 'WRONG'}" for result, right in answers]
            print(f"{case.name:60} {case.verdict:9} {shown[0]:40} {shown[1]}")
            for label, (result, right) in zip(("as dumped", "statistics only"), answers):
                if not right:
                    print(f"{'':60} {label}: {_first(result)}; expected {_expected(case)}")
        print(f"score: {scores[0]}/{len(cases)} right as dumped, {scores[1]}/{len(cases)} from statistics only")


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

"""The verdict's scoreboard: emulated devices (ulp noise, TF32 matmuls, one faulty call or its
gradient, SDPA against manual attention) on toy models, runs that differ in the optimizer's eps,
one sample of the batch, the seed or the dtype, a difference placed where each explanation rule
applies (rule_cases), and real PI0 with 1 against 2 threads, each
compared the way a user would; prints case, verdict, first divergence (kind, name, direction,
evidence), top culprit group and whether that is right. A benchmark to
read, not a test (tests/test_verdict.py asserts the acceptance cases).

    .venv/bin/python bench/verdict_quality.py [--pi0] [--work DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pi0align.testing.scenarios import pi0_cases, play, rule_cases, toy_cases


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
        print(f"{'case':64} {'expected':9} {'verdict':46} first divergence; top culprit group")
        score = 0
        for case in cases:
            result, right = play(case, work, made)
            score += right
            first = result.first_divergence
            evidence = {(c.step, c.name, c.direction): c.evidence for c in result.culprits}
            shown = (f"{first.kind} {first.name} ({first.direction}, step {first.step}, "
                     f"{evidence.get((first.step, first.name, first.direction), 'no culprit')})" if first else "-")
            if result.culprit_groups:
                group = result.culprit_groups[0]
                shown += f"; {group.api} ×{group.count}"
            verdict = (f"{result.verdict}{' within noise' if result.within_noise else ''} [{result.noise_model}], "
                       f"{len(result.culprits)} culprits")
            print(f"{case.name:64} {case.verdict:9} {verdict:46} {shown}  {'right' if right else 'WRONG'}")
            if not right:
                expected = ", ".join(f"{k} {v}" for k, v in (("name", case.top), ("kind", case.kind),
                                                               ("direction", case.direction), ("step", case.step),
                                                               ("group", case.group)) if v is not None)
                print(f"{'':64} expected first divergence: {expected}")
        print(f"score: {score}/{len(cases)} right")


if __name__ == "__main__":
    main()

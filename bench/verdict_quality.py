"""The verdict's scoreboard: emulated devices (ulp noise, TF32 matmuls, one faulty call, SDPA
against manual attention) on toy models, and real PI0 with 1 against 2 threads, each compared the
way a user would; prints case, verdict, top culprit and whether that is right. A benchmark to
read, not a test (tests/test_verdict.py asserts the acceptance cases).

    .venv/bin/python bench/verdict_quality.py [--pi0] [--work DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from pi0align.testing.scenarios import pi0_cases, play, toy_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pi0", action="store_true", help="also the real PI0 small cases (minutes)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the dumps (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = toy_cases() + (pi0_cases() if args.pi0 else [])
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        made: dict = {}
        print(f"{'case':58} {'expected':9} {'verdict':46} top culprit")
        score = 0
        for case in cases:
            result, right = play(case, work, made)
            score += right
            top = result.culprits[0] if result.culprits else None
            shown = f"{top.name} ({top.direction}, {top.evidence})" if top else "-"
            verdict = (f"{result.verdict}{' within noise' if result.within_noise else ''} [{result.noise_model}], "
                       f"{len(result.culprits)} culprits")
            print(f"{case.name:58} {case.verdict:9} {verdict:46} {shown}  {'right' if right else 'WRONG'}")
            if case.top and not right:
                print(f"{'':58} expected top culprit: {case.top}")
        print(f"score: {score}/{len(cases)} right")


if __name__ == "__main__":
    main()

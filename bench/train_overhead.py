"""What `pi0align run` (dumping off) costs over a bare training loop on the same LeRobot PI0.

Both sides use the same preset, data, batch size, thread count and components (built by
`pi0align.train.loop.build_components`); the bare loop is forward, backward, clip, optimizer and
scheduler step, nothing else. Rounds alternate in one process; each side's time per step is the
wall time between step ends after warm-up, so whatever `run` does between steps (logging,
progress bar, bookkeeping) is counted. Prints the ratio; the goal is <= 1.02x.

    .venv/bin/python bench/train_overhead.py [--preset small] [--steps 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# glibc's allocator lets a CPU step drift by tens of percent over a long process; fixed thresholds
# keep both sides on equal footing. They must be set before the process starts: re-exec once.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "134217728", "MALLOC_ARENA_MAX": "1"}


def bare_loop_step_times(components: dict, config) -> list[float]:
    """Step-end timestamps of the plain loop over the same batches `run` sees."""
    import torch

    from pi0align.train.data import make_loader

    policy, optimizer, scheduler = components["policy"], components["optimizer"], components["scheduler"]
    preprocessor = components["preprocessor"]
    loader = make_loader(components["dataset"], batch_size=config.batch_size, seed=config.seed, start_step=0,
                         steps=config.steps, num_workers=config.num_workers, pin_memory=False)
    clip = policy.config.optimizer_grad_clip_norm
    ends = []
    started = time.perf_counter()
    for raw_batch in loader:
        policy.train()
        loss, _ = policy.forward(preprocessor(raw_batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        ends.append(time.perf_counter() - started)
    return ends


def run_step_time(config, warmup: int) -> float:
    from pi0align.train.loop import train

    train(config)
    log_lines = (config.out / "train_log.jsonl").read_text().splitlines()
    return per_step([json.loads(line)["time_s"] for line in log_lines], warmup)


def bare_step_time(config, warmup: int) -> float:
    import torch

    from pi0align.device import resolve
    from pi0align.train.loop import build_components

    torch.set_num_threads(config.threads)  # as train() does
    return per_step(bare_loop_step_times(build_components(config, resolve("cpu")), config), warmup)


def per_step(ends: list[float], warmup: int) -> float:
    return (ends[-1] - ends[warmup - 1]) / (len(ends) - warmup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if any(os.environ.get(key) != value for key, value in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    import transformers

    from pi0align.train.config import TrainConfig

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    warmup = max(1, args.steps // 4)
    ours, bare = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            config = TrainConfig(preset=args.preset, steps=args.steps, batch_size=args.batch_size, threads=args.threads,
                                 out=Path(scratch) / f"run{round_index}", progress=True, log_every=0)
            # Alternate which side goes first, so neither always runs on a warmer (or more fragmented) heap.
            sides = [("run", lambda config=config: run_step_time(config, warmup)),
                     ("bare", lambda config=config: bare_step_time(config, warmup))]
            for side, measure in sides if round_index % 2 == 0 else sides[::-1]:
                (ours if side == "run" else bare).append(measure())
            print(f"round {round_index}: run {ours[-1] * 1000:.1f} ms/step, bare loop {bare[-1] * 1000:.1f} ms/step",
                  flush=True)
    ratio = statistics.median(ours) / statistics.median(bare)
    print(f"preset {args.preset}, batch {args.batch_size}, {args.threads} thread(s), "
          f"{args.steps} steps x {args.rounds} rounds")
    print(f"pi0align run / bare loop: {ratio:.3f}x (goal <= 1.02x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PI0 training as LeRobot's `lerobot-train` does it, seeded and measured. Reads top to bottom.

Same components as LeRobot: PI0's optimizer and scheduler presets, gradient clipping at the
preset's norm, PI0's pre/post-processors, a shuffled loader that drops the last partial batch.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import datetime
from pathlib import Path

import torch

from pi0align.device import Device, resolve
from pi0align.errors import UserError
from pi0align.seed import seed_all
from pi0align.train import checkpoint
from pi0align.train.config import TrainConfig
from pi0align.train.log import MetricsLog, ProgressDisplay, summarize


def default_out_dir(config: TrainConfig) -> Path:
    return Path("dumps") / f"{config.device.replace(':', '')}-seed{config.seed}-{datetime.now():%Y%m%d-%H%M%S}"


def train(config: TrainConfig, dumper=None, resume_from: Path | None = None, stop_step: int | None = None,
          started_from: Path | None = None) -> dict:
    """Train up to `stop_step` (default: the config's steps, which the schedule spans); returns the
    summary (also written to `<out>/summary.json`). `resume_from`: a checkpoint of this run to
    continue; `started_from`: another run's checkpoint to start from (`run --from`: its state on
    this run's device)."""
    started = time.perf_counter()
    device = resolve(config.device)
    torch.set_num_threads(config.threads)
    config.out = out = Path(config.out or default_out_dir(config))

    components = build_components(config, device)  # checks the inputs: a bad one leaves no folder behind
    policy, optimizer, scheduler = components["policy"], components["optimizer"], components["scheduler"]
    manifest = components["manifest"]
    start_step = 0
    for source in (resume_from, started_from):
        if source is not None:
            start_step = checkpoint.restore(source, policy=policy, optimizer=optimizer, scheduler=scheduler,
                                            device=device)
    if started_from is not None:
        manifest["started_from"] = {"run": str(started_from.parent.parent), "step": start_step}
    stop_step = config.steps if stop_step is None else stop_step
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    config.save(out / "train_config.json")
    batches = iter(_make_loader(config, components["dataset"], start_step, device))
    log = MetricsLog(out / "train_log.jsonl", keep_before=start_step)
    grad_clip_norm = policy.config.optimizer_grad_clip_norm

    loop_started = time.perf_counter()
    # Leaving the dumper's context ends its writer threads, also when training fails.
    with ProgressDisplay(stop_step, start_step, enabled=config.progress) as progress, \
            (dumper if dumper is not None else contextlib.nullcontext()):
        for step in range(start_step, stop_step):
            step_started = time.perf_counter()
            raw_batch = next(batches)
            data_time = time.perf_counter() - step_started
            if dumper is not None:  # around the step only: reading the dataset is not the model's work
                dumper.start(policy, step=step, manifest=manifest, optimizer=optimizer)
            lr = optimizer.param_groups[0]["lr"]
            loss, grad_norm = train_step(policy, components["preprocessor"](raw_batch), optimizer, scheduler,
                                         grad_clip_norm)
            if dumper is not None:
                dumper.record_metrics(step, loss=loss, grad_norm=grad_norm, lr=lr)
                dumper.stop()
                dumper.step()
            device.synchronize()
            step_time = time.perf_counter() - step_started
            record = log.write(step=step, loss=loss, grad_norm=grad_norm, lr=lr, step_time_s=step_time,
                               data_time_s=data_time, samples_per_s=config.batch_size / step_time,
                               time_s=time.perf_counter() - loop_started)
            progress.update(record, log_line=config.log_every > 0 and (step + 1) % config.log_every == 0)
            steps_done = step + 1
            if steps_done == stop_step or (config.save_every and steps_done % config.save_every == 0):
                checkpoint.save(out, steps_done, policy=policy, optimizer=optimizer, scheduler=scheduler,
                                config=config, device=device)

    summary = summarize(log.records, batch_size=config.batch_size, e2e_seconds=time.perf_counter() - started)
    summary |= {"out": str(out), "device": device.type, "seed": config.seed, "seed_impl": manifest["seed_impl"],
                "parameter_count": manifest["parameter_count"],
                "max_memory_allocated": device.max_memory_allocated()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def train_step(policy, batch, optimizer, scheduler, grad_clip_norm: float) -> tuple[float, float]:
    """One optimizer step, as LeRobot's `update_policy` (without accelerate's mixed precision)."""
    policy.train()
    loss, _ = policy.forward(batch)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip_norm, error_if_nonfinite=False)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return loss.item(), grad_norm.item()


def build_components(config: TrainConfig, device: Device) -> dict:
    """Dataset, policy (initialised from the seeded RNG), processors, optimizer, scheduler, manifest.

    Inputs are checked first, so that a bad flag fails before anything slow or noisy runs.
    """
    from pi0align.pi0 import compat
    from pi0align.pi0.dataset import check_dataset_root, default_dataset, fingerprint, load_dataset, policy_features
    from pi0align.pi0.policy import build_policy, count_parameters, make_config, weights_file
    from pi0align.pi0.presets import PRESETS
    from pi0align.pi0.processors import make_processors
    from pi0align.pi0.tokenizer import default_tokenizer, load_tokenizer
    from pi0align.train.manifest import build_manifest

    preset = PRESETS[config.preset]
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
    elif preset.is_full:
        raise UserError("the full preset needs PaliGemma's tokenizer: pass --tokenizer DIR (see `pi0align prepare`)")
    else:
        tokenizer = default_tokenizer(preset.vocab_size)
    if preset.vocab_size is not None and len(tokenizer) > preset.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens, more than the {config.preset} preset's "
                        f"vocabulary of {preset.vocab_size}: use the full preset or the generated tokenizer")

    if config.pretrained is not None:
        weights_file(config.pretrained)
    dataset_root = Path(config.dataset) if config.dataset is not None else default_dataset()
    input_features, output_features = policy_features(check_dataset_root(dataset_root)["features"])
    probe_config = make_config(preset, input_features, output_features, device=str(device.torch_device),
                               dtype=config.dtype, lr=config.lr)
    dataset = load_dataset(dataset_root, probe_config)
    if config.batch_size > len(dataset):
        raise UserError(f"--batch-size {config.batch_size} exceeds the dataset's {len(dataset)} frames")

    seed_impl = seed_all(config.seed, mode=config.deterministic, rm_dropout=config.rm_dropout, prefer=config.seed_impl)
    policy = build_policy(config.preset, input_features, output_features, device=str(device.torch_device),
                          dtype=config.dtype, lr=config.lr, pretrained=config.pretrained)
    preprocessor, _ = make_processors(policy.config, dataset.meta.stats, tokenizer)
    optimizer = policy.config.get_optimizer_preset().build(policy.get_optim_params())
    scheduler = policy.config.get_scheduler_preset().build(optimizer, num_training_steps=config.steps)
    manifest = build_manifest(
        config=config, device=device, seed_impl=seed_impl, transformers_compat=compat.apply(), policy=policy,
        parameter_count=count_parameters(policy), dataset_root=dataset_root,
        dataset_fingerprint=fingerprint(dataset_root),
    )
    return {"dataset": dataset, "policy": policy, "preprocessor": preprocessor, "optimizer": optimizer,
            "scheduler": scheduler, "manifest": manifest}


def _make_loader(config: TrainConfig, dataset, start_step: int, device: Device):
    from pi0align.train.data import make_loader

    return make_loader(dataset, batch_size=config.batch_size, seed=config.seed, start_step=start_step,
                       steps=config.steps, num_workers=config.num_workers, pin_memory=device.type != "cpu")

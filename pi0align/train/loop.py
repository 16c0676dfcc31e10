"""PI0 training as LeRobot's `lerobot-train` does it, seeded and measured. Reads top to bottom.

Same components as LeRobot: PI0's optimizer and scheduler presets, gradient clipping at the
preset's norm, PI0's pre/post-processors, a shuffled loader that drops the last partial batch.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from datetime import datetime
from pathlib import Path

import torch

from pi0align.device import Device, resolve
from pi0align.errors import UserError
from pi0align.seed import seed_all
from pi0align.train import checkpoint, distributed, engines
from pi0align.train.config import TrainConfig
from pi0align.train.log import MetricsLog, ProgressDisplay, RecipeLogs, summarize
from pi0align.train.profile import StepProfiler


def default_out_dir(config: TrainConfig) -> Path:
    return Path("dumps") / f"{config.device.replace(':', '')}-seed{config.seed}-{datetime.now():%Y%m%d-%H%M%S}"


def train(config: TrainConfig, dumper=None, resume_from: Path | None = None, stop_step: int | None = None,
          started_from: Path | None = None, monitor=None, alert_dumps=None) -> dict:
    """Train up to `stop_step` (default: the config's steps, which the schedule spans); returns the
    summary (also written to `<out>/summary.json`). `dumper`, `monitor`: a Dumper and a Monitor
    (pi0align.dump), started here on the policy; `alert_dumps`: the dumps of the steps after the
    monitor's alerts (dump/monitoring/alert_dumps.py). `resume_from`: a checkpoint of this run to
    continue; `started_from`: another run's checkpoint to start from (`run --from`: its state on
    this run's device). Under a launcher (distributed.launched), this process trains as its rank:
    the policy in DDP on its slice of each global batch; rank 0 writes the log, the summary, the
    manifest and the checkpoints."""
    started = time.perf_counter()
    ranks = distributed.launched()
    device = resolve(distributed.device_of_rank(config.device, ranks))
    distributed.start(ranks, device)
    finished = False
    try:
        summary = _train(config, ranks, device, dumper, resume_from, started_from, stop_step, started, monitor,
                         alert_dumps)
        finished = True
        return summary
    finally:
        distributed.stop(finished)


@contextlib.contextmanager
def frozen_heap():
    """Within: what was built before (torch, transformers, LeRobot, the policy: about 600,000
    objects with PI0 small) out of the garbage collector's sight (`gc.freeze`). A dumped step leaves
    objects behind for it to promote, and every few tens of dumped steps (sample mode) it ran a full
    collection, which scanned them all: 330-350 ms, more than a step; 3 ms frozen. Given back after
    (`gc.unfreeze`) unless they were frozen before, so that a process training again can free them."""
    frozen_before = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def _train(config: TrainConfig, ranks: distributed.Ranks, device: Device, dumper, resume_from: Path | None,
           started_from: Path | None, stop_step: int | None, started: float, monitor, alert_dumps) -> dict:
    if ranks.distributed:
        config.nproc = ranks.local_world_size
    if config.bind_cores:
        distributed.bind_cores(ranks)
    torch.set_num_threads(config.threads)
    config.out = out = Path(config.out or default_out_dir(config))

    components = build_components(config, device, ranks)  # checks the inputs: a bad one leaves no folder behind
    policy, optimizer, manifest = components["policy"], components["optimizer"], components["manifest"]
    trainer = engines.build(config.engine, policy=policy, optimizer=optimizer, scheduler=components["scheduler"],
                            grad_clip_norm=policy.config.optimizer_grad_clip_norm, batch_size=config.batch_size,
                            zero_stage=config.zero_stage, ranks=ranks, device=device)
    start_step = 0
    for source in (resume_from, started_from):
        if source is not None:
            start_step = trainer.restore(source)
    if started_from is not None:
        manifest["started_from"] = {"run": str(started_from.parent.parent), "step": start_step}
    stop_step = config.steps if stop_step is None else stop_step
    out.mkdir(parents=True, exist_ok=True)
    if ranks.main:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        config.save(out / "train_config.json")
    batches = iter(_make_loader(config, components["dataset"], start_step, device, ranks))
    log = MetricsLog(out / "train_log.jsonl", keep_before=start_step) if ranks.main else None
    recipe_logs = RecipeLogs(out, config.recipe, ranks.world_size, config.batch_size, config.dtype,
                             resumed=start_step > 0) if config.recipe and ranks.main else None
    profiler = StepProfiler(config.profile_steps, out / "profile", device)
    global_batch = config.batch_size * ranks.world_size

    loop_started = time.perf_counter()
    if monitor is not None:
        monitor.start(policy, trainer.dumped_optimizer, step=start_step)
    # Leaving the dumper's and the monitor's contexts ends their writer processes, also when training fails.
    with frozen_heap(), ProgressDisplay(stop_step, start_step, enabled=config.progress and ranks.main) as progress, \
            (dumper if dumper is not None else contextlib.nullcontext()), \
            (monitor if monitor is not None else contextlib.nullcontext()):
        for step in range(start_step, stop_step):
            step_started = time.perf_counter()
            raw_batch = next(batches)
            data_time = time.perf_counter() - step_started
            dumpers = [d for d in (dumper, alert_dumps and alert_dumps.take(step)) if d is not None]
            for each in dumpers:  # around the step only: reading the dataset is not the model's work
                each.start(policy, step=step, manifest=manifest, optimizer=trainer.dumped_optimizer)
            lr = optimizer.param_groups[0]["lr"]
            profiler.before(step)
            phase_started = time.perf_counter()
            loss = trainer.forward_backward(components["preprocessor"](raw_batch))
            device.synchronize()
            forward_backward_time = time.perf_counter() - phase_started
            # the monitor reads the gradients as the backward left them, before clipping
            grad_norm = trainer.step(monitor.after_backward if monitor is not None else None)
            device.synchronize()
            optimizer_time = time.perf_counter() - phase_started - forward_backward_time
            for each in dumpers:
                each.record_metrics(step, loss=loss, grad_norm=grad_norm, lr=lr)
                each.stop()
                each.step()
            if alert_dumps is not None:
                alert_dumps.finish(step)
            if monitor is not None and monitor.step() and alert_dumps is not None:
                alert_dumps.schedule(step + 1)
            top_ops = profiler.after(step)
            loss = distributed.mean(loss, ranks)  # the global batch's
            device.synchronize()
            step_time = time.perf_counter() - step_started
            record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time_s": step_time,
                      "data_time_s": data_time, "forward_backward_s": forward_backward_time,
                      "optimizer_s": optimizer_time,
                      "communication_s": trainer.communication_seconds(),
                      "samples_per_s": global_batch / step_time, "time_s": time.perf_counter() - loop_started}
            if ranks.main:
                log.write(**record)
                if recipe_logs:
                    recipe_logs.write(record)
                progress.update(record, log_line=config.log_every > 0 and (step + 1) % config.log_every == 0)
                if top_ops:
                    progress.console.print(f"profile of steps {config.profile}: the trace in {out / 'profile'}\n"
                                           f"{top_ops}")
            steps_done = step + 1
            if steps_done == stop_step or (config.save_every and steps_done % config.save_every == 0):
                states = distributed.gather(checkpoint.rng_state(device), ranks)  # every rank's generators
                trainer.save(out, steps_done, config, states)

    summary = {}
    if ranks.main:
        summary = summarize(log.records, batch_size=global_batch, e2e_seconds=time.perf_counter() - started)
        summary |= {"out": str(out), "device": device.type, "seed": config.seed, "seed_impl": manifest["seed_impl"],
                    "parameter_count": manifest["parameter_count"], "world_size": ranks.world_size,
                    "max_memory_allocated": device.max_memory_allocated()}
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if recipe_logs:
            recipe_logs.finish(summary)
    return distributed.from_main(summary, ranks)


def train_step(policy, batch, optimizer, scheduler, grad_clip_norm: float, after_backward=None) -> tuple[float, float]:
    """One optimizer step of the bare policy in this process, as LeRobot's `update_policy` (without
    accelerate's mixed precision); returns (loss, gradient norm before clipping). `after_backward`:
    a monitor's, called before the gradients are clipped, with their norms (TorchEngine.step)."""
    trainer = engines.TorchEngine(policy=policy, optimizer=optimizer, scheduler=scheduler,
                                  grad_clip_norm=grad_clip_norm, batch_size=None, zero_stage=0,
                                  ranks=distributed.Ranks(), device=None)
    loss = trainer.forward_backward(batch)
    return loss, trainer.step(after_backward)


def check_inputs(config: TrainConfig) -> dict:
    """The tokenizer, the pretrained weights and the dataset the config names, checked (each a one-line
    error where it is missing or unreadable): preset, tokenizer, dataset root and its features."""
    from pi0align.pi0.dataset import check_dataset_root, default_dataset, policy_features
    from pi0align.pi0.policy import weights_file
    from pi0align.pi0.presets import PRESETS
    from pi0align.pi0.tokenizer import default_tokenizer, load_tokenizer

    engines.check_available(config.engine)
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
    return {"preset": preset, "tokenizer": tokenizer, "dataset_root": dataset_root, "input_features": input_features,
            "output_features": output_features}


def build_components(config: TrainConfig, device: Device, ranks: distributed.Ranks | None = None) -> dict:
    """Dataset, policy (initialised from the seeded RNG), processors, optimizer, scheduler, manifest.

    Inputs are checked first, so that a bad flag fails before anything slow or noisy runs.
    """
    from pi0align.pi0 import compat
    from pi0align.pi0.dataset import fingerprint, load_dataset
    from pi0align.pi0.policy import build_policy, count_parameters, make_config
    from pi0align.pi0.processors import make_processors
    from pi0align.train.manifest import build_manifest

    inputs = check_inputs(config)
    preset, tokenizer, dataset_root = inputs["preset"], inputs["tokenizer"], inputs["dataset_root"]
    input_features, output_features = inputs["input_features"], inputs["output_features"]
    probe_config = make_config(preset, input_features, output_features, device=str(device.torch_device),
                               dtype=config.dtype, lr=config.lr)
    dataset = load_dataset(dataset_root, probe_config)
    ranks = ranks or distributed.Ranks()
    if config.batch_size * ranks.world_size > len(dataset):
        raise UserError(f"--batch-size {config.batch_size} × {ranks.world_size} process(es) exceeds the dataset's "
                        f"{len(dataset)} frames")

    seed_impl = seed_all(config.seed, mode=config.deterministic, rm_dropout=config.rm_dropout, prefer=config.seed_impl)
    policy = build_policy(config.preset, input_features, output_features, device=str(device.torch_device),
                          dtype=config.dtype, lr=config.lr, adam_eps=config.adam_eps, pretrained=config.pretrained)
    preprocessor, _ = make_processors(policy.config, dataset.meta.stats, tokenizer)
    optimizer = build_optimizer(policy, config.optimizer, device)
    scheduler = policy.config.get_scheduler_preset().build(optimizer, num_training_steps=config.steps)
    manifest = build_manifest(
        config=config, device=device, seed_impl=seed_impl, transformers_compat=compat.apply(), policy=policy,
        parameter_count=count_parameters(policy), dataset_root=dataset_root,
        dataset_fingerprint=fingerprint(dataset_root), world_size=ranks.world_size, rank=ranks.rank,
    )
    return {"dataset": dataset, "policy": policy, "preprocessor": preprocessor, "optimizer": optimizer,
            "scheduler": scheduler, "manifest": manifest}


def build_optimizer(policy, kind: str, device: Device) -> torch.optim.Optimizer:
    """PI0's AdamW preset (`adamw`), or the same hyper-parameters in a fused AdamW (`adamw-fused`):
    torch's (fused=True: one kernel for every parameter's update) or, on the NPU, torch_npu's
    NpuFusedAdamW (the case study's +9.6 % samples/s)."""
    preset = policy.config.get_optimizer_preset()
    if kind == "adamw":
        return preset.build(policy.get_optim_params())
    settings = {"lr": preset.lr, "betas": preset.betas, "eps": preset.eps, "weight_decay": preset.weight_decay}
    if device.type == "npu":
        from torch_npu.optim import NpuFusedAdamW

        return NpuFusedAdamW(policy.get_optim_params(), **settings)
    return torch.optim.AdamW(policy.get_optim_params(), fused=True, **settings)


def _make_loader(config: TrainConfig, dataset, start_step: int, device: Device, ranks: distributed.Ranks):
    from pi0align.train.data import make_loader

    return make_loader(dataset, batch_size=config.batch_size, seed=config.seed, start_step=start_step,
                       steps=config.steps, num_workers=config.num_workers, pin_memory=device.type != "cpu",
                       rank=ranks.rank, world_size=ranks.world_size)

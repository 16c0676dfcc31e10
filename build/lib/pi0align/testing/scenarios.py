"""Dumped runs for the verdict's tests and its scoreboard (bench/verdict_quality.py): a toy model
or real PI0, trained two steps from a fixed seed with both steps dumped, on an emulated device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

from pi0align.testing.devices import DrawBefore, EveryCall, Fault, Tf32Matmuls, UlpNoise, adam_kernel
from pi0align.testing.models import HandWrittenAdamW, Mlp, Transformer

FUNCTIONS = {"linear": F.linear, "gelu": F.gelu, "layer_norm": F.layer_norm, "softmax": torch.softmax,
             "matmul": torch.matmul, "sdpa": F.scaled_dot_product_attention, "add": torch.Tensor.add,
             "silu": F.silu, "mul": torch.Tensor.mul, "rsqrt": torch.rsqrt, "normal": torch.normal}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Emulation:
    """How the emulated device differs from the CPU: results moved by up to `ulp_noise` ulps,
    matmul inputs in TF32, one faulty call (module path, function name, index, factor), its
    gradient alone off (`fault_backward`), in the module's first `fault_forwards` forwards only,
    from its `fault_first_forward`-th on; an Adam kernel computing with another epsilon
    (`adam_eps`) or learning rate (× `adam_lr_scale`) than its settings say; every call of a
    function off (`every`); a number drawn before each call of a random function (`draw_before`:
    its draws from another generator state)."""

    ulp_noise: int = 0
    ulp_seed: int = 1
    tf32: bool = False
    fault: tuple[str, str, int, float] | None = None
    fault_backward: bool = False
    fault_forwards: int | None = None
    fault_first_forward: int = 1  # the module's forward (1 = its first) from which the fault strikes
    adam_eps: float | None = None
    adam_lr_scale: float = 1.0
    every: tuple[str, float] | None = None  # (function name, factor): every call of it off
    draw_before: str | None = None  # a function name: a draw before each of its calls (another generator state)

    @contextlib.contextmanager
    def on(self, model: torch.nn.Module):
        modes = []
        if self.ulp_noise:
            modes.append(UlpNoise(self.ulp_noise, self.ulp_seed))
        if self.tf32:
            modes.append(Tf32Matmuls())
        fault = None
        if self.fault is not None:
            path, function, index, factor = self.fault
            fault = Fault(model.get_submodule(path), FUNCTIONS[function], index, factor,
                          backward=self.fault_backward, forwards=self.fault_forwards, first=self.fault_first_forward)
            modes.append(fault)
        if self.every is not None:
            modes.append(EveryCall(FUNCTIONS[self.every[0]], self.every[1]))
        if self.draw_before is not None:
            modes.append(DrawBefore(FUNCTIONS[self.draw_before]))
        if self.adam_eps is not None or self.adam_lr_scale != 1.0:
            modes.append(adam_kernel(self.adam_eps, self.adam_lr_scale))
        try:
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                yield
        finally:
            if fault is not None:
                fault.detach()


@dataclass(frozen=True)
class ToyRun:
    model: str = "mlp"  # "mlp" | "transformer"
    dtype: str = "fp32"
    mode: str = "tensor"
    sdpa: bool = False
    device: Emulation = Emulation()
    perturb_ulps: int = 0  # pi0align's own noise reference (Dumper(perturb_ulps=...))
    seed: int = 0
    lr: float = 1e-3
    eps: float = 1e-8
    optimizer: str = "adamw"  # "adamw" (torch.optim.AdamW) | "handwritten" (testing.models.HandWrittenAdamW)
    level: str = "mix"
    changed_sample_at: int | None = None  # the step whose batch has its first sample changed
    sample_change: float | None = None  # that sample × (1 + this) instead of drawn again
    record_optimizer: bool = True  # Dumper.start(model, optimizer=...): its updates recorded
    steps: int = 2  # trained
    dumped: tuple[int, ...] = (0, 1)  # the steps dumped
    exclude: tuple[str, ...] = ()  # record names the dump leaves out (Dumper(exclude=...))
    # (parameter, factor, step): that parameter's gradient × factor after backward at that step,
    # before the optimizer reads it (a hook, gradient accumulation or all-reduce gone wrong)
    gradient_scaled: tuple[str, float, int] | None = None
    # (parameter, factor): the optimizer leaves that parameter × factor after each update (a bug in
    # one update, inside the optimizer's step: its records see it)
    update_scaled: tuple[str, float] | None = None
    head_scale: float = 1.0  # the head's initial weights × this: tiny gradients into the model, computed
    checksums: bool = True  # False: the dump's checksums erased afterwards, as msprobe's dumps have none
    # (module, factor): a backward hook of that module sends its input's gradient × factor back
    module_gradient_scaled: tuple[str, float] | None = None
    # (parameter, factor): a hook on that parameter scales what its readers send it, before it
    # reaches .grad
    parameter_gradient_scaled: tuple[str, float] | None = None
    device_name: str | None = None  # the manifest's: an emulated device that says so, as a real one's run does
    loss_scale: float = 1.0  # the loss × this before backward (a loss scaler or reduction gone wrong)


def _toy_training(run: ToyRun):
    """The toy run's model, its batches (made before any emulated device or dumper: as a loader
    hands them over) and its optimizer, with the run's hooks on them."""
    torch.manual_seed(run.seed)
    # the model made in float32 and cast: a bf16 run holds the fp32 run's initial weights, rounded
    model = Mlp() if run.model == "mlp" else Transformer(sdpa=run.sdpa)
    with torch.no_grad():
        model.head.weight.mul_(run.head_scale)
    model = model.to(DTYPES[run.dtype])
    shape = (16, 48) if run.model == "mlp" else (4, 12, 32)
    data = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    changed = data.clone()
    changed[0] = (torch.randn(*shape[1:], generator=torch.Generator().manual_seed(2)) if run.sample_change is None
                  else data[0] * (1 + run.sample_change))
    batches = [(changed if step == run.changed_sample_at else data).to(DTYPES[run.dtype]) for step in range(run.steps)]
    optimizers = {"adamw": torch.optim.AdamW, "handwritten": HandWrittenAdamW}
    optimizer = optimizers[run.optimizer](model.parameters(), lr=run.lr, eps=run.eps)
    if run.module_gradient_scaled is not None:  # before the dumper's hooks too
        hooked, factor = run.module_gradient_scaled
        model.get_submodule(hooked).register_full_backward_hook(
            lambda module, grad_input, grad_output: tuple(None if g is None else g * factor for g in grad_input))
    if run.parameter_gradient_scaled is not None:
        hooked, factor = run.parameter_gradient_scaled
        model.get_parameter(hooked).register_hook(lambda gradient: gradient * factor)
    if run.update_scaled is not None:  # before the dumper's hooks, so that its records see it
        scaled, factor = model.get_parameter(run.update_scaled[0]), run.update_scaled[1]
        optimizer.register_step_post_hook(lambda *_: scaled.data.mul_(factor))
    return model, batches, optimizer


def _toy_step(run: ToyRun, step: int, model, batch, optimizer) -> torch.Tensor:
    """One training step of the toy run; returns its loss."""
    loss = model(batch).float().square().mean() * run.loss_scale
    loss.backward()
    if run.gradient_scaled is not None and run.gradient_scaled[2] == step:
        with torch.no_grad():
            model.get_parameter(run.gradient_scaled[0]).grad.mul_(run.gradient_scaled[1])
    optimizer.step()
    optimizer.zero_grad()
    return loss


def dump_toy(path: str | Path, run: ToyRun) -> Path:
    """`run.steps` AdamW steps of a toy model, `run.dumped` of them dumped; returns the dump folder."""
    from pi0align.dump import Dumper

    model, batches, optimizer = _toy_training(run)
    manifest = {"device_name": run.device_name} if run.device_name is not None else None
    with run.device.on(model), Dumper(path, steps=run.dumped, level=run.level, mode=run.mode,
                                      exclude=list(run.exclude) or None, perturb_ulps=run.perturb_ulps,
                                      perturb_seed=run.seed + 7, manifest=manifest) as dumper:
        dumper.start(model, optimizer=optimizer if run.record_optimizer else None)
        for step, batch in enumerate(batches):
            loss = _toy_step(run, step, model, batch, optimizer)
            dumper.record_metrics(step, loss, lr=optimizer.param_groups[0]["lr"])
            dumper.step()
    if not run.checksums:
        import h5py

        with h5py.File(dumper.file, "r+") as f:
            for step in f["steps"].values():
                step["records"]["checksum"][...] = -1
    return Path(path)


def dump_toy_with_msprobe(path: str | Path, run: ToyRun, level: str = "L1") -> Path:
    """The toy run dumped by msprobe's PrecisionDebugger (task statistics, every step, its own
    `start` / `stop` / `step` around each); run it in a child process: msprobe patches torch for
    good. Returns msprobe's dump folder."""
    from msprobe.pytorch import PrecisionDebugger

    path = Path(path)
    debugger = PrecisionDebugger(task="statistics", dump_path=str(path), level=level)  # made first, as scripts do
    model, batches, optimizer = _toy_training(run)
    with run.device.on(model):
        for step, batch in enumerate(batches):
            debugger.start(model)
            _toy_step(run, step, model, batch, optimizer)
            debugger.stop()
            debugger.step()
    return path


@dataclass(frozen=True)
class Pi0Run:
    preset: str = "small"
    dtype: str = "bf16"
    mode: str = "tensor"
    threads: int = 1
    device: Emulation = Emulation()
    perturb_ulps: int = 0
    seed: int = 1234
    steps: int = 2  # trained and dumped
    level: str = "mix"
    batch_nan_at: int | None = None  # the step whose batch holds a NaN (its state's first element)


def dump_pi0(path: str | Path, run: Pi0Run) -> Path:
    """`run.steps` training steps of real LeRobot PI0 (the `pi0align run` recipe), all dumped at
    `run.level`, at `run.threads` threads (the caller's thread count given back after)."""
    from pi0align.device import resolve
    from pi0align.train.config import TrainConfig

    path = Path(path)
    config = TrainConfig(preset=run.preset, dtype=run.dtype, steps=run.steps, threads=run.threads, seed=run.seed,
                         out=path, progress=False, log_every=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(run.threads)
    try:
        _train_dumped(path, run, config, resolve("cpu"))
    finally:
        torch.set_num_threads(threads)
    return path


def _train_dumped(path: Path, run: Pi0Run, config, device) -> None:
    """dump_pi0's training, every step dumped."""
    from pi0align.dump import Dumper
    from pi0align.train.data import make_loader
    from pi0align.train.loop import build_components, train_step

    components = build_components(config, device)
    policy, optimizer, scheduler = components["policy"], components["optimizer"], components["scheduler"]
    batches = iter(make_loader(components["dataset"], batch_size=config.batch_size, seed=config.seed, start_step=0,
                               steps=config.steps, num_workers=0, pin_memory=False))
    clip = policy.config.optimizer_grad_clip_norm
    with run.device.on(policy), Dumper(path, steps=None, level=run.level, mode=run.mode, perturb_ulps=run.perturb_ulps,
                                       perturb_seed=run.seed + 7, manifest=components["manifest"]) as dumper:
        for step in range(config.steps):
            batch = components["preprocessor"](next(batches))
            if step == run.batch_nan_at:
                batch["observation.state"][0, 0] = float("nan")
            dumper.start(policy, step=step, optimizer=optimizer)
            lr = optimizer.param_groups[0]["lr"]
            loss, grad_norm = train_step(policy, batch, optimizer, scheduler, clip)
            dumper.record_metrics(step, loss, grad_norm, lr)
            dumper.stop()
            dumper.step()


@dataclass(frozen=True)
class Case:
    """One scenario of the verdict's scoreboard: run A, run B (and a noise reference), and what a
    right answer is: the verdict and, when diverged, the first divergence (the start of its name,
    its kind, direction and step: None is any) and the top culprit group's API."""

    name: str
    a: ToyRun | Pi0Run
    b: ToyRun | Pi0Run
    verdict: str
    top: str | None = None  # expected first divergence: the start of its name
    reference: ToyRun | Pi0Run | None = None
    replay: bool = True
    kind: str = "call"
    direction: str | None = "forward"
    step: int | None = None
    group: str | None = None  # expected API of the top culprit group


def _toy(model: str, dtype: str, mode: str, **b) -> tuple[ToyRun, ToyRun]:
    return ToyRun(model=model, dtype=dtype, mode=mode), ToyRun(model=model, dtype=dtype, mode=mode, **b)


def _noise(run: ToyRun, ulps: int = 1) -> ToyRun:
    return ToyRun(**{**run.__dict__, "perturb_ulps": ulps, "seed": run.seed})


NOISY = Emulation(ulp_noise=1)


def toy_cases() -> list[Case]:
    cases = []
    faults = {"mlp": ("blocks.2.2", "gelu", "blocks.2.2/Functional.gelu#0"),
              "transformer": ("layers.1.attention", "softmax", "layers.1.attention/Torch.softmax#0")}
    for model in ("mlp", "transformer"):
        path, function, culprit = faults[model]
        faulty = Emulation(ulp_noise=1, fault=(path, function, 0, 1.03))
        for mode in ("tensor", "stats"):
            a, b = _toy(model, "bf16", mode, device=NOISY)
            reference = _noise(a) if mode == "stats" else None
            cases.append(Case(f"{model} bf16 {mode}: ulp noise", a, b, "aligned", reference=reference))
            a, b = _toy(model, "bf16", mode, device=faulty)
            cases.append(Case(f"{model} bf16 {mode}: ulp noise + {function} 3% off", a, b, "diverged", culprit,
                              reference=reference))
        a, b = _toy(model, "fp32", "stats", device=Emulation(tf32=True))
        cases.append(Case(f"{model} fp32 stats: TF32 matmuls", a, b, "diverged", None))
    # lr 1e-2: Adam turns the rounding-level gradient of the fused qkv bias's key part into
    # updates that part the two runs' parameters at step 1 beyond the fp32 limits
    a, b = ToyRun(model="transformer", lr=1e-2), ToyRun(model="transformer", sdpa=True, lr=1e-2)
    cases.append(Case("transformer fp32 tensor: SDPA vs manual attention", a, b, "aligned"))
    b = ToyRun(model="transformer", sdpa=True, lr=1e-2, device=Emulation(fault=("layers.0.mlp", "gelu", 0, 1.03)))
    cases.append(Case("transformer fp32 tensor: SDPA vs manual + gelu 3% off", a, b, "diverged",
                      "layers.0.mlp.1/Functional.gelu#0"))
    return cases + kind_cases()


def kind_cases() -> list[Case]:
    """Culprits that are not one kernel: a whole family, a backward kernel, the optimizer, the data,
    the weights; and what must not be blamed (weights a later step inherits, another dtype)."""
    cases = []
    matmul_sites = {"mlp": ("blocks.1.2", "gelu", "blocks.1.2/Functional.gelu#0", "blocks.1.2/Module.GELU#0"),
                    "transformer": ("layers.1.attention", "softmax", "layers.1.attention/Torch.softmax#0",
                                    "layers.1.attention/Module.Attention#0")}
    for model, (path, function, culprit, module_culprit) in matmul_sites.items():
        for mode in ("tensor", "stats"):
            a, b = _toy(model, "fp32", mode, device=Emulation(tf32=True, ulp_noise=1))
            cases.append(Case(f"{model} fp32 {mode}: ulp noise + TF32 matmuls, the family", a, b, "diverged", None,
                              direction=None, group="matmul family"))
            for change in ({"eps": 1e-6}, {"changed_sample_at": 1}):
                a, b = _toy(model, "bf16", mode, device=NOISY, **change)
                expected = ({"kind": "optimizer", "direction": "optimizer", "step": 0, "group": "Optimizer.step"}
                            if "eps" in change else {"top": "input/Data#0", "kind": "data", "direction": "data",
                                                     "step": 1})
                what = "AdamW eps 1e-6" if "eps" in change else "one sample changed at step 1"
                cases.append(Case(f"{model} bf16 {mode}: ulp noise + {what}", a, b, "diverged",
                                  reference=_noise(a) if mode == "stats" else None, **expected))
            backward = Emulation(fault=(path, function, 0, 1.001), fault_backward=True)
            a, b = _toy(model, "fp32", mode, device=backward)
            cases.append(Case(f"{model} fp32 {mode}: {function}'s gradient 1e-3 off", a, b, "diverged", culprit,
                              direction="backward", step=0))
            a, b = _toy(model, "fp32", mode, eps=1e-6)
            cases.append(Case(f"{model} fp32 {mode}: AdamW eps 1e-6 against 1e-8", a, b, "diverged", None,
                              kind="optimizer", direction="optimizer", step=0, group="Optimizer.step"))
            a, b = _toy(model, "fp32", mode, optimizer="handwritten")
            cases.append(Case(f"{model} fp32 {mode}: hand-written AdamW", a, b, "aligned"))
            a, b = _toy(model, "fp32", mode, changed_sample_at=1)
            cases.append(Case(f"{model} fp32 {mode}: one sample changed at step 1", a, b, "diverged", "input/Data#0",
                              kind="data", direction="data", step=1))
            a, b = _toy(model, "fp32", mode, seed=1)
            cases.append(Case(f"{model} fp32 {mode}: another seed", a, b, "diverged", None, kind="initial_weights",
                              direction="parameter", step=0))
            a, b = ToyRun(model=model, mode=mode), ToyRun(model=model, dtype="bf16", mode=mode)
            if mode == "tensor":  # replay: bf16 within its own rounding is no culprit
                cases.append(Case(f"{model} fp32 against bf16 {mode}", a, b, "aligned"))
            for level, top in (("mix", culprit), ("module", module_culprit)):
                once = Emulation(fault=(path, function, 0, 1.03), fault_forwards=1)
                a, b = (ToyRun(model=model, mode=mode, level=level),
                        ToyRun(model=model, mode=mode, level=level, device=once))
                cases.append(Case(f"{model} fp32 {mode} {level}: {function} 3% off at step 0 only", a, b, "diverged",
                                  top, step=0))
    return cases


def rule_cases() -> list[Case]:
    """For each rule that explains a failing row or keeps a call from being a culprit, a real
    difference of the kind it could hide, a few times the dtype's limit (or the rule's own bound),
    placed where it applies (tests/test_verdict_rules.py; docs/compare.md, "Bounds")."""
    no_records, gap = {"record_optimizer": False}, {"record_optimizer": False, "steps": 3, "dumped": (0, 2)}
    sdpa = lambda **b: ToyRun(model="transformer", mode="stats", sdpa=True, **b)  # noqa: E731
    cases = []
    for mode in ("stats", "tensor"):
        a = ToyRun(mode=mode, **no_records)
        cases += [Case(f"mlp fp32 {mode}: AdamW eps 1e-4, updates not recorded", a, ToyRun(mode=mode, eps=1e-4,
                                                                                          **no_records),
                       "diverged", kind="optimizer", direction="parameter", step=1, group="Optimizer.step"),
                  Case(f"mlp fp32 {mode}: updates not recorded, same run", a, ToyRun(mode=mode, **no_records),
                       "aligned")]
    cases.append(Case("mlp fp32 stats: AdamW eps 1e-4, steps 0 and 2 dumped", ToyRun(mode="stats", **gap),
                      ToyRun(mode="stats", eps=1e-4, **gap), "diverged", kind="optimizer", direction="parameter",
                      step=2, group="Optimizer.step"))
    for factor, times in ((1.002, 20), (1.0005, 5)):
        cases.append(Case(f"transformer fp32 stats: SDPA vs manual + linear {times}x the limit off",
                          ToyRun(model="transformer", mode="stats"),
                          sdpa(device=Emulation(fault=("layers.1.mlp", "linear", 0, factor))), "diverged",
                          "layers.1.mlp.0/Functional.linear#0", step=0))
    cases.append(Case("transformer fp32 stats: SDPA vs manual attention", ToyRun(model="transformer", mode="stats"),
                      sdpa(), "aligned"))
    # level module: a linear's input gradient is also its block's (a Sequential's), whose backward
    # row opens first, at its first gradient (modules.enclosing_modules)
    for factor, times in ((1.0002, 2), (1.0005, 5)):
        fault = Emulation(ulp_noise=1, fault=("blocks.1.0", "linear", 0, factor), fault_backward=True)
        cases.append(Case(f"mlp fp32 stats, level module: ulp noise + a linear's input gradient {times}x the limit off",
                          ToyRun(mode="stats", level="module"), ToyRun(mode="stats", level="module", device=fault),
                          "diverged", "blocks.1.0/Module.Linear#0", direction="backward", step=0))
    for excluded, function, culprit in (("blocks.2.2", "gelu", "blocks.2/Module.Sequential#0"),
                                        ("blocks.1.1", "layer_norm", "blocks.1/Module.Sequential#0")):
        hidden = (f"{excluded}/*",)
        faulty = Emulation(fault=(excluded, function, 0, 1.0005))
        cases.append(Case(f"mlp fp32 stats: {function} not dumped, 5x the limit off",
                          ToyRun(mode="stats", exclude=hidden), ToyRun(mode="stats", exclude=hidden, device=faulty),
                          "diverged", culprit, step=0))
    # a module not dumped computes its parameters' gradients: held to the gradient entering the
    # innermost dumped module around it (sources.add_gradient_sources)
    hidden = ("blocks.1.1/*",)
    for seed in (2, 3):
        cases.append(Case(f"mlp bf16 stats: a LayerNorm not dumped, ulp noise draw {seed}",
                          ToyRun(dtype="bf16", mode="stats", exclude=hidden),
                          ToyRun(dtype="bf16", mode="stats", exclude=hidden,
                                 device=Emulation(ulp_noise=1, ulp_seed=seed)), "aligned"))
    for factor, times in ((1.0002, 2), (1.0005, 5)):
        gradient_off = Emulation(ulp_noise=1, fault=("blocks.1.1", "layer_norm", 0, factor), fault_backward=True)
        cases.append(Case(f"mlp fp32 stats: a LayerNorm not dumped, its gradients {times}x the limit off",
                          ToyRun(mode="stats", exclude=hidden), ToyRun(mode="stats", exclude=hidden,
                                                                       device=gradient_off),
                          "diverged", "blocks.1.1.weight/Parameter#0", kind="gradient", direction="gradient",
                          step=0))
    # every LayerNorm's weight is ones, in bf16 at every step: its gradient is what its own readers
    # sent (identity._shared_parameters_own_readers), not every LayerNorm's readers
    for percent in (2, 5):
        off = ToyRun(dtype="bf16", mode="stats", device=NOISY, parameter_gradient_scaled=("blocks.1.1.weight",
                                                                                         1 + percent / 100))
        cases.append(Case(f"mlp bf16 stats: ulp noise + a LayerNorm's weight gradient {percent}% off on its way",
                          ToyRun(dtype="bf16", mode="stats"), off, "diverged",
                          "blocks.1.1.weight/Parameter#0", kind="gradient", direction="gradient"))
    cases.append(Case("mlp bf16 stats: ulp noise + every layer_norm 3% off",
                      ToyRun(dtype="bf16", mode="stats", device=NOISY),
                      ToyRun(dtype="bf16", mode="stats", device=Emulation(ulp_noise=1, ulp_seed=2,
                                                                          every=("layer_norm", 1.03))),
                      "diverged", "blocks.0.1/Functional.layer_norm#0", step=0, group="Functional.layer_norm"))
    bare = {"exclude": ("*/Data#*",), "checksums": False}  # as msprobe's dumps
    cases.append(Case("mlp fp32 stats, no checksums or batch records: one sample 1% off at step 1",
                      ToyRun(mode="stats", **bare),
                      ToyRun(mode="stats", changed_sample_at=1, sample_change=1e-2, **bare),
                      "diverged", "/Module.Mlp#0/input 0", kind="data", direction="data", step=1))
    cases.append(Case("mlp fp32 stats: ulp noise + one update leaves its weight 20% off",
                      ToyRun(mode="stats", device=NOISY),
                      ToyRun(mode="stats", device=Emulation(ulp_noise=1, ulp_seed=2),
                             update_scaled=("blocks.1.0.weight", 1.2)),
                      "diverged", "blocks.1.0.weight/Optimizer.step#0", kind="optimizer", direction="optimizer",
                      step=0))
    expert_mlp = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp"
    up_proj_off = Emulation(fault=(expert_mlp, "linear", 1, 1.03), fault_backward=True)
    for mode in ("stats", "sample"):
        tiny = {"preset": "tiny", "dtype": "bf16", "mode": mode}
        cases += [Case(f"PI0 tiny bf16 {mode}: 1 vs 2 threads", Pi0Run(threads=1, **tiny), Pi0Run(threads=2, **tiny),
                       "aligned"),
                  Case(f"PI0 tiny bf16 {mode}: 2 threads + the expert's up_proj gradient 3% off",
                       Pi0Run(threads=1, **tiny), Pi0Run(threads=2, device=up_proj_off, **tiny), "diverged",
                       f"{expert_mlp}.up_proj/Functional.linear#0", direction="backward", step=0)]
    draw = Emulation(ulp_noise=1, ulp_seed=5, fault=("blocks.2.2", "gelu", 0, 1.03))
    cases.append(Case("mlp bf16 stats: ulp noise of another draw + gelu 3% off", ToyRun(dtype="bf16", mode="stats"),
                      ToyRun(dtype="bf16", mode="stats", device=draw), "diverged", "blocks.2.2/Functional.gelu#0"))
    # statistics by channel: without a noise reference, the draws whose extremes moved most (an
    # extreme of the noise was named: a gelu's gradient, the head, an attention matmul's gradient)
    for model, seed in (("mlp", 3), ("mlp", 8), ("transformer", 5)):
        cases.append(Case(f"{model} bf16 stats: ulp noise, draw {seed}, no noise reference",
                          ToyRun(model=model, dtype="bf16", mode="stats"),
                          ToyRun(model=model, dtype="bf16", mode="stats", device=Emulation(ulp_noise=1, ulp_seed=seed)),
                          "aligned"))
    # a linear's gradient 3 % off where noise moved an extreme of its incoming gradient 3 %
    gradient_off = Emulation(ulp_noise=1, fault=("blocks.1.0", "linear", 0, 1.03), fault_backward=True)
    cases.append(Case("mlp bf16 stats: ulp noise + a linear's gradient 3% off", ToyRun(dtype="bf16", mode="stats"),
                      ToyRun(dtype="bf16", mode="stats", device=gradient_off), "diverged",
                      "blocks.1.0/Functional.linear#0", direction="backward"))
    cases += level_module_cases()
    # a linear's gradient 2 % off whose bias gradient sums with C = 3.7: each result held to its own C
    mlp_gradient_off = Emulation(ulp_noise=1, fault=("layers.0.mlp", "linear", 0, 1.02), fault_backward=True)
    cases.append(Case("transformer bf16 stats: ulp noise + an MLP linear's gradient 2% off",
                      ToyRun(model="transformer", dtype="bf16", mode="stats"),
                      ToyRun(model="transformer", dtype="bf16", mode="stats", device=mlp_gradient_off), "diverged",
                      "layers.0.mlp.0/Functional.linear#0", direction="backward", step=0))
    scores_off = Emulation(ulp_noise=1, ulp_seed=2, fault=("layers.0.attention", "matmul", 0, 1.03))
    cases.append(Case("transformer bf16 stats: ulp noise + the attention scores 3% off",
                      ToyRun(model="transformer", dtype="bf16", mode="stats"),
                      ToyRun(model="transformer", dtype="bf16", mode="stats", device=scores_off), "diverged",
                      "layers.0.attention/Torch.matmul#0", step=0))
    cases.append(Case("mlp bf16 tensor: ulp noise, another draw", ToyRun(dtype="bf16"),
                      ToyRun(dtype="bf16", device=Emulation(ulp_noise=1, ulp_seed=2)), "aligned"))
    kernel = Emulation(adam_eps=1e-4)
    cases.append(Case("mlp fp32 tensor: AdamW kernel computes with eps 1e-4, its settings say 1e-8", ToyRun(),
                      ToyRun(device=kernel), "diverged", kind="optimizer", direction="optimizer", step=0,
                      group="Optimizer.step"))
    return cases + gap_cases()


def level_module_cases() -> list[Case]:
    """At level module the loss's gradient (computed after the model) and the arithmetic between
    child modules (a residual sum, attention's scores and softmax) are not dumped: noise alone, and
    a difference a few times the dtype's limit in each (explain._undumped_gradients_within,
    undumped.add_inside_errors), on the toy models and real PI0 tiny."""
    module = lambda model, dtype, **b: ToyRun(model=model, dtype=dtype, mode="stats", level="module", **b)  # noqa: E731
    cases = [Case(f"{model} bf16 stats, level module: ulp noise, no noise reference", module(model, "bf16"),
                  module(model, "bf16", device=Emulation(ulp_noise=1, ulp_seed=2)), "aligned")
             for model in ("mlp", "transformer")]
    for model in ("mlp", "transformer"):
        for dtype, scale, times in (("bf16", 1.02, 5), ("fp32", 1.0002, 2)):
            cases.append(Case(f"{model} {dtype} stats, level module: ulp noise + the loss {times}x the limit off",
                              module(model, dtype), module(model, dtype, loss_scale=scale,
                                                           device=Emulation(ulp_noise=1, ulp_seed=2)),
                              "diverged", "head/Module.Linear#0", direction="backward", step=0))
    for dtype, factor, times in (("bf16", 1.02, 5), ("fp32", 1.0002, 2)):
        softmax_off = Emulation(ulp_noise=1, ulp_seed=2, fault=("layers.1.attention", "softmax", 0, factor))
        cases.append(Case(f"transformer {dtype} stats, level module: ulp noise + attention's softmax {times}x the "
                          "limit off", module("transformer", dtype), module("transformer", dtype, device=softmax_off),
                          "diverged", "layers.1.attention/Module.Attention#0", step=0))
    tiny = {"preset": "tiny", "dtype": "bf16", "mode": "stats", "level": "module"}
    expert_mlp = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp"
    up_proj_off = Emulation(fault=(expert_mlp, "linear", 1, 1.03), fault_backward=True)
    # the first layer's attention weights times V, computed between modules (not dumped)
    mixing_off = Emulation(fault=("model.paligemma_with_expert", "matmul", 1, 1.03))
    cases += [Case("PI0 tiny bf16 stats, level module: 1 vs 2 threads", Pi0Run(threads=1, **tiny),
                   Pi0Run(threads=2, **tiny), "aligned"),
              Case("PI0 tiny bf16 stats, level module: 2 threads + the expert's up_proj gradient 3% off",
                   Pi0Run(threads=1, **tiny), Pi0Run(threads=2, device=up_proj_off, **tiny), "diverged",
                   f"{expert_mlp}.up_proj/Module.Linear#0", direction="backward", step=0),
              Case("PI0 tiny bf16 stats, level module: 2 threads + attention's weights times V 3% off",
                   Pi0Run(threads=1, **tiny), Pi0Run(threads=2, device=mixing_off, **tiny), "diverged",
                   "model.paligemma_with_expert/Module.PaliGemmaWithExpertModel#0", step=0)]
    return cases


def gap_cases() -> list[Case]:
    """A gap in the dumped steps, and a first dumped step past 0: the optimizer's states and the
    parameters read after it were made by updates that were not dumped, of noise where the runs
    compute differently; a gradient 3x fp32's limit off in a step not dumped; parameters that
    part by the first dumped step where the runs compute alike (their manifests); and runs dumped
    at other steps, compared at those both hold."""
    cases = []
    for dumped, listed, faulty in (((0, 2, 4), "0, 2 and 4", 1), ((2, 4), "2 and 4", 0)):
        noisy = {"dtype": "bf16", "mode": "stats", "steps": 5, "dumped": dumped}
        cases.append(Case(f"mlp bf16 stats: ulp noise, steps {listed} dumped", ToyRun(**noisy),
                          ToyRun(device=NOISY, device_name="emulated", **noisy), "aligned"))
        runs = {"model": "transformer", "mode": "stats", "steps": 5, "dumped": dumped}
        cases.append(Case(f"transformer fp32 stats: SDPA vs manual, steps {listed} dumped", ToyRun(**runs),
                          ToyRun(sdpa=True, **runs), "aligned"))
        off = ("layers.0.mlp.0.weight", 1.0003, faulty)
        cases.append(Case(f"transformer fp32 stats: SDPA vs manual + a gradient 3x the limit off at step {faulty}, "
                          f"steps {listed} dumped", ToyRun(**runs), ToyRun(sdpa=True, gradient_scaled=off, **runs),
                          "diverged", "layers.0.mlp.0.weight/Optimizer.step#0", kind="optimizer",
                          direction="optimizer", step=2))
    noisy = {"dtype": "bf16", "mode": "stats", "steps": 5}
    for dumped_a, dumped_b, listed in (((0, 1, 2, 3, 4), (2, 4), "every step against 2 and 4"),
                                       ((0, 2, 4), (1, 2, 3, 4), "0, 2 and 4 against 1 to 4")):
        cases.append(Case(f"mlp bf16 stats: ulp noise, steps {listed} dumped", ToyRun(dumped=dumped_a, **noisy),
                          ToyRun(device=NOISY, device_name="emulated", dumped=dumped_b, **noisy), "aligned"))
    late = {"mode": "stats", "record_optimizer": False, "steps": 4, "dumped": (2, 3)}
    cases.append(Case("mlp fp32 stats: AdamW eps 1e-4, updates not recorded, steps 2 and 3 dumped", ToyRun(**late),
                      ToyRun(eps=1e-4, **late), "diverged", kind="parameters", direction="parameter", step=2))
    return cases


EXPERT_FAULT = ("model.paligemma_with_expert.gemma_expert.model.layers.1.mlp", "linear", 0, 1.03)


EXPERT_CULPRIT = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.gate_proj/Functional.linear#0"
# an RMSNorm's rsqrt, whose gradient is judged through how close its input comes to zero
RMS_NORM = "model.paligemma_with_expert.paligemma.model.language_model.layers.3.input_layernorm"


def pi0_cases(steps: int = 2) -> list[Case]:
    a = Pi0Run(threads=1, steps=steps)
    root_gradient = Emulation(fault=(RMS_NORM, "rsqrt", 0, 1.03), fault_backward=True)
    return [Case("PI0 small bf16 tensor: 1 vs 2 threads", a, Pi0Run(threads=2, steps=steps), "aligned"),
            Case("PI0 small bf16 tensor: 2 threads + expert linear 3% off", a,
                 Pi0Run(threads=2, steps=steps, device=Emulation(fault=EXPERT_FAULT)), "diverged", EXPERT_CULPRIT),
            Case("PI0 small bf16 tensor: 2 threads + an RMSNorm's rsqrt gradient 3% off", a,
                 Pi0Run(threads=2, steps=steps, device=root_gradient), "diverged", f"{RMS_NORM}/Torch.rsqrt#0",
                 direction="backward")]


def statistics_only(case: Case) -> Case:
    """The same case dumped in statistics mode and judged without a noise reference or replay:
    the intrinsic rule alone, as most users' dumps (and every msprobe statistics dump) are judged."""
    def stats(run):
        return replace(run, mode="stats", perturb_ulps=0)

    return replace(case, name=case.name + " [statistics only]", a=stats(case.a), b=stats(case.b), reference=None,
                   replay=False)


def without_replay(case: Case) -> Case | None:
    """The same full-tensor case compared without replay (`--no-replay`): the intrinsic rule on full
    tensors; None where a run holds no full tensors or the case is not replayed anyway."""
    if not case.replay or case.a.mode != "tensor" or case.b.mode != "tensor":
        return None
    return replace(case, name=case.name + " [no replay]", replay=False)


def play(case: Case, work: Path, made: dict) -> tuple[object, bool]:
    """Dump the case's runs (each once: `made` maps a run to its dump folder) and compare them as a
    user would; returns the Comparison and whether its answer is right: the expected verdict, no
    culprit where aligned; where diverged, the expected first divergence (name, kind, direction,
    step), no culprit at a later step than a fault at step 0 alone, and the top culprit group."""
    from pi0align.compare import compare_dumps

    def dumped(run) -> Path:
        if run not in made:
            path = Path(work) / f"run{len(made)}"
            made[run] = dump_toy(path, run) if isinstance(run, ToyRun) else dump_pi0(path, run)
        return made[run]

    a, b = dumped(case.a), dumped(case.b)
    reference = dumped(case.reference) if case.reference is not None else None
    result = compare_dumps(a, b, noise=reference, replay=case.replay)
    first = result.first_divergence
    right = result.verdict == case.verdict
    if case.verdict == "aligned":
        return result, right and not result.culprits
    right &= first is not None and first.kind == case.kind
    if first is not None:
        right &= case.top is None or first.name.startswith(case.top)
        right &= case.direction is None or first.direction == case.direction
        right &= case.step is None or first.step == case.step
    if case.group is not None:
        right &= bool(result.culprit_groups) and result.culprit_groups[0].api == case.group
    if isinstance(case.b, ToyRun) and case.b.device.fault_forwards == 1:  # weights inherited are no one's fault
        right &= all(c.step == 0 for c in result.culprits)
    return result, right


def dump_pi0_with_msprobe(out: str | Path, task: str = "statistics", level: str = "L1", preset: str = "small",
                          dtype: str = "bf16", threads: int = 1, seed: int = 1234,
                          device: Emulation = Emulation()) -> Path:
    """One training step of real LeRobot PI0 dumped by msprobe's PrecisionDebugger (its own
    `start` / `stop` / `step` around the step), on an emulated `device`; run it in a child process:
    msprobe patches torch for good."""
    from msprobe.pytorch import PrecisionDebugger

    from pi0align.device import resolve
    from pi0align.train.config import TrainConfig
    from pi0align.train.data import make_loader
    from pi0align.train.loop import build_components, train_step

    out = Path(out)
    config = TrainConfig(preset=preset, dtype=dtype, steps=1, threads=threads, seed=seed, out=out / "run",
                         progress=False, log_every=0)
    torch.set_num_threads(threads)
    # made first, as a training script makes it: msprobe wraps torch's functions when made, and
    # transformers binds F.gelu when the model is built (functools.partial)
    debugger = PrecisionDebugger(task=task, dump_path=str(out / "msprobe"), level=level)
    components = build_components(config, resolve("cpu"))
    policy = components["policy"]
    batch = components["preprocessor"](next(iter(make_loader(components["dataset"], batch_size=config.batch_size,
                                                             seed=seed, start_step=0, steps=1, num_workers=0,
                                                             pin_memory=False))))
    with device.on(policy):
        debugger.start(policy)
        train_step(policy, batch, components["optimizer"], components["scheduler"],
                   policy.config.optimizer_grad_clip_norm)
        debugger.stop()
        debugger.step()
    return out / "msprobe"

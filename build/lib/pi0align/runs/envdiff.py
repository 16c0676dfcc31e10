"""Are two runs set up alike? Their manifests side by side, one line per item (`pi0align env-diff`).

An item is one thing a user sets up (a library's version, a numerics switch, a hyper-parameter),
read from the manifest keys that say it (the seed is `seed` and `config.seed`; the learning rate
`hyperparameters.optimizer_lr` and `config.lr`). Where an item differs, its effect says what that
means: `differs and matters` (it changes the numbers a run computes: call-by-call comparison is
off until it is aligned), `differs` (expected, or of an effect not known: the devices compared,
the tool's own version), `differs (follows)` (made from another item that differs: random initial
weights from the seed), `differs (no effect)` (paths, command lines, times, host names), or
`recorded on one side only` (a manifest older, or of another kind, than the other). Each item's
reason is in ITEMS and docs/runs.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pi0align.compare.measuring.manifest import flatten

SAME, DIFFERS, NO_EFFECT, MATTERS = "same", "differs", "differs (no effect)", "differs and matters"
FOLLOWS = "differs (follows)"  # made from another item that differs: that one is the cause
ONE_SIDE = "recorded on one side only"  # a manifest older or of another kind: not known to differ


@dataclass(frozen=True)
class Item:
    """One thing a run is set up with: its manifest keys (the first present is shown), what a
    difference in it means (MATTERS, DIFFERS or NO_EFFECT), and why; `follows`: the items it is
    made from (the seed and the host's CPU for random initial weights), when one of them differs
    too, with the keys that must be unset on both sides for it to hold (a pretrained checkpoint is
    no seed's)."""

    name: str
    keys: tuple[str, ...]
    effect: str
    why: str
    follows: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()


_LIBRARY = "its kernels, and so the numbers they compute, change between versions"
_SWITCH = "changes how float32 and reductions are computed"
_HOST = "the host's CPU kernels (PI0's noise draw, the batch, random initial weights) round otherwise"
_HOST_ITEMS = ("CPU architecture", "CPU model", "CPU code path", "BLAS", "oneDNN")
ITEMS = [
    *(Item(name, (f"versions.{name}",), MATTERS, _LIBRARY)
      for name in ("torch", "torch_npu", "cann", "transformers", "lerobot", "deepspeed", "accelerate")),
    *(Item(name, (f"versions.{name}",), DIFFERS, "no kernel of the training runs in it")
      for name in ("python", "numpy", "torchvision", "msprobe", "pi0align")),
    Item("device", ("device", "config.device"), DIFFERS, "the devices compared"),
    Item("device name", ("device_name",), DIFFERS, "the devices compared"),
    Item("device count", ("device_count",), DIFFERS, "devices present on the machine, not used"),
    *(Item(name, keys, MATTERS, why) for name, keys, why in zip(_HOST_ITEMS, (
        ("cpu.architecture",), ("cpu.model",), ("cpu.capability", "cpu.capability_forced"), ("cpu.blas", "cpu.mkl"),
        ("cpu.onednn",)), (
        _HOST, "torch's BLAS chooses its kernels by processor: " + _HOST,
        "torch's CPU kernels vectorised otherwise (ATEN_CPU_CAPABILITY): " + _HOST, _LIBRARY + ": " + _HOST,
        _LIBRARY + ": " + _HOST))),
    Item("world size", ("world_size",), MATTERS, "the global batch and the reductions across ranks"),
    Item("dtype", ("dtype", "config.dtype", "hyperparameters.dtype"), MATTERS,
         "parameters and activations in another precision (autocast included)"),
    Item("seed", ("seed", "config.seed"), MATTERS, "other initial weights, batches and noise"),
    Item("seed_all", ("seed_impl", "config.seed_impl"), MATTERS, "another seed_all draws other numbers"),
    Item("seeded by attach", ("attached.seed_forced",), MATTERS, "seed_all ran before the script's own code"),
    Item("model class", ("attached.model",), MATTERS, "another model (the module the first optimizer trains)"),
    Item("optimizer class", ("attached.optimizer",), MATTERS, "another update"),
    Item("initial weights", ("weights_sha256",), MATTERS, "the training starts from other weights",
         follows=("seed", *_HOST_ITEMS), unless=("config.pretrained",)),
    Item("dataset", ("dataset_fingerprint",), MATTERS, "other samples"),
    Item("parameter count", ("parameter_count",), MATTERS, "another model"),
    Item("transformers compatibility", ("transformers_compat",), MATTERS,
         "another implementation of PI0's Gemma pieces ran"),
    Item("pi0align commit", ("git_commit",), DIFFERS, "the tool's own code: its training loop may differ"),
    Item("threads", ("numerics.threads", "config.threads"), MATTERS, "CPU reductions are split by thread"),
    *(Item(f"autocast on {kind}", (f"numerics.autocast.{kind}",), MATTERS, "matmuls in another precision")
      for kind in ("cpu", "cuda", "npu")),
    *(Item(name, (f"numerics.{name}",), MATTERS, _SWITCH)
      for name in ("float32_matmul_precision", "cuda_matmul_allow_tf32", "cudnn_allow_tf32", "cudnn_deterministic",
                   "deterministic_algorithms", "npu_matmul_allow_hf32", "npu_conv_allow_hf32")),
    *(Item(name, (f"numerics.environment.{name}",), MATTERS, why) for name, why in (
        ("CUBLAS_WORKSPACE_CONFIG", "cuBLAS's deterministic workspace"),
        ("HCCL_DETERMINISTIC", "HCCL's deterministic reductions across NPUs"),
        ("NVIDIA_TF32_OVERRIDE", "turns TF32 on or off whatever torch's switches say"),
        ("OMP_NUM_THREADS", "CPU reductions are split by thread"))),
    Item("PYTHONHASHSEED", ("numerics.environment.PYTHONHASHSEED",), MATTERS,
         "the order of sets and dicts keyed by strings", follows=("seed",)),
    Item("learning rate", ("hyperparameters.optimizer_lr", "config.lr"), MATTERS, "another update"),
    Item("Adam's epsilon", ("hyperparameters.optimizer_eps", "config.adam_eps"), MATTERS, "another update"),
    *(Item(name.replace("_", " "), (f"hyperparameters.{name}",), MATTERS, "another update, model or batch")
      for name in ("optimizer_betas", "optimizer_weight_decay", "optimizer_grad_clip_norm",
                   "scheduler_warmup_steps", "scheduler_decay_steps", "scheduler_decay_lr", "chunk_size",
                   "n_action_steps", "max_state_dim", "max_action_dim", "image_resolution", "tokenizer_max_length",
                   "num_inference_steps", "paligemma_variant", "action_expert_variant")),
    Item("policy", ("policy_type",), MATTERS, "another model (LeRobot's policy type)"),
    Item("preset", ("config.preset",), MATTERS, "another model size"),
    Item("mixed precision", ("config.use_amp",), MATTERS, "matmuls in another precision (LeRobot's use_amp)"),
    Item("optimizer", ("config.optimizer",), MATTERS, "a fused AdamW computes the update in another order"),
    Item("engine", ("config.engine",), MATTERS, "DeepSpeed keeps its own copies, buckets and clipping"),
    Item("ZeRO stage", ("config.zero_stage",), MATTERS, "partitioned updates and reductions in another order"),
    Item("processes per node", ("config.nproc",), DIFFERS, "the world size is what changes the numbers"),
    Item("cores bound", ("config.bind_cores",), DIFFERS, "where the processes run: speed, not numbers"),
    Item("profiled steps", ("config.profile",), NO_EFFECT, "observed, not changed"),
    Item("steps", ("config.steps",), MATTERS, "the learning rate schedule decays over the run's steps"),
    Item("batch size", ("config.batch_size",), MATTERS, "other batches"),
    Item("deterministic algorithms asked", ("config.deterministic",), MATTERS, "seed_all(mode=...)"),
    Item("dropout removed", ("config.rm_dropout",), MATTERS, "seed_all(rm_dropout=...): dropout draws noise"),
    Item("noise reference", ("perturb_ulps",), MATTERS, "results moved by ulps on purpose"),
    Item("PI0 noise drawn on", ("noise_draws",), MATTERS, "drawn on the device, two kinds of device draw other noise"),
    Item("started from", ("started_from.run", "started_from.step"), DIFFERS,
         "a run's checkpoint (run --from): its state, not the initial weights"),
    *(Item(name, keys, NO_EFFECT, why) for name, keys, why in (
        ("run folder", ("config.out",), "a path"),
        ("dataset path", ("dataset", "config.dataset"), "a path: its contents are the fingerprint"),
        ("tokenizer path", ("config.tokenizer",), "a path"),
        ("weights path", ("config.pretrained",), "a path: the weights are their hash"),
        ("command line", ("argv", "attached.argv", "attached.command"), "how it was started"),
        ("host", ("host",), "the machine's name"),
        ("started", ("started",), "a time"),
        ("rank", ("rank",), "which rank's manifest"),
        ("dataloader workers", ("config.num_workers",), "batches are fixed by seed and step, not by workers"),
        ("log, checkpoint and progress settings", ("config.log_every", "config.save_every", "config.progress"),
         "output only"),
        ("monitor", ("config.monitor", "config.monitor_depth", "config.dump_on_alert"), "observed, not changed"))),
]
_ITEM_OF_KEY = {key: item for item in ITEMS for key in item.keys}


@dataclass(frozen=True)
class Line:
    """One item of two runs: its values in A and B, its status (SAME, DIFFERS, NO_EFFECT,
    MATTERS) and why a difference has that effect."""

    item: str
    a: Any
    b: Any
    status: str
    why: str


@dataclass(frozen=True)
class EnvDiff:
    """Two runs' items, in ITEMS' order, keys no item knows last. True when nothing that matters differs."""

    lines: list[Line]

    def __bool__(self) -> bool:
        return not self.matters

    @property
    def matters(self) -> list[Line]:
        return [line for line in self.lines if line.status == MATTERS]

    @property
    def differing(self) -> list[Line]:
        """The items that differ, with an effect or not."""
        return [line for line in self.lines if line.status != SAME]

    @property
    def notable(self) -> list[Line]:
        """The items that differ with an effect, or one not known (paths, times and the like left
        out, and what only one side records)."""
        return [line for line in self.lines if line.status not in (SAME, NO_EFFECT, ONE_SIDE)]


def env_diff(a: dict, b: dict) -> EnvDiff:
    """Every item of two manifests, the same ones included."""
    fa, fb = flatten(a), flatten(b)
    return _lines(fa, fb, set(fa) | set(fb), one_side=set(fa) ^ set(fb))


def env_diff_of(differences: list[tuple[str, Any, Any]]) -> EnvDiff:
    """The items of what differs between two manifests, from compare's manifest_diff (dotted key,
    value in A, value in B, None for null or absent alike): what a comparison of two dumps reports."""
    fa = {key: va for key, va, _ in differences}
    fb = {key: vb for key, _, vb in differences}
    return _lines(fa, fb, set(fa), one_side=set())


def _lines(fa: dict, fb: dict, keys: set[str], one_side: set[str]) -> EnvDiff:
    """The items of the flattened manifests over `keys`; `one_side`: the keys only one records."""
    differs = {key for key in keys if fa.get(key) != fb.get(key)}
    differing_items = {item.name for item in ITEMS if any(key in differs for key in item.keys)}
    lines = []
    for item in ITEMS:
        present = [key for key in item.keys if key in keys]
        if not present:
            continue
        shown = next((key for key in present if key in differs), present[0])
        status, why = (item.effect, item.why) if shown in differs else (SAME, "")
        if status != SAME and all(key in one_side for key in present):
            status, why = ONE_SIDE, "one manifest does not record it"
        elif status == MATTERS and shown.startswith("versions.") and None in (fa.get(shown), fb.get(shown)):
            status, why = DIFFERS, "installed on one side only (torch_npu and CANN come with the NPU)"
        unset = all(fa.get(key) is None and fb.get(key) is None for key in item.unless)
        cause = next((name for name in item.follows if name in differing_items), None)
        if status != SAME and cause is not None and unset:
            status, why = FOLLOWS, f"follows the {cause}, which differs: {item.why}"
        lines.append(Line(item.name, fa.get(shown), fb.get(shown), status, why))
    for key in sorted(keys - set(_ITEM_OF_KEY)):
        status = SAME if key not in differs else ONE_SIDE if key in one_side else DIFFERS
        lines.append(Line(key, fa.get(key), fb.get(key), status, "" if status == SAME else "an effect not known"))
    return EnvDiff(lines)

"""Two checkpoints parameter by parameter (`pi0align ckpt-diff A B`): relative L2 distance,
cosine, largest |Δ|, shapes and dtypes, grouped by module and sorted by difference; with the
optimizer's states too. What is read: `model.safetensors` (a run's `checkpoints/NNNNNN/`, its
`pretrained_model/`, a LeRobot policy folder) or, where there is none, a DeepSpeed checkpoint's
`mp_rank_00_model_states.pt`; for the optimizer, `training_state.pt`, or DeepSpeed's own states
(ZeRO stage 0: ZeRO 1 to 3 keep flat partitions that name no parameter). Pickles are read with
`torch.load(weights_only=True)`: nothing in a checkpoint runs code. msprobe's `config_check -c`
compares two checkpoints the same way.
"""

from __future__ import annotations

import math
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

from pi0align.errors import UserError

WEIGHTS, TRAINING_STATE = "model.safetensors", "training_state.pt"
DEEPSPEED_MODEL = "mp_rank_00_model_states.pt"  # a DeepSpeed checkpoint's module (and, ZeRO 0, optimizer)


@dataclass(frozen=True)
class TensorDifference:
    """One tensor of both checkpoints (a parameter, or an optimizer state `<parameter>:<state>`):
    its module, shapes, dtypes and how far B is from A."""

    name: str
    module: str
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    dtype_a: str
    dtype_b: str
    relative_l2: float  # ‖B − A‖ / ‖A‖ (inf where shapes differ or one side lacks it)
    cosine: float
    max_abs: float

    @property
    def differs(self) -> bool:
        return not (self.relative_l2 == 0 and self.shape_a == self.shape_b and self.dtype_a == self.dtype_b)


def weights_file(path: str | Path) -> Path:
    """The weights of a checkpoint, a `pretrained_model/` or a LeRobot policy folder (safetensors),
    or of a DeepSpeed checkpoint (its model states)."""
    path = Path(path)
    for candidate in (path, path / WEIGHTS, path / "pretrained_model" / WEIGHTS):
        if candidate.is_file() and candidate.name == WEIGHTS:
            return candidate
    found = deepspeed_states(path)
    if found is None:
        raise UserError(f"{path}: no {WEIGHTS} and no DeepSpeed checkpoint (a run's checkpoints/NNNNNN/, its "
                        f"pretrained_model/, a LeRobot policy folder, or a DeepSpeed checkpoint's folder)")
    return found


def deepspeed_states(path: Path) -> Path | None:
    """A DeepSpeed checkpoint's model states: the file, in the folder, in the tag its `latest` names,
    or in a pi0align run's checkpoint (its `deepspeed/`)."""
    folders = [path, path / "deepspeed"]
    latest = path / "latest"
    if latest.is_file() and latest.stat().st_size < 4096:
        tag = latest.read_text(errors="replace").strip()
        if tag and "/" not in tag and tag not in (".", ".."):
            folders.insert(0, path / tag)
    candidates = [path] if path.name == DEEPSPEED_MODEL else [folder / DEEPSPEED_MODEL for folder in folders]
    return next((c for c in candidates if c.is_file()), None)


def read_weights(path: str | Path) -> dict:
    """Every tensor of the checkpoint's weights (torch tensors, as stored)."""
    from safetensors import SafetensorError, safe_open

    file = weights_file(path)
    if file.name == DEEPSPEED_MODEL:
        module = _load(file).get("module")
        if not isinstance(module, dict):
            raise UserError(f"{file}: holds no module state (not a DeepSpeed checkpoint)")
        return _tensors(module)
    try:
        with safe_open(str(file), framework="pt") as weights:
            return {name: weights.get_tensor(name) for name in weights.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise UserError(f"{file}: not readable as safetensors ({str(error).splitlines()[0]})") from None


def read_optimizer(path: str | Path) -> dict[str, object]:
    """`<parameter>:<state>` -> tensor of the checkpoint's optimizer, named by the parameter names
    it was saved with (`#<k>` for older checkpoints): `training_state.pt`'s, else DeepSpeed's."""
    folder = Path(path)
    file = next((f for f in (folder / TRAINING_STATE, folder.parent / TRAINING_STATE) if f.is_file()), None)
    state = _load(file) if file is not None else {}
    if state.get("optimizer") is not None:
        return _named_states(state["optimizer"], state.get("optimizer_names") or [])
    deepspeed = deepspeed_states(folder) or (deepspeed_states(folder.parent) if file is not None else None)
    if deepspeed is None:
        if file is None:
            raise UserError(f"{folder}: no {TRAINING_STATE} and no DeepSpeed checkpoint: --optimizer needs a run's "
                            "checkpoint (checkpoints/NNNNNN/) or a DeepSpeed checkpoint")
        raise UserError(f"{file}: holds no optimizer state")
    states = _load(deepspeed)
    if not isinstance(states.get("optimizer"), dict):
        raise UserError(f"{deepspeed}: holds no optimizer state (ZeRO stages 1 to 3 keep flat partitions that name no "
                        "parameter: not compared)")
    # names: a pi0align run's training_state.pt keeps them; a DeepSpeed checkpoint of another's does not
    return _named_states(states["optimizer"], state.get("optimizer_names") or [])


def _load(file: Path) -> dict:
    """A pickle of tensors and plain data, read with weights_only: anything else is refused."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{file}: holds objects other than tensors and plain data: never unpickled") from None
    except (OSError, RuntimeError, EOFError, ValueError) as error:
        raise UserError(f"{file}: not readable ({str(error).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise UserError(f"{file}: holds a {type(state).__name__}, not a checkpoint's dictionary")
    return state


def _tensors(mapping: dict) -> dict:
    """The tensors of a state dict, a tied weight once (under its first name), as safetensors keeps it."""
    import torch

    found, storages = {}, set()
    for name, value in mapping.items():
        if not isinstance(value, torch.Tensor):
            continue
        where = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if where not in storages:
            storages.add(where)
            found[str(name)] = value
    return found


def _named_states(optimizer: dict, names: list[str]) -> dict[str, object]:
    """`<parameter>:<state>` -> tensor of an optimizer's state_dict, its k-th parameter `names[k]`."""
    import torch

    found = {}
    states = optimizer.get("state") if isinstance(optimizer, dict) else None
    for index, own in (states if isinstance(states, dict) else {}).items():
        parameter = names[index] if isinstance(index, int) and 0 <= index < len(names) else f"#{index}"
        for key, value in (own if isinstance(own, dict) else {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                found[f"{parameter}:{key}"] = value
    return found


def difference(name: str, a, b) -> TensorDifference:
    """How far tensor b is from a (torch tensors or None where one side lacks it)."""
    import torch

    module = name.split(":")[0].rpartition(".")[0]
    shape = lambda t: None if t is None else tuple(t.shape)  # noqa: E731
    dtype = lambda t: "" if t is None else str(t.dtype).removeprefix("torch.")  # noqa: E731
    if a is None or b is None or a.shape != b.shape:
        return TensorDifference(name, module, shape(a), shape(b), dtype(a), dtype(b), math.inf, math.nan, math.inf)
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    norm_a, norm_b = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    delta = y - x
    distance = float(torch.linalg.vector_norm(delta))
    relative = distance / norm_a if norm_a else (0.0 if distance == 0 else math.inf)
    cosine = float(x @ y) / (norm_a * norm_b) if norm_a and norm_b else (1.0 if norm_a == norm_b else 0.0)
    largest = float(delta.abs().max()) if delta.numel() else 0.0
    return TensorDifference(name, module, shape(a), shape(b), dtype(a), dtype(b), relative, cosine, largest)


def compare_checkpoints(a: str | Path, b: str | Path, *, optimizer: bool = False) -> list[TensorDifference]:
    """Every parameter (and, `optimizer`, every optimizer state) of A and B, the largest relative
    difference first."""
    tensors_a, tensors_b = read_weights(a), read_weights(b)
    if optimizer:
        tensors_a |= read_optimizer(a)
        tensors_b |= read_optimizer(b)
    names = list(dict.fromkeys([*tensors_a, *tensors_b]))
    found = [difference(name, tensors_a.get(name), tensors_b.get(name)) for name in names]
    return sorted(found, key=lambda d: (-d.relative_l2 if not math.isnan(d.relative_l2) else 0, d.name))


@dataclass(frozen=True)
class ModuleDifference:
    """The tensors of one module: how many, how many differ, the largest difference among them."""

    module: str
    tensors: int
    differing: int
    relative_l2: float
    cosine: float
    max_abs: float


def by_module(differences: list[TensorDifference]) -> list[ModuleDifference]:
    """The differences grouped by module, the largest first."""
    groups: dict[str, list[TensorDifference]] = {}
    for d in differences:
        groups.setdefault(d.module, []).append(d)
    found = [ModuleDifference(module, len(own), sum(d.differs for d in own), max(d.relative_l2 for d in own),
                              min((d.cosine for d in own), key=lambda c: (math.isnan(c), c)),
                              max(d.max_abs for d in own)) for module, own in groups.items()]
    return sorted(found, key=lambda m: (-m.relative_l2, m.module))


def beyond(differences: list[TensorDifference], tolerance: float) -> list[TensorDifference]:
    """The tensors that differ beyond `tolerance` (relative L2), or in shape or dtype."""
    return [d for d in differences if d.relative_l2 > tolerance or d.shape_a != d.shape_b or d.dtype_a != d.dtype_b]

"""Build LeRobot's real PI0Policy at a preset size, offline, with random or local pretrained weights."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from pi0align.errors import UserError
from pi0align.pi0 import compat
from pi0align.pi0.presets import PRESETS, Preset

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def make_config(preset: Preset, input_features: dict, output_features: dict, *, device: str, dtype: str,
                lr: float | None = None, adam_eps: float | None = None):
    """LeRobot's PI0Config for a preset; `lr` and `adam_eps` override the optimizer preset's peak
    learning rate and epsilon."""
    from lerobot.policies.pi0.configuration_pi0 import PI0Config

    config = PI0Config(
        dtype=DTYPES[dtype],
        chunk_size=preset.chunk_size,
        n_action_steps=preset.chunk_size,
        image_resolution=(preset.image_size, preset.image_size),
        tokenizer_max_length=preset.tokenizer_max_length,
        device=device,
    )
    if lr is not None:
        config.optimizer_lr = lr
    if adam_eps is not None:
        config.optimizer_eps = adam_eps
    config.input_features = dict(input_features)
    config.output_features = dict(output_features)
    return config


def build_policy(preset_name: str, input_features: dict, output_features: dict, *, device: str = "cpu",
                 dtype: str = "fp32", lr: float | None = None, adam_eps: float | None = None,
                 pretrained: Path | None = None):
    """A LeRobot PI0Policy: random init from the current torch RNG, or the weights in `pretrained`."""
    compat.apply()
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy

    preset = PRESETS[preset_name]
    config = make_config(preset, input_features, output_features, device=device, dtype=dtype, lr=lr, adam_eps=adam_eps)
    with _sized_like(preset):
        policy = PI0Policy(config)
    policy.model.sample_noise = _noise_drawn_on_the_cpu
    if pretrained is not None:
        load_weights(policy, Path(pretrained))
    return policy


# what the manifest says of PI0's random draws (NOISE_DRAWS)
NOISE_DRAWS = "cpu"


def _noise_drawn_on_the_cpu(shape, device) -> torch.Tensor:
    """PI0's flow-matching noise, drawn from the CPU generator and moved to the device. LeRobot
    draws it on the device, whose generators differ by kind (CUDA's Philox, the NPU's own, the
    CPU's Mersenne twister): two devices would never draw the same noise, and a CUDA generator's
    state cannot be restored on an NPU. Drawn on the CPU, every device draws the same noise from
    the same seed (PI0's time is already sampled on the CPU); on the CPU nothing changes."""
    return torch.normal(mean=0.0, std=1.0, size=shape, dtype=torch.float32).to(device)


def weights_file(directory: Path) -> Path:
    """`model.safetensors` in a LeRobot policy folder, or one clear line."""
    path = Path(directory) / "model.safetensors"
    if not path.is_file():
        raise UserError(f"no weights at {path}: --pretrained takes a folder holding model.safetensors")
    return path


def save_weights(policy, directory: Path) -> None:
    """A LeRobot policy folder (config.json + model.safetensors, what save_pretrained writes) from
    tensors copied out of any storage they share: DeepSpeed's ZeRO keeps the parameters as views
    of one flat buffer, which safetensors refuses. Tied weights are saved once."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    policy.config._save_pretrained(directory)
    tensors, seen = {}, set()
    for key, value in policy.state_dict().items():
        identity = (value.data_ptr(), tuple(value.shape), value.stride())
        if identity not in seen:
            seen.add(identity)
            tensors[key] = value.detach().clone(memory_format=torch.contiguous_format)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def load_weights(policy, directory: Path) -> None:
    """Load `model.safetensors` from a LeRobot policy folder (lerobot/pi0 layout, or our checkpoints)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_file_path = weights_file(directory)
    try:
        state_dict = load_file(str(weights_file_path))
    except (SafetensorError, OSError) as error:
        raise UserError(f"cannot read {weights_file_path}: {error}") from None
    # LeRobot's own key fixes for openpi-converted checkpoints, then its "model." prefix.
    state_dict = policy._fix_pytorch_state_dict_keys(state_dict, policy.config)
    state_dict = {key if key.startswith("model.") else f"model.{key}": value for key, value in state_dict.items()}
    try:
        missing, unexpected = policy.load_state_dict(state_dict, strict=False)
    except RuntimeError as error:  # a tensor of another shape: another preset's weights
        lines = str(error).splitlines()
        detail = next((line.strip() for line in lines if "size mismatch" in line), lines[0] if lines else "")
        raise UserError(f"weights in {weights_file_path} do not fit this preset: {detail}") from None
    # Tied weights (PaliGemma's embedding and lm_head) are saved once: a missing key is fine when
    # it shares storage with a key that was loaded.
    current = policy.state_dict()
    loaded_storage = {current[key].data_ptr() for key in state_dict if key in current}
    missing = [key for key in missing if current[key].data_ptr() not in loaded_storage]
    if missing or unexpected:
        raise UserError(
            f"weights in {weights_file_path} do not fit this preset: {len(missing)} missing, {len(unexpected)} "
            f"unexpected keys (first: {(missing or unexpected)[0]})"
        )


@contextlib.contextmanager
def _sized_like(preset: Preset):
    """While LeRobot builds PI0, give its Gemma/SigLIP constructors the preset's sizes.

    LeRobot hard-codes the full sizes in `get_gemma_config` and in the HF configs it creates, so a
    small preset swaps in three module-level names of `modeling_pi0` and restores them afterwards.
    """
    if preset.is_full:
        yield
        return
    from lerobot.policies.pi0 import modeling_pi0

    originals = {name: getattr(modeling_pi0, name)
                 for name in ("get_gemma_config", "PaliGemmaForConditionalGeneration", "GemmaForCausalLM")}
    sizes = {"gemma_2b": preset.language, "gemma_300m": preset.expert}

    def get_gemma_config(variant: str):
        return modeling_pi0.GemmaConfig(**vars(sizes[variant]))

    def paligemma(config):
        config.text_config.vocab_size = preset.vocab_size
        config.image_token_index = preset.vocab_size
        vision = config.vision_config
        for field, value in vars(preset.vision).items():
            setattr(vision, field, value)
        vision.projection_dim = preset.language.width
        config.text_config.projection_dim = preset.language.width
        return originals["PaliGemmaForConditionalGeneration"](config=config)

    def gemma(config):
        config.vocab_size = preset.vocab_size
        return originals["GemmaForCausalLM"](config=config)

    modeling_pi0.get_gemma_config = get_gemma_config
    modeling_pi0.PaliGemmaForConditionalGeneration = paligemma
    modeling_pi0.GemmaForCausalLM = gemma
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(modeling_pi0, name, value)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())

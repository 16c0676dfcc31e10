"""The PI0 presets are LeRobot's real PI0Policy, sized down, on stock transformers."""

from __future__ import annotations

import pytest
import torch

from pi0align.pi0 import compat
from pi0align.pi0.policy import build_policy, count_parameters, load_weights
from pi0align.pi0.presets import PRESETS


def features():
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {
        "observation.state": PolicyFeature(FeatureType.STATE, (6,)),
        "observation.images.laptop": PolicyFeature(FeatureType.VISUAL, (3, 48, 64)),
    }
    return inputs, {"action": PolicyFeature(FeatureType.ACTION, (6,))}


def batch_for(preset_name: str, batch_size: int = 2) -> dict:
    preset = PRESETS[preset_name]
    generator = torch.Generator().manual_seed(0)
    return {
        "observation.state": torch.randn(batch_size, 6, generator=generator),
        "observation.images.laptop": torch.rand(batch_size, 3, 48, 64, generator=generator),
        "action": torch.randn(batch_size, preset.chunk_size, 6, generator=generator),
        "observation.language.tokens": torch.randint(0, preset.vocab_size, (batch_size, preset.tokenizer_max_length),
                                                     generator=generator),
        "observation.language.attention_mask": torch.ones(batch_size, preset.tokenizer_max_length, dtype=torch.bool),
    }


@pytest.mark.parametrize(("preset_name", "low", "high"), [("tiny", 50_000, 500_000), ("small", 2_000_000, 10_000_000)])
def test_small_presets_keep_the_architecture(preset_name, low, high):
    from lerobot.policies.pi0.modeling_pi0 import PI0Policy

    torch.manual_seed(0)
    policy = build_policy(preset_name, *features())
    preset = PRESETS[preset_name]
    assert isinstance(policy, PI0Policy)
    assert low < count_parameters(policy) < high
    paligemma = policy.model.paligemma_with_expert.paligemma
    expert = policy.model.paligemma_with_expert.gemma_expert
    assert type(paligemma.model.vision_tower).__name__ == "SiglipVisionModel"
    assert len(paligemma.model.language_model.layers) == preset.language.depth
    assert len(expert.model.layers) == preset.expert.depth
    assert paligemma.model.language_model.embed_tokens.num_embeddings == preset.vocab_size
    assert paligemma.config.vision_config.image_size == preset.image_size
    # flow matching: a training forward gives a finite loss and gradients everywhere
    loss, _ = policy.forward(batch_for(preset_name))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in policy.model.action_out_proj.parameters())


def test_construction_leaves_lerobot_untouched():
    from lerobot.policies.pi0 import modeling_pi0

    build_policy("tiny", *features())
    assert modeling_pi0.get_gemma_config("gemma_2b").width == 2048


def test_compat_layer_matches_lerobot_call_signatures():
    assert compat.apply() in {"pi0align-compat", "patched-build"}
    from transformers.models.gemma import modeling_gemma
    from transformers.models.siglip import check

    norm = modeling_gemma.GemmaRMSNorm(8)
    x = torch.randn(2, 8)
    normed, gate = norm(x, cond=None)  # LeRobot's layer loop
    assert gate is None and torch.equal(normed, norm(x))  # stock layers
    assert torch.equal(modeling_gemma._gated_residual(x, x, None), 2 * x)
    assert check.check_whether_transformers_replace_is_installed_correctly()


def test_checkpoint_weights_round_trip(tmp_path):
    torch.manual_seed(0)
    policy = build_policy("tiny", *features())
    policy.save_pretrained(tmp_path)
    torch.manual_seed(1)
    other = build_policy("tiny", *features())
    load_weights(other, tmp_path)
    for (name, a), (_, b) in zip(policy.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_bf16_trains_on_stock_transformers():
    """PI0's dtype=bfloat16 keeps SigLIP's patch embedding in float32; the compat layer casts after it."""
    torch.manual_seed(0)
    policy = build_policy("tiny", *features(), dtype="bf16")
    language_model = policy.model.paligemma_with_expert.paligemma.model.language_model
    assert language_model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    loss, _ = policy.forward(batch_for("tiny"))
    loss.backward()
    assert torch.isfinite(loss)

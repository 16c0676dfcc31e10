"""Model size presets: LeRobot's full PI0, and small ones with the same code for CPU.

A small preset keeps the architecture (SigLIP vision tower + Gemma language model + Gemma action
expert + flow matching) and shrinks widths, depths, image size, sequence lengths and vocabulary.
LeRobot hard-codes 8 attention heads in its joint-attention reshape, so every preset keeps 8.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmaSize:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class VisionSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int


@dataclass(frozen=True)
class Preset:
    name: str
    language: GemmaSize
    expert: GemmaSize
    vision: VisionSize | None  # None: LeRobot's own SigLIP so400m
    vocab_size: int | None  # None: LeRobot's PaliGemma vocabulary (257152)
    image_size: int
    chunk_size: int
    tokenizer_max_length: int

    @property
    def is_full(self) -> bool:
        return self.name == "full"


PRESETS = {
    "full": Preset(
        name="full",
        language=GemmaSize(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256),
        expert=GemmaSize(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256),
        vision=None,
        vocab_size=None,
        image_size=224,
        chunk_size=50,
        tokenizer_max_length=48,
    ),
    "small": Preset(
        name="small",
        language=GemmaSize(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
        expert=GemmaSize(width=128, depth=4, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
        vision=VisionSize(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                          patch_size=16),
        vocab_size=1024,
        image_size=64,
        chunk_size=50,
        tokenizer_max_length=24,
    ),
    "tiny": Preset(
        name="tiny",
        language=GemmaSize(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8),
        expert=GemmaSize(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=8),
        vision=VisionSize(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          patch_size=8),
        vocab_size=512,
        image_size=32,
        chunk_size=10,
        tokenizer_max_length=16,
    ),
}

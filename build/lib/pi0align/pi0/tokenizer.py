"""The text tokenizer PI0's processor needs: PaliGemma's from a local folder, or a small one made here.

LeRobot's PI0 processor hard-codes the Hub name `google/paligemma-3b-pt-224`; pi0align passes a
tokenizer object instead (`--tokenizer DIR` for the real one). The small presets have a small
vocabulary, so they get a byte-level BPE tokenizer trained deterministically, offline, on a fixed
corpus of robot-task sentences: same input, same vocabulary, on every machine.
"""

from __future__ import annotations

from pathlib import Path

from pi0align.errors import UserError

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
# Task phrasing of koch-like datasets; any other text still tokenizes (byte-level fallback).
CORPUS = [
    "Grasp a lego block and put it in the bin.",
    "Pick up the red cube and place it in the box.",
    "Push the green block to the left.",
    "Open the gripper, move to the cup and close the gripper.",
    "Stack the blue block on top of the yellow block.",
    "Move the arm back to the rest position.",
]


def load_tokenizer(directory: Path):
    """AutoTokenizer from a local folder only; one clear line when it is not there."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"tokenizer folder {directory} does not exist (--tokenizer DIR)")
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise UserError(f"no tokenizer.json or tokenizer.model in {directory} (--tokenizer DIR)")
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load the tokenizer in {directory}: {str(error).splitlines()[0]}") from None


def make_small_tokenizer(vocab_size: int, directory: Path):
    """Train (deterministically) and save a byte-level BPE tokenizer of at most `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    wrapped.save_pretrained(str(directory))
    return wrapped


def default_tokenizer(vocab_size: int):
    """The generated tokenizer for a small preset's vocabulary size, made once per machine."""
    from pi0align.cache import cached_folder

    folder = cached_folder(f"tokenizer-bpe{vocab_size}-v1", lambda path: make_small_tokenizer(vocab_size, path))
    return load_tokenizer(folder)

"""PI0's own pre/post-processors (normalisation, newline, tokenizer, device), with a local tokenizer.

LeRobot builds its TokenizerProcessorStep from the Hub name `google/paligemma-3b-pt-224`; the step
also accepts a tokenizer object, which takes precedence, so we hand it ours.
"""

from __future__ import annotations

import functools


def make_processors(policy_config, dataset_stats: dict, tokenizer):
    from lerobot.policies.pi0 import processor_pi0

    original_step = processor_pi0.TokenizerProcessorStep
    processor_pi0.TokenizerProcessorStep = functools.partial(original_step, tokenizer=tokenizer)
    try:
        return processor_pi0.make_pi0_pre_post_processors(policy_config, dataset_stats=dataset_stats)
    finally:
        processor_pi0.TokenizerProcessorStep = original_step

"""LeRobot's PI0 policy and its data, offline: presets, compatibility, tokenizer, datasets."""

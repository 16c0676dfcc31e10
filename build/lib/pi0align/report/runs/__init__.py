"""The reports of the commands about runs: curves (console, JSON, HTML, TensorBoard, module trends),
check, ckpt-diff, doctor, env-diff."""

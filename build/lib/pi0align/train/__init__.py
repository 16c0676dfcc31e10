"""The training loop: LeRobot's PI0 training, seeded, logged, checkpointed."""

"""Datasets for PI0 training: any local LeRobot (v3.0) dataset, or a synthetic koch-like one.

The synthetic dataset is written with LeRobot's own writer (`LeRobotDataset.create`, `add_frame`,
`save_episode`, `finalize`), so it is read back by exactly the code that reads a real one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from pi0align.errors import UserError

# koch_test's joint names and cameras (lerobot/koch_test), without its "main_" prefix.
KOCH_JOINTS = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper"]
KOCH_CAMERAS = ["laptop", "phone"]
SYNTHETIC_TASKS = [
    "Grasp a lego block and put it in the bin.",
    "Pick up the red cube and place it in the box.",
]
SYNTHETIC_REPO_ID = "pi0align/synthetic_koch"


def synthetic_features(height: int, width: int) -> dict:
    joints = {"dtype": "float32", "shape": (len(KOCH_JOINTS),), "names": list(KOCH_JOINTS)}
    features = {"observation.state": dict(joints), "action": dict(joints)}
    for camera in KOCH_CAMERAS:
        features[f"observation.images.{camera}"] = {
            "dtype": "image", "shape": (height, width, 3), "names": ["height", "width", "channels"],
        }
    return features


def make_synthetic_dataset(root: Path, *, episodes: int = 4, frames_per_episode: int = 40, fps: int = 30,
                           height: int = 48, width: int = 64, seed: int = 0) -> Path:
    """Write a koch-like LeRobot dataset: 6-DoF state/action, two cameras, tasks, several episodes.

    Joint trajectories are smooth sinusoids (the action leads the state by one frame, as in
    teleoperation); images are a moving gradient plus noise. Deterministic in `seed`.
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise UserError(f"{root} exists and is not empty: make-dataset writes a new folder")
    if root.exists():
        root.rmdir()  # LeRobot creates the folder itself and refuses an existing one
    rng = np.random.default_rng(seed)
    dataset = LeRobotDataset.create(
        repo_id=SYNTHETIC_REPO_ID, fps=fps, features=synthetic_features(height, width), root=root,
        robot_type="koch", use_videos=False,
    )
    rows, cols = np.mgrid[0:height, 0:width].astype(np.float32)
    for episode in range(episodes):
        phase = rng.uniform(0, 2 * np.pi, size=len(KOCH_JOINTS))
        speed = rng.uniform(0.05, 0.2, size=len(KOCH_JOINTS))
        amplitude = rng.uniform(10, 60, size=len(KOCH_JOINTS))
        for frame in range(frames_per_episode):
            state = amplitude * np.sin(phase + speed * frame)
            action = amplitude * np.sin(phase + speed * (frame + 1))
            sample = {
                "observation.state": state.astype(np.float32),
                "action": action.astype(np.float32),
                "task": SYNTHETIC_TASKS[episode % len(SYNTHETIC_TASKS)],
            }
            for index, camera in enumerate(KOCH_CAMERAS):
                shift = frame * (2 + index) + episode * 7
                base = (rows * 3 + cols * 2 + shift) % 256
                channels = [base, (base + 85 * (index + 1)) % 256, (255 - base)]
                image = np.stack(channels, axis=-1) + rng.normal(0, 8, size=(height, width, 3))
                sample[f"observation.images.{camera}"] = np.clip(image, 0, 255).astype(np.uint8)
            dataset.add_frame(sample)
        dataset.save_episode()
    dataset.finalize()
    return root


def check_dataset_root(root: Path) -> dict:
    """The dataset's meta/info.json, after checking the folder looks like a LeRobot v3 dataset."""
    root = Path(root)
    info_file = root / "meta" / "info.json"
    if not root.is_dir():
        raise UserError(f"dataset folder {root} does not exist (--dataset ROOT)")
    if not info_file.is_file():
        raise UserError(f"{root} is not a LeRobot dataset: {info_file.relative_to(root)} is missing (--dataset ROOT)")
    try:
        info = json.loads(info_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"corrupt dataset metadata {info_file}: {error}") from None
    if not isinstance(info, dict) or "features" not in info or "fps" not in info:
        raise UserError(f"corrupt dataset metadata {info_file}: no 'features' or 'fps'")
    return info


def load_dataset(root: Path, policy_config):
    """LeRobotDataset from a local folder, offline, with the action chunk PI0 trains on."""
    from lerobot.datasets.factory import resolve_delta_timestamps
    from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata

    root = Path(root)
    check_dataset_root(root)
    repo_id = f"local/{root.name}"
    try:
        meta = LeRobotDatasetMetadata(repo_id, root=root)
        dataset = LeRobotDataset(
            repo_id, root=root, delta_timestamps=resolve_delta_timestamps(policy_config, meta),
            video_backend="pyav", download_videos=False,
        )
    except Exception as error:  # LeRobot raises many types for a broken folder; all mean the same here
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"cannot load the dataset at {root}: {first_line}") from None
    if len(dataset) == 0:
        raise UserError(f"the dataset at {root} holds no frames")
    return dataset


def policy_features(dataset_features: dict) -> tuple[dict, dict]:
    """Split a dataset's features into PI0's (input_features, output_features), as LeRobot's make_policy does."""
    from lerobot.configs.types import FeatureType
    from lerobot.datasets.utils import dataset_to_policy_features

    features = dataset_to_policy_features(dataset_features)
    outputs = {key: feature for key, feature in features.items() if feature.type is FeatureType.ACTION}
    inputs = {key: feature for key, feature in features.items() if key not in outputs}
    return inputs, outputs


def fingerprint(root: Path) -> str:
    """SHA-256 over the dataset's metadata and data files (paths and contents); videos by path and size.

    Two runs with the same fingerprint read the same frames; it does not depend on file times.
    """
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("images/"):
            continue  # LeRobot's temporary PNGs, removed after encoding
        digest.update(relative.encode())
        if relative.startswith("videos/"):
            digest.update(str(path.stat().st_size).encode())
            continue
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def default_dataset() -> Path:
    """The built-in synthetic dataset, made once per machine (see `pi0align.cache`)."""
    from pi0align.cache import cached_folder

    return cached_folder("synthetic_koch-v1", make_synthetic_dataset)

"""The three artifacts a full-size run needs, fetched once (where there is network) and checked offline.

Layout of a prepared folder OUT (the flags `pi0align run` takes are printed by `check`):

    OUT/pi0/                     lerobot/pi0: config.json, model.safetensors       --pretrained
    OUT/paligemma-3b-pt-224/     google/paligemma-3b-pt-224: tokenizer + config    --tokenizer
    OUT/<dataset name>/          a LeRobot dataset, e.g. lerobot/koch_test          --dataset
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pi0align.errors import UserError


@dataclass(frozen=True)
class Artifact:
    repo_id: str
    repo_type: str  # "model" | "dataset"
    folder: str
    flag: str
    required_files: tuple[str, ...]  # each entry: alternatives separated by "|"
    json_files: tuple[str, ...]  # must parse as JSON


def artifacts(dataset_repo: str) -> list[Artifact]:
    return [
        Artifact("lerobot/pi0", "model", "pi0", "--pretrained", ("config.json", "model.safetensors"), ("config.json",)),
        Artifact("google/paligemma-3b-pt-224", "model", "paligemma-3b-pt-224", "--tokenizer",
                 ("tokenizer.json|tokenizer.model", "tokenizer_config.json"), ("tokenizer_config.json",)),
        Artifact(dataset_repo, "dataset", dataset_repo.split("/")[-1], "--dataset",
                 ("meta/info.json",), ("meta/info.json",)),
    ]


def fetch(out: Path, dataset_repo: str) -> list[Path]:
    """Download (resumably; HF_ENDPOINT selects a mirror) into OUT; then check what arrived."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    from requests.exceptions import ConnectionError as RequestsConnectionError
    from requests.exceptions import Timeout

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        raise UserError("HF_HUB_OFFLINE is set: unset it to download, or check a copied folder with --check")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    for artifact in artifacts(dataset_repo):
        try:
            snapshot_download(repo_id=artifact.repo_id, repo_type=artifact.repo_type,
                              local_dir=out / artifact.folder, etag_timeout=10)
        except (RequestsConnectionError, Timeout, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as error:
            raise UserError(f"no network to {endpoint} ({type(error).__name__}): copy the files into {out} by hand "
                            f"(layout: `pi0align prepare --help`) and run `pi0align prepare --check {out}`") from None
        except HfHubHTTPError as error:
            reason = str(error).splitlines()[0]
            raise UserError(f"{artifact.repo_id}: {reason} (gated models need `hf auth login`)") from None
    return check(out, dataset_repo)


def check(out: Path, dataset_repo: str) -> list[Path]:
    """Verify a prepared folder offline; returns the artifact folders in `artifacts` order."""
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"{out} does not exist")
    folders = []
    for artifact in artifacts(dataset_repo):
        folder = out / artifact.folder
        for alternatives in artifact.required_files:
            present = [folder / name for name in alternatives.split("|") if (folder / name).is_file()]
            if not present:
                missing = folder / alternatives.split("|")[0]
                raise UserError(f"{artifact.repo_id}: {missing} is missing ({artifact.flag})")
            empty = [path for path in present if path.stat().st_size == 0]
            if empty:
                raise UserError(f"{artifact.repo_id}: {empty[0]} is empty (interrupted download?)")
        for name in artifact.json_files:
            try:
                json.loads((folder / name).read_text())
            except (ValueError, UnicodeDecodeError) as error:
                raise UserError(f"{artifact.repo_id}: {folder / name} is not valid JSON: {error}") from None
        folders.append(folder)
    _check_dataset_version(folders[2])
    return folders


def _check_dataset_version(dataset: Path) -> None:
    version = json.loads((dataset / "meta" / "info.json").read_text()).get("codebase_version")
    if version != "v3.0":
        raise UserError(f"{dataset} is a LeRobot {version} dataset; LeRobot 0.4 reads v3.0: convert it with "
                        "`python -m lerobot.datasets.v30.convert_dataset_v21_to_v30`")


def run_flags(folders: list[Path]) -> str:
    pretrained, tokenizer, dataset = folders
    return f"--preset full --pretrained {pretrained} --tokenizer {tokenizer} --dataset {dataset}"

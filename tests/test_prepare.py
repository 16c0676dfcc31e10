"""`pi0align prepare`: offline check of a prepared folder, and a clear line when there is no network."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A folder in the prepared layout, made locally: tiny PI0 weights, a tokenizer, a dataset."""
    from test_pi0_model import features

    from pi0align.pi0.policy import build_policy
    from pi0align.pi0.tokenizer import make_small_tokenizer

    out = tmp_path_factory.mktemp("prepared")
    torch.manual_seed(0)
    build_policy("tiny", *features()).save_pretrained(out / "pi0")
    make_small_tokenizer(512, out / "paligemma-3b-pt-224")
    assert run_cli("make-dataset", out / "koch_test", "--episodes", "1", "--frames", "8").returncode == 0
    return out


def test_check_accepts_a_complete_folder_and_prints_the_run_flags(prepared):
    result = run_cli("prepare", "--check", prepared)
    assert result.returncode == 0, result.stderr
    assert (f"--preset full --pretrained {prepared / 'pi0'} --tokenizer {prepared / 'paligemma-3b-pt-224'} "
            f"--dataset {prepared / 'koch_test'}") in result.stdout


@pytest.mark.parametrize(("damage", "fragment"), [
    ("pi0/model.safetensors", "model.safetensors is missing"),
    ("paligemma-3b-pt-224/tokenizer_config.json", "tokenizer_config.json is missing"),
    ("koch_test/meta/info.json", "info.json is missing"),
])
def test_check_names_the_missing_file(prepared, tmp_path, damage, fragment):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    (copy / damage).unlink()
    assert_one_line_error(run_cli("prepare", "--check", copy), fragment)


def test_check_refuses_a_truncated_config(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    (copy / "pi0" / "config.json").write_text('{"type": "pi0"')
    assert_one_line_error(run_cli("prepare", "--check", copy), "not valid JSON")


def test_fetch_without_network_says_so_in_one_line(tmp_path):
    result = run_cli("prepare", tmp_path / "out", env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert_one_line_error(result, "no network", "--check")

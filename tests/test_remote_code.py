"""Hugging Face folders that would run or unpickle code (issue 33, item 1): refused in one line, never asked
about, never run; from the library and from the CLI (exit 2)."""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import vitlens as vl
from vitlens.errors import CheckpointError, UnsupportedModelError

transformers = pytest.importorskip("transformers")


def _tiny_hf(folder: Path) -> Path:
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=16)
    transformers.ViTModel(cfg).save_pretrained(folder)
    return folder


def _remote_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose config's auto_map points at its own evil.py, which would touch a marker file if run."""
    folder = _tiny_hf(tmp_path / "remote")
    marker = tmp_path / "RAN"
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from transformers import ViTConfig as EvilConfig, ViTModel as EvilModel\n")
    return folder, marker


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_auto_map_folder_is_refused_without_asking_or_running(tmp_path, monkeypatch):
    folder, marker = _remote_code_folder(tmp_path)
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("vitlens asked on stdin"))
    with pytest.raises(UnsupportedModelError, match="auto_map.*own Python code"):
        vl.load_model(f"hf:{folder}")
    with pytest.raises(UnsupportedModelError, match="auto_map"):
        vl.load_model(f"hf:{folder}", pretrained=False)
    assert not marker.exists()


def test_auto_map_folder_is_refused_by_the_cli_even_when_y_is_piped(tmp_path, monkeypatch, capsys):
    """The command (``vitlens.cli.main``, in this process: a fresh interpreter's imports would add nothing)
    with "y" waiting on its standard input, as a pipe would give it: exit 2, no question asked, nothing run."""
    from vitlens.cli import main

    folder, marker = _remote_code_folder(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\n"))
    try:
        code = main(["report", "--model", f"hf:{folder}", "--out", str(tmp_path / "r.html")])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "auto_map" in err and "Do you wish" not in out + err
    assert sys.stdin.read() == "y\ny\n"  # never read: nothing was asked
    assert not marker.exists() and not (tmp_path / "r.html").exists()


def test_pickled_weights_in_an_hf_folder_are_refused_and_never_run(tmp_path):
    folder = _tiny_hf(tmp_path / "pick")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "RAN"
    torch.save({"x": _Evil(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle that needs code"):
        vl.load_model(f"hf:{folder}")
    assert not marker.exists()


def test_an_architecture_that_is_not_a_model_class_is_refused(tmp_path):
    folder = _tiny_hf(tmp_path / "pipe")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["pipeline"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'pipeline'.*not a transformers model class"):
        vl.load_model(f"hf:{folder}")


def test_cli_exit_2_for_pickled_hf_weights(tmp_path):
    from tests.test_cli import run_cli_here

    folder = _tiny_hf(tmp_path / "pick")
    (folder / "model.safetensors").unlink()
    torch.save({"x": _Evil(tmp_path / "RAN")}, folder / "pytorch_model.bin")
    proc = run_cli_here("report", "--model", f"hf:{folder}", "--out", str(tmp_path / "r.html"))
    assert proc.returncode == 2 and "pickle" in proc.stderr and not (tmp_path / "RAN").exists()

"""The smaller items of issue 33: NaN/Inf weights, a folder given as a checkpoint, a symlinked shards folder, the
progress bar of failed models, a full disk on the command line."""
from __future__ import annotations

import errno
import os

import pytest
import torch
from safetensors.torch import save_file

import vitlens as vl
from vitlens.errors import CheckpointError, InvalidParameterError
from vitlens.progress import Progress
from vitlens.survey.sources import Shard
from vitlens.survey.store import SurveyStore


def _saved(tiny, path, poison: float | None = None):
    state = {k: v.detach().clone().contiguous() for k, v in tiny.model.state_dict().items()}
    if poison is not None:
        next(v for k, v in state.items() if v.is_floating_point() and v.numel() > 1).view(-1)[0] = poison
    save_file(state, str(path))
    return path


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_or_inf_weights_are_refused_at_load(tmp_path, poison):
    m = vl.load_model("ref-vit", device="cpu")
    path = _saved(m, tmp_path / "bad.safetensors", poison)
    with pytest.raises(CheckpointError, match="NaN or infinite weights"):
        vl.load_model(str(path), arch="ref-vit")
    assert vl.load_model(str(_saved(m, tmp_path / "good.safetensors")), arch="ref-vit").weights == "checkpoint"


def test_a_folder_given_as_a_checkpoint_says_so(tmp_path):
    folder = tmp_path / "run.pth"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="is a folder, not a checkpoint file.*hf:"):
        vl.load_model(str(folder), arch="ref-vit")


def test_writes_never_follow_a_symlinked_model_folder(tmp_path):
    out, elsewhere = tmp_path / "zoo", tmp_path / "elsewhere"
    (out / "shards").mkdir(parents=True)
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "shards" / "m-123456")
    store = SurveyStore(out)
    result = {"n_images": 1, "skipped": [], "seconds": 0.0, "states": {}}
    with pytest.raises(InvalidParameterError, match="is a symbolic link"):
        store.write_shard("m-123456", Shard(0, 0, 1), result)
    assert list(elsewhere.iterdir()) == []


def test_the_progress_total_drops_a_failed_models_shards():
    seen = []
    bar = Progress(lambda done, total: seen.append((done, total)), 6)
    bar.update(2)
    bar.drop(4)  # the failed model's 4 shards will never come
    bar.update(2)
    assert seen[-1] == (2, 2)


def test_a_full_disk_says_no_space_left_at_the_path(monkeypatch, tmp_path):
    from tests.test_cli import run_cli_here
    import vitlens.cli.parser as cli  # where the parser binds each command

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r.html"))

    monkeypatch.setattr(cli, "cmd_report", full)
    proc = run_cli_here("report", "--out", str(tmp_path / "r.html"))
    assert proc.returncode == 1
    assert f"no space left on device at {tmp_path / 'r.html'}" in proc.stderr and "unexpected" not in proc.stderr


def test_a_rerun_says_the_reason_of_a_model_that_failed_in_an_earlier_run(monkeypatch, tmp_path, capsys):
    """'1 failed (...: the reason is above)' after a rerun said no reason: a model that failed in an earlier run
    into the folder and is not named now has its reason on the last line; one named now was said as it failed."""
    import pandas as pd

    from vitlens import cli
    from vitlens.survey.store import SurveyResult

    result = SurveyResult(path=tmp_path / "s", table=pd.DataFrame(), manifest={"models": {}},
                          failed={"ref-hybrid": "its weights file is missing", "ref-vit": "out of memory"})
    monkeypatch.setattr(vl, "survey", lambda *a, **k: result)
    code = cli.main(["survey", "--models", "ref-vit", "--out", str(tmp_path / "s")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code != 0
    assert "2 failed (ref-vit: the reason is above; ref-hybrid in an earlier run: its weights file is missing)" in last


def test_an_hf_folder_declaring_an_enormous_model_is_refused_before_it_is_built(tmp_path):
    """config.json with enormous sizes (vitlens built a ~600 GB model until a memory limit stopped it): refused from
    the config alone, naming the model's estimated size and the memory there is, in a moment."""
    import time

    tr = pytest.importorskip("transformers")
    folder = tmp_path / "huge"
    tr.ViTConfig(hidden_size=65536, num_hidden_layers=300, num_attention_heads=64,
                 intermediate_size=262144).save_pretrained(folder)
    start = time.perf_counter()
    for pretrained in (False, True):
        with pytest.raises(vl.errors.UnsupportedModelError,
                           match=r"describes a model of about [\d,]+ parameters \(~[\d,.]+ GiB in float32\), more "
                                 r"than the memory available here \(~[\d,.]+ GiB\); not built"):
            vl.load_model(f"hf:{folder}", pretrained=pretrained)
    assert time.perf_counter() - start < 30


def test_a_normal_config_is_estimated_close_below_its_size():
    """The estimate errs low and close: ViT-B/16's 86.6 M parameters are estimated at 85.7 M."""
    tr = pytest.importorskip("transformers")
    from vitlens.loading.external import estimated_parameters

    model = tr.ViTModel(tr.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, image_size=32, patch_size=8), add_pooling_layer=False)
    real = sum(p.numel() for p in model.parameters())
    guess = estimated_parameters(model.config.to_dict())
    assert 0.8 * real <= guess <= real
    assert 85e6 < estimated_parameters(tr.ViTConfig().to_dict()) <= 86.6e6


@pytest.mark.parametrize("kind", ["big", "fifo"])
def test_an_hf_folders_config_is_read_only_when_a_file_within_the_bound(tmp_path, monkeypatch, kind):
    """A config.json larger than the bound (a 1 GB one cost 2 GB to read) is refused from its size; a FIFO in its
    place is refused without being opened (a read would wait for ever)."""
    pytest.importorskip("transformers")
    from vitlens.loading import external

    folder = tmp_path / "m"
    folder.mkdir()
    if kind == "big":
        monkeypatch.setattr(external, "MAX_CONFIG_BYTES", 1000)
        (folder / "config.json").write_text('{"model_type": "vit", "pad": "' + "x" * 2000 + '"}')
        said = r"holds 2,0\d\d bytes, more than a model's config may \(1,000\); not read"
    else:
        os.mkfifo(folder / "config.json")
        said = "is not a regular file"
    with pytest.raises(vl.errors.UnknownModelError, match=said):
        vl.load_model(f"hf:{folder}", pretrained=False)


def test_printed_names_have_their_control_and_bidi_characters_escaped():
    """A model name with a terminal escape (recolours, moves the cursor) or a right-to-left override prints as what
    it is."""
    from vitlens.words import printable

    assert printable("ok\x1b[31mred\u202eevil\x07\tname") == "ok\\x1b[31mred\\u202eevil\\x07\tname"
    assert printable("two\nlines") == "two\\nlines" and printable("two\nlines", newlines=True) == "two\nlines"
    assert printable("vit_base_patch16_224 (random init) ÄÖ 模型") == "vit_base_patch16_224 (random init) ÄÖ 模型"


def test_bad_survey_names_fail_in_the_driver_without_a_worker_and_print_escaped(tmp_path, monkeypatch, capsys):
    """Names that resolve to nothing (41 cost ~3 minutes, a Ray worker each) fail in the driver before Ray starts,
    each with the reason a worker gave; on the command line they print escaped."""
    import time

    from vitlens import cli
    from vitlens.survey import run as run_module
    from vitlens.survey import shapes_source

    def no_ray(*_a, **_k):
        raise AssertionError("Ray was started for models that cannot load")

    monkeypatch.setattr(run_module, "start_ray", no_ray)
    names = [f"no_such_model_{i}" for i in range(6)] + ["vit_tiny_patch16_224.no_such_tag"]
    start = time.perf_counter()
    result = vl.survey(names, shapes_source(4), tmp_path / "zoo", shard_size=4, progress=False)
    assert time.perf_counter() - start < 60
    assert sorted(result.failed) == sorted(names) and result.models() == []
    assert "Unknown model 'no_such_model_0'" in result.failed["no_such_model_0"]
    assert "no pretrained weights named 'vit_tiny_patch16_224.no_such_tag'" in result.failed[names[-1]]
    evil = "evil\x1b[2J\u202emodel"
    # the command line's main, in this process (Ray still patched to fail if started)
    assert cli.main(["survey", "--models", evil, "--n-images", "4", "--out", str(tmp_path / "cli"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err
    assert "vitlens: failed: evil\\x1b[2J\\u202emodel: " in err

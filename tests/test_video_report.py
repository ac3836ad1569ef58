"""``vitlens report --video`` and ``vitlens compare --video`` (issue 50) on tiny random-init Hugging Face video models
saved as folders (``hf:FOLDER``) and a GIF of a moving shape, run in-process; the views the registry offers for the
space-time kind; bad input refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import vitlens as vl  # noqa: E402
from vitlens.errors import ViewNotAvailableError  # noqa: E402
from vitlens.kinds import takes_clips, all_kinds  # noqa: E402
from vitlens.report.video import model_frames  # noqa: E402
from vitlens.views.registry import CLIP_PAGES, VIEWS, ViewParams, available_views  # noqa: E402

from test_cli import run_cli_here  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             initializer_range=0.3)  # peaked maps, so the views are not all uniform


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    """Two video models (VideoMAE's tubelets of 2 frames, joint; TimeSformer's frames, divided) and an image ViT,
    saved as folders, and an 8-frame GIF of a square moving 2 px a frame."""
    t = transformers
    root = tmp_path_factory.mktemp("video")
    torch.manual_seed(0)
    t.VideoMAEModel(t.VideoMAEConfig(image_size=32, patch_size=8, num_frames=4, tubelet_size=2, **SMALL)
                    ).save_pretrained(root / "mae")
    t.TimesformerModel(t.TimesformerConfig(image_size=32, patch_size=8, num_frames=4, **SMALL)
                       ).save_pretrained(root / "ts")
    t.ViTModel(t.ViTConfig(image_size=32, patch_size=8, **SMALL)).save_pretrained(root / "vit")
    gif = vl.write_gif(vl.moving_shape_clip(num_frames=8, size=32).clip, root / "clip.gif")
    return {"root": root, "gif": str(gif), "mae": f"hf:{root / 'mae'}", "ts": f"hf:{root / 'ts'}",
            "vit": f"hf:{root / 'vit'}"}


@pytest.fixture(scope="module")
def report(made) -> dict:
    out = made["root"] / "report.html"
    proc = run_cli_here("report", "--video", made["gif"], "--model", made["mae"], "--model", made["ts"], "--out",
                        str(out), "--device", "cpu", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return {"page": out.read_text(), "data": vl.load_result(out.with_suffix(".json"))}


def test_the_registry_offers_the_video_views_for_the_space_time_kind_alone(made) -> None:
    video = {n for n, v in VIEWS.items() if v.for_kind is takes_clips}
    assert video == {"video_filters", "video_position", "spacetime_distance", "spacetime_rollout"}
    assert all(VIEWS[n].shown_in == CLIP_PAGES for n in video)  # the app shows them among a clip's pages alone
    clip_kinds = [k.name for k in all_kinds() if k.clips]
    for name, view in VIEWS.items():  # the image views are not offered for clips, the video views only for clips
        assert (set(view.kinds) <= set(clip_kinds)) == (name in video), name
    m = vl.load_model(made["mae"], device="cpu")
    assert available_views(m) == ("video_filters", "video_position", "spacetime_distance", "spacetime_rollout")
    vit = vl.load_model(made["vit"], device="cpu")
    assert not set(available_views(vit)) & video
    a = vl.analyze(vit, torch.zeros(1, 3, 32, 32), views=("spacetime_distance", "video_filters", "distance"))
    assert a.view("spacetime_distance") is None and a.view("video_filters") is None and a.distance is not None
    assert "reads a video model's clips" in a.notes["spacetime_distance"]
    with pytest.raises(ViewNotAvailableError, match="reads a video model's clips"):
        VIEWS["video_position"].build(vit, ViewParams())
    # on a video model, analyze computes them by name, and notes an image view
    b = vl.analyze(m, vl.clip_pixel_values(made["gif"], m), views=("video_position", "spacetime_rollout", "prefix"))
    assert b.view("video_position").sinusoidal and b.view("spacetime_rollout").maps.shape == (1, 2, 4, 4)
    assert b.view("prefix") is None and "prefix" in b.notes


def test_report_has_every_registry_view_of_the_clip_and_its_numbers(made, report) -> None:
    page, data = report["page"], report["data"]
    assert page.count("plotly.js v") == 1 and "<script src=" not in page  # inlined once, offline
    for name in ("video_filters", "video_position", "spacetime_distance", "spacetime_rollout"):
        assert page.count(VIEWS[name].heading) == 2, name  # one section per model, headed as the registry says
    assert "8 fps (from the file)" in page  # the GIF's frame durations (120 and 130 ms: 8 fps, issue 63.17)
    # the numbers written are those of the library's own call on the clip as the model's processor samples it
    m = vl.load_model(made["ts"], device="cpu")
    direct = vl.attention_distance(m, vl.clip_pixel_values(made["gif"], m))
    saved = data.analyses[1].view("spacetime_distance")
    np.testing.assert_allclose(saved.temporal_frames, direct.temporal_frames, rtol=1e-12)
    np.testing.assert_allclose(saved.spatial_px, direct.spatial_px, rtol=1e-12)
    # seconds at the rate of the frames the model reads: 4 of the GIF's 8 frames, so half the GIF's rate
    assert saved.roles == ("temporal", "spatial") * 2 and saved.fps == pytest.approx(8 * 4 / 8)
    assert page.count("reads 4 of the clip's 8 frames, sampled uniformly, 4 fps") == 2
    assert data.analyses[0].view("spacetime_rollout").maps.shape == (1, 2, 4, 4)  # tubelets: 2 steps of 4 frames
    assert data.analyses[0].view("video_position").sinusoidal  # VideoMAE's fixed sin-cos table, said so
    rows = data.to_pandas()  # every head of every map of both models, one row each
    assert len(rows) == 2 * 2 + 4 * 2 and set(rows["model"]) == {made["mae"], made["ts"]}


def test_compare_draws_fig_11_in_space_and_time(made) -> None:
    out = made["root"] / "compare.html"
    proc = run_cli_here("compare", "--video", made["gif"], "--models", made["mae"], made["ts"], "--fps", "4",
                        "--out", str(out), "--device", "cpu", "--quiet")
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert page.count("plotly.js v") == 1 and "4 fps (--fps)" in page
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["models"] == [made["mae"], made["ts"]]
    loaded = vl.load_result(out.with_suffix(".json"))
    assert all(a.views == ("spacetime_distance", "spacetime_rollout") for a in loaded.analyses)
    d = loaded.analyses[0].view("spacetime_distance")
    assert d.fps == 2 and np.all(d.temporal_frames <= d.max_temporal_frames + 1e-12)  # 4 of 8 frames at 4 fps


def test_model_frames_are_the_frames_the_model_reads(made) -> None:
    m = vl.load_model(made["mae"], device="cpu")
    x = vl.clip_pixel_values(made["gif"], m)[0]  # 32 px frames at a 32 px crop: no resize, no crop
    sampled = vl.read_clip(made["gif"], 4).frames
    assert np.abs(model_frames(x, m).astype(int) - sampled.astype(int)).max() <= 1  # float32 rounding at most


@pytest.mark.parametrize("args, says", [
    (("report", "--video", "NOCLIP.gif", "--model", "MAE"), "NOCLIP.gif"),
    (("report", "--video", "GIF", "--model", "VIT"), "reads images"),
    (("compare", "--video", "GIF", "--models", "MAE", "VIT"), "reads images"),
    (("report", "--model", "MAE", "--n-images", "2"), "give it a clip with --video"),
    (("compare", "--models", "VIT", "MAE", "--n-images", "2"), "give it a clip with --video"),
    (("report", "--fps", "8", "--model", "VIT", "--n-images", "2"), "--fps is a clip's frame rate"),
    (("report", "--video", "GIF", "--fps", "0", "--model", "MAE"), "must be a number > 0"),
    (("report", "--video", "GIF", "--images", "x", "--model", "MAE"), "not allowed with"),
])
def test_bad_input_is_one_line(made, tmp_path, args, says) -> None:
    names = {"MAE": made["mae"], "VIT": made["vit"], "GIF": made["gif"], "NOCLIP.gif": str(tmp_path / "NOCLIP.gif")}
    proc = run_cli_here(*[names.get(a, a) for a in args], "--out", str(tmp_path / "r.html"), "--device", "cpu",
                        "--quiet")
    said = [line for line in proc.stderr.splitlines() if line.startswith(("vitlens", "usage"))]  # not transformers'
    assert proc.returncode == 2 and len(said) == 1 and says in said[0], proc.stderr  # progress bar of its loading
    assert not (tmp_path / "r.html").exists()

"""A video model in the app (issue 50): loaded offline as ``hf:FOLDER`` (a tiny random-init VideoMAE and TimeSformer
classifier saved here with ``save_pretrained``), the sidebar offers a clip (a moving shape made by the library, or an
uploaded GIF; a bad file is one message and the app keeps working), a frame slider, and the space-time pages:
distance in space and time with its baselines, the rollout as frames following the slider, the position embeddings
over space and time and the tubelet filters."""
from __future__ import annotations

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

import vitlens as vl
from test_app import APP, NO_BROWSER, problems

transformers = pytest.importorskip("transformers")

#: the clip's pages: the registered views shown among a clip's pages, in the registry's order (weights first)
PAGES = ["Tubelet filters", "Position embeddings (space and time)", "Space-time distance", "Rollout through time"]


def tiny_video(kind: str) -> "transformers.PreTrainedModel":
    """A 2-block, 2-head classifier of 4 frames of 32 px (8 px cells), random init (seeded)."""
    import torch

    torch.manual_seed(0)
    common = dict(image_size=32, patch_size=8, num_frames=4, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=64, num_labels=3, initializer_range=0.3)  # peaked maps
    if kind == "videomae":
        return transformers.VideoMAEForVideoClassification(transformers.VideoMAEConfig(tubelet_size=2, **common))
    return transformers.TimesformerForVideoClassification(transformers.TimesformerConfig(**common))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for kind in ("videomae", "timesformer"):
        folder = tmp_path_factory.mktemp(kind)
        tiny_video(kind).save_pretrained(folder)
        out[kind] = str(folder)
    return out


def open_video_app(folder: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.radio(key="m1-source").set_value("Name").run()
    at.checkbox(key="m1-pre").check().run()  # the folder's saved weights
    at.text_input(key="m1-timm").set_value(f"hf:{folder}").run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    return at


def test_a_video_model_gets_a_clip_a_frame_slider_and_every_space_time_page(folders):
    at = open_video_app(folders["timesformer"])
    assert "video (space-time tokens)" in at.sidebar.table[0].value.to_string()
    assert [h.value for h in at.sidebar.header][-2:] == ["Clip", "Facts"]
    assert at.radio(key="video-view").options == PAGES
    assert at.slider(key="clip-frame-4").max == 3  # the model's 4 frames (0-3), sampled from the moving shape's 16
    assert any("frame 0 of 0-3 as the model sees it" in c.value and "source frame 0" in c.value for c in at.caption)
    for page in PAGES:
        at.radio(key="video-view").set_value(page).run()
        assert problems(at) == [] and not at.error, (page, [e.value for e in at.error])
        assert at.get("plotly_chart"), page
    # the rollout follows the slider: frame 2 is TimeSformer's time step 2 (a frame per step), source frame 8 of 16
    at.radio(key="video-view").set_value("Rollout through time").run()
    at.slider(key="clip-frame-4").set_value(2).run()
    assert problems(at) == [] and any("frame 2 of 0-3" in c.value and "source frame 8, t = 1.00 s" in c.value
                                      for c in at.caption)
    assert any("Frame 2 (the slider's) under the map of frame 2," in c.value for c in at.caption)
    at.radio(key="video-view").set_value("Space-time distance").run()
    table = at.dataframe[0].value
    assert list(table["role"]) == ["temporal", "spatial"] * 2  # divided: map 2l temporal, 2l + 1 spatial
    assert (table.loc[table["role"] == "temporal", "spatial_px"] == 0).all()  # 0 by construction
    assert any("0 by construction" in c.value for c in at.caption)
    assert any("fps" in c.value for c in at.caption)  # the moving shape's 8 fps, sampled 4 of 16: 2 fps


def test_an_uploaded_gif_is_the_clip_and_a_bad_file_is_one_message(folders, tmp_path):
    at = open_video_app(folders["videomae"])
    at.radio(key="clip-source").set_value("Upload").run()
    assert any("Upload a video" in i.value for i in at.info)
    at.file_uploader(key="clip-upload").set_value(("broken.mp4", b"not a video at all", "video/mp4")).run()
    assert problems(at) == [] and len(at.error) == 1, [e.value for e in at.error]
    message = at.error[0].value  # names the upload, not the private folder it is kept in
    assert message.startswith("Cannot read broken.mp4 as a video") and "session-" not in message, message
    shape = vl.moving_shape_clip(num_frames=8, size=40, shape="circle", velocity=(0.0, 3.0))
    gif = vl.write_gif(shape.clip, tmp_path / "moving.gif")
    at.file_uploader(key="clip-upload").set_value(("moving.gif", gif.read_bytes(), "image/gif")).run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    assert any(c.value.startswith("moving.gif: frame 0 of 0-3") for c in at.caption)
    at.radio(key="video-view").set_value("Rollout through time").run()
    assert problems(at) == [] and not at.error
    # VideoMAE's tubelets of 2 frames: frame 3 is in time step 1
    at.slider(key="clip-frame-4").set_value(3).run()
    assert any("under the map of time step 1 (frames 2-3)" in c.value for c in at.caption)


def test_the_moving_shape_has_at_least_the_frames_the_model_samples():
    """A V-JEPA 2 of 24 frames per clip: the sidebar's moving shape (16 frames by default) is made with 24, so the
    model's sampling never refuses it (``clip_source`` in Streamlit's bare mode: its widgets' defaults)."""
    from vitlens_app.video import SHAPE_FRAMES, clip_source

    model = transformers.VJEPA2Model(transformers.VJEPA2Config(
        crop_size=32, patch_size=8, frames_per_clip=24, tubelet_size=2, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, mlp_ratio=2.0, pred_hidden_size=32, pred_num_hidden_layers=1,
        pred_num_attention_heads=2, num_pooler_layers=1))
    m = vl.LoadedModel.from_module(model.eval(), name="tiny-vjepa2", device="cpu")
    clip, key, name = clip_source(m)
    assert SHAPE_FRAMES < 24 and clip.num_frames == 24 and key.endswith("-24") and name == clip.name
    assert vl.clip_pixel_values(clip, m).shape == (1, 24, 3, 32, 32)


def test_the_shown_frames_are_the_models_input_undone():
    """The frame shown is the model's pixel values mapped back through the family's per-frame defaults (one source):
    a two-colour moving shape comes back within one grey level of its resized frame."""
    m = vl.LoadedModel.from_module(tiny_video("videomae").eval(), name="tiny-videomae", device="cpu")
    clip = vl.moving_shape_clip(num_frames=4, size=32, shape="square").clip
    shown = np.stack(m.display(vl.clip_pixel_values(clip, m)[0]))
    assert shown.shape == (4, 32, 32, 3) and np.abs(shown.astype(int) - clip.frames.astype(int)).max() <= 1


@pytest.mark.skipif(NO_BROWSER, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_a_clip_shows_every_space_time_view_in_chromium(browser_app, folders):
    """The suite's app server in its Chromium (conftest's ``browser_app``): the TimeSformer folder typed as
    ``hf:FOLDER``, its moving shape's every space-time page drawn, the slider moved to frame 2 on the rollout;
    screenshots in test-output/video-app/."""
    from pathlib import Path

    from test_app import ROOT, session_with_model, settled

    out = Path(ROOT) / "test-output" / "video-app"
    out.mkdir(parents=True, exist_ok=True)
    folder = f"hf:{folders['timesformer']}"
    with session_with_model(browser_app, folder, height=1300, pretrained=True) as (page, sidebar):
        sidebar.get_by_text("video (space-time tokens)").wait_for(timeout=120000)
        for i, view in enumerate(PAGES):
            page.get_by_text(view, exact=True).first.click()
            page.wait_for_timeout(500)
            settled(page)
            page.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=90000)
            assert page.locator("[data-testid='stException']").count() == 0, view
            page.screenshot(path=str(out / f"{i + 1}-{view.split()[0].lower()}.png"), full_page=True)
        page.get_by_text("Rollout through time", exact=True).first.click()
        settled(page)
        thumb = page.locator("[data-testid='stSlider']").filter(has_text="Frame").get_by_role("slider")
        thumb.focus()
        for _ in range(2):
            thumb.press("ArrowRight")
            settled(page)
        page.get_by_text("frame 2 of 0-3 as the model sees it", exact=False).wait_for(timeout=60000)
        page.get_by_text("Rollout at frame 2").first.wait_for(timeout=60000)
        page.screenshot(path=str(out / "5-rollout-frame-2.png"), full_page=True)

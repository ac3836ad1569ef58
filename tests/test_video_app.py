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

PAGES = ["Space-time distance", "Rollout through time", "Position embeddings (space and time)", "Tubelet filters"]


def tiny_video(kind: str) -> "transformers.PreTrainedModel":
    """A 2-block, 2-head classifier of 4 frames of 32 px (8 px cells), random init (seeded)."""
    import torch

    torch.manual_seed(0)
    common = dict(image_size=32, patch_size=8, num_frames=4, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=64, num_labels=3)
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
    assert at.slider(key="clip-frame-4").max == 4  # the model's 4 frames, sampled from the 16 of the moving shape
    assert any("frame 1 of 4" in c.value for c in at.caption)
    for page in PAGES:
        at.radio(key="video-view").set_value(page).run()
        assert problems(at) == [] and not at.error, (page, [e.value for e in at.error])
        assert at.get("plotly_chart"), page
    # the rollout follows the slider: frame 3 is TimeSformer's time step 3 (a frame per step)
    at.radio(key="video-view").set_value("Rollout through time").run()
    at.slider(key="clip-frame-4").set_value(3).run()
    assert problems(at) == [] and any("frame 3 of 4" in c.value for c in at.caption)
    assert any("under its frame 3 of 4's map" in c.value for c in at.caption)
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
    assert any("frame 1 of 4" in c.value for c in at.caption)
    at.radio(key="video-view").set_value("Rollout through time").run()
    assert problems(at) == [] and not at.error
    # VideoMAE's tubelets of 2 frames: frame 4 is in time step 2
    at.slider(key="clip-frame-4").set_value(4).run()
    assert any("time step 2 of 2 (frames 3-4)" in c.value for c in at.caption)


def test_the_shown_frames_are_the_models_input_undone():
    """The frame shown is the model's pixel values mapped back through the family's per-frame defaults (one source):
    a two-colour moving shape comes back within one grey level of its resized frame."""
    m = vl.LoadedModel.from_module(tiny_video("videomae").eval(), name="tiny-videomae", device="cpu")
    clip = vl.moving_shape_clip(num_frames=4, size=32, shape="square").clip
    shown = np.stack(m.display(vl.clip_pixel_values(clip, m)[0]))
    assert shown.shape == (4, 32, 32, 3) and np.abs(shown.astype(int) - clip.frames.astype(int)).max() <= 1

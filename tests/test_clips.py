"""Video inputs (issue 50): clips read from GIFs, MP4s and folders written here return the frames written; frames
are sampled with the processors' rule and preprocessed to the processors' ``pixel_values``; every bad input is
refused in one line; the synthetic clips move as stated."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import vitlens as vl
from vitlens.clips import VideoProcessing, read, sample_indices
from vitlens.errors import ClipLoadError, InvalidParameterError, UnsupportedModelError

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def moving():
    return vl.moving_shape_clip(num_frames=9, size=32, shape="star", velocity=(1, 2), fps=10.0)


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text.endswith((".", ")")), text
    return text


# --- sampling: the processors' rule ---

@pytest.mark.parametrize("total,n", [(4, 4), (11, 4), (16, 8), (300, 16), (7, 3)])
def test_sample_indices_equal_the_processors_default_rule(total, n):
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    expected = default_sample_indices_fn(VideoMetadata(total_num_frames=total), num_frames=n)
    np.testing.assert_array_equal(sample_indices(total, n), expected)


def test_fewer_frames_than_the_model_takes_is_refused_in_one_line():
    with pytest.raises(ClipLoadError) as e:
        sample_indices(3, 8, "clip.gif")
    assert "3 frames, fewer than the 8" in one_line(e)


# --- the synthetic clips ---

def test_a_moving_shape_moves_by_its_velocity_exactly(moving):
    m = moving
    assert m.clip.frames.shape == (9, 32, 32, 3) and m.clip.fps == 10.0
    for t in range(1, 9):  # the mask shifted by t * (1, 2) pixels; the shape stays inside the frame
        np.testing.assert_array_equal(m.masks[t], np.roll(m.masks[0], (t, 2 * t), axis=(0, 1)))
        np.testing.assert_allclose(m.centres[t] - m.centres[0], [t, 2 * t])
    assert not m.masks[:, 0, :].any() and not m.masks[:, :, -1].any()
    assert len(np.unique(m.clip.frames.reshape(-1, 3), axis=0)) == 2  # background and shape


def test_a_shape_appearing_at_frame_k_is_absent_before_it():
    m = vl.moving_shape_clip(num_frames=6, size=24, shape="circle", velocity=(0, 0), appear_at=3)
    assert not m.masks[:3].any() and m.masks[3:].all(axis=0).sum() == m.masks[3].sum() > 0
    assert np.isnan(m.centres[:3]).all() and not np.isnan(m.centres[3:]).any()
    assert (m.clip.frames[:3] == m.clip.frames[0, 0, 0]).all()
    with pytest.raises(InvalidParameterError):
        vl.moving_shape_clip(num_frames=4, appear_at=4)


# --- decoding what was written ---

def test_a_gif_written_here_reads_back_exactly(tmp_path, moving):
    path = vl.write_gif(moving.clip, tmp_path / "m.gif")
    clip = vl.read_clip(path)
    np.testing.assert_array_equal(clip.frames, moving.clip.frames)
    assert clip.fps == pytest.approx(10.0) and clip.source_frames == 9 and clip.name == "m.gif"
    sampled = vl.read_clip(path, num_frames=4)
    np.testing.assert_array_equal(sampled.indices, [0, 2, 4, 6])
    np.testing.assert_array_equal(sampled.frames, moving.clip.frames[[0, 2, 4, 6]])


def test_an_mp4_written_here_reads_back_within_the_colour_conversions_rounding(tmp_path, moving):
    # H.264 at qp 0 in 4:4:4 loses only the RGB -> YUV (8-bit, limited range) -> RGB rounding: half a Y step
    # (255/219) plus half the largest chroma term (B: 2.017 * 255/224 / 2) plus the last rounding is about
    # 2.1 levels; the bound is 3
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (6, 24, 40, 3), dtype=np.uint8)
    for clip in (moving.clip, vl.Clip(frames, 12.0, "noise")):
        path = vl.write_mp4(clip, tmp_path / "c.mp4")
        back = vl.read_clip(path)
        assert back.frames.shape == clip.frames.shape and back.fps == pytest.approx(clip.fps)
        assert np.abs(back.frames.astype(int) - clip.frames).max() <= 3
    sampled = vl.read_clip(path, num_frames=4)
    np.testing.assert_array_equal(sampled.indices, sample_indices(6, 4))
    assert np.abs(sampled.frames.astype(int) - frames[sampled.indices]).max() <= 3
    np.testing.assert_allclose(sampled.times(), sampled.indices / 12.0)


def test_a_lossless_mkv_without_a_frame_count_reads_back_exactly(tmp_path):
    # Matroska lists no frame count (stream.frames == 0): the reader counts the packets, then decodes
    frames = np.random.default_rng(2).integers(0, 256, (5, 16, 24, 3), dtype=np.uint8)
    with av.open(str(tmp_path / "f.mkv"), "w", format="matroska") as out:
        stream = out.add_stream("ffv1", rate=5)
        stream.width, stream.height, stream.pix_fmt = 24, 16, "bgr0"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    with av.open(str(tmp_path / "f.mkv")) as c:
        assert c.streams.video[0].frames == 0
    clip = vl.read_clip(tmp_path / "f.mkv")
    np.testing.assert_array_equal(clip.frames, frames)
    assert clip.fps == 5.0 and clip.source_frames == 5
    sampled = vl.read_clip(tmp_path / "f.mkv", num_frames=3)
    np.testing.assert_array_equal(sampled.frames, frames[[0, 1, 3]])


def test_a_folder_of_frames_reads_back_exactly_sorted_by_name_without_symlinks(tmp_path, moving):
    folder = tmp_path / "frames"
    folder.mkdir()
    for t in reversed(range(9)):
        Image.fromarray(moving.clip.frames[t]).save(folder / f"f{t:03d}.png")
    (folder / "notes.txt").write_text("not a frame")
    (folder / "z_link.png").symlink_to(folder / "f000.png")
    clip = vl.read_clip(folder)
    np.testing.assert_array_equal(clip.frames, moving.clip.frames)
    assert clip.fps is None and clip.source_frames == 9 and clip.name == "frames"


def test_writing_into_a_missing_folder_writes_nothing(tmp_path, moving):
    with pytest.raises(ClipLoadError) as e:
        vl.write_gif(moving.clip, tmp_path / "missing" / "m.gif")
    assert "does not exist" in one_line(e) and not (tmp_path / "missing").exists()


def test_a_failing_encoder_leaves_no_file(tmp_path, moving, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("encoder failed")

    monkeypatch.setattr(av.VideoFrame, "from_ndarray", broken)
    with pytest.raises(RuntimeError):
        vl.write_mp4(moving.clip, tmp_path / "c.mp4")
    assert list(tmp_path.iterdir()) == []


# --- bad inputs, each one line ---

def test_bad_inputs_are_refused_in_one_line(tmp_path, moving, monkeypatch):
    (tmp_path / "fake.mp4").write_bytes(b"not a video at all" * 20)
    (tmp_path / "fake.gif").write_bytes(b"GIF89a but not really")
    (tmp_path / "list.mp4").write_text("#EXTM3U\n#EXTINF:1,\nother.mp4\n#EXT-X-ENDLIST\n")  # a playlist
    (tmp_path / "clip.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    Image.new("RGB", (8, 8)).save(mixed / "a.png")
    Image.new("RGB", (8, 6)).save(mixed / "b.png")
    cases = {tmp_path / "fake.mp4": "as a video", tmp_path / "fake.gif": "as a GIF", tmp_path / "list.mp4": "as a video",
             tmp_path / "clip.txt": "not a clip", tmp_path / "empty": "holds no images",
             tmp_path / "nothing.mp4": "not found", mixed: "different sizes"}
    for source, words in cases.items():
        with pytest.raises(ClipLoadError) as e:
            vl.read_clip(source)
        assert words in one_line(e), (source, str(e.value))
    gif = vl.write_gif(moving.clip, tmp_path / "m.gif")
    with pytest.raises(ClipLoadError) as e:
        vl.read_clip(gif, num_frames=16)
    assert "9 frames, fewer than the 16" in one_line(e)
    monkeypatch.setattr(read, "MAX_CLIP_BYTES", 100)
    with pytest.raises(ClipLoadError) as e:
        vl.read_clip(gif)
    assert "file too large" in one_line(e)
    monkeypatch.setattr(read, "MAX_CLIP_BYTES", 1 << 30)
    monkeypatch.setattr(read, "MAX_CLIP_FRAMES", 5)
    with pytest.raises(ClipLoadError) as e:
        vl.read_clip(gif)
    assert "too many frames" in one_line(e)
    monkeypatch.setattr(read, "MAX_CLIP_FRAMES", 100)
    monkeypatch.setattr(read, "MAX_CLIP_PIXELS", 32 * 32 * 4)
    with pytest.raises(ClipLoadError) as e:
        vl.read_clip(gif)
    assert "pass num_frames" in one_line(e)
    assert vl.read_clip(gif, num_frames=4).num_frames == 4  # sampling fits the budget


@pytest.mark.parametrize("frames,words", [(np.zeros((4, 8, 8), np.uint8), "[T, H, W, 3]"),
                                          (np.zeros((2, 8, 8, 3), np.float32), "uint8")])
def test_a_clip_record_refuses_what_is_not_frames(frames, words):
    with pytest.raises(InvalidParameterError) as e:
        vl.Clip(frames)
    assert words in one_line(e)


def test_a_tensor_becomes_an_array():
    clip = vl.Clip(torch.zeros(3, 4, 5, 3, dtype=torch.uint8), fps=5)
    assert isinstance(clip.frames, np.ndarray) and clip.size == (4, 5) and clip.num_frames == 3
    frames = torch.arange(5, dtype=torch.uint8)[:, None, None, None].expand(5, 2, 2, 3)
    np.testing.assert_array_equal(vl.read_clip(frames, num_frames=2).frames[:, 0, 0, 0], [0, 2])


# --- preprocessing: the processors' pixel_values ---

PROCESSORS = {
    "videomae": ("VideoMAEConfig", "VideoMAEVideoProcessor", {"image_size": 32, "num_frames": 4}),
    "vivit": ("VivitConfig", "VivitVideoProcessor", {"image_size": 32, "num_frames": 4}),
    "timesformer": ("TimesformerConfig", "TimesformerVideoProcessor", {"image_size": 32, "num_frames": 4}),
    "vjepa2": ("VJEPA2Config", "VJEPA2VideoProcessor", {"crop_size": 32, "frames_per_clip": 4}),
}


@pytest.mark.parametrize("model_type", sorted(PROCESSORS))
def test_pixel_values_equal_the_hf_processors(model_type):
    config_name, processor_name, kwargs = PROCESSORS[model_type]
    config = getattr(transformers, config_name)(**kwargs)
    ours = VideoProcessing.of(config)
    if model_type == "vjepa2":
        processor = transformers.VJEPA2VideoProcessor(crop_size=32)
    else:
        processor = getattr(transformers, processor_name)(size={"shortest_edge": ours.shortest_edge},
                                                          crop_size={"height": 32, "width": 32})
    assert VideoProcessing.from_processor(processor, 4) == ours
    frames = np.random.default_rng(1).integers(0, 256, (11, 40, 52, 3), dtype=np.uint8)  # landscape, not square
    out = processor(frames, do_sample_frames=True, num_frames=4, video_metadata={"total_num_frames": 11, "fps": 8.0},
                    return_tensors="pt")
    expected = out["pixel_values"] if "pixel_values" in out else out["pixel_values_videos"]
    got = vl.clip_pixel_values(vl.Clip(frames), config)
    assert got.shape == expected.shape == (1, 4, 3, 32, 32) and got.dtype == torch.float32
    # the same torchvision resize (uint8, integer arithmetic) and the same float32 normalisation: equal; 1e-6
    # allows a different fused multiply-add order only
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_the_per_frame_defaults_have_one_source_the_familys_declaration():
    from vitlens.families.common.hf import processor_data_config, video_model_types
    from vitlens.families.hf_video import HF_TYPES

    assert set(video_model_types()) == set(PROCESSORS) == set(HF_TYPES.processors)
    for model_type, (config_name, _processor, kwargs) in PROCESSORS.items():
        declared = HF_TYPES.processors[model_type]
        ours = VideoProcessing.of(getattr(transformers, config_name)(**kwargs))
        assert (ours.mean, ours.std, ours.rescale, ours.offset) == (declared.mean, declared.std, declared.rescale,
                                                                   declared.offset)
    # a ViViT checkpoint's own preprocessor_config.json (rescale 1 / 127.5, offset, then 0.5 / 0.5) on [0, 1] pixels
    processor = transformers.VivitImageProcessor().to_dict()
    read_off = processor_data_config(processor, "vivit")
    np.testing.assert_allclose(read_off["mean"], [0.75] * 3, rtol=1e-12)
    np.testing.assert_allclose(read_off["std"], [0.25] * 3, rtol=1e-12)
    assert processor_data_config(transformers.VideoMAEImageProcessor().to_dict(), "videomae")["mean"] == (0.5,) * 3


def test_a_model_without_video_processing_is_refused_in_one_line():
    with pytest.raises(UnsupportedModelError) as e:
        VideoProcessing.of(transformers.ViTConfig())
    assert "no video processing" in one_line(e).lower()


def test_clip_pixel_values_batches_clips_of_any_source(tmp_path, moving):
    config = transformers.VideoMAEConfig(image_size=32, num_frames=4)
    gif = vl.write_gif(moving.clip, tmp_path / "m.gif")
    x = vl.clip_pixel_values([gif, moving.clip], config)
    assert x.shape == (2, 4, 3, 32, 32)
    torch.testing.assert_close(x[0], x[1], rtol=0, atol=0)  # the GIF holds the clip's frames exactly


def test_the_readmes_video_section_runs_as_written(tmp_path, monkeypatch, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("\n## Video clips\n")
    block, = re.findall(r"```python\n(.*?)```", readme[start:readme.find("\n## ", start + 1)], flags=re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Clip('square.mp4': 16 frames of 64x64, 8 fps)" in out and "fixed, not learned" in out
    assert (tmp_path / "square.gif").is_file() and (tmp_path / "square.mp4").is_file()

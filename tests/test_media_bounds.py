"""Small files that took large memory or time (issue 62, items 1-7), each replayed at a smaller scale: the clip
readers decode only the frames a model samples, resize them as they decode and bound frames x pixels before
decoding; a GIF's canvas is bounded before any frame decodes; a survey worker holds a clip as the model's input; an
image is bounded after the model's resize; ``analyze_each`` packs by a token budget. Peak memory is measured in a
child process (``grown_mb``), against the growth the old code showed."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitlens as vl
from vitlens.errors import ClipLoadError, ImageLoadError

transformers = pytest.importorskip("transformers")
av = pytest.importorskip("av")

#: the vitlens the children import: the one this test runs
LIBRARY = str(Path(vl.__file__).resolve().parents[1])
#: a guard on a child's address space (imports take ~4 GB of it): an unbounded read stops there, not at the machine
GUARD_BYTES = 12 << 30


def grown_mb(setup: str, warm: str, attack: str, timeout: float = 180) -> tuple[str, int]:
    """Run ``setup``, ``warm`` and ``attack`` in a fresh interpreter; returns (what the attack raised, as "Type:
    message", or ""; how many MB its peak resident memory grew over the peak after ``warm``, which pays the imports
    and first uses)."""
    body = textwrap.indent(textwrap.dedent(attack), "    ")
    code = (f"import json, resource\nresource.setrlimit(resource.RLIMIT_AS, ({GUARD_BYTES}, {GUARD_BYTES}))\n"
            f"{textwrap.dedent(setup)}\n{textwrap.dedent(warm)}\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\nsaid = ''\n"
            f"try:\n{body}\nexcept Exception as e:\n    said = f'{{type(e).__name__}}: {{e}}'\n"
            "print(json.dumps([said, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024]))\n")
    env = {**os.environ, "PYTHONPATH": LIBRARY, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said, grown = json.loads(proc.stdout.strip().splitlines()[-1])
    return said, int(grown)


def flat_mp4(path: Path, frames: int, size: tuple[int, int]) -> Path:
    """An H.264 MP4 of ``frames`` identical frames (``size`` = (H, W)), one keyframe: a few KB whatever its size."""
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "51", "x264-params": "keyint=100000:scenecut=0"}
        img = np.zeros((*size, 3), np.uint8)
        img[: size[0] // 2] = 200
        frame = av.VideoFrame.from_ndarray(img, format="rgb24")
        for _ in range(frames):
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def crafted_gif(path: Path, canvas: tuple[int, int], extents: list[tuple[int, int]]) -> Path:
    """A GIF written byte by byte: a logical screen of ``canvas`` (w, h) and one frame per extent, each at (0, 0)
    with that (w, h), restored to the background after it (disposal 2), its pixels a 2-byte LZW stream: ~25 bytes a
    frame, whatever the canvas."""
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", *canvas, 0x80, 1, 0) + b"\x00\x00\x00\xff\xff\xff")
    out += b"!\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"
    for w, h in extents:
        out += b"!\xf9\x04\x08\x04\x00\x00\x00" + b"," + struct.pack("<HHHHB", 0, 0, w, h, 0) + b"\x02\x02\x44\x01\x00"
    path.write_bytes(bytes(out + b";"))
    return path


@pytest.fixture(scope="module")
def videomae(tmp_path_factory) -> str:
    """A random-init VideoMAE of 4 frames at 32 x 32, saved as a folder (``hf:FOLDER``)."""
    root = tmp_path_factory.mktemp("mae")
    torch.manual_seed(0)
    transformers.VideoMAEModel(transformers.VideoMAEConfig(
        image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64)).save_pretrained(root)
    return str(root)


# --- items 3 and 1: only the sampled frames, resized as they decode ---

def test_clip_pixel_values_holds_one_decoded_frame_not_the_clip(tmp_path):
    """Item 3, at 2048 x 2048 instead of 4992 x 4992: 16 frames were held whole as a list, then stacked (~400 MB
    here); read as they decode and resized, the read grows by about one frame (12 MB)."""
    small, big = flat_mp4(tmp_path / "small.mp4", 16, (64, 64)), flat_mp4(tmp_path / "big.mp4", 16, (2048, 2048))
    assert big.stat().st_size < 50_000
    setup = ("import vitlens as vl, transformers\nfrom vitlens.clips import sampled_clip\n"
             "cfg = transformers.VideoMAEConfig(image_size=32, num_frames=16)\n")
    for attack in (f"vl.clip_pixel_values({str(big)!r}, cfg)",  # the library's path
                   f"vl.clip_pixel_values(sampled_clip({str(big)!r}, cfg), cfg)"):  # the app's
        said, grown = grown_mb(setup, f"vl.clip_pixel_values(sampled_clip({str(small)!r}, cfg), cfg)", attack)
        assert said == "" and grown < 100, (attack, said, grown)


@pytest.mark.parametrize("kind", ["mp4", "gif", "folder"])
def test_frames_resized_as_they_decode_equal_the_clip_resized_at_once(tmp_path, kind):
    """What the model is given is unchanged: the frames resized one by one as they decode are those of the whole
    clip resized at once (the processors' resize works frame by frame), bit for bit, on a clip wider than tall."""
    g = np.random.default_rng(0)
    clip = vl.Clip(g.integers(0, 256, (9, 40, 56, 3), dtype=np.uint8), fps=5.0)
    if kind == "mp4":
        source = vl.write_mp4(clip, tmp_path / "c.mp4")
    elif kind == "gif":
        source = vl.write_gif(clip, tmp_path / "c.gif")
    else:
        source = tmp_path / "frames"
        source.mkdir()
        for i, f in enumerate(clip.frames):
            Image.fromarray(f).save(source / f"{i:03d}.png")
    cfg = transformers.VideoMAEConfig(image_size=32, num_frames=4)
    processing = vl.clips.VideoProcessing.of(cfg)
    whole = vl.read_clip(source)  # every frame at its own size, as before
    expected = processing.frames_to_pixels(whole.frames[vl.clips.sample_indices(whole.num_frames, 4)])
    sampled = vl.clips.sampled_clip(source, cfg)
    assert sampled.size == (32, 44) and sampled.source_frames == 9  # 40 x 56 with the shorter side at 32
    np.testing.assert_array_equal(sampled.indices, [0, 2, 4, 6])
    torch.testing.assert_close(vl.clip_pixel_values(source, cfg)[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(vl.clip_pixel_values(sampled, cfg)[0], expected, rtol=0, atol=0)


def test_report_video_reads_the_frames_each_model_samples_not_the_clip(tmp_path, videomae):
    """Item 1, 300 frames of 512 x 512 instead of 19,999 of 140 x 140: ``report --video`` read every frame (a list,
    then a stack: ~470 MB here) for a model that takes 4; now the first frame is read to describe the clip and each
    model reads its 4, so the report of the long clip grows no more than one of a short clip."""
    small, big = flat_mp4(tmp_path / "small.mp4", 8, (64, 64)), flat_mp4(tmp_path / "big.mp4", 300, (512, 512))
    setup = "from vitlens.cli import main\n"
    run = ("assert main(['report', '--video', {!r}, '--model', 'hf:{}', '--out', {!r}, '--device', 'cpu', "
           "'--quiet']) == 0")
    said, grown = grown_mb(setup, run.format(str(small), videomae, str(tmp_path / "s.html")),
                           run.format(str(big), videomae, str(tmp_path / "b.html")))
    assert said == "" and grown < 100, (said, grown)
    page = (tmp_path / "b.html").read_text()
    assert "300 frames of 512x512" in page and "reads 4 of the clip&#x27;s 300 frames" in page.replace("'", "&#x27;")


# --- item 5: frames decoded x pixels bounded before decoding ---

def test_a_long_gif_of_large_frames_is_refused_before_it_decodes(tmp_path):
    """Item 5 with 1,000 frames instead of 19,999 (25 KB): a model sampling 16 of them decoded every frame up to the
    last one kept (~70 ms each at 4992 x 4992, and 16 kept frames of 75 MB); refused from the blocks alone."""
    gif = crafted_gif(tmp_path / "long.gif", (4992, 4992), [(1, 1)] * 1000)
    assert gif.stat().st_size < 30_000
    t0 = time.perf_counter()
    said, grown = grown_mb("import vitlens as vl", "", f"vl.read_clip({str(gif)!r}, 16)", timeout=60)
    assert said.startswith("ClipLoadError") and "decodes 938 frames of 4992 x 4992" in said, said
    assert "cut or downscale it first" in said and grown < 50, (said, grown)
    assert time.perf_counter() - t0 < 50


def test_a_long_mp4_is_refused_before_decoding_past_the_bound(tmp_path, monkeypatch):
    """Item 5 for a video, the bound scaled down with the clip (300 frames of 512 x 512, one keyframe; a bound of
    50 M decoded pixels): the 4 frames a model samples need 226 frames decoded, refused before the first is; a
    sample within the bound reads."""
    from vitlens.clips import read

    path = flat_mp4(tmp_path / "long.mp4", 300, (512, 512))
    monkeypatch.setattr(read, "MAX_CLIP_DECODE_PIXELS", 50_000_000, raising=False)
    with pytest.raises(ClipLoadError, match=r"long.mp4: reading it decodes 226 frames of 512 x 512"):
        vl.read_clip(path, 4)
    monkeypatch.setattr(read, "MAX_CLIP_DECODE_PIXELS", 60_000_000)
    assert vl.read_clip(path, 4, shortest_edge=32).frames.shape == (4, 32, 32, 3)


# --- item 4: a GIF's canvas, grown by a later frame ---

def test_a_gif_canvas_grown_by_a_later_frame_is_refused_before_it_is_allocated(tmp_path):
    """Item 4 at 6100 x 6100 instead of 13000 x 13000 (~110 bytes): only the first canvas (1 x 1) was checked, and
    Pillow allocates the grown one when it seeks to the frame (~150 MB here); refused before any frame decodes."""
    gif = crafted_gif(tmp_path / "grows.gif", (1, 1), [(1, 1), (1, 1), (6100, 6100), (1, 1)])
    assert gif.stat().st_size < 200
    said, grown = grown_mb("import vitlens as vl", "", f"vl.read_clip({str(gif)!r})")
    assert said.startswith("ClipLoadError: grows.gif: frames too large to read safely (6100 x 6100 pixels"), said
    assert grown < 30, grown
    with pytest.raises(ClipLoadError, match="frames too large"):
        vl.read_clip(gif, 2)  # frames 0 and 2 are sampled: the canvas of frame 2 is read


# --- item 6: an image bounded after the model's resize ---

def test_an_elongated_image_is_refused_before_the_models_resize(tmp_path):
    """Item 6 at 1000 x 1 instead of 20000 x 1 (a PNG of ~70 bytes): decoding it is nothing, but timm's eval
    transform scales its short side to 256 first (256 x 256,000, ~200 MB here); refused before that resize."""
    png = tmp_path / "strip.png"
    Image.new("RGB", (1000, 1), (9, 99, 199)).save(png)
    cfg = dict(input_size=(3, 224, 224), interpolation="bicubic", mean=(0.5,) * 3, std=(0.5,) * 3, crop_pct=0.875)
    setup = f"from vitlens.images import preprocess\ncfg = {cfg!r}\n"
    said, grown = grown_mb(setup, "preprocess([__import__('numpy').zeros((8, 8, 3), 'uint8')], cfg)",
                           f"preprocess([{str(png)!r}], cfg)")
    assert said.startswith(f"ImageLoadError: {png}: image too elongated to analyse safely (1000 x 1 px, aspect "
                           "ratio 1000:1)"), said
    assert "Crop it nearer to square first." in said and grown < 30, (said, grown)


def test_the_resize_bound_follows_the_transforms_rule_and_every_path_meets_it(tmp_path):
    """The bound is the resize's own size (timm's "center" mode; "squash" never grows), so a wide photo passes and
    a strip is refused, by ``preprocess`` and so by every path on it: ``m.preprocess``, batches, the CLI (exit 2); a
    survey worker skips it as an unreadable image."""
    from vitlens.images import check_resized, resized_pixels

    cfg = dict(input_size=(3, 224, 224), crop_pct=0.875)
    assert resized_pixels((640, 480), cfg) == 341 * 256
    assert resized_pixels((100_000, 1), {**cfg, "crop_mode": "squash"}) == 256 * 256
    check_resized((4000, 250), cfg, "a 16:1 panorama")  # 4096 x 256: passes
    with pytest.raises(ImageLoadError, match="strip: image too elongated"):
        check_resized((20_000, 1), cfg, "strip")
    m = vl.load_model("ref-vit", device="cpu")
    strip = np.zeros((1, 20_000, 3), np.uint8)
    with pytest.raises(ImageLoadError, match="too elongated"):
        m.preprocess([strip])
    with pytest.raises(ImageLoadError, match="too elongated"):
        next(vl.images.iter_batches([np.zeros((8, 8, 3), np.uint8), strip], m.data_config, 2))
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.new("RGB", (32, 32)).save(folder / "a.png")
    Image.new("RGB", (20_000, 1)).save(folder / "b.png")
    from test_cli import run_cli_here

    proc = run_cli_here("report", "--model", "ref-vit", "--images", str(folder), "--out", str(tmp_path / "r.html"),
                        "--quiet")
    assert proc.returncode == 2 and "b.png: image too elongated" in proc.stderr, proc.stderr
    assert not (tmp_path / "r.html").exists()
    from vitlens.survey import files_source
    from vitlens.survey.sources import Shard
    from vitlens.survey.worker import run_shard

    done = run_shard(m, files_source(str(folder)), Shard(0, 0, 2), ("distance",), 2)
    assert done["skipped"] == ["b.png"] and done["n_images"] == 1


# --- item 2: a survey worker holds a clip as the model's input ---

def test_a_survey_worker_holds_each_clip_as_the_models_input(tmp_path, videomae):
    """Item 2, two clips of 300 frames at 512 x 512: a worker read a shard's clips whole (~470 MB here) before the
    model sampled 4 frames of each; now each clip is read as the model's input (its 4 frames, resized as they
    decode), and the shard's statistics are those of the clips read whole."""
    from vitlens.survey import clips_source
    from vitlens.survey.sources import Shard
    from vitlens.survey.worker import run_shard

    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir(), big.mkdir()
    for i in range(2):
        flat_mp4(small / f"{i}.mp4", 8, (64, 64))
        flat_mp4(big / f"{i}.mp4", 300, (512, 512))
    setup = ("import vitlens as vl\nfrom vitlens.survey import clips_source\nfrom vitlens.survey.sources import Shard\n"
             "from vitlens.survey.worker import run_shard\n"
             f"m = vl.load_model('hf:{videomae}', device='cpu')\n")
    run = "run_shard(m, clips_source({!r}), Shard(0, 0, 2), ('spacetime',), 2)"
    said, grown = grown_mb(setup, run.format(str(small)), run.format(str(big)))
    assert said == "" and grown < 100, (said, grown)
    m = vl.load_model(f"hf:{videomae}", device="cpu")
    source = clips_source(str(big))
    state = run_shard(m, source, Shard(0, 0, 2), ("spacetime",), 2)["states"]["spacetime"]
    from vitlens.survey.spacetime import spacetime_stats

    whole = spacetime_stats(m, [vl.read_clip(f) for f in source.files], 2).state()
    assert state.keys() == whole.keys()
    for key in state:
        np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(whole[key]), err_msg=key)


# --- item 7: analyze_each in packs of a token budget ---

PIXTRAL = ("import torch, transformers, vitlens as vl\n"
           "cfg = transformers.PixtralVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, "
           "intermediate_size=64, image_size=32, patch_size=8, head_dim=16, attn_implementation='sdpa')\n"
           "torch.manual_seed(0)\nm = vl.load_model(transformers.PixtralVisionModel(cfg).eval(), device='cpu')\n")


def test_analyze_each_runs_a_long_list_in_packs_of_a_token_budget():
    """Item 7 with 200 images of 32 x 32 (3,200 tokens) and the budget scaled down with them (1 MiB of maps: 256
    tokens for 2 blocks of 2 heads): one pack of every image held maps growing with its tokens squared (~200 MB
    here); in packs the run grows by one pack's."""
    setup = PIXTRAL + "from vitlens.views import packed\npacked.MAX_PACK_MAP_BYTES = 1 << 20\n"
    images = "[torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range({})]"
    said, grown = grown_mb(setup, f"vl.analyze_each(m, {images.format(8)})",
                           f"assert len(vl.analyze_each(m, {images.format(200)})) == 200")
    assert said == "" and grown < 60, (said, grown)


def test_packs_of_a_token_budget_give_each_image_the_result_of_one_pack(monkeypatch):
    """Cutting the list into packs changes no image's result: images of different sizes, in packs of at most 40
    tokens (an image above it alone), equal the same images in one pack."""
    from vitlens.views import packed

    cfg = transformers.PixtralVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, image_size=32, patch_size=8, head_dim=16,
                                           attn_implementation="sdpa")
    torch.manual_seed(0)
    m = vl.load_model(transformers.PixtralVisionModel(cfg).eval(), device="cpu")
    g = torch.Generator().manual_seed(3)
    images = [torch.randn(3, h, w, generator=g) for h, w in [(32, 24), (16, 40), (32, 32), (8, 8), (48, 56), (24, 16)]]
    one = vl.analyze_each(m, images)
    calls = []
    forward = m.family.packed_forward
    monkeypatch.setattr(m.family, "packed_forward", lambda model, pack: calls.append(len(pack)) or forward(model, pack))
    monkeypatch.setattr(packed, "MAX_PACK_MAP_BYTES", 40 * 40 * 4 * 2 * 2)
    assert packed.pack_tokens(m) == 40
    split = vl.analyze_each(m, images)
    assert calls == [4, 1, 1]  # 12 + 10 + 16 + 1 tokens; 42 alone (above the budget); 6
    for a, b in zip(one, split):
        assert a.spec.grid == b.spec.grid
        np.testing.assert_allclose(a.distance.mean_px, b.distance.mean_px, rtol=0, atol=1e-6)
        np.testing.assert_allclose(a.rollout.maps, b.rollout.maps, rtol=0, atol=1e-6)

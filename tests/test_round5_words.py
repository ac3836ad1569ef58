"""What a new user tripped over, round five (issue 63): the words the library says. Refusals with their true reason
(63.6), class names where the model knows them and every image in the lens summary (63.7), huge uploads said too
large (63.9), a model without prefix tokens not said to have a GAP/MAP head (63.10), a GIF's rate kept (63.17),
figure_for naming images= (63.19), top_heads' 0-based indices (63.20), the CLI's help and the token norms' summary
(63.21)."""
from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens import figures
from vitlens.errors import ImageLoadError, InvalidParameterError, UnsupportedModelError

from test_cli import run_cli_here


def blank_png(w: int, h: int) -> bytes:
    """A grey PNG of w x h pixels, a few hundred kB however large (rows of zeros compress to nothing)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = zlib.compress((b"\x00" * (w + 1)) * h, 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) + chunk(b"IDAT", raw)
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("side", [10_000, 15_000])  # above Pillow's warning (89 MP), above its refusal (179 MP)
def test_a_huge_png_is_said_too_large_in_vitlens_words_without_a_warning(side: int) -> None:
    """63.9: 'Cannot read huge.png as an image (... Downscale it first.). Pass a PNG ...' for a PNG, Pillow's
    'decompression bomb DOS attack' text, and a raw DecompressionBombWarning on the CLI."""
    from vitlens.image_uploads import read_upload

    data = blank_png(side, side)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with pytest.raises(ImageLoadError) as e:
            read_upload("huge.png", data)
    text = str(e.value)
    assert text.startswith("huge.png: image too large to analyse safely") and f"{side * side:,} pixels" in text
    assert "Cannot read" not in text and "Pass a PNG" not in text and "DOS attack" not in text


def test_a_towers_prefix_tokens_are_not_said_to_be_a_gap_or_map_head() -> None:
    """63.10: Pixtral, VideoMAE and Qwen2.5-VL towers were said to have a 'GAP/MAP head'."""
    spec = vl.load_model("ref-vit").spec
    none = type(spec)(**{**spec.__dict__, "num_prefix_tokens": 0, "has_class_token": False, "prefix_labels": ()})
    assert none.prefix_description() == "0 (none: patch tokens only)"


@pytest.mark.parametrize("fps", [8.0, 10.0, 25.0])
def test_a_gif_written_at_a_rate_reads_back_at_that_rate(tmp_path, fps: float) -> None:
    """63.17: 8 fps was written as 120 ms frames and read back at 8.33 fps (temporal distances ~4% off)."""
    moving = vl.moving_shape_clip(num_frames=16, fps=fps)
    vl.write_gif(moving.clip, tmp_path / "m.gif")
    back = vl.read_clip(tmp_path / "m.gif")
    assert back.num_frames == 16 and back.fps == pytest.approx(fps, rel=1e-9)
    assert len(repr(moving).splitlines()) == 1 and "array" not in repr(moving)  # not the masks' arrays


def test_figure_for_names_images_and_display_when_images_are_missing() -> None:
    """63.19: 'pass them as the model sees them' without saying how."""
    m = vl.load_model("ref-vit")
    a = vl.attribute(m, vl.sample_images()[:1], "rollout")
    with pytest.raises(InvalidParameterError, match=r"images=m\.display\(images\)"):
        figures.figure_for(a)


def test_top_heads_are_0_based_indices_of_head_table_and_the_summary_counts_from_1() -> None:
    """63.20: top_heads (1, 3, 0.104) beside a summary's 'layer 2 head 4'; the answer: 0-based indices, said."""
    d = vl.decompose(vl.load_model("ref-vit"), vl.sample_images()[:1])
    l, h, v = d.top_heads(1)[0]
    assert d.head_table(0)[l, h] == pytest.approx(v)
    assert f"top head layer {l + 1} head {h + 1}" in d.summary() and "0-based" in type(d).top_heads.__doc__


def test_lens_and_patching_name_the_class_and_the_lens_summary_says_every_image() -> None:
    """63.7: 'class 4 first on top at depth 3' beside a table that says 'ring'; four images, the first described."""
    m = vl.load_model("ref-vit")
    names = m.label_names()
    images = vl.sample_images()[:3]
    r = vl.logit_lens(m, images)
    assert r.label_names == names
    for b in range(3):
        assert names[int(r.target[b])] in r.summary() and f"(image {b})" in r.summary()
    assert f"image 0 ({names[int(r.target[0])]})" == figures.logit_lens_figure(r).data[0].name
    x = vl.preprocess(images[:1], m.data_config)
    p = vl.patch_activations(m, x, torch.zeros_like(x))
    assert p.summary().split(": ", 1)[1].startswith(f"{names[p.target]} logit")


def test_lens_and_norms_refuse_a_tower_without_calling_it_hierarchical(tmp_path) -> None:
    """63.6: a Pixtral tower's logit lens and token norms said 'hierarchical models have no single stream'."""
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    tower = tr.PixtralVisionModel(tr.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=2, image_size=32, patch_size=8))
    for fn in (vl.logit_lens, vl.token_norms):
        with pytest.raises(UnsupportedModelError, match="PixtralVisionModel's blocks are not among them") as e:
            fn(tower, torch.zeros(1, 3, 32, 32))
        assert "hierarchical" not in str(e.value)


def test_a_siglip_towers_components_refusal_asks_the_app_for_what_it_has() -> None:
    """63.6: the Components page asked a SigLIP tower's user for direction=, an API argument with no widget."""
    tr = pytest.importorskip("transformers")
    tower = tr.SiglipVisionModel(tr.SiglipVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64, image_size=32, patch_size=8))
    for call in (lambda: vl.decompose(tower, torch.zeros(1, 3, 32, 32)),
                 lambda: vl.logit_lens(tower, torch.zeros(1, 3, 32, 32))):
        with pytest.raises(InvalidParameterError) as e:
            call()
        assert "Give direction=" in e.value.message_for("python") and "Give direction=" not in e.value.message_for("app")


def test_token_norms_summary_without_outliers_says_none() -> None:
    """63.21: 'first appear at depth never'."""
    r = vl.token_norms(vl.load_model("ref-vit"), vl.sample_images()[:1], factor=1e6)
    assert r.summary().endswith("none at any depth") and "never" not in r.summary()


def test_every_cli_option_and_argument_has_help() -> None:
    """63.21: compare --models, --batch-size and survey-report's folder had no help text."""
    from vitlens.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    bare = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in sub.choices.items() for a in p._actions
            if not a.help and a.dest != "help"]
    assert bare == [], bare
    assert "the survey folder" in run_cli_here("survey-report", "--help").stdout


def test_the_docs_home_and_readme_name_every_tutorial_and_view() -> None:
    """63.8 and 63.18: 'runs the six tutorials' (eight), the README's app views without Components, the home page
    without tutorial 07 and the Components API page and saying every tutorial runs on the embedded pair; its first
    code block cut at the right; no search from file:// (answered: it needs a server, said in the README)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    home, readme = (root / "docs" / "index.md").read_text(), (root / "README.md").read_text()
    for tutorial in sorted((root / "tutorials").glob("[0-9][0-9]_*.py")):
        assert f"tutorials/{tutorial.stem}.md" in home and f"tutorials/{tutorial.name}" in readme, tutorial.name
    assert "api/components.md" in home and "six tutorials" not in readme
    assert "Attributions, Components, Compare" in readme and "08 on a random-init" in home
    block = home.split("```bash\n", 1)[1].split("```", 1)[0]
    assert max(len(line) for line in block.splitlines()) <= 72  # the theme's code box at its narrowest, whole
    # search from file:// would need Material's offline plugin, which fetches a shim from unpkg.com: not used, said
    assert "- offline" not in (root / "mkdocs.yml").read_text() and "python -m http.server -d site" in readme

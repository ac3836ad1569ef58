"""Images: every mode converts to RGB, unreadable input gives ImageLoadError, preprocessing uses
the model's data config, and batching streams any kind of input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import vitlens as vl
from vitlens.images import iter_batches


def test_modes_convert_to_rgb():
    gray = Image.fromarray(np.full((4, 5), 128, np.uint8), "L")
    assert np.all(np.asarray(vl.to_rgb(gray)) == 128)
    rgba = Image.fromarray(np.dstack([np.zeros((4, 5, 3), np.uint8), np.zeros((4, 5), np.uint8)]), "RGBA")
    assert np.all(np.asarray(vl.to_rgb(rgba)) == 255)  # fully transparent -> white background
    cmyk = Image.new("CMYK", (5, 4), (0, 0, 0, 0))
    assert np.all(np.asarray(vl.to_rgb(cmyk)) == 255)
    i16 = Image.fromarray(np.full((4, 5), 65535, np.uint16))
    assert i16.mode.startswith("I;16")
    assert np.all(np.asarray(vl.to_rgb(i16)) == 255)
    pal = gray.convert("P")
    assert vl.to_rgb(pal).mode == "RGB"


def test_arrays_convert_by_their_range():
    assert np.all(np.asarray(vl.to_rgb(np.full((3, 3), 1.0))) == 255)  # float in [0, 1]
    assert np.all(np.asarray(vl.to_rgb(np.full((3, 3, 3), 257 * 10, np.uint16))) == 10)
    chw = np.zeros((3, 6, 7), np.uint8)
    assert vl.to_rgb(chw).size == (7, 6)
    with pytest.raises(vl.ImageLoadError, match="not an image"):
        vl.to_rgb(np.zeros((2, 3, 4, 5), np.uint8))


def test_sixteen_bit_png_file_is_scaled_not_clipped(tmp_path):
    p = tmp_path / "deep.png"
    Image.fromarray(np.full((8, 8), 32768, np.uint16)).save(p)
    assert np.all(np.abs(np.asarray(vl.to_rgb(p)).astype(int) - 128) <= 1)


def test_unreadable_images_raise_image_load_error(tmp_path):
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not a png at all")
    with pytest.raises(vl.ImageLoadError, match="Cannot read"):
        vl.to_rgb(junk)
    truncated = tmp_path / "cut.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:300])
    with pytest.raises(vl.ImageLoadError):
        vl.to_rgb(truncated)
    with pytest.raises(vl.ImageLoadError, match="not found"):
        vl.to_rgb(tmp_path / "nope.png")
    with pytest.raises(vl.ImageLoadError):
        vl.to_rgb(object())  # type: ignore[arg-type]


def test_preprocess_uses_the_models_input_size_and_normalisation(tiny):
    x = tiny.preprocess(vl.sample_images())
    assert x.shape == (4, 3, 224, 224) and x.dtype == torch.float32
    # vit_tiny normalises with mean = std = 0.5: values lie in [-1, 1]
    assert x.min() >= -1.0001 and x.max() <= 1.0001
    wide = vl.load_model("vit_tiny_patch16_224", pretrained=False, img_size=(160, 224))
    assert wide.preprocess(vl.sample_images(["coffee"])).shape == (1, 3, 160, 224)


def test_batches_from_tensors_lists_and_iterables(tiny):
    x = torch.zeros(5, 3, 224, 224)
    assert [b.shape[0] for b in iter_batches(x, tiny.data_config, 2)] == [2, 2, 1]
    imgs = vl.sample_images()
    assert [b.shape[0] for b in iter_batches(imgs, tiny.data_config, 3)] == [3, 1]
    gen = (torch.zeros(2, 3, 224, 224) for _ in range(3))
    assert [b.shape[0] for b in iter_batches(gen, tiny.data_config, 8)] == [2, 2, 2]
    with pytest.raises(vl.InvalidParameterError, match="No images"):
        list(iter_batches([], tiny.data_config, 2))
    with pytest.raises(vl.InvalidParameterError, match="batch_size"):
        list(iter_batches(x, tiny.data_config, 0))


def test_views_accept_paths_and_report_the_bad_one(tmp_path, tiny):
    good = tmp_path / "good.png"
    vl.sample_images(["chelsea"])[0].save(good)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 broken")
    assert vl.attention_distance(tiny, [good]).n_images == 1
    with pytest.raises(vl.ImageLoadError, match="bad.jpg"):
        vl.attention_distance(tiny, [good, bad])


def test_sample_images_ship_offline():
    imgs = vl.sample_images()
    assert [i.info["name"] for i in imgs] == ["astronaut", "coffee", "chelsea", "rocket"]
    assert all(i.mode == "RGB" and min(i.size) >= 300 for i in imgs)


# --- tiny images

def test_a_tiny_image_gets_the_one_warning_in_uploads_and_on_the_command_line():
    import io

    from PIL import Image

    from vitlens.image_uploads import read_uploads
    from vitlens.images import TINY_IMAGE_PX, tiny_image_warning

    def png(size):
        buf = io.BytesIO()
        Image.new("RGB", size).save(buf, format="PNG")
        return buf.getvalue()

    got = read_uploads([("dot.png", png((1, 1))), ("ok.png", png((TINY_IMAGE_PX, TINY_IMAGE_PX)))])
    assert got.names == ["dot.png", "ok.png"] and got.tiny == [tiny_image_warning("dot.png", (1, 1))]
    assert got.tiny[0].startswith("dot.png (1x1 px) is smaller than 16 px")
    assert tiny_image_warning("ok.png", (TINY_IMAGE_PX, 400)) == ""

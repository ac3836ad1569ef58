"""Decompression bombs under PIL's own limit, EXIF orientation, and uploads decoded once (issue 33, item 6)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vitlens import images as vimages
from vitlens.errors import ImageLoadError
from vitlens import image_uploads
from vitlens.image_uploads import read_uploads
from vitlens.images import MAX_DECODE_PIXELS, open_image, to_rgb


def test_a_png_above_the_budget_is_refused_before_it_is_decoded(tmp_path):
    path = tmp_path / "bomb.png"
    Image.new("RGB", (4000, 4000)).save(path)  # 48 MB decoded, a few hundred KB on disk
    code = ("import resource, sys; from vitlens.images import open_image; from vitlens.errors import ImageLoadError\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "try:\n    open_image(sys.argv[1], 'bomb.png', max_pixels=1_000_000)\n"
            "except ImageLoadError as e:\n    print(e)\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    message, grown_mb = proc.stdout.strip().splitlines()
    assert "bomb.png: image too large to analyse safely (4000 x 4000 = 16,000,000 pixels" in message
    assert "Downscale it first." in message
    assert int(grown_mb) < 24, proc.stdout  # never the 48 MB of its pixels


def test_the_default_budget_is_stated_and_refuses_just_above_it(tmp_path):
    side = int(MAX_DECODE_PIXELS ** 0.5) + 1
    path = tmp_path / "big.png"
    Image.new("L", (side, side)).save(path)
    with pytest.raises(ImageLoadError, match="too large.*Downscale it first"):
        to_rgb(path)


def test_a_jpeg_above_the_budget_is_decoded_reduced_to_fit(tmp_path):
    path = tmp_path / "big.jpg"
    Image.new("RGB", (4000, 3000), (200, 30, 30)).save(path, quality=80)
    img = open_image(path, "big.jpg", max_pixels=1_000_000)
    assert img.size == (1000, 750) and img.getpixel((500, 375))[0] > 150


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 10, 20))  # blue on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: show rotated 90 degrees clockwise
    path = tmp_path / "phone.jpg"
    img.save(path, exif=exif, quality=95)
    upright = to_rgb(path)
    assert upright.size == (20, 40)
    r, g, b = upright.getpixel((10, 2))  # the left edge became the top
    assert b > 200 and r < 60


def test_uploads_are_decoded_once_per_session_and_kept_resized(monkeypatch):
    buf = io.BytesIO()
    Image.new("RGB", (3000, 100)).save(buf, format="PNG")
    data = buf.getvalue()
    calls = []
    real = image_uploads.read_upload
    monkeypatch.setattr(image_uploads, "read_upload", lambda *a: calls.append(a[0]) or real(*a))
    memo: dict = {}
    first = read_uploads([("wide.png", data), ("junk.png", b"no")], max_side_px=2048, memo=memo)
    second = read_uploads([("wide.png", data), ("junk.png", b"no")], max_side_px=2048, memo=memo)
    assert calls == ["wide.png", "junk.png"]  # the rerun decoded nothing
    assert first.images[0].size == (2048, 68) and second.images[0] is first.images[0]
    assert second.skipped == first.skipped and len(second.skipped) == 1
    read_uploads([], memo=memo)
    assert memo == {}  # files no longer uploaded leave the session

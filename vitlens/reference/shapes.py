"""Procedural "shapes" scenes: the offline data the embedded reference models are trained on.

Each image holds one bright shape of one of six classes at a random position, size and
rotation, over a dark background with weak low-frequency texture, pixel noise and up to three
small distractor blobs. The class depends only on the shape, so a faithful attribution map
should fall on the object; every image comes with its object mask for measuring that
(pointing game, mass inside the mask).

Everything is generated from a seed: the same ``(seed, index)`` always gives the same scene.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "ring", "star")
IMAGE_SIZE = 64


@dataclass(frozen=True)
class ShapesBatch:
    """A batch of scenes.

    Attributes:
        images: uint8 [n, H, W, 3].
        labels: int64 [n], indices into ``CLASSES``.
        masks: bool [n, H, W], True on the object's pixels.
    """

    images: np.ndarray
    labels: np.ndarray
    masks: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def _shape_mask(kind: int, u: np.ndarray, v: np.ndarray, radius: float) -> np.ndarray:
    """Inside-test for shape ``kind`` in its own rotated frame (u, v), centred at the origin."""
    r = np.hypot(u, v)
    if kind == 0:  # circle
        return r <= radius
    if kind == 1:  # square of half-side 0.8 R
        return np.maximum(np.abs(u), np.abs(v)) <= 0.8 * radius
    if kind == 2:  # equilateral triangle with circumradius R
        inside = np.ones_like(u, dtype=bool)
        for k in range(3):
            phi = np.pi / 2 + (k + 0.5) * 2 * np.pi / 3
            inside &= u * np.cos(phi) + v * np.sin(phi) <= 0.5 * radius
        return inside
    if kind == 3:  # plus-shaped cross, arm half-width 0.3 R
        w = 0.3 * radius
        return ((np.abs(u) <= w) & (np.abs(v) <= radius)) | ((np.abs(v) <= w) & (np.abs(u) <= radius))
    if kind == 4:  # ring
        return (r <= radius) & (r >= 0.55 * radius)
    if kind == 5:  # five-pointed star: radius oscillates between 0.35 R and R
        phi = np.arctan2(v, u)
        return r <= radius * (0.675 + 0.325 * np.cos(5 * phi))
    raise ValueError(f"unknown shape kind {kind}")


def shape_mask(label: int, u: np.ndarray, v: np.ndarray, radius: float) -> np.ndarray:
    """Inside-test for the shape ``CLASSES[label]`` of circumradius ``radius`` at pixel offsets (u, v) from its
    centre, in its own rotated frame (the scenes' shapes; the moving-shape clips of ``vitlens.clips`` draw them)."""
    return _shape_mask(label, u, v, radius)


def _smooth_texture(rng: np.random.Generator, size: int) -> np.ndarray:
    """Low-frequency texture in [-1, 1]: a 4x4 random grid upsampled bilinearly to size x size."""
    coarse = rng.uniform(-1, 1, size=(4, 4, 3))
    pos = np.linspace(0, 3, size)
    i0 = np.clip(np.floor(pos).astype(int), 0, 2)
    t = (pos - i0)[:, None]
    rows = coarse[i0] * (1 - t)[..., None] + coarse[i0 + 1] * t[..., None]  # [size, 4, 3]
    cols = rows[:, i0] * (1 - t.T)[..., None] + rows[:, i0 + 1] * t.T[..., None]
    return cols


def render_scene(rng: np.random.Generator, size: int = IMAGE_SIZE,
                 field_rng: np.random.Generator | None = None) -> tuple[np.ndarray, int, np.ndarray]:
    """Draw one scene; returns (float image [H, W, 3] in [0, 1], label, mask [H, W]).

    With ``field_rng`` the background also carries a strong smooth colour field (amplitude
    0.15-0.3 per channel), drawn from that generator so the rest of the scene is unchanged:
    a patch's colour is then best predicted from its neighbours.
    """
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    background = rng.uniform(0.05, 0.4, size=3)
    image = np.broadcast_to(background, (size, size, 3)).copy()
    if rng.random() >= 0.3:  # 30% of scenes keep a plain background
        image += rng.uniform(0.03, 0.08) * _smooth_texture(rng, size)
    for _ in range(rng.integers(0, 4)):  # distractor blobs: small, soft, mid-bright
        cy, cx = rng.uniform(0, size, size=2)
        sigma = rng.uniform(1.0, 2.0)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma**2))
        image += blob[..., None] * rng.uniform(0.1, 0.35, size=3)
    label = int(rng.integers(0, len(CLASSES)))
    radius = rng.uniform(10.0, 22.0) * size / IMAGE_SIZE
    margin = 0.8 * radius
    cy, cx = rng.uniform(margin, size - margin, size=2)
    theta = rng.uniform(0, 2 * np.pi)
    dy, dx = yy - cy, xx - cx
    u = dx * np.cos(theta) + dy * np.sin(theta)
    v = -dx * np.sin(theta) + dy * np.cos(theta)
    mask = _shape_mask(label, u, v, radius)
    colour = rng.uniform(0.6, 1.0, size=3)
    image[mask] = colour
    image += rng.normal(0.0, 0.02, size=image.shape)
    if field_rng is not None:
        image[~mask] += field_rng.uniform(0.15, 0.3) * _smooth_texture(field_rng, size)[~mask]
    return np.clip(image, 0.0, 1.0), label, mask


STYLES = ("plain", "field")


def generate(n: int, seed: int = 0, size: int = IMAGE_SIZE, start: int = 0, style: str = "plain") -> ShapesBatch:
    """Generate scenes ``start .. start+n-1`` of the stream named by ``seed``.

    Scene ``i`` depends only on ``(seed, i)``, so batches can be generated in any order and
    shards agree with one long run.

    Args:
        n: number of scenes.
        seed: stream seed; the reference models were trained on seeds >= 1000 and are
            evaluated on ``seed=0`` (see ``HELD_OUT_SEED``).
        size: image side in pixels (64 for the reference models).
        start: index of the first scene.
        style: "plain" (the reference pair's scenes) or "field" (the same scenes over a strong
            smooth colour field; used to pretrain with masked patch prediction).

    Returns:
        A ``ShapesBatch``: ``images`` [n, size, size, 3] uint8, ``labels`` [n] class indices into
            ``CLASSES``, ``masks`` [n, size, size] bool object masks.
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, not {style!r}")
    if n < 0 or start < 0:
        raise ValueError(f"n and start must be >= 0 (got n={n}, start={start})")
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    masks = np.empty((n, size, size), dtype=bool)
    for j in range(n):
        rng = np.random.default_rng([seed, start + j])
        field_rng = np.random.default_rng([seed, start + j, 7]) if style == "field" else None
        img, labels[j], masks[j] = render_scene(rng, size, field_rng)
        images[j] = np.round(img * 255).astype(np.uint8)
    return ShapesBatch(images=images, labels=labels, masks=masks)


HELD_OUT_SEED = 0


def scene_names(labels: np.ndarray, start: int = 0) -> list[str]:
    """'scene 3 (ring)'-style names for scenes ``start, start + 1, ...`` with these labels."""
    return [f"scene {start + i} ({CLASSES[int(label)]})" for i, label in enumerate(labels)]

"""Images in, model-ready batches out: reading files and uploads, converting any mode to RGB,
preprocessing with the model's own data config, batching, and the sample images that ship with
scikit-image. ``Images`` is every form of image input the views accept.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Sequence, Union

import numpy as np
import torch
from PIL import Image, ImageFile

from .errors import ImageLoadError, InvalidParameterError

ImageLike = Union[Image.Image, str, Path, np.ndarray]
#: What every view accepts as images: a preprocessed tensor [B, 3, H, W] (or [3, H, W]); one
#: image or a sequence of PIL images / file paths / arrays (read batch by batch); or any iterable
#: of tensors [b, 3, H, W] such as a DataLoader (``(x, y)`` pairs accepted).
Images = Union[torch.Tensor, ImageLike, Sequence[ImageLike], Iterable[torch.Tensor]]
#: The image formats vitlens reads, as file extensions: a folder's images, the app's uploads.
UPLOAD_TYPES: tuple[str, ...] = ("png", "jpg", "jpeg", "webp", "bmp", "tif", "tiff", "gif")
IMAGE_SUFFIXES: tuple[str, ...] = tuple(f".{t}" for t in UPLOAD_TYPES)
#: Largest image upload, in megabytes (the app's widget, its hint and the error all use it).
MAX_UPLOAD_MB = 20
SAMPLE_NAMES: tuple[str, ...] = ("astronaut", "coffee", "chelsea", "rocket")
_ALPHA_BACKGROUND = (255, 255, 255)


def find_image_files(spec: str, recursive: bool = False) -> list[Path]:
    """The image files named by a folder (its images, ``IMAGE_SUFFIXES``; with ``recursive`` those of
    its subfolders too), a glob pattern ("val/*/*.JPEG", ``**`` allowed) or a single file, sorted."""
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        files = _once(p for p in _glob_no_links(os.path.expanduser(spec)) if p.is_file())
        if not files:
            raise InvalidParameterError(f"No files match {spec!r}.")
        return files
    if path.is_dir():
        found = path.rglob("*") if recursive else path.iterdir()
        files = _once(p for p in found if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise InvalidParameterError(f"The folder {path} holds no images ({', '.join(IMAGE_SUFFIXES)}).")
        return files
    if path.is_file():
        return [path]
    raise InvalidParameterError(f"Image folder or file not found: {path}.")


def _glob_no_links(pattern: str) -> Iterator[Path]:
    """The paths a glob pattern matches, ``**`` included, without descending into symlinked folders (pathlib's
    rule: a symlink loop such as ``ln -s . self`` ends instead of recursing until the OS gives up)."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if any(ch in part for ch in "*?["))
    root = Path(*parts[:first]) if first else Path(".")
    rest = str(Path(*parts[first:]))
    return root.glob(rest) if root.is_dir() else iter(())


def _once(paths: Iterable[Path]) -> list[Path]:
    """Each file once (by its resolved path, the shortest name kept: ``a.png`` over ``self/a.png``), sorted."""
    by_target: dict[str, Path] = {}
    for p in sorted(paths, key=lambda q: (len(q.parts), str(q))):
        by_target.setdefault(os.path.realpath(p), p)
    return sorted(by_target.values())


def _composite(img: Image.Image) -> Image.Image:
    """Flatten transparency onto white, as an image viewer shows it on a white page."""
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, _ALPHA_BACKGROUND + (255,))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _array_to_uint8(a: np.ndarray, what: str) -> np.ndarray:
    """Scale an integer/float/bool array to uint8 by its dtype's natural range."""
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.bool_:
        return a.astype(np.uint8) * 255
    if a.dtype == np.uint16:
        return np.round(a.astype(np.float64) / 257.0).astype(np.uint8)
    if np.issubdtype(a.dtype, np.integer):
        if a.min() < 0:
            raise ImageLoadError(f"{what}: integer image with negative values; pass uint8 or uint16 pixels.")
        scale = 1.0 if a.max() <= 255 else 255.0 / 65535.0
        return np.clip(np.round(a * scale), 0, 255).astype(np.uint8)
    if np.issubdtype(a.dtype, np.floating):
        if not np.all(np.isfinite(a)):
            raise ImageLoadError(f"{what}: float image with NaN/inf values.")
        scale = 255.0 if a.max() <= 1.0 else 1.0
        return np.clip(np.round(a * scale), 0, 255).astype(np.uint8)
    raise ImageLoadError(f"{what}: unsupported pixel type {a.dtype}; pass uint8, uint16 or float in [0, 1].")


def _from_array(a: np.ndarray, what: str) -> Image.Image:
    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)  # channels-first
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] in (3, 4))) or min(a.shape[:2]) < 1:
        raise ImageLoadError(f"{what}: array of shape {a.shape} is not an image; expected HxW, HxWx3 or HxWx4.")
    a = _array_to_uint8(np.ascontiguousarray(a), what)
    if a.ndim == 2:
        return Image.fromarray(a, "L").convert("RGB")
    if a.shape[-1] == 4:
        return _composite(Image.fromarray(a, "RGBA"))
    return Image.fromarray(a, "RGB")


#: The most pixels vitlens decodes from one image file (36 MP, 6000 x 6000: ~108 MB as RGB). A JPEG above it
#: is decoded reduced (PIL's draft mode: 1/2, 1/4 or 1/8 scale) to fit; another format is refused before its
#: pixels are decoded, however small the file (a 13000 x 13000 PNG can be 0.5 MB).
MAX_DECODE_PIXELS = 36_000_000


def open_image(source: Path | IO[bytes], what: str, max_pixels: int = MAX_DECODE_PIXELS) -> Image.Image:
    """Decode a file (path or binary stream) fully, so corrupt or truncated data fails here, within a pixel
    budget, and turned upright by its EXIF orientation (as a photo viewer shows it).

    Args:
        max_pixels: the budget (``MAX_DECODE_PIXELS``); a JPEG above it is decoded reduced to fit.

    Raises:
        ImageLoadError: naming ``what``, for undecodable data or an image above the budget ("too large").
    """
    import warnings

    try:
        with warnings.catch_warnings():  # Pillow's bomb warning: the budget below is stricter, and said in words
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(source)
        with opened:
            w, h = opened.size
            if w * h > max_pixels and opened.format == "JPEG":
                scale = 1
                while scale < 8 and (w // scale) * (h // scale) > max_pixels:
                    scale *= 2
                opened.draft(opened.mode if opened.mode in ("RGB", "L") else "RGB", (w // scale, h // scale))
                w, h = opened.size
            if w * h > max_pixels:
                raise ImageLoadError(f"{what}: image too large to analyse safely ({w} x {h} = {w * h:,} pixels, "
                                     f"more than vitlens decodes: {max_pixels:,}). Downscale it first.")
            opened.load()
            img = opened.copy()
        return _upright(img)
    except ImageLoadError:  # (a ValueError) already says what was wrong: not "cannot read" a readable file
        raise
    except Image.DecompressionBombError as e:  # above twice Pillow's limit: refused by Pillow before its size is read
        import re

        found = re.search(r"(\d+) pixels", str(e))
        size = f"{int(found.group(1)):,} pixels" if found else "too many pixels"
        raise ImageLoadError(f"{what}: image too large to analyse safely ({size}, more than vitlens decodes: "
                             f"{max_pixels:,}). Downscale it first.") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageLoadError(f"Cannot read {what} as an image ({_reason(e, source)}). "
                             f"Pass a {', '.join(t.upper() for t in UPLOAD_TYPES if t not in ('jpeg', 'tif'))} "
                             "file.") from e


def _upright(img: Image.Image) -> Image.Image:
    """The image turned by its EXIF orientation tag (unchanged without one)."""
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(img) or img
    except Exception:  # a malformed EXIF block: the pixels as stored
        return img


def _reason(e: Exception, source: object) -> str:
    """PIL's complaint without the ``<_io.BytesIO object at 0x...>`` it names a stream by."""
    text = str(e)
    if not isinstance(source, (str, Path)):
        text = text.replace(f" {source!r}", "").replace(repr(source), "the data")
    return text


def to_rgb(img: ImageLike, what: str | None = None) -> Image.Image:
    """Any image-like -> an 8-bit RGB PIL image.

    Grayscale, palette, CMYK and YCbCr are converted; alpha is composited onto white; 16-bit and
    32-bit integer or float images are scaled by their range.

    Args:
        img: a PIL image, a file path, or an array (HxW, HxWx3, HxWx4; any integer or float dtype).
        what: how to name the image in an error message (default: its path or type).

    Returns:
        An 8-bit RGB PIL image.

    Raises:
        ImageLoadError: unreadable, corrupt, truncated or non-image input.
    """
    what = what or (str(img) if isinstance(img, (str, Path)) else type(img).__name__)
    if isinstance(img, (str, Path)):
        path = Path(img).expanduser()
        if not path.is_file():
            raise ImageLoadError(f"Image file not found: {path}.")
        img = open_image(path, str(path))
    if isinstance(img, np.ndarray):
        return _from_array(img, what)
    if not isinstance(img, Image.Image):
        raise ImageLoadError(f"{what}: not an image; pass PIL images, file paths or uint8 arrays.")
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        return _composite(img)
    if img.mode.startswith("I") or img.mode == "F":
        a = np.asarray(img)
        if img.mode.startswith("I;16") or (img.mode == "I" and a.max() > 255):
            a = a.astype(np.float64) / 65535.0
        elif img.mode == "I":
            a = a.astype(np.float64) / 255.0
        return _from_array(a.astype(np.float64), what)
    try:
        return img.convert("RGB")
    except (OSError, ValueError) as e:
        raise ImageLoadError(f"{what}: cannot convert mode {img.mode} to RGB ({e}).") from e


def preprocess(images: Any, data_config: dict[str, Any]) -> torch.Tensor:
    """Images -> [B, 3, H, W] float tensor with timm's eval transform for ``data_config``.

    Args:
        images: a tensor [B, 3, H, W] (returned as float), one image or a sequence of PIL images, file
            paths or arrays (HxW, HxWx3, HxWx4).
        data_config: timm's data config (``input_size``, ``mean``, ``std``, ``interpolation``, ``crop_pct``).

    Returns:
        A float32 tensor [B, 3, H, W], normalised with the config's mean and std.

    Raises:
        ImageLoadError: an image that cannot be read.
    """
    from timm.data import create_transform

    cfg: dict[str, Any] = {k: data_config[k] for k in ("input_size", "interpolation", "mean", "std", "crop_pct",
                                                         "crop_mode") if k in data_config}
    transform = create_transform(**cfg, is_training=False)
    items = [images] if isinstance(images, (Image.Image, str, Path, np.ndarray)) else list(images)
    if not items:
        raise InvalidParameterError("No images given: pass at least one image.")
    if isinstance(images, np.ndarray) and images.ndim == 4:
        items = list(images)
    tensors = []
    for i, item in enumerate(items):
        img = to_rgb(item, what=_describe(item, i))
        check_resized(img.size, cfg, _describe(item, i))
        tensors.append(transform(img))
    return torch.stack(tensors)


#: timm's crop_pct when a data config gives none (``timm.data.transforms_factory``'s DEFAULT_CROP_PCT)
_TIMM_CROP_PCT = 0.875


def resized_pixels(size: tuple[int, int], data_config: dict[str, Any]) -> int:
    """How many pixels timm's eval transform for ``data_config`` makes of a ``size`` (width, height) image before it
    crops: its default "center" mode scales the shorter side to ``input_size / crop_pct`` (a non-square input: the
    side that makes both fit), keeping the aspect ratio, so a 20000 x 1 image becomes 248 x 4,960,000; "squash" and
    "border" resize to the scale size itself."""
    side = tuple(data_config.get("input_size", (3, 224, 224)))[-2:]
    crop_pct = data_config.get("crop_pct") or _TIMM_CROP_PCT
    scale = [int(np.floor(x / crop_pct)) for x in side]
    if data_config.get("crop_mode") in ("squash", "border"):
        return scale[0] * scale[1]
    w, h = size
    ratio = max(scale[0] / h, scale[1] / w)  # ResizeKeepRatio's, and torchvision's Resize(s) for a square scale
    return int(round(h * ratio)) * int(round(w * ratio))


def check_resized(size: tuple[int, int], data_config: dict[str, Any], what: str) -> None:
    """Refuse, before the model's resize runs, an image it would make larger than ``MAX_DECODE_PIXELS`` (issue 62: a
    143-byte 20000 x 1 PNG was 4.9 GB in timm's resize; ``MAX_DECODE_PIXELS`` bounds the decode, not the resize).

    Raises:
        ImageLoadError: naming ``what``, its size and aspect ratio, and what to do.
    """
    pixels = resized_pixels(size, data_config)
    if pixels > MAX_DECODE_PIXELS:
        w, h = size
        raise ImageLoadError(f"{what}: image too elongated to analyse safely ({w} x {h} px, aspect ratio "
                             f"{max(w, h) / max(1, min(w, h)):.0f}:1): the model's resize would make it {pixels:,} "
                             f"pixels, more than vitlens allows ({MAX_DECODE_PIXELS:,}). Crop it nearer to square "
                             "first.")


def preprocess_masks(masks: np.ndarray, data_config: dict[str, Any]) -> np.ndarray:
    """Object masks [B, h, w] through the same resize and crop as their images -> bool [B, H, W].

    Nearest-neighbour resampling, so a mask stays a mask; masks already at the model's input size
    are returned as they are.
    """
    from timm.data import create_transform

    masks = np.asarray(masks, dtype=bool)
    size = tuple(data_config.get("input_size", (3, *masks.shape[-2:])))[-2:]
    if masks.shape[-2:] == size:
        return masks
    cfg = {k: data_config[k] for k in ("input_size", "crop_pct", "crop_mode") if k in data_config}
    transform = create_transform(**cfg, interpolation="nearest", mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
                                 is_training=False)
    return np.stack([transform(Image.fromarray(mk.astype(np.uint8) * 255).convert("RGB"))[0].numpy() > 0.5
                     for mk in masks])


def _describe(item: Any, i: int) -> str:
    return str(item) if isinstance(item, (str, Path)) else f"image {i} ({type(item).__name__})"


def count_images(images: Images) -> int | None:
    """How many images ``images`` holds, when that is known without reading them (None otherwise)."""
    if isinstance(images, torch.Tensor):
        return 1 if images.ndim == 3 else int(images.shape[0])
    if isinstance(images, np.ndarray):
        return 1 if images.ndim < 4 else int(images.shape[0])
    if isinstance(images, (Image.Image, str, Path)):
        return 1
    if isinstance(images, Sequence):
        return len(images)
    return None


def image_list(images: Images) -> list[Any] | torch.Tensor:
    """``images`` as a list of images (one image alone, a path, a [H, W, 3] array, become a list of one), or the
    tensor itself: for the analyses that index images one by one (the comparison and sanity tables)."""
    if isinstance(images, torch.Tensor):
        return images
    if isinstance(images, (Image.Image, str, Path)) or (isinstance(images, np.ndarray) and images.ndim < 4):
        return [images]
    return list(images)  # an iterable of images, read once here


def iter_batches(images: Images, data_config: dict[str, Any], batch_size: int) -> Iterator[torch.Tensor]:
    """Yield model-ready batches of at most ``batch_size`` images.

    ``images`` may be a preprocessed tensor [B, 3, H, W] (or [3, H, W]), a sequence of PIL
    images / paths / arrays (read batch by batch, so a long list of paths streams), or any
    iterable yielding tensors [b, 3, H, W] (e.g. a DataLoader; ``(x, y)`` pairs are accepted).
    """
    if batch_size < 1:
        raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}.")
    if isinstance(images, torch.Tensor):
        x = images.unsqueeze(0) if images.ndim == 3 else images
        if x.ndim != 4 or x.shape[1] not in (1, 3):
            raise InvalidParameterError(f"An image tensor must be [B, 3, H, W]; got shape {tuple(images.shape)}.")
        for i in range(0, x.shape[0], batch_size):
            yield x[i : i + batch_size]
        return
    if isinstance(images, (Image.Image, str, Path)) or (isinstance(images, np.ndarray) and images.ndim < 4):
        images = [images]
    if isinstance(images, (Sequence, np.ndarray)):
        if len(images) == 0:
            raise InvalidParameterError("No images given: pass at least one image.")
        for i in range(0, len(images), batch_size):
            chunk = images[i : i + batch_size]
            tensors = [c for c in chunk if isinstance(c, torch.Tensor)]
            if len(tensors) == len(chunk):
                yield torch.stack([c if c.ndim == 3 else c[0] for c in tensors])
            else:
                yield preprocess(list(chunk), data_config)
        return
    if isinstance(images, Iterable):
        seen = False
        for item in images:
            if isinstance(item, (tuple, list)) and item and isinstance(item[0], torch.Tensor):
                item = item[0]
            seen = True
            if isinstance(item, torch.Tensor):
                yield from iter_batches(item, data_config, batch_size)
            else:
                yield preprocess([item], data_config)
        if not seen:
            raise InvalidParameterError("No images given: the iterable was empty.")
        return
    raise InvalidParameterError(f"Cannot read images from a {type(images).__name__}; pass a tensor, a list of "
                                "PIL images / paths / arrays, or an iterable of tensors.")


def sample_images(names: Sequence[str] = SAMPLE_NAMES) -> list[Image.Image]:
    """Natural photographs shipped with scikit-image (no download), as RGB PIL images.

    Each image carries its name in ``img.info["name"]``. Available: astronaut, coffee, chelsea,
    rocket.

    Args:
        names: which photographs, in order.

    Returns:
        The images as RGB PIL images (no download).

    Raises:
        InvalidParameterError: a name that is not one of the four.
    """
    import skimage.data

    out = []
    for name in names:
        if name not in SAMPLE_NAMES:
            raise InvalidParameterError(f"Unknown sample image {name!r}; choose from {', '.join(SAMPLE_NAMES)}.")
        img = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
        img.info["name"] = name
        out.append(img)
    return out


#: An image narrower or shorter than this is analysed with a warning (``tiny_image_warning``): it is enlarged
#: many times to the model's input, so its maps show the interpolation more than the image.
TINY_IMAGE_PX = 16


def tiny_image_warning(name: str, size: tuple[int, int]) -> str:
    """The one warning for an image below ``TINY_IMAGE_PX`` a side (the CLI and the app print it).

    Args:
        name: how to name the image (its file name).
        size: (width, height) in pixels.

    Returns:
        The warning, or "" for an image large enough.
    """
    if min(size) >= TINY_IMAGE_PX:
        return ""
    return (f"{name} ({size[0]}x{size[1]} px) is smaller than {TINY_IMAGE_PX} px: it is enlarged to the model's "
            "input, so its maps show the interpolation more than the image")


def display_image(x: torch.Tensor, data_config: dict[str, Any]) -> np.ndarray:
    """Undo the normalisation of one preprocessed image [3, H, W] -> uint8 [H, W, 3] for overlays."""
    mean = torch.tensor(data_config.get("mean", (0.0, 0.0, 0.0)), dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(data_config.get("std", (1.0, 1.0, 1.0)), dtype=torch.float32).view(-1, 1, 1)
    img = (x.detach().float().cpu() * std + mean).clamp(0, 1)
    if img.shape[0] == 1:
        img = img.expand(3, -1, -1)
    return (img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


ImageFile.LOAD_TRUNCATED_IMAGES = False

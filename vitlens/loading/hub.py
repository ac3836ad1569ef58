"""Pretrained weights from the Hugging Face hub: cached files first, then a fast offline check.

timm's own download retries for about a minute when there is no network. vitlens looks in
the local cache first and, when the weights are not there, checks that the hub can be
reached within a few seconds before handing over to timm, so that an offline machine gets
a clear message at once instead of a long hang.
"""
from __future__ import annotations

import concurrent.futures
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..errors import WeightsUnavailableError

_CANDIDATE_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors",
                    "open_clip_pytorch_model.bin")
PROBE_TIMEOUT_S = 3.0


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE asks for no network access."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_weights_file(pretrained_cfg: dict, cache_dir: str | None = None) -> Path | None:
    """The path of this checkpoint's weights in the local hub (or torch hub) cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    hub_id = pretrained_cfg.get("hf_hub_id")
    if hub_id:
        repo, _, revision = hub_id.partition("@")
        names = [pretrained_cfg["hf_hub_filename"]] if pretrained_cfg.get("hf_hub_filename") else []
        for filename in names + [n for n in _CANDIDATE_FILES if n not in names]:
            found = try_to_load_from_cache(repo, filename, cache_dir=cache_dir, revision=revision or None)
            if isinstance(found, str) and Path(found).is_file():
                return Path(found)
    url = pretrained_cfg.get("url")
    if url:
        import torch.hub

        legacy = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name
        if legacy.is_file():
            return legacy
    return None


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S, url: str | None = None) -> bool:
    """Whether a TCP connection to the hub endpoint (or to ``url``'s host) opens within ``timeout_s`` seconds."""
    from huggingface_hub import constants

    parsed = urlparse(url or str(getattr(constants, "ENDPOINT", "https://huggingface.co")))
    host, port = parsed.hostname or "huggingface.co", parsed.port or (443 if parsed.scheme == "https" else 80)

    def connect() -> bool:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(connect).result(timeout=timeout_s)
    except (OSError, concurrent.futures.TimeoutError):
        return False
    finally:
        pool.shutdown(wait=False)  # a hanging DNS lookup must not hold the caller


def resolve_pretrained_source(name: str, pretrained_cfg: dict) -> Path | None:
    """Where the pretrained weights of ``name`` will come from.

    Returns the cached file when there is one, None when timm should download them.

    Raises:
        WeightsUnavailableError: not cached, and offline (HF_HUB_OFFLINE or hub unreachable).
    """
    cached = cached_weights_file(pretrained_cfg)
    if cached is not None:
        return cached
    if not (pretrained_cfg.get("hf_hub_id") or pretrained_cfg.get("url")):
        raise WeightsUnavailableError(f"timm has no pretrained weights for {name!r}. Use pretrained=False "
                                      "or pass a checkpoint file with arch=.")
    why = "HF_HUB_OFFLINE is set" if hub_offline() else None
    if why is None and not hub_reachable():
        why = "the Hugging Face hub cannot be reached (no network)"
    if why is not None:
        where = pretrained_cfg.get("hf_hub_id") or pretrained_cfg.get("url")
        arch = name.split(".")[0]
        raise WeightsUnavailableError(
            f"The pretrained weights of {name!r} could not be downloaded: {why}, and they are not in the local "
            f"cache. Download them where there is network ({where}) and pass the file;",
            fixes={"python": f"vl.load_model('path/to/model.safetensors', arch={arch!r}). Or try the embedded "
                             "models 'ref-vit' / 'ref-hybrid', or pretrained=False for random weights.",
                   "cli": f"--model path/to/model.safetensors --arch {arch}. Or try --model ref-vit, or add "
                          "--random-init for random weights.",
                   "app": f"choose the Checkpoint source with that file and the architecture {arch}. Or pick an "
                          "Embedded model, or untick 'Pretrained weights' for random weights."})
    return None

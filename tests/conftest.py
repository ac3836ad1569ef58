"""Shared fixtures. Tests never touch the network: HF_HUB_OFFLINE is set before anything imports
huggingface_hub, and models are random-init timm architectures or the embedded reference pair."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@functools.lru_cache(maxsize=16)
def _cached_model(name: str, kwargs_items: tuple) -> object:
    import vitlens as vl

    torch.manual_seed(0)
    return vl.load_model(name, pretrained=False, device="cpu", **dict(kwargs_items))


def get_model(name: str, **kwargs: object):
    """A random-init model, built once per test session (never modify it in a test)."""
    return _cached_model(name, tuple(sorted(kwargs.items())))


@pytest.fixture(scope="session")
def tiny():
    return get_model("vit_tiny_patch16_224")


@pytest.fixture()
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)

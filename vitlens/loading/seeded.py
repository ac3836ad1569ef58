"""Random-init weights as a function of (name, seed): what a long-lived process that caches models
by name (the Streamlit app) loads through, so that a model evicted and loaded again has the very
weights the results cached beside its name were computed on (the CLI seeds the same way, ``--seed``)."""
from __future__ import annotations

from typing import Any

import torch

from .model import LoadedModel
from .resolve import load_model

#: the seed of random-init weights (the CLI's ``--seed`` default)
RANDOM_INIT_SEED = 0


def load_model_seeded(name: str, pretrained: bool = True, seed: int = RANDOM_INIT_SEED, **kwargs: Any) -> LoadedModel:
    """``load_model`` with torch's CPU random generator seeded with ``seed`` for the load and then put
    back as it was (the caller's random stream is untouched): random-init weights (``pretrained=False``,
    ``open_clip:ARCH`` without a tag, a Hugging Face config) are the same on every load; pretrained ones
    do not depend on it. Arguments are ``load_model``'s."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return load_model(name, pretrained=pretrained, **kwargs)


__all__ = ["RANDOM_INIT_SEED", "load_model_seeded"]

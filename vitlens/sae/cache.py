"""An optional on-disk float16 cache of a site's selected tokens, within a byte budget the user sets: the SAE's later
epochs read what it holds instead of running the model again (docs/definitions.md, "Sparse autoencoder"; saev writes
every activation first, ~723 GB for one layer of ViT-B/16 over ImageNet-1k: here nothing beyond the budget is
written, and a batch that does not fit is computed again by the next epoch's forward).

The cache is one file in a private temporary folder, removed when the cache closes (on error too).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidParameterError


def check_cache_bytes(cache_bytes: object) -> int:
    """``cache_bytes`` as an int >= 0, refused in one line otherwise."""
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, (int, np.integer)) or cache_bytes < 0:
        raise InvalidParameterError(f"cache_bytes is the on-disk cache's budget in bytes, an integer >= 0 (0: no "
                                    f"cache); got {cache_bytes!r}.")
    return int(cache_bytes)


class ActivationCache:
    """Batches of tokens [N, d] kept on disk as float16, in the order added, up to ``budget`` bytes in all.

    Args:
        budget: the most bytes the cache may write.
        folder: where its temporary folder goes (None: the system's temporary folder).
    """

    def __init__(self, budget: int, folder: str | Path | None = None) -> None:
        self.budget = check_cache_bytes(budget)
        self.used = 0
        self._dir: Path | None = None
        self._folder = folder
        self._spans: dict[int, tuple[int, tuple[int, int]]] = {}  # batch index -> (byte offset, shape)

    def __enter__(self) -> "ActivationCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def path(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="vitlens-sae-cache-", dir=self._folder))
        return self._dir / "tokens.f16"

    def add(self, index: int, tokens: torch.Tensor) -> bool:
        """Keep batch ``index``'s tokens [N, d] when they fit the budget; whether they were kept."""
        if self.budget <= 0 or self.used + tokens.numel() * 2 > self.budget:  # float16: 2 bytes a value
            return False
        data = tokens.detach().to("cpu", torch.float16).contiguous().numpy()
        with open(self.path, "ab") as f:
            f.write(data.tobytes())
        self._spans[index] = (self.used, (int(data.shape[0]), int(data.shape[1])))
        self.used += data.nbytes
        return True

    def __contains__(self, index: int) -> bool:
        return index in self._spans

    def __len__(self) -> int:
        return len(self._spans)

    def get(self, index: int) -> torch.Tensor:
        """Batch ``index``'s tokens, float32 [N, d] (the float16 values the cache holds)."""
        offset, shape = self._spans[index]
        count = shape[0] * shape[1]
        data = np.fromfile(self.path, dtype=np.float16, count=count, offset=offset)
        return torch.from_numpy(data.reshape(shape).astype(np.float32))

    def close(self) -> None:
        """Remove the cache's folder."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._spans.clear()
        self.used = 0


__all__ = ["ActivationCache", "check_cache_bytes"]

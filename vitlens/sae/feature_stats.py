"""What ``vl.sae_features`` gathers from each batch (docs/definitions.md, "SAE feature views"): a consumer of the
engine's stream (``vitlens.engine.stream``) that reads the SAE's site, each writing head's output before its
projection (``blocks.{i}.attn.hook_z``) and the residual entering the final norm (``ln_final.hook_in``) through one
``SiteSession``, in the same forward as the attention the distance view reads. Nothing is kept beyond a batch but the
running sums and each shown feature's best images so far.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..engine.consumer import AttentionConsumer, BatchInfo
from ..engine.sites import HookPoint, SiteSession
from ..errors import UnsupportedModelError
from .activations import select_tokens

#: edges of the activation histogram (log-spaced: an SAE's activations span decades); values outside fall in the
#: first or last bin, and zeros (the feature off) are not counted
HIST_EDGES = np.logspace(-3.0, 3.0, 31)
#: numbers of [images x tokens x features] encoded at once (the code of a whole batch of a wide SAE is large)
CODE_CHUNK = 1 << 24


@dataclass
class WriterBlock:
    """One block whose heads can write the SAE's site: its heads' site, output projection and layer scale.

    Attributes:
        layer: the block (0-based).
        site: its ``blocks.{layer}.attn.hook_z`` site's name.
        w_o: [D, H * dh] the output projection's weight.
        gamma: [D] the attention branch's layer scale, or None.
        heads: heads of the block.
    """

    layer: int
    site: str
    w_o: torch.Tensor
    gamma: torch.Tensor | None
    heads: int


class FeatureStats(AttentionConsumer):
    """Running statistics of every feature of an SAE over a stream of images, and of the features ``shown``: their
    top images (the activation over the token grid) and the heads that write them.

    Args:
        sae: the SparseAutoencoder (its ``config.site`` and ``config.tokens`` say what it reads).
        points: the named sites read: the SAE's site, the writer blocks' ``attn.hook_z``, ``ln_final.hook_in`` when
            the logit effect is read.
        model: the module the sites are on (its lock is held for the stream).
        prefix: prefix tokens before the patches at the site.
        shown: [K] the features whose top images and writers are kept.
        top: images kept per shown feature.
        writers: the blocks whose heads are projected on the encoder directions.
        num_classes: classes of the labels (0: no labels).
        read_token: the final-norm input token the head reads (its sigma is held: the logit effect), or None.
        eps: the final norm's epsilon (its sigma is ``sqrt(var + eps)``).
    """

    reads_every_kind = True  # it reads sites, not attention maps

    def __init__(self, sae: nn.Module, points: dict[str, HookPoint], model: nn.Module, prefix: int,
                 shown: np.ndarray, top: int, writers: list[WriterBlock], num_classes: int,
                 read_token: int | None, eps: float = 1e-6) -> None:
        self.sae, self.points, self.model, self.prefix = sae, points, model, int(prefix)
        self.site, self.tokens = sae.config.site, sae.config.tokens
        f = int(sae.config.n_features)
        self.shown = torch.as_tensor(shown, dtype=torch.long)
        self.top, self.writers, self.read_token, self.eps = int(top), writers, read_token, float(eps)
        self.seen: dict[str, torch.Tensor] = {}
        self.n_images = self.n_tokens = 0
        self.grid: tuple[int, int] | None = None
        self.active = torch.zeros(f, dtype=torch.float64)
        self.total = torch.zeros(f, dtype=torch.float64)
        self.hist = torch.zeros(f, len(HIST_EDGES) - 1, dtype=torch.float64)
        self.cells: torch.Tensor | None = None  # [F, gh * gw] summed over images
        self.class_sum = torch.zeros(f, max(num_classes, 0), dtype=torch.float64)
        self.class_images = torch.zeros(max(num_classes, 0), dtype=torch.float64)
        k = len(self.shown)
        self.top_values = torch.full((k, self.top), -1.0, dtype=torch.float64)
        self.top_index = torch.full((k, self.top), -1, dtype=torch.long)
        self.top_maps: torch.Tensor | None = None  # [K, top, gh * gw]
        heads = sum(w.heads for w in writers)
        self.write_active = torch.zeros(k, heads, dtype=torch.float64)
        self.write_all = torch.zeros(k, heads, dtype=torch.float64)
        self.write_tokens = 0
        self.write_on = torch.zeros(k, dtype=torch.float64)  # [K] read tokens where each shown feature fired
        self.sigma_sum = 0.0
        self.batch: BatchInfo | None = None

    def hooks(self) -> contextlib.AbstractContextManager:
        """The session that keeps each named site's value of the batch's forward (read only)."""
        def keep(name: str, value: Any) -> None:
            # a copy: under the views' capture a block's buffers are reused by the next block (engine.stream)
            self.seen[name] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        return SiteSession(self.model, self.points, keep)

    def begin_batch(self, batch: BatchInfo) -> None:
        self.batch = batch
        self.seen = {}

    def end_batch(self, logits: torch.Tensor | None = None) -> None:
        batch = self.batch
        assert batch is not None, "end_batch before begin_batch"  # the engine calls begin_batch first
        value = self.seen.get(self.site)
        if not isinstance(value, torch.Tensor) or value.ndim != 3:
            raise UnsupportedModelError(f"site {self.site!r} gave no [B, T, D] tokens in this forward.")
        acts = value.float()
        b, t, _ = acts.shape
        gh, gw = batch.grid
        if t - self.prefix != gh * gw:
            raise UnsupportedModelError(f"site {self.site!r} holds {t} tokens; {self.prefix} prefix tokens and a "
                                        f"{gh}x{gw} grid make {self.prefix + gh * gw}.")
        self.grid = (gh, gw)
        if self.cells is None:
            self.cells = torch.zeros(self.active.shape[0], gh * gw, dtype=torch.float64)
            self.top_maps = torch.zeros(len(self.shown), self.top, gh * gw, dtype=torch.float64)
        f = self.active.shape[0]
        step = max(1, CODE_CHUNK // max(1, t * f))
        for lo in range(0, b, step):
            self._codes(acts[lo:lo + step], batch, lo)
        self._writes(batch)
        if self.read_token is not None and "ln_final.hook_in" in self.seen:
            x = self.seen["ln_final.hook_in"][:, self.read_token].double()
            self.sigma_sum += float(torch.sqrt(x.var(-1, unbiased=False) + self.eps).sum())
        self.n_images += b
        self.seen = {}

    def _codes(self, acts: torch.Tensor, batch: BatchInfo, lo: int) -> None:
        """Every statistic of the code of images ``lo ..`` of the batch (``acts`` [b, T, D])."""
        b, t, d = acts.shape
        with torch.no_grad():
            z = self.sae.encode(acts.reshape(b * t, d).to(self.sae.W_enc.dtype)).reshape(b, t, -1).double().cpu()
        read = select_tokens(z, self.prefix, self.tokens)  # [b * T', F]
        self.n_tokens += read.shape[0]
        on = read > 0
        self.active += on.sum(0)
        self.total += read.sum(0)
        values = read[on]
        if values.numel():
            bins = torch.bucketize(values, torch.as_tensor(HIST_EDGES[1:-1]))
            feature = on.nonzero()[:, 1]
            self.hist.view(-1).index_add_(0, feature * self.hist.shape[1] + bins, torch.ones_like(values))
        patches = z[:, self.prefix:]  # [b, P, F]
        assert self.cells is not None and self.top_maps is not None  # made at the first batch
        self.cells += patches.sum(0).T
        per_image = read.reshape(b, -1, read.shape[-1])
        if self.class_sum.shape[1] and batch.labels is not None:
            labels = torch.as_tensor(np.asarray(batch.labels)[lo:lo + b], dtype=torch.long)
            self.class_sum.index_add_(1, labels, per_image.mean(1).T)
            self.class_images.index_add_(0, labels, torch.ones(b, dtype=torch.float64))
        if not len(self.shown):
            return
        score = per_image[..., self.shown].amax(1).T  # [K, b]: each image's largest activation of the feature
        maps = patches[..., self.shown].permute(2, 0, 1)  # [K, b, P]
        index = torch.arange(batch.start + lo, batch.start + lo + b).expand(len(self.shown), b)
        values = torch.cat([self.top_values, score], 1)
        best = values.topk(self.top, dim=1).indices
        self.top_values = values.gather(1, best)
        self.top_index = torch.cat([self.top_index, index], 1).gather(1, best)
        self.top_maps = torch.cat([self.top_maps, maps], 1).gather(1, best[..., None].expand(-1, -1, maps.shape[-1]))

    def _writes(self, batch: BatchInfo) -> None:
        """Each writer head's output at the read tokens, projected on the shown features' encoder directions: summed
        over every read token, and over the tokens where the feature fires."""
        if not self.writers or not len(self.shown):
            return
        acts = self.seen[self.site].float()
        with torch.no_grad():
            z = self.sae.encode(select_tokens(acts, self.prefix, self.tokens).to(self.sae.W_enc.dtype))
            on = (z[:, self.shown] > 0).double().cpu()  # [N, K]
            w_enc = self.sae.W_enc.detach().double()[:, self.shown]  # [D, K]
            column = 0
            for w in self.writers:
                heads = select_tokens(self.seen[w.site].double(), self.prefix, self.tokens)  # [N, H * dh]
                dh = heads.shape[-1] // w.heads
                for h in range(w.heads):
                    write = heads[:, h * dh:(h + 1) * dh] @ w.w_o[:, h * dh:(h + 1) * dh].T  # [N, D]
                    if w.gamma is not None:
                        write = write * w.gamma
                    along = (write @ w_enc).cpu()  # [N, K]
                    self.write_all[:, column] += along.sum(0)
                    self.write_active[:, column] += (along * on).sum(0)
                    column += 1
            self.write_tokens += int(on.shape[0])
            self.write_on += on.sum(0)

    def result(self, spec: Any) -> Any:
        raise NotImplementedError("FeatureStats is read by vitlens.sae.features, which builds the result.")

    def merge(self, other: "FeatureStats") -> "FeatureStats":
        raise NotImplementedError("sae_features runs in one process; its statistics are not merged.")


__all__ = ["CODE_CHUNK", "FeatureStats", "HIST_EDGES", "WriterBlock"]

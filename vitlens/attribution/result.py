"""The result every attribution method gives (``vitlens.attribute``): maps on one contract, [B, gh, gw] on the token
grid (or a stage's grid for the CAMs of a hierarchical model), with the targets explained and the time they took;
what the faithfulness metrics score and the figures draw (rollout beside class-specific methods, paper Fig. 6)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.resample import upsample_map
from ..results import Result
from ..words import counted


@dataclass(eq=False, repr=False)
class AttributionResult(Result):
    """Maps of one method over a batch of images.

    Attributes:
        method: one of ``METHODS``.
        maps: [B, gh, gw] float64 on the patch-token grid (signed for gradient methods; larger =
            more evidence for the target).
        targets: [B] class explained (the predicted class unless given).
        grid: (gh, gw); image_size: (H, W) input pixels.
        seconds_per_image: wall time of the maps (``attribute``'s loop: preprocessing, forwards, backwards)
            divided by B, the method's first call in the process included (one-time setup shows there).
        params: the method's parameters.
        note: what the map means for this method/model (e.g. class-agnostic, no class token).
        model_name: the model's name.
        label_names: the model's class names (empty when it has none), for ``target_name``; for a text
            target, the distinct prompts, which ``targets`` index.
        target_kind: "class", or "text" when a prompt was explained (``vitlens.attribution.text``).
        text_embeddings: for a text target, [P, D] float32 unit text embeddings of the
            prompts (what deletion / insertion score against); None otherwise.
        stride_px: (sy, sx) pixels between the map's cells: the patch stride for maps on the patch-token grid,
            a stage's stride for CAMs on a hierarchical model's stage (the last stage's: 32 px on a 224 px Swin,
            ``grid`` 7x7 where the patch grid is 56x56); None in files of an older vitlens (the model's patch
            stride). The perturbation metrics remove whole cells of this size (``cell_px``).
    """

    kind = "attribution"
    method: str
    maps: np.ndarray
    targets: np.ndarray
    grid: tuple[int, int]
    image_size: tuple[int, int]
    seconds_per_image: float
    params: dict = field(default_factory=dict)
    note: str = ""
    model_name: str = ""
    label_names: list = field(default_factory=list)
    target_kind: str = "class"
    text_embeddings: np.ndarray | None = None
    stride_px: tuple | None = None

    def target_name(self, index: int) -> str:
        """The class (or prompt) explained for image ``index`` in words: 'ring', 'a photo of a dog', or 'class 4'
        without names."""
        t = int(self.targets[index])
        if 0 <= t < len(self.label_names):
            return self.label_names[t]
        return f"class {t}" if t >= 0 else "no class (the model has no classifier head)"

    def summary(self) -> str:
        prompt = f" for {self.label_names[0]!r}" if self.target_kind == "text" and len(self.label_names) == 1 else ""
        return (f"{self.model_name or 'model'}: {self.method} maps of {counted(len(self.maps), 'image')}{prompt} on "
                f"{self.grid[0]}x{self.grid[1]}, {self.seconds_per_image:.3f} s/image")

    def to_rows(self) -> list[dict]:
        """One row per (image, patch row, patch column), 0-based: the map's value, with the target."""
        b, gh, gw = self.maps.shape
        return [{"method": self.method, "image": i, "target": int(self.targets[i]), "row": r, "col": c,
                 "value": float(self.maps[i, r, c])} for i in range(b) for r in range(gh) for c in range(gw)]

    def cell_px(self, patch_stride: tuple[int, int]) -> tuple[int, int]:
        """(sy, sx) pixels of one map cell: ``stride_px``, or ``patch_stride`` (the model's) where it is None."""
        sy, sx = self.stride_px or patch_stride
        return int(sy), int(sx)

    def upsampled(self) -> np.ndarray:
        """[B, H, W] maps resized (bilinear) to the input size, for display."""
        return np.stack([upsample_map(mp, self.image_size) for mp in self.maps])


__all__ = ["AttributionResult"]

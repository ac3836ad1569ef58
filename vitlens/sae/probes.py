"""Linear probes per layer (docs/definitions.md, "Linear probes"): how linearly the image's class can be read from
each block's output, from the class token and from the mean patch token, as Raghu et al. (2021, "Do Vision
Transformers See Like Convolutional Neural Networks?", Fig. 11) read their ViTs.

Every block's output (``blocks.{i}.hook_resid_post``) is read from one forward per batch (``iter_sites``): per image
the class token's row and the mean of the patch tokens' rows, nothing else kept. A seeded split holds out
``test_fraction`` of the images; scikit-learn's ``LogisticRegression`` (on standardised features) is fitted on the
rest at each block, and its accuracy on the held-out images is the figure.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..images import Images, count_images
from ..loading.model import LoadedModel
from ..progress import Progress, ProgressArg
from ..results import Result
from .activations import check_images_model, iter_sites
from .trainer import check_positive


@dataclass(eq=False, repr=False)
class LinearProbeResult(Result):
    """Held-out accuracy of a linear probe at every block.

    Attributes:
        blocks: [L] the blocks probed (0-based; block i's output).
        class_token_accuracy: [L] the probe on the class token (NaN without a class token).
        mean_patch_accuracy: [L] the probe on the mean of the patch tokens.
        chance: the held-out share of the most frequent training class (what a probe that learned nothing gets).
        n_train: images the probes were fitted on.
        n_test: held-out images.
        n_classes: classes among the labels.
        C: the inverse regularisation strength of the logistic regression.
        model_name: the model's name.
    """

    kind = "linear_probes"
    blocks: np.ndarray
    class_token_accuracy: np.ndarray
    mean_patch_accuracy: np.ndarray
    chance: float
    n_train: int
    n_test: int
    n_classes: int
    C: float = 1.0
    model_name: str = ""

    def summary(self) -> str:
        best = int(np.nanargmax(self.mean_patch_accuracy))
        cls = (f", class token best {np.nanmax(self.class_token_accuracy):.1%} at block "
               f"{int(self.blocks[int(np.nanargmax(self.class_token_accuracy))]) + 1}"
               if np.isfinite(self.class_token_accuracy).any() else ", no class token")
        return (f"{self.model_name or 'model'}: linear probes over {len(self.blocks)} blocks on {self.n_test} held-out "
                f"images ({self.n_classes} classes, chance {self.chance:.1%}): mean patch token best "
                f"{self.mean_patch_accuracy[best]:.1%} at block {int(self.blocks[best]) + 1}{cls}")

    def to_rows(self) -> list[dict]:
        """One row per block (1-based): both probes' held-out accuracy and chance."""
        return [{"block": int(b) + 1, "class_token_accuracy": float(c), "mean_patch_accuracy": float(p),
                 "chance": float(self.chance)}
                for b, c, p in zip(self.blocks, self.class_token_accuracy, self.mean_patch_accuracy)]


def probe_accuracy(train: np.ndarray, y_train: np.ndarray, test: np.ndarray, y_test: np.ndarray, C: float,
                   max_iter: int, seed: int) -> float:
    """Held-out accuracy of a logistic regression on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=max_iter, random_state=seed))
    probe.fit(train, y_train)
    return float((probe.predict(test) == y_test).mean())


def held_out_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) image indices: a seeded split, stratified by class where every class has two images."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    _, counts = np.unique(labels, return_counts=True)
    stratify = labels if counts.min() >= 2 else None
    train, test = train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=stratify)
    return np.sort(train), np.sort(test)


def linear_probes(m: LoadedModel, images: Images, labels: np.ndarray | list, blocks: list[int] | None = None,
                  test_fraction: float = 0.25, C: float = 1.0, max_iter: int = 2000, seed: int = 0,
                  batch_size: int = 16, progress: ProgressArg = None) -> LinearProbeResult:
    """Linear probes of the image's class at every block: the class token and the mean patch token, accuracy on a
    held-out split (docs/definitions.md, "Linear probes"; Raghu et al. 2021).

    Args:
        m: the model.
        images: the images (tensor, sequence of PIL images / paths / arrays, or iterable of tensors).
        labels: [N] one class label per image.
        blocks: the blocks to probe (0-based; default every block).
        test_fraction: the share of images held out, in (0, 1).
        C: the logistic regression's inverse regularisation strength.
        max_iter: the logistic regression's iterations.
        seed: the split's seed.
        batch_size: images per forward.
        progress: True for a bar, or a callable ``f(done, total)`` (images).

    Returns:
        A ``LinearProbeResult`` (its figure: ``vitlens.figures.probes_figure``).
    """
    check_images_model(m)
    y = np.asarray(labels)
    n = count_images(images)
    if y.ndim != 1 or (n is not None and len(y) != n):
        raise InvalidParameterError(f"labels must give one class per image ({n} images); got shape {y.shape}.")
    if len(np.unique(y)) < 2:
        raise InvalidParameterError("labels must hold at least two classes: a probe separates classes.")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise InvalidParameterError(f"test_fraction is the share of images held out, in (0, 1); got {test_fraction!r}.")
    check_positive("C", C)
    check_positive("max_iter", max_iter, integer=True)
    check_positive("batch_size", batch_size, integer=True)
    depth = m.spec.num_layers
    chosen = list(range(depth)) if blocks is None else [int(b) for b in blocks]
    bad = [b for b in chosen if not 0 <= b < depth]
    if bad or not chosen:
        raise InvalidParameterError(f"blocks are 0-based block indices of {m.spec.name}, from 0 to {depth - 1}; got "
                                    f"{blocks!r}.")
    train, test = held_out_split(y, float(test_fraction), seed)
    if len(test) < 1 or len(train) < 2:
        raise InvalidParameterError(f"{len(y)} images split at test_fraction={test_fraction} leave no held-out image "
                                    "or too few to fit: give more images.")
    sites = [f"blocks.{b}.hook_resid_post" for b in chosen]
    cls_rows: list[torch.Tensor] = []
    mean_rows: list[torch.Tensor] = []
    has_cls = bool(m.spec.has_class_token)
    with Progress(progress, len(y), "linear probes") as bar, torch.no_grad():
        for seen in iter_sites(m, images, sites, batch_size):
            stack = [seen[s] for s in sites]
            mean_rows.append(torch.stack([b.acts[:, b.prefix:].mean(1) for b in stack], 1).double().cpu())
            if has_cls:
                cls_rows.append(torch.stack([b.acts[:, 0] for b in stack], 1).double().cpu())
            bar.update(stack[0].start + int(stack[0].acts.shape[0]))
    means = torch.cat(mean_rows).numpy()  # [N, L, d]
    if len(means) != len(y):
        raise InvalidParameterError(f"labels must give one class per image: {len(means)} images, {len(y)} labels.")
    cls = torch.cat(cls_rows).numpy() if has_cls else None
    values, counts = np.unique(y[train], return_counts=True)
    chance = float((y[test] == values[np.argmax(counts)]).mean())

    def accuracy(features: np.ndarray | None, i: int) -> float:
        if features is None:
            return float("nan")
        return probe_accuracy(features[train, i], y[train], features[test, i], y[test], float(C), int(max_iter),
                              seed)
    return LinearProbeResult(
        blocks=np.asarray(chosen), class_token_accuracy=np.array([accuracy(cls, i) for i in range(len(chosen))]),
        mean_patch_accuracy=np.array([accuracy(means, i) for i in range(len(chosen))]), chance=chance,
        n_train=len(train), n_test=len(test), n_classes=int(len(np.unique(y))), C=float(C), model_name=m.spec.name)


__all__ = ["LinearProbeResult", "held_out_split", "linear_probes", "probe_accuracy"]

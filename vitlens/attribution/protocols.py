"""The perturbation metrics' protocols, by name: vitlens's token default beside each paper's own procedure.

One registry, ``PROTOCOLS``, is the source of what a protocol name means; ``perturbation_test``,
``road`` and ``deletion_insertion`` take ``protocol=`` and record it (and the ordering) on their result.

- Chefer et al. 2021 ("Transformer Interpretability Beyond Attention Visualization", section 4.2,
  Tables 1-2), ``chefer2021``: the map is upsampled bilinearly to the input (their
  ``interpolate(scale_factor=16, mode="bilinear")``), the top-k pixels of the map (negative: of its
  negation) are set to 0 before normalisation, k = floor(HW x f) for f = 0, 0.1, .., 0.9.
- Petsiuk et al. 2018 ("RISE", section 4.1, Fig. 4), ``petsiuk2018``: pixel order of the upsampled map,
  W pixels (one image row's worth, their ``step=224`` at 224 px) per step, H steps; deletion moves pixels
  to 0 in the normalised input (their ``torch.zeros_like``), insertion starts from the image blurred by
  their 11x11 kernel of sigma 5 and copies pixels back; the score is the target's probability; the AUC is
  the trapezoid over i / n_steps (their ``auc``).
- Rong et al. 2022 ("A Consistent and Efficient Evaluation Strategy for Attribution Methods", ROAD),
  ``rong2022``: the map's pixels (upsampled) ranked, removed at 10% .. 90% and filled by noisy linear
  imputation (noise 0.01).
- ``vitlens`` (every metric's default): whole patch tokens ranked by the map's value, the unit every map
  of ``vitlens.attribution`` is computed on (a half-removed patch is a token the model never saw).

Ordering (``ORDERINGS``): "signed" ranks by the map's value (the papers' way: their maps are
non-negative, so value and magnitude agree), "absolute" by its magnitude |R|, which for signed maps
(AttnLRP, integrated gradients) keeps strongly negative tokens out of "least relevant first".
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidParameterError

ORDERINGS = ("signed", "absolute")


@dataclass(frozen=True)
class Protocol:
    """One metric's removal procedure.

    Attributes:
        metric: "perturbation", "road" or "deletion_insertion".
        name: the protocol's name ("vitlens", "chefer2021", "petsiuk2018", "rong2022").
        granularity: "token" (whole patches) or "pixel" (the bilinearly upsampled map's pixels).
        ordering: the default ordering ("signed" or "absolute").
        source: the paper (and figure or table) the procedure follows.
    """

    metric: str
    name: str
    granularity: str
    ordering: str
    source: str


PROTOCOLS: dict[tuple[str, str], Protocol] = {(p_.metric, p_.name): p_ for p_ in (
    Protocol("perturbation", "vitlens", "token", "signed", "vitlens: Chefer et al. 2021's test on whole tokens"),
    Protocol("perturbation", "chefer2021", "pixel", "signed",
             "Chefer et al. 2021, section 4.2, Tables 1-2 (their perturbation script: top-k pixels to black)"),
    Protocol("road", "vitlens", "token", "signed", "vitlens: ROAD on whole tokens"),
    Protocol("road", "rong2022", "pixel", "signed", "Rong et al. 2022, ROAD (pixels, noisy linear imputation)"),
    Protocol("deletion_insertion", "vitlens", "token", "signed",
             "vitlens: deletion/insertion on whole tokens, one baseline for both"),
    Protocol("deletion_insertion", "petsiuk2018", "pixel", "signed",
             "Petsiuk et al. 2018, RISE section 4.1 (W pixels a step; deletion to 0, insertion from blur)"),
)}

# each metric's published protocol: what compare_methods(protocol="published") runs
PUBLISHED: dict[str, str] = {"deletion_insertion": "petsiuk2018", "perturbation": "chefer2021", "road": "rong2022"}


def protocol(metric: str, name: str) -> Protocol:
    """The named protocol of ``metric``, or a message listing the names it has."""
    if (metric, name) not in PROTOCOLS:
        names = [n for m_, n in PROTOCOLS if m_ == metric]
        raise InvalidParameterError(f"protocol for {metric} must be one of {', '.join(names)}; got {name!r}.")
    return PROTOCOLS[(metric, name)]


def check_ordering(ordering: str) -> str:
    """``ordering`` if it is one of ``ORDERINGS``, else a clear error."""
    if ordering not in ORDERINGS:
        raise InvalidParameterError(f"ordering must be one of {', '.join(ORDERINGS)}; got {ordering!r}.")
    return ordering

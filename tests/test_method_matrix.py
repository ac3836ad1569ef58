"""Every attribution method on every family of the family matrix (``tests/test_families.py``), as issue 22
asks: a classifier explains a class, a model with a text tower a prompt; the maps are finite, on the patch
grid, not all zero, and the model is the same model afterwards (its output bit for bit). A feature model
(no classifier, no text tower) has nothing to explain for the methods that need a target: they say so, and
the class-agnostic ones (rollout, eigencam) still run. Each method's numbers are checked elsewhere against
known answers and independent computations (test_attribution, test_cam, test_lrp, test_text_targets)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from test_families import FAMILIES, build
from test_text_targets import char_tokenizer
from vitlens.attribution import METHODS, attribute
from vitlens.attribution.methods import METHOD_TABLE
from vitlens.attribution.text import has_text_tower

#: smaller than the defaults where a method's cost is a count (the tiny models have 16 patch tokens)
PARAMS = {"integrated_gradients": {"n_steps": 4}, "scorecam": {"masked_per_forward": 16}}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_runs_on_every_family(family):
    pytest.importorskip("pytorch_grad_cam")
    module, _ = build(family)
    if family == "torchvision":  # torchvision starts its head at zero: every class map would be zero
        torch.nn.init.normal_(module.heads.head.weight, std=0.5)
    m = vl.LoadedModel.from_module(module, name=family, device="cpu")
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = m.forward(x)
    text = has_text_tower(m)
    ran = []
    for method in METHODS:
        kwargs = dict(PARAMS.get(method, {}))
        if text:
            kwargs.update(target="a photo", tokenizer=char_tokenizer)
        refuses = METHOD_TABLE[method].refuses
        if refuses is not None and refuses(m):  # defined on some models of the kind (the spatial decomposition)
            with pytest.raises(vl.UnsupportedModelError, match=method):
                attribute(m, x, method=method, **kwargs)
            ran.append(method)
            continue
        if not text and not m.spec.num_classes and METHOD_TABLE[method].needs_target:  # a class is refused (63.1) ...
            with pytest.raises(vl.InvalidParameterError, match="no classifier head"):
                attribute(m, x, method=method, target=0, **kwargs)
        a = attribute(m, x, method=method, **kwargs)  # ... and a tower's output norm explained
        assert text or m.spec.num_classes or a.target_kind == "output", method
        assert a.maps.shape == (2, *m.spec.grid), method
        assert np.isfinite(a.maps).all() and np.abs(a.maps).max() > 0, method
        ran.append(method)
    assert set(ran) == set(METHODS)
    with torch.no_grad():
        assert torch.equal(m.forward(x), before)

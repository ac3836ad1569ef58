"""The SAE's training on Ray Data (issue 66, item 6): two workers running the forward give the very SAE one process
gives for the same seed and batch order, from images in memory and from image files the workers read themselves."""
from __future__ import annotations

import numpy as np
import pytest

from vitlens.errors import InvalidParameterError

SITE = "blocks.3.hook_resid_post"
KW = dict(site=SITE, n_features=64, k=4, batch_size=8, seed=2)


def same_weights(a, b) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in ("W_enc", "b_enc", "W_dec", "b_dec"))


@pytest.mark.heavy
def test_two_ray_workers_give_the_sae_of_one_process(local_ray, ref_vit, tmp_path):
    from PIL import Image

    from vitlens.reference.shapes import generate
    from vitlens.sae.train import train_sae

    scenes = generate(40, seed=1000).images
    x = ref_vit.preprocess(list(scenes))
    one = train_sae(ref_vit, x, epochs=2, **KW)
    two = train_sae(ref_vit, x, epochs=2, on="ray", workers=2, worker_cpus=0.5, **KW)
    assert same_weights(one, two) and np.array_equal(one.fvu, two.fvu) and len(two.fvu) == 10  # 5 batches x 2

    paths = []
    for i, img in enumerate(scenes[:24]):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(img).save(paths[-1])
    assert same_weights(train_sae(ref_vit, paths, **KW),
                        train_sae(ref_vit, paths, on="ray", workers=2, worker_cpus=0.5, **KW))


def test_the_disk_cache_is_refused_on_ray_before_any_work(ref_vit):
    from vitlens.sae.train import train_sae

    with pytest.raises(InvalidParameterError, match="cache_bytes is the one-process"):
        train_sae(ref_vit, np.zeros((2, 64, 64, 3), np.uint8), on="ray", cache_bytes=10, **KW)
    with pytest.raises(InvalidParameterError, match="on must be one of local, ray"):
        train_sae(ref_vit, np.zeros((2, 64, 64, 3), np.uint8), on="spark", **KW)

"""Progress as a person reads it: the time left from the rate so far, and one progress over all the work of a
call that runs several methods (compare_methods over methods and images, the sanity cascade over methods and
steps), counting up to its total and never restarting."""
from __future__ import annotations

import torch

def test_time_left_reads_the_rate_so_far():
    from vitlens.progress import time_left

    assert time_left(10.0, 1, 5) == "about 40 s left"
    assert time_left(60.0, 1, 4) == "about 3 min left"
    assert time_left(5.0, 0, 4) == "" and time_left(5.0, 4, 4) == ""


def test_compare_methods_reports_one_progress_over_methods_and_images(ref_vit):
    from vitlens.attribution import compare_methods

    seen = []
    x = torch.rand(3, 3, 64, 64)
    compare_methods(ref_vit, x, methods=["rollout", "saliency"], metrics=("deletion_insertion",), steps=2,
                    batch_size=2, progress=lambda done, total: seen.append((done, total)))
    assert {t for _, t in seen} == {12} and seen[-1][0] == 12  # 2 methods x 3 images x (map, scores)
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and {3, 6, 9} <= set(dones)  # maps, then scores, of one method after the other


def test_the_sanity_cascade_reports_one_progress_over_methods_and_steps(ref_vit):
    from vitlens.attribution.sanity import parameter_groups, sanity_table

    seen = []
    sanity_table(ref_vit, torch.rand(1, 3, 64, 64), methods=["rollout", "saliency"],
                 progress=lambda done, total: seen.append((done, total)))
    total = 2 * (len(parameter_groups(ref_vit)) + 1)  # the original maps, then each step of the cascade
    assert seen == [(k, total) for k in range(1, total + 1)]

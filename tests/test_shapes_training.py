"""The procedural shapes data (deterministic, masked) and the reference training script
(seeded, resumable, writes loadable safetensors)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import vitlens as vl
from vitlens.attribution.masks import mask_scores, patch_coverage
from vitlens.reference.shapes import CLASSES, generate

ROOT = Path(__file__).resolve().parents[1]


def test_scenes_are_determined_by_seed_and_index():
    a = generate(8, seed=3)
    b = generate(5, seed=3, start=3)
    np.testing.assert_array_equal(a.images[3:], b.images)
    np.testing.assert_array_equal(a.masks[3:], b.masks)
    np.testing.assert_array_equal(a.labels[3:], b.labels)
    assert not np.array_equal(generate(4, seed=4).images, a.images[:4])


def test_every_scene_has_one_object_of_plausible_size_and_all_classes_occur():
    data = generate(300, seed=11)
    area = data.masks.reshape(300, -1).mean(1)
    assert data.images.shape == (300, 64, 64, 3) and data.images.dtype == np.uint8
    assert (area > 0.01).all() and (area < 0.5).all()
    assert 0.08 < area.mean() < 0.25
    assert set(np.unique(data.labels)) == set(range(len(CLASSES)))
    # the object is drawn bright (each channel >= 0.6 before noise) on a darker background
    on = data.images[data.masks].mean()
    off = data.images[~data.masks].mean()
    assert on > off + 60


def test_patch_coverage_and_mask_scores_on_a_hand_built_case():
    mask = np.zeros((8, 8), bool)
    mask[:4, :4] = True  # exactly the top-left patch of a 2x2 grid
    np.testing.assert_array_equal(patch_coverage(mask, (2, 2)), [[1, 0], [0, 0]])
    maps = np.array([[[1.0, 0.0], [0.0, 0.0]], [[0.25, 0.25], [0.25, 0.25]], [[0.0, 1.0], [0.0, 0.0]]])
    s = mask_scores(maps, np.stack([mask] * 3))
    np.testing.assert_allclose(s.mass_in_mask, [1.0, 0.25, 0.0])
    np.testing.assert_allclose(s.ratio, [4.0, 1.0, 0.0])
    assert s.pointing_hit.tolist() == [True, True, False]  # argmax of a flat map is the first patch


def test_training_script_is_resumable_and_writes_loadable_weights(tmp_path, capsys):
    """``analyses/train_reference.py`` run twice, as its ``main`` in this process (what makes a run resumable is the
    state on disk, not the process: a fresh interpreter's imports would add nothing); the thread count the script
    sets is put back for the tests after it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_reference", ROOT / "analyses" / "train_reference.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--models", "ref-vit", "--save-every", "1", "--state-dir", str(tmp_path / "state"), "--out",
            str(tmp_path / "w"), "--eval-n", "64"]
    threads = torch.get_num_threads()
    try:
        assert script.main(args + ["--steps-vit", "2"]) == 0
        capsys.readouterr()
        assert script.main(args + ["--steps-vit", "3"]) == 0
        second = capsys.readouterr()
    finally:
        torch.set_num_threads(threads)
    assert "resuming at step 2" in second.out
    m = vl.load_model(str(tmp_path / "w" / "ref-vit.safetensors"), arch="ref-vit")
    assert m.spec.grid == (8, 8) and m.spec.num_classes == len(CLASSES)
    state = torch.load(tmp_path / "state" / "ref-vit.state.pt", weights_only=True)
    assert state["step"] == 3


def test_an_interrupted_run_resumes_to_exactly_the_uninterrupted_weights(tmp_path):
    from vitlens.reference.models import build_reference
    from vitlens.reference.training import classification_loss, run_steps

    def fresh():
        torch.manual_seed(0)
        return build_reference("ref-vit")

    whole = fresh()
    run_steps(whole, classification_loss(whole, batch=8), 3, tmp_path / "whole.pt", save_every=1, batch=8)

    broken = fresh()
    loss = classification_loss(broken, batch=8)

    def dies_at_step_2(step: int) -> torch.Tensor:
        if step == 2:
            raise KeyboardInterrupt
        return loss(step)

    try:
        run_steps(broken, dies_at_step_2, 3, tmp_path / "resumed.pt", save_every=1, batch=8)
    except KeyboardInterrupt:
        pass
    resumed = fresh()
    run_steps(resumed, classification_loss(resumed, batch=8), 3, tmp_path / "resumed.pt", save_every=1, batch=8)
    for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k


def test_masked_patch_targets_are_the_3_bit_mean_colour_of_each_patch():
    from vitlens.reference.training import mean_colour_classes

    img = np.zeros((1, 16, 16, 3), dtype=np.uint8)
    img[0, :8, :8] = (255, 0, 0)  # patch (0, 0): red -> levels (7, 0, 0)
    img[0, :8, 8:] = (0, 128, 255)  # patch (0, 1): levels (0, 4, 7)
    img[0, 8:, :8, 2] = 40  # patch (1, 0): blue 40/255 * 8 = 1.25 -> level 1
    img[0, 8:, 8:8 + 4] = 255  # patch (1, 1): half white -> mean 0.5 -> level 4 in every channel
    got = mean_colour_classes(img, patch=8).tolist()
    assert got == [[7 * 64, 4 * 8 + 7, 1, 4 * 64 + 4 * 8 + 4]]


def test_field_scenes_keep_the_plain_scenes_objects():
    plain, field = generate(6, seed=5), generate(6, seed=5, style="field")
    np.testing.assert_array_equal(plain.labels, field.labels)
    np.testing.assert_array_equal(plain.masks, field.masks)
    np.testing.assert_array_equal(plain.images[plain.masks], field.images[field.masks])  # the object is untouched
    assert np.abs(plain.images.astype(int) - field.images).mean() > 5  # the background is not

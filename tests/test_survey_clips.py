"""A survey of video models over a folder of clips (issue 50): a shard is a set of clips, the space-time statistics
merge exactly (``SpaceTimeAccumulator.merge``), and two video models over 4 tiny GIF clips in shards of 1 and 2 give
the numbers of one process running ``vl.attention_distance`` / ``vl.attention_rollout`` over the same clips."""
from __future__ import annotations

import numpy as np
import pytest

import vitlens as vl
from vitlens.views.spacetime import SpaceTimeDistanceResult, SpaceTimeRolloutResult
from vitlens.survey import clips_source, shapes_source
from vitlens.survey.sources import Shard
from vitlens.survey.stats import merge, read_state
from vitlens.survey.worker import run_shard

ray = pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")

SHAPES = (("square", (0.0, 2.0)), ("circle", (2.0, 0.0)), ("star", (1.0, 1.0)), ("triangle", (0.0, -2.0)))


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> tuple[list[str], str]:
    """Two random-init video classifiers saved with ``save_pretrained`` (hf:FOLDER) and a folder of 4 GIF clips."""
    import torch

    root = tmp_path_factory.mktemp("video-zoo")
    common = dict(image_size=32, patch_size=8, num_frames=4, hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=64, num_labels=3, initializer_range=0.3)
    torch.manual_seed(0)
    models = {"videomae": transformers.VideoMAEForVideoClassification(transformers.VideoMAEConfig(tubelet_size=2,
                                                                                                   **common)),
              "timesformer": transformers.TimesformerForVideoClassification(transformers.TimesformerConfig(**common))}
    names = []
    for kind, model in models.items():
        model.save_pretrained(root / kind)
        names.append(f"hf:{root / kind}")
    clips = root / "clips"
    clips.mkdir()
    for i, (shape, velocity) in enumerate(SHAPES):
        vl.write_gif(vl.moving_shape_clip(num_frames=8, size=40, shape=shape, velocity=velocity, seed=i).clip,
                     clips / f"{i}-{shape}.gif")
    return names, str(clips)


def one_process(name: str, folder: str) -> tuple[SpaceTimeDistanceResult, SpaceTimeRolloutResult]:
    m = vl.load_model(name, device="cpu")
    x = vl.clip_pixel_values([vl.read_clip(f) for f in clips_source(folder).files], m)
    return vl.attention_distance(m, x, batch_size=1), vl.attention_rollout(m, x, batch_size=1)


def test_shards_of_clips_merge_to_one_process_in_process(zoo):
    names, folder = zoo
    source = clips_source(folder)
    assert len(source) == 4 and [s.stop - s.start for s in source.shards(1)] == [1, 1, 1, 1]
    for name in names:
        m = vl.load_model(name, device="cpu")
        want_d, want_r = one_process(name, folder)
        for size in (1, 2):
            parts = [run_shard(m, source, s, ("spacetime",), batch_size=1) for s in source.shards(size)]
            assert all(p["n_images"] == size and not p["skipped"] for p in parts)
            merged = parts[0]["states"]
            for p in parts[1:]:
                merged = merge(merged, p["states"])
            stats = read_state("spacetime", merged["spacetime"])
            d, r = stats.acc.distance(name), stats.acc.rollout(name)
            assert d.n_clips == 4 and d.roles == want_d.roles
            for field in ("spatial_px", "within_px", "temporal_frames", "spatial_std_px", "temporal_std_frames"):
                np.testing.assert_allclose(getattr(d, field), getattr(want_d, field), rtol=1e-12, err_msg=field)
            np.testing.assert_allclose(r.maps, want_r.maps, rtol=1e-12)
    # the survey's renormalize reaches it: raw weights as vl.attention_distance(renormalize=False) reads them
    raw = run_shard(m, source, Shard(0, 0, 4), ("spacetime",), batch_size=1, renormalize=False)["states"]
    x = vl.clip_pixel_values([vl.read_clip(f) for f in source.files], m)
    np.testing.assert_allclose(read_state("spacetime", raw["spacetime"]).acc.distance(name).spatial_px,
                               vl.attention_distance(m, x, batch_size=1, renormalize=False).spatial_px, rtol=1e-12)
    # a shard of images never runs the clips' statistic
    assert run_shard(m, shapes_source(2), Shard(0, 0, 2), ("spacetime",), 1)["states"] == {}


def test_a_survey_of_two_video_models_over_clips_on_ray_equals_one_process(zoo, local_ray, tmp_path):
    names, folder = zoo
    result = vl.survey(names, clips_source(folder), tmp_path / "video-survey", shard_size=2, batch_size=1,
                       progress=False)
    assert result.models() == names
    t = result.table
    for name in names:
        want, _roll = one_process(name, folder)
        rows = t[t["model"] == name]
        for i, (role, block) in enumerate(zip(want.roles, want.blocks)):
            for what, values in (("spatial_px", want.spatial_px), ("temporal_frames", want.temporal_frames)):
                got = rows[(rows["metric"] == f"{role}_{what}") & (rows["layer"] == block)].sort_values("head")
                np.testing.assert_allclose(got["value"].to_numpy(), values[i], rtol=1e-12)
                assert set(got["n_images"]) == {4}
            base = rows[(rows["metric"] == f"{role}_baseline_temporal_frames") & (rows["layer"] == block)]
            assert base["value"].tolist() == pytest.approx([want.baseline_temporal_frames[i]])
        assert rows[rows["metric"] == "images_used"]["value"].item() == 4
    # the survey page and the app's summary open on it (the space-time rows are in the table, not drawn yet)
    from vitlens.report.survey import summary_rows, survey_html

    assert "<html" in survey_html(result).lower() and len(summary_rows(result)) == 2

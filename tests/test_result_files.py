"""Tampered result files (issue 33, item 8): one vitlens error naming the file and the field, never a raw Python
error, a wrong type never loading silently, and an archive judged by what it would inflate to before it is read."""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

import vitlens as vl
from vitlens.result_schema import MAX_RESULT_BYTES, ResultFileError
from vitlens.views.distance import AttentionDistanceResult


def _result() -> AttentionDistanceResult:
    z = np.zeros((2, 3))
    return AttentionDistanceResult(mean_px=z + 1.0, std_px=z, m2=z, n_images=4, image_size=(32, 32), grid=(2, 2),
                                   stride_px=(16, 16), renormalize=True, model_name="m")


def _tamper(tmp_path, **changes):
    path = _result().save(tmp_path / "r.json")
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("field, value, why", [
    ("n_images", "four", "not an integer"),
    ("grid", [2, 2, 2], "3 items, not 2"),
    ("renormalize", 1, "not true/false"),
    ("mean_px", [[1, 2], [3, 4]], "not an array"),
    ("mean_px", {"__ndarray__": [1.0, 2.0, 3.0], "dtype": "float64", "shape": [3]}, "1 dimensions"),
    ("m2", {"__ndarray__": [[0.0], [0.0]], "dtype": "float64", "shape": [2, 1]}, "H = 1, but mean_px has H = 3"),
    ("std_px", {"__ndarray__": ["a"], "dtype": "<U1", "shape": [1]}, "not a plain numeric dtype"),
])
def test_a_field_of_the_wrong_type_or_shape_is_named(tmp_path, field, value, why):
    path = _tamper(tmp_path, **{field: value})
    with pytest.raises(ResultFileError, match=f"r.json \\(field '{field}'\\): .*{why}"):
        vl.load_result(path)


def test_a_missing_field_and_broken_encodings_are_named(tmp_path):
    path = _tamper(tmp_path)
    d = json.loads(path.read_text())
    del d["grid"]
    path.write_text(json.dumps(d))
    with pytest.raises(ResultFileError, match="field 'grid'.*missing"):
        vl.load_result(path)
    path.write_text(json.dumps({**d, "grid": [2, 2], "mean_px": {"__ndarray__": [1, 2], "dtype": "float64",
                                                                  "shape": [5]}}))
    with pytest.raises(ResultFileError, match="r.json.*field 'mean_px'.*do not fill the declared shape \\[5\\]"):
        vl.load_result(path)
    for junk in ("{not json", "[1, 2]", '{"kind": 3}'):
        path.write_text(junk)
        with pytest.raises(vl.errors.VitlensError, match="r.json|kind"):
            vl.load_result(path)


def test_deep_nesting_is_refused_without_recursing(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ResultFileError, match="deep.json: nested more than"):
        vl.load_result(path)


def test_an_npz_that_would_inflate_past_the_bound_is_not_read(tmp_path):
    path = tmp_path / "bomb.npz"
    buf = io.BytesIO()
    big = np.zeros(MAX_RESULT_BYTES // 8 + 1024)  # zeros: a tiny file that inflates past the bound
    np.savez_compressed(buf, __meta__=np.asarray(json.dumps({"kind": "attention_distance"})), mean_px=big)
    del big
    path.write_bytes(buf.getvalue())
    assert path.stat().st_size < 2 * 2**20
    with pytest.raises(ResultFileError, match="bomb.npz: its arrays would inflate to .* not read"):
        vl.load_result(path)


def test_a_tampered_npz_names_the_file(tmp_path):
    path = _result().save(tmp_path / "r.npz")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ResultFileError, match="r.npz"):
        vl.load_result(path)
    with zipfile.ZipFile(tmp_path / "nometa.npz", "w") as z:
        z.writestr("x.npy", b"")
    with pytest.raises(ResultFileError, match="nometa.npz \\(field '__meta__'\\): missing"):
        vl.load_result(tmp_path / "nometa.npz")


def test_a_good_file_still_round_trips(tmp_path):
    for suffix in (".json", ".npz"):
        assert vl.load_result(_result().save(tmp_path / f"r{suffix}")).equals(_result())


@pytest.mark.parametrize("dtype, items, shape, why", [
    ("(25000000,)f8", [1.0], [1], "not a plain numeric dtype"),  # one item of 200 MB
    ("O", [1.0], [1], "not a plain numeric dtype"),
    ("V100000000", [1], [1], "not a plain numeric dtype"),
    ("f8,i4", [1.0], [1], "not a plain numeric dtype"),
    ("no-such-dtype", [1.0], [1], "not a numpy dtype"),
    ("float64", [1.0, 2.0], [100000, 100000], "would take 80,000,000,000 bytes"),
    ("float64", [1.0, 2.0], [3], "do not fill the declared shape"),
    ("float64", [[1.0, 2.0], [3.0]], [2, 2], "do not fill the declared shape"),
    ("float64", [1.0], [-1], "not a list of non-negative integers"),
])
def test_an_encoded_array_is_checked_before_it_takes_memory(tmp_path, dtype, items, shape, why):
    """A 2 KB file whose array declares a subarray dtype allocated 763 MB before it was refused: the dtype, the
    declared size and the number of items are checked first, and the field named."""
    import tracemalloc

    path = _tamper(tmp_path, std_px={"__ndarray__": items, "dtype": dtype, "shape": shape})
    assert path.stat().st_size < 4096
    tracemalloc.start()
    try:
        with pytest.raises(ResultFileError, match=f"r.json \\(field 'std_px'\\): .*{why}"):
            vl.load_result(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_loading_what_is_not_a_file_says_what_it_is(tmp_path, kind):
    """A FIFO (a read would block), a link to /dev/zero (a read would never end), a folder: said for what they
    are, never opened."""
    import os

    path = tmp_path / "r.json"
    if kind == "fifo":
        os.mkfifo(path)
        said = "is a FIFO \\(named pipe\\)"
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
        said = "a link to /dev/zero\\) is a character device"
    else:
        path.mkdir()
        said = "is a folder"
    with pytest.raises(vl.InvalidParameterError, match=f"r.json.*{said}, not a result file"):
        vl.load_result(path)


def _array(a: np.ndarray) -> dict:
    return {"__ndarray__": a.tolist(), "dtype": str(a.dtype), "shape": list(a.shape)}


def _lens() -> "vl.Result":
    from vitlens.components import LogitLensResult

    b, depth, n, k = 1, 4, 5, 2  # L = 3 blocks: depths 0..3
    return LogitLensResult(target=np.zeros(b, dtype=np.int64), pooled=np.zeros((b, depth)),
                           tokens=np.zeros((b, depth, n)), top_classes=np.zeros((b, depth, k), dtype=np.int64),
                           top_logits=np.zeros((b, depth, k)), output=np.zeros(b), num_prefix_tokens=1, model_name="m")


def _spacetime() -> "vl.Result":
    from vitlens.views.spacetime import SpaceTimeDistanceResult

    maps, heads = 2, 3
    z, b = np.zeros((maps, heads)), np.zeros(maps)
    return SpaceTimeDistanceResult(model="m", roles=("temporal", "spatial"), blocks=(0, 0), spatial_px=z,
                                   within_px=z, temporal_frames=z, spatial_std_px=z, temporal_std_frames=z,
                                   baseline_spatial_px=b, baseline_within_px=b, baseline_temporal_frames=b,
                                   max_spatial_px=8.0, max_temporal_frames=2.0, n_clips=1)


def _rollout() -> "vl.Result":
    from vitlens.views.spacetime import SpaceTimeRolloutResult

    return SpaceTimeRolloutResult(model="m", maps=np.zeros((1, 2, 3, 3)), source_token="class", head_fusion="mean",
                                  time_centres=np.array([0.5, 2.5]))


@pytest.mark.parametrize("make, field, value, why", [
    # [B, L + 1] beside [B, L + 1, N]: one depth more than blocks, the same everywhere
    (_lens, "pooled", _array(np.zeros((1, 3))), "field '(pooled|tokens)'.*L = [23], but \\w+ has L = [23]"),
    (_lens, "top_logits", _array(np.zeros((1, 4, 3))), "field 'top_logits'.*k = 3, but top_classes has k = 2"),
    # [B, T', gh, gw] beside time_centres [T']: a primed symbol is a symbol
    (_rollout, "time_centres", _array(np.array([0.5, 1.5, 2.5])), "field 'time_centres'.*T' = 3, but maps has T' = 2"),
    # roles [maps] and blocks [maps]: a sequence's length is its one dimension
    (_spacetime, "roles", ["temporal", "spatial", "joint"], "field '(roles|blocks)'.*maps = [23], but \\w+ has maps"),
    (_spacetime, "blocks", [0], "field '(roles|blocks)'.*maps = [12], but \\w+ has maps = [12]"),
])
def test_every_declared_shape_of_the_new_kinds_is_checked(tmp_path, make, field, value, why):
    """Shapes written with offsets (``L + 1``), primes (``T'``) and sequences of one per map (``roles: [maps]``) are
    held to the arrays beside them, so a crafted file fails on load, not later in repr, to_rows or a figure."""
    path = make().save(tmp_path / "r.json")
    assert type(vl.load_result(path)) is type(make())  # the untouched file loads
    d = json.loads(path.read_text())
    d[field] = value
    path.write_text(json.dumps(d))
    with pytest.raises(ResultFileError, match=why):
        vl.load_result(path)


def test_a_map_role_that_is_no_role_is_refused_on_load(tmp_path):
    path = _spacetime().save(tmp_path / "r.json")
    d = json.loads(path.read_text())
    d["roles"] = ["temporal", "sideways"]
    path.write_text(json.dumps(d))
    with pytest.raises(vl.InvalidParameterError, match="roles are among joint, temporal, spatial; got 'sideways'"):
        vl.load_result(path)

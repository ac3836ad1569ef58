"""SAE files (issue 66, item 5): vitlens's own folder round-trips; SAELens / ViT-Prisma folders and saev checkpoints
written by hand in their layouts load to SAEs that compute what those tools compute; a saev file that carries
pickled code is refused without running it."""
from __future__ import annotations

import io
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from vitlens.errors import CheckpointError
from vitlens.sae import SAEConfig, SparseAutoencoder, load_sae, save_sae

D, F = 8, 16


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"W_enc": torch.randn(D, F, generator=g), "b_enc": torch.randn(F, generator=g),
            "W_dec": torch.randn(F, D, generator=g), "b_dec": torch.randn(D, generator=g)}


def reference_code(w: dict, x: torch.Tensor, k: int | None, centred: bool, relu_topk: bool = True) -> torch.Tensor:
    """The code as the other tool computes it, written out here."""
    pre = ((x - w["b_dec"]) if centred else x) @ w["W_enc"] + w["b_enc"]
    if k is None:
        return torch.relu(pre)
    values, idx = pre.topk(k, -1)
    return torch.zeros_like(pre).scatter(-1, idx, torch.relu(values) if relu_topk else values)


X = torch.randn(20, D, generator=torch.Generator().manual_seed(5))


def test_a_vitlens_sae_folder_round_trips(tmp_path):
    sae = SparseAutoencoder(SAEConfig(d_in=D, n_features=F, k=3, site="blocks.1.hook_resid_post", seed=4))
    back = load_sae(save_sae(sae, tmp_path / "sae"))
    assert sorted(p.name for p in (tmp_path / "sae").iterdir()) == ["sae.json", "sae.safetensors"]
    assert back.config == sae.config
    assert all(torch.equal(getattr(back, n), getattr(sae, n)) for n in ("W_enc", "b_enc", "W_dec", "b_dec"))
    assert load_sae(tmp_path / "sae", site="blocks.0.hook_resid_post").config.site == "blocks.0.hook_resid_post"
    with pytest.raises(CheckpointError, match="is a file"):
        save_sae(sae, tmp_path / "sae" / "sae.json")


def saelens_folder(path, cfg: dict, w: dict):
    path.mkdir()
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file(w, str(path / "sae_weights.safetensors"))
    return path


@pytest.mark.parametrize("centred", [True, False])
def test_a_saelens_topk_folder_computes_what_saelens_computes(tmp_path, centred):
    w = weights(1)
    cfg = {"d_in": D, "d_sae": F, "architecture": "topk", "activation_fn_kwargs": {"k": 3},
           "hook_name": "blocks.2.hook_resid_post", "apply_b_dec_to_input": centred, "normalize_activations": "none",
           "model_name": "vit_base_patch16_224"}
    sae = load_sae(saelens_folder(tmp_path / "s", cfg, w))
    assert sae.config.kind == "topk" and sae.config.k == 3 and sae.config.site == "blocks.2.hook_resid_post"
    z = reference_code(w, X, 3, centred)
    assert torch.allclose(sae.encode(X), z, atol=1e-5)
    assert torch.allclose(sae(X)[0], z @ w["W_dec"] + w["b_dec"], atol=1e-5)


def test_a_vit_prisma_relu_folder_reads_its_hook_point(tmp_path):
    w = weights(2)
    cfg = {"d_in": D, "d_sae": F, "activation_fn_str": "relu", "hook_point": "blocks.9.hook_resid_post"}
    sae = load_sae(saelens_folder(tmp_path / "p", cfg, w))
    assert sae.config.kind == "relu" and sae.config.site == "blocks.9.hook_resid_post" and sae.config.tokens == "all"
    assert torch.allclose(sae.encode(X), reference_code(w, X, None, True), atol=1e-5)


@pytest.mark.parametrize("cfg, words", [
    ({"architecture": "jumprelu"}, "JumpReLU"),
    ({"normalize_activations": "expected_average_only_in"}, "rescales the activations"),
    ({"d_sae": 15}, "shapes do not fit"),
])
def test_a_saelens_folder_vitlens_cannot_compute_is_refused_by_name(tmp_path, cfg, words):
    with pytest.raises(CheckpointError, match=words):
        load_sae(saelens_folder(tmp_path / "x", {"d_in": D, "d_sae": F, **cfg}, weights()))


def saev_file(path, header: dict, state) -> str:
    buf = io.BytesIO()
    torch.save(state, buf)
    path.write_bytes((json.dumps(header) + "\n").encode() + buf.getvalue())
    return str(path)


@pytest.mark.parametrize("header, k, centred", [
    ({"d_vit": D, "exp_factor": 2, "sparsity_coeff": 4e-4, "ghost_grads": False}, None, True),  # before schemas
    ({"schema": 1, "cls": "TopK", "cfg": {"d_vit": D, "exp_factor": 2, "top_k": 4}}, 4, True),
    ({"schema": 2, "cfg": {"d_vit": D, "exp_factor": 2, "activation": {"cls": "TopK", "params": {"top_k": 4}}},
      "commit": "abc", "lib": "1.0"}, 4, False),
])
def test_a_saev_checkpoint_computes_what_saev_computed_at_its_schema(tmp_path, header, k, centred):
    w = weights(3)
    sae = load_sae(saev_file(tmp_path / "sae.pt", header, w), site="blocks.11.hook_resid_post")
    assert sae.config.n_features == F and sae.config.site == "blocks.11.hook_resid_post"
    assert torch.allclose(sae.encode(X), reference_code(w, X, k, centred), atol=1e-5)
    assert torch.allclose(sae.decode(sae.encode(X)), reference_code(w, X, k, centred) @ w["W_dec"] + w["b_dec"],
                          atol=1e-5)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('VITLENS_TEST_MARK', '/nonexistent/mark')}",))


def test_a_saev_checkpoint_that_carries_pickled_code_is_refused_without_running_it(tmp_path, monkeypatch):
    mark = tmp_path / "ran"
    monkeypatch.setenv("VITLENS_TEST_MARK", str(mark))
    path = saev_file(tmp_path / "evil.pt", {"schema": 2, "cfg": {"d_vit": D, "exp_factor": 2, "activation": {
        "cls": "Relu", "params": {}}}}, {**weights(), "extra": _Payload()})
    with pytest.raises(CheckpointError, match="not plain tensors"):
        load_sae(path)
    assert not mark.exists()


def test_a_file_of_no_layout_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"hello\nworld")
    with pytest.raises(CheckpointError, match="first line is not JSON"):
        load_sae(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_sae(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not an SAE this vitlens reads"):
        load_sae(tmp_path / "empty")

"""TextSpan (issue 51; docs/definitions.md, "TextSpan"): the greedy projection against a hand-built case with a
known answer and an independent computation (each pick the best growth of an orthonormal basis of the picked texts),
and each head's contribution vectors against ``decompose``'s head parts read along directions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.components.head_vectors import head_vectors
from vitlens.components.textspan import greedy_span

CLASSES = ["cat", "dog", "car", "tree", "boat", "house", "bird"]


def by_bases(outputs: np.ndarray, texts: np.ndarray, steps: int) -> tuple[list[int], list[float]]:
    """The same rule computed another way: the pick maximising the variance captured by the span of the texts picked
    so far plus it (an orthonormal basis by QR), its share the growth of that variance."""
    c = outputs - outputs.mean(0)
    total, picked, shares, before = (c ** 2).sum(), [], [], 0.0
    for _ in range(steps):
        best, best_k = -1.0, -1
        for k in range(len(texts)):
            if k in picked:
                continue
            q, _ = np.linalg.qr(texts[picked + [k]].T)
            captured = ((c @ q) ** 2).sum()
            if captured > best:
                best, best_k = captured, k
        picked.append(best_k)
        shares.append((best - before) / total)
        before = best
    return picked, shares


def test_outputs_in_the_span_of_two_texts_return_those_two_first() -> None:
    rng = np.random.default_rng(0)
    texts = rng.normal(size=(7, 16))
    mix = rng.normal(size=(40, 2))
    outputs = mix @ texts[[2, 5]] + rng.normal(size=16)  # in span(text 2, text 5), plus a constant (centred away)
    chosen, explained = greedy_span(outputs, texts, 4)
    assert set(chosen[:2].tolist()) == {2, 5}
    assert explained[:2].sum() == pytest.approx(1.0, abs=1e-12)
    assert np.abs(explained[2:]).max() < 1e-12  # nothing left to explain


def test_greedy_equals_an_independent_computation() -> None:
    rng = np.random.default_rng(1)
    texts = rng.normal(size=(9, 12))
    outputs = rng.normal(size=(30, 12)) * np.linspace(3, 0.1, 12)  # anisotropic: distinct picks
    chosen, explained = greedy_span(outputs, texts, 5)
    picked, shares = by_bases(outputs, texts, 5)
    assert chosen.tolist() == picked
    np.testing.assert_allclose(explained, shares, rtol=1e-9, atol=1e-12)
    chosen, _ = greedy_span(outputs, texts[:3], 5)  # more steps than texts: the rest marked -1
    assert sorted(chosen[:3].tolist()) == [0, 1, 2] and (chosen[3:] == -1).all()


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                 patch_size=8)
    if kind == "clip":
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
        m = CLIPVisionModelWithProjection(CLIPVisionConfig(**small, projection_dim=16))
    elif kind == "siglip":
        from transformers import SiglipVisionConfig, SiglipVisionModel
        m = SiglipVisionModel(SiglipVisionConfig(**small))
    else:
        from open_clip.transformer import VisionTransformer
        m = VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=2.0, output_dim=16,
                              ls_init_value=0.5, pool_type="avg" if kind == "openclip-avg" else "tok",
                              final_ln_after_pool=kind == "openclip-avg")
    m = m.double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return m


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(3, 3, 32, 32, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["clip", "siglip", "openclip", "openclip-avg"])
def test_head_vectors_read_along_a_direction_are_the_decomposition(kind: str, pixels: torch.Tensor) -> None:
    m = build(kind)
    vectors, layers = head_vectors(m, pixels, layers=[0, -1])
    assert layers == [0, 1]
    torch.manual_seed(5)
    u = torch.randn(vectors.shape[-1], dtype=torch.float64)
    r = vl.decompose(m, pixels, direction=u)
    np.testing.assert_allclose((vectors @ u).numpy(), r.heads.sum(-1), rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def clip_pair() -> tuple[torch.nn.Module, torch.Tensor]:
    """A random-init CLIP (both towers); the class names embedded by its own text tower (token ids by hand: no
    tokenizer files offline)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      vocab_size=64, max_position_embeddings=16, bos_token_id=1,
                                      eos_token_id=63, pad_token_id=0),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=32, patch_size=8), projection_dim=16)
    model = CLIPModel(cfg).double().eval()
    ids = torch.tensor([[1] + [2 + ord(ch) % 60 for ch in word] + [63] + [0] * (10 - len(word)) for word in CLASSES])
    with torch.no_grad():
        text = model.get_text_features(input_ids=ids)
    text = text if torch.is_tensor(text) else text.pooler_output
    from transformers import CLIPVisionModelWithProjection

    cfg.vision_config.projection_dim = 16
    tower = CLIPVisionModelWithProjection(cfg.vision_config).double().eval()
    tower.vision_model.load_state_dict(model.vision_model.state_dict())
    tower.visual_projection.load_state_dict(model.visual_projection.state_dict())
    return tower, text


def test_text_span_on_a_clip_tower(clip_pair, tmp_path) -> None:  # noqa: ANN001
    tower, text = clip_pair
    torch.manual_seed(2)
    x = torch.randn(5, 3, 32, 32, dtype=torch.float64)
    r = vl.text_span(tower, x, CLASSES, text, steps=3)
    assert r.chosen.shape == (2, 4, 3) and r.layers.tolist() == [0, 1]
    # every head's picks by the independent computation, on its contribution vectors (which equal decompose's head
    # parts read along any direction: the test above)
    vectors = head_vectors(tower, x)[0].numpy()
    for l in range(2):
        for h in range(4):
            picked, shares = by_bases(vectors[:, l, h], text.numpy(), 3)
            assert r.chosen[l, h].tolist() == picked
            np.testing.assert_allclose(r.explained[l, h], shares, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r.variance, ((vectors - vectors.mean(0)) ** 2).sum((0, -1)), rtol=1e-12)
    assert (r.explained >= -1e-12).all() and (r.explained.sum(-1) <= 1 + 1e-9).all()
    words = r.described(1, 0)
    assert [w for w, _ in words] == [CLASSES[k] for k in r.chosen[1, 0]]
    assert len(r.to_rows()) == 2 * 4 * 3 and "TextSpan" in r.summary()
    frame = r.to_pandas()
    np.testing.assert_allclose(frame[frame.step == 3].cumulative.to_numpy(), r.explained.sum(-1).ravel())
    back = vl.load_result(r.save(tmp_path / "span.npz"))
    assert type(back) is type(r) and back.equals(r)
    from vitlens import figures
    fig = figures.figure_for(r)
    np.testing.assert_allclose(np.asarray(fig.data[0].z), r.explained.sum(-1))
    same = vl.text_span(tower, x, CLASSES, lambda words: text[[CLASSES.index(w) for w in words]], steps=3)
    assert same.equals(r)  # a function that embeds the texts


def test_text_span_refuses_bad_input(clip_pair) -> None:  # noqa: ANN001
    tower, text = clip_pair
    x = torch.zeros(2, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(vl.InvalidParameterError, match="one row per text"):
        vl.text_span(tower, x, CLASSES[:3], text)
    with pytest.raises(vl.InvalidParameterError, match="2 images"):
        vl.text_span(tower, x[:1], CLASSES, text)
    with pytest.raises(vl.UnsupportedModelError, match="TextSpan"):
        vl.text_span(torch.nn.Linear(2, 2), x, CLASSES, text)

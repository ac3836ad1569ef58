"""The component analyses' named conventions (issue 65; docs/definitions.md, "Norm conventions", "TextSpan", "Token
norms"): each held to a recomputation written here from the paper's definition, on towers whose norm gains and biases,
head biases and attention are made to differ from the defaults, so that the conventions differ by far more than the
tolerance and a swap of two of them fails."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlens.components import decompose
from vitlens.errors import InvalidParameterError, UnsupportedModelError

TOL = 1e-9


def noisy(m: torch.nn.Module, sharpen: float = 4.0) -> torch.nn.Module:
    """Float64, eval; random norm gains and biases and head (output projection) biases, sharpened attention (the
    query projection scaled up)."""
    torch.manual_seed(1)
    m = m.double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if any(w in name for w in ("norm", "ln")) or name.endswith("bias"):
                p.add_(0.5 * torch.randn_like(p))
            if name.endswith("q_proj.weight"):
                p.mul_(sharpen)
            if name.endswith("in_proj_weight"):
                p[: p.shape[0] // 3].mul_(sharpen)
    return m


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "hf-clip":
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
        return noisy(CLIPVisionModelWithProjection(CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
            patch_size=8, projection_dim=16)))
    from open_clip.transformer import VisionTransformer
    return noisy(VisionTransformer(image_size=32, patch_size=8, width=32, layers=3, heads=4, mlp_ratio=2.0,
                                   output_dim=16))


def authors_parts(m: torch.nn.Module, kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paper's projected residual stream (PRS), written from its definition: the forward in plain torch; the
    class token's residual after the blocks as ``2L + 1`` intermediates (the pre-norm's output, each attention layer
    per source token and head with its output bias spread over tokens x heads, each MLP); the final norm's mean and
    beta shared equally over the intermediates (an attention layer's share split over tokens x heads); each through
    the norm's gain over the held std and the projection, over the embedding's norm.

    Returns:
        ``(attn [B, L, N, H, F], mlps [B, L + 1, F], embedding [B, F])``.
    """
    if kind == "hf-clip":
        vm = m.vision_model
        emb, pre, post, proj = vm.embeddings(x), vm.pre_layrnorm, vm.post_layernorm, m.visual_projection.weight.T
        blocks = []
        for layer in vm.encoder.layers:
            a = layer.self_attn
            blocks.append((layer.layer_norm1, (a.q_proj.weight, a.q_proj.bias), (a.k_proj.weight, a.k_proj.bias),
                           (a.v_proj.weight, a.v_proj.bias), a.out_proj, a.num_heads,
                           lambda t, layer=layer: layer.mlp(layer.layer_norm2(t))))
    else:
        patches = m.conv1(x).flatten(2).transpose(1, 2)
        cls = m.class_embedding.expand(x.shape[0], 1, -1)
        emb = torch.cat([cls, patches], 1) + m.positional_embedding
        pre, post, proj = m.ln_pre, m.ln_post, m.proj
        blocks = []
        for r in m.transformer.resblocks:
            w, bias = r.attn.in_proj_weight.chunk(3), r.attn.in_proj_bias.chunk(3)
            blocks.append((r.ln_1, (w[0], bias[0]), (w[1], bias[1]), (w[2], bias[2]), r.attn.out_proj,
                           r.attn.num_heads, lambda t, r=r: r.ls_2(r.mlp(r.ln_2(t)))))
    stream = pre(emb)
    b, n, d = stream.shape
    attn, mlps = [], [stream[:, 0]]
    for ln1, (wq, bq), (wk, bk), (wv, bv), out, h, mlp in blocks:
        z = ln1(stream)
        q, k, v = ((z @ w.T + bb).reshape(b, n, h, d // h).transpose(1, 2) for w, bb in ((wq, bq), (wk, bk), (wv, bv)))
        a = ((q @ k.transpose(-1, -2)) / (d // h) ** 0.5).softmax(-1)  # [B, H, N, N]
        w_o = out.weight.reshape(d, h, d // h)
        per = torch.einsum("bhj,bhjc,ehc->bjhe", a[:, :, 0], v, w_o) + out.bias / (n * h)  # at the class token
        attn.append(per)
        full = torch.einsum("bhqj,bhjc->bqhc", a, v).reshape(b, n, d) @ out.weight.T + out.bias
        stream = stream + full
        branch = mlp(stream)
        mlps.append(branch[:, 0])
        stream = stream + branch
    x0 = stream[:, 0]
    mu, std = x0.mean(-1), torch.sqrt(x0.var(-1, unbiased=False) + post.eps)
    embedding = post(x0) @ proj
    count = 2 * len(blocks) + 1
    at = torch.stack(attn, 1)  # [B, L, N, H, D]
    at = (post.weight * (at - mu[:, None, None, None, None] / (count * n * h)) / std[:, None, None, None, None]
          + post.bias / (count * n * h)) @ proj
    ml = torch.stack(mlps, 1)
    ml = (post.weight * (ml - mu[:, None, None] / count) / std[:, None, None] + post.bias / count) @ proj
    r = embedding.norm(dim=-1)
    return at / r[:, None, None, None, None], ml / r[:, None, None], embedding


@pytest.mark.parametrize("kind", ["hf-clip", "openclip"])
def test_clip_text_span_convention_equals_the_papers_prs_and_per_part_does_not(kind: str) -> None:
    torch.manual_seed(2)
    m = build(kind)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    u = torch.randn(16, dtype=torch.float64)
    with torch.no_grad():
        attn, mlps, embedding = authors_parts(m, kind, x)
        own = m(pixel_values=x).image_embeds if kind == "hf-clip" else m(x)
    assert torch.allclose(embedding, own, atol=1e-10)  # the forward written here is the model's
    want_heads = torch.einsum("bljhf,f->blhj", attn, u).numpy()
    want_mlp = (mlps @ u).numpy()
    want_out = (embedding @ u / embedding.norm(dim=-1)).numpy()
    assert np.allclose(want_heads.sum((1, 2, 3)) + want_mlp.sum(1), want_out, atol=1e-12)  # the PRS closes
    got = decompose(m, x, direction=u.numpy(), norm_convention="clip_text_span")
    np.testing.assert_allclose(got.output, want_out, atol=TOL)
    np.testing.assert_allclose(got.heads, want_heads, atol=TOL)
    np.testing.assert_allclose(got.mlp[:, :, 0], want_mlp[:, 1:], atol=TOL)
    assert np.abs(got.mlp[:, :, 1:]).max() == 0
    before = got.embed_patch.sum(-1) + got.embed_position.sum(-1) + got.embed_prefix.sum(-1) + got.pre_norm_bias
    np.testing.assert_allclose(before, want_mlp[:, 0], atol=TOL)
    assert np.abs(got.attn_bias).max() == 0 and got.closes(1e-10) and got.norm_convention == "clip_text_span"
    ours = decompose(m, x, direction=u.numpy())  # per_part: the parts differ, by far more than the tolerance
    assert ours.closes(1e-10) and np.abs(ours.output - want_out).max() > 1e3 * TOL
    r = np.linalg.norm(embedding.numpy(), axis=-1)[:, None, None, None]
    assert np.abs(ours.heads / r - want_heads).max() > 1e3 * TOL


def test_clip_text_span_is_refused_where_the_authors_state_no_convention() -> None:
    import transformers as tf
    vit = tf.ViTForImageClassification(tf.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                    intermediate_size=64, image_size=32, patch_size=8, num_labels=3))
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(InvalidParameterError, match="CLIP"):
        decompose(vit.eval(), x, norm_convention="clip_text_span")
    with pytest.raises(InvalidParameterError, match="per_part"):
        decompose(vit.eval(), x, norm_convention="authors")
    from open_clip.transformer import VisionTransformer
    avg = VisionTransformer(image_size=32, patch_size=8, width=32, layers=1, heads=4, mlp_ratio=2.0, output_dim=16,
                            pool_type="avg").eval()
    with pytest.raises(UnsupportedModelError, match="class token"):
        decompose(avg, x, target=0, norm_convention="clip_text_span")


def span_by_complements(outputs: np.ndarray, texts: np.ndarray, steps: int, rank: int) -> list[int]:
    """The authors' TextSpan from its definition, computed another way: texts restricted to the span of the top-``rank``
    right singular vectors of the uncentred outputs (by least squares on that basis); at each step every text's part
    orthogonal to the picks so far (QR of the picks), scored by the sample standard deviation over the images of the
    centred outputs along it, unnormalised."""
    basis = np.linalg.svd(outputs, full_matrices=False)[2][:rank]  # [rank, F]
    coef = np.linalg.lstsq(basis.T, texts.T, rcond=None)[0]
    projected = (basis.T @ coef).T
    c = outputs - outputs.mean(0)
    picked: list[int] = []
    for _ in range(steps):
        if picked:
            q, _ = np.linalg.qr(projected[picked].T)
            rest = projected - (projected @ q) @ q.T
        else:
            rest = projected
        score = np.array([np.std(c @ t, ddof=1) for t in rest])
        score[picked] = -np.inf
        picked.append(int(np.argmax(score)))
    return picked


def texts_and_outputs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Anisotropic head outputs and texts of very different lengths: the two rules part."""
    rng = np.random.default_rng(seed)
    outputs = rng.normal(size=(40, 24)) * np.linspace(4, 0.05, 24) + rng.normal(size=24)
    texts = rng.normal(size=(30, 24)) * rng.uniform(0.1, 5.0, size=(30, 1))
    return outputs, texts


def test_authors_text_span_equals_the_papers_rule_and_differs_from_the_normalised_one() -> None:
    from vitlens.components.textspan import VARIANTS, authors_span, greedy_span

    differ = 0
    for seed in range(6):
        outputs, texts = texts_and_outputs(seed)
        chosen, explained = authors_span(outputs, texts, 6, rank=8)
        assert chosen.tolist() == span_by_complements(outputs, texts, 6, 8)
        assert VARIANTS["authors"](outputs, texts, 6, 8)[0].tolist() == chosen.tolist()
        assert np.all(explained >= 0) and explained.sum() <= 1 + 1e-12
        normalised = greedy_span(outputs, texts, 6)[0]
        differ += normalised.tolist() != chosen.tolist()
    assert differ >= 4  # a swap of the two rules would fail above


def test_text_span_variant_authors_on_a_tower_follows_the_rule_on_its_head_vectors(tmp_path) -> None:  # noqa: ANN001
    import vitlens as vl
    from vitlens.components.head_vectors import head_vectors

    m = build("openclip")
    torch.manual_seed(3)
    x = torch.randn(12, 3, 32, 32, dtype=torch.float64)
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(20, 16)) * rng.uniform(0.1, 5.0, size=(20, 1))
    names = [f"text {k}" for k in range(20)]
    path = tmp_path / "mine.txt"
    path.write_text("\n".join(names) + "\n\n", encoding="utf-8")
    got = vl.text_span(m, x, path, emb, layers=[-1], steps=4, variant="authors", rank=6)
    normal = vl.text_span(m, x, names, emb, layers=[-1], steps=4)
    assert got.texts == names and got.variant == "authors" and got.rank == 6 and "authors rule" in got.summary()
    v = head_vectors(m, x, [-1])[0].numpy()
    for h in range(v.shape[2]):
        assert got.chosen[0, h].tolist() == span_by_complements(v[:, 0, h], emb, 4, 6)
    assert (got.chosen != normal.chosen).any()
    with pytest.raises(InvalidParameterError, match="variant"):
        vl.text_span(m, x, names, emb, variant="paper")
    with pytest.raises(InvalidParameterError, match="rank"):
        vl.text_span(m, x, names, emb, variant="authors", rank=0)


def test_text_files_are_read_within_bounds_and_bad_ones_refused(tmp_path) -> None:  # noqa: ANN001
    from vitlens.components import textbank

    bank = textbank.text_bank()
    assert 200 <= len(bank) <= textbank.MAX_TEXTS and len(set(bank)) == len(bank)
    assert all(0 < len(t) <= textbank.MAX_TEXT_CHARS for t in bank)
    cases = {"missing.txt": None, "empty.txt": b"\n \n", "latin1.txt": "caf\xe9 au lait\n".encode("latin-1"),
             "long.txt": ("x" * (textbank.MAX_TEXT_CHARS + 1)).encode(), "nul.txt": b"a\x00b\n"}
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
        with pytest.raises(InvalidParameterError, match=name):
            textbank.read_texts(tmp_path / name)
    with pytest.raises(InvalidParameterError, match="not a file"):
        textbank.read_texts(tmp_path)
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(textbank.MAX_FILE_BYTES + 1)
    with pytest.raises(InvalidParameterError, match="bytes"):
        textbank.read_texts(big)


def test_artifact_rules_follow_their_definitions_and_differ() -> None:
    from vitlens.views.prefix import high_norm_outliers

    norms = np.array([[9.0, 1.0, 1.2, 0.9, 6.0, 1.1],           # relative: 6 > 4 x 1.1; none over 150
                      [500.0, 200.0, 210.0, 190.0, 205.0, 900.0]])  # absolute: every patch; relative: 900 only
    _, rel = high_norm_outliers(norms, 1)
    _, ab = high_norm_outliers(norms, 1, rule="absolute")
    assert rel.tolist() == [[False, False, False, False, True, False], [False] * 5 + [True]]
    assert ab.tolist() == [[False] * 6, [False, True, True, True, True, True]]
    for bad in (dict(rule="darcet"), dict(rule="absolute", threshold=0.0), dict(factor=float("nan"))):
        with pytest.raises(InvalidParameterError):
            high_norm_outliers(norms, 1, **bad)


def test_token_norms_rule_absolute_flags_norms_over_the_threshold() -> None:
    import timm

    import vitlens as vl
    torch.manual_seed(0)
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    x = torch.randn(2, 3, 32, 32)
    rel = vl.token_norms(m, x)
    threshold = float(np.quantile(rel.norms[:, :, 1:], 0.7))  # a threshold where the two rules differ
    ab = vl.token_norms(m, x, rule="absolute", threshold=threshold)
    want = np.zeros_like(ab.outliers)
    want[..., 1:] = rel.norms[..., 1:] > threshold  # Darcet et al.: a patch token whose norm is over the threshold
    assert (ab.outliers == want).all() and want.any()
    med = np.median(rel.norms[..., 1:], axis=-1, keepdims=True)
    assert (rel.outliers[..., 1:] == (rel.norms[..., 1:] > 4 * med)).all()
    assert (ab.outliers != rel.outliers).any() and ab.rule == "absolute" and f"norm > {threshold:g}" in ab.summary()
    with pytest.raises(InvalidParameterError, match="rule"):
        vl.token_norms(m, x, rule="median")


def test_text_span_evaluation_replaces_heads_in_the_sum_as_the_paper_does() -> None:
    from vitlens.components import evaluate_text_span
    from vitlens.components.head_vectors import head_vectors
    from vitlens.figures import figure_for

    m = build("hf-clip")
    torch.manual_seed(4)
    x = torch.randn(16, 3, 32, 32, dtype=torch.float64)
    rng = np.random.default_rng(1)
    texts = [f"t{k}" for k in range(40)]
    emb = rng.normal(size=(40, 16))
    classes = rng.normal(size=(5, 16))
    with torch.no_grad():
        f = m(pixel_values=x).image_embeds.numpy()
    # texts spanning the embedding, every head of every layer read: the heads are reproduced, nothing changes
    full = evaluate_text_span(m, x, texts, emb, classes, layers=[0, 1, 2], steps=16)
    assert np.allclose(full.explained, 1.0) and full.accuracy_model == full.accuracy_replaced == 1.0
    # two texts per head in the last layer: the replaced embedding written out from the paper's recipe
    labels = rng.integers(0, 5, size=16)
    for variant in ("normalised", "authors"):
        got = evaluate_text_span(m, x, texts, emb, classes, labels=labels, layers=[-1], steps=2, variant=variant,
                                 rank=6)
        v = head_vectors(m, x, "all")[0].numpy()
        heads = v.copy()
        heads[:, :2] = v[:, :2].mean(0)  # the other layers' heads mean-ablated
        for h in range(v.shape[2]):
            t = emb[got.chosen[0, h]]
            if variant == "authors":
                basis = np.linalg.svd(v[:, 2, h], full_matrices=False)[2][:6]
                t = t @ basis.T @ basis
            c = v[:, 2, h] - v[:, 2, h].mean(0)
            proj = c @ t.T @ np.linalg.pinv(t @ t.T) @ t  # the centred outputs on the texts' span
            heads[:, 2, h] = v[:, 2, h].mean(0) + proj
            assert got.explained[0, h] == pytest.approx((proj ** 2).sum() / (c ** 2).sum(), rel=1e-9)
        replaced = f - v.sum((1, 2)) + heads.sum((1, 2))
        assert got.accuracy_replaced == float(((replaced @ classes.T).argmax(-1) == labels).mean())
        assert got.accuracy_model == float(((f @ classes.T).argmax(-1) == labels).mean())
        assert got.labels_given and variant in got.summary()
        assert figure_for(got).layout.title.text.startswith(got.model_name)
    with pytest.raises(InvalidParameterError, match="labels"):
        evaluate_text_span(m, x, texts, emb, classes, labels=[7] * 16)
    with pytest.raises(InvalidParameterError, match="class_embeddings"):
        evaluate_text_span(m, x, texts, emb, classes[:, :3])


def test_the_prefix_view_counts_outliers_by_the_rule_it_is_given() -> None:
    """prefix_diagnostics takes the artifact rule by name as token_norms does: its outlier share per layer is the share
    of patch tokens of each block's output over the threshold (absolute) or over 4x the image's median (relative),
    computed here from the blocks' outputs read by hooks of the test's own."""
    import timm

    import vitlens as vl
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2).eval()
    x = torch.randn(2, 3, 32, 32)
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().double())) for b in model.blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    patch = np.stack([t.norm(dim=-1)[:, 1:].numpy() for t in seen])  # [L, B, 16]
    threshold = float(np.quantile(patch, 0.7))
    m = vl.LoadedModel.from_module(model, name="tiny", device="cpu", data_config={"input_size": (3, 32, 32)})
    rel = vl.prefix_diagnostics(m, x)
    ab = vl.prefix_diagnostics(m, x, outlier_rule="absolute", outlier_threshold=threshold)
    np.testing.assert_allclose(ab.outlier_share, (patch > threshold).mean(axis=(1, 2)))
    np.testing.assert_allclose(rel.outlier_share,
                               (patch > 4 * np.median(patch, axis=-1, keepdims=True)).mean(axis=(1, 2)))
    assert (ab.outlier_share != rel.outlier_share).any() and ab.outlier_rule == "absolute"
    assert ab.outlier_threshold == threshold
    with pytest.raises(InvalidParameterError, match="rule"):
        vl.prefix_diagnostics(m, x, outlier_rule="median")

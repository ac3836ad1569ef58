"""Text targets: CLIP / SigLIP attributions of the image-text similarity to a prompt (issue 21).

Known answer: on an open_clip CLIP the maps of ``target="a photo of a dog"`` equal the same
method applied by hand with torch autograd to s(x) = cos(encode_image(x), encode_text(tokens)),
tokens from ``open_clip.get_tokenizer``. Random-init towers (open_clip, HF CLIPModel, SiglipModel):
every method runs on a prompt through the class-target code path, finite, prompt-dependent, and
leaves images and model as they were."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl

TEXT = dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)
VISION = dict(image_size=32, patch_size=8, width=32, layers=2, head_width=16)
GRADIENT_METHODS = {"saliency": {}, "input_x_gradient": {}, "integrated_gradients": {"n_steps": 4},
                    "grad_rollout": {}, "occlusion": {}}


def char_tokenizer(prompts: list[str]) -> torch.Tensor:
    """A tokenizer for a 64-token vocabulary: 0 start, 1 end, the last 6 letters 2.., 8 ids per prompt."""
    rows = []
    for p in prompts:
        ids = [0] + [2 + ord(c) % 60 for c in p[-6:]] + [1]
        rows.append(ids + [1] * (8 - len(ids)))
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def open_clip_named(tmp_path_factory):
    """``open_clip:vitlens-tiny-text``: a tiny CLIP with open_clip's own 49,408-token vocabulary and tokenizer."""
    open_clip = pytest.importorskip("open_clip")
    path = tmp_path_factory.mktemp("oc") / "vitlens-tiny-text.json"
    path.write_text(json.dumps({"embed_dim": 16, "vision_cfg": VISION, "text_cfg": {**TEXT, "vocab_size": 49408}}))
    open_clip.add_model_config(path)
    torch.manual_seed(0)
    return vl.load_model("open_clip:vitlens-tiny-text", device="cpu")


def images(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def hand_similarity(m, x: torch.Tensor, prompt: str) -> torch.Tensor:
    import open_clip

    with torch.no_grad():
        text = F.normalize(m.model.encode_text(open_clip.get_tokenizer("vitlens-tiny-text")([prompt])), dim=-1)
    return (F.normalize(m.model.encode_image(x), dim=-1) * text).sum(-1)  # [B]


def blocks(a: torch.Tensor, reduce=torch.sum) -> np.ndarray:
    """[B, 3, 32, 32] pixel attributions -> [B, 4, 4]: channels summed, each 8 x 8 token block reduced."""
    b = a.detach().double().sum(1).reshape(a.shape[0], 4, 8, 4, 8)
    return reduce(reduce(b, dim=4), dim=2).numpy()


def test_text_target_maps_equal_the_method_applied_by_hand_to_the_cosine_similarity(open_clip_named, tmp_path):
    m, x, prompt = open_clip_named, images(), "a photo of a dog"
    xg = x.clone().requires_grad_(True)
    with torch.enable_grad():
        s = hand_similarity(m, xg, prompt)
        (grad,) = torch.autograd.grad(s.sum(), xg)
    sal = vl.attribute(m, x, method="saliency", target=prompt)
    np.testing.assert_allclose(sal.maps, blocks(grad.abs()), rtol=1e-4, atol=1e-7)
    ixg = vl.attribute(m, x, method="input_x_gradient", target=[prompt, prompt])
    np.testing.assert_allclose(ixg.maps, blocks(x * grad), rtol=1e-4, atol=1e-7)
    # occlusion of token (1, 2): the similarity drops by s(x) - s(x with that token's pixels zeroed)
    occ = vl.attribute(m, x, method="occlusion", target=prompt)
    xo = x.clone()
    xo[:, :, 8:16, 16:24] = 0
    with torch.no_grad():
        drop = (hand_similarity(m, x, prompt) - hand_similarity(m, xo, prompt)).double().numpy()
    np.testing.assert_allclose(occ.maps[:, 1, 2], drop, rtol=1e-4, atol=1e-6)
    assert sal.target_kind == "text" and sal.label_names == [prompt] and sal.target_name(1) == prompt
    assert list(sal.targets) == [0, 0] and "cosine similarity" in sal.params["score"]
    assert "for 'a photo of a dog'" in sal.summary()
    # deletion / insertion follow the similarity the maps explain: all tokens kept = s(x), all removed = s(mean)
    f = vl.deletion_insertion(m, x, sal, steps=2)
    with torch.no_grad():
        base = x.mean(dim=(2, 3), keepdim=True).expand_as(x)
        np.testing.assert_allclose(f.deletion[:, 0], hand_similarity(m, x, prompt).numpy(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(f.deletion[:, -1], hand_similarity(m, base, prompt).numpy(), rtol=1e-4, atol=1e-6)
    assert f.score == "cosine similarity to the prompt"
    back = vl.load_result(sal.save(tmp_path / "sal.json"))
    assert back.target_name(0) == prompt and np.allclose(back.text_embeddings, sal.text_embeddings)
    # every method of the comparison, rollout too (its class-agnostic map scored against the prompt)
    cmp = vl.compare_methods(m, x, methods=["rollout", "saliency"], target=prompt, steps=2)
    assert [r["method"] for r in cmp.rows] == ["rollout", "saliency"]
    np.testing.assert_allclose(cmp.faithfulness[1].deletion_auc, vl.deletion_insertion(m, x, sal, steps=2).deletion_auc)
    from vitlens.report.html import attribution_figures

    figs = attribution_figures(cmp, m.display(x)[0])
    assert prompt in figs["attributions"].layout.title.text
    assert figs["deletion_insertion"].layout.yaxis.title.text == "cosine similarity to the prompt"


@pytest.mark.parametrize("kind", ["openclip", "hf-clip-model", "hf-siglip-model"])
def test_every_method_explains_a_prompt_on_random_init_towers(kind):
    torch.manual_seed(0)
    tokenizer = char_tokenizer
    if kind == "openclip":
        open_clip = pytest.importorskip("open_clip")
        module = open_clip.model.CLIP(embed_dim=16, vision_cfg=VISION, text_cfg=TEXT)
    else:
        tr = pytest.importorskip("transformers")
        vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      image_size=32, patch_size=8)
        text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                    bos_token_id=0, eos_token_id=1, pad_token_id=1, max_position_embeddings=8)
        module = (tr.CLIPModel(tr.CLIPConfig(vision_config=vision, text_config=text, projection_dim=16))
                  if kind == "hf-clip-model" else tr.SiglipModel(tr.SiglipConfig(vision_config=vision,
                                                                                  text_config=text)))
        tokenizer = word_tokenizer() if kind == "hf-siglip-model" else char_tokenizer
    m = vl.LoadedModel.from_module(module, device="cpu", source="random init")
    before = {k: v.clone() for k, v in m.model.state_dict().items()}
    x = images()
    x0 = x.clone()
    dog, cat = "a photo of a dog", "a photo of a cat"
    for method, params in GRADIENT_METHODS.items():
        a = vl.attribute(m, x, method=method, target=dog, tokenizer=tokenizer, **params)
        b = vl.attribute(m, x, method=method, target=[cat, dog], tokenizer=tokenizer, **params)
        assert a.maps.shape == (2, 4, 4) and np.isfinite(a.maps).all() and np.isfinite(b.maps).all(), method
        assert not np.allclose(a.maps[0], b.maps[0]), method  # the cat prompt explains something else
        # the same prompt, the same map (float32 noise of a batch of two prompts apart)
        np.testing.assert_allclose(a.maps[1], b.maps[1], rtol=1e-3, atol=1e-3 * np.abs(a.maps[1]).max())
        assert b.label_names == [cat, dog] and [b.target_name(i) for i in range(2)] == [cat, dog]
    r = vl.attribute(m, x, method="rollout", target=dog, tokenizer=tokenizer)  # class-agnostic: the prompt recorded
    assert r.target_name(0) == dog and "recorded only" in r.params["score"] and r.maps.shape == (2, 4, 4)
    assert torch.equal(x, x0)
    assert all(torch.equal(v, before[k]) for k, v in m.model.state_dict().items())
    assert all(p.grad is None for p in m.model.parameters())


def word_tokenizer():
    """A Hugging Face fast tokenizer over a few words (SigLIP pads it to the text tower's full length)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "a", "photo", "of", "dog", "cat"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def test_text_targets_say_what_is_missing_and_take_pre_tokenised_ids():
    tr = pytest.importorskip("transformers")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    m = vl.LoadedModel.from_module(tr.CLIPModel(tr.CLIPConfig(vision_config=vision, text_config=text,
                                                              projection_dim=16)), device="cpu")
    x = images()
    for method in ("saliency", "rollout"):
        with pytest.raises(vl.InvalidParameterError, match="tokenizer="):
            vl.attribute(m, x, method=method, target="a photo of a dog")
    with pytest.raises(vl.InvalidParameterError, match="one per image"):
        vl.attribute(m, x, method="saliency", target=["a", "b", "c"], tokenizer=char_tokenizer)
    with pytest.raises(vl.InvalidParameterError, match="vocabulary of 64"):
        vl.attribute(m, x, method="saliency", target="dog", tokenizer=lambda p: torch.tensor([[0, 99, 1]]))
    ids = char_tokenizer(["a photo of a dog"])
    by_ids = vl.attribute(m, x, method="saliency", target={"input_ids": ids})
    m.tokenizer = char_tokenizer  # set once on the model, used by every call
    by_prompt = vl.attribute(m, x, method="saliency", target="a photo of a dog")
    np.testing.assert_allclose(by_ids.maps, by_prompt.maps)
    vision_only = vl.LoadedModel.from_module(tr.CLIPVisionModel(tr.CLIPVisionConfig(**vision)), device="cpu")
    with pytest.raises(vl.InvalidParameterError, match="no text tower"):
        vl.attribute(vision_only, x, method="saliency", target="a photo of a dog")


def test_a_hugging_face_folder_saved_with_its_tokenizer_needs_no_tokenizer_argument(tmp_path):
    """hf:FOLDER with tokenizer files: vitlens reads the tokenizer from there (SigLIP padded to full length)."""
    tr = pytest.importorskip("transformers")
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                bos_token_id=0, eos_token_id=1, pad_token_id=0, max_position_embeddings=8)
    torch.manual_seed(0)
    tr.SiglipModel(tr.SiglipConfig(vision_config=vision, text_config=text)).save_pretrained(tmp_path / "siglip")
    word_tokenizer().save_pretrained(tmp_path / "siglip")
    m = vl.load_model(f"hf:{tmp_path / 'siglip'}", device="cpu")
    x = images()
    a = vl.attribute(m, x, method="saliency", target="a photo of a dog")
    ids = word_tokenizer()(["a photo of a dog"], padding="max_length", max_length=8, return_tensors="pt")
    b = vl.attribute(m, x, method="saliency", target={"input_ids": ids["input_ids"]})
    np.testing.assert_allclose(a.maps, b.maps)
    assert a.target_name(0) == "a photo of a dog" and np.isfinite(a.maps).all()


def test_a_clip_model_without_a_target_is_told_to_give_a_prompt(open_clip_named):
    """Issue 29: vl.attribute(clip, img, method="saliency") said to use rollout or a model with a head; what the
    user needs is target="a prompt"."""
    with pytest.raises(vl.InvalidParameterError) as e:
        vl.attribute(open_clip_named, images(1), method="saliency")
    assert 'target="a photo of a dog"' in str(e.value) and "rollout" not in str(e.value)

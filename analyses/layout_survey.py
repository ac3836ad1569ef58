"""Which global-attention ViTs of timm, transformers and open_clip vitlens reads, and how exactly: a survey of tiny
random-init models (issue 31 §3).

Each model is built small (a few layers, 32-64 px where the model takes it), loaded with
``vl.LoadedModel.from_module`` (or ``vl.load_model`` for timm names) and, when vitlens reads it, captured in side and
inline mode on two random images and compared with the model's own non-fused attention:

- transformers: the same weights on ``attn_implementation="eager"``, ``output_attentions=True``;
- timm: a copy with every ``fused_attn`` off, the probabilities as they enter each block's ``attn_drop``;
- open_clip: softmax(ln_q(q) ln_k(k)^T / sqrt(d)) from each block's input (open_clip 3.3's own non-fused path fails
  on 4-D tensors); nn.MultiheadAttention blocks against ``need_weights=True``.

It prints one markdown table row per model: what vitlens gives (the family, or the refusal, or a crash) and the
largest absolute difference of the maps in side and inline mode, whether side capture left the outputs bit-identical,
and whether ``vl.analyze(m, x, views=("distance", "rollout"))`` ran. CPU only, single-threaded; a few minutes.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python analyses/layout_survey.py [--only SUBSTRING]
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
             patch_size=8)


# ------------------------------------------------------------------------------------------------ references


def hf_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor] | str:
    """The eager twin's attentions (same weights, attn_implementation='eager', output_attentions=True)."""
    from vitlens.families.hf import model_inputs, vision_tower

    tower = vision_tower(model)
    if not hasattr(type(tower), "_from_config"):  # an inner module (GIT's): the model itself, eager-only
        tower = model
    try:
        twin = type(tower)._from_config(copy.deepcopy(tower.config), attn_implementation="eager").eval()
        twin.load_state_dict(tower.state_dict())
        with torch.no_grad():
            out = twin(**model_inputs(twin, x, twin.forward), output_attentions=True)
    except Exception as e:  # noqa: BLE001 (a survey: every failure is a row)
        return f"no eager reference ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    if getattr(out, "attentions", None) is None:
        return "no eager reference (the eager model returns no attentions)"
    return [a.float() for a in out.attentions]


def timm_reference(m: Any, x: torch.Tensor) -> list[torch.Tensor] | str:
    """A copy with fused_attn off, the probabilities as they enter each attention module's attn_drop."""
    ref = copy.deepcopy(m.model)
    names = {id(a): n for n, a in m.model.named_modules()}
    by_name = dict(ref.named_modules())
    maps: list[torch.Tensor] = []
    for attn in m.family.attention_modules(m.model):
        twin = by_name[names[id(attn)]]
        for mod in twin.modules():
            if hasattr(mod, "fused_attn"):
                mod.fused_attn = False
        drop = getattr(twin, "attn_drop", None)
        if drop is None:
            return "no non-fused reference (the attention module has no attn_drop)"
        drop.register_forward_pre_hook(lambda _m, args: maps.append(args[0].detach().float()))
    with torch.no_grad():
        m.family.logits(ref, x)
    return maps


def open_clip_reference(m: Any, x: torch.Tensor) -> list[torch.Tensor] | str:
    from vitlens.families.openclip import visual_of

    blocks = visual_of(m.model).transformer.resblocks
    inputs: list[torch.Tensor] = []
    handles = [b.attn.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach())) for b in blocks]
    with torch.no_grad():
        m.family.logits(m.model, x)
    for h in handles:
        h.remove()
    maps = []
    with torch.no_grad():
        for block, h in zip(blocks, inputs):
            attn = block.attn
            if isinstance(attn, nn.MultiheadAttention):
                maps.append(attn(h, h, h, need_weights=True, average_attn_weights=False)[1])
                continue
            b, t, _ = h.shape
            q, k, _ = F.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
            q, k = (z.reshape(b, t, attn.num_heads, -1).transpose(1, 2) for z in (q, k))
            q, k = attn.ln_q(q), attn.ln_k(k)
            maps.append((q @ k.transpose(-2, -1) * attn.head_dim ** -0.5).softmax(-1))
    return maps


# ---------------------------------------------------------------------------------------------------- models


def hf(cls_name: str, config_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**config)).eval()

    return build


def hf_sub(cls_name: str, config_name: str, **config: Any) -> Callable[[], nn.Module]:
    """A vision tower whose class transformers does not export at the top level (from its modeling module)."""
    def build() -> nn.Module:
        import importlib

        import transformers

        module = importlib.import_module(f"transformers.models.{config.pop('_module')}")
        torch.manual_seed(0)
        return getattr(module, cls_name)(getattr(transformers, config_name)(**config)).eval()

    return build


def open_clip_tower(**options: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from open_clip.transformer import VisionTransformer

        torch.manual_seed(0)
        return VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=2, mlp_ratio=2.0,
                                 output_dim=16, **options).eval()

    return build


def coca(kind: Any = True) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import open_clip

        torch.manual_seed(0)
        return open_clip.CoCa(
            embed_dim=16 if kind is True else 32,
            vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2, head_width=16, mlp_ratio=2.0,
                            attentional_pool=kind, attn_pooler_heads=2, attn_pooler_queries=4, output_tokens=True),
            text_cfg=dict(context_length=8, vocab_size=64, width=16, heads=2, layers=1, embed_cls=True,
                          output_tokens=True),
            multimodal_cfg=dict(context_length=8, vocab_size=64, width=16, heads=2, layers=1)).eval()

    return build


SMALL_CLIP = dict(SMALL)
HF_CASES: list[tuple[str, Callable[[], nn.Module]]] = [
    ("DINOv3ViTModel (2 registers, RoPE)", hf("DINOv3ViTModel", "DINOv3ViTConfig", **SMALL, num_register_tokens=2)),
    ("Aimv2VisionModel (attention-pool head)", hf("Aimv2VisionModel", "Aimv2VisionConfig", **SMALL, use_head=True)),
    ("MetaClip2VisionModel", hf("MetaClip2VisionModel", "MetaClip2VisionConfig", **SMALL)),
    ("Data2VecVisionModel (relative bias)", hf("Data2VecVisionModel", "Data2VecVisionConfig", **SMALL,
                                               use_relative_position_bias=True)),
    ("BeitModel (shared relative bias)", hf("BeitModel", "BeitConfig", **SMALL, use_shared_relative_position_bias=True)),
    ("ViTMSNModel", hf("ViTMSNModel", "ViTMSNConfig", **SMALL)),
    ("AltCLIPVisionModel", hf("AltCLIPVisionModel", "AltCLIPVisionConfig", **SMALL)),
    ("ChineseCLIPVisionModel", hf("ChineseCLIPVisionModel", "ChineseCLIPVisionConfig", **SMALL)),
    ("OwlViTVisionModel", hf("OwlViTVisionModel", "OwlViTVisionConfig", **SMALL)),
    ("Owlv2VisionModel", hf("Owlv2VisionModel", "Owlv2VisionConfig", **SMALL)),
    ("CLIPSegVisionModel", hf("CLIPSegVisionModel", "CLIPSegVisionConfig", **SMALL)),
    ("XCLIPVisionModel", hf("XCLIPVisionModel", "XCLIPVisionConfig", **SMALL)),
    ("MLCDVisionModel (RoPE)", hf("MLCDVisionModel", "MLCDVisionConfig", **SMALL)),
    ("GitVisionModel", hf("GitVisionModel", "GitVisionConfig", **SMALL)),
    ("BlipVisionModel", hf("BlipVisionModel", "BlipVisionConfig", **SMALL)),
    ("Kosmos2VisionModel", hf_sub("Kosmos2VisionModel", "Kosmos2VisionConfig", _module="kosmos2.modeling_kosmos2",
                                  **SMALL)),
    ("InternVLVisionModel", hf("InternVLVisionModel", "InternVLVisionConfig", hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64, image_size=[32, 32], patch_size=[8, 8])),
    ("JanusVisionModel", hf("JanusVisionModel", "JanusVisionConfig", **SMALL)),
    ("Idefics3VisionTransformer", hf("Idefics3VisionTransformer", "Idefics3VisionConfig", **SMALL)),
    ("PixtralVisionModel (RoPE, block mask)", hf("PixtralVisionModel", "PixtralVisionConfig", hidden_size=32,
                                                 num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                                 image_size=32, patch_size=8, head_dim=16)),
    ("YolosModel (detection tokens)", hf("YolosModel", "YolosConfig", **{**SMALL, "image_size": [32, 32]},
                                         num_detection_tokens=4)),
    ("FlavaImageModel", hf("FlavaImageModel", "FlavaImageConfig", **SMALL)),
    ("VitPoseBackbone", hf("VitPoseBackbone", "VitPoseBackboneConfig", hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, mlp_ratio=2, image_size=[32, 32], patch_size=[8, 8])),
    ("DPTModel (ViT)", hf("DPTModel", "DPTConfig", **SMALL, backbone_out_indices=[0, 1])),
    ("TimmWrapperModel (timm vit_tiny)", lambda: __import__("transformers").TimmWrapperModel(
        __import__("transformers").TimmWrapperConfig(architecture="vit_tiny_patch16_224",
                                                     model_args={"img_size": 32, "depth": 2})).eval()),
    ("EomtForUniversalSegmentation (queries in the last blocks)", hf(
        "EomtForUniversalSegmentation", "EomtConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, image_size=32, patch_size=8, num_blocks=1, num_queries=4, num_register_tokens=1)),
    ("Qwen2VLVisionModel (packed patches)", hf_sub("Qwen2VisionTransformerPretrainedModel", "Qwen2VLVisionConfig",
                                                   _module="qwen2_vl.modeling_qwen2_vl", depth=2, embed_dim=32,
                                                   hidden_size=32, num_heads=2, patch_size=8)),
    ("VideoMAEModel (tubelets)", hf("VideoMAEModel", "VideoMAEConfig", **SMALL, num_frames=2, tubelet_size=2)),
    ("SwinModel", hf("SwinModel", "SwinConfig", image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                     num_heads=[1, 2], window_size=4)),
    ("HieraModel", hf("HieraModel", "HieraConfig", embed_dim=8, image_size=[64, 64], patch_size=[7, 7], depths=[1, 1],
                      num_heads=[1, 1], num_query_pool=1)),
    ("VitDetModel", hf("VitDetModel", "VitDetConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       image_size=32, patch_size=8, pretrain_image_size=32, window_size=2,
                       window_block_indices=[0])),
    ("SamVisionModel", hf("SamVisionModel", "SamVisionConfig", hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, image_size=32, patch_size=8, output_channels=16, window_size=2,
                          global_attn_indexes=[1], mlp_dim=64)),
]

OPEN_CLIP_CASES: list[tuple[str, Callable[[], nn.Module]]] = [
    ("VisionTransformer qk_norm (CustomResidualAttentionBlock)", open_clip_tower(qk_norm=True)),
    ("VisionTransformer head scale + inner norms", open_clip_tower(scale_heads=True, scale_attn_inner=True,
                                                                   scale_attn=True, scale_fc=True)),
    ("VisionTransformer scaled-cosine attention", open_clip_tower(scaled_cosine_attn=True)),
    ("CoCa (original attentional pooler)", coca(True)),
    ("CoCa 'parallel' pooler", coca("parallel")),
    ("CoCa 'cascade' pooler", coca("cascade")),
]
# issue 48 (h48c): DPT-hybrid and further global-attention towers of transformers 5.24
_BIT = dict(global_padding="same", layer_type="bottleneck", depths=[1, 1, 1], hidden_sizes=[32, 64, 128],
            embedding_size=32, num_groups=4, out_features=["stage1", "stage2", "stage3"],
            embedding_dynamic_padding=True)


def dpt_hybrid() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.DPTConfig(**SMALL | dict(image_size=64, patch_size=16), is_hybrid=True,
                                    backbone_featmap_shape=[1, 128, 4, 4], backbone_out_indices=[0, 1],
                                    neck_hidden_sizes=[32, 64, 32, 32], fusion_hidden_size=16,
                                    backbone_config=transformers.BitConfig(**_BIT))
    return transformers.DPTModel(config).eval()


HF_CASES += [
    ("DPTModel (hybrid, BiT stem)", dpt_hybrid),
    ("Blip2VisionModel", hf("Blip2VisionModel", "Blip2VisionConfig", **SMALL)),
    ("InstructBlipVisionModel", hf("InstructBlipVisionModel", "InstructBlipVisionConfig", **SMALL)),
    ("SmolVLMVisionTransformer", hf("SmolVLMVisionTransformer", "SmolVLMVisionConfig", **SMALL)),
    ("GroupViTVisionModel (grouping blocks)", hf("GroupViTVisionModel", "GroupViTVisionConfig", hidden_size=32,
                                                  num_hidden_layers=2, depths=[1, 1], num_group_tokens=[4, 0],
                                                  num_output_groups=[4, 4], num_attention_heads=2,
                                                  intermediate_size=64, image_size=32, patch_size=8)),
    ("MgpstrForSceneTextRecognition", hf("MgpstrForSceneTextRecognition", "MgpstrConfig", hidden_size=32,
                                         num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2.0, image_size=[32, 64],
                                         patch_size=8)),
    ("Pix2StructVisionModel (flattened patches)", hf("Pix2StructVisionModel", "Pix2StructVisionConfig", hidden_size=32,
                                                     num_hidden_layers=2, num_attention_heads=2, d_ff=64, d_kv=16,
                                                     patch_embed_hidden_size=48)),
    ("Dinov2Backbone", hf("Dinov2Backbone", "Dinov2Config", **SMALL, out_features=["stage2"])),
]


#: timm names and the keywords that make them small (tried with, then without)
TIMM_CASES: list[tuple[str, dict[str, Any]]] = [
    ("vit_relpos_small_patch16_224", dict(img_size=64, depth=2)),
    ("qwen3_vit_88m_enc", dict(img_size=64, depth=2)),
    ("deepseek_vit_412m_enc", dict(img_size=56, depth=2)),
    ("gemma4_vit_167m_enc", dict(img_size=64, depth=2)),
    ("gemma4_vit_167m", dict(img_size=64, depth=2)),
    ("vitamin_small_224", dict(img_size=64, depth=(2, 2, 2))),
    ("crossvit_tiny_240", dict()),
    ("convit_tiny", dict(img_size=64, depth=2)),
    ("tnt_s_patch16_224", dict(img_size=64, depth=2)),
    ("volo_d1_224", dict()),
    ("pit_ti_224", dict()),
    ("twins_svt_small", dict()),
    ("pvt_v2_b0", dict()),
    ("levit_128s", dict()),
    ("efficientformer_l1", dict()),
    ("coat_lite_tiny", dict()),
    ("visformer_tiny", dict()),
    ("nest_tiny", dict()),
    ("xcit_nano_12_p16_224", dict(depth=2)),
    ("cait_xxs24_224", dict(depth=2)),
    ("swin_tiny_patch4_window7_224", dict()),
    ("hiera_tiny_224", dict()),
    ("mvitv2_tiny", dict()),
    ("mvitv2_tiny", dict(img_size=112)),  # padded poolings: 28 -> 14 -> 7 -> 4 (issue 48)
    ("swinv2_tiny_window8_256", dict()),
    ("samvit_base_patch16", dict(img_size=64, depth=2)),
    ("naflexvit_base_patch16_gap", dict(depth=2)),
]


# --------------------------------------------------------------------------------------------------- one row


def fmt(v: float) -> str:
    return f"{v:.1e}"


def reference_for(m: Any, x: torch.Tensor) -> list[torch.Tensor] | str:
    source = type(m.model).__module__
    if source.startswith("transformers."):
        return hf_reference(m.model, x)
    if source.startswith("open_clip."):
        return open_clip_reference(m, x)
    return timm_reference(m, x)


def pool_difference(m: Any, x: torch.Tensor) -> str:
    """The pool attention (``capture_pool_attention``) against the pool's own: CoCa's nn.MultiheadAttention with
    need_weights=True, AIMv2's head written out; "" for a model without a pool vitlens reads."""
    from vitlens.errors import ViewNotAvailableError
    from vitlens.families.pooling import capture_pool_attention

    seen: list[tuple] = []
    visual = getattr(m.model, "visual", None)
    pool = getattr(visual, "attn_pool", None)
    if pool is not None and getattr(visual, "attn_pool_type", "") == "parallel":
        pool = visual.attn_pool_contrastive
    head = getattr(getattr(m.model, "head", None), "k_proj", None) and m.model.head
    target = pool.attn if pool is not None else head
    if target is None:
        return ""
    handle = target.register_forward_pre_hook(lambda _m, args: seen.append(args))
    try:
        with torch.no_grad(), capture_pool_attention(m) as cap:
            m.logits(x)
    except ViewNotAvailableError as e:
        return f"; pool refused: {str(e)[:90]}"
    finally:
        handle.remove()
    with torch.no_grad():
        if pool is not None:
            query, key, value = seen[-1][:3]
            want = target(query, key, value, need_weights=True, average_attn_weights=False)[1]
        else:
            h = seen[-1][0]
            b, t, d = h.shape
            heads = head.num_heads
            k = head.k_proj(h).reshape(b, t, heads, d // heads).transpose(1, 2)
            q = head.cls_token.reshape(1, 1, heads, d // heads).transpose(1, 2)
            want = ((q @ k.transpose(-2, -1)) / (d // heads) ** 0.5).softmax(-1)
    return f"; pool attention {tuple(cap.maps[0].shape)} max abs diff {fmt((cap.maps[0] - want).abs().max().item())}"


def survey(m: Any) -> str:
    """Side and inline capture against the model's own reference, the outputs, the two views."""
    import vitlens as vl

    size = m.spec.image_size
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    ref = reference_for(m, x)
    with torch.no_grad():
        plain = m.logits(x)
    diffs, identical = {}, None
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            out = m.logits(x)
        if mode == "side":
            identical = torch.equal(out, plain)
        if isinstance(ref, list):
            if len(ref) != len(cap.maps) or any(a.shape != b.shape for a, b in zip(ref, cap.maps)):
                return f"read by {m.spec.family}, but {len(cap.maps)} maps against {len(ref)} reference maps"
            diffs[mode] = max((a.float() - b).abs().max().item() for a, b in zip(cap.maps, ref))
    try:
        vl.analyze(m, x, views=("distance", "rollout"))
        views = "views run"
    except Exception as e:  # noqa: BLE001
        views = f"views fail ({type(e).__name__}: {str(e)[:80]})"
    geometry = f"{m.spec.grid[0]}x{m.spec.grid[1]} + {m.spec.num_prefix_tokens} prefix"
    exact = (f"side {fmt(diffs['side'])}, inline {fmt(diffs['inline'])}" if diffs else ref)
    ok = "exact" if diffs and max(diffs.values()) < 1e-5 else ("NOT EXACT" if diffs else "read (no reference)")
    return (f"{ok} ({m.spec.family}; {geometry}): max abs diff {exact}; side outputs bit-identical: "
            f"{'yes' if identical else 'NO'}; {views}{pool_difference(m, x)}")


def row(label: str, load: Callable[[], Any]) -> str:
    import vitlens as vl

    t0 = time.perf_counter()
    try:
        m = load()
    except vl.VitlensError as e:
        text = f"refused: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001
        text = f"CRASH at load: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    else:
        try:
            text = survey(m)
        except vl.VitlensError as e:
            text = f"loaded ({m.spec.family}), refused at capture: {str(e).splitlines()[0]}"
        except Exception as e:  # noqa: BLE001
            text = f"loaded ({m.spec.family}), CRASH at capture: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return f"| {label} | {text.replace('|', '/')} | {time.perf_counter() - t0:.1f} s |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the rows whose label contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import vitlens as vl

    print("| model | what vitlens gives | time |\n|---|---|---|")
    for label, build in HF_CASES:
        if args.only in f"transformers {label}":
            def load(build: Callable[[], nn.Module] = build) -> Any:
                return vl.LoadedModel.from_module(build(), device="cpu")
            print(row(f"transformers {label}", load), flush=True)
    for label, build in OPEN_CLIP_CASES:
        if args.only in f"open_clip {label}":
            def load(build: Callable[[], nn.Module] = build) -> Any:
                return vl.LoadedModel.from_module(build(), device="cpu")
            print(row(f"open_clip {label}", load), flush=True)
    for name, kwargs in TIMM_CASES:
        if args.only in f"timm {name}":
            def load(name: str = name, kwargs: dict = kwargs) -> Any:
                try:
                    return vl.load_model(name, pretrained=False, device="cpu", **kwargs)
                except vl.UnknownModelError:  # timm could not take the keywords: its own size
                    return vl.load_model(name, pretrained=False, device="cpu")
            print(row(f"timm {name}", load), flush=True)


if __name__ == "__main__":
    sys.exit(main())

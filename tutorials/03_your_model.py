# %% [markdown]
# # Your own model
#
# `vl.load_model` takes the embedded pair, any timm ViT name, a Hugging Face name or folder
# (`hf:`), an OpenCLIP architecture (`open_clip:`), torchvision's ViTs (`torchvision:`), a local
# checkpoint file with its architecture, or a module you built. Whatever it loads, it reads the
# model's *spec* (grid, stride, prefix tokens, layers x heads) from the model itself, checks that its
# family knows how to capture the attention exactly, and refuses with a message that says what to
# do otherwise. Everything below runs offline; the page [Supported models](../models.md) lists the
# families.

# %%
import torch
import vitlens as vl
from vitlens.reference.shapes import HELD_OUT_SEED, generate

images = list(generate(2, seed=HELD_OUT_SEED).images)

# %% [markdown]
# ## A timm name
#
# `pretrained=False` builds timm's architecture with random weights (no download); other keyword
# arguments go to `timm.create_model`, so a non-square input is one argument. Random weights are
# fine for the weight-free parts of the views (the grid, the distances' geometry) and for testing a
# pipeline, but their predictions and their learned filters mean nothing, and reports say so.

# %%
t = vl.load_model("vit_tiny_patch16_224", pretrained=False, img_size=(160, 224))
print(t.spec.describe())
print("weights:", t.weights)
d = vl.attention_distance(t, images)
print(d)

# %% [markdown]
# The views read the grid from the input: 10x14 tokens here, distances in pixels of the 160x224 input
# (random weights: every head attends almost uniformly, near the dotted line).

# %%
from vitlens import figures

figures.distance_figure([d], names=["vit_tiny_patch16_224, 160x224, random init"])

# %% [markdown]
# ## A checkpoint file with its architecture
#
# Your own fine-tuned weights: a `.safetensors` file, or a torch state dict (`.pth`, `.pt`, `.bin`),
# with `arch=` naming the timm architecture (or `ref-vit` / `ref-hybrid`) they belong to. Here we
# save the random model's state dict and load it back; the weights are identical.

# %%
from safetensors.torch import save_file

small = vl.load_model("vit_tiny_patch16_224", pretrained=False)
save_file(small.model.state_dict(), "my_vit.safetensors")
mine = vl.load_model("my_vit.safetensors", arch="vit_tiny_patch16_224")
same = all(torch.equal(a, b) for a, b in zip(small.model.state_dict().values(), mine.model.state_dict().values()))
print(mine.spec.name, "| weights:", mine.weights, "| identical to what was saved:", same)

# %% [markdown]
# ## A Hugging Face folder
#
# `hf:FOLDER` loads a folder written by `save_pretrained` (its `config.json` and weights, and its
# `preprocessor_config.json` for preprocessing when there is one). We build a small ViT from a
# config to have a folder to load.

# %%
from transformers import ViTConfig, ViTForImageClassification

config = ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, num_labels=3)
ViTForImageClassification(config).save_pretrained("tiny_hf_vit")
h = vl.load_model("hf:tiny_hf_vit")
print(h.spec.describe())

# %% [markdown]
# ## An OpenCLIP tower with a text prompt
#
# `open_clip:ARCH` builds OpenCLIP's architecture (random weights; `open_clip:ARCH/TAG` takes a tag's
# weights from the local cache). Its text tower is kept, so an attribution's `target` may be a
# prompt: the map then explains the cosine similarity of the image embedding and the prompt's text
# embedding. (With random weights the map means nothing; the mechanics are the same with real ones.)

# %%
clip = vl.load_model("open_clip:ViT-B-32")
print(clip.spec.describe())
att = vl.attribute(clip, images[:1], method="saliency", target="a photo of a ring")
print(att, "| explains:", att.target_name(0))

# %% [markdown]
# ## Your own module
#
# A ViT you built in code (or already loaded) goes through `vl.LoadedModel.from_module`; it works
# when its blocks are of a family vitlens knows (the message names the first block it does not).

# %%
import timm

module = timm.create_model("vit_small_patch16_224", pretrained=False, depth=2, num_classes=5)
u = vl.LoadedModel.from_module(module, name="my-two-block-vit")
print(u.spec.describe())

# %% [markdown]
# ## What the refusals mean
#
# Every refusal is a `vl.VitlensError` subclass whose message says what was wrong and what to do
# (in the app and on the command line the same message is shown in their own words).

# %%
def refusal(call):
    try:
        call()
    except vl.VitlensError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"

# a misspelt name: close names that would load are suggested
print(refusal(lambda: vl.load_model("vit_tiny_patch16_2240", pretrained=False)))
# an architecture whose attention vitlens cannot capture exactly (Swin's windows)
print(refusal(lambda: vl.load_model("swin_tiny_patch4_window7_224", pretrained=False)))
# hub weights with no network and no cache (HF_HUB_OFFLINE=1 here): fails at once, says how to pass a file
print(refusal(lambda: vl.load_model("vit_tiny_patch16_224.augreg_in21k_ft_in1k")))
# a checkpoint with no architecture
print(refusal(lambda: vl.load_model("my_vit.safetensors")))

# %% [markdown]
# A torch pickle that needs code to load (a whole pickled module rather than a state dict) is
# refused and never run: vitlens reads pickles with `weights_only=True` (see [Security](../security.md)).

# %%
torch.save(small.model, "whole_module.pth")      # pickles the class, not just tensors
print(refusal(lambda: vl.load_model("whole_module.pth", arch="vit_tiny_patch16_224")))

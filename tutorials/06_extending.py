# %% [markdown]
# # Extending vitlens: a new view, a new attribution method, a new family
#
# vitlens is built on registries, each the one source of what it names, all extended from one public place,
# `vitlens.registry`: the kinds of model (`register_kind`), the views (`register_view`: the streaming engine's
# consumers and the weight views), the attribution methods (`register_method`) and metrics (`register_metric`), and
# the model families (`register_family`). This tutorial adds a view, a method and a family, at run time, and uses
# them through the ordinary entry points.

# %%
import numpy as np
import torch
import vitlens as vl
from vitlens.views.distance import AttentionDistanceAccumulator
from vitlens.reference.shapes import HELD_OUT_SEED, generate

m = vl.load_model("ref-vit")
images = list(generate(16, seed=HELD_OUT_SEED).images)

# %% [markdown]
# ## A new view: attention entropy per head
#
# A view over attention is an `AttentionConsumer`: it hears `begin_batch`, then `on_attention(layer,
# attn, rows)` for every block (the whole [B, heads, T, T] map, or blocks of query rows of it, in
# order), then `end_batch`, and answers `result(spec)` and `merge(other)`. Here: the mean entropy
# (in nats) of each head's attention rows over all tokens. `vl.stream_attention` feeds it from the
# same forward pass as the built-in attention distance.

# %%
class AttentionEntropy(vl.AttentionConsumer):
    """Mean entropy of each head's attention rows (nats), summed in float64 over images and queries."""

    def __init__(self, layers: int, heads: int):
        self.total = np.zeros((layers, heads))
        self.count = np.zeros((layers, 1))

    def on_attention(self, layer, attn, rows=None):
        p = attn.double().clamp_min(1e-30)
        entropy = -(p * p.log()).sum(-1)             # [B, heads, rows]
        self.total[layer] += entropy.sum((0, 2)).numpy()
        self.count[layer] += entropy.shape[0] * entropy.shape[2]

    def result(self, spec):
        return self.total / self.count                # [layers, heads]

    def merge(self, other):
        out = AttentionEntropy(*self.total.shape)
        out.total, out.count = self.total + other.total, self.count + other.count
        return out


entropy = AttentionEntropy(m.spec.num_layers, m.spec.num_heads)
distance = AttentionDistanceAccumulator.for_model(m.spec)
n = vl.stream_attention(m, images, [entropy, distance])
h = entropy.result(m.spec)
print(f"{n} images; mean entropy per layer (nats):", np.round(h.mean(1), 3))
print(f"uniform attention over {m.spec.num_prefix_tokens + 64} tokens would be {np.log(65):.3f} nats")

# %% [markdown]
# Partial states over disjoint image sets merge exactly (what a survey's shards rely on):

# %%
a, b = AttentionEntropy(*h.shape), AttentionEntropy(*h.shape)
vl.stream_attention(m, images[:7], [a])
vl.stream_attention(m, images[7:], [b])
print("merged == one pass:", np.allclose(a.merge(b).result(m.spec), h, rtol=1e-12))
# are the local heads (short distance) the low-entropy ones? (not in this model: entropy counts the
# class token's share too, distance does not)
d = distance.result(m.spec).mean_px
print("correlation of entropy and distance over heads:", round(float(np.corrcoef(h.ravel(), d.ravel())[0, 1]), 3))

# %% [markdown]
# To make it a first-class view (offered by `analyze(views=...)`, the command line, the report, the
# app and `vitlens survey`), give it a module in `vitlens/views/`, a figure function in
# `vitlens/figures.py` decorated with `@draws(ItsResult)` (the report and the app find the figure by
# the result's class), and one `View(...)` entry in `VIEWS` in `vitlens/views/registry.py` (its
# name, the paper figure it serves, `kind="attention"`, the builder returning the consumer, the
# result type); a survey also needs its `state()` / `from_state()` as plain arrays.
# That step edits the package, so it is not executed here.
#
# ## A new attribution method
#
# A method is a `Method(name, fn, defaults)`, added with `vitlens.registry.register_method` (the one public place every
# registry is extended from: kinds, views, methods, metrics, families); `fn(model, x, targets, grid, params,
# score)` returns `(maps [b, gh, gw], targets [b])`, where `score(x)` gives the [b, K] outputs the
# targets index (class logits, or similarities to prompts). Here: gradient x input summed per
# token, signed. Everything downstream (faithfulness, the sanity check, the figures) takes it.

# %%
from vitlens.registry import Method, attribution_methods, register_method


def gradient_x_input_tokens(model, x, targets, grid, params, score):
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = score(x).gather(1, targets[:, None]).sum()
        (grad,) = torch.autograd.grad(out, x)
    per_pixel = (grad * x).sum(1)                       # [b, H, W]
    b, hh, ww = per_pixel.shape
    gh, gw = grid
    tokens = per_pixel.reshape(b, gh, hh // gh, gw, ww // gw).sum((2, 4))
    return tokens.detach().cpu().numpy(), targets.cpu().numpy()


register_method(Method("gxi_tokens", gradient_x_input_tokens))
assert "gxi_tokens" in attribution_methods()  # every list of methods reads the registry when it is shown
att = vl.attribute(m, images, method="gxi_tokens")
print(att)
print(vl.deletion_insertion(m, images, att))

# %%
from vitlens import figures

figures.attribution_figure([att, vl.attribute(m, images, method="input_x_gradient")], np.asarray(images[0]))

# %% [markdown]
# ## A new family
#
# A family tells vitlens how to read one kind of model exactly: `matches(model)`, `check`,
# `spec` (grid, stride, prefix tokens, layers x heads), `attention_modules`, `install_side` /
# `install_inline` (the capture, handed one `CaptureRequest`: where the maps go, by how many query
# rows), `abilities`, `pixel_filters`, `position_table`, `data_config`, `logits`
# (`vitlens/families/base.py` documents each). A new family is a subclass registered with
# `vitlens.families.register`; `family_of` takes the first that matches. Here, a family for a
# module of our own that wraps a timm ViT as `.backbone` (with its own head). It is an `Adapter`:
# every method it does not write is the timm family's, called on the backbone, and only the output
# is the wrapper's. (The spec is the backbone's, so it reports a feature model; a real family would
# read the wrapper's head too.)

# %%
import timm
from torch import nn
from vitlens.families import FAMILIES, Adapter, family_of, register


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=64,
                                          patch_size=8)
        self.head = nn.Linear(192, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


class WrappedTimm(Adapter):
    name = "wrapped-timm"
    reads = "a module with a timm ViT as .backbone"

    def inner(self, model):
        return model.backbone, family_of(model.backbone)

    def matches(self, model):
        return isinstance(model, Wrapper)

    def check(self, model, name):
        family_of(model.backbone, name)  # refuses a backbone no family reads

    def logits(self, model, x):
        return model(x)


register(WrappedTimm())
w = vl.LoadedModel.from_module(Wrapper().eval(), name="my-wrapper")
print(w.spec.describe())
print(vl.analyze(w, images[:4]))
print("families:", [f.name for f in FAMILIES])

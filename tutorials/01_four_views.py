# %% [markdown]
# # The paper's four views, and Fig. 11, on the embedded pair
#
# Dosovitskiy et al. (ICLR 2021, section 4.5 and appendix D) look inside a ViT in four ways:
# the principal components of the patch-embedding filters (Fig. 7 left), the cosine similarity of
# the position embeddings (Fig. 7 centre), the mean attention distance of every head in every layer
# (Fig. 7 right) and attention rollout (Fig. 6); Fig. 11 sets a ViT's attention distance beside its
# R50 hybrid's. This tutorial makes all of them offline on the embedded pair, `ref-vit` and
# `ref-hybrid` (8x8 token grids on 64x64 shape scenes), and reads them as the paper does.
# What each view computes exactly is on the [Definitions](../definitions.md) page.

# %%
import numpy as np
import vitlens as vl
from vitlens import figures
from vitlens.reference.shapes import HELD_OUT_SEED, generate

vit = vl.load_model("ref-vit")
hybrid = vl.load_model("ref-hybrid")
print(vit.spec.describe())
print(hybrid.spec.describe())

# %% [markdown]
# The images are held-out procedural scenes (the pair was trained on other seeds of the same
# generator), so predictions mean something here. `vl.analyze` computes every view; the two
# attention views come from one forward pass per batch.

# %%
scenes = generate(32, seed=HELD_OUT_SEED)
images = list(scenes.images)
a_vit = vl.analyze(vit, images)
a_hybrid = vl.analyze(hybrid, images)
print(a_vit)

# %% [markdown]
# ## Fig. 7 left: the embedding filters
#
# The paper shows the top principal components of the patch-embedding filters and reads them as
# "plausible basis functions for a low-dimensional representation of the fine structure within each
# patch". Each tile is one component, its three colour channels rescaled to [0, 1].

# %%
print(a_vit.filters)
figures.filters_figure(a_vit.filters, title="ref-vit: principal components of the embedding filters")

# %% [markdown]
# ## Fig. 7 centre: position-embedding similarity
#
# Tile (i, j) shows the cosine similarity of patch (i, j)'s position embedding with every other
# patch's. The paper reads it as the model having learned the 2D image topology: close patches
# have similar embeddings, and a row-column structure appears.

# %%
figures.position_figure(a_vit.position, title="ref-vit: position-embedding similarity")

# %% [markdown]
# A quantitative reading of the same picture: how similarity falls with grid distance.

# %%
sim = a_vit.position.similarity            # [gh, gw, gh, gw]
gh, gw = sim.shape[:2]
ii, jj = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
by_distance = {}
for i in range(gh):
    for j in range(gw):
        dist = np.maximum(abs(ii - i), abs(jj - j))   # Chebyshev distance on the grid
        for k in range(1, 4):
            by_distance.setdefault(k, []).append(float(sim[i, j][dist == k].mean()))
for k, values in by_distance.items():
    print(f"mean cosine similarity at grid distance {k}: {np.mean(values):.3f}")

# %% [markdown]
# ## Fig. 7 right: mean attention distance
#
# For each head, the distance in pixels between a query and the keys it attends to, weighted by
# the attention, averaged over queries and images. The paper's reading: in the lowest layers some
# heads attend locally and some globally, and distance grows with depth. The dotted line is what
# uniform attention over the image would give.

# %%
d_vit, d_hybrid = a_vit.distance, a_hybrid.distance
print(d_vit)
per_layer = d_vit.mean_px.mean(axis=1)
print("ref-vit mean distance per layer (px):", np.round(per_layer, 2))
print(f"last / first layer: {per_layer[-1] / per_layer[0]:.2f}x; uniform attention: {d_vit.uniform_px:.2f} px")
local = (d_vit.mean_px[0] <= 0.6 * d_vit.uniform_px).sum()
print(f"layer-1 heads at <= 0.6x the uniform distance: {local} of {d_vit.mean_px.shape[1]}")

# %%
figures.distance_figure([d_vit], names=["ref-vit"])

# %% [markdown]
# ## Fig. 11: the ViT beside its hybrid
#
# The paper's Fig. 11 shows that a hybrid, whose tokens come from a ResNet, has fewer local heads in
# its first layers: the CNN has already done the local work. The embedded pair shows the same
# contrast. Both models see 64 px wide inputs, so pixels compare directly.

# %%
ratio = d_hybrid.mean_px[0].mean() / d_vit.mean_px[0].mean()
print(f"layer-1 mean distance, hybrid / ViT: {ratio:.2f}x")
figures.distance_figure([d_vit, d_hybrid], names=["ref-vit", "ref-hybrid"])

# %% [markdown]
# ## Fig. 6: attention rollout
#
# Rollout multiplies the (identity-augmented, head-fused) attention matrices of all layers and
# shows the class token's row over the patches: where information was mixed from, not what caused
# the prediction (for that, see the [attributions tutorial](02_attributions.md)).

# %%
print(a_vit.rollout)
figures.rollout_grid_figure(a_vit.rollout, [np.asarray(im) for im in images[:4]])

# %% [markdown]
# # High resolution: memory budgets, one query's maps, the capture plan
#
# At 224 px a ViT-B/16 has T = 197 tokens and a block's attention map is small. At 768 px T = 2,305
# and every block's [batch, heads, T, T] map is 12 x T² floats per image: 255 MB a block, 3 GB for
# the twelve blocks of one image. vitlens never needs them all at once. The views compute the
# probabilities a block of *query rows* at a time, within a memory budget, and give the same numbers
# as whole maps. This tutorial shows what the capture plan chooses, checks that the numbers do not
# depend on it, and keeps one query's maps of a high-resolution image. It runs on a small random-init
# ViT at 512 px so that it stays quick on two cores; the [Performance](../performance.md) page has
# the 768 and 1024 px measurements.

# %%
import numpy as np
import vitlens as vl
from vitlens.engine import capture_plan

m = vl.load_model("vit_tiny_patch16_224", pretrained=False, img_size=512)
print(m.spec.describe())

# %% [markdown]
# ## What the capture plan chooses
#
# `capture_plan(m, batch, tokens, memory_budget_mb)` is the rule every view follows (its docstring
# gives it in full). For timm ViTs the views run the block's non-fused attention themselves, in
# blocks of query rows sized to the budget; a block holds all T rows (a whole map) when that fits.
# The default budget is one block's MLP activation at that batch and T, and no block is larger than
# `ROW_BLOCK_MB` (smaller blocks are faster), which is why a larger budget stops mattering at 1024 px.

# %%
for side in (224, 512, 768, 1024):
    tokens = 1 + (side // 16) ** 2
    for budget in (None, 64.0):
        plan = capture_plan(m, batch=4, tokens=tokens, memory_budget_mb=budget)
        rows = "all" if plan.query_rows is None or plan.query_rows >= tokens else plan.query_rows
        print(f"{side:5d} px  T={tokens:5d}  budget {plan.budget_mb:7.1f} MB  whole map {plan.whole_map_mb:8.1f} MB"
              f"  -> {plan.mode}, query rows per block: {rows}")

# %% [markdown]
# ## The numbers do not depend on the budget
#
# Attention distance at 512 px with the default budget and with a budget so small that each block
# holds only a few query rows: the same distances, to float32 rounding (the view's documented bound
# is 7.8e-6 relative; see [Definitions](../definitions.md)).

# %%
images = vl.sample_images()[:2]
d_default = vl.attention_distance(m, images, batch_size=2)
d_small = vl.attention_distance(m, images, batch_size=2, memory_budget_mb=2.0)
print(capture_plan(m, batch=2, memory_budget_mb=2.0))
rel = np.abs(d_small.mean_px - d_default.mean_px).max() / np.abs(d_default.mean_px).max()
print(f"largest relative difference between the two runs: {rel:.2e}")
assert rel < 7.8e-6

# %% [markdown]
# ## One query's maps
#
# `vl.attention_maps(m, image)` keeps every block's whole map of one image: L x heads x T² floats
# (here 12 x 3 x 1025² x 4 bytes = 144 MiB; 3 GB for ViT-B at 768 px). Asking for some queries keeps
# only their rows, computed as the capture plan says, so memory stays at one block of rows plus the
# kept rows whatever T.

# %%
centre = vl.query_token(m.spec, row=16, col=16)
one = vl.attention_maps(m, images[0], queries=[0, centre])
print(one)
print("kept:", tuple(one.maps.shape), f"= {one.maps.nbytes / 2**20:.1f} MiB;",
      f"every query's maps would be {12 * 3 * 1025 * 1025 * 4 / 2**20:.0f} MiB")

# %% [markdown]
# Each kept row is a probability distribution over the T keys. The figure shows where the centre
# patch attends in every head of the last block (a random-init model: the maps only show the
# mechanics).

# %%
from vitlens import figures

x = m.preprocess(images[:1])
display = np.asarray(((x[0].permute(1, 2, 0).numpy() * np.array(m.data_config["std"])
                       + np.array(m.data_config["mean"])).clip(0, 1) * 255).astype(np.uint8))
heads = one.query_attention(layer=11, query=centre)
print("rows sum to", float(one.maps[11, :, 1].sum(-1).mean()))
figures.heads_figure(display, heads, layer=11, query_label="patch (16, 16)")

# %% [markdown]
# # Components: the output as an exact sum, the logit lens, token norms and patching
#
# Attention maps say where a head looks, not what it adds to the answer. `vl.decompose` writes a ViT's
# class logit as an exact sum: the patch, position and prefix embeddings, each head per source token, each MLP
# and the biases, the final norm's scale held at the forward's value. A **ledger** says how closely the parts
# add up to the output, and is printed with every result. Beside it: the logit lens (what each depth's residual
# already predicts), token norms by depth (the high-norm "artifact" tokens of Darcet et al., ICLR 2024) and
# activation patching (which components a corrupted image needs back). All on the embedded `ref-vit`, offline;
# the definitions are on the [Definitions](../definitions.md) page ("Direct contributions" and after).
#
# The same numbers from the command line and the app:
#
# ```bash
# vitlens report --components --out report.html        # a components section per model
# vitlens survey --models ref-vit --views components --out zoo   # each head's mean part, merged across shards
# streamlit run app.py                                 # the Components page
# ```

# %%
import numpy as np
import pandas as pd
import vitlens as vl
from vitlens import figures
from vitlens.reference.shapes import HELD_OUT_SEED, generate

m = vl.load_model("ref-vit")
scenes = generate(4, seed=HELD_OUT_SEED)
image = scenes.images[0]
d = vl.decompose(m, [image])  # the predicted class; target=k for another, direction=u for a direction
print(d)

# %% [markdown]
# ## The ledger
#
# Each part summed over its layers, heads and tokens, their total and the output of the forward. The gap,
# relative to the largest entry, is the ledger: here at float32's precision (the forward ran in float32; in
# float64 it is below 1e-12).

# %%
ledger = pd.DataFrame([{"part": k, "value": float(np.asarray(v)[0].sum())} for k, v in d.parts().items()])
print(f"sum of parts {d.total()[0]:.6f}, output {d.output[0]:.6f}, ledger {d.ledger()[0]:.1e}")
ledger

# %% [markdown]
# ## What each head adds
#
# The layer x head table (each head's part summed over the tokens it reads from) and the top heads; then the
# top head's part per source token on the patch grid: which image tokens it writes into the logit.

# %%
print("top heads (layer, head, part), 0-based:", [(l, h, round(v, 3)) for l, h, v in d.top_heads(3)])
figures.contributions_figure(d)

# %%
layer, head, _ = d.top_heads(1)[0]
figures.head_contribution_figure(d, layer, head)

# %% [markdown]
# ## The logit lens
#
# Each depth's residual read through the model's own final norm and head: the target's logit by depth, from the
# embeddings (depth 0) to the output (the last depth equals it exactly).

# %%
lens = vl.logit_lens(m, [image])
print(lens)
figures.logit_lens_figure(lens)

# %% [markdown]
# ## Token norms by depth
#
# The residual's norm per token at every depth. An outlier is a patch token whose norm exceeds 4x its image's
# median patch-token norm at that depth; the small reference ViT has none (large ViTs without registers do).

# %%
norms = vl.token_norms(m, [image])
print(norms)
figures.token_norms_figure(norms)

# %% [markdown]
# ## Activation patching
#
# The corruption: the object masked out (its pixels set to the background's mean colour). Each block's attention
# and MLP branch, each head and each token of each block's output is put from the clean run into the corrupted
# one, many patches per forward; the figure shows the share of the clean logit each head's patch restores.

# %%
masked = image.copy()
mask = scenes.masks[0]
masked[mask] = image[~mask].mean(0).astype(np.uint8)
p = vl.patch_activations(m, [image], [masked])
print(p)
figures.patching_figure(p)

# %% [markdown]
# No single head brings the object back here; whole branches and single tokens of the residual say more. By layer:
# the share restored by the attention branch, by the MLP branch, and by the best single token of the block's output
# (`p.resid`, a layer x token table; the class token is token 0).

# %%
pd.DataFrame({"layer": np.arange(1, len(p.attn) + 1), "attention branch": p.restored(p.attn),
              "MLP branch": p.restored(p.mlp), "best token": p.restored(p.resid).max(1),
              "which token": p.restored(p.resid).argmax(1)}).round(3)

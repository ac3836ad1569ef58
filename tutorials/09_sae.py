# %% [markdown]
# # Features of the residual stream: a sparse autoencoder finds the shapes
#
# A sparse autoencoder (SAE) writes each token of a block's residual stream as a few non-negative features, each a
# direction of the stream; a feature is read by the patches that light it up. Here one is trained on the embedded
# `ref-vit` as the reference scenes stream (one forward per batch, nothing dumped to disk), and we look for the six
# shapes among its features: where each fires, which heads write it (local or global ones, Fig. 7 right), and what
# the model does when it is taken out. Offline, on 2 cores, in about a minute; the quantities are defined on the
# [Definitions](../definitions.md) page ("SAE feature views", "SAE feature interventions").
#
# The same from the command line and the app:
#
# ```bash
# vitlens report --train-sae --sae-features 256 --out report.html   # an SAE section per model
# vitlens report --sae FOLDER --out report.html                     # an SAE saved with vitlens.sae.save_sae
# streamlit run app.py                                              # the Features (SAE) page
# python analyses/sae_shapes.py                                     # the shapes found again, against PCA
# ```

# %%
import pandas as pd
import vitlens as vl
from vitlens import figures
from vitlens.reference.shapes import CLASSES, HELD_OUT_SEED, generate

m = vl.load_model("ref-vit")
train = generate(1000, seed=7)  # a stream of scenes neither the model's training nor the held-out split uses
trained = vl.train_sae(m, list(train.images), site="blocks.3.hook_resid_post", n_features=256, k=8,
                    tokens="patches", epochs=3, seed=0)
print(trained.summary())

# %% [markdown]
# ## Every feature over held-out scenes
#
# `vl.sae_features` streams the held-out scenes once: in the same forward it reads the SAE's site, every head's
# output before its projection, the final norm's input and the attention (for each head's mean distance). Each
# feature gets its activation frequency, histogram, mean per grid cell and per class, and its direct logit effect
# (its decoder direction read through the final norm and the head).

# %%
held = generate(300, seed=HELD_OUT_SEED)
r = vl.sae_features(m, trained, list(held.images), labels=held.labels, top=6)
print(r)
figures.sae_frequency_figure(r)

# %% [markdown]
# ## A feature per shape
#
# For each shape, the feature whose mean activation on scenes of that shape stands furthest above its mean on the
# other scenes, with the share of its per-class mean activation that falls on its shape and the class its logit
# effect raises most.

# %%
selectivity = r.class_mean - (r.class_mean.sum(1, keepdims=True) - r.class_mean) / (len(CLASSES) - 1)
rows = []
for c, shape in enumerate(CLASSES):
    f = int(selectivity[:, c].argmax())
    share = r.class_mean[f] / max(r.class_mean[f].sum(), 1e-12)
    rows.append({"shape": shape, "feature": f, "frequency": r.frequency[f], "share on its shape": share[c],
                 "raises most": r.top_logits(f, 1)[0][0]})
found = pd.DataFrame(rows)
found

# %% [markdown]
# ## Where one fires
#
# The star's feature over its top held-out scenes (its activation per patch, one colour scale), then its numbers:
# histogram, mean per grid cell (to read beside the position-embedding view, Fig. 7 centre), per class and its logit
# effect.

# %%
star = int(found.loc[found["shape"] == "star", "feature"].iloc[0])
shown = m.display(list(held.images))
figures.sae_top_images_figure(r, star, shown)

# %%
figures.sae_feature_figure(r, star)

# %% [markdown]
# ## Who writes it
#
# Each head's output read along the feature's encoder direction, on the tokens where the feature fires, against the
# head's mean attention distance over the same scenes: a feature written by local heads sits on the left.

# %%
figures.sae_writers_figure(r, star)

# %% [markdown]
# ## Taking it out
#
# `vl.sae_intervene` removes the feature's decoder contribution at its site (`x - z_f W_dec[f]`) on its top
# scenes; the logits and the rollout (Fig. 6) before and after, each from one stream.

# %%
top = [int(i) for i in r.top_images[r.row(star)] if i >= 0][:3]
edit = vl.sae_intervene(m, trained, [held.images[i] for i in top], star)
print(edit)
figures.sae_intervention_figure(edit, [shown[i] for i in top])

# %% [markdown]
# How well a single feature tells each shape apart, and whether it beats the best PCA direction and dictionary
# learning on the same tokens, is measured per layer by `analyses/sae_shapes.py` (held-out F1, and the share of a
# feature's activation inside the object's mask).

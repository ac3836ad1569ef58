# %% [markdown]
# # Attributions: every method, the sanity check, the faithfulness table
#
# Rollout (see the [four views](01_four_views.md)) shows where information was mixed; it is the
# same map whatever the class. An *attribution* explains one output: a class's logit, or for a
# CLIP/SigLIP model the similarity to a text prompt. vitlens runs every method on one contract
# (images in, `[B, gh, gw]` maps on the token grid out), then scores them with the same metrics.
# This tutorial runs on `ref-vit` and six held-out shape scenes, whose object masks say where the
# evidence is.

# %%
import numpy as np
import vitlens as vl
from vitlens.registry import attribution_methods
from vitlens import figures
from vitlens.reference.shapes import CLASSES, HELD_OUT_SEED, generate

m = vl.load_model("ref-vit")
scenes = generate(6, seed=HELD_OUT_SEED)
images, masks = list(scenes.images), scenes.masks
print("classes:", CLASSES)
print("labels: ", [CLASSES[i] for i in scenes.labels])
print("methods:", ", ".join(attribution_methods()))

# %% [markdown]
# ## Every method
#
# `vl.attribute(m, images, method=...)` explains the predicted class unless `target=` names one
# (a class index per image, or a prompt for a text tower). The Grad-CAM family runs through
# pytorch-grad-cam on the last block's pre-attention norm; `attnlrp` is AttnLRP (Achtibat et al.
# 2024). Here every method explains the first scene.

# %%
results = {name: vl.attribute(m, images[:1], method=name) for name in attribution_methods()}
for name, att in results.items():
    print(f"{name:22s} maps {tuple(att.maps.shape)}  explains {att.target_name(0)!r}")

# %%
figures.attribution_figure([results[n] for n in ("rollout", "grad_rollout", "saliency", "integrated_gradients",
                                                 "attnlrp", "gradcam")], np.asarray(images[0]))

# %% [markdown]
# ## The sanity check
#
# Adebayo et al. (2018): re-initialise the model's weights from the top down (head, last block, ...,
# embedding, on a copy of the model) and recompute the map at each step. A map that explains the
# model should change when the weights it depends on are gone; one that barely changes is showing
# the image (or the architecture), not what the model learned. The verdict is one rule for every
# method, the same the app and the report print (`vitlens.attribution.sanity.verdict_rule`), and its
# one cutoff is the dotted line on the figure's left panel:

# %%
from vitlens.attribution.sanity import verdict_rule

table = vl.sanity_table(m, images[:3], methods=["rollout", "grad_rollout", "saliency", "attnlrp"])
print(verdict_rule(table.results[0].threshold))
print(table)
for result in table.results:
    print(result.verdict())

# %%
figures.sanity_figure(table.results)

# %% [markdown]
# ## The faithfulness table
#
# `vl.compare_methods` scores methods side by side. How to read its columns:
#
# - **deletion AUC** (lower is better): replace the tokens the map ranks highest first by the
#   baseline, and follow
#   the explained class's probability; a faithful map makes it fall fast.
# - **insertion AUC** (higher is better): start from the image with every token replaced by the
#   baseline (the image mean by default) and put back the highest-ranked tokens first; a faithful
#   map makes the probability rise fast.
# - **positive / negative perturbation** (Chefer et al. 2021; lower / higher is better): the same
#   idea with 10-90% of tokens set to black.
# - **pointing game** and **mass in mask** (higher is better, when masks are given): is the map's
#   maximum inside the object, and what share of its mass is.
#
# A method that does well on mass in mask but not on deletion finds the object but not what the
# model used; these metrics disagree often, which is why they are shown together.

# %%
cmp = vl.compare_methods(m, images, methods=["rollout", "grad_rollout", "saliency", "input_x_gradient",
                                             "attnlrp", "gradcam"], masks=masks)
cmp.to_pandas()

# %%
figures.faithfulness_figure(cmp.faithfulness)

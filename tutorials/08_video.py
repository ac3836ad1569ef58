# %% [markdown]
# # Video: Fig. 11 in space and time
#
# The ViT paper asked how far each head looks in the image (Fig. 7 right) and compared models by it (Fig. 11).
# A video transformer's heads have two answers: how far they look **across the frame** (pixels) and how far
# **across frames** (frames, or seconds with the clip's frame rate). `vl.attention_distance` gives both on a
# clip, beside what uniform attention would give, and `figures.spacetime_compare_figure` draws two or more
# video models side by side: the space-time Fig. 11. The definitions are on the
# [Definitions](../definitions.md) page ("Video: space and time").
#
# This tutorial compares two small **random-init** models offline: a VideoMAE (tubelets of 2 frames, one joint
# attention over every token of the clip) and a TimeSformer (a token per frame and cell, divided attention: a
# temporal then a spatial map in every block), on a synthetic clip of a square moving at a known speed. The
# same comparison from the command line, on any clip (a video file, an animated GIF or a folder of frames):
#
# ```bash
# vitlens compare --video clip.mp4 --models hf:MCG-NJU/videomae-base hf:facebook/timesformer-base-finetuned-k400
# vitlens report --video clip.gif --fps 8 --model hf:./my-videomae    # every view of one model; hf:FOLDER
# ```

# %%
import numpy as np
import torch
import transformers
import vitlens as vl
from vitlens import figures

moving = vl.moving_shape_clip(num_frames=16, size=64, velocity=(0.0, 3.0), seed=1)  # 3 px a frame, rightwards
clip = moving.clip
print(clip)
print("the square's centre (y, x) in frames 0, 5, 10, 15:", moving.centres[[0, 5, 10, 15]].round(1).tolist())

# %% [markdown]
# ## Two video models, built from their configurations
#
# Both read 8 frames of 64x64 as 4x4 cells of 16 px; four blocks of four heads. They are built with the
# configurations' own initialisation (`from_config`), as a model is before training; `vl.LoadedModel.from_module`
# wraps a model built in code (`vl.load_model("hf:FOLDER")` loads one saved with `save_pretrained`).

# %%
common = dict(image_size=64, patch_size=16, num_frames=8, hidden_size=64, num_hidden_layers=4,
              num_attention_heads=4, intermediate_size=128)
torch.manual_seed(0)
videomae = vl.LoadedModel.from_module(
    transformers.VideoMAEModel(transformers.VideoMAEConfig(tubelet_size=2, **common)), name="VideoMAE (random)")
timesformer = vl.LoadedModel.from_module(
    transformers.TimesformerModel(transformers.TimesformerConfig(**common)), name="TimeSformer (random)")
for m in (videomae, timesformer):
    print(m.spec.describe()["token order"])

# %% [markdown]
# Each model samples the clip as its processor does (8 of the 16 frames, uniformly: every other frame) and
# normalises it with its processor's statistics (`vl.clip_pixel_values`). One call gives every head's distances
# over the clip; `fps=` adds the temporal distance in seconds. It is the rate of the frames the model **reads**:
# every other frame of an 8 fps clip comes at 4 fps (`vitlens report --video` and `compare --video` work it out
# from the file's rate the same way).

# %%
distances = []
for m in (videomae, timesformer):
    x = vl.clip_pixel_values(clip, m)  # [1, 8, 3, 64, 64]
    read_fps = clip.fps * x.shape[1] / clip.num_frames  # 8 of 16 frames at 8 fps: 4 fps
    distances.append(vl.attention_distance(m, x, fps=read_fps))
    print(distances[-1])
figures.spacetime_compare_figure(distances, ["VideoMAE (random)", "TimeSformer (random)"])

# %% [markdown]
# ## What random weights show, and what they do not
#
# Every dot sits on its model's dotted line: with the configurations' initialisation (weights of standard
# deviation 0.02) the attention logits are close to 0, so every head attends almost uniformly, and its distances
# are those of uniform attention. The lines themselves are geometry, the same for any weights: uniform attention
# over a 4x4 grid of 16 px averages 32.1 px between cell centres; over the TimeSformer's 8 frames the mean gap
# between two frames is 2.625 frames (0.66 s at 4 fps), and over the VideoMAE's 4 tubelets (centres 2 frames
# apart) 2.5 frames. The numbers below check that every head is within 1% of its baseline.
#
# What this does **not** show: anything a trained model learned. The paper's finding (some heads local in the
# first layers, distance rising with depth) is a property of trained weights; here no head is local in space or
# in time, the square's motion leaves no trace, and the two models differ only in their geometry (tubelets vs
# frames, joint vs divided maps). The figure and the numbers are what the machinery computes from the maps
# (checked against an independent computation in the tests); the reading needs real checkpoints.

# %%
for d, name in zip(distances, ["VideoMAE", "TimeSformer"]):
    spatial = [i for i, r in enumerate(d.roles) if r != "temporal"]  # a divided model's temporal maps: 0 px by
    temporal = [i for i, r in enumerate(d.roles) if r != "spatial"]  # construction (and its spatial maps 0 frames)
    gap_px = np.abs(d.spatial_px[spatial] / d.baseline_spatial_px[spatial, None] - 1).max()
    gap_t = np.abs(d.temporal_frames[temporal] / d.baseline_temporal_frames[temporal, None] - 1).max()
    assert gap_px < 0.01 and gap_t < 0.01, (name, gap_px, gap_t)
    print(f"{name}: uniform {d.baseline_spatial_px[spatial[0]]:.1f} px and "
          f"{d.baseline_temporal_frames[temporal[0]]:.3f} frames; every head within {100 * gap_px:.2f}% (space) "
          f"and {100 * gap_t:.2f}% (time) of it")

# %% [markdown]
# ## Rollout through space-time
#
# Rollout composes every block's maps with the residual (through a divided block, its temporal then its spatial
# map) and reads the source's row: a map per frame or tubelet, divided by its maximum over the clip so that the
# frames compare. Near-uniform attention gives a near-flat rollout (every cell between 0.98 and 1 of the most,
# one colour on the scale from 0): here over the frames the TimeSformer reads.

# %%
x = vl.clip_pixel_values(clip, timesformer)
rollout = vl.attention_rollout(timesformer, x)
print(rollout, "- least / most of the maps:", rollout.maps.min().round(3), rollout.maps.max())
sampled = vl.read_clip(clip, 8).frames  # the 8 frames it samples, already 64x64: no resize, no crop
figures.spacetime_rollout_figure(rollout, frames=sampled)

# %% [markdown]
# ## With real checkpoints
#
# Where there is a network, the same lines read trained models (the weights download once into the Hugging
# Face cache); each samples the clip as its own processor does (VideoMAE 16 frames at 224 px, TimeSformer 8):
#
# ```python
# mae = vl.load_model("hf:MCG-NJU/videomae-base")
# ts = vl.load_model("hf:facebook/timesformer-base-finetuned-k400")
# clip = vl.read_clip("clip.mp4")    # PyAV: pip install 'vitlens[video]'; a GIF or a folder of frames needs no more
# ds = [vl.attention_distance(m, vl.clip_pixel_values(clip, m), fps=clip.fps) for m in (mae, ts)]
# figures.spacetime_compare_figure(ds, ["VideoMAE-B", "TimeSformer-B"])
# ```
#
# `vitlens compare --video clip.mp4 --models ...` writes the same figure, each model's numbers by map and its
# rollout over the frames into one offline HTML page (and the numbers as JSON); `vitlens report --video` adds
# the video weight views (the tubelet filters per time step, the position embeddings over space and time).

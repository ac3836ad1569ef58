# %% [markdown]
# # A survey: a model zoo x an image set on Ray
#
# `vl.survey` (and `vitlens survey` on the command line) runs several models over one image set on
# Ray, a (model, image shard) task at a time, writes every finished shard atomically, and merges the
# shards' partial states exactly into one tidy table. A rerun skips finished shards, so a survey
# killed at any moment resumes to the same numbers. This tutorial surveys the embedded pair over 32
# held-out scenes on a local Ray (kept on 127.0.0.1 with token authentication; see
# [Security](../security.md)), resumes it, and reads the table with pandas and duckdb.
#
# The same survey from the command line:
#
# ```bash
# vitlens survey --models ref-vit ref-hybrid --n-images 32 --out zoo
# vitlens survey-report zoo --out zoo.html
# ```

# %%
import vitlens as vl
from vitlens.survey import shapes_source

images = shapes_source(32)
s = vl.survey(["ref-vit", "ref-hybrid"], images, out="zoo", shard_size=16, num_cpus=2, progress=False)
print(s)

# %% [markdown]
# ## Resuming
#
# Running the same survey again finds every shard finished (their bytes checked against the sha256
# recorded beside them) and computes nothing; adding a model to the list would compute only its
# shards. The table is the same.

# %%
again = vl.survey(["ref-vit", "ref-hybrid"], images, out="zoo", shard_size=16, num_cpus=2, progress=False)
print(again)
same = again.table.sort_values(list(again.table.columns[:-1])).reset_index(drop=True).equals(
    s.table.sort_values(list(s.table.columns[:-1])).reset_index(drop=True))
print("the same table:", same)

# %% [markdown]
# ## Reading the table
#
# `zoo/table.parquet` has one row per (model, weights, layer, head, metric, class): pandas and duckdb
# read it directly, without vitlens. `class` is empty (null) for the numbers over all images; the shape
# scenes have labels, so each class has its own rows as well.

# %%
import pandas as pd

table = pd.read_parquet("zoo/table.parquet")
print(table.columns.tolist())
print(table["metric"].unique().tolist())
table.head(8)

# %% [markdown]
# Fig. 11 as a query: each model's mean attention distance per layer, over all images (8 heads a layer).

# %%
import duckdb

duckdb.sql("""
    SELECT model, layer, round(avg(value), 2) AS mean_distance_px, count(*) AS heads
    FROM 'zoo/table.parquet'
    WHERE metric = 'mean_distance_px' AND class IS NULL
    GROUP BY model, layer ORDER BY model, layer
""").df()

# %% [markdown]
# `vl.load_survey(path).distance(model)` gives a model's `AttentionDistanceResult` back, so the
# figures work on surveys too.

# %%
from vitlens import figures

zoo = vl.load_survey("zoo")
figures.distance_figure([zoo.distance("ref-vit"), zoo.distance("ref-hybrid")], names=["ref-vit", "ref-hybrid"])

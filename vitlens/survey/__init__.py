"""Surveys past one machine: a model zoo x an image set on Ray, resumable and fault-tolerant,
merged into one tidy table (paper Fig. 11 across a whole zoo).

- ``sources``: the image set, cut into shards workers read by themselves;
- ``stats``: the partial states a shard returns (they merge exactly);
- ``worker``: a model held by a Ray worker process from task to task, shards in, states out;
- ``run``: the driver (``vl.survey``) and its scheduler; ``ray_setup``: the Ray it runs on (a local one private and
  authenticated); ``checks``: what the driver settles in the folder before Ray;
- ``store``: the survey folder, every name of ``shard_store`` (shards, manifest, checksum records), ``entries`` (the
  manifest's model entries), ``table`` (the Parquet table) and ``result`` (``vl.load_survey``); ``reading``: a
  folder's files read within bounds;
- the survey's offline HTML page is ``vitlens.report.survey``.
"""
from __future__ import annotations

from .run import SurveyError, survey
from .sources import ImageSource, clips_source, files_source, shapes_source
from .store import SurveyResult, load_survey

__all__ = ["ImageSource", "SurveyError", "SurveyResult", "clips_source", "files_source", "load_survey", "shapes_source",
           "survey"]

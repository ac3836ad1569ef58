"""A survey folder (``OUT/``): the shard store, its manifest entries, the tidy table and the finished survey, each
in a module of its own, every name importable from here as it was before they were split (issue 61, item 5):

- ``shard_store``: ``SurveyStore`` (the lock, the manifest, the shards and their checksum records: the folder's
  layout and its rules are that module's docstring) and its errors;
- ``entries``: what a manifest's model entries say (model keys, kinds of weights, checkpoints, image counts);
- ``table``: the tidy table's rows, written and read back within a row bound;
- ``result``: ``SurveyResult`` and ``vl.load_survey``;
- ``reading``: every file of a folder read within bounds (``lstat`` first, regular files only).
"""
from __future__ import annotations

from .entries import (checkpoint_of, file_sha256, model_key, own_weights, random_init_note,  # noqa: F401
                      source_count, weights_of)
from .result import SurveyResult, damage_message, damaged_shards, distance_result, load_survey  # noqa: F401
from .shard_store import (FORMAT, LOCK_NAME, MAX_MANIFEST_BYTES, MAX_RECORD_BYTES, MAX_SHARD_BYTES,  # noqa: F401
                          PINNED, DamagedShardError, DamagedSurveyWarning, SurveyBusyError, SurveyStore, _jsonable,
                          _now, settings_digest)
from .table import (MAX_TABLE_BYTES, ROWS_PER_HEAD_AND_CLASS, TABLE_COLUMNS, TABLE_ROWS_SLACK,  # noqa: F401
                    _split_weights, read_table, table_row_bound, table_rows, write_table)

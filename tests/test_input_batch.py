"""The persistent batch: block-table rows follow the manager's tables through appends, edits
(copy-on-write, eviction), removals and growth."""

import torch

from kvserve.engine.input_batch import InputBatch


def _batch(rows=2, max_blocks=4, groups=1):
    return InputBatch(groups, rows, max_blocks, torch.device("cpu"))


def test_rows_follow_appends_and_edits():
    tables = {"a": [[3, 7]], "b": [[5]]}
    ib = _batch()
    got = ib.tables(["a", "b"], lambda rid, g: tables[rid][g])[0]
    assert got[0, :2].tolist() == [3, 7] and got[1, :1].tolist() == [5]
    tables["a"][0].append(9)                  # a new block
    tables["b"][0][0] = 6                     # copy-on-write replaced the last block
    got = ib.tables(["b", "a"], lambda rid, g: tables[rid][g])[0]
    assert got.shape == (2, 3)
    assert got[0, :1].tolist() == [6] and got[1].tolist() == [3, 7, 9]
    tables["a"][0][:] = [7]                   # eviction compacted the table
    assert ib.tables(["a"], lambda rid, g: tables[rid][g])[0].tolist() == [[7]]


def test_rows_are_released_and_reused_and_tables_grow():
    tables = {"a": [[1, 2]], "b": [[4]], "c": [[8, 9, 10, 11, 12, 13]]}
    ib = _batch(rows=2, max_blocks=4)
    ib.tables(["a", "b"], lambda rid, g: tables[rid][g])
    ib.release(lambda rid: rid != "a")
    assert "a" not in ib.row_of and len(ib.free) == 1
    got = ib.tables(["c", "b"], lambda rid, g: tables[rid][g])[0]   # c takes a's row, 6 blocks > 4
    assert got[0].tolist() == [8, 9, 10, 11, 12, 13] and got[1, :1].tolist() == [4]
    tables["d"] = [[20]]
    got = ib.tables(["c", "b", "d"], lambda rid, g: tables[rid][g])[0]   # a third row: the tables grow
    assert got[2, :1].tolist() == [20] and got[0].tolist() == [8, 9, 10, 11, 12, 13]


def test_each_group_has_its_own_rows():
    tables = {"a": [[1, 2], [30]]}
    got = _batch(groups=2).tables(["a"], lambda rid, g: tables[rid][g])
    assert got[0].tolist() == [[1, 2]] and got[1].tolist() == [[30]]

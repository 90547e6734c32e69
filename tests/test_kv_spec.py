"""KVSpec's answers by hand: what a full, a sliding and an MLA layer hold and see."""

import pytest

from kvserve.kv.spec import FullSpec, MLASpec, SlidingWindowSpec

FULL = FullSpec(num_kv_heads=3, head_dim=64)
SLIDING = SlidingWindowSpec(num_kv_heads=3, head_dim=64, window=8)
MLA = MLASpec(latent_dim=512, rope_dim=64)


def test_what_each_layer_sees():
    assert (FULL.visible_window, SLIDING.visible_window, MLA.visible_window) == (None, 8, None)
    assert (FULL.keeps_window, SLIDING.keeps_window, MLA.keeps_window) == (False, True, False)
    assert (FULL.per_head, SLIDING.per_head, MLA.per_head) == (True, True, False)


def test_blocks_held_by_a_lone_sequence():
    # 100 tokens in blocks of 4: 25 blocks; a window of 8 spans 2 blocks plus the one it starts in
    assert FULL.blocks_held(100, 4) == MLA.blocks_held(100, 4) == 25
    assert SLIDING.blocks_held(100, 4) == 3
    assert SLIDING.blocks_held(5, 4) == 2     # fewer tokens than the window: all of them
    assert SLIDING.blocks_held(100, 16) == 2  # window 8 inside one block of 16, plus the next


def test_first_needed_block():
    # after 20 tokens, the next query (position 20) sees positions 13..20: blocks of 4 from block 3
    assert SLIDING.first_needed_block(20, 4) == 3
    assert SLIDING.first_needed_block(7, 4) == 0
    assert FULL.first_needed_block(20, 4) == MLA.first_needed_block(20, 4) == 0


def test_bytes_per_token():
    assert FULL.bytes_per_token(2) == 2 * 3 * 64 * 2
    assert MLA.bytes_per_token(2) == (512 + 64) * 2


def test_each_layout_is_its_own_type():
    assert (FULL.kind, SLIDING.kind, MLA.kind) == ("full", "sliding", "mla")
    # equal fields, other layouts: never one pool group (group_layers keys on the spec)
    assert FullSpec(3, 64) == FULL and SlidingWindowSpec(3, 64, window=8) == SLIDING
    assert len({FULL, SLIDING, MLA, FullSpec(3, 64)}) == 3
    with pytest.raises(ValueError, match="window >= 1"):
        SlidingWindowSpec(3, 64)

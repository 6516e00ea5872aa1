"""MetadataBuffers layout, the device rule, and the FIFO slot allocator."""
from __future__ import annotations

import pytest
import torch

from impl.decode import (DecodeInputError, MetadataBuffers, SlotAllocator, SlotNotAllocated, SlotOutOfRange,
                         SlotsExhausted, resolve_device)
from impl.decode.buffers import NVLINK_ENV

LAYOUT = {  # SGLang 0.5.13: field -> (columns, dtype)
    "output_ids": (16, torch.int32), "cached_tokens": (16, torch.int32),
    "output_token_logprobs_val": (16, torch.float32), "output_token_logprobs_idx": (16, torch.int32),
    "output_top_logprobs_val": (128, torch.float32), "output_top_logprobs_idx": (128, torch.int32),
    "output_topk_p": (16, torch.float32), "output_topk_index": (16, torch.int64),
    "output_hidden_states": (32, torch.float32), "bootstrap_room": (8, torch.uint64),
}


def test_layout_dtypes_and_row_sizes():
    b = MetadataBuffers(6, hidden_size=32)
    assert list(b.fields) == list(LAYOUT)
    for name, (cols, dtype) in LAYOUT.items():
        t = b.fields[name]
        assert t.shape == (6, cols) and t.dtype == dtype, name
        assert t[0].nbytes >= 64, name


def test_buf_infos_describe_every_field_for_registration():
    b = MetadataBuffers(3, hidden_size=32)
    ptrs, data_lens, item_lens = b.get_buf_infos()
    assert ptrs == [t.data_ptr() for t in b.fields.values()]
    assert data_lens == [t.nbytes for t in b.fields.values()]
    assert item_lens == [n // 3 for n in data_lens]
    assert b.buf_infos().names == tuple(LAYOUT)
    # a prefill copying row 2 of output_ids writes at ptr + 2 * item_len
    b.write_first_token(2, 1234)
    row = torch.frombuffer(bytearray(b.output_ids.numpy().tobytes()), dtype=torch.int32)
    assert int(row[2 * item_lens[0] // 4]) == 1234


def test_rooms_use_all_64_bits_and_clear_slot_zeroes_the_sentinel_only():
    b = MetadataBuffers(2)
    b.write_room(1, 2**64 - 1)
    b.write_first_token(1, 7)
    assert b.read_room(1) == 2**64 - 1 and b.bootstrap_room[1, :1].tolist() == [2**64 - 1]
    b.clear_slot(1)
    assert b.read_room(1) == 0 and int(b.output_ids[1, 0]) == 7
    with pytest.raises(SlotOutOfRange):
        b.clear_slot(2)


def test_device_rule(monkeypatch):
    monkeypatch.delenv(NVLINK_ENV, raising=False)
    assert resolve_device() == torch.device("cpu")
    want = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device(intra_node_nvlink=True) == want
    monkeypatch.setenv(NVLINK_ENV, "INTRA_NODE_NVLINK")
    assert resolve_device() == want
    assert resolve_device("cpu") == torch.device("cpu")
    assert MetadataBuffers(1).device == want


def test_allocator_is_fifo_and_refuses_misuse():
    a = SlotAllocator(3)
    assert [a.alloc(), a.alloc()] == [0, 1]
    a.free(0)
    assert [a.alloc(), a.alloc()] == [2, 0]
    with pytest.raises(SlotsExhausted, match="all 3 metadata slots are in use") as exc:
        a.alloc()
    assert isinstance(exc.value, DecodeInputError)    # a batch of replays reports, not stops
    a.free(1)
    with pytest.raises(SlotNotAllocated):
        a.free(1)
    with pytest.raises(SlotOutOfRange):
        a.free(3)
    assert a.free_list() == [1]

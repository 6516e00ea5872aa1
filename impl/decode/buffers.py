"""Metadata rows (SGLang's layout) and the FIFO slot allocator.

One row per slot; a prefill copies each field's row into the slot it was given, and the
decode side reads the row once the gate and the MIN agree. ``bootstrap_room`` column 0
is the sentinel the gate compares; it is uint64 like SGLang's, and compared through an
int64 view (same bits, so equality and "is zero" are unchanged).
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import torch

from impl.decode.errors import SlotNotAllocated, SlotOutOfRange, SlotsExhausted

NVLINK_ENV = "SGLANG_MOONCAKE_CUSTOM_MEM_POOL"   # SGLang's switch for intra-node NVLink pools
MIN_ROW_BYTES = 64                                # RDMA's smallest efficient write


def resolve_device(device: str | torch.device | None = None,
                   intra_node_nvlink: bool | None = None) -> torch.device:
    """cpu by default; cuda for an intra-node NVLink pool when cuda is available.

    ``intra_node_nvlink=None`` reads SGLang's environment switch. An explicit ``device``
    wins over both.
    """
    if device is not None:
        return torch.device(device)
    if intra_node_nvlink is None:
        intra_node_nvlink = os.environ.get(NVLINK_ENV, "") == "INTRA_NODE_NVLINK"
    if intra_node_nvlink and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


@dataclass(frozen=True)
class BufInfos:
    """What a transfer engine registers and a prefill needs to copy one row per field."""
    names: tuple[str, ...]
    ptrs: tuple[int, ...]
    data_lens: tuple[int, ...]      # bytes of the whole field tensor
    item_lens: tuple[int, ...]      # bytes of one row (one slot)


class MetadataBuffers:
    """SGLang's metadata rows: ``size`` slots, one tensor per field, rows >= 64 bytes."""

    def __init__(self, size: int, hidden_size: int = 16, *,
                 hidden_dtype: torch.dtype = torch.float32, max_top_logprobs_num: int = 128,
                 device: str | torch.device | None = None, intra_node_nvlink: bool | None = None):
        if size < 1:
            raise ValueError(f"metadata buffers need size >= 1, got {size}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        self.size = size
        self.device = resolve_device(device, intra_node_nvlink)

        def z(cols: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((size, cols), dtype=dtype, device=self.device)

        self.output_ids = z(16, torch.int32)                  # first output token in column 0
        self.cached_tokens = z(16, torch.int32)
        self.output_token_logprobs_val = z(16, torch.float32)
        self.output_token_logprobs_idx = z(16, torch.int32)
        self.output_top_logprobs_val = z(max_top_logprobs_num, torch.float32)
        self.output_top_logprobs_idx = z(max_top_logprobs_num, torch.int32)
        self.output_topk_p = z(16, torch.float32)
        self.output_topk_index = z(16, torch.int64)
        self.output_hidden_states = z(hidden_size, hidden_dtype)
        self.bootstrap_room = z(8, torch.uint64)              # column 0 used
        # The gate reads the sentinel through this int64 view: one gather, no copies.
        self.room_column = self.bootstrap_room.view(torch.int64)[:, 0]
        self.fields: dict[str, torch.Tensor] = {
            "output_ids": self.output_ids,
            "cached_tokens": self.cached_tokens,
            "output_token_logprobs_val": self.output_token_logprobs_val,
            "output_token_logprobs_idx": self.output_token_logprobs_idx,
            "output_top_logprobs_val": self.output_top_logprobs_val,
            "output_top_logprobs_idx": self.output_top_logprobs_idx,
            "output_topk_p": self.output_topk_p,
            "output_topk_index": self.output_topk_index,
            "output_hidden_states": self.output_hidden_states,
            "bootstrap_room": self.bootstrap_room,
        }
        small = [n for n, t in self.fields.items()
                 if n != "output_hidden_states" and t[0].nbytes < MIN_ROW_BYTES]
        assert not small, f"rows under {MIN_ROW_BYTES} bytes: {small}"

    # -- transfer-engine registration (SGLang: get_buf_infos) -----------------------
    def buf_infos(self) -> BufInfos:
        ts = list(self.fields.values())
        return BufInfos(tuple(self.fields), tuple(t.data_ptr() for t in ts),
                        tuple(t.nbytes for t in ts), tuple(t[0].nbytes for t in ts))

    def get_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """SGLang's shape: (ptrs, data_lens, item_lens), one entry per field."""
        info = self.buf_infos()
        return list(info.ptrs), list(info.data_lens), list(info.item_lens)

    # -- rows ------------------------------------------------------------------------
    def check_index(self, idx: int, rid: str | None = None) -> int:
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self.size:
            raise SlotOutOfRange(idx, self.size, rid)
        return idx

    def write_room(self, idx: int, room: int) -> None:
        """Store a 64-bit room (0..2^64-1) in the slot's sentinel column."""
        self.check_index(idx)
        self.room_column[idx] = room_to_int64(room)

    def read_room(self, idx: int) -> int:
        self.check_index(idx)
        return int(self.room_column[idx]) & (2**64 - 1)

    def write_first_token(self, idx: int, token: int) -> None:
        self.check_index(idx)
        self.output_ids[idx, 0] = token

    def clear_slot(self, idx: int) -> None:
        """Zero the slot's sentinel (SGLang 0.5.23 ``clear_slot``, #27374). Payload fields
        are left: the next tenant's write overwrites them before its room can match."""
        self.check_index(idx)
        self.room_column[idx] = 0

    def clear_slots(self, idx: torch.Tensor) -> None:
        """``clear_slot`` for many slots at once (an index tensor, already validated)."""
        self.room_column.index_fill_(0, idx, 0)

    def row(self, idx: int) -> dict[str, torch.Tensor]:
        """Copies of every field's row (what a commit hands to the running batch)."""
        self.check_index(idx)
        return {name: t[idx].clone() for name, t in self.fields.items()}


def room_to_int64(room: int) -> int:
    """A 64-bit room as the signed value with the same bits (for the int64 view)."""
    return room - 2**64 if room >= 2**63 else room


class SlotAllocator:
    """FIFO free list of metadata slots (alloc pops the front, free appends), like
    SGLang's ReqToMetadataIdxAllocator; a double free or unknown slot is refused."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"allocator size must be >= 1, got {size}")
        self.size = size
        self._free: deque[int] = deque(range(size))
        self._used: set[int] = set()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise SlotsExhausted(self.size)
        idx = self._free.popleft()
        self._used.add(idx)
        return idx

    def undo_alloc(self, idx: int) -> None:
        """Return a slot just allocated to the front, as if ``alloc`` never ran."""
        if idx not in self._used:
            raise SlotNotAllocated(idx)
        self._used.discard(idx)
        self._free.appendleft(idx)

    def free(self, idx: int) -> None:
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self.size:
            raise SlotOutOfRange(idx, self.size)
        if idx not in self._used:
            raise SlotNotAllocated(idx)
        self._used.discard(idx)
        self._free.append(idx)

    def is_allocated(self, idx: int) -> bool:
        return idx in self._used

    def free_list(self) -> list[int]:
        return list(self._free)

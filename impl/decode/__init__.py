"""impl.decode: the production gated decode path (torch + torch.distributed only).

Drop-in pieces for a SGLang decode worker: MetadataBuffers with SGLang's row layout, a
FIFO SlotAllocator, the vectorized metadata gate (the spec's kernel run on tensors),
poll_and_all_reduce[_with_staging] with a hang-proof MIN, and DecodeTransferQueue.
See docs/IMPL.md.
"""
from model.spec.kernel import Decision
from model.spec.kvpoll import KVPoll
from impl.decode.buffers import BufInfos, MetadataBuffers, SlotAllocator, resolve_device
from impl.decode.collective import DEFAULT_TIMEOUT_S, GlooExchange, agree_min
from impl.decode.errors import (BadPollValue, CollectiveError, CollectiveFailed,
                                CollectiveLengthMismatch, CollectiveTimeout, DecodeError,
                                DecodeInputError, DuplicateRequest, DuplicateRoom,
                                PeerAbortedStep, QueueContentMismatch, RoomOutOfRange,
                                SlotInUse, SlotNotAllocated, SlotOutOfRange, SlotsExhausted,
                                ZeroRoom)
from impl.decode.gate import (FAKE_BOOTSTRAP_HOST, apply_metadata_gate, decide_tensor,
                              gate_tensor)
from impl.decode.polling import poll_and_all_reduce, poll_and_all_reduce_with_staging
from impl.decode.queue import (Aborted, Committed, DecodeRequest, DecodeTransferQueue,
                               KVReceiver, Req, StepPlan)
from impl.decode.trace import ListTracer, StepTrace, Tracer

__all__ = [
    "KVPoll", "Decision", "BufInfos", "MetadataBuffers", "SlotAllocator", "resolve_device",
    "DEFAULT_TIMEOUT_S", "GlooExchange", "agree_min",
    "DecodeError", "DecodeInputError", "BadPollValue", "SlotOutOfRange", "SlotInUse",
    "SlotNotAllocated", "SlotsExhausted", "ZeroRoom", "RoomOutOfRange", "DuplicateRoom",
    "DuplicateRequest", "CollectiveError", "CollectiveLengthMismatch", "QueueContentMismatch",
    "PeerAbortedStep", "CollectiveTimeout", "CollectiveFailed",
    "FAKE_BOOTSTRAP_HOST", "apply_metadata_gate", "gate_tensor", "decide_tensor",
    "poll_and_all_reduce", "poll_and_all_reduce_with_staging",
    "Req", "DecodeRequest", "KVReceiver", "DecodeTransferQueue", "Committed", "Aborted",
    "StepPlan", "StepTrace", "Tracer", "ListTracer",
]

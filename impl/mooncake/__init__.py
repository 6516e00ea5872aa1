"""Real transfers for the gated decode path: Mooncake's TransferEngine plus ZMQ control.

``engine`` wraps the TransferEngine with a registry of registered ranges and typed
errors; ``decode`` and ``receiver`` are the decode rank's side; ``prefill`` (library)
and ``prefill_main`` (process) the sender; ``frames`` the wire formats; ``synth`` the
deterministic test workload. docs/MOONCAKE.md documents the protocol.
"""

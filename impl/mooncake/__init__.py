"""Real transfers for the gated decode path: Mooncake's TransferEngine plus ZMQ control.

``engine`` wraps the TransferEngine (registry of registered ranges, typed errors);
``frames`` holds the wire formats; ``decode``, ``receiver`` and ``landing`` are a decode
rank's side; ``prefill`` (library) and ``prefill_main`` (process) the sender; ``rank``,
``cluster`` and ``report`` run and score ``pdgate e2e``; ``synth`` is the deterministic
test workload. docs/MOONCAKE.md documents the protocol.
"""

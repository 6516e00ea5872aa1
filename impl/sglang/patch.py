"""pdgate's functions inside SGLang's own transfer queue.

``swap_dropins(release)``: the release's ``poll_and_all_reduce`` /
``poll_and_all_reduce_with_staging`` replaced by pdgate's drop-ins (impl.decode.polling),
nothing else changed (``pdgate conform --swap``: the release must still match its spec
variant, now with a collective that cannot hang).
"""
from __future__ import annotations

from typing import Any, Callable

from impl.decode import polling

_NAMES = ("poll_and_all_reduce", "poll_and_all_reduce_with_staging")


def _note(release: Any) -> Callable[[list], None] | None:
    observer = getattr(release, "observer", None)
    return None if observer is None else observer.note


def swap_dropins(release: Any) -> None:
    """Point the release's queue (and utils) at pdgate's drop-ins, gate rule ``gate``."""
    def bind(fn: Callable[..., list]) -> Callable[..., list]:
        def call(*args: Any, **kwargs: Any) -> list:
            return fn(*args, **kwargs, timeout_s=release.collective_timeout_s,
                      transfer_backend=release.server_args.disaggregation_transfer_backend,
                      trace=_note(release))
        call._pdgate_swapped = True           # type: ignore[attr-defined]
        return call

    for name in _NAMES:
        ours = bind(getattr(polling, name))
        for module in (release.decode, release.utils):
            if hasattr(module, name):
                setattr(module, name, ours)

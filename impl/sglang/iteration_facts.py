"""What each SGLang release's decode iteration does at its rank-agreement points, read
from the release's own source (its cached wheel) with ``ast``, and compared with the
``iter-*`` variant that models it (model/spec/iteration.py). Nothing is imported from
the wheel and nothing downloads: this checks the variant table against the code.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from typing import Any

from impl.sglang.wheels import open_wheel
from model.spec.agreement import Op, Point, Skip
from model.spec.iteration import ITER_VARIANTS, IterVariant

DECODE = "sglang.srt.disaggregation.decode"
# The variant that models each release, 0.5.12 to 0.5.23, read from each one's wheel
# (docs/PROOFS.md, "The decode iteration"; 0.5.20 has a variant of its own: 0.5.19's
# per-rank hold and release with 0.5.21's prealloc poll).
MODELLED_BY = {"0.5.12": "iter-0.5.12", **{f"0.5.{n}": "iter-0.5.13" for n in range(13, 19)},
               "0.5.19": "iter-0.5.19", "0.5.20": "iter-0.5.20", "0.5.21": "iter-0.5.21",
               "0.5.22": "iter-0.5.21", "0.5.23": "iter-0.5.23"}
OFFLOAD = "sglang.srt.disaggregation.decode_kvcache_offload_manager"
SCHEDULER = "sglang.srt.managers.scheduler"


@dataclass(frozen=True)
class Mechanisms:
    resolve: Op           # how pending requests reach the prealloc queue
    prealloc_skip: Skip   # when a rank skips the prealloc queue's poll MIN
    admission: Op         # pop_preallocated
    admission_halts: bool  # ... stops its FIFO walk at the first request that does not fit
    transfer_veto: bool   # a rank-local continue after the transfer MIN's Success
    checksum: Op | None   # _verify_kv_checksums (None: no checksum)
    hold: Op | None       # pop_transferred's decision to hold a failed request's slot (None: never held)
    release: Op | None    # resolve_deferred_releases' reduction (None: no deferred release)
    release_host_only: bool   # ... of host-staged holds only, issued ``if host_ready.numel()``


class _Functions(dict):
    """Method name -> definition; a reader asking for one the source lacks (an edited
    ``--source``) gets a one-line ValueError, not a KeyError."""

    def __missing__(self, name: str) -> ast.FunctionDef:
        raise ValueError(f"the source defines no function {name} (a reader needs it)")


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    """Method name -> its last definition in the module (class and mixin methods)."""
    return _Functions((n.name, n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def _collective(fn: ast.FunctionDef | None) -> bool:
    return fn is not None and any(w in _text(fn) for w in ("all_reduce", "broadcast"))


def _prealloc_skip(fn: ast.FunctionDef) -> Skip:
    """The early returns before the poll: an ``if`` whose body is a bare ``return``."""
    tests = [_text(n.test) for n in fn.body if isinstance(n, ast.If)
             and len(n.body) == 1 and isinstance(n.body[0], ast.Return)]
    if not any("self.queue" in t and t.startswith("not") for t in tests):
        return Skip.NEVER
    ready = [t for t in tests if "waiting_for_input" in t]
    if not ready:
        return Skip.EMPTY
    return Skip.ALL_READY_NO_LOCAL_FAIL if any("Failed" in t for t in ready) else Skip.ALL_READY


def _veto(fn: ast.FunctionDef, exits: tuple[type, ...], markers: tuple[str, ...]) -> str | None:
    """A rank-local exit (one of ``exits``: ``continue``, ``break``) from the loop under a
    test naming one of ``markers``: which ("continue" or "break"), or None."""
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and any(isinstance(b, exits) for b in node.body):
            test = _text(node.test)
            if any(m in test for m in markers):
                return next(type(b).__name__.lower() for b in node.body if isinstance(b, exits))
    return None


def _exit_of(p: Point) -> str | None:
    """How a point's rank-local keep leaves the walk: a ``break`` where it halts it."""
    return None if p.veto is None else "break" if p.halt is not None else "continue"


# decode: host staging or a pending HiCache restore; prefill: no free metadata buffer
_TRANSFER_VETO = ((ast.Continue,), ("allocate_host_staged", "HiCacheRestoreResult.PENDING"))
_BUFFER_VETO = ((ast.Continue, ast.Break), ("ensure_metadata_buffer", "available_size() == 0"))
# pop_preallocated's token-budget test (the fit): ``break`` stops the FIFO walk
_FIT_BREAK = ((ast.Break,), ("allocatable_tokens", "_prealloc_reservation_fits"))


def _reduce_op(fn: ast.FunctionDef) -> Op:
    text = _text(fn)
    return Op.MIN if "ReduceOp.MIN" in text else Op.MAX if "ReduceOp.MAX" in text else Op.LOCAL


def mechanisms_of(source: str) -> Mechanisms:
    """The mechanisms of one release's decode.py source."""
    fns = _functions(ast.parse(source))
    checksum = fns.get("_verify_kv_checksums")
    pop, release = fns["pop_transferred"], fns.get("resolve_deferred_releases")
    holds = "_defer_release(" in _text(pop)
    return Mechanisms(
        resolve=Op.MIN if _collective(fns.get("_resolve_pending_reqs")) else Op.LOCAL,
        prealloc_skip=_prealloc_skip(fns["_update_handshake_waiters"]),
        admission=Op.MIN if _collective(fns.get("pop_preallocated")) else Op.LOCAL,
        admission_halts=_veto(fns["pop_preallocated"], *_FIT_BREAK) is not None,
        transfer_veto=_veto(pop, *_TRANSFER_VETO) is not None,
        checksum=None if checksum is None else (Op.MAX if "ReduceOp.MAX" in _text(checksum) else Op.LOCAL),
        # 0.5.23 reduces the hold flags with a MAX inside pop_transferred (its only MAX there)
        hold=None if not holds else Op.MAX if "ReduceOp.MAX" in _text(pop) else Op.LOCAL,
        release=None if release is None else _reduce_op(release),
        release_host_only=release is not None and "host_ready.numel()" in _text(release))


def mechanisms_modelled(v: IterVariant) -> Mechanisms:
    """The same facts, as the variant configures its points."""
    by = {p.name: p for p in v.points}
    resolve = by.get("resolve_pending")
    checksum = by.get("kv_checksum")
    hold, host = by.get("defer_release"), by.get("deferred_release_host")
    release = host or by.get("deferred_release")
    # no point of its own: resolution is rank-local, read by the prealloc MIN (its cap)
    folded = by["prealloc_poll"].gate == "unresolved"
    return Mechanisms(resolve=resolve.op if resolve else Op.LOCAL if folded else Op.MIN,
                      prealloc_skip=by["prealloc_poll"].skip, admission=by["admission"].op,
                      admission_halts=by["admission"].halt is not None,
                      transfer_veto=by["transfer_poll"].veto is not None,
                      checksum=checksum.op if checksum else None,
                      hold=hold.op if hold else None, release=release.op if release else None,
                      release_host_only=host is not None)


@dataclass(frozen=True)
class OffloadMechanisms:
    progress: tuple[Op, int, bool]   # check_offload_progress: op, vector length, guarded by a rank-local test
    drain: tuple[Op, ...]            # drain_before_retraction's collectives, in order (empty: none)
    drain_on_local_memory: bool      # the scheduler drains under ``kv_full_retract_flag`` (check_decode_mem)


def offload_mechanisms_of(offload: str, scheduler: str) -> OffloadMechanisms:
    """decode_kvcache_offload_manager.py and managers/scheduler.py of one release."""
    fns = _functions(ast.parse(offload))
    prog = fns["check_offload_progress"]
    call = next(n for n in ast.walk(prog) if isinstance(n, ast.Call) and _text(n.func).endswith("all_reduce"))
    vector = next(n for n in ast.walk(prog) if isinstance(n, ast.List))
    guard = next(_text(n.test) for n in ast.walk(prog) if isinstance(n, ast.If) and call in ast.walk(n))
    drain_fn = fns.get("drain_before_retraction")
    drain: tuple[Op, ...] = ()
    if drain_fn is not None:      # its own check_offload_progress() call, then its reductions
        text = _text(drain_fn)
        drain = ((Op.MIN,) if "self.check_offload_progress()" in text else ()) + (_reduce_op(drain_fn),)
    on_memory = False
    for node in ast.walk(ast.parse(scheduler)):
        if isinstance(node, ast.If) and "kv_full_retract_flag" in _text(node.test):
            on_memory |= any("drain_before_retraction" in _text(b) for b in node.body)
    return OffloadMechanisms((_reduce_op(prog), len(vector.elts), guard != "self.tp_world_size > 1"),
                             drain, on_memory)


def offload_mechanisms_modelled(v: IterVariant) -> OffloadMechanisms:
    by = {p.name: p for p in v.points}
    off = by["offload_progress"]
    drains = [by[n] for n in ("offload_drain_progress", "offload_drain") if n in by]
    return OffloadMechanisms((off.op, off.shape or 0, off.skip is not Skip.NEVER), tuple(p.op for p in drains),
                             any(p.skip is Skip.LOCAL_FLAG for p in drains))


def differences(version: str, variant: str, got: Any, want: Any) -> list[str]:
    """One line per fact (a dataclass field) where the source and the variant differ."""
    return [f"{version} {f.name}: source {getattr(got, f.name)}, {variant} {getattr(want, f.name)}"
            for f in fields(got) if getattr(got, f.name) != getattr(want, f.name)]


def offload_mismatches(version: str, source: str | None = None) -> list[str]:
    w = open_wheel(version, source)
    got = offload_mechanisms_of(w.source_of(OFFLOAD)[0], w.source_of(SCHEDULER)[0])
    return differences(version, MODELLED_BY[version],
                       got, offload_mechanisms_modelled(ITER_VARIANTS[MODELLED_BY[version]]))


def release_mismatches(version: str, source: str | None = None) -> list[str]:
    """What the release's source does that its variant does not model (empty: none);
    ``source``: a tree whose modules replace the wheel's (an edited copy)."""
    got = mechanisms_of(open_wheel(version, source).source_of(DECODE)[0])
    return differences(version, MODELLED_BY[version], got, mechanisms_modelled(ITER_VARIANTS[MODELLED_BY[version]]))


PREFILL = "sglang.srt.disaggregation.prefill"
# resolve_waiting_queue_bootstrap (prefill-0.5.18's waiting MIN) came in 0.5.14
PREFILL_MODELLED_BY = {"0.5.12": "prefill-0.5.12", "0.5.13": "prefill-0.5.13",
                       **{f"0.5.{n}": "prefill-0.5.18" for n in range(14, 24)}}


@dataclass(frozen=True)
class PrefillMechanisms:
    bootstrap_skip: Skip   # pop_bootstrapped's early return
    bootstrap_veto: str | None   # a rank without a free metadata buffer keeps the request: "continue",
                                 # or "break" (the later requests stay too); None: never
    inflight_skip: Skip    # process_disagg_prefill_inflight_queue's early return
    waiting: Skip | None   # resolve_waiting_queue_bootstrap's empty return (None: no such MIN)


def _empty_return(fn: ast.FunctionDef) -> Skip:
    """EMPTY where the body returns early on an empty list (``len(...) == 0``, ``not x``)."""
    for n in fn.body:
        test = _text(n.test) if isinstance(n, ast.If) else ""
        if (("len(self" in test and "== 0" in test) or test.startswith("not ")) \
                and any(isinstance(b, ast.Return) for b in ast.walk(n)):
            return Skip.EMPTY
    return Skip.NEVER


def prefill_mechanisms_of(source: str) -> PrefillMechanisms:
    fns = _functions(ast.parse(source))
    boot, waiting = fns["pop_bootstrapped"], fns.get("resolve_waiting_queue_bootstrap")
    return PrefillMechanisms(_empty_return(boot), _veto(boot, *_BUFFER_VETO),
                             _empty_return(fns["process_disagg_prefill_inflight_queue"]),
                             None if waiting is None or not _collective_poll(waiting) else _empty_return(waiting))


def _collective_poll(fn: ast.FunctionDef) -> bool:
    return "poll_and_all_reduce" in _text(fn)


def prefill_mechanisms_modelled(v: IterVariant) -> PrefillMechanisms:
    by = {p.name: p for p in v.points}
    waiting = by.get("waiting_bootstrap")
    return PrefillMechanisms(by["bootstrap_poll"].skip, _exit_of(by["bootstrap_poll"]),
                             by["inflight_poll"].skip, waiting.skip if waiting else None)


def prefill_mismatches(version: str, source: str | None = None) -> list[str]:
    """What the release's prefill.py does that its prefill-* variant does not model."""
    name = PREFILL_MODELLED_BY[version]
    got = prefill_mechanisms_of(open_wheel(version, source).source_of(PREFILL)[0])
    return differences(version, name, got, prefill_mechanisms_modelled(ITER_VARIANTS[name]))

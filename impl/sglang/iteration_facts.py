"""What each SGLang release's decode iteration does at its rank-agreement points, read
from the release's own source (its cached wheel) with ``ast``, and compared with the
``iter-*`` variant that models it (model/spec/iteration.py). Nothing is imported from
the wheel and nothing downloads: this checks the variant table against the code.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from impl.sglang.wheels import open_wheel
from model.spec.agreement import Op, Skip
from model.spec.iteration import ITER_VARIANTS, IterVariant

DECODE = "sglang.srt.disaggregation.decode"
# The variant that models each pinned release (docs/PROOFS.md, "The decode iteration").
MODELLED_BY = {"0.5.12": "iter-0.5.12", "0.5.13": "iter-0.5.13", "0.5.18": "iter-0.5.13",
               "0.5.19": "iter-0.5.13", "0.5.21": "iter-0.5.21", "0.5.23": "iter-0.5.23"}


@dataclass(frozen=True)
class Mechanisms:
    resolve: Op           # how pending requests reach the prealloc queue
    prealloc_skip: Skip   # when a rank skips the prealloc queue's poll MIN
    admission: Op         # pop_preallocated
    transfer_veto: bool   # a rank-local continue after the transfer MIN's Success
    checksum: Op | None   # _verify_kv_checksums (None: no checksum)


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    """Method name -> its last definition in the module (class and mixin methods)."""
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


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


def _veto(fn: ast.FunctionDef, exits: tuple[type, ...], markers: tuple[str, ...]) -> bool:
    """A rank-local exit (one of ``exits``: ``continue``, ``break``) from the loop under a
    test naming one of ``markers``."""
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and any(isinstance(b, exits) for b in node.body):
            test = _text(node.test)
            if any(m in test for m in markers):
                return True
    return False


# decode: host staging or a pending HiCache restore; prefill: no free metadata buffer
_TRANSFER_VETO = ((ast.Continue,), ("allocate_host_staged", "HiCacheRestoreResult.PENDING"))
_BUFFER_VETO = ((ast.Continue, ast.Break), ("ensure_metadata_buffer", "available_size() == 0"))


def mechanisms_of(source: str) -> Mechanisms:
    """The mechanisms of one release's decode.py source."""
    fns = _functions(ast.parse(source))
    checksum = fns.get("_verify_kv_checksums")
    return Mechanisms(
        resolve=Op.MIN if _collective(fns.get("_resolve_pending_reqs")) else Op.LOCAL,
        prealloc_skip=_prealloc_skip(fns["_update_handshake_waiters"]),
        admission=Op.MIN if _collective(fns.get("pop_preallocated")) else Op.LOCAL,
        transfer_veto=_veto(fns["pop_transferred"], *_TRANSFER_VETO),
        checksum=None if checksum is None else (Op.MAX if "ReduceOp.MAX" in _text(checksum) else Op.LOCAL))


def mechanisms_modelled(v: IterVariant) -> Mechanisms:
    """The same facts, as the variant configures its points."""
    by = {p.name: p for p in v.points}
    resolve = by.get("resolve_pending")
    checksum = by.get("kv_checksum")
    return Mechanisms(resolve=resolve.op if resolve else Op.MIN,
                      prealloc_skip=by["prealloc_poll"].skip, admission=by["admission"].op,
                      transfer_veto=by["transfer_poll"].veto is not None,
                      checksum=checksum.op if checksum else None)


def release_mismatches(version: str) -> list[str]:
    """What the release's source does that its variant does not model (empty: none)."""
    got = mechanisms_of(open_wheel(version).source_of(DECODE)[0])
    want = mechanisms_modelled(ITER_VARIANTS[MODELLED_BY[version]])
    return [f"{version} {name}: source {getattr(got, name)}, {MODELLED_BY[version]} {getattr(want, name)}"
            for name in Mechanisms.__dataclass_fields__ if getattr(got, name) != getattr(want, name)]


PREFILL = "sglang.srt.disaggregation.prefill"
PREFILL_VARIANT = "prefill-0.5.12"       # every pinned release (docs/PROOFS.md)


@dataclass(frozen=True)
class PrefillMechanisms:
    bootstrap_skip: Skip   # pop_bootstrapped's early return
    bootstrap_veto: bool   # a rank without a free metadata buffer keeps the request
    inflight_skip: Skip    # process_disagg_prefill_inflight_queue's early return


def _empty_return(fn: ast.FunctionDef) -> Skip:
    """EMPTY where the body returns early on an empty queue (``len(...) == 0``)."""
    for n in fn.body:
        if isinstance(n, ast.If) and "len(self" in _text(n.test) and "== 0" in _text(n.test) \
                and any(isinstance(b, ast.Return) for b in ast.walk(n)):
            return Skip.EMPTY
    return Skip.NEVER


def prefill_mechanisms_of(source: str) -> PrefillMechanisms:
    fns = _functions(ast.parse(source))
    boot = fns["pop_bootstrapped"]
    return PrefillMechanisms(_empty_return(boot), _veto(boot, *_BUFFER_VETO),
                             _empty_return(fns["process_disagg_prefill_inflight_queue"]))


def prefill_mechanisms_modelled(v: IterVariant) -> PrefillMechanisms:
    by = {p.name: p for p in v.points}
    return PrefillMechanisms(by["bootstrap_poll"].skip, by["bootstrap_poll"].veto is not None,
                             by["inflight_poll"].skip)


def prefill_mismatches(version: str) -> list[str]:
    """What the release's prefill.py does that prefill-0.5.12 does not model."""
    got = prefill_mechanisms_of(open_wheel(version).source_of(PREFILL)[0])
    want = prefill_mechanisms_modelled(ITER_VARIANTS[PREFILL_VARIANT])
    return [f"{version} {name}: source {getattr(got, name)}, {PREFILL_VARIANT} {getattr(want, name)}"
            for name in PrefillMechanisms.__dataclass_fields__ if getattr(got, name) != getattr(want, name)]

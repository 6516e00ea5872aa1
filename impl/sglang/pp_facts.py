"""What each SGLang release does with ``pp_size > 1`` at the points model/spec/pipeline.py
models, read from its cached wheel with ``ast`` (as impl/sglang/iteration_facts.py does
for the decode iteration) and compared with the ``pp-*`` variants that model it.
Nothing is imported from the wheel and nothing downloads.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from impl.sglang.iteration_facts import _BUFFER_VETO, DECODE, PREFILL, _functions, _text, _veto, differences
from impl.sglang.wheels import open_wheel
from model.spec.agreement import Across, Op, Skip
from model.spec.pipeline import PP_VARIANTS, PPVariant

MIXIN = "sglang.srt.managers.scheduler_pp_mixin"
UTILS = "sglang.srt.disaggregation.utils"
# decode variant, prefill variant per release, 0.5.12 to 0.5.23: the prefill's walk breaks
# at a request without a metadata buffer in 0.5.12 only, the ring's consensus is applied
# from 0.5.17 (pp_good_rids), PP0's polls forwarded from 0.5.22
MODELLED_BY = {"0.5.12": ("pp-0.5.12", "pp-prefill-0.5.12"),
               **{f"0.5.{n}": ("pp-0.5.13", "pp-prefill-0.5.13") for n in range(13, 17)},
               **{f"0.5.{n}": ("pp-0.5.13", "pp-prefill-0.5.18") for n in range(17, 22)},
               "0.5.22": ("pp-0.5.13", "pp-prefill-0.5.23"), "0.5.23": ("pp-0.5.23", "pp-prefill-0.5.23")}


@dataclass(frozen=True)
class PPMechanisms:
    finished_as_one: bool     # the transferred-rids ring keeps Success and Failed in one list
    ring_intersects: bool     # a later stage intersects its list with the previous stage's
    first_min_gated: bool     # get_rids's TP-MIN passes metadata rows (the gate)
    empty_min_skipped: bool   # ... and skips an empty poll list (else a shape-0 MIN)
    second_poll: bool         # each stage then pops with a poll of its own (pop_transferred)
    second_min_gated: bool    # ... through the metadata gate
    commit_keeps_unlanded: bool   # ... and its commit keeps a request whose room has not landed
    hold_max: bool            # ... then MAX-reduces its failed requests' hold flags
    prefill_ring: bool        # bootstrap consensus round the stages: good intersected, bad united
    prefill_consensus_applied: bool   # pop_bootstrapped applies it (no second poll of the listed rids)
    prefill_by_position: bool  # pop_bootstrapped takes PP0's polls forwarded down the stages
    prefill_buffer_break: bool   # ... and stops its walk at a request without a metadata buffer


def _calls(fn: ast.FunctionDef, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _text(n.func).endswith(name)]


def _returns_on_empty(fn: ast.FunctionDef) -> bool:
    """An ``if not x ...: return`` (the list it would reduce is empty)."""
    return any(isinstance(n, ast.If) and isinstance(n.body[0], ast.Return)
               and any(isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and isinstance(t.operand, ast.Name)
                       for t in ast.walk(n.test)) for n in ast.walk(fn))


def mechanisms_of(mixin: str, decode: str, prefill: str, utils: str) -> PPMechanisms:
    mx, dec, pre, ut = (_functions(ast.parse(s)) for s in (mixin, decode, prefill, utils))
    ids = mx["_pp_pd_get_decode_transferred_ids"]
    groups = [_text(a) for c in _calls(ids, "get_rids") for a in c.args[2:]]
    pop = dec["pop_transferred"]
    gate = dec.get("_poll_with_metadata_gate")
    second = [c for c in ast.walk(pop) if isinstance(c, ast.Call) and "poll" in _text(c.func)]
    gated = bool(_calls(pop, "_poll_with_metadata_gate")) and gate is not None and "metadata_buffers" in _text(gate)
    # get_rids -> poll_and_all_reduce_attn_cp_tp_group -> poll_and_all_reduce -> the reduction
    chain = [ut[f] for f in ("poll_and_all_reduce", "_all_reduce_polls", "all_reduce_flags") if f in ut]
    commits = [n for n in ast.walk(pop) if isinstance(n, ast.Assign) and _calls(n, "_commit_transfer_to_req")]
    boot = mx.get("_pp_pd_get_bootstrapped_ids")
    return PPMechanisms(
        finished_as_one=bool(groups) and all("KVPoll.Success" in g and "KVPoll.Failed" in g for g in groups),
        ring_intersects="set(prev_transferred_rids) & set(curr_transferred_rids)" in _text(ids),
        first_min_gated=any("metadata" in _text(f) for f in (mx["get_rids"],
                                                             ut["poll_and_all_reduce_attn_cp_tp_group"])),
        empty_min_skipped=any(_returns_on_empty(f) for f in chain),
        second_poll=bool(_calls(mx["process_decode_transfer_queue"], "pop_transferred")) and bool(second),
        second_min_gated=gated,
        commit_keeps_unlanded=bool(commits),
        hold_max=any("MAX" in _text(c) for c in _calls(pop, "all_reduce_flags")),
        prefill_ring=boot is not None and "set(prev_bad_bootstrapped_rids) | set(curr_bad_bootstrapped_rids)"
        in _text(boot) and "set(prev_good_bootstrapped_rids) & set(curr_good_bootstrapped_rids)" in _text(boot),
        prefill_consensus_applied=bool(_calls(pre["pop_bootstrapped"], "poll_and_all_reduce_pp")),
        prefill_by_position=bool(_calls(pre["pop_bootstrapped"], "poll_and_all_reduce_prefill_pp")),
        prefill_buffer_break=_veto(pre["pop_bootstrapped"], *_BUFFER_VETO) == "break")


def mechanisms_modelled(decode: PPVariant, prefill: PPVariant) -> PPMechanisms:
    ring = next(p for p in decode.points if p.across is Across.RING)
    pops = [p for p in decode.points if p.name == "transfer_poll"]
    targets = {target for _, target in ring.moves}
    boot = next((p for p in prefill.points if p.across is Across.RING), None)
    return PPMechanisms(finished_as_one={value for value, _ in ring.moves} == {0, 4} and len(targets) == 1,
                        ring_intersects=True, first_min_gated=ring.gate is not None,
                        empty_min_skipped=ring.skip is Skip.EMPTY,
                        second_poll=bool(pops), second_min_gated=any(p.gate is not None for p in pops),
                        commit_keeps_unlanded=any(p.veto == "unlanded" for p in pops),
                        hold_max=any(p.op is Op.MAX for p in decode.points),
                        prefill_ring=boot is not None and boot.union == (0,),
                        prefill_consensus_applied=boot is not None and dict(boot.moves)[0] not in prefill.transient,
                        prefill_by_position=any(p.across is Across.PP0 for p in prefill.points),
                        prefill_buffer_break=any(p.halt is not None for p in prefill.points))


def release_mismatches(version: str, source: str | None = None) -> list[str]:
    """What the release's source does that its pp-* variants do not model (empty: none)."""
    w = open_wheel(version, source)
    got = mechanisms_of(*(w.source_of(m)[0] for m in (MIXIN, DECODE, PREFILL, UTILS)))
    dec, pre = MODELLED_BY[version]
    want = mechanisms_modelled(PP_VARIANTS[dec], PP_VARIANTS[pre])
    return differences(version, f"{dec}/{pre}", got, want)

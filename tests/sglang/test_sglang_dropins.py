"""pdgate's drop-ins against each release's own poll functions (0.5.12 to 0.5.23): same call shapes,
same reduced polls (on a real one-rank gloo group, SGLang's own MetadataBuffers), the
fake-transfer forms, staging ``is_failed`` and ``pollers=``, and the per-request cache
(rooms are re-read every call; new request objects are re-read)."""
from __future__ import annotations

import datetime
import inspect
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from impl.decode import poll_and_all_reduce, poll_and_all_reduce_with_staging
from impl.sglang import stubs
from impl.sglang.release import load_release
from impl.sglang.wheels import RELEASES

S, T, W, F = 4, 3, 2, 0


@pytest.fixture(scope="module", autouse=True)
def _forget_releases():
    yield
    stubs.purge()        # the releases loaded here leave no sglang modules behind


@pytest.fixture(scope="module")
def gloo1():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))


class Recv:
    def __init__(self, state):
        self.state, self.require_staging = state, False

    def poll(self):
        return self.state


def make_queue(u, rng, n, hosts=("10.0.0.1",)):
    buffers = u.MetadataBuffers(**{k: v for k, v in dict(
        size=2 * n, hidden_size=16, hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=16).items()
        if k in inspect.signature(u.MetadataBuffers).parameters})
    reqs = []
    for i in range(n):
        room = rng.randrange(1, 2**63)
        if rng.random() < 0.5:
            buffers.bootstrap_room[i, 0] = room
        reqs.append(SimpleNamespace(req=SimpleNamespace(rid=str(i), bootstrap_room=room,
                                                        bootstrap_host=rng.choice(hosts)),
                                    kv_receiver=Recv(rng.choice([S, S, T, W, F])),
                                    metadata_buffer_index=i))
    return reqs, buffers


@pytest.mark.parametrize("release", RELEASES)
def test_same_result_as_the_release_in_its_own_call_shape(release, gloo1):
    rel = load_release(release)
    u = rel.utils
    params = inspect.signature(u.poll_and_all_reduce).parameters
    rng = random.Random(release)
    for n in (0, 1, 7, 64):
        reqs, buffers = make_queue(u, rng, n, hosts=("10.0.0.1", "2.2.2.2", None))
        pollers = [d.kv_receiver for d in reqs]
        args = [pollers, gloo1]
        kwargs = {}
        if "decode_reqs" in params:
            kwargs = {"decode_reqs": reqs, "metadata_buffers": buffers}
            if "server_args" in params:
                kwargs["server_args"] = rel.server_args
        theirs = u.poll_and_all_reduce(*args, **kwargs) if n else []
        ours = poll_and_all_reduce(*args, **kwargs, transfer_backend="mooncake")
        assert ours == theirs, (release, n)


@pytest.mark.parametrize("release", ["0.5.13", "0.5.18", "0.5.23"])
def test_staging_shapes_and_is_failed(release, gloo1):
    rel = load_release(release)
    u = rel.utils
    params = inspect.signature(u.poll_and_all_reduce_with_staging).parameters
    reqs, buffers = make_queue(u, random.Random(1), 4)
    for d, room in zip(reqs, (11, 12, 13, 14)):
        d.kv_receiver.state = S
        d.req.bootstrap_room = room
        buffers.bootstrap_room[d.metadata_buffer_index, 0] = room
    reqs[0].kv_receiver.require_staging = reqs[1].kv_receiver.require_staging = True
    handler = SimpleNamespace(is_done=lambda d: d is not reqs[0], advance_scatter=lambda d: None,
                              is_failed=lambda d: d is reqs[1])
    if "is_failed" not in u.poll_and_all_reduce_with_staging.__code__.co_names:
        del handler.is_failed                     # this release's handlers have no is_failed
    kwargs = {"metadata_buffers": buffers}
    if "server_args" in params:
        kwargs["server_args"] = rel.server_args
    if "pollers" in params:
        kwargs["pollers"] = [d.kv_receiver for d in reqs]
    theirs = u.poll_and_all_reduce_with_staging(reqs, handler, gloo1, **kwargs)
    ours = poll_and_all_reduce_with_staging(reqs, handler, gloo1, **kwargs)
    assert ours == theirs
    assert ours[0] == T and ours[1] == (F if hasattr(handler, "is_failed") else S)


def test_fake_transfers_in_both_forms(gloo1):
    rel = load_release("0.5.13")
    reqs, buffers = make_queue(rel.utils, random.Random(2), 3)
    for d in reqs:
        d.kv_receiver.state = S
        buffers.bootstrap_room[d.metadata_buffer_index, 0] = 0     # nothing landed
    reqs[0].req.bootstrap_host = "2.2.2.2"
    reqs[1].req.bootstrap_host = None
    pollers = [d.kv_receiver for d in reqs]
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers, transfer_backend="fake") == [S, S, T]
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers, transfer_backend="mooncake") == [S, T, T]
    fake = SimpleNamespace(disaggregation_transfer_backend="fake")
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers, fake) == [S, S, T]


def test_cached_requests_still_see_new_rooms_and_new_requests(gloo1):
    rel = load_release("0.5.13")
    reqs, buffers = make_queue(rel.utils, random.Random(3), 2)
    for d in reqs:
        d.kv_receiver.state = S
        buffers.bootstrap_room[d.metadata_buffer_index, 0] = 0
    pollers = [d.kv_receiver for d in reqs]
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers) == [T, T]
    buffers.bootstrap_room[reqs[1].metadata_buffer_index, 0] = 5     # lands between steps
    assert poll_and_all_reduce(pollers, gloo1, reqs, buffers) == [T, S]
    # another request object in the same place: its own slot is read, not the cached one
    moved = SimpleNamespace(req=reqs[1].req, kv_receiver=reqs[1].kv_receiver,
                            metadata_buffer_index=3)
    assert poll_and_all_reduce(pollers, gloo1, [reqs[0], moved], buffers) == [T, T]

"""One-copy weight sync into the embedded engine's shared parameters (engines/shared_weights.py):
the trainer writes HF-layout tensors straight into the engine's weights between two decode steps,
and no token is ever produced by a half-written set of weights.

The trainer side here is its output only (HF-named tensors, as `WeightGatherer.hf_tensors`
yields them); tests/test_weight_sync.py runs the same path from real Megatron ranks.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

from megatron_rl.checkpoint.weight_map import WeightMap
from megatron_rl.engines.base import EngineError, GenerateRequest
from megatron_rl.engines.embedded import EmbeddedServer
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.engines.process_memory import map_process_memory
from megatron_rl.engines.shared_weights import LAYOUT_FORMAT, SharedWeightWriter
from megatron_rl.engines.write_control import WriteControlClient
from megatron_rl.models.registry import get_model_spec
from megatron_rl.trainer.weight_sync import SyncStats, WeightSyncer, _viewed_as
from megatron_rl.utils.parallel_copy import copy_all, copy_shares
from tests.test_engine_embedded import (
    PROMPTS,
    TOL,
    checkpoint_tensors,
    full_logprobs,
    greedy,
    hf_greedy,
    max_diff,
    perturbed,
    tiny_model,
)


class HFGatherer:
    """What the trainer's gatherer yields: (HF name, tensor) pairs; swap `named` to move."""

    rank, senders = 0, [0]  # one rank sends every layer

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self.named, self.stats = named, SyncStats()

    def sends(self, one_sender: bool = False) -> bool:
        return True

    def hf_tensors(self, dtype=None, one_sender: bool = False, grouped: bool = False):
        self.stats = SyncStats()
        for name, t in self.named:
            self.stats.tensors += 1
            self.stats.bytes += t.numel() * t.element_size()
            yield name, t


def greedy_probe(url: str, tokens: int):
    """The engine's greedy answer to the first prompt, over HTTP."""
    async def probe():
        async with HttpEngine(url) as eng:
            return await eng.generate(GenerateRequest("p", PROMPTS[0], greedy(tokens)))

    return asyncio.run(probe())


@pytest.fixture(scope="module")
def models():
    base = tiny_model()
    return base, perturbed(base)


def test_one_copy_sync_writes_the_engines_parameters_in_place(models, tmp_path) -> None:
    base, new = models
    named = checkpoint_tensors(new, tmp_path / "new")
    with EmbeddedServer(copy.deepcopy(base)).start() as srv:
        with WeightSyncer(HFGatherer(named), [srv.url], transport="tensor") as syncer:
            syncer.sync(2)
            writer = syncer._writers[0]
            stats = syncer.sync(3)
            assert syncer._writers[0] is writer  # mapped once: later syncs write warm pages
            segment = writer.name
        layout = srv.core.share_weights()
        base_ptr = torch.frombuffer(srv.core.shared.memory.map, dtype=torch.uint8).data_ptr()
        ptrs = [p.data_ptr() for p in srv.core.model.parameters()]

        out = greedy_probe(srv.url, 12)
    assert layout["label"] == segment and layout["format"] == LAYOUT_FORMAT
    assert set(n for n, _ in named) <= set(layout["tensors"])  # every name written in place
    assert stats.extra["unshared"] == 0 and stats.tensors == len(named)
    # the engine decodes from the segment: its parameters are views of shared memory
    assert all(base_ptr <= p < base_ptr + layout["nbytes"] for p in ptrs)
    assert out.weight_versions == [3] * 12
    assert out.output_ids == hf_greedy(new, PROMPTS[0], 12)
    assert max_diff(out.output_logprobs, full_logprobs(new, PROMPTS[0], out.output_ids)) < TOL


def test_later_syncs_of_the_same_tensors_reuse_the_plan_and_write_their_new_values(
        models, tmp_path) -> None:
    """The gatherer yields views of live parameters, which an optimizer step writes in place:
    the next sync copies through the plan it made (no walk to the engine's names), and the
    engine decodes the new values; a tensor that is another object is planned again."""
    base, new = models
    live = [(n, t.clone()) for n, t in checkpoint_tensors(base, tmp_path / "base")]
    updated = dict(checkpoint_tensors(new, tmp_path / "new"))
    gatherer = HFGatherer(live)
    with EmbeddedServer(copy.deepcopy(base)).start() as srv:
        with WeightSyncer(gatherer, [srv.url], transport="tensor") as syncer:
            syncer.sync(1)
            plan = syncer._plan
            assert plan is not None
            for name, t in live:  # the optimizer step
                t.copy_(updated[name])
            syncer.sync(2)
            assert syncer._plan is plan
            out = greedy_probe(srv.url, 12)
            gatherer.named = [(n, t.clone()) for n, t in live]  # new objects, same values
            syncer.sync(3)
            assert syncer._plan is not plan and syncer._plan is not None
            again = greedy_probe(srv.url, 12)
    assert out.weight_versions == [2] * 12 and again.weight_versions == [3] * 12
    assert out.output_ids == again.output_ids == hf_greedy(new, PROMPTS[0], 12)


def test_an_engine_restarted_between_syncs_is_mapped_again(models, tmp_path) -> None:
    """The next sync finds another segment behind the same URL: it maps the new engine's
    memory and writes there, not into the old engine's."""
    base, new = models
    named = checkpoint_tensors(new, tmp_path / "new")
    with EmbeddedServer(copy.deepcopy(base)).start() as first:
        port = first.port
        with WeightSyncer(HFGatherer(named), [first.url], transport="tensor") as syncer:
            syncer.sync(1)
            old = syncer._writers[0].name
            first.stop()
            with EmbeddedServer(copy.deepcopy(base), port=port).start() as second:
                stats = syncer.sync(2)
                assert syncer._writers[0].name != old
                assert stats.extra["unshared"] == 0
                out = greedy_probe(second.url, 8)
    assert out.weight_versions == [2] * 8
    assert out.output_ids == hf_greedy(new, PROMPTS[0], 8)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_copies_split_over_threads_write_every_element_once(threads) -> None:
    """The threads take equal runs of the destination in address order, a contiguous tensor
    on a boundary cut there; non-contiguous sources (a grouped QKV's views) stay whole."""
    gen = torch.Generator().manual_seed(0)
    sizes = [(700, 33), (5,), (64, 64), (3, 129), (1000,), (8, 16)]
    memory = torch.zeros(sum(torch.Size(s).numel() for s in sizes) + 8)
    dsts, at = [], 0
    for shape in sizes:  # back to back, as the engine's parameters
        n = torch.Size(shape).numel()
        dsts.append(memory[at:at + n].view(shape))
        at += n
    srcs = [torch.randn(s, generator=gen) for s in sizes]
    srcs[2] = torch.randn(64, 64, generator=gen).t()  # non-contiguous
    pairs = [(d, s) for d, s in zip(dsts, srcs, strict=True)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shares = copy_shares(pairs[::-1], threads)  # any order in
        copy_all(shares)
    finally:
        torch.set_num_threads(previous)
    assert len(shares) == threads
    assert all(torch.equal(d, s) for d, s in pairs)
    assert not memory[at:].any()  # nothing past the last destination


def test_a_split_qkv_is_written_from_views_of_the_fused_tensor() -> None:
    """With several query groups HF's q, k and v are copies of Megatron's fused QKV; grouped,
    they stay views and are written through the engine's parameter viewed alike."""
    wmap = WeightMap(get_model_spec("tiny-moe"))  # 2 query groups
    entry, index = next((e, i) for e, i in wmap.units() if e.kind == "qkv")
    fused = torch.randn(wmap.megatron_shapes(entry, index)[0])
    hf = wmap.to_hf(entry, index, [fused])
    grouped = wmap.to_hf(entry, index, [fused], grouped=True)
    assert list(grouped) == list(hf) and len(hf) == 3
    ptr = fused.untyped_storage().data_ptr()
    assert hf[next(iter(hf))].untyped_storage().data_ptr() != ptr  # HF's q: a copy
    for name, t in grouped.items():
        assert t.untyped_storage().data_ptr() == ptr and t.dim() == 3
        dst = torch.zeros(hf[name].shape)
        _viewed_as(dst, t).copy_(t)
        assert torch.equal(dst, hf[name])
        assert _viewed_as(torch.zeros(hf[name].shape[0] + 1, hf[name].shape[1]), t) is None


@pytest.mark.parametrize("window", ["syncer", "owner"])
def test_no_token_decodes_with_half_written_weights(models, tmp_path, window) -> None:
    """Requests decode while the trainer syncs 8 times, alternating two weight sets. Every
    token carries a version; tokens before a request's first switch (its KV cache built by one
    set only) must equal that set's full forward: a step that ran during a write would match
    neither set. The write window is the syncer's own (HTTP begin / commit) or held by the
    engine's owner in its process (`EmbeddedCore.weights_held`, as the RL driver does)."""
    base, new = models
    sets = {0: base, 1: new}
    named = {i: checkpoint_tensors(m, tmp_path / str(i)) for i, m in sets.items()}
    gatherer = HFGatherer(named[0])
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    done = threading.Event()

    def trainer(url: str) -> None:
        with WeightSyncer(gatherer, [url], transport="tensor") as syncer:
            for version in range(1, 9):
                gatherer.named = named[version % 2]
                if window == "owner":
                    with srv.core.weights_held(version) as segment:
                        syncer.sync(version, [segment])
                else:
                    syncer.sync(version)
                done.wait(0.15)  # let batches decode between syncs

    with EmbeddedServer(copy.deepcopy(base), max_batch_size=6).start() as srv:
        async def scenario():
            async with HttpEngine(srv.url) as eng:
                sync = asyncio.create_task(asyncio.to_thread(trainer, srv.url))
                outs = []
                while not sync.done() or not outs:
                    outs += await asyncio.gather(*(
                        eng.generate(GenerateRequest(f"r{len(outs)}-{i}", p, greedy(24)))
                        for i, p in enumerate(prompts[:6])))
                await sync
                return outs

        outs = asyncio.run(scenario())
    spanning = checked = 0
    for out, prompt in zip(outs, prompts * len(outs), strict=False):
        versions = out.weight_versions
        assert versions == sorted(versions)  # a version never goes back within a request
        first = [v == versions[0] for v in versions].index(False) if len(set(versions)) > 1 \
            else len(versions)
        spanning += first < len(versions)
        ref = full_logprobs(sets[versions[0] % 2], prompt, out.output_ids)
        assert max_diff(out.output_logprobs[:first], ref[:first]) < TOL, versions
        checked += first
    assert max(v for out in outs for v in out.weight_versions) == 8
    assert spanning >= 1 and checked > 100  # in-flight requests crossed syncs


def test_an_owner_window_left_by_a_failed_write_stays_held_until_the_next(models,
                                                                           tmp_path) -> None:
    """A block of `weights_held` that raises leaves the engine held (no step decodes from
    half-written weights); the next window writes, commits and lets decoding go on. A syncer
    that writes no parameters in place has no window to be given."""
    base, new = models
    named = checkpoint_tensors(new, tmp_path / "new")
    with EmbeddedServer(copy.deepcopy(base)).start() as srv:
        core = srv.core
        with WeightSyncer(HFGatherer(named), [srv.url], transport="tensor") as syncer:
            assert syncer.shares_parameters()
            with pytest.raises(RuntimeError, match="mid-write"):
                with core.weights_held(1) as segment:
                    raise RuntimeError("the trainer died mid-write")
            assert core.writing and core.weight_version != "1"
            with core.weights_held(2) as segment:
                stats = syncer.sync(2, [segment])
            assert not core.writing and stats.extra["unshared"] == 0
        with WeightSyncer(HFGatherer(named), [srv.url], transport="tensor",
                          one_copy=False) as bucketed:
            assert not bucketed.shares_parameters()
            with pytest.raises(ValueError, match="nothing to hold"):
                bucketed.sync(3, [segment])
        out = greedy_probe(srv.url, 8)
    assert out.weight_versions == [2] * 8
    assert out.output_ids == hf_greedy(new, PROMPTS[0], 8)


def test_a_hostile_layout_is_refused_naming_the_field(tmp_path) -> None:
    model = tiny_model()
    other = (tmp_path / "secret.txt").open("w+")
    with EmbeddedServer(copy.deepcopy(model)).start() as srv:
        good = srv.core.share_weights()
        some = next(iter(good["tensors"]))
        bad = {
            "path": {**good, "path": "../../etc/passwd"},
            "label": {**good, "label": "psm_1234"},
            # well-formed, but the descriptor is a plain file, not the engine's memory
            "not the shared memory": {**good, "path": f"/proc/{os.getpid()}/fd/{other.fileno()}"},
            "nbytes": {**good, "nbytes": good["nbytes"] * 4},
            "offset": {**good, "tensors": {some: {**good["tensors"][some],
                                                  "offset": good["nbytes"]}}},
            "dtype": {**good, "tensors": {some: {**good["tensors"][some], "dtype": "int64"}}},
            "format": {**good, "format": "pickle"},
        }
        for field, layout in bad.items():
            with pytest.raises(ValueError, match=field if field != "nbytes" else "smaller"):
                SharedWeightWriter(layout)
        writer = SharedWeightWriter(good)
        assert writer.target(some).shape == torch.Size(good["tensors"][some]["shape"])
        writer.close()
    other.close()


def control_lines(address: str, *lines: bytes) -> list[bytes]:
    """Each line sent on one raw connection to an engine's write control, and its answers
    until the engine closes the connection or stops answering."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + address)
        sock.settimeout(10)
        with sock.makefile("rb") as answers:
            out = []
            for line in lines:
                try:
                    sock.sendall(line)
                    out.append(answers.readline())
                except (BrokenPipeError, ConnectionResetError):  # closed by the engine
                    out.append(b"")
            return out


def test_the_write_control_answers_hostile_lines_and_turns_other_users_away(
        models, tmp_path, monkeypatch) -> None:
    """The begin / commit socket (engines/write_control.py) carries the syncer's window; a
    line that is not JSON, an unknown op, a commit with no write open or a version that does
    not parse get an error naming it and the connection goes on; a line over the limit gets
    one and is closed. A peer of another user is turned away at accept, and the syncer goes
    by HTTP; the engine keeps serving throughout."""
    base, new = models
    named = checkpoint_tensors(new, tmp_path / "new")
    with EmbeddedServer(copy.deepcopy(base)).start() as srv:
        with WeightSyncer(HFGatherer(named), [srv.url], transport="tensor") as syncer:
            syncer.sync(1)
            engine = syncer.engines[0]
            address = engine._write_control.address
            assert address == srv._write_control.address  # the layout gave it
            label = syncer._writers[0].name
            answers = [json.loads(a) for a in control_lines(
                address, b"rm -rf /\n", b'{"op": "shutdown"}\n', b"[1, 2]\n",
                b'{"op": "commit", "weight_version": "2"}\n', b'{"op": "begin"}\n',
                b'{"op": "commit", "weight_version": "two"}\n',
                b'{"op": "commit", "weight_version": "2"}\n')]
            assert [a.get("status") for a in answers[:4]] == [400] * 4
            assert "not a JSON line" in answers[0]["error"]
            assert "'shutdown' is not 'begin' or 'commit'" in answers[1]["error"]
            assert "no shared-weights write is open" in answers[3]["error"]
            assert answers[4] == {"segment": label}
            assert answers[5]["status"] == 400 and "two" in answers[5]["error"]
            assert answers[6] == {"weight_version": "2"}
            long = control_lines(address, b"x" * 5000 + b"\n", b'{"op": "begin"}\n')
            assert json.loads(long[0])["status"] == 400 and long[1] == b""  # closed
            assert srv.core.weight_version == "2" and not srv.core.writing
            stats = syncer.sync(3)  # the syncer's own connection was not disturbed
            assert stats.extra["flip_s"] < 5 and srv.core.weight_version == "3"

            uid = os.getuid()
            monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # the engine's user, now
            assert control_lines(address, b'{"op": "begin"}\n') == [b""]
            syncer.engines[0]._write_control._streams = None  # a new connection: turned away
            syncer.sync(4)  # ...so begin and commit went by HTTP
            assert engine._write_control is None and srv.core.weight_version == "4"
        out = greedy_probe(srv.url, 8)
    assert out.weight_versions == [4] * 8
    assert out.output_ids == hf_greedy(new, PROMPTS[0], 8)


def test_the_write_control_client_refuses_a_broken_answer() -> None:
    """What the socket answers is the engine's input to the trainer: a line that is not a
    JSON object, or one over the limit, raises an EngineError naming the call; an address of
    another kind is refused before anything connects."""
    address = f"megatron-rl-weights-test-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + address)
    server.listen(1)
    replies = [b"garbage\n", b"[1]\n", b"{" + b" " * 5000 + b"}\n"]

    def serve() -> None:
        for reply in replies:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(reply)
                conn.recv(1)  # until the client closes

    threading.Thread(target=serve, daemon=True).start()

    async def calls() -> list[str]:
        client = WriteControlClient(address, timeout_s=10)
        errors = []
        for _ in replies:
            with pytest.raises(EngineError) as e:
                await client.call({"op": "begin"})
            errors.append(str(e.value))
        return errors

    errors = asyncio.run(calls())
    server.close()
    assert all(e.startswith("weight-write control begin") for e in errors)
    assert "garbage" in errors[0] and "[1]" in errors[1] and "longer than 4096" in errors[2]
    with pytest.raises(ValueError, match="not a weight-write control address"):
        WriteControlClient("/tmp/some.sock")


OWNER = """
import sys, time
from megatron_rl.engines.process_memory import ProcessMemory
m = ProcessMemory(1 << 20, "weights")
m.map[:5] = b"hello"
print(m.path, m.label, flush=True)
time.sleep(60)
"""


def test_shared_memory_dies_with_its_owner_even_on_sigkill() -> None:
    """A /dev/shm segment outlived every SIGKILLed engine; the memfd goes with its owner."""
    shm_before = set(os.listdir("/dev/shm"))
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        path, label = owner.stdout.readline().split()
        address = {"path": path, "label": label}
        mapped = map_process_memory(address, 1 << 20, writable=True, what="test")
        assert mapped[:5] == b"hello"
        mapped[:5] = b"world"  # the owner's pages: a writable mapping, not a copy
        assert map_process_memory(address, 1 << 20, writable=False, what="test")[:5] == b"world"
        with pytest.raises(ValueError, match="smaller"):
            map_process_memory(address, 1 << 21, writable=False, what="test")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    with pytest.raises(FileNotFoundError, match="owner exited"):
        map_process_memory(address, 1 << 20, writable=False, what="test")
    assert mapped[:5] == b"world"  # a live mapping keeps its pages until it is closed
    mapped.close()
    assert set(os.listdir("/dev/shm")) <= shm_before  # nothing left behind


def test_an_updates_buckets_read_one_mapping_of_the_trainers_segment() -> None:
    """The trainer writes every bucket into one segment; the engine maps it at the first
    bucket, reads each later one through the same mapping (the bytes written since, not
    stale ones) and unmaps it at the last; another segment's header unmaps one left over."""
    from megatron_rl.engines.tensors import SharedBucket, ShmWriter, shm_header

    gen = torch.Generator().manual_seed(0)
    values = [[(f"w{i}", torch.randn(1000, 300, generator=gen)) for i in range(3)]
              for _ in range(3)]
    writer, maps = ShmWriter(), []
    try:
        for k, bucket in enumerate(values):
            last = k == len(values) - 1
            with SharedBucket(shm_header(writer.write(bucket)), keep=not last) as named:
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, bucket,
                                                                       strict=True))
            maps.append(SharedBucket._kept.get(writer.segment.label, (None,))[0])
        assert maps[0] is not None and maps[1] is maps[0]  # mapped once
        assert maps[2] is None and maps[0].closed  # the last bucket unmapped it
        with SharedBucket(shm_header(writer.write(values[0])), keep=True):
            pass
        other = ShmWriter()
        try:
            kept = SharedBucket._kept[writer.segment.label][0]
            with SharedBucket(shm_header(other.write(values[1])), keep=False) as named:
                assert torch.equal(named[0][1], values[1][0][1])
            assert kept.closed and not SharedBucket._kept
        finally:
            other.close()
    finally:
        writer.close()

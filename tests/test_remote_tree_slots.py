"""Tree slots (``specsplit.remote.tree_slots``): a co-located target worker reads trees from the draft
worker's GPU memory. CUDA IPC itself needs GPUs and separate processes (``tests/test_gpu.py``); here:
the sanitiser that makes any slot contents a well-formed tree, the wire form, the draft worker's
refusals over a real gRPC server, and the target loop's slot bookkeeping and fallbacks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("grpc")

from specsplit import LocalTransport, SpecSplitConfig, SpecSplitGenerator, TreeConfig  # noqa: E402
from specsplit.config import TargetConfig  # noqa: E402
from specsplit.core.tree import TokenTree  # noqa: E402
from specsplit.errors import TransportError  # noqa: E402
from specsplit.remote import GrpcTransport, convert, serve_draft, serve_target, tree_slots  # noqa: E402
from specsplit.remote import target_loop as tl  # noqa: E402
from specsplit.remote._generated import spec_decoding_pb2 as pb  # noqa: E402
from specsplit.remote.tree_slots import SlotDraftRequest as DraftRequest  # noqa: E402
from specsplit.remote.tree_slots import SlotDraftResult as DraftResult
from specsplit.remote.tree_slots import TreeSlotRef

pytestmark = pytest.mark.usefixtures("one_thread")

DYNAMIC = TreeConfig(shape="dynamic", budget=16, max_depth=4, topk=4, width=4)


def in_slot(res: object) -> object:
    """The tree slot a draft result names (a plain ``DraftResult`` names none)."""
    return getattr(res, "tree_in_slot", None)


def _rows(tok: list[int], par: list[int], dep: list[int]) -> torch.Tensor:
    return torch.tensor([tok, par, dep], dtype=torch.long)


# ---------------------------------------------------------------------- sanitize
def test_sanitize_is_the_identity_on_well_formed_trees():
    tok, par, dep = [5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, 2, 4], [1, 1, 2, 2, 3, 4]
    out = tree_slots.sanitize(_rows(tok, par, dep), 100, torch.arange(6))
    assert [t.tolist() for t in out] == [tok, par, dep]
    TokenTree(*out, torch.zeros(6)).validate(100, 64, 16)  # what a host tree from the network must pass


def test_sanitize_makes_any_contents_a_well_formed_tree():
    """Out-of-vocabulary ids are clamped, a parent that is not an earlier node makes a root (itself,
    later nodes, out of range, below -1), and depths come from the parents, whatever row 2 says."""
    raw = _rows([-4, 7, 10**9, 3, 2, 1], [-1, 1, 0, 9, -7, 3], [9, 9, 9, 9, 9, 9])
    tok, par, dep = tree_slots.sanitize(raw, 100, torch.arange(6))
    assert tok.tolist() == [0, 7, 99, 3, 2, 1]
    assert par.tolist() == [-1, -1, 0, -1, -1, 3]
    assert dep.tolist() == [1, 1, 2, 1, 1, 2]
    TokenTree(tok, par, dep, torch.zeros(6)).validate(100, 64, 16)


def test_sanitize_empty_tree():
    out = tree_slots.sanitize(torch.zeros(3, 0, dtype=torch.long), 100, torch.arange(0))
    assert all(t.numel() == 0 for t in out)


# ---------------------------------------------------------------------- wire form
def test_draft_response_carries_either_the_tree_or_its_slot():
    ref = TreeSlotRef("c" * 32, 3, 24, 4, 5)
    m = convert.draft_result_to_proto(DraftResult(TokenTree.empty(), 17, tree_in_slot=ref))
    assert m.HasField("tree_in_slot") and not m.HasField("tree")
    back = convert.draft_result_from_proto(m)
    assert back.tree_in_slot == ref and back.tree.num_nodes == 0 and back.prefix_length == 17
    tree = TokenTree(torch.tensor([4, 5]), torch.tensor([-1, 0]), torch.tensor([1, 2]), torch.zeros(2))
    plain = convert.draft_result_from_proto(convert.draft_result_to_proto(DraftResult(tree, 9)))
    assert in_slot(plain) is None and plain.tree.token_ids.tolist() == [4, 5]
    m.tree.token_ids.append(1)
    with pytest.raises(Exception, match="both a tree and a tree slot"):
        convert.draft_result_from_proto(m)


def test_draft_request_carries_its_slot():
    req = DraftRequest("s", [1, 2], 0, DYNAMIC, tree_channel="abc", tree_slot=5)
    back = convert.draft_request_from_proto(convert.draft_request_to_proto(req))
    assert (back.tree_channel, back.tree_slot) == ("abc", 5)


# ---------------------------------------------------------------------- draft worker side
def test_cpu_draft_worker_refuses_slots_and_sends_trees(engines):
    """Over a real server: ShareTreeSlots says why not (CPU draft, another host, switched off), and a
    request naming a channel the worker does not know gets its tree in the reply (e.g. after a
    restart)."""
    with serve_draft(engines[0]) as srv, GrpcTransport(None, srv.address) as client:
        resp = client.share_tree_slots(tree_slots.host_id(), 4)
        assert not resp.available and "cpu" in resp.reason
        res = client.draft(DraftRequest("s1", [3, 4, 5, 6], 0, DYNAMIC, tree_channel="unknown", tree_slot=0))
        assert in_slot(res) is None and res.tree.num_nodes > 0
    exporter = tree_slots.TreeSlotExporter(torch.device("cuda", 0), 64)  # never touches CUDA when refusing
    assert "another host" in exporter.share(pb.ShareTreeSlotsRequest(host_id="elsewhere/1", slots=2)).reason


def test_slots_switched_off_on_either_worker():
    exporter = tree_slots.TreeSlotExporter(
        torch.device("cuda", 0), 64, enabled=False
    )  # serve draft --no-tree-ipc
    resp = exporter.share(pb.ShareTreeSlotsRequest(host_id=tree_slots.host_id(), slots=2))
    assert not resp.available and "--no-tree-ipc" in resp.reason
    loop = tl.TargetLoopTransport(
        object(), _FakeDraft(), lambda c: c, tree_slots=False
    )  # serve target --no-tree-ipc
    assert loop._want_slots is False


def test_exporter_places_only_what_a_slot_can_hold():
    """Unknown channel, slot out of range, sampled trees (q), too many nodes, no host bounds: None."""
    exporter = tree_slots.TreeSlotExporter(torch.device("cpu"), 4)
    ch = tree_slots._Channel(torch.zeros(2, tree_slots.ROWS * 4, dtype=torch.long), [_Event(), _Event()])
    exporter._channels["c"] = ch
    tree = TokenTree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0]), torch.tensor([1, 2, 2]), torch.zeros(3),
                     max_branch=2, depth_bound=2)  # fmt: skip
    ref = exporter.place("c", 1, tree)
    assert ref == TreeSlotRef("c", 1, 3, 2, 2) and ch.events[1].records == 1
    assert ch.buffer[1, :9].view(3, 3).tolist() == [[7, 8, 9], [-1, 0, 0], [1, 2, 2]]
    assert ch.buffer[0].abs().sum() == 0
    assert exporter.place("other", 0, tree) is None
    assert exporter.place("c", 2, tree) is None
    big = TokenTree(torch.arange(5), torch.full((5,), -1), torch.ones(5, dtype=torch.long), torch.zeros(5),
                    max_branch=5, depth_bound=1)  # fmt: skip
    assert exporter.place("c", 0, big) is None
    sampled = TokenTree(tree.token_ids, tree.parents, tree.depths, tree.log_probs, torch.zeros(3, 2, dtype=torch.long),
                        torch.zeros(3, 2), 2, 2)  # fmt: skip
    assert exporter.place("c", 0, sampled) is None
    unbounded = TokenTree(tree.token_ids, tree.parents, tree.depths, tree.log_probs)
    assert exporter.place("c", 0, unbounded) is None


class _Event:
    def __init__(self) -> None:
        self.records = 0

    def record(self, stream: object = None) -> None:
        self.records += 1


# ---------------------------------------------------------------------- target loop side
class _FakeDraft:
    """A draft client: records requests; answers from a slot when asked to, else with the tree."""

    has_draft = True

    def __init__(self, grant: bool = True, answer_in_slot: bool = True, refuse: bool = False):
        self.grant, self.answer_in_slot, self.refuse = grant, answer_in_slot, refuse
        self.shares, self.requests = 0, []

    def share_tree_slots(self, host: str, slots: int) -> pb.ShareTreeSlotsResponse:
        self.shares += 1
        if not self.grant:
            raise TransportError("UNIMPLEMENTED")
        if self.refuse:
            return pb.ShareTreeSlotsResponse(available=False, reason="the target worker runs on another host")
        return pb.ShareTreeSlotsResponse(available=True, channel_id=f"ch{self.shares}", slots=2, slot_nodes=8)

    def draft(self, req: DraftRequest) -> DraftResult:
        channel, slot = (
            getattr(req, "tree_channel", ""),
            getattr(req, "tree_slot", 0),
        )  # a plain request: none
        self.requests.append((req.session_id, channel, slot))
        if channel and self.answer_in_slot:
            return DraftResult(TokenTree.empty(), 4, tree_in_slot=TreeSlotRef(channel, slot, 3, 2, 2))
        return DraftResult(
            TokenTree(torch.tensor([1]), torch.tensor([-1]), torch.tensor([1]), torch.zeros(1)), 4
        )

    def end_session(self, sid: str) -> None:
        pass


class _FakeImporter:
    def __init__(self, resp: pb.ShareTreeSlotsResponse, device: torch.device):
        if not resp.available:
            raise TransportError(resp.reason)
        self.channel_id, self.slots, self.slot_nodes = resp.channel_id, resp.slots, resp.slot_nodes
        self.reads: list[TreeSlotRef] = []

    def read(self, ref: TreeSlotRef, vocab: int, max_nodes: int, max_depth: int) -> TokenTree:
        self.reads.append(ref)
        return TokenTree(torch.tensor([2, 3, 4]), torch.tensor([-1, 0, 0]), torch.tensor([1, 2, 2]), torch.zeros(3),
                         max_branch=2, depth_bound=2)  # fmt: skip


class _Engine:
    device = torch.device("cuda", 0)  # a CUDA engine as far as the loop can tell
    model_vocab_size = 100
    config = TargetConfig()

    def end_session(self, sid: str) -> bool:
        return True


def _loop(draft: _FakeDraft, monkeypatch) -> tl.TargetLoopTransport:
    monkeypatch.setattr(tl, "TreeSlotImporter", _FakeImporter)
    return tl.TargetLoopTransport(_Engine(), draft, lambda c: c)  # type: ignore[arg-type]


def test_target_loop_gives_each_generation_a_slot_and_takes_it_back(monkeypatch):
    draft = _FakeDraft()
    loop = _loop(draft, monkeypatch)
    a = loop.draft(DraftRequest("a", [1], 0, DYNAMIC))
    b = loop.draft(DraftRequest("b", [1], 0, DYNAMIC))
    a2 = loop.draft(DraftRequest("a", [], 4, DYNAMIC))
    assert draft.shares == 1  # asked once
    (_, ch, sa), (_, _, sb), (_, _, sa2) = draft.requests
    assert ch == "ch1" and sa != sb and sa == sa2
    assert a.tree.token_ids.tolist() == [2, 3, 4] and b.tree.num_nodes == 3 and in_slot(a2) is not None
    assert len(loop._slots.reads) == 3  # type: ignore[union-attr]
    c = loop.draft(DraftRequest("c", [1], 0, DYNAMIC))  # both slots taken: the tree comes in the reply
    assert draft.requests[-1][1] == "" and in_slot(c) is None and c.tree.num_nodes == 1
    loop.end_session("a")
    loop.draft(DraftRequest("c", [], 4, DYNAMIC))
    assert draft.requests[-1][1:] == ("ch1", sa)  # a's slot went to c
    draft.close = lambda: None
    loop.close()  # unmaps the slots; nothing asks for them again
    loop.draft(DraftRequest("d", [1], 0, DYNAMIC))
    assert loop._slots is None and draft.requests[-1][1] == "" and draft.shares == 1


def test_target_loop_keeps_speculative_and_sampled_trees_in_replies(monkeypatch):
    from specsplit.config import SamplingParams

    draft = _FakeDraft()
    loop = _loop(draft, monkeypatch)
    loop.draft(DraftRequest("a", [], 4, DYNAMIC, speculate=True))
    loop.draft(DraftRequest("b", [1], 0, DYNAMIC, sampling=SamplingParams(do_sample=True, temperature=0.7)))
    assert [r[1] for r in draft.requests] == ["", ""] and draft.shares == 0


def test_target_loop_falls_back_when_slots_are_refused_or_lost(monkeypatch):
    refused = _FakeDraft(grant=False)
    loop = _loop(refused, monkeypatch)
    res = loop.draft(DraftRequest("a", [1], 0, DYNAMIC))
    assert res.tree.num_nodes == 1 and refused.requests[-1][1] == ""
    loop.draft(DraftRequest("a", [], 4, DYNAMIC))
    assert refused.shares == 1  # not asked again before _RESHARE_S

    refusing = _FakeDraft(refuse=True)  # a refusal (another host, CPU, switched off) is for good
    loop = _loop(refusing, monkeypatch)
    loop.draft(DraftRequest("a", [1], 0, DYNAMIC))
    loop._share_after = 0.0
    loop.draft(DraftRequest("b", [1], 0, DYNAMIC))
    assert refusing.shares == 1 and not loop._want_slots and [r[1] for r in refusing.requests] == ["", ""]

    fresh = _FakeDraft(answer_in_slot=False)  # grants slots, then answers with trees anyway
    loop = _loop(fresh, monkeypatch)
    res = loop.draft(DraftRequest("a", [1], 0, DYNAMIC))
    assert res.tree.num_nodes == 1 and loop._slots is not None and loop._slot_of == {}  # slot given back
    loop.draft(DraftRequest("a", [], 4, DYNAMIC))
    assert fresh.shares == 1 and fresh.requests[-1][1] == ""  # not asked again every round

    restarted = _FakeDraft()  # slots in use for a while, then the worker restarts and knows no channel
    loop = _loop(restarted, monkeypatch)
    loop.draft(DraftRequest("a", [1], 0, DYNAMIC))
    loop._shared_at -= tl._RESHARE_S
    restarted.answer_in_slot = False
    res = loop.draft(DraftRequest("a", [], 4, DYNAMIC))
    assert res.tree.num_nodes == 1 and loop._slots is None
    restarted.answer_in_slot = True
    loop.draft(DraftRequest("a", [], 5, DYNAMIC))
    assert restarted.shares == 2 and restarted.requests[-1][1] == "ch2"  # asked again at once


def test_sessions_a_draft_worker_answers_in_replies_keep_the_slots_for_others(monkeypatch):
    """A draft worker that answers some sessions in replies (its batched chain drafts) while it
    fills slots for others: each such session gives its slot back after its first round and asks
    for none again, the slots stay shared (asked for once, never dropped), and a session the worker
    served through its slot before still has its trees read from there."""
    draft = _FakeDraft()
    answer_in_reply = {"chain-1", "chain-2", "chain-3"}
    plain_draft = draft.draft

    def draft_call(req: DraftRequest) -> DraftResult:
        if req.session_id in answer_in_reply:
            draft.requests.append(
                (req.session_id, getattr(req, "tree_channel", ""), getattr(req, "tree_slot", 0))
            )
            return DraftResult(
                TokenTree(torch.tensor([1]), torch.tensor([-1]), torch.tensor([1]), torch.zeros(1)), 4
            )
        return plain_draft(req)

    draft.draft = draft_call  # type: ignore[method-assign]
    loop = _loop(draft, monkeypatch)
    assert in_slot(loop.draft(DraftRequest("tree", [1], 0, DYNAMIC))) is not None
    for rnd in range(3):  # three chain sessions, three rounds each: two slots are enough for them all
        for sid in sorted(answer_in_reply):
            loop.draft(DraftRequest(sid, [1] if rnd == 0 else [], 4 * rnd, DYNAMIC))
    asked = [r for r in draft.requests if r[0].startswith("chain") and r[1]]
    assert sorted(r[0] for r in asked) == sorted(answer_in_reply)  # each asked once, on its first round
    assert draft.shares == 1 and loop._slots is not None and list(loop._slot_of) == ["tree"]
    assert in_slot(loop.draft(DraftRequest("tree", [], 4, DYNAMIC))) is not None
    loop.end_session("chain-1")
    assert "chain-1" not in loop._by_reply
    # The draft worker restarts while no running session has a tree in a slot: once the slots have
    # carried no tree for _RESHARE_S, a session answered in a reply makes the loop ask again.
    loop.end_session("tree")
    loop._slot_tree_at -= tl._RESHARE_S
    loop._shared_at -= tl._RESHARE_S
    draft.answer_in_slot = False
    loop.draft(DraftRequest("new", [1], 0, DYNAMIC))
    assert loop._slots is None
    draft.answer_in_slot = True
    assert in_slot(loop.draft(DraftRequest("new", [], 4, DYNAMIC))) is not None and draft.shares == 2


def test_target_loop_rejects_a_slot_nobody_asked_for(monkeypatch):
    draft = _FakeDraft(grant=False)
    loop = _loop(draft, monkeypatch)
    draft.draft = lambda req: DraftResult(TokenTree.empty(), 4, tree_in_slot=TreeSlotRef("x", 0, 3, 2, 2))
    with pytest.raises(TransportError, match="nobody asked"):
        loop.draft(DraftRequest("a", [1], 0, DYNAMIC))


def test_target_loop_on_cpu_workers_equals_local(engines):
    """CPU workers: the target loop asks for no slots (its engine is not on CUDA) and the output is
    local mode's; the draft worker answers every request with the tree."""
    d_engine, t_engine = engines
    ids = torch.tensor([[5, 9, 13, 2, 7, 11]])
    want = SpecSplitGenerator(
        transport=LocalTransport(d_engine, t_engine), config=SpecSplitConfig(tree=DYNAMIC)
    )
    want = want.generate(ids, max_new_tokens=12)
    with serve_draft(d_engine) as d_srv, serve_target(t_engine, draft_address=d_srv.address) as t_srv:
        cfg = SpecSplitConfig(
            transport="grpc", grpc_loop="target", tree=DYNAMIC, target_address=t_srv.address
        )
        with SpecSplitGenerator(config=cfg) as gen:
            assert torch.equal(gen.generate(ids, max_new_tokens=12), want)


def test_importer_rejects_bad_slot_refs_before_touching_the_gpu():
    """A misbehaving draft worker's reply (another channel, a slot or node count out of range, bounds
    beyond this worker's limits) is a TransportError (the loop then continues target-only); nothing
    is queued on the device and nothing is counted as read."""
    imp = object.__new__(tree_slots.TreeSlotImporter)
    imp.channel_id, imp.slots, imp.slot_nodes, imp.reads = "ch", 2, 8, 0
    bad = [
        TreeSlotRef("other", 0, 3, 2, 2),
        TreeSlotRef("ch", 2, 3, 2, 2),
        TreeSlotRef("ch", -1, 3, 2, 2),
        TreeSlotRef("ch", 0, 9, 2, 2),  # more nodes than a slot holds
        TreeSlotRef("ch", 0, 7, 2, 2),  # more than this worker's max_nodes (6)
        TreeSlotRef("ch", 0, 3, 2, 5),  # deeper than max_depth (4)
        TreeSlotRef("ch", 0, 3, 7, 2),  # wider than max_nodes
        TreeSlotRef("ch", 0, -1, 2, 2),
    ]
    for ref in bad:
        with pytest.raises(TransportError, match="draft reply"):
            imp.read(ref, 100, max_nodes=6, max_depth=4)
    assert imp.reads == 0

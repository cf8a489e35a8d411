"""Tree slots: a co-located target worker reads each round's tree from the draft worker's GPU memory.

Without them a round's tree crosses between the workers as a protobuf message: the draft worker
waits for its GPU work to end, copies the tree to the host and serialises it; the target worker
decodes and validates it and only then prepares and launches its verification. All of that, and the
reply's network hop, is serial host work while the GPU idles (see benchmarks/NOTES.md, "Tree slots").

With a target worker on the same host as its draft worker (``specsplit serve target
--draft-address``; ``--tree-ipc`` is the default), the target asks the draft worker once for
*tree slots* (``DraftService.ShareTreeSlots``): a small int64 buffer on the draft's GPU, shared
through CUDA IPC, and one interprocess CUDA event per slot. Every round the draft worker queues a
copy of the tree into the session's slot behind its tree growth, records the slot's event and
replies at once, with only the node count and bounds (``DraftResponse.tree_in_slot``). The
target's stream waits for that event and the verification is queued right behind the draft's GPU
work, as it is in one process: the reply's hop, the target's conversions and its launch overlap
the draft's GPU time.

Trust: a slot's contents are untrusted input like any tree from the network, but they can only be
read on the GPU (reading them on the host would be the sync this avoids). :func:`sanitize` makes
any contents a well-formed tree without a host read: token ids are clamped into the vocabulary,
a parent that is not an earlier node becomes a root, and depths are rebuilt from the parents. For
a well-formed tree it is the identity, and verification is exact for ANY well-formed tree, so a
broken or hostile draft worker can cost acceptance, never correctness or memory safety. The
bounds in the reply are host values and are checked against the target's limits.

The order of writes and reads needs no extra synchronisation: a slot belongs to one generation at a
time, and a generation's next draft request (the only thing that makes the draft write the slot
again) is sent after the verification that read it has finished. Speculative drafts of the
overlapped pipeline, sampled trees (which carry ``q``) and trees larger than a slot travel in the
reply as before.

Slots are refused (and trees travel in replies) when the draft runs on the CPU, the hosts differ,
the draft's GPU is not visible to the target, the CUDA IPC handles do not open (e.g. containers
without a shared IPC namespace), or when the target worker is started with ``--no-tree-ipc``.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from specsplit.core.tree import TokenTree
from specsplit.core.tree_attention import ancestor_matrix
from specsplit.errors import TransportError
from specsplit.messages import DraftRequest, DraftResult
from specsplit.remote._generated import spec_decoding_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass
class TreeSlotRef:
    """Where a draft worker left a tree in GPU memory a co-located target worker maps
    (:mod:`specsplit.remote.tree_slots`), with the host-side bounds verification needs."""

    channel_id: str
    slot: int
    num_nodes: int
    max_branch: int
    depth_bound: int


@dataclass
class SlotDraftRequest(DraftRequest):
    """A :class:`~specsplit.messages.DraftRequest` that asks a draft worker to leave the tree in
    a tree slot of ``tree_channel`` (between co-located workers only; engines never see these fields).
    """

    tree_channel: str = ""
    tree_slot: int = 0

    @classmethod
    def of(cls, request: DraftRequest, channel: str, slot: int) -> SlotDraftRequest:
        """``request`` asking for its tree in slot ``slot`` of ``channel``."""
        base = {f.name: getattr(request, f.name) for f in fields(DraftRequest)}
        return cls(**base, tree_channel=channel, tree_slot=slot)


@dataclass
class SlotDraftResult(DraftResult):
    """A :class:`~specsplit.messages.DraftResult` whose tree was left in a tree slot: ``tree`` is
    empty and the target worker that asked reads it from ``tree_in_slot``."""

    tree_in_slot: TreeSlotRef | None = None


ROWS = 3  # token_ids, parents, depths
MAX_SLOTS = 16  # per channel
MAX_CHANNELS = 8  # per draft worker; the least recently shared is dropped beyond this


def host_id() -> str:
    """This host's identity: hostname and kernel boot id (CUDA IPC handles only open on one host)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _local_index(device_uuid: str) -> int | None:
    """This process's index of the GPU with ``device_uuid`` (indices differ with CUDA_VISIBLE_DEVICES)."""
    for i in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", i)) == device_uuid:
            return i
    return None


@dataclass
class _Channel:
    buffer: torch.Tensor  # [slots, ROWS * slot_nodes] int64
    events: list[torch.cuda.Event]


class TreeSlotExporter:
    """The draft worker's side: grants channels of slots and leaves trees in them.

    Args:
        device: the draft engine's device (slots are refused unless it is a CUDA device).
        slot_nodes: most nodes a slot holds (the draft's ``max_tree_nodes``).
        enabled: grant slots at all (``specsplit serve draft --no-tree-ipc``: trees always travel in
            replies).
    """

    def __init__(self, device: torch.device, slot_nodes: int, enabled: bool = True):
        self.enabled = enabled
        self.device = torch.device(device)
        self.slot_nodes = slot_nodes
        self._channels: OrderedDict[str, _Channel] = OrderedDict()
        self._lock = threading.Lock()

    def share(self, req: pb.ShareTreeSlotsRequest) -> pb.ShareTreeSlotsResponse:
        """Grant a new channel, or say why not (``available=False``)."""
        reason = self._refusal(req)
        if reason:
            return pb.ShareTreeSlotsResponse(available=False, reason=reason)
        slots = min(max(req.slots, 1), MAX_SLOTS)
        try:
            with torch.cuda.device(self.device):
                buffer = torch.zeros(slots, ROWS * self.slot_nodes, dtype=torch.long, device=self.device)
                events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
                stream = torch.cuda.current_stream(self.device)
                for ev in events:  # a wait before the first write finds a recorded event
                    ev.record(stream)
                dev, handle, size, offset, ref_handle, ref_offset, ev_handle, ev_sync = (
                    buffer.untyped_storage()._share_cuda_()
                )
                ev_handles = [ev.ipc_handle() for ev in events]
        except (RuntimeError, AttributeError) as e:  # an allocator or driver that cannot share memory
            logger.info("tree slots refused: CUDA IPC is not available here (%s)", e)
            return pb.ShareTreeSlotsResponse(available=False, reason=f"CUDA IPC is not available: {e}")
        channel_id = uuid.uuid4().hex
        with self._lock:
            self._channels[channel_id] = _Channel(buffer, events)
            while len(self._channels) > MAX_CHANNELS:
                # torch's IPC reference counting keeps the memory alive while a reader holds it
                self._channels.popitem(last=False)
        logger.info("shared %d tree slots on %s (channel %s)", slots, self.device, channel_id[:8])
        return pb.ShareTreeSlotsResponse(
            available=True,
            channel_id=channel_id,
            slots=slots,
            slot_nodes=self.slot_nodes,
            device_uuid=_device_uuid(self.device),
            storage_handle=handle,
            storage_size_bytes=size,
            storage_offset_bytes=offset,
            ref_counter_handle=ref_handle,
            ref_counter_offset=ref_offset,
            storage_event_handle=ev_handle or b"",
            storage_event_sync_required=bool(ev_sync),
            slot_event_handles=ev_handles,
        )

    def _refusal(self, req: pb.ShareTreeSlotsRequest) -> str:
        if not self.enabled:
            return "tree slots are off on the draft worker (specsplit serve draft --no-tree-ipc)"
        if self.device.type != "cuda":
            return f"the draft runs on {self.device}, not a CUDA device"
        if req.host_id != host_id():
            return "the target worker runs on another host"
        return ""

    def place(self, channel_id: str, slot: int, tree: TokenTree) -> TreeSlotRef | None:
        """Queue a copy of ``tree`` into a slot and record its event; ``None``: send it in the reply.

        No host sync: the copy runs behind the tree's own GPU work.
        """
        with self._lock:
            ch = self._channels.get(channel_id)
        n = tree.num_nodes
        if (
            ch is None
            or not 0 <= slot < len(ch.events)
            or tree.q_ids is not None
            or n > self.slot_nodes
            or tree.token_ids.device != ch.buffer.device
            or tree.max_branch is None
            or tree.depth_bound is None
        ):
            return None
        if n:
            out = ch.buffer[slot, : ROWS * n].view(ROWS, n)
            torch.stack([tree.token_ids, tree.parents, tree.depths], out=out)
        ch.events[slot].record(torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None)
        return TreeSlotRef(channel_id, slot, n, tree.max_branch, tree.depth_bound)


class TreeSlotImporter:
    """The target worker's side: the draft worker's slots of one channel, mapped into this process.

    Raises:
        TransportError: the response grants nothing, or the memory or events do not open here.
    """

    def __init__(self, resp: pb.ShareTreeSlotsResponse, device: torch.device):
        if not resp.available:
            raise TransportError(resp.reason or "the draft worker granted no tree slots")
        if len(resp.slot_event_handles) != resp.slots or resp.slots <= 0 or resp.slot_nodes <= 0:
            raise TransportError("malformed ShareTreeSlots response")
        index = _local_index(resp.device_uuid)
        if index is None:
            raise TransportError(f"the draft's GPU ({resp.device_uuid}) is not visible to this worker")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        self.channel_id = resp.channel_id
        self.slots, self.slot_nodes = resp.slots, resp.slot_nodes
        self.device = torch.device(device)
        width = ROWS * resp.slot_nodes
        if resp.storage_size_bytes != resp.slots * width * 8:
            raise TransportError("ShareTreeSlots: the buffer's size does not match its slots")
        try:
            self.buffer = rebuild_cuda_tensor(
                torch.Tensor, (resp.slots, width), (width, 1), 0, torch.UntypedStorage, torch.long,
                index, resp.storage_handle, resp.storage_size_bytes, resp.storage_offset_bytes, False,
                resp.ref_counter_handle, resp.ref_counter_offset, resp.storage_event_handle,
                resp.storage_event_sync_required,
            )  # fmt: skip
            src = torch.device("cuda", index)
            self.events = [torch.cuda.Event.from_ipc_handle(src, h) for h in resp.slot_event_handles]
        except (RuntimeError, OSError, ValueError, TypeError) as e:
            raise TransportError(f"could not open the draft worker's tree slots here: {e}") from None
        self._per_n: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # n -> (arange(n), zeros(n))
        self.reads = 0  # trees read (telemetry, tests)

    def read(self, ref: TreeSlotRef, vocab_size: int, max_nodes: int, max_depth: int) -> TokenTree:
        """The tree in ``ref``'s slot on this worker's device, sanitised; queued, no host sync.

        Raises:
            TransportError: ``ref`` names another channel, a slot out of range, or bounds beyond
                the slot or this worker's limits (the draft worker is misbehaving).
        """
        n = ref.num_nodes
        if ref.channel_id != self.channel_id or not 0 <= ref.slot < self.slots:
            raise TransportError(f"draft reply names tree slot {ref.slot} of an unknown channel")
        if not 0 <= n <= min(self.slot_nodes, max_nodes):
            raise TransportError(
                f"draft reply: {n} nodes in a tree slot (limit {min(self.slot_nodes, max_nodes)})"
            )
        if not (0 <= ref.depth_bound <= max_depth and 0 <= ref.max_branch <= max_nodes):
            raise TransportError(
                f"draft reply: tree bounds (branch {ref.max_branch}, depth {ref.depth_bound}) beyond "
                f"this worker's limits ({max_nodes} nodes, depth {max_depth})"
            )
        # Waited for on its own device's stream (a wait on an IPC event from another device
        # crashes); a copy across devices then orders this device's stream after that one.
        torch.cuda.current_stream(self.buffer.device).wait_event(self.events[ref.slot])
        raw = self.buffer[ref.slot, : ROWS * n].view(ROWS, n).to(self.device, non_blocking=True)
        rows, log_probs = self._constants(n)
        tok, par, dep = sanitize(raw, vocab_size, rows)
        self.reads += 1
        return TokenTree(tok, par, dep, log_probs, None, None, ref.max_branch, ref.depth_bound)

    def _constants(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``arange(n)`` and the greedy tree's (unused) zero log-probs, made once per node count."""
        got = self._per_n.get(n)
        if got is None:
            got = self._per_n[n] = (torch.arange(n, device=self.device), torch.zeros(n, device=self.device))
        return got


def sanitize(raw: torch.Tensor, vocab_size: int, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(token_ids, parents, depths)`` of a well-formed tree from untrusted `[3, N]` int64 rows.

    Token ids are clamped into ``[0, vocab_size)``; a parent outside ``[0, i)`` makes node ``i`` a
    root; depths are rebuilt from the parents (the third row is ignored). Device ops only, no
    host sync; the identity on a well-formed tree. ``rows`` is ``arange(N)`` on the device.
    """
    tok = raw[0].clamp(0, vocab_size - 1)
    par = torch.where((raw[1] >= 0) & (raw[1] < rows), raw[1], -1)
    dep = ancestor_matrix(par).sum(-1)
    return tok, par, dep

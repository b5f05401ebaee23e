"""The wire: every message tqueue sends, as typed structs, and how they become frames.

A message is ``[kind, header, *buffers]``: one byte naming the message type, the header as
MessagePack (a msgspec Struct, so decoding validates), then one raw frame per payload buffer.
Payload bytes never pass through MessagePack and nothing is ever unpickled.

A timeout on the wire is always explicit: seconds, or ``math.inf`` for no deadline. (Only
``Store.timeout``, which tells a unit how long its writer waits, may be None: unknown.) The
rule everywhere above the wire is the same with one more case: None is "no timeout of my
own", the default of whoever is asked (the client's config, a peer's request timeout).

Schema evolution follows msgspec's rules: new struct fields get defaults and go last; a
change that old peers cannot read bumps :data:`PROTOCOL_VERSION`, which the handshake checks.

Closed sets of names are ``Literal`` types and fixed pairs are tuples, so decoding checks
them as it checks every other type (a ``FieldSpec`` of layout ``"sparse"``, a lane of three
numbers is a ``ProtocolError`` naming the path, before any handler runs). Both encode as the
strings and arrays they replaced: peers of this protocol version read each other either way.
Sets that grow at run time stay ``str`` and are checked where they are known: batch policies
(loaded by the controller), error codes (an unknown code becomes ``RemoteError``), dtypes.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Union, get_args

import msgspec

from ..errors import ProtocolError

PROTOCOL_VERSION = 13  # 2: FieldBlock.packed; 3: heartbeats (Ping, Pong, Bye, Heartbeat), unit names, lost samples; 4: Notice, CreatePartition.step; 5: timeouts are explicit (math.inf: none); 6: arena epochs (Allocated, Fetched); 7: arena leases (Store.keep, Store.release, Allocated.ttl); 8: a unit's commits of one loop turn in one message (Commits, CommitsDone); 9: per-sample CRC-32C (FieldBlock.crcs); 10: storage copies are named copies (CreatePartition.copies, BatchMeta.two_copies, Granted.second_units, Located.two_copies and second_units, PartitionStatus.copies); 11: integers packed as uint8 (FieldBlock.packed); 12: values shared by content (FieldBlock.value_of, CreatePartition.dedup, Granted.dedup, Heartbeat.bytes_shared), appends that write only the new rows (Grant.append, Store.append, FieldBlock.rows_per_sample); 13: splice rows kept by the controller (Grant.splice, BatchMeta.splices)

GroupId = Union[str, int, None]
FieldKind = Literal["tensor", "ndarray", "object"]
FieldLayout = Literal["dense", "jagged"]
PackedType = Literal["", "int8", "uint8", "int16", "int32"]  # "": the field's own dtype
PutStatus = Literal["ok", "aborted", "recycled", "trimmed", "moved"]  # trimmed: some samples kept, see fates
SampleFate = Literal["ok", "aborted"]
MemberFailure = Literal["drop_group", "mask_member"]
MEMBER_FAILURES: tuple[MemberFailure, ...] = get_args(MemberFailure)  # to check a caller's argument
WaiterKind = Literal["get_meta", "put", "reserve"]
WaitCause = Literal["samples", "memory", "staleness"]  # what a parked call waits for


class Kind(enum.IntEnum):
    ERROR = 1
    OK = 2
    HELLO = 3
    HELLO_REPLY = 4
    REGISTER_UNIT = 5
    REGISTERED = 6
    GRANT = 7
    GRANTED = 8
    STORE = 9
    STORED = 10
    COMMIT = 11
    GET_META = 12
    META = 13
    FETCH = 14
    FETCHED = 15
    ACK = 16
    CLEAR = 17
    DROP = 18
    STATUS = 19
    STATUS_REPLY = 20
    CREATE_PARTITION = 21
    ALLOC = 22
    ALLOCATED = 23
    RELEASE = 24
    RENEW = 25
    FAIL = 26
    SET_VERSION = 27
    ADMISSION = 28
    RESERVE = 29
    DROPPED = 30
    SEAL = 31
    MOVE = 32
    POSTPONE = 33
    SEALED = 34
    SELECT = 35
    CANCEL = 36
    PING = 37
    PONG = 38
    BYE = 39
    HEARTBEAT = 40
    HEARTBEAT_REPLY = 41
    NOTICE = 42
    COMMITTED = 43
    VERSION_WAIT = 44
    VERSION_REPLY = 45
    COMMITS = 46
    COMMITS_DONE = 47
    # 50-59: durability (wire/_durable.py)
    CHECKPOINT = 50
    CHECKPOINT_REPLY = 51
    RESTORE = 52
    RESTORED = 53
    SAVE_UNIT = 54
    UNIT_SAVED = 55
    LOAD_UNIT = 56
    UNIT_LOADED = 57
    # 60-69: keys and tags (wire/_keys.py)
    BIND_KEYS = 60
    TAG_KEYS = 61
    SET_TAGS = 62
    LOOKUP_KEYS = 63
    KEYS_FOUND = 64
    LIST_KEYS = 65
    KEY_LISTING = 66
    DROP_KEYS = 67
    RESET_CONSUMPTION = 68
    # 70-79: rows allocated ahead of their data (wire/_rows.py)
    ALLOCATE_ROWS = 70
    LOCATE = 71
    LOCATED = 72
    CORRUPT = 73


class Message(msgspec.Struct, kw_only=True):
    """Base of every header. ``rid`` pairs a reply with its request."""

    KIND: ClassVar[Kind]
    rid: int = 0


# --- payload descriptions ---------------------------------------------------------------


class FieldSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one field is, independent of any batch.

    ``kind`` is ``tensor`` (torch), ``ndarray`` (numpy) or ``object`` (MessagePack values).
    ``layout`` is ``dense`` (every sample has ``shape``; a batch stacks them) or ``jagged``
    (per-sample shapes of ``ndim`` dimensions that may differ; a batch keeps them apart).
    In a partition's schema (a meta's ``schema``, ``status()``), a jagged tensor field's
    ``shape`` is the one shape all its samples have had so far, or ``()`` once they differed.
    """

    kind: FieldKind
    dtype: str = ""
    layout: FieldLayout = "dense"
    shape: tuple[int, ...] = ()
    ndim: int = 0


class FieldBlock(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One field of a run of samples, as it travels: the header of its raw frames.

    Frame ``i`` holds the bytes of ``counts[i]`` consecutive samples, back to back.
    ``shapes`` (jagged, flattened ``n * ndim``) or ``sizes`` (object, bytes per sample)
    give each sample's extent; dense samples all have ``spec.shape``.

    ``packed`` (integer fields only): per frame, ``""`` or the narrower integer dtype
    (``int8``, ``uint8``, ``int16``, ``int32``) its values travel and are stored in; they all fit it,
    and readers get them back in ``spec.dtype``. See tqueue/wire/_pack.py.

    ``crcs``: per sample, the CRC-32C of its bytes as the producer put them (before any
    packing: what readers get back), or -1 where none was computed; computed once by the
    producer, kept by the unit, checked by the reader (tqueue/client/_integrity.py).

    ``value_of`` (a field shared by content, ``create_partition(dedup=...)``): the block
    carries each distinct value once, and ``value_of[i]`` is the one sample ``i`` holds.
    ``counts``, ``shapes``, ``sizes``, ``packed`` and ``crcs`` then describe the values, not the
    samples; values appear in the order their first sample does. See tqueue/wire/_shared.py.

    ``rows_per_sample`` (a read of samples that appends grew, ``Store.append``): sample ``i``
    is ``rows_per_sample[i]`` consecutive rows of the block, its value their concatenation
    along dim 0; ``counts``, ``shapes``, ``packed`` and ``crcs`` describe the rows.
    """

    name: str
    spec: FieldSpec
    counts: list[int]
    shapes: list[int] | None = None
    sizes: list[int] | None = None
    packed: list[PackedType] | None = None
    crcs: list[int] | None = None
    value_of: list[int] | None = None
    rows_per_sample: list[int] | None = None


class UnitInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A storage unit; ``shm`` is the path of its shared-memory arena ("" if it has none),
    which clients on the same ``host`` map to write and read payload without sockets;
    ``bulk`` the ``host:port`` of its bulk stream listener ("" if it has none); ``nixl`` its
    NIXL agent's metadata and ``nixl_base`` the address of its arena there (``b""``: it offers
    no NIXL transfers; see tqueue/transport/_nixl.py); ``rdma``: its host has RDMA devices."""

    unit_id: int
    address: str
    host: str
    shm: str = ""
    bulk: str = ""
    nixl: bytes = b""
    nixl_base: int = 0
    rdma: bool = False  # its host has RDMA devices


class BatchMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Where a batch of samples lives and what it holds; no payload.

    Returned by ``put`` (the samples just written) and ``get_meta`` (the samples leased to
    a task). It is a plain MessagePack-able struct, so ranks can pass it to each other.
    """

    partition: str
    partition_uid: int
    indexes: list[int]
    units: list[int]
    fields: list[str]
    schema: dict[str, FieldSpec]
    groups: list[GroupId] | None = None
    task: str | None = None
    lease: int = 0
    lease_timeout: float = math.inf
    versions: list[int] | None = None
    dp_rank: int = -1
    dp_size: int = 0
    round: int = -1
    global_batch_size: int = 0
    num_microbatches: int = 1
    micro_batch_indices: list[list[int]] | None = None
    versions_max: list[int] | None = None
    segments: list[list[list[int]]] | None = None  # per sample: [[version, first_token], ...]
    # per field spliced by ``complete(splice=)``, per sample: the field's first row that each of
    # its segments computed (-1: that segment computed none of them)
    splices: dict[str, list[list[int]]] | None = None
    revisions: list[int] | None = None
    status: PutStatus = "ok"  # a put's fate: "ok", "aborted" (discarded), "recycled" or "trimmed"
    sealed: bool = False  # the partition takes no more samples (its target was reached)
    recycled_to: str = ""
    fates: list[SampleFate] | None = None  # a "trimmed" put's, per sample: "ok" (kept) or "aborted"
    two_copies: bool = False  # the partition keeps two copies of each sample: updates write both

    @property
    def pads(self) -> int:
        """Number of pad rows (index -1): masked filler that makes a batch divide evenly."""
        return sum(1 for i in self.indexes if i < 0)

    @property
    def size(self) -> int:
        """Number of samples."""
        return len(self.indexes)

    def __len__(self) -> int:
        return len(self.indexes)

    def select(self, positions: Sequence[int]) -> BatchMeta:
        """The meta of some of these samples (by position), e.g. to fail or clear them."""
        pick = list(positions)

        def take(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[i] for i in pick]

        return msgspec.structs.replace(
            self,
            indexes=take(self.indexes),
            units=take(self.units),
            groups=take(self.groups),
            versions=take(self.versions),
            versions_max=take(self.versions_max),
            segments=take(self.segments),
            splices=None if self.splices is None else {f: [rows[i] for i in pick] for f, rows in self.splices.items()},
            revisions=take(self.revisions),
            micro_batch_indices=None,
            num_microbatches=1,
            global_batch_size=len(pick),
        )


# --- messages -------------------------------------------------------------------------


class Error(Message):
    KIND = Kind.ERROR
    code: str
    message: str


class Ok(Message):
    KIND = Kind.OK


class Hello(Message):
    KIND = Kind.HELLO
    protocol: int
    role: str = "client"
    host: str = ""


class HelloReply(Message):
    """``heartbeat``: the seconds between signs of life the server expects of this session
    (see tqueue/transport/_liveness.py); 0: it expects none."""

    KIND = Kind.HELLO_REPLY
    protocol: int
    server: str
    units: list[UnitInfo] = []
    heartbeat: float = 0.0


class RegisterUnit(Message):
    """``name``: the unit's identity; a unit that registers again under a known name (it
    restarted, or the controller had declared it dead) gets its ``unit_id`` back. A unit that
    loaded its payload from a checkpoint (``restored``, ``generation``) keeps what of it the
    controller still has as it was; ``Registered.reset`` tells it to free the rest or all.
    ``unit_id``: the id it had (-1: none yet); a controller that does not know the name (it
    restarted) gives that id back where no other unit has it, so that clients' connections,
    which know units by id, stay right."""

    KIND = Kind.REGISTER_UNIT
    protocol: int
    address: str
    host: str
    capacity: int = 0
    shm: str = ""
    bulk: str = ""
    name: str = ""
    metrics: str = ""  # its Prometheus endpoint, if it serves one
    nixl: bytes = b""  # its NIXL agent's metadata, with its arena registered (b"": none)
    nixl_base: int = 0  # the arena's address in that agent's memory
    rdma: bool = False  # its host has RDMA devices (/sys/class/infiniband)
    unit_id: int = -1
    restored: str = ""  # the checkpoint (directory) whose payload of this unit it loaded before registering
    generation: str = ""  # that checkpoint's generation


class Registered(Message):
    """``reset``: the controller declared this unit's samples lost while it was away; the
    unit frees everything it holds. ``partitions``: the uids whose restored payload the unit
    keeps (None: all it holds). ``heartbeat``: seconds between the unit's heartbeats."""

    KIND = Kind.REGISTERED
    unit_id: int
    reset: bool = False
    heartbeat: float = 0.0
    partitions: list[int] | None = None


class CreatePartition(Message):
    """Create a partition up front, with options (see ``controller.model._partition.Options``)."""

    KIND = Kind.CREATE_PARTITION
    partition: str
    fields: list[str] | None = None
    exist_ok: bool = True
    tasks: list[str] | None = None
    group_size: int = 0
    on_member_failure: MemberFailure = "drop_group"
    auto_free: bool = True
    target: int = 0  # seal once this many samples are complete (over-sampling)
    target_groups: int = 0  # ... or this many whole groups
    recycle_to: str = ""  # late puts go there as partial samples instead of being discarded
    prefetch: str = ""  # a consumer short of samples may take ready ones from this partition
    step: int = -1  # the trainer version that reads it, for the staleness bound (-1: from a name ending in step-N)
    copies: int = 0  # copies of each put on as many units (0: the cluster's ControllerConfig.copies)
    dedup: list[str] | None = None  # fields shared by content: a value is stored and moved once per unit


class Grant(Message):
    """Ask the controller where to write ``count`` samples (new ones, or ``indexes``)."""

    KIND = Kind.GRANT
    partition: str
    count: int
    blocks: list[FieldBlock]
    host: str = ""
    groups: list[GroupId] | None = None
    partition_uid: int = 0
    indexes: list[int] | None = None
    nbytes: int = 0
    versions: list[int] | None = None
    timeout: float = math.inf  # how long the grant may wait for memory or admission
    reserved: int = 0  # samples of this write already admitted by a reserve()
    partial: bool = False  # unfinished samples: stored, never served until completed
    complete: bool = False  # (update) the samples are finished now
    segment: tuple[int, int] | None = None  # (update) (version, first_token) of a resumed rollout
    replaces: int = 0  # a grant of this client whose store failed on its unit: placed again, elsewhere
    failed_unit: int = -1  # the unit that failed it (suspected dead from now on)
    append: list[str] | None = None  # (update) fields whose new rows go after the stored ones, along dim 0
    splice: dict[str, list[int]] | None = None  # (update) per spliced field, per sample: the first row it computes
    callers: list[int] | None = None  # a put of several callers' samples joined (coalesce_puts): each one's count, in order


class Granted(Message):
    """Where to write; ``status`` "aborted": the partition is sealed (or its target is
    promised to earlier puts), nothing is to be sent; "recycled": the samples go to
    ``partition`` (the recycle partition) as partial; ``kept`` >= 0: the put crosses the
    target, only its first ``kept`` samples are kept, the others are stored and never served;
    ``take`` > 0 (a put of several callers, ``Grant.callers``, that crosses the target before
    its last caller): nothing is granted, the writer puts its first ``take`` samples (the
    callers up to the one that crosses) and the other callers' again, so each caller's
    samples meet the target as a put of their own would.
    An update of a partition of two copies: ``unit`` and ``second_units`` are where its samples' copies
    are now, the units to write; "moved": they are no longer on one pair of units (locate
    them again)."""

    KIND = Kind.GRANTED
    grant_id: int
    partition_uid: int
    start: int
    unit: UnitInfo | None = None
    schema: dict[str, FieldSpec] = {}
    status: PutStatus = "ok"
    partition: str = ""
    sealed: bool = False
    kept: int = -1  # >= 0: only the first ``kept`` samples count (the target is reached)
    stored: bool = False  # the grant named by ``replaces`` was committed after all: nothing to send
    second_units: list[UnitInfo] = []  # units to store the same bytes on too (the partition's second copy)
    dedup: list[str] = []  # the partition's fields shared by content: the writer sends each value once
    take: int = 0  # > 0: nothing granted; put the first ``take`` samples, then the rest, apart


class Alloc(Message):
    """A same-host writer asks a unit for ``nbytes`` of its arena to copy payload into."""

    KIND = Kind.ALLOC
    nbytes: int


class Allocated(Message):
    """The arena range granted (``offset`` -1: the arena is full, send frames instead).
    ``epoch``: how many times the unit has handed the arena's free pages back to the OS; a
    client that registered arena pages with a device driver under an older epoch registers
    them again, since the pages it locked are no longer the arena's."""

    KIND = Kind.ALLOCATED
    offset: int
    length: int = 0
    epoch: int = 0
    ttl: float = 0.0  # seconds the range stays allocated without a Store into it (0: unknown)
    token: int = 0  # names this allocation in a Store's release


class Store(Message):
    """Payload for a grant: one frame per ``counts`` entry of each block, in order.

    With ``shm`` (a writer on the unit's host), each frame is either an arena range
    ``[offset, length]`` inside the ``region`` it allocated, or ``[]``: the next raw frame
    (a pair or nothing: msgspec cannot tell two array types apart in a union, so these stay
    lists and the unit checks each). With ``bulk``, no frames follow here: lane
    ``(token, n)`` carries the next ``n`` frames back to back on the writer's bulk stream
    ``token``, the lanes at once.

    ``keep``: the writer keeps its ``region`` for later puts, each into ranges of it that no
    other put uses (an arena lease: one ``Alloc`` for many puts); the region's allocation lasts
    ``ttl`` after each such Store. ``release``: regions this writer kept that it no longer puts
    into, ``[offset, token]`` each (their allocation ends; the samples stored in them stay).
    """

    KIND = Kind.STORE
    grant_id: int
    partition: str
    partition_uid: int
    start: int
    count: int
    blocks: list[FieldBlock]
    indexes: list[int] | None = None
    region: int = -1
    shm: list[list[int]] | None = None
    bulk: list[tuple[int, int]] | None = None
    timeout: float | None = None  # seconds the writer waits for Stored: the unit answers within it (None: unknown)
    keep: bool = False
    release: list[list[int]] | None = None
    append: list[str] | None = None  # (update) fields whose rows the unit appends to each sample's, copying nothing


class Stored(Message):
    KIND = Kind.STORED
    nbytes: int
    sealed: bool = False  # the controller sealed the partition when this write committed


class Committed(Message):
    """The controller recorded a ``Commit``; ``sealed``: the partition is sealed now (this
    write may be the one that reached its target)."""

    KIND = Kind.COMMITTED
    sealed: bool = False


class Commit(Message):
    """A unit tells the controller that a grant's bytes are stored."""

    KIND = Kind.COMMIT
    grant_id: int
    unit_id: int
    fields: list[str]
    nbytes: int
    partition_bytes: int
    unit_bytes: int


class GetMeta(Message):
    """Lease samples to a task. ``policy``: ``first_ready``, ``groups`` (whole groups;
    ``batch_size`` in samples), a loaded one, or ``""``: ``groups`` where the partition has a
    group size, else ``first_ready``. With ``dp_size``, the request is rank ``dp_rank``'s share
    of ``round`` (``dp_size * batch_size`` samples split by tokens, see _rounds), cut into
    micro-batches: under ``max_tokens_per_micro_batch`` tokens (0: no cap), or of exactly
    ``micro_batch_size`` samples (0: not fixed); their count at least
    ``min_num_microbatches`` and a multiple of ``num_microbatches_multiple_of``."""

    KIND = Kind.GET_META
    partition: str
    fields: list[str]
    batch_size: int
    task: str
    timeout: float = math.inf
    lease_timeout: float = math.inf
    policy: str = ""
    dp_rank: int = -1
    dp_size: int = 0
    round: int = -1
    max_tokens_per_micro_batch: int = 0
    balance_by: list[str] | None = None
    max_staleness: int | None = None
    round_uid: int = 0  # partition incarnation the caller's round count refers to
    pad: bool = False  # once the partition is sealed and drained, fill the batch with pad rows
    micro_batch_size: int = 0
    num_microbatches_multiple_of: int = 1
    min_num_microbatches: int = 1
    replica_group: str = ""  # with dp_size: rounds formed and counted for this group alone
    policy_args: dict[str, Any] | None = None  # MessagePack values the policy reads (Candidates.args)


class MetaReply(Message):
    KIND = Kind.META
    meta: BatchMeta


class Fetch(Message):
    """Read fields of samples; ``shm``: the reader maps the unit's arena; ``bulk``: the
    token of the reader's bulk stream, where the unit may send the frames instead."""

    KIND = Kind.FETCH
    partition: str
    partition_uid: int
    indexes: list[int]
    fields: list[str]
    shm: bool = False
    bulk: int = 0


class Fetched(Message):
    """Blocks, then their frames. With ``shm``, each frame is an arena range or ``[]`` (the
    next raw frame); the ranges stay valid until the reader sends ``Release(hold)``.
    ``bulk`` > 0: no frames follow here; that many bytes, the frames back to back, follow on
    the reader's bulk stream. ``epoch``: the arena's, as in :class:`Allocated`."""

    KIND = Kind.FETCHED
    blocks: list[FieldBlock]
    shm: list[list[int]] | None = None
    hold: int = 0
    bulk: int = 0
    epoch: int = 0


class Release(Message):
    """A reader no longer looks at the arena ranges of these holds."""

    KIND = Kind.RELEASE
    holds: list[int]


class Ack(Message):
    KIND = Kind.ACK
    partition: str
    partition_uid: int
    task: str
    indexes: list[int]
    lease: int = 0


class Clear(Message):
    """Free a partition, or only ``indexes`` of it."""

    KIND = Kind.CLEAR
    partition: str
    partition_uid: int = 0
    indexes: list[int] | None = None


class Drop(Message):
    """The controller tells a unit to free a partition's bytes (or some samples')."""

    KIND = Kind.DROP
    partition_uid: int
    indexes: list[int] | None = None


class Dropped(Message):
    """What a unit holds after a drop: in all, and of that partition."""

    KIND = Kind.DROPPED
    unit_bytes: int
    partition_bytes: int = 0


class Move(Message):
    """The controller tells a unit to re-key samples' data from one partition to another."""

    KIND = Kind.MOVE
    src_uid: int
    dst_uid: int
    dst_name: str
    src_indexes: list[int]
    dst_indexes: list[int]


class Postpone(Message):
    """Move samples (their data kept, partial or not) to a later partition."""

    KIND = Kind.POSTPONE
    partition: str
    partition_uid: int
    indexes: list[int]
    to: str
    whole_groups: bool = False


class Sealed(Message):
    """Wait until a partition is sealed (answered then, or at the timeout)."""

    KIND = Kind.SEALED
    partition: str
    timeout: float = math.inf


class Select(Message):
    """The meta of every live sample with ``fields`` (no lease), e.g. to compute metrics;
    with ``consumed_by``, only those that task consumed; the first ``limit`` of them (-1: all)."""

    KIND = Kind.SELECT
    partition: str
    fields: list[str]
    consumed_by: str | None = None
    limit: int = -1


class Cancel(Message):
    """The sender gave up on its request ``of`` (timeout, cancellation): a server withdraws it
    if it is still waiting (a parked ``GetMeta``, a write waiting for budget, a ``Sealed``
    wait) and sends no reply, neither to this message nor to the withdrawn one."""

    KIND = Kind.CANCEL
    of: int


class Ping(Message):
    """A sign of life after an interval of silence; answered with ``Pong``."""

    KIND = Kind.PING


class Pong(Message):
    KIND = Kind.PONG


class Notice(Message):
    """Word on request ``rid`` while it stays parked (a wait that may never end, and why); not
    its reply: the request goes on waiting. The client logs it as a warning."""

    KIND = Kind.NOTICE
    text: str


class Bye(Message):
    """The sender's session ends on purpose: what the server holds for it is freed now. No reply."""

    KIND = Kind.BYE


class Heartbeat(Message):
    """A storage unit's periodic sign of life to the controller, with what it holds."""

    KIND = Kind.HEARTBEAT
    unit_id: int
    name: str = ""
    nbytes: int = 0
    arena_used: int = 0  # bytes of its shared-memory arena in use (stored, being written, held by readers)
    held_bytes: int = 0  # bytes of replies its readers have not taken yet (ZeroMQ and bulk streams)
    bytes_shared: int = 0  # bytes its samples hold beyond what it stores: values shared by content


class HeartbeatReply(Message):
    """``known``: false if the controller does not know this unit as alive (it restarted, or
    declared the unit dead): the unit registers again."""

    KIND = Kind.HEARTBEAT_REPLY
    known: bool = True


class Renew(Message):
    KIND = Kind.RENEW
    partition: str
    partition_uid: int
    task: str
    lease: int
    timeout: float = math.inf


class Fail(Message):
    """Samples (``indexes``) or members of ``group`` that were never put (``count``) failed."""

    KIND = Kind.FAIL
    partition: str
    reason: str
    partition_uid: int = 0
    indexes: list[int] | None = None
    group: GroupId = None
    count: int = 0


class Seal(Message):
    """No more samples will be put to this partition."""

    KIND = Kind.SEAL
    partition: str


_TYPES: dict[int, type[Message]] = {}
_KIND_FRAMES: dict[type[Message], bytes] = {}
_DECODERS: dict[int, msgspec.msgpack.Decoder[Any]] = {}
_ENCODER = msgspec.msgpack.Encoder()
_ANY = msgspec.msgpack.Decoder()


def register(namespace: dict[str, Any]) -> None:
    """Make the messages defined in a wire module (its ``globals()``) encodable and decodable.

    Each wire module calls this once, at its end; a kind claimed twice is a programming error.
    """
    for cls in list(namespace.values()):
        if not (isinstance(cls, type) and issubclass(cls, Message)) or cls is Message:
            continue
        if "KIND" not in cls.__dict__:
            continue  # imported from another wire module, registered there
        kind = int(cls.KIND)
        if _TYPES.get(kind, cls) is not cls:
            raise RuntimeError(f"message kind {kind} claimed by {_TYPES[kind].__name__} and {cls.__name__}")
        _TYPES[kind] = cls
        _KIND_FRAMES[cls] = bytes([kind])
        _DECODERS[kind] = msgspec.msgpack.Decoder(cls)


def encode(msg: Message, buffers: Sequence[Any] = ()) -> list[Any]:
    """The frames of ``msg``: kind, header, then ``buffers`` as they are (zero-copy)."""
    return [_KIND_FRAMES[type(msg)], _ENCODER.encode(msg), *buffers]


def _view(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def decode(frames: Sequence[Any], *, max_header: int = 1 << 26) -> tuple[Message, list[Any]]:
    """Parse ``[kind, header, *buffers]``; buffers come back as they were received.

    Raises :class:`ProtocolError` saying what is wrong; never executes anything.
    """
    if len(frames) < 2:
        raise ProtocolError(f"a message needs a kind and a header frame; got {len(frames)} frame(s)")
    first = frames[0]
    if len(first) != 1:
        raise ProtocolError(f"unknown message kind {bytes(memoryview(first)[:8])!r}")
    kind_frame = getattr(first, "bytes", None) or bytes(first)  # a zmq.Frame keeps its bytes
    if kind_frame[0] not in _DECODERS:
        raise ProtocolError(f"unknown message kind {kind_frame!r}")
    header = frames[1]  # msgspec reads any buffer, a zmq.Frame's included, without a view
    if len(header) > max_header:
        raise ProtocolError(
            f"{_TYPES[kind_frame[0]].__name__} header of {len(header)} bytes exceeds the "
            f"limit of {max_header} bytes"
        )
    try:
        msg = _DECODERS[kind_frame[0]].decode(header)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        name = _TYPES[kind_frame[0]].__name__
        raise ProtocolError(f"bad {name} header: {exc}") from exc
    return msg, list(frames[2:])


def salvage_rid(frames: Sequence[Any]) -> int:
    """Best-effort request id of a malformed message, so its error reply can be matched."""
    if len(frames) < 2 or len(_view(frames[1])) > 1 << 20:
        return 0
    try:
        obj = _ANY.decode(_view(frames[1]))
    except (ValueError, TypeError, RecursionError, MemoryError):  # DecodeError is a ValueError
        return 0  # too deep to read, or not MessagePack at all: nothing to salvage
    rid = obj.get("rid") if isinstance(obj, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def error_reply(rid: int, exc: BaseException) -> Error:
    code = getattr(exc, "code", "remote")
    message = str(exc) if getattr(exc, "code", None) else f"{type(exc).__name__}: {exc}"
    return Error(rid=rid, code=code, message=message)


register(globals())

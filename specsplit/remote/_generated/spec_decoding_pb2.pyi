# Post-processed by scripts/gen_stubs.py from proto/specsplit/v1/spec_decoding.proto. DO NOT EDIT; regenerate.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_TYPE_UNSPECIFIED: _ClassVar[WorkerType]
    WORKER_TYPE_DRAFT: _ClassVar[WorkerType]
    WORKER_TYPE_TARGET: _ClassVar[WorkerType]

class TreeShape(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TREE_SHAPE_UNSPECIFIED: _ClassVar[TreeShape]
    TREE_SHAPE_CHAIN: _ClassVar[TreeShape]
    TREE_SHAPE_STATIC: _ClassVar[TreeShape]
    TREE_SHAPE_DYNAMIC: _ClassVar[TreeShape]
WORKER_TYPE_UNSPECIFIED: WorkerType
WORKER_TYPE_DRAFT: WorkerType
WORKER_TYPE_TARGET: WorkerType
TREE_SHAPE_UNSPECIFIED: TreeShape
TREE_SHAPE_CHAIN: TreeShape
TREE_SHAPE_STATIC: TreeShape
TREE_SHAPE_DYNAMIC: TreeShape

class SamplingParams(_message.Message):
    __slots__ = ("do_sample", "temperature", "top_k", "top_p")
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ...) -> None: ...

class TreePath(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class StaticPaths(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedCompositeFieldContainer[TreePath]
    def __init__(self, paths: _Optional[_Iterable[_Union[TreePath, _Mapping]]] = ...) -> None: ...

class TreeSpec(_message.Message):
    __slots__ = ("shape", "num_draft_tokens", "static_paths", "topk", "width", "budget", "max_depth", "min_confidence")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATIC_PATHS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    shape: TreeShape
    num_draft_tokens: int
    static_paths: StaticPaths
    topk: int
    width: int
    budget: int
    max_depth: int
    min_confidence: float
    def __init__(self, shape: _Optional[_Union[TreeShape, str]] = ..., num_draft_tokens: _Optional[int] = ..., static_paths: _Optional[_Union[StaticPaths, _Mapping]] = ..., topk: _Optional[int] = ..., width: _Optional[int] = ..., budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., min_confidence: _Optional[float] = ...) -> None: ...

class TokenTree(_message.Message):
    __slots__ = ("token_ids", "parents", "depths", "log_probs", "has_q", "q_width", "q_ids", "q_probs", "max_branch", "depth_bound")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_Q_FIELD_NUMBER: _ClassVar[int]
    Q_WIDTH_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_BOUND_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    log_probs: _containers.RepeatedScalarFieldContainer[float]
    has_q: bool
    q_width: int
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    max_branch: int
    depth_bound: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ..., log_probs: _Optional[_Iterable[float]] = ..., has_q: _Optional[bool] = ..., q_width: _Optional[int] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ..., max_branch: _Optional[int] = ..., depth_bound: _Optional[int] = ...) -> None: ...

class Telemetry(_message.Message):
    __slots__ = ("wall_time_s", "model_time_s", "tokens_processed", "forwards", "device", "server_time_s", "verify_mode")
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MODE_FIELD_NUMBER: _ClassVar[int]
    wall_time_s: float
    model_time_s: float
    tokens_processed: int
    forwards: int
    device: str
    server_time_s: float
    verify_mode: str
    def __init__(self, wall_time_s: _Optional[float] = ..., model_time_s: _Optional[float] = ..., tokens_processed: _Optional[int] = ..., forwards: _Optional[int] = ..., device: _Optional[str] = ..., server_time_s: _Optional[float] = ..., verify_mode: _Optional[str] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "new_token_ids", "prefix_length", "tree", "sampling", "seed", "max_depth", "capacity_hint", "speculate", "tree_channel", "tree_slot", "processing")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_HINT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    TREE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TREE_SLOT_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_length: int
    tree: TreeSpec
    sampling: SamplingParams
    seed: int
    max_depth: int
    capacity_hint: int
    speculate: bool
    tree_channel: str
    tree_slot: int
    processing: str
    def __init__(self, session_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., prefix_length: _Optional[int] = ..., tree: _Optional[_Union[TreeSpec, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., max_depth: _Optional[int] = ..., capacity_hint: _Optional[int] = ..., speculate: _Optional[bool] = ..., tree_channel: _Optional[str] = ..., tree_slot: _Optional[int] = ..., processing: _Optional[str] = ...) -> None: ...

class TreeSlotRef(_message.Message):
    __slots__ = ("channel_id", "slot", "num_nodes", "max_branch", "depth_bound")
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_BOUND_FIELD_NUMBER: _ClassVar[int]
    channel_id: str
    slot: int
    num_nodes: int
    max_branch: int
    depth_bound: int
    def __init__(self, channel_id: _Optional[str] = ..., slot: _Optional[int] = ..., num_nodes: _Optional[int] = ..., max_branch: _Optional[int] = ..., depth_bound: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "prefix_length", "cache_hit", "telemetry", "assumed_token_ids", "tree_in_slot")
    TREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TREE_IN_SLOT_FIELD_NUMBER: _ClassVar[int]
    tree: TokenTree
    prefix_length: int
    cache_hit: bool
    telemetry: Telemetry
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tree_in_slot: TreeSlotRef
    def __init__(self, tree: _Optional[_Union[TokenTree, _Mapping]] = ..., prefix_length: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., tree_in_slot: _Optional[_Union[TreeSlotRef, _Mapping]] = ...) -> None: ...

class ShareTreeSlotsRequest(_message.Message):
    __slots__ = ("host_id", "slots")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    slots: int
    def __init__(self, host_id: _Optional[str] = ..., slots: _Optional[int] = ...) -> None: ...

class ShareTreeSlotsResponse(_message.Message):
    __slots__ = ("available", "reason", "channel_id", "slots", "slot_nodes", "device_uuid", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "storage_event_handle", "storage_event_sync_required", "slot_event_handles")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_NODES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORAGE_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SLOT_EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    available: bool
    reason: str
    channel_id: str
    slots: int
    slot_nodes: int
    device_uuid: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    storage_event_handle: bytes
    storage_event_sync_required: bool
    slot_event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, available: _Optional[bool] = ..., reason: _Optional[str] = ..., channel_id: _Optional[str] = ..., slots: _Optional[int] = ..., slot_nodes: _Optional[int] = ..., device_uuid: _Optional[str] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., storage_event_handle: _Optional[bytes] = ..., storage_event_sync_required: _Optional[bool] = ..., slot_event_handles: _Optional[_Iterable[bytes]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tree", "pending_token_ids", "expected_prefix_length", "sampling", "seed", "capacity_hint", "processing", "return_scores", "return_logits", "return_choices", "return_guesses")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_HINT_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    RETURN_SCORES_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    RETURN_CHOICES_FIELD_NUMBER: _ClassVar[int]
    RETURN_GUESSES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: TokenTree
    pending_token_ids: _containers.RepeatedScalarFieldContainer[int]
    expected_prefix_length: int
    sampling: SamplingParams
    seed: int
    capacity_hint: int
    processing: str
    return_scores: bool
    return_logits: bool
    return_choices: bool
    return_guesses: bool
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[TokenTree, _Mapping]] = ..., pending_token_ids: _Optional[_Iterable[int]] = ..., expected_prefix_length: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., capacity_hint: _Optional[int] = ..., processing: _Optional[str] = ..., return_scores: _Optional[bool] = ..., return_logits: _Optional[bool] = ..., return_choices: _Optional[bool] = ..., return_guesses: _Optional[bool] = ...) -> None: ...

class HeadGuesses(_message.Message):
    __slots__ = ("token_ids", "parents", "depths")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_token_ids", "next_token_id", "accepted_node_indices", "prefix_length", "num_drafted", "num_nodes", "cache_hit", "telemetry", "scores", "logits", "choices", "guesses")
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODE_INDICES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    GUESSES_FIELD_NUMBER: _ClassVar[int]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    next_token_id: int
    accepted_node_indices: _containers.RepeatedScalarFieldContainer[int]
    prefix_length: int
    num_drafted: int
    num_nodes: int
    cache_hit: bool
    telemetry: Telemetry
    scores: bytes
    logits: bytes
    choices: _containers.RepeatedScalarFieldContainer[int]
    guesses: HeadGuesses
    def __init__(self, accepted_token_ids: _Optional[_Iterable[int]] = ..., next_token_id: _Optional[int] = ..., accepted_node_indices: _Optional[_Iterable[int]] = ..., prefix_length: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_nodes: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ..., scores: _Optional[bytes] = ..., logits: _Optional[bytes] = ..., choices: _Optional[_Iterable[int]] = ..., guesses: _Optional[_Union[HeadGuesses, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "max_new_tokens", "sampling", "tree", "eos_token_ids", "rng_state", "overlap", "overlap_policy", "drafter", "processing")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RNG_STATE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    tree: TreeSpec
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rng_state: bytes
    overlap: bool
    overlap_policy: str
    drafter: str
    processing: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tree: _Optional[_Union[TreeSpec, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., rng_state: _Optional[bytes] = ..., overlap: _Optional[bool] = ..., overlap_policy: _Optional[str] = ..., drafter: _Optional[str] = ..., processing: _Optional[str] = ...) -> None: ...

class GenerateRound(_message.Message):
    __slots__ = ("token_ids", "accepted", "drafted_depth", "tree_nodes", "draft_s", "verify_s", "host_s", "transport_s", "draft_model_s", "verify_model_s", "overlap_draft_s", "spec_hit", "drafter")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    HOST_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MODEL_S_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    SPEC_HIT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    drafted_depth: int
    tree_nodes: int
    draft_s: float
    verify_s: float
    host_s: float
    transport_s: float
    draft_model_s: float
    verify_model_s: float
    overlap_draft_s: float
    spec_hit: bool
    drafter: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., drafted_depth: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., host_s: _Optional[float] = ..., transport_s: _Optional[float] = ..., draft_model_s: _Optional[float] = ..., verify_model_s: _Optional[float] = ..., overlap_draft_s: _Optional[float] = ..., spec_hit: _Optional[bool] = ..., drafter: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("rounds", "done", "recoveries", "draft_fallback", "wall_time_s")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[GenerateRound]
    done: bool
    recoveries: int
    draft_fallback: bool
    wall_time_s: float
    def __init__(self, rounds: _Optional[_Iterable[_Union[GenerateRound, _Mapping]]] = ..., done: _Optional[bool] = ..., recoveries: _Optional[int] = ..., draft_fallback: _Optional[bool] = ..., wall_time_s: _Optional[float] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed", "telemetry")
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    telemetry: Telemetry
    def __init__(self, existed: _Optional[bool] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("client_protocol_version",)
    CLIENT_PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_protocol_version: str
    def __init__(self, client_protocol_version: _Optional[str] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("worker_type", "model_name", "vocab_size", "dtype", "device", "protocol_version", "active_sessions", "telemetry")
    WORKER_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    worker_type: WorkerType
    model_name: str
    vocab_size: int
    dtype: str
    device: str
    protocol_version: str
    active_sessions: int
    telemetry: Telemetry
    def __init__(self, worker_type: _Optional[_Union[WorkerType, str]] = ..., model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., protocol_version: _Optional[str] = ..., active_sessions: _Optional[int] = ..., telemetry: _Optional[_Union[Telemetry, _Mapping]] = ...) -> None: ...

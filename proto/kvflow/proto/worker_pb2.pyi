from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Task(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_UNSPECIFIED: _ClassVar[Task]
    TASK_GENERATE: _ClassVar[Task]
    TASK_EMBED: _ClassVar[Task]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_COLOCATED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class PriorityClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_CLASS_UNSPECIFIED: _ClassVar[PriorityClass]
    PRIORITY_CLASS_REALTIME: _ClassVar[PriorityClass]
    PRIORITY_CLASS_NORMAL: _ClassVar[PriorityClass]
    PRIORITY_CLASS_BATCH: _ClassVar[PriorityClass]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class KvHandoffVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_HANDOFF_VERSION_UNSPECIFIED: _ClassVar[KvHandoffVersion]
    KV_HANDOFF_VERSION_1: _ClassVar[KvHandoffVersion]

class KvTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KvTransport]
    KV_TRANSPORT_TCP: _ClassVar[KvTransport]
    KV_TRANSPORT_GLOO: _ClassVar[KvTransport]
    KV_TRANSPORT_NCCL: _ClassVar[KvTransport]

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_CLEARED: _ClassVar[KvEventKind]
TASK_UNSPECIFIED: Task
TASK_GENERATE: Task
TASK_EMBED: Task
ROLE_UNSPECIFIED: Role
ROLE_COLOCATED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
PRIORITY_CLASS_UNSPECIFIED: PriorityClass
PRIORITY_CLASS_REALTIME: PriorityClass
PRIORITY_CLASS_NORMAL: PriorityClass
PRIORITY_CLASS_BATCH: PriorityClass
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
KV_HANDOFF_VERSION_UNSPECIFIED: KvHandoffVersion
KV_HANDOFF_VERSION_1: KvHandoffVersion
KV_TRANSPORT_UNSPECIFIED: KvTransport
KV_TRANSPORT_TCP: KvTransport
KV_TRANSPORT_GLOO: KvTransport
KV_TRANSPORT_NCCL: KvTransport
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind
KV_EVENT_KIND_CLEARED: KvEventKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "context", "cache_salt", "priority", "num_public_blocks", "remote_prefill", "structured_output", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLIC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    context: RequestContext
    cache_salt: str
    priority: int
    num_public_blocks: int
    remote_prefill: RemotePrefillParams
    structured_output: StructuredOutput
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., context: _Optional[_Union[RequestContext, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., num_public_blocks: _Optional[int] = ..., remote_prefill: _Optional[_Union[RemotePrefillParams, _Mapping]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., tenant: _Optional[str] = ...) -> None: ...

class RequestContext(_message.Message):
    __slots__ = ("tenant", "cache_salt", "priority", "num_public_blocks", "priority_class")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLIC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    cache_salt: str
    priority: int
    num_public_blocks: int
    priority_class: PriorityClass
    def __init__(self, tenant: _Optional[str] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., num_public_blocks: _Optional[int] = ..., priority_class: _Optional[_Union[PriorityClass, str]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark", "ebnf")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    ebnf: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class RemotePrefillParams(_message.Message):
    __slots__ = ("version", "timeout_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    version: KvHandoffVersion
    timeout_s: float
    def __init__(self, version: _Optional[_Union[KvHandoffVersion, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class KvReservation(_message.Message):
    __slots__ = ("version", "transfer_id", "decode_instance_id", "transport", "endpoint", "first_token", "end_token", "kv_layout", "tag", "deadline_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    version: KvHandoffVersion
    transfer_id: str
    decode_instance_id: str
    transport: KvTransport
    endpoint: str
    first_token: int
    end_token: int
    kv_layout: str
    tag: int
    deadline_s: float
    def __init__(self, version: _Optional[_Union[KvHandoffVersion, str]] = ..., transfer_id: _Optional[str] = ..., decode_instance_id: _Optional[str] = ..., transport: _Optional[_Union[KvTransport, str]] = ..., endpoint: _Optional[str] = ..., first_token: _Optional[int] = ..., end_token: _Optional[int] = ..., kv_layout: _Optional[str] = ..., tag: _Optional[int] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "context", "destination", "cache_salt", "num_public_blocks", "priority", "tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLIC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context: RequestContext
    destination: KvReservation
    cache_salt: str
    num_public_blocks: int
    priority: int
    tenant: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., context: _Optional[_Union[RequestContext, _Mapping]] = ..., destination: _Optional[_Union[KvReservation, _Mapping]] = ..., cache_salt: _Optional[str] = ..., num_public_blocks: _Optional[int] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("num_computed_tokens", "num_cached_tokens", "num_sent_blocks", "num_sent_bytes", "queued_s", "prefill_s", "transfer_s")
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    num_computed_tokens: int
    num_cached_tokens: int
    num_sent_blocks: int
    num_sent_bytes: int
    queued_s: float
    prefill_s: float
    transfer_s: float
    def __init__(self, num_computed_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_sent_blocks: _Optional[int] = ..., num_sent_bytes: _Optional[int] = ..., queued_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class CancelKvTransferRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelKvTransferResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "remote_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    remote_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., remote_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_s", "ttft_s", "e2e_s", "num_preemptions")
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    queued_s: float
    ttft_s: float
    e2e_s: float
    num_preemptions: int
    def __init__(self, queued_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "stop_token_id", "usage", "timings", "kv_reservation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_RESERVATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    stop_token_id: int
    usage: Usage
    timings: Timings
    kv_reservation: KvReservation
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., kv_reservation: _Optional[_Union[KvReservation, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("instance_id", "model", "role", "block_size", "hash_seed", "max_model_len", "num_total_blocks", "vocab_size", "eos_token_ids", "kv_transport", "prefix_caching", "task", "embedding")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model: str
    role: Role
    block_size: int
    hash_seed: bytes
    max_model_len: int
    num_total_blocks: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_transport: KvTransport
    prefix_caching: bool
    task: Task
    embedding: EmbeddingInfo
    def __init__(self, instance_id: _Optional[str] = ..., model: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., block_size: _Optional[int] = ..., hash_seed: _Optional[bytes] = ..., max_model_len: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kv_transport: _Optional[_Union[KvTransport, str]] = ..., prefix_caching: _Optional[bool] = ..., task: _Optional[_Union[Task, str]] = ..., embedding: _Optional[_Union[EmbeddingInfo, _Mapping]] = ...) -> None: ...

class EmbeddingInfo(_message.Message):
    __slots__ = ("dimensions", "allowed_dimensions", "max_inputs", "max_input_tokens")
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    dimensions: int
    allowed_dimensions: _containers.RepeatedScalarFieldContainer[int]
    max_inputs: int
    max_input_tokens: int
    def __init__(self, dimensions: _Optional[int] = ..., allowed_dimensions: _Optional[_Iterable[int]] = ..., max_inputs: _Optional[int] = ..., max_input_tokens: _Optional[int] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "dimensions", "context")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    context: RequestContext
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ..., context: _Optional[_Union[RequestContext, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "num_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    num_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "prompt_tokens", "queued_s", "compute_s")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    queued_s: float
    compute_s: float
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., queued_s: _Optional[float] = ..., compute_s: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("is_serving", "info")
    IS_SERVING_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    is_serving: bool
    info: WorkerInfo
    def __init__(self, is_serving: _Optional[bool] = ..., info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "kv_usage", "num_cached_blocks", "num_free_blocks", "num_total_blocks", "num_kv_transfers", "max_waiting_requests", "queue_drain_rate_per_s", "num_prefill_tokens", "num_decode_seqs", "num_kv_tokens")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DRAIN_RATE_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    kv_usage: float
    num_cached_blocks: int
    num_free_blocks: int
    num_total_blocks: int
    num_kv_transfers: int
    max_waiting_requests: int
    queue_drain_rate_per_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_kv_tokens: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_cached_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_kv_transfers: _Optional[int] = ..., max_waiting_requests: _Optional[int] = ..., queue_drain_rate_per_s: _Optional[float] = ..., num_prefill_tokens: _Optional[int] = ..., num_decode_seqs: _Optional[int] = ..., num_kv_tokens: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "kind", "block_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: KvEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[KvEventKind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("instance_id", "is_snapshot", "seq", "snapshot_block_hashes", "events")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    IS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    is_snapshot: bool
    seq: int
    snapshot_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, instance_id: _Optional[str] = ..., is_snapshot: _Optional[bool] = ..., seq: _Optional[int] = ..., snapshot_block_hashes: _Optional[_Iterable[int]] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

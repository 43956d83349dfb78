from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_FULL: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CONTEXT_FULL: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("mode", "draft_length", "pipeline", "tree_budget")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[SpeculationParams.Mode]
        MODE_AUTO: _ClassVar[SpeculationParams.Mode]
        MODE_FIXED: _ClassVar[SpeculationParams.Mode]
        MODE_OFF: _ClassVar[SpeculationParams.Mode]
    MODE_UNSPECIFIED: SpeculationParams.Mode
    MODE_AUTO: SpeculationParams.Mode
    MODE_FIXED: SpeculationParams.Mode
    MODE_OFF: SpeculationParams.Mode
    class Pipeline(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PIPELINE_UNSPECIFIED: _ClassVar[SpeculationParams.Pipeline]
        PIPELINE_OFF: _ClassVar[SpeculationParams.Pipeline]
        PIPELINE_BONUS_MATCH: _ClassVar[SpeculationParams.Pipeline]
        PIPELINE_POST_VERIFY: _ClassVar[SpeculationParams.Pipeline]
        PIPELINE_SPEC_CACHE: _ClassVar[SpeculationParams.Pipeline]
        PIPELINE_AUTO: _ClassVar[SpeculationParams.Pipeline]
    PIPELINE_UNSPECIFIED: SpeculationParams.Pipeline
    PIPELINE_OFF: SpeculationParams.Pipeline
    PIPELINE_BONUS_MATCH: SpeculationParams.Pipeline
    PIPELINE_POST_VERIFY: SpeculationParams.Pipeline
    PIPELINE_SPEC_CACHE: SpeculationParams.Pipeline
    PIPELINE_AUTO: SpeculationParams.Pipeline
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationParams.Mode
    draft_length: int
    pipeline: SpeculationParams.Pipeline
    tree_budget: int
    def __init__(self, mode: _Optional[_Union[SpeculationParams.Mode, str]] = ..., draft_length: _Optional[int] = ..., pipeline: _Optional[_Union[SpeculationParams.Pipeline, str]] = ..., tree_budget: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs", "id_gaps", "weights")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ID_GAPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    id_gaps: bytes
    weights: bytes
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., id_gaps: _Optional[bytes] = ..., weights: _Optional[bytes] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "vocab_size", "tokenizer_size", "vocab_hash", "max_context", "eos_token_ids", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    tokenizer_size: int
    vocab_hash: str
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kind: str
    def __init__(self, name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_size: _Optional[int] = ..., vocab_hash: _Optional[str] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., kind: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClientMessage(_message.Message):
    __slots__ = ("request", "flow", "cancel")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    request: ChatRequest
    flow: FlowControl
    cancel: Cancel
    def __init__(self, request: _Optional[_Union[ChatRequest, _Mapping]] = ..., flow: _Optional[_Union[FlowControl, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("request_id", "model", "messages", "max_tokens", "temperature")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    max_tokens: int
    temperature: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class FlowControl(_message.Message):
    __slots__ = ("request_id", "credit_tokens", "max_tokens_per_second")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CREDIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    credit_tokens: int
    max_tokens_per_second: float
    def __init__(self, request_id: _Optional[str] = ..., credit_tokens: _Optional[int] = ..., max_tokens_per_second: _Optional[float] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("request_id", "delta", "usage", "done", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: Delta
    usage: Usage
    done: Done
    error: Error
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("content", "tokens")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    content: str
    tokens: int
    def __init__(self, content: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("finish_reason",)
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    def __init__(self, finish_reason: _Optional[str] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("status", "type", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: int
    type: str
    message: str
    def __init__(self, status: _Optional[int] = ..., type: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

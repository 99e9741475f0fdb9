from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DialBackRequest(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("reachable", "detail", "port_open")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PORT_OPEN_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    detail: str
    port_open: bool
    def __init__(self, reachable: _Optional[bool] = ..., detail: _Optional[str] = ..., port_open: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TunnelOffer(_message.Message):
    __slots__ = ("tunnel_id", "dialer")
    TUNNEL_ID_FIELD_NUMBER: _ClassVar[int]
    DIALER_FIELD_NUMBER: _ClassVar[int]
    tunnel_id: str
    dialer: str
    def __init__(self, tunnel_id: _Optional[str] = ..., dialer: _Optional[str] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("target", "tunnel_id", "data")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    target: str
    tunnel_id: str
    data: bytes
    def __init__(self, target: _Optional[str] = ..., tunnel_id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

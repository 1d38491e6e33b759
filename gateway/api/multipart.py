"""The text fields of a `multipart/form-data` body (an audio upload's `model`, `stream`), found
without copying the file parts; stdlib only, pure.

The body itself is forwarded unchanged with the client's content-type (boundary kept): the gateway
only reads the few small fields it routes by. A body that is not well-formed multipart is a 400.
"""

from __future__ import annotations

from gateway.api.openai import ParsedRequest
from gateway.errors import BadRequest

MAX_FIELD_BYTES = 4096  # a text field the gateway reads is a name or a flag, never this long
WANTED = frozenset({"model", "stream", "user"})


def boundary_of(content_type: bytes | None) -> bytes:
    """The boundary parameter of a multipart/form-data content-type (400 when there is none)."""
    if content_type is None:
        raise BadRequest("A multipart/form-data body is required", code="invalid_multipart")
    kind, _, params = content_type.partition(b";")
    if kind.strip().lower() != b"multipart/form-data":
        raise BadRequest(
            "The request body must be multipart/form-data (an audio file upload)",
            code="invalid_multipart",
        )
    for param in params.split(b";"):
        name, _, value = param.strip().partition(b"=")
        if name.strip().lower() == b"boundary":
            value = value.strip()
            if len(value) >= 2 and value[:1] == value[-1:] == b'"':
                value = value[1:-1]
            if 1 <= len(value) <= 70:
                return value
    raise BadRequest("The multipart content-type has no valid boundary", code="invalid_multipart")


def form_fields(raw: bytes, content_type: bytes | None, wanted: frozenset[str] = WANTED) -> dict[str, str]:
    """The `wanted` text fields of the form (parts without a filename), as strings."""
    delimiter = b"--" + boundary_of(content_type)
    fields: dict[str, str] = {}
    pos = raw.find(delimiter)
    if pos < 0:
        raise BadRequest("The multipart body has no part", code="invalid_multipart")
    while True:
        pos += len(delimiter)
        if raw.startswith(b"--", pos):
            return fields  # the closing delimiter
        head_end = raw.find(b"\r\n\r\n", pos)
        if head_end < 0:
            raise BadRequest("A multipart part has no end of headers", code="invalid_multipart")
        nxt = raw.find(b"\r\n" + delimiter, head_end + 4)
        if nxt < 0:
            raise BadRequest("The multipart body is not terminated", code="invalid_multipart")
        name, is_file = _disposition(raw[pos:head_end])
        if name in wanted and not is_file:
            value = raw[head_end + 4 : nxt]
            if len(value) > MAX_FIELD_BYTES:
                raise BadRequest(f"The form field '{name}' is too long", param=name)
            try:
                fields.setdefault(name, value.decode())
            except UnicodeDecodeError:
                raise BadRequest(f"The form field '{name}' is not UTF-8", param=name) from None
        pos = nxt + 2


def _disposition(head: bytes) -> tuple[str, bool]:
    """(the part's field name, whether it is a file) from its Content-Disposition header."""
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        name, is_file = "", False
        for param in value.split(b";")[1:]:
            k, _, v = param.strip().partition(b"=")
            v = v.strip().strip(b'"')
            if k.lower() == b"name":
                name = v.decode("utf-8", "replace")
            elif k.lower() in (b"filename", b"filename*"):
                is_file = True
        return name, is_file
    return "", False


def parse_audio(kind: str, raw: bytes, content_type: bytes | None) -> ParsedRequest:
    """An audio upload (transcription, translation): its `model` and `stream` form fields."""
    fields = form_fields(raw, content_type)
    model = fields.get("model", "")
    stream = fields.get("stream", "false").strip().lower()
    if stream not in ("true", "false", ""):
        raise BadRequest("'stream' must be true or false", param="stream")
    # include_usage: the body is forwarded as it came, nothing is asked for on the client's behalf
    return ParsedRequest(kind, raw, dict(fields), model, stream == "true", include_usage=True,
                         user=fields.get("user"))  # fmt: skip

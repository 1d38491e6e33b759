"""`/v1/audio/transcriptions` and `/v1/audio/translations`, simulated: a multipart upload with a
`file` part; the "text" is filler words drawn from the xxhash of the file's bytes (so the same
audio gives the same text), `{"text": ..., "usage": {"type": "duration", "seconds": N}}` as vLLM
answers, or plain text with `response_format: text`.

The form is read by a small parser of its own (no python-multipart; the simulator imports nothing
of the gateway, whose `gateway/api/multipart.py` reads only the text fields).
"""

from __future__ import annotations

from typing import Any

import xxhash

from simulator.openai_api import ApiError, bad

BYTES_PER_SECOND = 32_000  # 16 kHz 16-bit mono
_WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()


def parse_form(raw: bytes, content_type: str) -> dict[str, tuple[bytes, bool]]:
    """name -> (value, is_file) of each part of a multipart/form-data body."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise bad("the request must be multipart/form-data")
    boundary = ""
    for param in params.split(";"):
        k, _, v = param.strip().partition("=")
        if k.strip().lower() == "boundary":
            boundary = v.strip().strip('"')
    if not boundary:
        raise bad("the multipart content-type has no boundary")
    delimiter = b"--" + boundary.encode()
    parts: dict[str, tuple[bytes, bool]] = {}
    for chunk in raw.split(delimiter)[1:]:
        if chunk.startswith(b"--"):
            break
        head, sep, value = chunk.partition(b"\r\n\r\n")
        if not sep:
            raise bad("a multipart part has no headers")
        if value.endswith(b"\r\n"):
            value = value[:-2]
        name, is_file = "", False
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-disposition:"):
                for p in line.split(b";")[1:]:
                    key, _, val = p.strip().partition(b"=")
                    if key.lower() == b"name":
                        name = val.strip(b'"').decode("utf-8", "replace")
                    elif key.lower() == b"filename":
                        is_file = True
        parts.setdefault(name, (value, is_file))
    return parts


def transcribe(raw: bytes, content_type: str, model: str) -> tuple[Any, bool]:
    """(the answer, whether it is JSON) for an upload."""
    form = parse_form(raw, content_type)
    asked = form.get("model")
    if asked is not None and asked[0].decode("utf-8", "replace") != model:
        raise ApiError(404, f"The model `{asked[0].decode('utf-8', 'replace')}` does not exist.",
                       "model")
    audio = form.get("file")
    if audio is None or not audio[0]:
        raise bad("a 'file' part with the audio is required", "file")
    data = audio[0]
    h = xxhash.xxh3_64_intdigest(data)
    words = [_WORDS[(h >> (4 * i)) % len(_WORDS)] for i in range(8)]
    text = " ".join(words).capitalize() + "."
    fmt = form.get("response_format", (b"json", False))[0].decode("utf-8", "replace")
    if fmt == "text":
        return text, False
    seconds = max(1, -(-len(data) // BYTES_PER_SECOND))
    return {"text": text, "usage": {"type": "duration", "seconds": seconds}}, True

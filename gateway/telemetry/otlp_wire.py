"""OTLP/protobuf for the gateway's fixed span shape, written straight to bytes.

The few protobuf pieces the span shape needs (varints, length-delimited fields, fixed 64-bit
times), the resource and scope encoded once, and `SpanEncoder`, which turns a finished
`RequestTrace` into its spans' bytes: in one pass from what the request handed over (no child
span tuples, no root attribute mapping) for the request path's traces, built first for others.
The bytes decode to what the SDK's OTLP exporter sends for the same spans (tested, both ways).
What repeats is encoded once and cached: attribute blocks, (name, value) pairs, each int
attribute's bytes up to its value.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from itertools import islice
from types import MappingProxyType
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from gateway.telemetry.trace import (
    ATTRIBUTES,
    ROOT_SPAN,
    SPAN_KINDS,
    Child,
    RequestTrace,
    _getrandbits,
    attempt_spans,
    derived_times,
    group_of,
    segment_times,
    server_error,
)

__all__ = ["SpanEncoder", "encode_resource", "export_request"]

_CACHE_MAX = 8192  # encoded (attribute, value) pairs kept; cleared when full


# --- protobuf wire format: the few pieces the span shape needs ----------------------------------

_VARINT = [bytes((n,)) if n < 0x80 else bytes((n & 0x7F | 0x80, n >> 7)) for n in range(1 << 14)]
_FIXED64 = struct.Struct("<Q").pack
_TIMES = struct.Struct("<BQBQ").pack  # start_time_unix_nano (7) and end_time_unix_nano (8)
_DOUBLE = struct.Struct("<d").pack
_STATUS_UNSET = b"\x7a\x00"  # status (15): present and empty, as the SDK's exporter sends it
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)  # flags (16): HAS_IS_REMOTE
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)  # ... | IS_REMOTE (the parent's)
_TAIL_OK = _STATUS_UNSET + _FLAGS_LOCAL  # an OK local span's last two fields
_LEN_SPAN = [b"\x12" + _VARINT[n] for n in range(1024)]  # spans (2): tag and length, by length
_KIND = {"INTERNAL": b"\x30\x01", "SERVER": b"\x30\x02", "CLIENT": b"\x30\x03"}  # kind (6)
_TTFT, _TPOT, _OUTPUT = ATTRIBUTES["ttft_s"], ATTRIBUTES["tpot_s"], ATTRIBUTES["output_tokens"]
_STATUS, _ERROR_TYPE = ATTRIBUTES["status_code"], ATTRIBUTES["error_type"]
_OUTCOME = ATTRIBUTES["outcome"]
_DERIVED = (_TTFT, _TPOT, _ERROR_TYPE)  # root names build() may add after the given ones
_ATTEMPT_READS = (ATTRIBUTES["method"], ATTRIBUTES["url_path"], _OUTCOME)  # attempt_spans' reads


def _varint(n: int) -> bytes:
    if 0 <= n < 1 << 14:  # (a negative int indexed from the table's end: 16383 for -1)
        return _VARINT[n]
    n &= (1 << 64) - 1  # int64: two's complement, ten bytes when negative
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: tag byte (field << 3 | 2), length, payload."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _any_value(value: Any, max_len: int | None) -> bytes:
    """AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(value, str):
        return _field(0x0A, (value if max_len is None else value[:max_len]).encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, (list, tuple)):
        return _field(0x2A, b"".join(_field(0x0A, _any_value(v, max_len)) for v in value))
    return _field(0x0A, str(value).encode())


def _key_value(tag: int, key: str, value: Any, max_len: int | None = None) -> bytes:
    """KeyValue {key 1, value 2} as a field `tag` of the enclosing message."""
    return _field(tag, _field(0x0A, key.encode()) + _field(0x12, _any_value(value, max_len)))


def encode_resource(resource: Resource, scope: InstrumentationScope) -> tuple[bytes, bytes]:
    """ResourceSpans.resource (1) and ScopeSpans.scope (1) as encoded fields."""
    res = b"".join(_key_value(0x0A, k, v) for k, v in resource.attributes.items())
    sc = _field(0x0A, scope.name.encode())
    if scope.version:
        sc += _field(0x12, scope.version.encode())
    return _field(0x0A, res), _field(0x0A, sc)


def export_request(resource: bytes, scope: bytes, spans: Iterable[bytes]) -> bytes:
    """ExportTraceServiceRequest {ResourceSpans {resource, ScopeSpans {scope, spans...}}}, in one
    join: a batch is about a megabyte, and each nesting level built by concatenation copied it
    again (five copies, each a fresh large allocation: 1.9 ms of a batch's 3.5 ms of CPU)."""
    parts = [b"", b"", resource, b"", scope, *spans]
    inner = sum(map(len, parts))
    parts[3] = b"\x12" + _varint(inner - len(resource))  # ScopeSpans, field 2 of ResourceSpans
    parts[0], parts[1] = b"\x0a", _varint(inner + len(parts[3]))  # ResourceSpans, field 1
    return b"".join(parts)


def _segment_tail(kind: bytes) -> tuple[int, Callable[[int, int, int, bytes], bytes]]:
    """name (5) and kind (6) `kind`, the times (7, 8), an OK status and flags, in one pack:
    (length less the times, pack(start, 0x41, end, _TAIL_OK))."""
    pack = struct.Struct(f"<{len(kind)}sBQBQ{len(_TAIL_OK)}s").pack
    return len(kind) + len(_TAIL_OK), partial(pack, kind, 0x39)


def _status_error(description: str) -> bytes:
    """status (15): Status {message 2, code 3 = ERROR}."""
    return _field(0x7A, _field(0x12, description.encode()) + b"\x18\x02")


class SpanEncoder:
    """A finished `RequestTrace` as its ScopeSpans.spans (2) fields, children first, root last.

    Encoded attribute (name, value) pairs of strings and ints are cached: most of a request's
    attributes (model, pool, replica, policy, outcome, status) repeat from request to request.
    """

    def __init__(self, max_attributes: int = 128, max_value_len: int | None = None) -> None:
        self.max_attributes = max_attributes
        self.max_value_len = max_value_len
        self._cache: dict[tuple[str, Any], tuple[type, bytes]] = {}
        # a whole attribute block, by the mapping's id (attempt spans of the same shape share one
        # read-only mapping, roots their repeating group); the mapping is kept, so its id is not
        # reused meanwhile
        self._blocks: dict[int, tuple[Mapping[str, Any], bytes]] = {}
        # (id of a repeating set, Host, User-Agent) → (the set, kept; its group; the group's
        # block; whether the one pass takes it)
        self._groups: dict[
            tuple[int, bytes | None, bytes | None],
            tuple[Mapping[str, Any], Mapping[str, Any], bytes, bool, bool],
        ] = {}
        self._ints: dict[str, list[bytes]] = {}  # int attributes' KeyValue heads (_int_prefixes)
        self._ttft_kv = _key_value(0x4A, _TTFT, 0.0)[:-8]  # then the double's 8 bytes
        self._tpot_kv = _key_value(0x4A, _TPOT, 0.0)[:-8]
        # name (5) and kind (6) of each span shape
        self._root_name = _field(0x2A, ROOT_SPAN.encode()) + _KIND["SERVER"]
        self._child_name = {
            n: _field(0x2A, n.encode()) + _KIND[k] for n, k in SPAN_KINDS.items() if n != ROOT_SPAN
        }
        # a segment span without attributes: its length past `base`, and its bytes from name (5)
        # to flags (16) given its times
        self._segment = {n: _segment_tail(k) for n, k in self._child_name.items()}

    def encode(self, rt: RequestTrace) -> bytes:
        """A finished trace's spans: in one pass from what `finish` was given when it has the
        request path's shape (a shared repeating set, then the measured names), else built
        (`rt.build()`) and encoded. Either way the same bytes for the same span ids."""
        given = rt.given
        if given is not None and not rt.attributes and self.max_value_len is None:
            named = given[3]
            got = named() if callable(named) else named
            if type(got) is tuple and type(got[0]) is MappingProxyType:
                out = self._one_pass(rt, given[0], given[1], given[2], got, given[4])
                if out is not None:
                    return out
        rt.build()
        return self.built(rt)

    def _one_pass(
        self,
        rt: RequestTrace,
        segs: tuple[tuple[int, int] | None, ...],
        attempts: Sequence[Any],
        end_ns: int,
        got: tuple[Mapping[str, Any], ...],
        error_type: str | None,
    ) -> bytes | None:
        """`RequestTrace.build` and `built` in one: no child tuples (but attempts'), no root
        mapping; None (nothing drawn yet) for what only the two passes encode exactly."""
        repeat, measured = got[0], got[1]
        key = (id(repeat), rt.host, rt.agent)
        hit = self._groups.get(key)
        if hit is None or hit[0] is not repeat:
            hit = self._group(key, repeat, rt.host, rt.agent)
        _, group, gblock, plain, whole = hit
        if (
            not plain  # the group has a name build() would add or move
            or len(group) + len(measured) + 3 > self.max_attributes
            or _TTFT in measured
            or _TPOT in measured
            or _ERROR_TYPE in measured
            or not group.keys().isdisjoint(measured)
        ):
            return None
        route_attrs = got[2] if len(got) == 3 else None
        head = b"\x0a\x10" + rt.tid.to_bytes(16, "big")  # trace_id (1)
        ts = rt.trace_state
        state = _field(0x1A, ts.to_header().encode()) if ts else b""  # trace_state (3)
        root_id = rt.sid.to_bytes(8, "big")
        pre = head + b"\x12\x08"  # then span_id (2)
        mid = state + b"\x22\x08" + root_id  # parent_span_id (4)
        base = len(pre) + 8 + len(mid) + 18  # span id, and the two times: 18 bytes
        out: list[bytes] = []
        add = out.extend
        names = self._child_name
        start = prev = rt.start_ns
        shapes = self._segment
        for name, s, prev in segment_times(segs, start):
            sid = (_getrandbits(64) or 1).to_bytes(8, "big")
            if route_attrs and name == "gateway.route":  # the route receipt's attributes
                kind, block = names[name], self.attributes(route_attrs)
                n = base + len(kind) + len(block) + len(_TAIL_OK)
                add((b"\x12" + _varint(n), pre, sid, mid, kind, _TIMES(0x39, s, 0x41, prev),
                     block, _TAIL_OK))  # fmt: skip
                continue
            length, rest = shapes[name]  # the span's length less base; kind, times and status
            n = base + length
            add((_LEN_SPAN[n] if n < 1024 else b"\x12" + _varint(n), pre, sid, mid,
                 rest(s, 0x41, prev, _TAIL_OK)))  # fmt: skip
        # the root's attributes, in build()'s order: the group, the measured, then the derived
        attrs = [gblock]
        ints, more = self._ints, attrs.append
        for item in measured.items():
            value = item[1]
            if type(value) is int:
                vb = _VARINT[value] if 0 <= value < 16384 else _varint(value)
                kv = ints.get(item[0]) or self._int_prefixes(item[0])
                more(kv[len(vb)])
                more(vb)
            else:
                more(self._pair(item))
        ttft, tpot = derived_times(segs, start, measured.get(_OUTPUT, group.get(_OUTPUT)))
        if ttft is not None:
            more(self._ttft_kv)
            more(_DOUBLE(ttft))
        if tpot is not None:
            more(self._tpot_kv)
            more(_DOUBLE(tpot))
        end = max(end_ns, prev)
        if attempts:
            children: list[Child] = []
            reads = group if whole else {**group, **measured}  # what build()'s root has of them
            attempt_spans(children, attempts, reads, rt.offset_ns, start, prev, end)
            for name, span_id, s, e, a, error in children:
                kind = names[name]
                block = self._block(a) if a else b""
                tail = _TAIL_OK if error is None else _status_error(error) + _FLAGS_LOCAL
                n = base + len(kind) + len(block) + len(tail)
                add((_LEN_SPAN[n] if n < 1024 else b"\x12" + _varint(n), pre,
                     span_id.to_bytes(8, "big"), mid, kind, _TIMES(0x39, s, 0x41, e), block, tail))  # fmt: skip
        root_status = _STATUS_UNSET
        error_type, failed = server_error(measured.get(_STATUS, group.get(_STATUS)), error_type)
        if error_type is not None:
            more(self._pair((_ERROR_TYPE, error_type)))
            if failed:
                root_status = _status_error(error_type)
        parent = rt.parent
        root = (
            pre,
            root_id,
            state,
            b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
            self._root_name,
            _TIMES(0x39, start, 0x41, end),
            *attrs,
            root_status,
            _FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL,
        )
        n = sum(map(len, root))
        out.append(_LEN_SPAN[n] if n < 1024 else b"\x12" + _varint(n))
        out.extend(root)
        return b"".join(out)

    def _group(
        self,
        key: tuple[int, bytes | None, bytes | None],
        repeat: Mapping[str, Any],
        host: bytes | None,
        agent: bytes | None,
    ) -> tuple[Mapping[str, Any], Mapping[str, Any], bytes, bool, bool]:
        """A repeating set with the request's Host names (trace.group_of), its encoded block,
        whether the one pass can take it (build() adds or moves none of its names) and whether
        it holds all an attempt span reads of the root."""
        group = group_of(repeat, host, agent)
        plain = _OUTCOME in group and not any(n in group for n in _DERIVED)
        whole = all(n in group for n in _ATTEMPT_READS)
        if len(self._groups) >= _CACHE_MAX:
            self._groups.clear()
        hit = self._groups[key] = (repeat, group, self.attributes(group), plain, whole)
        return hit

    def _int_prefixes(self, name: str) -> list[bytes]:
        """An int attribute's KeyValue bytes up to its value's varint, by the varint's length."""
        got = [b""] + [_key_value(0x4A, name, 1 << 7 * (n - 1) if n < 10 else -1)[:-n]
                       for n in range(1, 11)]  # fmt: skip
        if len(self._ints) >= _CACHE_MAX:
            self._ints.clear()
        self._ints[name] = got
        return got

    def built(self, rt: RequestTrace) -> bytes:
        """A built trace's spans (`rt.build()` was called): children first, root last."""
        head = b"\x0a\x10" + rt.tid.to_bytes(16, "big")  # trace_id (1)
        ts = rt.trace_state
        state = _field(0x1A, ts.to_header().encode()) if ts else b""  # trace_state (3)
        root_id = rt.sid.to_bytes(8, "big")
        names = self._child_name
        pre = head + b"\x12\x08"  # then span_id (2)
        mid = state + b"\x22\x08" + root_id  # parent_span_id (4)
        base = len(pre) + 8 + len(mid) + 18  # span id, and the two times: 18 bytes
        out: list[bytes] = []
        add = out.extend
        for name, span_id, start, end, attrs, error in rt.segments:
            kind = names.get(name) or _field(0x2A, name.encode()) + _KIND["INTERNAL"]
            block = self._block(attrs) if attrs else b""
            tail = _TAIL_OK if error is None else _status_error(error) + _FLAGS_LOCAL
            n = base + len(kind) + len(block) + len(tail)
            # one spans (2) field per child, its bytes gathered into one join with the others'
            add((_LEN_SPAN[n] if n < 1024 else b"\x12" + _varint(n), pre,
                 span_id.to_bytes(8, "big"), mid, kind, _TIMES(0x39, start, 0x41, end), block, tail))  # fmt: skip
        parent = rt.parent
        body = b"".join(
            (
                pre,
                root_id,
                state,
                b"\x22\x08" + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
                self._root_name,
                _TIMES(0x39, rt.start_ns, 0x41, rt.end_ns),
                self.attributes(rt.attributes, rt.group),
                _STATUS_UNSET if rt.error is None else _status_error(rt.error),
                _FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL,
            )
        )
        out.append(_field(0x12, body))
        return b"".join(out)

    def _block(self, attrs: Mapping[str, Any]) -> bytes:
        """Attributes of a shared read-only mapping, encoded once per mapping object."""
        hit = self._blocks.get(id(attrs))
        if hit is not None and hit[0] is attrs:
            return hit[1]
        block = self.attributes(attrs)
        if len(self._blocks) >= _CACHE_MAX:
            self._blocks.clear()
        self._blocks[id(attrs)] = (attrs, block)
        return block

    def attributes(self, attrs: Mapping[str, Any], group: Mapping[str, Any] | None = None) -> bytes:
        """Span.attributes (9) fields, and dropped_attributes_count (10) past the count limit.

        `group`, when given, is the mapping `attrs` begins with (`RequestTrace.group`, shared by
        the traces that repeat it): it is encoded once, as one cached block.
        """
        items: Iterable[tuple[str, Any]] = attrs.items()
        dropped = len(attrs) - self.max_attributes
        parts = []
        if dropped > 0:  # as the SDK's BoundedAttributes: the latest ones are kept
            items = list(items)[dropped:]
        elif group is not None:
            parts.append(self._block(group))
            items = islice(items, len(group), None)
        parts.extend(map(self._pair, items))
        if dropped > 0:
            parts.append(b"\x50" + _varint(dropped))
        return b"".join(parts)

    def _pair(self, item: tuple[str, Any]) -> bytes:
        """One attribute's KeyValue as a Span.attributes (9) field; strings', ints' and string
        tuples' kept."""
        # (name, value) is the key; the value's type is checked as 1 == 1.0 == True
        cache = self._cache
        try:
            hit = cache.get(item)
        except TypeError:  # an unhashable value (a list)
            hit = None
        if hit is not None and hit[0] is type(item[1]):
            return hit[1]
        name, value = item
        kv = _key_value(0x4A, name, value, self.max_value_len)
        kind = type(value)
        if kind is str or kind is int or (kind is tuple and all(type(v) is str for v in value)):
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            cache[item] = (kind, kv)
        return kv

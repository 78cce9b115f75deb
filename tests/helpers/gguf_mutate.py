"""Rewrite a GGUF's header for tests: change, add or drop metadata keys and tensor records, keep the data.

Not a general GGUF writer: it keeps every value's raw bytes as it found them, so a test changes only
what it means to change. `GgufFile.to_bytes()` re-pads the header to the file's alignment, so the
tensor data section stays aligned whatever the header's new length.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

_SCALAR = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass
class KeyValue:
    key: str
    vtype: GGUFValueType
    payload: bytes  # the value's bytes as stored after its type field

    def value(self) -> object:
        if self.vtype in _SCALAR:
            return struct.unpack("<" + _SCALAR[self.vtype], self.payload)[0]
        if self.vtype == GGUFValueType.STRING:
            return self.payload[8:].decode("utf-8", errors="replace")
        return None


@dataclass
class TensorInfo:
    name: str
    dims: list[int]  # ggml order, ne0 first
    qtype: int
    offset: int  # relative to the data section


@dataclass
class GgufFile:
    version: int
    kvs: list[KeyValue]
    tensors: list[TensorInfo]
    data: bytes  # the tensor data section, from its first (aligned) byte to the end of the file
    alignment: int = 32
    n_tensors: int | None = None  # header counts written instead of the true ones (None: the true ones)
    n_kv: int | None = None

    @classmethod
    def read(cls, path: str | Path) -> GgufFile:
        return cls.parse(Path(path).read_bytes())

    @classmethod
    def parse(cls, raw: bytes) -> GgufFile:
        pos = 4
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, pos)
        pos += 20
        kvs = []
        for _ in range(n_kv):
            key, pos = _string(raw, pos)
            (vtype,) = struct.unpack_from("<I", raw, pos)
            pos += 4
            end = _skip_value(raw, pos, vtype)
            kvs.append(KeyValue(key, GGUFValueType(vtype), raw[pos:end]))
            pos = end
        tensors = []
        for _ in range(n_tensors):
            name, pos = _string(raw, pos)
            (n_dims,) = struct.unpack_from("<I", raw, pos)
            dims = list(struct.unpack_from(f"<{n_dims}Q", raw, pos + 4))
            pos += 4 + 8 * n_dims
            qtype, offset = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            tensors.append(TensorInfo(name, dims, qtype, offset))
        f = cls(version=version, kvs=kvs, tensors=tensors, data=b"")
        alignment = f.get("general.alignment")
        f.alignment = alignment if isinstance(alignment, int) else 32
        start = -(-pos // f.alignment) * f.alignment
        f.data = raw[start:]
        return f

    # -- metadata -----------------------------------------------------------------------
    def find(self, key: str) -> KeyValue | None:
        return next((kv for kv in self.kvs if kv.key == key), None)

    def get(self, key: str) -> object:
        kv = self.find(key)
        return None if kv is None else kv.value()

    def set(self, key: str, vtype: GGUFValueType, value: object) -> GgufFile:
        """Set a scalar or string key (added at the end if missing)."""
        if vtype == GGUFValueType.STRING:
            raw = value if isinstance(value, bytes) else str(value).encode()
            payload = struct.pack("<Q", len(raw)) + raw
        else:
            payload = struct.pack("<" + _SCALAR[vtype], value)
        return self.set_raw(key, vtype, payload)

    def set_raw(self, key: str, vtype: GGUFValueType, payload: bytes) -> GgufFile:
        kv = self.find(key)
        if kv is None:
            self.kvs.append(KeyValue(key, vtype, payload))
        else:
            kv.vtype, kv.payload = vtype, payload
        return self

    def set_array(self, key: str, item_type: GGUFValueType, values: list[object]) -> GgufFile:
        payload = struct.pack("<IQ", item_type, len(values))
        payload += b"".join(struct.pack("<" + _SCALAR[item_type], v) for v in values)
        return self.set_raw(key, GGUFValueType.ARRAY, payload)

    def drop(self, key: str) -> GgufFile:
        self.kvs = [kv for kv in self.kvs if kv.key != key]
        return self

    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)

    # -- output -------------------------------------------------------------------------
    def header_bytes(self) -> bytes:
        out = [b"GGUF", struct.pack("<IQQ", self.version,
                                    len(self.tensors) if self.n_tensors is None else self.n_tensors,
                                    len(self.kvs) if self.n_kv is None else self.n_kv)]
        for kv in self.kvs:
            out += [_pack_string(kv.key), struct.pack("<I", kv.vtype), kv.payload]
        for t in self.tensors:
            out += [_pack_string(t.name), struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims),
                    struct.pack("<IQ", t.qtype, t.offset)]
        head = b"".join(out)
        return head + b"\0" * (-len(head) % self.alignment)

    def to_bytes(self) -> bytes:
        return self.header_bytes() + self.data

    def write(self, path: str | Path) -> Path:
        Path(path).write_bytes(self.to_bytes())
        return Path(path)


def _string(raw: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", raw, pos)
    return raw[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n


def _pack_string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _skip_value(raw: bytes, pos: int, vtype: int) -> int:
    if vtype in _SCALAR:
        return pos + struct.calcsize(_SCALAR[vtype])
    if vtype == GGUFValueType.STRING:
        (n,) = struct.unpack_from("<Q", raw, pos)
        return pos + 8 + n
    if vtype == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        if item_type in _SCALAR:
            return pos + count * struct.calcsize(_SCALAR[item_type])
        for _ in range(count):
            pos = _skip_value(raw, pos, item_type)
        return pos
    raise ValueError(f"unknown GGUF value type {vtype}")

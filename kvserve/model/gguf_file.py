"""A GGUF file's metadata and tensor table, read in one pass over the header.

`gguf.GGUFReader` builds a numpy view per value (a vocabulary of 49,152 strings and as many merges
is about a million views: seconds on every first start); this reader walks the same layout with
`struct` over the mapped bytes, keeps every value as a Python value and maps each tensor's data
as `GGUFReader` does (a typed array for float and integer tensors, the raw block bytes of a
quantized one, shape innermost dimension last). Its `fields` and `tensors` have the attributes the
engine reads from a `GGUFReader` (`field.contents()`, `len(field.data)`; `tensor.name`, `.shape`,
`.tensor_type`, `.n_elements`, `.n_bytes`, `.data`), so either can be passed where a reader is taken.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format of one scalar (8: string and 9: array are read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader can read; the message says where and why."""


class Field:
    """One metadata value: `contents()` is the value (a list for arrays); `data` has one entry per
    element of an array (one for a scalar), as a `GGUFReader` field's `data` has."""

    __slots__ = ("name", "value", "data")

    def __init__(self, name: str, value: Any, count: int):
        self.name, self.value, self.data = name, value, range(count)

    def contents(self) -> Any:
        return self.value


class Tensor(NamedTuple):
    name: str
    tensor_type: Any          # gguf.GGMLQuantizationType
    shape: np.ndarray         # dims as the file stores them: innermost first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The metadata (`fields`: name -> Field) and tensors (`tensors`) of one GGUF file."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise GGUFFormatError(f"{self.path}: not a GGUF file ({exc})") from exc
        self._pos = 0
        if self._bytes(4) != MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic; a big-endian GGUF is not read)")
        version = self._scalar("I")
        if version not in VERSIONS:
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not read (versions {VERSIONS} are)")
        tensor_count, kv_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Field] = {}
        for _ in range(kv_count):
            name = self._string()
            self.fields[name] = self._field(name)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment")
        align = int(alignment.value) if alignment is not None else DEFAULT_ALIGNMENT
        if align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"{self.path}: general.alignment {align} is not a power of two")
        self.data_offset = -(-self._pos // align) * align
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(*info) for info in infos]

    def _bytes(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._map):
            raise GGUFFormatError(f"{self.path}: truncated at byte {self._pos} (the file ends at {len(self._map)})")
        out = self._map[self._pos:end]
        self._pos = end
        return out

    def _scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self._bytes(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._bytes(self._scalar("Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind in SCALARS:
            return self._scalar(SCALARS[kind])
        raise GGUFFormatError(f"{self.path}: unknown GGUF value type {kind} at byte {self._pos}")

    def _field(self, name: str) -> Field:
        kind = self._scalar("I")
        if kind != ARRAY:
            return Field(name, self._value(kind), 1)
        item, count = self._scalar("I"), self._scalar("Q")
        if item in NUMPY:
            width = np.dtype(NUMPY[item]).itemsize
            values = np.frombuffer(self._bytes(width * count), dtype=np.dtype(NUMPY[item]).newbyteorder("<"))
            return Field(name, values.tolist(), count)
        if item == STRING:
            return Field(name, self._strings(count), count)
        return Field(name, [self._field_value(item) for _ in range(count)], count)

    def _field_value(self, kind: int):
        if kind != ARRAY:
            return self._value(kind)
        item, count = self._scalar("I"), self._scalar("Q")
        return [self._field_value(item) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        data, pos, out = self._map, self._pos, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > len(data):
                raise GGUFFormatError(f"{self.path}: truncated inside a string array at byte {pos}")
            (n,) = unpack(data, pos)
            pos += 8
            out.append(data[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        if pos > len(data):
            raise GGUFFormatError(f"{self.path}: truncated inside a string array")
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
        return name, dims, self._scalar("I"), self._scalar("Q")

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: tensor {name} has unknown GGML type {raw_type}") from None
        block, size = GGML_QUANT_SIZES[kind]
        elements = int(np.prod(dims)) if dims else 1
        n_bytes = elements * size // block
        start = self.data_offset + offset
        if start + n_bytes > len(self._array):
            raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file")
        raw = self._array[start:start + n_bytes]
        shape = tuple(reversed(dims))
        typed = _TYPED.get(kind.name)
        if typed is not None:
            data = raw.view(typed).reshape(shape)
        else:
            if shape[-1] % block:
                raise GGUFFormatError(f"{self.path}: tensor {name} rows of {shape[-1]} are not whole {kind.name} blocks")
            data = raw.reshape(*shape[:-1], shape[-1] // block * size)
        return Tensor(name, kind, np.array(dims, dtype=np.uint64), elements, n_bytes, start, data)


# GGML types whose data is an array of plain numbers (the rest are blocks of bytes)
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}

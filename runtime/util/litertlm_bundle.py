"""Reading ``.litertlm`` bundles (LiteRT-LM's container: model, tokenizer, metadata) over mmap.

Layout (as ``litert-lm-builder`` 0.18 writes it): ``LITERTLM`` magic, major/minor/patch
versions (uint32 each) at bytes 8-20, the end of the header (uint64) at byte 24, and from
byte 32 a flatbuffer ``LiteRTLMMetaData`` {system_metadata: {entries: [KeyValuePair]},
section_metadata: {objects: [SectionObject {items: [KeyValuePair], begin_offset,
end_offset, data_type}]}}; each section's bytes lie at ``[begin_offset, end_offset)``,
aligned to 16 KiB. A ``KeyValuePair`` is {key, value_type, value: union of one-field
tables}. A Hugging Face tokenizer section holds the uint64 size of the JSON and then the
JSON compressed with zlib. An LlmMetadata section is a protocol buffer
(``litert.lm.proto.LlmMetadata``) of which the engine reads start_token (1) and
stop_tokens (2), TokenUnions of int32 ids; max_num_tokens (5); jinja_prompt_template (7).
``runtime export`` also puts the texts of the bos and eos tokens, which chat templates
insert, into the section's key/value items ``bos_token`` and ``eos_token``.
"""

from __future__ import annotations

import functools
import os
import stat
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import DataLossError, InvalidArgumentError, NotFoundError
from runtime.util.flatbuffer_table import FlatTable
from runtime.util.model_view import ModelFile
from runtime.util.scoped_file import ScopedFile

MAGIC = b"LITERTLM"
HEADER_BEGIN = 32
SUPPORTED_MAJOR = 1

SECTION_TYPES = {
    0: "none", 1: "generic_binary_data", 2: "deprecated", 3: "tflite_model", 4: "sentencepiece_tokenizer",
    5: "llm_metadata_proto", 6: "hf_tokenizer_zlib", 7: "tflite_weights", 8: "embedding_metadata_proto",
    9: "executor_metadata_proto", 10: "tts_metadata_proto", 11: "asr_metadata_proto",
}
# VData union members: type code -> struct format of their single field (9 is a string).
_VALUE_FORMATS = {1: "B", 2: "b", 3: "H", 4: "h", 5: "I", 6: "i", 7: "f", 8: "?", 10: "Q", 11: "q", 12: "d"}
_STRING_VALUE = 9
PREFILL_DECODE = "tf_lite_prefill_decode"


@dataclass(frozen=True)
class LlmMetadata:
    """What a bundle says about generating with its model."""

    # Token ids a conversation starts with (LiteRT-LM prepends them).
    start_token_ids: tuple[int, ...] = ()
    # Tokens that end a generation (stop sequences of one token; longer ones and stop
    # texts are left out).
    stop_token_ids: tuple[int, ...] = ()
    # The Jinja2 chat template, or None.
    chat_template: str | None = None
    # The longest context the bundle was made for, or None.
    max_num_tokens: int | None = None
    # The texts chat templates insert for the bos and eos tokens ("" if unknown).
    bos_token: str = ""
    eos_token: str = ""


@dataclass(frozen=True)
class BundleSection:
    """One section: what it holds, where, and its key/value metadata."""

    index: int
    data_type: str
    begin: int
    end: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Bytes of the section's data."""
        return self.end - self.begin


class LitertLmBundle:
    """A ``.litertlm`` file, memory-mapped; sections are read as zero-copy views."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with ScopedFile(self.path) as scoped:
            self._map = scoped.memory_map()
        try:
            self.version, self.system_metadata, self.sections = self._parse()
        except BaseException:
            self._map.close()
            raise

    def _parse(self) -> tuple[tuple[int, int, int], dict[str, Any], list[BundleSection]]:
        data, source = self._map, str(self.path)
        if len(data) < HEADER_BEGIN or data[:8] != MAGIC:
            raise InvalidArgumentError(f"{source}: not a .litertlm bundle (no LITERTLM magic)")
        version = struct.unpack_from("<3I", data, 8)
        if version[0] != SUPPORTED_MAJOR:
            raise InvalidArgumentError(
                f"{source}: .litertlm version {'.'.join(map(str, version))}, expected major {SUPPORTED_MAJOR}"
            )
        header_end = struct.unpack_from("<Q", data, 24)[0]
        if not HEADER_BEGIN < header_end <= len(data):
            raise DataLossError(f"{source}: header ends at byte {header_end}, outside the {len(data)}-byte file")
        header = memoryview(data)[HEADER_BEGIN:header_end]
        try:
            root = FlatTable.root(header, source)
            system = root.table(0)
            sections = root.table(1)
            system_metadata = _key_values(system.tables(0)) if system else {}
            parsed = []
            for index, entry in enumerate(sections.tables(0) if sections else []):
                begin, end = int(entry.scalar(1, "Q")), int(entry.scalar(2, "Q"))
                kind = int(entry.scalar(3, "B"))
                if not 0 <= begin <= end <= len(data):
                    raise DataLossError(
                        f"{source}: section {index} at bytes [{begin}, {end}) is outside the {len(data)}-byte file"
                    )
                parsed.append(BundleSection(index, SECTION_TYPES.get(kind, f"unknown_{kind}"), begin, end,
                                            _key_values(entry.tables(0))))
        finally:
            header.release()
        return version, system_metadata, parsed

    def section_bytes(self, section: BundleSection) -> memoryview:
        """A read-only view of a section's data (valid until :meth:`close`)."""
        return memoryview(self._map)[section.begin : section.end]

    def model_section(self, model_type: str = PREFILL_DECODE) -> BundleSection:
        """The TFLite model section of ``model_type`` (the LLM itself by default)."""
        models = [s for s in self.sections if s.data_type == "tflite_model"]
        for section in models:
            if section.metadata.get("model_type", PREFILL_DECODE) == model_type:
                return section
        raise NotFoundError(
            f"{self.path}: no {model_type} model section (models: "
            f"{[s.metadata.get('model_type') for s in models]})"
        )

    def tokenizer(self) -> tuple[str, bytes] | None:
        """``("hf", tokenizer.json bytes)`` or ``("sentencepiece", model bytes)``, or ``None``."""
        for section in self.sections:
            if section.data_type == "hf_tokenizer_zlib":
                raw = self.section_bytes(section)
                if len(raw) < 8:
                    raise DataLossError(f"{self.path}: tokenizer section {section.index} is truncated")
                size = struct.unpack_from("<Q", raw, 0)[0]
                inflate = zlib.decompressobj()
                try:  # no further than one byte past the declared size (a corrupt size or a zlib bomb)
                    text = inflate.decompress(raw[8:], min(size, sys.maxsize - 1) + 1)
                except zlib.error as exc:
                    raise DataLossError(f"{self.path}: tokenizer section {section.index}: {exc}") from None
                if len(text) > size:
                    raise DataLossError(
                        f"{self.path}: tokenizer section {section.index} inflates to more than {size} bytes, "
                        "its declared size")
                if not inflate.eof or len(text) != size:
                    raise DataLossError(
                        f"{self.path}: tokenizer section {section.index} inflates to {len(text)} bytes"
                        f"{'' if inflate.eof else ' and is cut short'}, expected {size}")
                return "hf", text
            if section.data_type == "sentencepiece_tokenizer":
                return "sentencepiece", bytes(self.section_bytes(section))
        return None

    def llm_metadata(self) -> LlmMetadata | None:
        """The LlmMetadata section's start and stop tokens, chat template and KV length, or
        ``None`` when the bundle has no such section."""
        for section in self.sections:
            if section.data_type == "llm_metadata_proto":
                from google.protobuf.message import DecodeError

                message = _llm_metadata_message()()
                try:
                    with self.section_bytes(section) as view:
                        message.ParseFromString(bytes(view))
                except DecodeError as exc:
                    raise DataLossError(f"{self.path}: LlmMetadata section {section.index} does not parse: {exc}") from None
                return LlmMetadata(
                    start_token_ids=tuple(message.start_token.token_ids.ids),
                    stop_token_ids=tuple(stop.token_ids.ids[0] for stop in message.stop_tokens
                                         if len(stop.token_ids.ids) == 1),
                    chat_template=message.jinja_prompt_template or None,
                    max_num_tokens=message.max_num_tokens if message.HasField("max_num_tokens") else None,
                    bos_token=str(section.metadata.get("bos_token", "")),
                    eos_token=str(section.metadata.get("eos_token", "")),
                )
        return None

    def close(self) -> None:
        """Unmaps the file (views handed out must be released first)."""
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it

    def __enter__(self) -> LitertLmBundle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def is_litertlm(path: str | os.PathLike[str]) -> bool:
    """Whether the file is a regular one starting with the ``.litertlm`` magic (opened
    without blocking: a FIFO is no bundle, and is not waited on for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(MAGIC)) == MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def model_file(path: str | os.PathLike[str]) -> ModelFile:
    """The LLM a model file holds, as the engine opens it: a ``.litertlm`` bundle's
    :data:`PREFILL_DECODE` model section, any other file whole."""
    if not is_litertlm(path):
        return ModelFile(Path(path))
    with LitertLmBundle(path) as bundle:
        section = bundle.model_section()
    return ModelFile(Path(path), section.begin, section.end)


@functools.cache
def _llm_metadata_message() -> type:
    """A protobuf message class for the LlmMetadata fields the engine reads (the others
    are kept as unknown fields), made from a descriptor built here: the generated module
    ships only with litert-lm-builder, which the runtime does not depend on."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="runtime_llm_metadata.proto", package="runtime_llm_metadata")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        added = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            added.field.add(name=field_name, number=number, type=kind, label=label, **(
                {"type_name": type_name} if type_name else {}))

    optional, repeated = field.LABEL_OPTIONAL, field.LABEL_REPEATED
    message("TokenIds", ("ids", 1, field.TYPE_INT32, repeated, ""))
    message("TokenUnion", ("token_ids", 1, field.TYPE_MESSAGE, optional, ".runtime_llm_metadata.TokenIds"),
            ("token_str", 2, field.TYPE_STRING, optional, ""))
    union = ".runtime_llm_metadata.TokenUnion"
    message("LlmMetadata", ("start_token", 1, field.TYPE_MESSAGE, optional, union),
            ("stop_tokens", 2, field.TYPE_MESSAGE, repeated, union),
            ("max_num_tokens", 5, field.TYPE_INT32, optional, ""),
            ("jinja_prompt_template", 7, field.TYPE_STRING, optional, ""))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("runtime_llm_metadata.LlmMetadata"))


def _key_values(entries: list[FlatTable]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for entry in entries:
        key = entry.string(0)
        kind = int(entry.scalar(1, "B"))
        holder = entry.table(2)
        if key is None or holder is None:
            continue
        if kind == _STRING_VALUE:
            values[key] = holder.string(0)
        elif kind in _VALUE_FORMATS:
            values[key] = holder.scalar(0, _VALUE_FORMATS[kind])
    return values

"""The record types' shared machinery: a record is a frozen dataclass whose fields are columns,
each with one plain Python type (or None), from which ``store.schema`` derives the Polars
schema of the frame it fills (one declaration per column)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

Row = dict[str, Any]
"""One row of a secondary frame as the store writes it (``FrameRow.row()``)."""
ResultRow = dict[str, Any]
"""A job's flat row of the results frame, assembled from its phases' records (the store checks
it against the results schema)."""

_FRAME = "quantdask.frame"


def frame_rows(frame: str) -> Any:
    """A record field holding rows of the secondary frame ``frame`` (``store.schema.FRAMES``)."""
    return dataclasses.field(default_factory=list, metadata={_FRAME: frame})


@dataclasses.dataclass(frozen=True)
class Record:
    """Base of every record (see the module): its columns, flat or from nested records."""

    def columns(self) -> ResultRow:
        """Its columns, nested records' flattened in (a nested None: their columns null)."""
        columns: ResultRow = {}
        nested = type(self).nested()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if _FRAME in f.metadata:
                continue
            if isinstance(value, Record):
                columns.update(value.columns())
            elif f.name in nested:
                columns.update(dict.fromkeys(nested[f.name].column_names()))
            else:
                columns[f.name] = value
        return columns

    @classmethod
    def nested(cls) -> dict[str, type[Record]]:
        """Fields that hold another record (or None: its columns then null)."""
        return _nested_fields(cls)

    @classmethod
    def column_names(cls) -> tuple[str, ...]:
        """The columns a record of this type fills."""
        return tuple(cls.column_types())

    @classmethod
    def column_types(cls) -> dict[str, type]:
        """The columns a record of this type fills, each with its Python type (None left out
        of an optional one): what ``store.schema`` derives the frame's schema from."""
        return {name: kind for name, (kind, _) in _columns(cls).items()}

    @classmethod
    def optional_columns(cls) -> tuple[str, ...]:
        """The columns a record of this type may leave null (typed ``... | None``)."""
        return tuple(name for name, (_, optional) in _columns(cls).items() if optional)


_NESTED: dict[type, dict[str, type[Record]]] = {}
_COLUMNS: dict[type, dict[str, tuple[type, bool]]] = {}


def _nested_fields(record_type: type[Record]) -> dict[str, type[Record]]:
    """``Record.nested``, read from the type hints once per record type (every job assembles
    its row through it)."""
    if record_type in _NESTED:
        return _NESTED[record_type]
    hints, nested = typing.get_type_hints(record_type), {}
    for f in dataclasses.fields(record_type):
        if _FRAME in f.metadata:
            continue
        for kind in typing.get_args(hints[f.name]) or (hints[f.name],):
            if (isinstance(kind, type) and typing.get_origin(kind) is None
                    and issubclass(kind, Record)):
                nested[f.name] = kind
    _NESTED[record_type] = nested
    return nested


def _columns(record_type: type[Record]) -> dict[str, tuple[type, bool]]:
    """Each column's Python type and whether it may be null, nested records' included (a
    nested record that may be None makes its columns optional), read once per type."""
    if record_type in _COLUMNS:
        return _COLUMNS[record_type]
    nested, hints = record_type.nested(), typing.get_type_hints(record_type)
    columns: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(record_type):
        if _FRAME in f.metadata:
            continue
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        optional = type(None) in args
        if f.name in nested:
            columns.update({name: (kind, optional or inner)
                            for name, (kind, inner) in _columns(nested[f.name]).items()})
            continue
        kinds = [k for k in args if k is not type(None)]
        if len(kinds) != 1 or not isinstance(kinds[0], type):
            raise TypeError(f"{record_type.__name__}.{f.name}: a column holds one plain "
                            f"type (or None), not {hints[f.name]}")
        columns[f.name] = (kinds[0], optional)
    _COLUMNS[record_type] = columns
    return columns


@dataclasses.dataclass(frozen=True)
class PhaseRecord(Record):
    """What a phase of a job produces: results columns, and rows of secondary frames in its
    fields made with :func:`frame_rows` (``records.phases``)."""

    def rows(self) -> dict[str, list[Row]]:
        """Its rows of secondary frames, by frame name, as the store writes them."""
        return {f.metadata[_FRAME]: [row.row() for row in getattr(self, f.name)]
                for f in dataclasses.fields(self) if _FRAME in f.metadata}

    @classmethod
    def frame_names(cls) -> tuple[str, ...]:
        """The secondary frames a record of this type fills."""
        return tuple(f.metadata[_FRAME] for f in dataclasses.fields(cls) if _FRAME in f.metadata)


@dataclasses.dataclass(frozen=True)
class FrameRow(Record):
    """One row of a secondary frame (``records.rows``): its fields are the frame's columns."""

    def row(self) -> Row:
        """The row as the store writes it."""
        return self.columns()

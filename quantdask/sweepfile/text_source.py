"""Eval text from a Hugging Face ``datasets`` dataset, read only from what is on this machine.

``DatasetSource`` names the dataset as ``datasets.load_dataset`` takes it: a name in the local
``datasets`` cache (``wikitext`` with ``name: wikitext-2-raw-v1``), or a packaged builder over
local files (``parquet``, ``json``, ``csv``, ``text`` with ``data_files``). The rows of
``column`` are joined with blank lines ("\\n\\n", the usual wikitext perplexity protocol) into
one text, which is then cut into windows like a text file's. Nothing is downloaded: the load
runs with the ``datasets`` offline switch on, and a dataset that is not here is a clear error.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field, fields

from quantdask.errors import SpecError
from quantdask.util import import_datasets_offline

ROW_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class DatasetSource:
    """A dataset's text column (see the module). ``data_files`` are relative to the sweep."""

    path: str
    column: str = "text"
    name: str | None = None
    split: str = "test"
    data_files: tuple[str, ...] = ()
    root: str = field(default="", compare=False)

    def __post_init__(self):
        for attr in ("path", "column", "split"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value:
                raise SpecError(attr, f"must be a non-empty string, got {value!r}")
        if self.name is not None and not isinstance(self.name, str):
            raise SpecError("name", f"must be a dataset config name, got {self.name!r}")
        files = self.data_files
        if isinstance(files, str):
            files = (files,)
        if not isinstance(files, (list, tuple)) or not all(isinstance(f, str) for f in files):
            raise SpecError("data_files", f"must be a path or a list of paths, got {files!r}")
        object.__setattr__(self, "root", os.path.abspath(self.root or "."))
        resolved = tuple(os.path.join(self.root, f) for f in files)
        for i, path in enumerate(resolved):
            if not os.path.isfile(path):
                raise SpecError(f"data_files[{i}]", f"no file at {path}; give a local "
                                                    "Parquet, JSON, CSV or text file")
        object.__setattr__(self, "data_files", resolved)

    def describe(self) -> str:
        where = f" ({', '.join(os.path.basename(f) for f in self.data_files)})" \
            if self.data_files else ""
        return (f"dataset {self.path}{'/' + self.name if self.name else ''}{where}, split "
                f"{self.split}, column {self.column}")


def dataset_text(source: DatasetSource) -> str:
    """The dataset's ``column`` rows, joined (cached per process: the driver hashes it, then
    hands it to each model's reference)."""
    return _load(source.path, source.name, source.split, source.data_files, source.column)


@functools.lru_cache(maxsize=4)
def _load(path: str, name: str | None, split: str, data_files: tuple[str, ...],
          column: str) -> str:
    try:
        datasets = import_datasets_offline()
    except ImportError:
        raise SpecError("dataset", "needs the `datasets` package: pip install "
                                   "'quantdask[datasets]'") from None
    kwargs = {"data_files": list(data_files)} if data_files else {}
    try:
        table = datasets.load_dataset(path, name, split=split, **kwargs)
    except Exception as error:  # noqa: BLE001 - the library's own errors vary by cause
        raise SpecError("dataset", f"cannot load {path!r} (split {split!r}) from this "
                                   f"machine: {type(error).__name__}: {error}. Nothing is "
                                   "downloaded: give local data_files, or load the dataset "
                                   "once with network into the datasets cache") from None
    if column not in table.column_names:
        raise SpecError("dataset.column", f"{path!r} has no column {column!r}; its columns: "
                                          f"{', '.join(table.column_names)}")
    rows = [row for row in table[column] if isinstance(row, str)]
    return ROW_SEPARATOR.join(rows)


class TextSource:
    """A text given as a UTF-8 file (``text``, relative to ``root``) or a dataset's column
    (``dataset``), one of the two: what the eval and the calibration data read. A dataclass
    that mixes it in has the fields ``text``, ``dataset``, ``root`` and ``text_sha256``, and
    calls :meth:`_read_source` once it is built."""

    text: str | None
    dataset: DatasetSource | dict | None
    root: str
    text_sha256: str

    def _read_source(self, what: str) -> None:
        """Check the source, read it and set ``text_sha256`` (the content's, whatever its
        source: it goes into job ids)."""
        if (self.text is None) == (self.dataset is None):
            raise SpecError("text", f"give the {what} as a file (text: PATH) or as a dataset "
                                    "(dataset: {path: ..., split: ..., column: ...}), one of "
                                    "the two")
        if self.text is not None:
            if not isinstance(self.text, str):
                raise SpecError("text", f"must be a path to a UTF-8 text file, got {self.text!r}")
        else:
            object.__setattr__(self, "dataset", _dataset_source(self.dataset, self.root))
        content = self.read_text().encode("utf-8")
        if not content.strip():
            where = "dataset" if self.dataset is not None else "text"
            raise SpecError(where, f"{self.source} is empty; give one with {what}")
        object.__setattr__(self, "text_sha256", hashlib.sha256(content).hexdigest())

    @property
    def source(self) -> str:
        """Where the text comes from, for messages."""
        if self.dataset is None:
            return self.text_path
        # Already a DatasetSource once _read_source ran; this only narrows the type.
        return _dataset_source(self.dataset, self.root).describe()

    def read_text(self) -> str:
        """The text: the file's content, or the dataset's rows joined."""
        if self.dataset is not None:
            return dataset_text(_dataset_source(self.dataset, self.root))
        try:
            with open(self.text_path, "rb") as f:
                return f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise SpecError("text", f"cannot read a UTF-8 text file at {self.text_path} "
                                    f"({type(err).__name__}); give an existing text file") from None

    @property
    def text_path(self) -> str:
        if self.text is None:
            raise SpecError("text", "no text file given (the text comes from a dataset)")
        return os.path.join(self.root, self.text)


def _dataset_source(dataset, root: str) -> DatasetSource:
    if isinstance(dataset, dict):
        allowed = [f.name for f in fields(DatasetSource) if f.init and f.name != "root"]
        unknown = [k for k in dataset if k not in allowed]
        if unknown:
            raise SpecError(f"dataset.{unknown[0]}", f"unknown key; allowed: {', '.join(allowed)}")
        if "path" not in dataset:
            raise SpecError("dataset.path", "is required: a dataset name or a builder such as "
                                            "parquet, json or text")
        try:
            dataset = DatasetSource(**dataset, root=root)
        except SpecError as err:
            raise SpecError(f"dataset.{err.field}", err.message) from None
    if not isinstance(dataset, DatasetSource):
        raise SpecError("dataset", f"must be a mapping (path, name, split, column, data_files), "
                                   f"got {dataset!r}")
    return dataset

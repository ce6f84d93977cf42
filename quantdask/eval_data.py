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
import os
from dataclasses import dataclass, field

from quantdask.errors import SpecError

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
    # Read at import by `datasets`: set before it is first imported, and on its config after.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise SpecError("dataset", "needs the `datasets` package: pip install "
                                   "'quantdask[datasets]'") from None
    datasets.config.HF_DATASETS_OFFLINE = True
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

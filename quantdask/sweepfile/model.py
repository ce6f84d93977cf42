"""A model to quantize: where it is (a local directory or a hub id), its dtype, and the identity
that goes into job ids (a local checkpoint's fingerprint, so a changed checkpoint is a new job)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from quantdask.errors import SpecError
from quantdask.sweepfile.fields import NAME, require, resolve_root

DTYPES = ("auto", "float32", "bfloat16", "float16")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _fingerprint(directory: str) -> str:
    """A cheap content fingerprint of a model directory (no weights are read)."""
    digest = hashlib.sha256()
    with open(os.path.join(directory, "config.json"), "rb") as f:
        digest.update(f.read())
    for name in sorted(os.listdir(directory)):
        if name.endswith(_WEIGHT_SUFFIXES):
            size = os.path.getsize(os.path.join(directory, name))
            digest.update(f"{name}:{size}".encode())
    return digest.hexdigest()[:16]


def _safetensors_problem(path: str) -> str | None:
    """What is wrong with a safetensors file, from its header and size alone, or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"holds {size} bytes, less than a safetensors header"
        header_bytes = struct.unpack("<Q", head)[0]
        if 8 + header_bytes > size:
            return (f"its header claims {header_bytes:,} bytes but the file holds {size:,} "
                    "(incomplete metadata)")
        try:
            header = json.loads(f.read(header_bytes))
            end = max((int(entry["data_offsets"][1]) for key, entry in header.items()
                       if key != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError):
            return "its header is not a safetensors header (not the JSON it should be)"
    if 8 + header_bytes + end > size:
        return f"holds {size:,} bytes, but its tensors need {8 + header_bytes + end:,} (truncated)"
    return None


def check_model_files(directory: str, trust_remote_code: bool = False) -> None:
    """Refuse a model directory with a damaged config.json, a ``model_type`` the installed
    transformers does not know, or a cut-short safetensors file, reading only the config and
    the weight files' headers (cheap, on the driver), so that a broken checkpoint stops the
    sweep before a cluster starts instead of failing every job."""
    config = os.path.join(directory, "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            fields = json.load(f)
    except ValueError as err:
        raise SpecError("path", f"{config} is not valid JSON ({err}); restore the model's "
                                "config.json") from None
    _check_model_type(config, fields, trust_remote_code)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = set(json.load(f)["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SpecError("path", f"{index} is not a safetensors index (a JSON weight_map); "
                                    "restore it") from None
        missing = sorted(s for s in shards if not os.path.isfile(os.path.join(directory, s)))
        if missing:
            more = f" ({len(missing)} shards missing)" if len(missing) > 1 else ""
            raise SpecError("path", f"{index} lists {missing[0]}, which is not in "
                                    f"{directory}{more}; copy the whole checkpoint")
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(os.path.join(directory, name))
            if problem:
                raise SpecError("path", f"{os.path.join(directory, name)} {problem}; the file is "
                                        "damaged or incomplete: copy or download it again")


def _known_model_types(quick: bool) -> Any:
    """The model types transformers has a config class for. ``quick``: the generated table
    alone (``auto_mappings``, where transformers 5 keeps it), without the module that completes
    it (``configuration_auto``), which imports torch: 2.5 s of CPU for a command that never
    needs torch itself. A type missing from the quick table is looked up in the full one."""
    if quick:
        try:
            from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
        except ImportError:  # another layout: the full table
            return ()
        return CONFIG_MAPPING_NAMES
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return CONFIG_MAPPING_NAMES


def _check_model_type(config: str, fields: Any, trust_remote_code: bool) -> None:
    """Refuse a ``model_type`` the installed transformers has no class for (a model with its
    own code, ``auto_map``, is loaded with ``trust_remote_code: true`` instead)."""
    import transformers

    model_type = fields.get("model_type") if isinstance(fields, dict) else None
    if not isinstance(model_type, str) or model_type in _known_model_types(quick=True) \
            or model_type in _known_model_types(quick=False):
        return
    if trust_remote_code and "auto_map" in fields:
        return
    custom = (" or, for a model that ships its own code (auto_map), set trust_remote_code: "
              "true" if "auto_map" in fields else "")
    raise SpecError("path", f"{config} names model_type {model_type!r}, which the installed "
                            f"transformers {transformers.__version__} does not know: upgrade "
                            f"it (pip install -U transformers){custom}")


@dataclass(frozen=True)
class ModelSpec:
    """A model to quantize: a local directory (``path``) or a Hugging Face hub id (``hub``).

    Relative paths are resolved against ``root`` (the sweep file's directory, or the current one).
    """

    path: str | None = None
    hub: str | None = None
    name: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    root: str = field(default="", compare=False)

    def __post_init__(self):
        if (self.path is None) == (self.hub is None):
            raise SpecError("path", "give exactly one of `path` (a local model directory) "
                                    "or `hub` (a Hugging Face id such as org/name)")
        object.__setattr__(self, "root", resolve_root(self.root))
        if self.path is not None:
            require("path", self.path, str, "a directory path")
            if not os.path.isfile(os.path.join(self.location, "config.json")):
                raise SpecError("path", f"no model directory at {self.location} (a directory with "
                                        "config.json); fix the path, or use `hub:` for a hub id")
            check_model_files(self.location, self.trust_remote_code)
        else:
            hub: str = require("hub", self.hub, str, "a hub id such as org/name")
            if not _HUB_ID.match(hub):
                raise SpecError("hub", f"must be a hub id such as org/name, got {self.hub!r}")
        if self.name is not None and not (isinstance(self.name, str) and NAME.match(self.name)):
            raise SpecError("name", f"must be letters, digits, '.', '_' or '-', got {self.name!r}")
        if self.revision is not None:
            require("revision", self.revision, str, "a branch, tag or commit")
        if self.dtype not in DTYPES:
            raise SpecError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require("trust_remote_code", self.trust_remote_code, bool, "true or false")

    @property
    def location(self) -> str:
        """Where transformers loads it from: an absolute directory or the hub id."""
        return self.hub if self.hub else os.path.join(self.root, self._path())

    def _path(self) -> str:
        """``path``, which __post_init__ makes sure is set whenever ``hub`` is not."""
        if self.path is None:
            raise SpecError("path", "give `path` (a local model directory) or `hub`")
        return self.path

    @property
    def label(self) -> str:
        ref = self.hub or os.path.normpath(self._path())
        return self.name or os.path.basename(ref.rstrip("/"))

    def loaded_dtype(self) -> str | None:
        """The dtype its weights load in: ``dtype``, or for ``auto`` the one its config.json
        names (None: a hub model's, which the driver does not download, or a config that
        names none)."""
        if self.dtype != "auto":
            return self.dtype
        if self.hub:
            return None
        with open(os.path.join(self.location, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        named = config.get("dtype") or config.get("torch_dtype")
        return str(named) if named else None

    def identity(self) -> dict:
        """The fields that decide what the model is: for a local directory, its name and a
        fingerprint of its files (config.json's content, each weight file's name and size), so
        a model retrained in place gets new ids and the same model at two paths the same."""
        if self.hub:
            ref = {"hub": self.hub, "revision": self.revision}
        else:
            ref = {"path": os.path.basename(os.path.normpath(self._path())),
                   "fingerprint": _fingerprint(self.location)}
        return {**ref, "dtype": self.dtype, "trust_remote_code": self.trust_remote_code}

"""Task accuracy settings (a sweep's ``tasks:`` block): which lm-evaluation-harness tasks each
job runs on its quantized model in memory, and how.

lm-evaluation-harness is an optional extra (``pip install 'quantdask[tasks]'``): a sweep that
names tasks without it is refused here, before anything runs. So is a task lm-eval does not
know. Local tasks live in ``include_path`` folders (relative to the sweep file), one YAML per
task as lm-eval reads them; a ``dataset_kwargs.data_files`` path in such a YAML is relative to
the YAML's own folder (lm-eval alone would read it relative to the working directory), so a task
folder can be moved or shipped whole. Everything runs offline: a task whose data is not on
disk fails its jobs with the dataset library's error.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantdask.errors import SpecError
from quantdask.sweepfile.fields import positive_int, require, resolve_root

INSTALL_TASKS = "pip install 'quantdask[tasks]'"
"""What installs lm-evaluation-harness beside quantdask."""


def import_lm_eval(field_name: str = "tasks"):
    """The ``lm_eval`` module, or a SpecError naming ``field_name`` and the install command."""
    try:
        import lm_eval
    except ImportError as err:
        raise SpecError(field_name, f"task accuracy needs lm-evaluation-harness, which is not "
                                    f"installed ({err}): {INSTALL_TASKS}") from None
    return lm_eval


def task_manager(include_paths: tuple[str, ...], defaults: bool):
    """An lm-eval ``TaskManager`` over ``include_paths`` (and lm-eval's own tasks when
    ``defaults``: indexing those takes seconds, so it is skipped when every task is local);
    one per process and arguments, made again when a file under ``include_paths`` changed (a
    task added in a notebook's session is found)."""
    return _task_manager(include_paths, defaults, _fingerprint(include_paths))


@functools.lru_cache(maxsize=8)
def _task_manager(include_paths: tuple[str, ...], defaults: bool, fingerprint: tuple):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_paths) or None, include_defaults=defaults)


@dataclass(frozen=True)
class TaskFiles:
    """The text of every task file under a folder, and the names it gives tasks, groups and
    tags (for suggestions)."""

    text: bytes
    names: tuple[str, ...]


# A task:, group: or tag: line's value (the key quoted or not); a tag: line's block or flow
# list; an include: line's file.
_NAME = re.compile(rb"""^[ \t]*['"]?(?:task|group|tag)['"]?[ \t]*:[ \t]*['"]?([\w.\-()]+)""",
                   re.M)
_TAGS = re.compile(rb"""^[ \t]*['"]?tag['"]?[ \t]*:[ \t]*"""
                   rb"""(\[[^\]\n]*\]|\n(?:[ \t]*-[ \t]*\S+[ \t]*\n)+)""", re.M)
_INCLUDE = re.compile(rb"""^[ \t]*include[ \t]*:[ \t]*['"]?([^\s'"#]+)""", re.M)


def task_files(root: Path) -> TaskFiles:
    """Every YAML file under ``root`` as lm-eval's index walks them, and every file they
    include (some have no .yaml suffix), read as text. Each name lm-eval's index of ``root``
    holds (a task's, a group's, a tag's) is written in one of them, so a name found in none is
    not there."""
    to_read = [p for p in sorted(root.glob("**/*.yaml"))
               if not {"__pycache__", ".ipynb_checkpoints"} & set(p.parts)]
    texts: dict[Path, bytes] = {}
    while to_read:
        path = to_read.pop()
        if path in texts or not path.is_file():
            continue
        texts[path] = path.read_bytes()
        to_read += [path.parent / os.fsdecode(file) for file in _INCLUDE.findall(texts[path])]
    text = b"\n".join(texts.values())
    names = set(_NAME.findall(text))
    for items in _TAGS.findall(text):
        names.update(item.strip().lstrip(b"-").strip().strip(b"'\"")
                     for item in re.split(rb"[\n,]", items.strip(b"[] \n")) if item.strip())
    return TaskFiles(text, tuple(sorted(n.decode() for n in names - {b"null"})))


@functools.lru_cache(maxsize=1)
def builtin_task_files() -> TaskFiles:
    """lm-eval's own task files (about 0.3 s to read; its index of them takes seconds)."""
    import lm_eval.tasks

    return task_files(Path(lm_eval.tasks.__file__).parent)


def _fingerprint(folders: tuple[str, ...]) -> tuple:
    """Every file under ``folders`` with its size and modification time."""
    return tuple(sorted((str(path), path.stat().st_size, path.stat().st_mtime_ns)
                        for folder in folders for path in Path(folder).rglob("*")
                        if path.is_file()))


@dataclass(frozen=True)
class TaskSettings:
    """lm-eval tasks every job of the sweep runs on its quantized model (the baseline on the
    unquantized one, once per model).

    ``names``: lm-eval task (or group) names, built-in or from ``include_path`` (one folder or a
    list, relative to the sweep file). ``num_fewshot`` (None: each task's own default),
    ``limit`` (at most this many samples per task; None: all), ``seed`` (lm-eval's random,
    numpy, torch and few-shot seeds) and ``max_length`` (the longest input in tokens; None: the
    model's own, from its config) decide the scores and are part of the job ids, with a digest
    of each local task's YAML and data files (a built-in task's: lm-eval's version).
    ``batch_size`` only groups the same requests.
    """

    names: list[str]
    include_path: str | list[str] | None = None
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 16
    seed: int = 1234
    max_length: int | None = None
    root: str = field(default="", compare=False)
    include_paths: tuple[str, ...] = field(default=(), init=False)
    digests: dict[str, str] = field(default_factory=dict, init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "root", resolve_root(self.root))
        require("names", self.names, (list, tuple), "a non-empty list of lm-eval task names")
        if not self.names:
            raise SpecError("names", "is empty; give at least one lm-eval task name")
        for i, name in enumerate(self.names):
            require(f"names[{i}]", name, str, "an lm-eval task name")
        if len(set(self.names)) != len(self.names):
            raise SpecError("names", f"names a task twice: {list(self.names)}")
        object.__setattr__(self, "names", tuple(self.names))
        if self.num_fewshot is not None:
            require("num_fewshot", self.num_fewshot, int, "an integer >= 0 (or null)")
            if self.num_fewshot < 0:
                raise SpecError("num_fewshot", f"must be >= 0, got {self.num_fewshot}")
        if self.limit is not None:
            positive_int("limit", self.limit, "a positive number of samples per task (or null)")
        positive_int("batch_size", self.batch_size)
        require("seed", self.seed, int, "an integer")
        if self.max_length is not None:
            positive_int("max_length", self.max_length, "a positive number of tokens (or null)")
        object.__setattr__(self, "include_paths", self._checked_paths())
        if isinstance(self.include_path, list):  # a Job holding these must stay hashable
            object.__setattr__(self, "include_path", tuple(self.include_path))
        import_lm_eval("")  # the field is the block itself (sweep files: tasks)
        object.__setattr__(self, "digests", self._digests())

    def _checked_paths(self) -> tuple[str, ...]:
        given = self.include_path
        if given is None:
            return ()
        paths = [given] if isinstance(given, str) else given
        require("include_path", paths, (list, tuple), "a folder or a list of folders")
        resolved = []
        for i, path in enumerate(paths):
            where = "include_path" if isinstance(given, str) else f"include_path[{i}]"
            require(where, path, str, "a folder of lm-eval task YAML files")
            full = os.path.join(self.root, path)
            if not os.path.isdir(full):
                raise SpecError(where, f"{full} is not a folder; give a folder of lm-eval task "
                                       "YAML files (relative to the sweep file)")
            resolved.append(str(Path(full).resolve()))  # as lm-eval's index holds them
        return tuple(resolved)

    def _local_index(self) -> dict:
        """lm-eval's index of the ``include_path`` folders alone ({} without any)."""
        return task_manager(self.include_paths, False).task_index if self.include_paths else {}

    def manager(self):
        """The lm-eval TaskManager that finds every named task (the built-in index only when
        some name is not local)."""
        local = self._local_index()
        return task_manager(self.include_paths,
                            not (local and all(name in local for name in self.names)))

    def _digests(self) -> dict[str, str]:
        """Per task, what its score depends on besides the settings: for a local one (its YAML
        under ``include_path``), a sha256 of every file in the YAML's folder (includes,
        ``!function`` helpers) and of the data files it names; for a built-in one, lm-eval's
        version. Unknown names, and a local task whose data files are missing, are refused."""
        import lm_eval

        local_index = self._local_index()
        for i, name in enumerate(self.names):
            # A name in no built-in task file is refused without lm-eval's built-in index, which
            # takes seconds to build (a typo is told at once).
            if name not in local_index and name.encode() not in builtin_task_files().text:
                raise self._unknown(i, name, [*local_index, *builtin_task_files().names])
        index = self.manager().task_index
        digests = {}
        for i, name in enumerate(self.names):
            entry = index.get(name)
            if entry is None:
                raise self._unknown(i, name, list(index))
            if not self._is_local(entry):
                digests[name] = f"lm-eval {lm_eval.__version__}"
                continue
            folder = Path(entry.yaml_path).parent
            files = sorted(p for p in folder.iterdir() if p.is_file())
            config = self.local_config(entry) or {}
            local = [f for f in data_files(config) if "://" not in f]
            missing = [f for f in local if not os.path.isfile(f)]
            if missing:
                raise SpecError(f"names[{i}]", f"the local task {name!r} names data files that "
                                f"are not there: {', '.join(missing)} (data_files are "
                                f"relative to {folder})")
            sha = hashlib.sha256()
            for path in [*files, *map(Path, local)]:
                sha.update(str(path.name).encode() + b"\0" + path.read_bytes())
            digests[name] = sha.hexdigest()
        return digests

    def _unknown(self, i: int, name: str, known: list[str]) -> SpecError:
        import lm_eval

        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return SpecError(f"names[{i}]", f"no lm-eval task or group is named {name!r} (lm-eval "
                                        f"{lm_eval.__version__}, include_path: "
                                        f"{list(self.include_paths) or 'none'}){hint}")

    def _is_local(self, entry) -> bool:
        yaml_path = getattr(entry, "yaml_path", None)
        return yaml_path is not None and any(
            Path(yaml_path).resolve().is_relative_to(p) for p in self.include_paths)

    def local_config(self, entry) -> dict[str, Any] | None:
        """A local task's full config (includes merged) with its ``data_files`` made absolute
        against the YAML's folder; None for a built-in task or group, which lm-eval loads by
        name."""
        from lm_eval.tasks._index import Kind
        from lm_eval.tasks._yaml_loader import load_yaml

        if entry.kind != Kind.TASK or not self._is_local(entry):
            return None
        yaml_path = entry.yaml_path
        config = load_yaml(yaml_path, resolve_func=True)
        kwargs = dict(config.get("dataset_kwargs") or {})
        if "data_files" in kwargs:
            kwargs["data_files"] = _absolute(kwargs["data_files"], Path(yaml_path).parent)
            config["dataset_kwargs"] = kwargs
        return config

    def task_configs(self) -> dict[str, dict[str, Any]]:
        """Every task the block scores, its groups and tags opened, by name: its config as
        lm-eval's index holds it (includes merged; no dataset is read). For checks that need
        what a task asks of the model (its ``output_type``, its ``generation_kwargs``)."""
        from lm_eval.tasks._index import Kind

        index = self.manager().task_index
        found: dict[str, dict[str, Any]] = {}
        waiting: list[Any] = list(self.names)
        while waiting:
            name = waiting.pop(0)
            if isinstance(name, dict):  # a group's task given inline
                found.setdefault(str(name.get("task", "?")), name)
                continue
            entry = index.get(name)
            if entry is None or name in found:
                continue
            if entry.kind == Kind.TASK:
                found[name] = dict(entry.cfg or {})
            elif entry.kind == Kind.GROUP:
                members = (entry.cfg or {}).get("task") or []
                waiting.extend([members] if isinstance(members, str) else members)
                found[name] = {}  # a group scores nothing of its own
            else:  # a tag: the tasks that carry it
                waiting.extend(sorted(entry.tags or ()))
                found[name] = {}
        return {name: config for name, config in found.items() if config}

    def specs(self) -> list[str | dict[str, Any]]:
        """What ``lm_eval.simple_evaluate`` gets as ``tasks``: a local task's config, else its
        name."""
        index = self.manager().task_index
        return [self.local_config(index[name]) or name for name in self.names]

    def identity(self) -> dict:
        # batch_size only groups the same requests.
        return {"names": list(self.names), "num_fewshot": self.num_fewshot, "limit": self.limit,
                "seed": self.seed, "max_length": self.max_length, "digests": self.digests}


def _absolute(files: Any, folder: Path) -> Any:
    """``data_files`` (a path, a list, or split -> paths) with each relative path made
    absolute against ``folder``."""
    if isinstance(files, str):
        return files if os.path.isabs(files) or "://" in files else str(folder / files)
    if isinstance(files, (list, tuple)):
        return [_absolute(f, folder) for f in files]
    if isinstance(files, dict):
        return {split: _absolute(f, folder) for split, f in files.items()}
    return files


def data_files(config: dict[str, Any]) -> list[str]:
    """Every path a task config's ``dataset_kwargs.data_files`` names."""
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        files = list(files.values())
    return [f for item in files or [] for f in ([item] if isinstance(item, str) else item)]

"""A backend's options: one frozen dataclass per backend, each field declared once with the
:class:`Option` that validates it and its default.

>>> from dataclasses import dataclass
>>> @dataclass(frozen=True)
... class RtnOptions(BackendOptions):
...     bits: int | None = option(int, choices=(3, 4, 8), default=4, help="bits per weight")
...     skip_modules: tuple[str, ...] | None = skip_modules_option()
>>> RtnOptions.declared()["bits"].default
4
>>> RtnOptions(bits=4, skip_modules=["lm_head"]).as_dict()
{'bits': 4, 'skip_modules': ['lm_head']}
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, KeysView, Mapping
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any, Self

from quantdask.errors import SpecError

LM_HEAD = ("lm_head",)
"""The modules the backends leave unquantized unless told otherwise: the output head."""

_OPTION = "option"  # the key of a field's metadata holding its Option


@dataclass(frozen=True)
class Option:
    """One option a backend accepts.

    ``kind`` is the Python type values must have; ``choices`` (if given) the allowed values;
    ``check`` an extra predicate with ``check_hint`` saying what it requires; ``default`` what a
    config that leaves the option out gets (None: nothing, unless the backend's ``complete``
    fills it from the other options).
    """

    kind: type | tuple[type, ...]
    default: Any = None
    choices: tuple = ()
    check: Callable[[Any], bool] | None = None
    check_hint: str = ""
    help: str = ""

    def validate(self, name: str, value: Any) -> Any:
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        # bool is an int in Python; a YAML `true` must not pass as bits=1.
        if isinstance(value, bool) and bool not in kinds:
            raise SpecError(name, f"must be {_kind_names(kinds)}, got {value!r}")
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds):
            raise SpecError(name, f"must be {_kind_names(kinds)}, got {value!r}")
        if self.choices and value not in self.choices:
            allowed = " or ".join(repr(c) for c in self.choices)
            raise SpecError(name, f"must be {allowed}, got {value!r}")
        if self.check is not None and not self.check(value):
            raise SpecError(name, f"{self.check_hint}, got {value!r}")
        return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             list: "a list", tuple: "a list", dict: "a mapping"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def option(kind: type | tuple[type, ...], *, default: Any = None, choices: tuple = (),
           check: Callable[[Any], bool] | None = None, check_hint: str = "",
           help: str = "") -> Any:
    """A field of a :class:`BackendOptions` dataclass, validated by the :class:`Option` these
    arguments make. The field itself is None (unset) until ``Backend.normalize`` fills in
    ``default``, so that ``complete`` can tell an option given from one left out.

    >>> option(int, choices=(4, 8)).metadata["option"].choices
    (4, 8)
    """
    spec = Option(kind, default, tuple(choices), check, check_hint, help)
    return field(default=None, metadata={_OPTION: spec})


def skip_modules_option(default: tuple[str, ...] | None = LM_HEAD, shown: str = "lm_head") -> Any:
    """The ``skip_modules`` field the backends share: module names left unquantized
    (``shown`` is how its help names the default)."""
    return option(list, default=default, check=lambda v: all(isinstance(m, str) and m for m in v),
                  check_hint="must be a list of module names",
                  help=f"modules left unquantized (default: {shown})")


@dataclass(frozen=True)
class BackendOptions:
    """The base of a backend's options: a frozen dataclass with one field per option, each
    declared with :func:`option`, None where unset. Hashable (lists are held as tuples);
    :meth:`as_dict` is the canonical dict that job ids hash and the ``config`` column holds.

    For backends written against dicts, ``options["bits"]``, ``options.get("bits")``,
    ``"bits" in options`` and ``dict(options)`` read the fields as :meth:`as_dict` gives them.

    >>> BackendOptions().as_dict()
    {}
    """

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list | dict):
                object.__setattr__(self, f.name, _frozen(value))

    @classmethod
    def declared(cls) -> dict[str, Option]:
        """Each option's name and :class:`Option`, in the order the fields are declared."""
        plain = [f.name for f in fields(cls) if _OPTION not in f.metadata]
        if plain:
            raise TypeError(f"{cls.__name__}.{plain[0]} is a plain field; declare it with "
                            "quantdask.backends.options.option(kind, ...)")
        return {f.name: f.metadata[_OPTION] for f in fields(cls)}

    def as_dict(self) -> dict[str, Any]:
        """The options set, by sorted name, with tuples as the lists and frozen mappings as
        the dicts a config gives."""
        values = sorted((f.name, getattr(self, f.name)) for f in fields(self))
        return {name: _thawed(value) for name, value in values if value is not None}

    def complete(self) -> Self:
        """The option set as every hook receives it: impossible combinations refused with a
        :class:`~quantdask.errors.SpecError` named as in the config (``SpecError("group_size",
        "...")``; ``Backend.normalize`` prefixes where it is), and the defaults that depend on
        other options filled (:meth:`with_defaults`). Called at spec time, after each option is
        checked and the declared defaults filled; what it returns is what the job id hashes,
        so it must be deterministic. Default: unchanged."""
        return self

    def batch_dependent(self) -> bool:
        """Whether the quantized model's figures depend on which eval windows share a forward
        pass (LLM.int8 picks its outlier columns per pass): an out-of-memory retry then keeps
        the eval batch, so that its figures stay comparable. Default: they do not."""
        return False

    def with_defaults(self, **defaults: Any) -> Self:
        """A copy with each of ``defaults`` that is unset here set (for ``complete``)."""
        return replace(self, **{name: value for name, value in defaults.items()
                                if getattr(self, name) is None})

    def given(self, *names: str) -> list[str]:
        """Those of ``names`` that are set."""
        return [name for name in names if getattr(self, name) is not None]

    def __getitem__(self, name: str) -> Any:
        try:
            return self.as_dict()[name]
        except KeyError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return self.as_dict().get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self.as_dict()

    def keys(self) -> KeysView[str]:
        return self.as_dict().keys()


class FrozenMapping(dict):
    """A mapping option's value as the options hold it: hashable (by its sorted items), its
    values frozen too. Read it like a dict; it is not meant to be changed."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return FrozenMapping({key: _frozen(v) for key, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _thawed(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _thawed(v) for key, v in sorted(value.items())}
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


def options_class(backend: str, declared: Mapping[str, Option]) -> type[BackendOptions]:
    """The :class:`BackendOptions` dataclass of options declared as a dict of :class:`Option`
    (how a backend of one's own may still declare them).

    >>> options_class("my-rtn", {"bits": Option(int)})(bits=4)
    MyRtnOptions(bits=4)
    """
    if not isinstance(declared, Mapping):
        raise TypeError(f"backend {backend!r}: options must be a BackendOptions dataclass or a "
                        f"dict of option name to Option, got {declared!r}")
    for name, spec in declared.items():
        if (not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name)
                or hasattr(BackendOptions, name)):
            raise ValueError(f"backend {backend!r}: option name {name!r} must be a Python "
                             "identifier other than a keyword or a BackendOptions attribute")
        if not isinstance(spec, Option):
            raise TypeError(f"backend {backend!r}: option {name!r} must be an Option, "
                            f"got {spec!r}")
    words = re.findall(r"[A-Za-z0-9]+", backend)
    cls = make_dataclass("".join(w[:1].upper() + w[1:] for w in words) + "Options",
                         [(name, Any, field(default=None, metadata={_OPTION: spec}))
                          for name, spec in declared.items()],
                         bases=(BackendOptions,), frozen=True)
    cls.__module__ = __name__  # no module holds it: pickles by value (cloudpickle), not by name
    return cls

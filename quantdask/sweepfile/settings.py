"""How a sweep measures and keeps: the eval (windows, reference top-k), the calibration text of
calibrated backends, and where done jobs' quantized models are saved."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

from quantdask.errors import SpecError
from quantdask.sweepfile.bos import BOS_RULES
from quantdask.sweepfile.fields import positive_int, require, resolve_root
from quantdask.sweepfile.text_source import DatasetSource, TextSource
from quantdask.words import ArtifactKeep

DEFAULT_KL_TOP_K = 64
"""The reference's tokens per position for KL (eval.kl_top_k), chosen by measurement: see
benchmarks/kl_top_k.py and its figures in benchmarks/RESULTS.md."""
DEFAULT_KL_TAIL_SAMPLES = 64
"""Tokens per position sampled from the reference's tail, beyond its top k, for an unbiased
estimate of the tail's share of the KL (eval.kl_tail_samples; 0: the tail as one bucket, a
lower bound). Chosen by measurement: benchmarks/kl_top_k.py."""


REFERENCE_DTYPES = ("float32", "model")
"""``eval.reference_dtype``'s values."""


@dataclass(frozen=True)
class EvalSettings(TextSource):
    """Perplexity evaluation: ``samples`` windows of ``seq_len`` tokens from the eval text,
    which is a UTF-8 text file (``text``) or a ``datasets`` dataset's text column
    (``dataset``: see :class:`~quantdask.sweepfile.text_source.DatasetSource`; read locally only).

    ``kl_top_k``: KL divergence exact over the reference's ``k`` most likely tokens at each
    position, and over the rest of the vocabulary estimated without bias from
    ``kl_tail_samples`` tokens sampled from it (0: the rest as one bucket, a lower bound; see
    ``QualityMeter``); or ``"all"`` for the exact figure over the whole vocabulary (a reference
    of samples x seq_len x vocab floats).

    ``bos``: whether each window starts with the model's beginning-of-sequence token (``auto``,
    ``always`` or ``never``; ``sweepfile.bos``). A window with one is the BOS and
    ``seq_len`` - 1 tokens of text, the text encoded without special tokens; the BOS position
    is never scored. ``bos_token_id`` is the rule resolved for one model (``Sweep.eval_for``):
    None, the text cut as the tokenizer encodes it.

    ``reference_dtype``: what the reference's log-probs are computed in for a model that loads
    in 16 bits (bfloat16 or float16): ``float32`` (default; llama.cpp computes its activations
    in float32, and a 16-bit reference's own rounding would land in every KL) or ``model``
    (the model's own dtype: half the reference's memory). ``reference_float32`` is it resolved
    for one model (``Sweep.eval_for``): then the baseline job runs the model in its own dtype
    against that reference, and its KL is the noise floor of the model's dtype."""

    text: str | None = None
    seq_len: int = 128
    samples: int = 32
    batch_size: int = 8
    kl_top_k: int | str = DEFAULT_KL_TOP_K
    kl_tail_samples: int = DEFAULT_KL_TAIL_SAMPLES
    dataset: DatasetSource | dict | None = None
    bos: str = "auto"
    reference_dtype: str = "float32"
    root: str = field(default="", compare=False)
    text_sha256: str = field(default="", init=False)
    # Resolved per model (with_bos), never written in a sweep file (an init field, so that
    # dataclasses.replace keeps it: a retry's smaller batch measures the same windows).
    bos_token_id: int | None = field(default=None, metadata={"resolved": True})
    reference_float32: bool = field(default=False, metadata={"resolved": True})

    def __post_init__(self):
        object.__setattr__(self, "root", resolve_root(self.root))
        self._read_source("eval text")
        positive_int("seq_len", self.seq_len)
        if self.seq_len < 2:
            raise SpecError("seq_len", f"must be at least 2 tokens, got {self.seq_len}")
        positive_int("samples", self.samples)
        positive_int("batch_size", self.batch_size)
        if self.kl_top_k != "all":
            positive_int("kl_top_k", self.kl_top_k,
                          f"a number of tokens such as {DEFAULT_KL_TOP_K}, or all")
        if isinstance(self.kl_tail_samples, bool) or not isinstance(self.kl_tail_samples, int) \
                or self.kl_tail_samples < 0:
            raise SpecError("kl_tail_samples", f"must be a number of tokens >= 0 such as "
                                               f"{DEFAULT_KL_TAIL_SAMPLES} (0: a lower bound), "
                                               f"got {self.kl_tail_samples!r}")
        if self.bos not in BOS_RULES:
            raise SpecError("bos", f"must be {', '.join(BOS_RULES)} (auto: a BOS token at the "
                                   "start of every window where the model's tokenizer adds "
                                   f"one), got {self.bos!r}")

        if self.reference_dtype not in REFERENCE_DTYPES:
            raise SpecError("reference_dtype", f"must be {' or '.join(REFERENCE_DTYPES)} "
                                               "(float32: a 16-bit model's reference computed "
                                               "in float32; model: in its own dtype), got "
                                               f"{self.reference_dtype!r}")

    def with_bos(self, token_id: int | None, reference_float32: bool = False) -> EvalSettings:
        """These settings for a model whose windows each start with ``token_id`` (None: the
        text as tokenized) and whose reference is computed in float32 where
        ``reference_float32``. A copy, not ``dataclasses.replace``: that would read the text
        again."""
        resolved = copy.copy(self)
        object.__setattr__(resolved, "bos_token_id", token_id)
        object.__setattr__(resolved, "reference_float32", reference_float32)
        return resolved

    @property
    def top_k(self) -> int | None:
        """The reference's tokens per position (None: every token, exact KL)."""
        # __post_init__ allows only "all" or a positive int.
        return None if isinstance(self.kl_top_k, str) else self.kl_top_k

    def identity(self) -> dict:
        # batch_size only changes how the same tokens are grouped, not what is measured. The
        # exact KL (all) is what every run measured before kl_top_k: its jobs keep their ids.
        identity = {"text_sha256": self.text_sha256, "seq_len": self.seq_len,
                    "samples": self.samples}
        if self.top_k is not None:
            identity["kl_top_k"] = self.top_k
            if self.kl_tail_samples:  # 0 is what every run measured before the tail samples
                identity["kl_tail_samples"] = self.kl_tail_samples
        if self.bos_token_id is not None:  # no BOS inserted is what every run measured before
            identity["bos_token_id"] = self.bos_token_id
        if self.reference_float32:  # a reference in the model's dtype is what runs had before
            identity["reference_dtype"] = "float32"
        return identity

    @property
    def tail_samples(self) -> int:
        """Tokens sampled per position from the reference's tail (0 with an exact reference)."""
        return 0 if self.top_k is None else self.kl_tail_samples


@dataclass(frozen=True)
class CalibrationSettings(TextSource):
    """Calibration data for the backends that fit their quantization to it (``calibrated``
    backends such as AutoRound): ``samples`` windows of ``seq_len`` tokens at offsets drawn with
    ``seed`` from a UTF-8 text file (``text``) or a local dataset's text column (``dataset``, as
    for the eval). Tokenized once per model with its reference; its content, samples, seq_len
    and seed are part of the calibrated jobs' ids (no other job's id changes)."""

    text: str | None = None
    dataset: DatasetSource | dict | None = None
    samples: int = 128
    seq_len: int = 2048
    seed: int = 0
    root: str = field(default="", compare=False)
    text_sha256: str = field(default="", init=False)

    def __post_init__(self):
        object.__setattr__(self, "root", resolve_root(self.root))
        self._read_source("calibration text")
        positive_int("samples", self.samples)
        positive_int("seq_len", self.seq_len)
        if self.seq_len < 2:
            raise SpecError("seq_len", f"must be at least 2 tokens, got {self.seq_len}")
        require("seed", self.seed, int, "an integer")
        if not 0 <= self.seed < 2**63:
            raise SpecError("seed", f"must be between 0 and 2**63 - 1, got {self.seed}")

    def identity(self) -> dict:
        return {"text_sha256": self.text_sha256, "samples": self.samples,
                "seq_len": self.seq_len, "seed": self.seed}


@dataclass(frozen=True)
class ArtifactSettings:
    """Whether and where done jobs' quantized models are kept (see the module). ``shared``:
    the user's word that a local ``to`` is on storage every worker machine sees (needed when
    the workers may be on other machines: ``--scheduler``, a client of a scheduler reached by
    address; see ``Sweep.check_workers``)."""

    keep: ArtifactKeep = ArtifactKeep.NONE
    to: str | None = None
    verify: bool = False
    required: bool = False
    shared: bool = False
    root: str = field(default="", compare=False)

    def __post_init__(self):
        if self.keep not in tuple(ArtifactKeep):
            raise SpecError("keep", f"must be one of {', '.join(ArtifactKeep)}, got {self.keep!r}")
        object.__setattr__(self, "keep", ArtifactKeep(self.keep))
        for name in ("verify", "required", "shared"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.keep != ArtifactKeep.NONE and not (isinstance(self.to, str) and self.to):
            raise SpecError("to", f"is required with keep: {self.keep}: a directory, or an "
                                  "fsspec URL such as s3://bucket/prefix")
        object.__setattr__(self, "root", os.path.abspath(self.root or "."))
        if self.enabled and self.to is not None and self.is_url:
            _check_filesystem(self.to)

    @property
    def enabled(self) -> bool:
        return self.keep != ArtifactKeep.NONE

    @property
    def is_url(self) -> bool:
        return "://" in (self.to or "")

    def location(self, job_id: str) -> str:
        """Where ``job_id``'s artifact goes: a local path or a URL."""
        if self.to is None:
            raise SpecError("to", f"is not set (keep: {self.keep}): artifacts have no location")
        if self.is_url:
            return f"{self.to.rstrip('/')}/{job_id}"
        return os.path.join(self.root, self.to, job_id)


def _check_filesystem(url: str) -> None:
    """Refuse an fsspec URL whose filesystem cannot load here (s3:// without s3fs, say),
    before any job saves to it: a failed save only records the error on each job."""
    protocol = url.split("://", 1)[0]
    try:
        import fsspec

        fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        raise SpecError("to", f"{url} needs a filesystem package that is not installed "
                              f"({err}): install it (pip install s3fs for s3://, gcsfs for "
                              "gs://, adlfs for az://) on the driver and every worker") from None
    except ValueError as err:
        raise SpecError("to", f"{url}: {err}; give a directory or an fsspec URL such as "
                              "s3://bucket/prefix") from None

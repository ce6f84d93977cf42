"""The exceptions quantdask raises. Each carries the data a caller needs to act on it."""

from __future__ import annotations


class QuantdaskError(Exception):
    """Base class for every error quantdask raises on purpose."""


class SpecError(QuantdaskError, ValueError):
    """A sweep or argument is invalid. Raised before any job runs.

    ``field`` is the dotted path of the offending value (``backends[0].grid.bits``) and the message
    says what is allowed, so a user can fix the file without reading code.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class LengthError(SpecError):
    """A sweep asks a model for more positions than it takes: refused before any job runs.

    ``too_long`` lists (field, what is asked in words, tokens, model label, the model's limit,
    where the limit comes from); the first one's field is the error's ``field``, and every
    one is in the message.
    """

    def __init__(self, too_long: list[tuple[str, str, int, str, int, str]]):
        self.too_long = too_long
        parts = [f"{asked}{tokens:,} tokens, but model {model!r} takes at most {limit:,} "
                 f"positions ({source}): give {limit:,} or fewer"
                 for _, asked, tokens, model, limit, source in too_long]
        also = "".join(f"; also {entry[0]}: {part}"
                       for entry, part in zip(too_long[1:], parts[1:]))
        super().__init__(too_long[0][0], parts[0] + also)


class UnsupportedHere(QuantdaskError):
    """A job cannot run here (backend missing, needs CUDA, ...): it is skipped, not retried."""


class JobTimeout(QuantdaskError):
    """An attempt (or a model's reference) ran past its ``timeout_s``: failure class ``timeout``.

    Raised on the worker when the work ends after its deadline (its result is discarded, so a
    deadline means the same however soon the driver looks); the driver records the same class
    when it cuts a hung attempt.
    """

    def __init__(self, what: str, elapsed_s: float, timeout_s: float):
        self.what, self.elapsed_s, self.timeout_s = what, elapsed_s, timeout_s
        super().__init__(f"{what} ran {elapsed_s:.3g}s, past timeout_s={timeout_s:g}s; "
                         "its result was discarded")


class SchemaError(QuantdaskError):
    """A result record does not match the results schema; it is never persisted."""


class RunDirError(QuantdaskError):
    """The run directory cannot be used (not a directory, unreadable results, ...)."""


class CompareError(QuantdaskError):
    """Two runs cannot be compared (a missing or half-written run directory, no job in common,
    a malformed gate, scipy missing): raised before anything is compared; nothing is written
    into either run."""


class PlacementError(QuantdaskError):
    """Some jobs fit on no worker's device: raised before any job runs.

    ``too_big`` lists (job id, job label, estimated bytes, what the estimate rests on, what
    sets its peak: the phase and why, or ""); ``largest`` is the most device memory a worker
    advertises, ``largest_worker`` its name, ``offer`` how a CPU slot's figure is made.
    """

    def __init__(self, too_big: list[tuple[str, str, int, str, str]], largest: float,
                 largest_worker: str, offer: str = ""):
        from quantdask.util import format_bytes

        self.too_big, self.largest, self.largest_worker = too_big, largest, largest_worker
        lines = [f"  {label} ({job_id}): needs ~{format_bytes(need)} = {need:,} bytes ({basis})"
                 + (f", its peak in {peak}" if peak else "")
                 for job_id, label, need, basis, peak in too_big]
        super().__init__(
            f"{len(too_big)} job(s) fit on no worker: the largest device memory a worker "
            f"advertises is {format_bytes(int(largest))} = {int(largest):,} bytes (worker "
            f"{largest_worker}{': ' + offer if offer else ''}):\n"
            + "\n".join(lines)
            + "\nfix: add a worker with a larger GPU, lower eval.batch_size or eval.seq_len "
              "(speed.batch_sizes, speed.prompt_length or speed.new_tokens where the peak is "
              "time_generation), or remove those configs"
            + (", or give the CPU slots a larger memory limit (quantdask run --memory-limit, "
               "start_cluster(memory_limit=...))" if offer else "")
            + "; nothing was run or changed")

"""Domain errors. None of them knows about HTTP: server/errors.py maps each
class to a status code and OpenAI's error envelope."""

from __future__ import annotations


class MolaError(Exception):
    """Base class of every error mola raises on purpose.

    ``param`` names the request field at fault, when there is one.
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(MolaError):
    """The base model cannot be found or loaded (or converted)."""


class SlotsDoNotFit(ModelLoadError):
    """The adapter slots asked for (--max-loras, --max-lora-rank, the expert
    slots) take more memory than the machine has free beside the base."""


class PacksDoNotFit(MolaError):
    """Loading an adapter would grow the slot packs (mola.lora.pack) past the
    memory free beside the base model and the KV budget."""


class InvalidRequest(MolaError):
    """A request whose body or parameters cannot be served as given."""


class ModelNotFound(MolaError):
    """The ``model`` of a request names neither the base model nor an adapter."""

    def __init__(self, model_id: str, *, param: str | None = "model"):
        super().__init__(f"The model '{model_id}' does not exist.", param=param)
        self.model_id = model_id


class InvalidAdapterName(InvalidRequest):
    """A name given to an adapter breaks the adapter id grammar (mola/registry/names.py)."""
class ResponseNotFound(MolaError):
    """A ``previous_response_id`` (or GET /v1/responses/{id}) names no stored
    response: unknown, stored with ``store: false``, or evicted."""


class AdapterNotFound(MolaError):
    """An adapter route names an adapter the registry does not know."""

    def __init__(self, name: str):
        super().__init__(f"The adapter '{name}' is not loaded.", param="name")
        self.name = name


class AdapterExists(MolaError):
    """A load names an adapter (or the base model) that is already served."""

    def __init__(self, name: str):
        super().__init__(
            f"An adapter or model named '{name}' is already served; unload it first.",
            param="name",
        )
        self.name = name


class AdapterDirExists(MolaError):
    """A push asks to be persisted where a directory no push wrote already is."""


class PersistFailed(MolaError):
    """A push's adapter directory could not be written (the disk refused it)."""


class AdapterPathNotFound(MolaError):
    """The path given for an adapter does not exist."""


class AdapterPathNotAllowed(MolaError):
    """The adapter path lies outside the directories adapters may come from
    (mola/registry/sources.py)."""


class InvalidAdapter(MolaError):
    """An adapter's files exist but cannot be applied exactly to the base model:
    broken config, unsupported fine-tune type, rank too high, unknown modules,
    shapes that do not fit, non-finite values."""


class AdapterRankTooHigh(InvalidAdapter):
    """An adapter (or a stack of adapters) exceeds --max-lora-rank."""


class ContextLengthExceeded(InvalidRequest):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


class KVBudgetExceeded(InvalidRequest):
    """A prompt (plus the tokens asked for) needs more KV cache than the
    server's whole KV budget (--kv-cache-bytes) holds."""


class BaseBusy(MolaError):
    """An unload names a base with requests in flight, or one pinned."""


class EngineUnavailable(MolaError):
    """The engine thread is not running (still loading, stopped, or died)."""


class Overloaded(MolaError):
    """The queue is full (--max-queue): try again later."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(MolaError):
    """The server is draining for shutdown and takes no new generations."""


class RequestTimedOut(MolaError):
    """A request waited in the queue past --request-timeout."""


class TrainError(MolaError):
    """`mola train` cannot go on: bad data, output path, model or setting."""


class DataError(TrainError):
    """A data file is missing, unreadable or not in a format mlx-lm reads."""


class OutputPathError(TrainError):
    """The output path cannot take the adapter."""


class DistillError(TrainError):
    """`mola distill` cannot go on: no prompts, a prompt too long, a teacher that does not fit."""

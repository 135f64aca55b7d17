"""Typed errors. Each names the tensor, field or argument at fault and what was expected.

MetraleError, ShapeError and KernelUnavailableError are defined beside the kernels (pallas_kernels.errors, which
imports nothing from this package) and are the same classes here."""

from pallas_kernels.errors import KernelUnavailableError, MetraleError, ShapeError  # noqa: F401  (re-exported)


class ConfigError(MetraleError, ValueError):
    """A config.json field, lever or environment variable is missing, unknown or inconsistent."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class CheckpointError(MetraleError, ValueError):
    """A checkpoint is missing tensors, has unexpected ones, or has mis-shaped / mis-typed ones."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(f"checkpoint has {len(self.problems)} problem(s):\n  {lines}")


class WeightFormatError(MetraleError, ValueError):
    """A weight container has the wrong tag, dtype or scale shape for the arm it is installed in."""


class PoolExhaustedError(MetraleError, RuntimeError):
    """Every slot of a state pool is in use."""


class SlotError(MetraleError, ValueError):
    """A slot index is out of range, reserved, or not allocated."""


class RequestError(MetraleError, KeyError):
    """A request id the engine does not hold, or whose request has not finished (pop); a KeyError too, as a lookup."""

    def __str__(self) -> str:                              # KeyError's own str quotes the message
        return str(self.args[0]) if self.args else ""


class NonFiniteError(MetraleError, ArithmeticError):
    """A computed value (a logit, a log-prob) is NaN or infinite: the weights or the inputs are broken."""


class ModelNotFoundError(MetraleError, FileNotFoundError):
    """A model name that is neither a checkpoint directory nor a hub repository in the local cache or downloadable."""

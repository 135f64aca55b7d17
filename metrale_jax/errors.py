"""Typed errors. Each names the tensor, field or argument at fault and what was expected."""


class MetraleError(Exception):
    """Base of every error this library raises on purpose."""


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


class ShapeError(MetraleError, ValueError):
    """An input array to an entry point has the wrong shape or dtype."""


class KernelUnavailableError(MetraleError, RuntimeError):
    """A kernel an arm or entry point needs did not resolve on this backend."""


class PoolExhaustedError(MetraleError, RuntimeError):
    """Every slot of a state pool is in use."""


class SlotError(MetraleError, ValueError):
    """A slot index is out of range, reserved, or not allocated."""


class NonFiniteError(MetraleError, ArithmeticError):
    """A computed value (a logit, a log-prob) is NaN or infinite: the weights or the inputs are broken."""

"""Weight containers, checkpoint reading and quantizing."""

from metrale_jax.weights.containers import DenseWeight, WeightQuantFormat, as_dense  # noqa: F401

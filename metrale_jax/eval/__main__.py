"""`python -m metrale_jax.eval [run] --model metrale-jax --model_args pretrained=DIR,... --tasks ...`: the
lm-evaluation-harness command line (all its options) with the `metrale-jax` model registered first."""

import metrale_jax.eval.lm_eval_adapter  # noqa: F401  (registers the model)
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()

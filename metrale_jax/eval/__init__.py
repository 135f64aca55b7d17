"""Evaluation with the lm-evaluation-harness (the optional extra `[eval]`): `lm_eval_adapter.MetraleLM`, registered
as the harness model `metrale-jax` when that module is imported; `python -m metrale_jax.eval ...` is the harness's
own command line with the model registered. Nothing is imported here, so `metrale_jax` never needs lm-eval."""

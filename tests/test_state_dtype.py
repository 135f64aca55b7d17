"""A bfloat16 Mamba state (new_cache(ssm_state_dtype=)) on the built-in model: the decoded predictions stay those of
the float32 state (tools/state_dtype_effect.py prints the full comparison), and the pool holds bfloat16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.builtin import load_builtin
from metrale_jax.errors import ConfigError
from tools.state_dtype_effect import decode_logits, heldout_windows


def test_bf16_state_keeps_the_builtin_models_predictions(rng):
    model = load_builtin(dtype=jnp.float32)
    # four random 96-byte windows of the held-out KJV text, the text tools/state_dtype_effect.py (and the README's
    # figure) measures on: random bytes are far from anything the model saw, and there its KL spreads past 1e-4
    ids = heldout_windows(model, rng, 4, 96)
    ref = decode_logits(model, ids, 32, "float32")
    got = decode_logits(model, ids, 32, "bfloat16")
    assert model.new_cache(1, 8, ssm_state_dtype="bfloat16").ssm.ssm_state.dtype == jnp.bfloat16
    lp_ref, lp = jax.nn.log_softmax(ref[:, 32:], -1), jax.nn.log_softmax(got[:, 32:], -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp), -1)))
    assert 0 < kl < 1e-4                                                   # rounded, but barely
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.98
    np.testing.assert_array_equal(got[:, :32], ref[:, :32])               # the prefill's logits do not see it
    with pytest.raises(ConfigError, match="mamba_ssm_cache_dtype"):
        model.new_cache(1, 8, ssm_state_dtype="int8")

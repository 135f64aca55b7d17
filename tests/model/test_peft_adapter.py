"""A PEFT-made LoRA adapter (tests/fixtures/peft/, made by tools/make_peft_fixture.py with HF transformers + peft)
loaded by metrale-jax onto its base checkpoint matches HF+PEFT's logits within the HF fixtures' tolerance, on the
reference path and through the Pallas kernels (interpret mode); unloading gives the base's logits back."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelLevers
from metrale_jax.model import NemotronH
from metrale_jax.weights.safetensors_io import SafetensorsFile
from tests.model.test_hf_equivalence import F32_TOL
from tests.numpy_refs import rel_err

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "peft" / "m_attn_m_mlp_m_moe_lora"


def _expected() -> dict[str, np.ndarray]:
    f = SafetensorsFile(FIXTURE / "expected.safetensors")
    out = {k: np.array(f.get(k)) for k in f.keys()}
    f.close()
    return out


@pytest.mark.parametrize("kernels", ["reference", "interpret"])
def test_peft_adapter_matches_hf_peft_logits(kernels):
    exp = _expected()
    meta = json.loads((FIXTURE / "meta.json").read_text())
    assert meta["numbers"]["adapter_vs_base_rel"] > 0.05          # the adapter really moves the logits
    model = NemotronH.from_pretrained(FIXTURE / "base", dtype=jnp.float32, levers=ModelLevers(kernels=kernels),
                                      progress=False)
    ids = exp["input_ids"]
    base = np.asarray(model.forward(ids))
    assert rel_err(base, exp["logits_base"]) < F32_TOL
    name = model.load_adapter(FIXTURE / "adapter")
    assert name == "adapter" and model.active_adapter == "adapter"
    info = model.adapters[0]
    assert info.config.use_rslora and dict(info.config.rank_pattern) == {"o_proj": 2}
    assert len(info.modules) == meta["lora_factors_drawn"] // 2            # every PEFT pair installed
    got = np.asarray(model.forward(ids))
    assert rel_err(got, exp["logits_adapter"]) < F32_TOL, rel_err(got, exp["logits_adapter"])
    model.unload_adapter()
    np.testing.assert_array_equal(np.asarray(model.forward(ids)), base)

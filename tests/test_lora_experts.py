"""LoRA on the MoE experts and lm_head (issue 36): PEFT's per-expert module form and its fused target_parameters
form (ParamWrapper on a 3-D expert parameter) load to the same overlay, which equals a model built from weights
merged by hand in numpy; shared experts and lm_head as targets; merge / unload; rows of different adapters in one
batch; full copies (modules_to_save) checked; unsupported embedding LoRA refused; a PEFT-made fixture matching
HF+PEFT's logits."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.config import ModelLevers
from metrale_jax.errors import CheckpointError
from metrale_jax.model import _JITTED, NemotronH, random_tensors
from metrale_jax.weights.lora import CONFIG_FILE, WEIGHTS_FILE
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors
from tests.model.test_hf_equivalence import F32_TOL
from tests.numpy_refs import rel_err
from tests.tiny_models import ALL_KINDS

F32 = jnp.float32
# I (24) != the latent width (16), so a transposed expert factor cannot fit by accident
CFG = dataclasses.replace(ALL_KINDS, moe_intermediate_size=24)
MOE = 2                                          # the E layer of "M*E-"
E, I, DIN, D, V = CFG.n_routed_experts, 24, CFG.moe_latent_size, CFG.hidden_size, CFG.vocab_size
R, ALPHA = 3, 5.0
PFX = f"base_model.model.model.layers.{MOE}.mixer"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "peft" / "m_moe_head_lora"


def _draw(rng):
    """Random factors: per expert up [I, DIN] / down [DIN, I], the shared up_proj [24, D] and lm_head [V, D]."""
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)
    return {"up": (f(E, R, DIN), f(E, I, R)), "down": (f(E, R, I), f(E, DIN, R)),
            "shared": (f(R, D), f(24, R)), "head": (f(R, D), f(V, R))}


def _config(**kw):
    base = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["lm_head", "up_proj"]}
    return {**base, **kw}


def _per_expert(fac):
    """The module form: one pair per expert (a model whose experts are modules names them experts.{e}.up_proj)."""
    t = {}
    for p in ("up", "down"):
        a, b = fac[p]
        for e in range(E):
            t[f"{PFX}.experts.{e}.{p}_proj.lora_A.weight"], t[f"{PFX}.experts.{e}.{p}_proj.lora_B.weight"] = a[e], b[e]
    t[f"{PFX}.shared_experts.up_proj.lora_A.weight"], t[f"{PFX}.shared_experts.up_proj.lora_B.weight"] = fac["shared"]
    t["base_model.model.lm_head.lora_A.weight"], t["base_model.model.lm_head.lora_B.weight"] = fac["head"]
    return t, _config(target_modules=["lm_head", "up_proj", "down_proj"])


def _fused(fac):
    """PEFT's ParamWrapper form: A [r*E, K] expert-major, B [N, r*E] rank-major; up_proj the inner wrapper."""
    t = {}
    for p, nest in (("up", ".base_layer"), ("down", "")):
        a, b = fac[p]
        t[f"{PFX}.experts{nest}.lora_A.weight"] = a.reshape(E * R, -1)
        t[f"{PFX}.experts{nest}.lora_B.weight"] = b.transpose(1, 2, 0).reshape(b.shape[1], R * E)
    t[f"{PFX}.shared_experts.up_proj.lora_A.weight"], t[f"{PFX}.shared_experts.up_proj.lora_B.weight"] = fac["shared"]
    t["base_model.model.lm_head.lora_A.weight"], t["base_model.model.lm_head.lora_B.weight"] = fac["head"]
    return t, _config(target_parameters=["experts.up_proj", "experts.down_proj"])


def _write(path, tensors, config):
    path.mkdir(parents=True)
    save_safetensors(path / WEIGHTS_FILE, tensors)
    (path / CONFIG_FILE).write_text(json.dumps(config))
    return path


def _merged_by_hand(tensors, fac):
    """The base checkpoint with every factor folded in, in float64 numpy (W + alpha / r * B A)."""
    s = ALPHA / R
    out = dict(tensors)
    fold = lambda name, a, b: np.asarray(tensors[name], np.float64) + s * (b.astype(np.float64) @ a)
    for p in ("up", "down"):
        a, b = fac[p]
        for e in range(E):
            n = f"backbone.layers.{MOE}.mixer.experts.{e}.{p}_proj.weight"
            out[n] = fold(n, a[e], b[e]).astype(np.float32)
    n = f"backbone.layers.{MOE}.mixer.shared_experts.up_proj.weight"
    out[n] = fold(n, *fac["shared"]).astype(np.float32)
    out["lm_head.weight"] = fold("lm_head.weight", *fac["head"]).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def base(request):
    rng = np.random.default_rng(3601)
    tensors = {k: np.asarray(v) for k, v in random_tensors(CFG, jax.random.key(int(rng.integers(1 << 30))), F32).items()}
    return tensors, rng


def test_both_expert_forms_equal_weights_merged_by_hand(base, tmp_path):
    tensors, rng = base
    fac = _draw(rng)
    ids = rng.integers(0, V, (2, 9))
    model = NemotronH(CFG, tensors, dtype=F32, levers=ModelLevers(kernels="reference"))
    plain = np.asarray(model.forward(ids))
    treedef, leaves = jax.tree.structure(model), [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    want = np.asarray(NemotronH(CFG, _merged_by_hand(tensors, fac), dtype=F32,
                                levers=ModelLevers(kernels="reference")).forward(ids))
    assert rel_err(want, plain) > 1e-2                                       # the adapter does something
    for form in (_per_expert, _fused):
        model.load_adapter(_write(tmp_path / form.__name__, *form(fac)))
        info = model.adapters[0]
        assert set(info.modules) == {"lm_head", f"backbone.layers.{MOE}.mixer.shared_experts.up_proj",
                                     f"backbone.layers.{MOE}.mixer.experts.up_proj",
                                     f"backbone.layers.{MOE}.mixer.experts.down_proj"}, form
        got = np.asarray(model.forward(ids))
        assert rel_err(got, want) < 1e-5, (form.__name__, rel_err(got, want))
        if form is _fused:
            model.merge_adapter()                               # folded into the dense experts and lm_head
            assert rel_err(np.asarray(model.forward(ids)), got) < 1e-5
        model.unload_adapter()
        assert jax.tree.structure(model) == treedef
        for x, y in zip(leaves, jax.tree.leaves(nnx.state(model))):
            np.testing.assert_array_equal(x, np.asarray(y))                  # the base back, bit for bit
        np.testing.assert_array_equal(np.asarray(model.forward(ids)), plain)


def test_save_and_load_round_trip_and_rows_of_different_adapters(base, tmp_path):
    tensors, rng = base
    ids = rng.integers(0, V, (3, 7))
    model = NemotronH(CFG, tensors, dtype=F32, levers=ModelLevers(kernels="reference"))
    model.load_adapter(_write(tmp_path / "a", *_fused(_draw(rng))), "a")
    model.load_adapter(_write(tmp_path / "b", *_per_expert(_draw(rng))), "b")
    fwd = lambda table: np.asarray(_JITTED["forward"](model, jnp.asarray(ids), jnp.asarray(table, jnp.int32)))
    alone = {k: fwd([k] * 3) for k in (0, 1, 2)}                  # one compiled step for every table
    mixed = fwd([0, 1, 2])
    for row in range(3):
        np.testing.assert_allclose(mixed[row], alone[row][row], rtol=1e-5, atol=1e-5)
    assert rel_err(alone[1], alone[0]) > 1e-2 and rel_err(alone[2], alone[1]) > 1e-2
    for name in ("a", "b"):                                   # save writes the form it was loaded in
        model.save_adapter(tmp_path / f"saved_{name}", name)
    saved = json.loads((tmp_path / "saved_a" / CONFIG_FILE).read_text())
    assert saved["target_parameters"] == ["experts.up_proj", "experts.down_proj"]
    model.unload_adapter()
    for name in ("a", "b"):
        model.load_adapter(tmp_path / f"saved_{name}", name)
    for k in (1, 2):
        np.testing.assert_allclose(fwd([k] * 3), alone[k], rtol=1e-6, atol=1e-6)


def test_full_copies_are_checked_and_lm_head_replacement_is_served(base, tmp_path):
    tensors, rng = base
    ids = rng.integers(0, V, (2, 6))
    model = NemotronH(CFG, tensors, dtype=F32, levers=ModelLevers(kernels="reference"))
    fac = _draw(rng)
    t, c = _fused(fac)
    new_head = tensors["lm_head.weight"] + rng.standard_normal((V, D)).astype(np.float32) * 0.2
    copies = {"base_model.model.model.embeddings.weight": tensors["backbone.embeddings.weight"],
              "base_model.model.lm_head.weight": new_head}
    del t["base_model.model.lm_head.lora_A.weight"], t["base_model.model.lm_head.lora_B.weight"]
    model.load_adapter(_write(tmp_path / "copies", {**t, **copies},
                              {**c, "target_modules": ["up_proj"], "modules_to_save": ["lm_head", "embeddings"]}))
    ref = _merged_by_hand(tensors, {**fac, "head": (np.zeros((R, D), np.float32), np.zeros((V, R), np.float32))})
    want = np.asarray(NemotronH(CFG, {**ref, "lm_head.weight": new_head}, dtype=F32,
                                levers=ModelLevers(kernels="reference")).forward(ids))
    assert rel_err(np.asarray(model.forward(ids)), want) < 1e-5
    model.unload_adapter()
    cases = {
        "embeddings": ({**t, "base_model.model.model.embeddings.weight": copies[
            "base_model.model.model.embeddings.weight"] + 1.0}, {**c, "modules_to_save": ["embeddings"]},
            "differs from this model's embeddings .* not supported"),
        "head base": ({**t, "base_model.model.lm_head.base_layer.weight": new_head}, c,
                      r"lm_head.base_layer.weight: differs from this model's lm_head.weight .* another base model"),
        "missing copy": (t, {**c, "modules_to_save": ["lm_head"]}, "modules_to_save names lm_head, but the adapter "
                                                                     "holds no full copy"),
        "embedding lora": (t, {**c, "target_modules": ["embeddings"]}, "LoRA on the embeddings .* not supported"),
        "fused shape": ({**t, f"{PFX}.experts.lora_B.weight": np.zeros((I, R * E), np.float32)}, c,
                        rf"{PFX}.experts.lora_B.weight: shape \[24, 24\], expected \[16, 24\]"),
        "nesting": ({**t, f"{PFX}.experts.base_layer.base_layer.lora_A.weight": np.zeros((R * E, DIN))}, c,
                    "nested 2 deep, but target_parameters .* names 2"),
        "expert id": ({**t, f"{PFX}.experts.9.up_proj.lora_A.weight": np.zeros((R, DIN)),
                       f"{PFX}.experts.9.up_proj.lora_B.weight": np.zeros((I, R))}, c,
                      "expert 9, but this model's layers have 8 routed experts"),
        "parameter": (t, {**c, "target_parameters": ["experts.gate_up_proj"]},
                      "target_parameters: 'experts.gate_up_proj' names no routed-expert parameter"),
    }
    for case, (tt, cc, match) in cases.items():
        with pytest.raises(CheckpointError, match=match):
            model.load_adapter(_write(tmp_path / case.replace(" ", "_"), tt, cc))
        assert model.adapters == (), case


def test_peft_made_expert_and_lm_head_adapter_matches_hf_peft_logits():
    f = SafetensorsFile(FIXTURE / "expected.safetensors")
    exp = {k: np.array(f.get(k)) for k in f.keys()}
    f.close()
    meta = json.loads((FIXTURE / "meta.json").read_text())
    assert meta["numbers"]["adapter_vs_base_rel"] > 0.05
    model = NemotronH.from_pretrained(FIXTURE / "base", dtype=F32, levers=ModelLevers(kernels="reference"),
                                      progress=False)
    base = np.asarray(model.forward(exp["input_ids"]))
    assert rel_err(base, exp["logits_base"]) < F32_TOL
    model.load_adapter(FIXTURE / "adapter")
    mods = model.adapters[0].modules
    assert "lm_head" in mods and sum(".experts." in m for m in mods) == 2 * meta["moe_layers"]
    got = np.asarray(model.forward(exp["input_ids"]))
    assert rel_err(got, exp["logits_adapter"]) < F32_TOL, rel_err(got, exp["logits_adapter"])


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_expert_overlay_beside_quantized_experts(fmt):
    """Quantized routed experts (the grouped kernels) plus the overlay equal their dequantized twin with the
    factors merged in by hand."""
    from metrale_jax.layers import lora
    from metrale_jax.layers.lora import ExpertLoraOverlay
    from metrale_jax.layers.moe import NemotronMoELayer
    from tests.layers.test_moe import CFG as MOE_CFG, D as MOE_D, _moe_tensors
    from tests.layers.test_moe_quantized import _stack

    rng = np.random.default_rng(3603)
    _, _, layer = _moe_tensors(rng, MOE_CFG)
    w = layer.moe_weights()
    up, down = _stack(fmt, w.experts_up), _stack(fmt, w.experts_down)
    quant = NemotronMoELayer(layer.input_norm[...], dataclasses.replace(w, experts_up=up, experts_down=down),
                             MOE_CFG, layer_idx=1, levers=ModelLevers(kernels="reference"))
    merged, s = {}, np.float32(0.7)
    for p, stack in (("up", up), ("down", down)):
        En, N, K = stack.shape
        a = (rng.standard_normal((1, En, 2, K)) * K ** -0.5).astype(np.float32)
        b = (rng.standard_normal((1, En, N, 2)) * 0.3).astype(np.float32)
        setattr(quant, f"experts_{p}_lora", ExpertLoraOverlay(a, b, np.array([s])))
        merged[p] = np.asarray(stack.dequantize(), np.float64) + s * np.einsum("enr,erk->enk", b[0], a[0])
    twin = NemotronMoELayer(layer.input_norm[...], dataclasses.replace(
        w, experts_up=jnp.asarray(merged["up"], F32), experts_down=jnp.asarray(merged["down"], F32)),
        MOE_CFG, layer_idx=1)
    x = jnp.asarray(rng.standard_normal((7, MOE_D)), F32)
    with lora.slot_adapters(jnp.array([0, 1], jnp.int32)), lora.head_rows(jnp.ones(7, jnp.int32)):
        got = quant(x)
    assert rel_err(got, twin(x)) < 1e-5
    assert rel_err(quant(x), got) > 1e-3                    # outside any adapter scope: the base alone

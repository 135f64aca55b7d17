"""Quantized weights under tensor parallelism: FP8-block and NVFP4 checkpoints of the built-in model (made with
quantize_checkpoint) split over 2 devices compute what the unsharded quantized model does and save back to the same
files; each device's share of an FP8 weight holds exactly the checkpoint's numbers, however the split or the Mamba
row permutation cuts its 128x128 blocks; what a mesh cannot serve raises a ConfigError saying so."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from metrale_jax import sharding, sharding_quant
from metrale_jax.builtin import builtin_model_dir
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import ConfigError
from metrale_jax.model import NemotronH
from metrale_jax.runtime import Engine
from metrale_jax.weights import quant_formats as qf
from metrale_jax.weights.containers import (Fp8Share, Fp8Weight, Nvfp4Weight, StackedExperts, W4a4Weight,
                                            WeightQuantFormat)
from metrale_jax.weights.quantize import quantize_checkpoint
from metrale_jax.weights.checkpoint import QUANTIZED_SUFFIXES
from metrale_jax.weights.safetensors_io import CheckpointReader
from tests.numpy_refs import rel_err
from tests.sharding.test_tensor_parallel import TOL
from tests.sharding.test_tp_repeated_groups import greedy_run

SLOTS, MAXLEN, T, STEPS = 2, 24, 8, 3
BF16_ACT = ModelLevers(fp8_activations="bf16")      # FP8 prefill weight-only: no per-device activation blocks


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    return sharding.make_mesh(2)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """format -> the built-in model's checkpoint directory in that format."""
    made = {}

    def get(fmt):
        if fmt not in made:
            made[fmt] = tmp_path_factory.mktemp(fmt) / "ckpt"
            quantize_checkpoint(builtin_model_dir(), made[fmt], fmt)
        return made[fmt]
    return get


@pytest.fixture(scope="module")
def loaded(mesh, quantized):
    """format -> (the unsharded quantized built-in model, the same split over 2 devices), float32."""
    made = {}

    def get(fmt):
        if fmt not in made:
            path = quantized(fmt)
            made[fmt] = tuple(NemotronH.from_pretrained(path, dtype=jnp.float32, levers=BF16_ACT, progress=False,
                                                        mesh=m) for m in (None, mesh))
        return made[fmt]
    return get


def _run(model, prompts, lens):
    return greedy_run(model, prompts, lens, steps=STEPS, max_len=MAXLEN)


@pytest.mark.parametrize("fmt,kinds", [("fp8-block", (Fp8Share, Fp8Weight)), ("nvfp4", (Nvfp4Weight,))])
def test_quantized_builtin_split_over_two_devices(loaded, rng, tmp_path, fmt, kinds):
    """Logits (prefill and decode) within the TP tolerance of the unsharded quantized model, the same greedy tokens,
    the SSM pool's state; the weights stay quantized on their shards (routed experts split by expert); and
    save_pretrained writes bitwise the unsharded model's tensors (the MTP head is not kept on a mesh)."""
    one, two = loaded(fmt)
    in_proj = two.layers[0].in_proj.base_weight()
    assert isinstance(in_proj, kinds) and isinstance(one.layers[0].in_proj.base_weight(), kinds)
    experts = two.layers[3].moe_weights().experts_up
    assert isinstance(experts, StackedExperts)
    lead = jax.tree.leaves(experts.member)[0]
    assert lead.sharding.is_equivalent_to(two.tp.sharding(P("tp", None, None)), lead.ndim)
    lens = np.array([T, 5])
    prompts = np.where(np.arange(T)[None] < lens[:, None], rng.integers(3, 259, (SLOTS, T)), 0).astype(np.int32)
    want, got = _run(one, prompts, lens), _run(two, prompts, lens)
    for b in range(SLOTS):
        assert rel_err(got[0][b, :lens[b]], want[0][b, :lens[b]]) <= TOL
    assert rel_err(got[1], want[1]) <= TOL
    np.testing.assert_array_equal(got[2], want[2])
    assert rel_err(np.asarray(got[3].ssm.ssm_state)[:, :SLOTS], np.asarray(want[3].ssm.ssm_state)[:, :SLOTS]) <= TOL
    one.save_pretrained(tmp_path / "one")
    two.save_pretrained(tmp_path / "two")
    a, b = CheckpointReader(tmp_path / "one"), CheckpointReader(tmp_path / "two")
    assert set(a.keys()) - set(b.keys()) == {n for n in a.keys() if n.startswith("mtp.")}
    assert set(b.keys()) <= set(a.keys()) and any(n.endswith("weight_scale_inv" if fmt == "fp8-block" else
                                                              "weight_scale_2") for n in b.keys())
    for name in b.keys():
        assert a.info(name) == b.info(name), name
        np.testing.assert_array_equal(b.get(name).view(np.uint8), a.get(name).view(np.uint8), err_msg=name)
    assert (tmp_path / "two" / "config.json").read_text() == (tmp_path / "one" / "config.json").read_text()


# 128-aligned splits: in_proj / q / k / v / up_proj rows and out_proj / o_proj / down_proj columns of whole blocks
ALIGNED = dict(vocab_size=256, hidden_size=256, hybrid_override_pattern="M*-E", mamba_num_heads=8, mamba_head_dim=64,
               ssm_state_size=128, n_groups=2, chunk_size=16, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
               intermediate_size=512, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
               moe_shared_expert_intermediate_size=256, n_shared_experts=1, n_group=1, topk_group=1)


def test_fp8_with_e4m3_activations_on_128_aligned_splits(mesh, rng, tmp_path):
    """The default levers (E4M3 prefill activations, the gated norm's per-group quantization) on a model whose
    splits land on 128 boundaries: plain per-device grids (in_proj padded after its 4 dt rows only), the fused
    norms quantize as on one device. The weights are the same numbers (test above), but an activation block's E4M3
    scale is its amax / 448: where the all-reduce's summation order moves an amax by an ulp the whole block rounds
    anew, and a flip carries on through the Mamba state to every later position (some seeds flip at position 1):
    the split moves the logits by less than E4M3 activations themselves do (against weight-only prefill on one
    device), and a sequence's first position, before any state carries a flip, is within the TP tolerance in at
    least one of the two sequences (a quantization that differs from one device's would miss it in both)."""
    cfg = ModelConfig.from_hf(ALIGNED)
    NemotronH.from_config(cfg, jax.random.key(5), dtype=jnp.float32).save_pretrained(tmp_path / "dense")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", "fp8-block")
    lev = ModelLevers()
    assert (lev.fp8_activations, lev.gated_norm_quant) == ("e4m3", "group")
    one, two, weight_only = (NemotronH.from_pretrained(tmp_path / "q", dtype=jnp.float32, levers=lv, progress=False,
                                                       mesh=m) for lv, m in ((lev, None), (lev, mesh), (BF16_ACT, None)))
    assert isinstance(two.layers[0].out_proj.base_weight(), Fp8Weight)
    assert isinstance(two.layers[1].k_proj.base_weight(), Fp8Weight)
    assert two.layers[0].in_proj.base_weight().rows is None                 # its output a slice, not a gather
    assert two.layers[0].out_proj.active_kernel("prefill", 16) == "w8a16_gemm_pipelined"
    lens = np.array([T, 6])
    prompts = np.where(np.arange(T)[None] < lens[:, None], rng.integers(0, 256, (SLOTS, T)), 0).astype(np.int32)
    runs = [_run(m, prompts, lens) for m in (one, two, weight_only)]
    flat = [np.concatenate([r[0][b, :lens[b]] for b in range(SLOTS)] + [r[1].reshape(-1, r[1].shape[-1])])
            for r in runs]
    split, lever = rel_err(flat[1], flat[0]), rel_err(flat[2], flat[0])
    assert 0 < split < lever, (split, lever)
    errs = [rel_err(a, b) for a, b in zip(flat[1], flat[0])]
    firsts = [errs[0], errs[lens[0]]]                                   # each sequence's first prefill position
    assert min(firsts) <= TOL, errs


def test_engine_splits_an_unsharded_quantized_model_over_a_mesh(loaded, mesh):
    """Engine(model, mesh=...) puts a copy of an unsharded FP8 model on the mesh (its containers, routed experts
    one by one, placed as the loader's are) and generates the unsharded model's greedy tokens."""
    one, _ = loaded("fp8-block")
    engine = Engine(one, max_slots=2, max_len=32, mesh=mesh)
    assert isinstance(engine.model.layers[0].in_proj.base_weight(), Fp8Share) and engine.model.tp.size == 2
    assert isinstance(engine.model.layers[3].moe_weights().experts_down, StackedExperts)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
    want = [g.tokens for g in one.generate(prompts, max_new_tokens=6)]
    assert [g.tokens for g in engine.generate(prompts, 6)] == want


def _fp8(rng, n, k, spread=True):
    """A block-FP8 weight whose 128x128 blocks have scales far apart (or all one scale)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    if spread:
        w *= np.exp(rng.uniform(-3, 3, qf.block_grid(n, k))).repeat(128, 0).repeat(128, 1)[:n, :k]
    q, s = qf.quantize_fp8_block(w)
    return Fp8Weight(jnp.asarray(q), jnp.asarray(s))


def _device_rows(w, tp):
    """Each device's dequantized share [N_local, K] (or [N, K_local]) from its own shards (a device view's call)."""
    out = []
    for d in range(tp):
        take = lambda a: None if a is None else np.asarray(a.addressable_shards[d].data)
        if isinstance(w, Fp8Share):
            n, k = w.logical
            local = (n // tp, k) if w.cols is None else (n, k // tp)
            share = Fp8Share(Fp8Weight(jnp.asarray(take(w.weight.weight)), jnp.asarray(take(w.weight.scale))),
                             None if w.rows is None else jnp.asarray(take(w.rows)),
                             None if w.cols is None else jnp.asarray(take(w.cols)), local)
        else:
            share = Fp8Weight(jnp.asarray(take(w.weight)), jnp.asarray(take(w.scale)))
        out.append(np.asarray(share.dequantize()))
    return out


def test_fp8_shares_hold_exactly_the_checkpoint_numbers(mesh, rng):
    """Row split through the Mamba row permutation (device rows from several 128-row blocks of different scales:
    padded shares), column split at 192 (cutting a 128-column block), and a split on 128 boundaries (a plain grid
    [tp*ceil(N_local/128), K/128]): every device's dequantized share is bitwise the checkpoint's rows / columns, and
    the checkpoint comes back from the shards."""
    cfg = ModelConfig.from_hf(builtin_model_dir())
    tp = sharding.tensor_parallel(mesh)
    cases = [("backbone.layers.0.mixer.in_proj.weight", (cfg.in_proj_dim, cfg.hidden_size), 0),
             ("backbone.layers.0.mixer.out_proj.weight", (cfg.hidden_size, cfg.d_inner), 1),
             ("backbone.layers.2.mixer.up_proj.weight", (cfg.intermediate_size, cfg.hidden_size), 0),
             ("backbone.layers.2.mixer.down_proj.weight", (cfg.hidden_size, cfg.intermediate_size), 1)]
    for name, shape, axis in cases:
        w = _fp8(rng, *shape)
        placed = sharding_quant.place_fp8(name, w, cfg, tp, BF16_ACT)
        dense = np.asarray(w.dequantize())
        rows = sharding.tensor_layout(name, cfg, tp).rows
        for d, got in enumerate(_device_rows(placed, 2)):
            if axis == 0:
                want = dense[(np.arange(shape[0]) if rows is None else rows).reshape(2, -1)[d]]
            else:
                want = dense[:, d * shape[1] // 2:(d + 1) * shape[1] // 2]
            np.testing.assert_array_equal(got, want, err_msg=f"{name} device {d}")
        aligned = shape[axis] // 2 % 128 == 0 and rows is None
        assert isinstance(placed, Fp8Weight) == aligned, name
        if aligned:
            local = (shape[0] // 2, shape[1]) if axis == 0 else (shape[0], shape[1] // 2)
            grid = qf.block_grid(*local)                        # [ceil(N_local/128), ceil(K_local/128)] a device
            assert placed.scale.shape == ((2 * grid[0], grid[1]) if axis == 0 else (grid[0], 2 * grid[1]))
        back = sharding_quant.unshard(name, placed, cfg, tp)
        np.testing.assert_array_equal(np.asarray(back.weight).view(np.uint8), np.asarray(w.weight).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(back.scale), np.asarray(w.scale))
    # every device segment of in_proj on a 128 boundary but the 4 dt rows: padding after the share's rows only,
    # so the share's output is a slice (no row gather)
    wide = ModelConfig.from_hf(ALIGNED)
    in_proj = "backbone.layers.0.mixer.in_proj.weight"
    w_in = _fp8(rng, wide.in_proj_dim, wide.hidden_size)
    placed = sharding_quant.place_fp8(in_proj, w_in, wide, tp, BF16_ACT)
    assert isinstance(placed, Fp8Share) and placed.rows is None and placed.cols is None
    dense, rows = np.asarray(w_in.dequantize()), sharding.in_proj_rows(wide, 2).reshape(2, -1)
    for d, got in enumerate(_device_rows(placed, 2)):
        np.testing.assert_array_equal(got, dense[rows[d]])
    back = sharding_quant.unshard(in_proj, placed, wide, tp)
    np.testing.assert_array_equal(np.asarray(back.weight).view(np.uint8), np.asarray(w_in.weight).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(back.scale), np.asarray(w_in.scale))
    # one scale for the whole tensor (ModelOpt FP8, expanded to the grid): a cut block needs no padding
    uniform = Fp8Weight(w.weight, jnp.asarray(0.01, jnp.float32), format=WeightQuantFormat.FP8_PER_TENSOR)
    placed = sharding_quant.place_fp8(name, uniform, cfg, tp, BF16_ACT)
    assert isinstance(placed, Fp8Weight) and placed.scale.shape == (2, 2 * 3)       # down_proj: K 768 -> 384
    np.testing.assert_array_equal(np.concatenate(_device_rows(placed, 2), 1), np.asarray(uniform.dequantize()))


def test_what_a_mesh_cannot_serve_raises_config_errors(mesh, rng):
    cfg = ModelConfig.from_hf(builtin_model_dir())
    tp = sharding.tensor_parallel(mesh)
    out_proj = "backbone.layers.0.mixer.out_proj.weight"
    w = _fp8(rng, cfg.hidden_size, cfg.d_inner)
    with pytest.raises(ConfigError, match="out_proj.weight: its column split gives each device 192 input columns"):
        sharding_quant.place_fp8(out_proj, w, cfg, tp, ModelLevers(fp8_activations="e4m3"))
    with pytest.raises(ConfigError, match="native_fp8_ssm"):
        sharding_quant.check_levers(cfg, {out_proj: w}, ModelLevers(native_fp8_ssm="decode"), 2)
    with pytest.raises(ConfigError, match="gated_norm_quant: 'group' .* a group of 384 channels is split"):
        sharding_quant.check_levers(cfg, {out_proj: w}, ModelLevers(), 2)
    sharding_quant.check_levers(cfg, {out_proj: w}, ModelLevers(gated_norm_quant="off"), 2)
    packed, scale, g = qf.quantize_nvfp4(rng.standard_normal((cfg.hidden_size, cfg.d_inner)).astype(np.float32))
    nv = Nvfp4Weight(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(g))
    with pytest.raises(ConfigError, match="W4A4"):
        sharding_quant.place_container(out_proj, W4a4Weight(nv), cfg, tp, BF16_ACT)
    narrow = Nvfp4Weight(nv.packed[:, :24], nv.scale[:, :3], nv.global_scale)          # K = 48: 24 per device
    with pytest.raises(ConfigError, match="not a multiple of 16 per device"):
        sharding_quant.place_nvfp4("backbone.layers.2.mixer.down_proj.weight", narrow, cfg, tp)
    per_row = Fp8Weight(w.weight, jnp.ones(cfg.hidden_size), format=WeightQuantFormat.FP8_PER_ROW)
    with pytest.raises(ConfigError, match="per-row scale"):
        sharding_quant.place_fp8(out_proj, per_row, cfg, tp, BF16_ACT)


class _Recorded:
    """A memory-mapped tensor that records the bytes of every read from it: an index (a share) or the whole."""

    def __init__(self, arr, name, log):
        self.arr, self.name, self.log = arr, name, log

    shape = property(lambda self: self.arr.shape)
    dtype = property(lambda self: self.arr.dtype)
    ndim = property(lambda self: self.arr.ndim)
    size = property(lambda self: self.arr.size)

    def __getitem__(self, index):
        out = np.asarray(self.arr[index])
        self.log.setdefault(self.name, []).append(out.nbytes)
        return out

    def __array__(self, dtype=None, copy=None):
        self.log.setdefault(self.name, []).append(("whole", self.arr.nbytes))
        return np.asarray(self.arr, dtype)


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8", "nvfp4"])
def test_quantized_checkpoint_is_read_by_device_share(quantized, monkeypatch, fmt):
    """Loading a quantized checkpoint on a (dp=2, tp=2) mesh reads every FP8 code / NVFP4 code and group-scale tensor
    by device share: a split tensor in tp reads of one share each (once per process, not once per replica), together
    exactly the rows the devices store (Mamba B/C rows, kv heads repeated per device), so that none is the whole
    tensor but k_proj / v_proj (3 kv heads over 2 devices: each device's query heads read all of them); a
    routed expert once, by the device holding it; nothing through a whole-array read. The placed shares give back
    the file's codes and scales bitwise (block FP8, ModelOpt FP8 with its one scale, NVFP4)."""
    import metrale_jax.weights.safetensors_io as io

    log: dict = {}
    get = io.SafetensorsFile.get

    def recorded(self, name):
        arr = get(self, name)
        return _Recorded(arr, name, log) if self.info(name)[0] in ("F8_E4M3", "U8") else arr

    monkeypatch.setattr(io.SafetensorsFile, "get", recorded)
    tp_size = 2
    mesh = sharding.make_mesh(tp_size, dp=2 if len(jax.devices()) >= 4 else 1)
    model = NemotronH.from_pretrained(quantized(fmt), dtype=jnp.float32, levers=BF16_ACT, progress=False, mesh=mesh)
    monkeypatch.undo()
    cfg, tp = model.config, sharding.tensor_parallel(mesh)
    reader = CheckpointReader(quantized(fmt))
    codes = [n for n in reader.keys() if reader.info(n)[0] in ("F8_E4M3", "U8") and not n.startswith("mtp.")]
    assert set(log) == set(codes) and any(n.endswith("weight_scale") for n in codes) == (fmt == "nvfp4")
    whole = set()                      # the projections a device holds whole: k / v (kv heads repeated)
    for name in codes:
        reads, full = log[name], reader.get(name).nbytes
        assert all(isinstance(r, int) for r in reads), (name, reads)               # no whole-array read
        if sharding.one_expert(name.rsplit(".", 1)[0] + ".weight") is not None:
            assert reads == [full], (name, reads)
            continue
        layout = sharding.tensor_layout(name.rsplit(".", 1)[0] + ".weight", cfg, tp)
        rows = reader.info(name)[1][0]
        stored = full if layout.rows is None else full // rows * len(layout.rows)
        assert reads == [stored // tp_size] * tp_size, (name, reads, full)                 # one share a device
        if stored // tp_size == full:
            whole.add(name.split(".mixer.")[1].split(".")[0])
    assert whole == {"k_proj", "v_proj"} and cfg.num_key_value_heads % tp_size, whole
    back = model.state_dict()                 # the shares back in the checkpoint's layout: the file's numbers
    bits = lambda a: np.asarray(a).reshape(-1).view(np.uint8)
    quant = [n for n in reader.keys() if n in codes or n.rsplit(".", 1)[1] in QUANTIZED_SUFFIXES]
    for name in (n for n in quant if not n.startswith("mtp.")):
        np.testing.assert_array_equal(bits(back[name]), bits(reader.get(name)), err_msg=name)
    reader.close()

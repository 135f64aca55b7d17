"""`metrale-jax` subcommands on the built-in model: demo, generate (against model.generate), score
(against float64 log-softmax of model.forward), info (against the safetensors files), and the
one-line, exit-code-2 report of bad paths and arguments."""

import json
import math
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from metrale_jax import cli
from metrale_jax.builtin import builtin_model_dir, load_builtin
from metrale_jax.weights.safetensors_io import save_safetensors
from tests import numpy_refs_model as ref


@pytest.fixture(scope="module")
def model():
    return load_builtin()


def run(capsys, *argv):
    capsys.readouterr()                                   # drop what came before (the rng fixture's seed)
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_demo_prints_text_and_rates(capsys):
    rc, out, err = run(capsys, "demo", "--max-new-tokens", "24")
    assert rc == 0, err
    assert cli.DEMO_PROMPT in out
    text = out.split(cli.DEMO_PROMPT, 1)[1].split("\n\n", 1)[0]
    assert len(text) >= 20 and sum(c.isalpha() or c in " ,.;:\n" for c in text) >= 0.9 * len(text), text
    assert "prefill: " in out and "decode: " in out and out.count("tokens/s") == 2


def test_generate_greedy_matches_model_generate(capsys, model):
    prompt = "And the LORD said"
    rc, out, err = run(capsys, "generate", "--prompt", prompt, "--max-new-tokens", "20", "--json")
    assert rc == 0, err
    got = json.loads(out)
    want = model.generate([prompt], max_new_tokens=20)[0]
    assert got["prompt_ids"] == model.tokenizer.encode(prompt)
    assert got["tokens"] == want.tokens and got["text"] == want.text


def test_generate_sampling_is_seeded(capsys):
    args = ("generate", "--prompt", "Blessed", "--max-new-tokens", "24", "--temperature", "1.0", "--top-p", "0.95",
            "--json")
    draws = [json.loads(run(capsys, *args, "--seed", str(s))[1])["tokens"] for s in (3, 3, 4)]
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def test_score_matches_forward(capsys, tmp_path):
    """In float32, so that the CLI's sums can be held to float32 accuracy."""
    model = load_builtin(dtype=np.float32)
    texts = ["In the beginning God created the heaven and the earth.", "Jesus wept.",
             "And it came to pass, when Pharaoh had let the people go, that God led them not"]
    ids = [5, 40, 80, 120, 200, 258, 3]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([json.dumps({"text": t}) for t in texts] + [json.dumps({"ids": ids})]) + "\n")
    rc, out, err = run(capsys, "score", "--data", str(data), "--batch-size", "3", "--dtype", "float32", "--json")
    assert rc == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    rows, total = lines[:-1], lines[-1]["total"]
    seqs = [model.tokenizer.encode(t) for t in texts] + [ids]
    assert [r["example"] for r in rows] == [0, 1, 2, 3]
    # reference: one forward over the right-padded rows (causal, so padding does not reach earlier logits)
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        padded[i, :len(seq)] = seq
    logits = np.asarray(model.forward(padded), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = [logp[i, np.arange(len(s) - 1), s[1:]].sum() for i, s in enumerate(seqs)]
    for r, seq, w in zip(rows, seqs, want):
        assert r["tokens"] == len(seq) - 1
        assert abs(r["sum_logprob"] - w) < 1e-4 * len(seq), (r, w)
        assert math.isclose(r["perplexity"], math.exp(-r["sum_logprob"] / r["tokens"]), rel_tol=1e-9)
    assert total["tokens"] == sum(len(s) - 1 for s in seqs)
    assert abs(total["sum_logprob"] - sum(want)) < 1e-4 * total["tokens"]
    rc, out, err = run(capsys, "score", "--data", str(data), "--batch-size", "3", "--dtype", "float32")   # table
    assert rc == 0 and out.splitlines()[-1].split()[0] == "total"
    assert float(out.splitlines()[-1].split()[3]) == pytest.approx(total["perplexity"], rel=1e-3)


def test_info_matches_safetensors(capsys):
    d = builtin_model_dir()
    rc, out, err = run(capsys, "info", "--json")
    assert rc == 0, err
    s = json.loads(out)
    tensors = load_file(d / "model.safetensors")
    assert s["params"] == sum(t.size for t in tensors.values())
    assert s["bytes"] == sum(t.nbytes for t in tensors.values())
    assert s["tensors"] == len(tensors)
    assert s["layer_kinds"] == {"mamba2": s["pattern"].count("M"), "attention": s["pattern"].count("*"),
                                "mlp": s["pattern"].count("-"), "moe": s["pattern"].count("E")}
    assert sum(s["weight_formats"].values()) == sum(t.ndim >= 2 for t in tensors.values())
    assert s["tokenizer"] == "bytes"
    mtp = sum(1 for n in tensors if n.startswith("mtp."))                # the built-in model's trained MTP head
    assert mtp > 0 and s["config"]["mtp"] == f"1 step(s) of '*-', {mtp} tensors (speculative method 'mtp')"
    rc, out, err = run(capsys, "info")
    assert rc == 0 and "pattern" in out and "formats:" in out and "mtp: 1 step(s)" in out


def test_info_counts_quantized_formats_from_headers(capsys, tmp_path, rng):
    """A ModelOpt-style header set: an FP8 per-tensor, an FP8 block-scaled and an NVFP4 weight, plus
    dense ones; info reads only the headers, so the tensors need not form a loadable model."""
    f8 = lambda *s: rng.standard_normal(s).astype(ml_dtypes.float8_e4m3fn)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    tensors = {
        "backbone.embeddings.weight": f32(16, 8), "backbone.norm_f.weight": f32(8),
        "backbone.layers.0.mixer.up_proj.weight": f8(32, 8),
        "backbone.layers.0.mixer.up_proj.weight_scale": f32(), "backbone.layers.0.mixer.up_proj.input_scale": f32(),
        "backbone.layers.0.mixer.down_proj.weight": f8(8, 32),
        "backbone.layers.0.mixer.down_proj.weight_scale_inv": f32(1, 1),
        "backbone.layers.1.mixer.up_proj.weight": rng.integers(0, 255, (32, 4)).astype(np.uint8),
        "backbone.layers.1.mixer.up_proj.weight_scale": f8(32, 1),
        "backbone.layers.1.mixer.up_proj.weight_scale_2": f32(),
        "backbone.layers.1.mixer.down_proj.weight": f32(8, 32).astype(ml_dtypes.bfloat16),
        "lm_head.weight": f32(16, 8),
    }
    save_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        vocab_size=16, hidden_size=8, hybrid_override_pattern="--", intermediate_size=32,
        quantization_config={"quant_method": "modelopt"})))
    rc, out, err = run(capsys, "info", "--model", str(tmp_path), "--json")
    assert rc == 0, err
    s = json.loads(out)
    assert s["weight_formats"] == {"dense bf16": 1, "dense f32": 2, "fp8 block-scaled": 1, "fp8 per-tensor": 1,
                                   "nvfp4": 1}
    assert s["params"] == 16 * 8 * 2 + 8 + 32 * 8 * 2 + 32 * 8 + 8 * 32     # nvfp4: two weights a byte
    assert s["bytes_by_dtype"]["U8"] == 32 * 4
    assert s["config"]["quantization"] == "modelopt"


@pytest.fixture
def broken_dirs(tmp_path):
    """Folders that look like checkpoints and are not."""
    src = builtin_model_dir()
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    missing = tmp_path / "missing_tensor"
    shutil.copytree(src, missing)
    t = load_file(src / "model.safetensors")
    del t["backbone.norm_f.weight"], t["lm_head.weight"]
    save_safetensors(missing / "model.safetensors", t)
    truncated = tmp_path / "truncated"
    shutil.copytree(src, truncated)
    (truncated / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:1000])
    return {"bad_json": bad_json, "missing": missing, "truncated": truncated, "tmp": tmp_path}


@pytest.mark.parametrize("argv, message", [
    (["info", "--model", "/no/such/dir"], "--model /no/such/dir: no such directory"),
    (["generate", "--model", "{tmp}", "--prompt", "x"], "no config.json there"),
    (["info", "--model", "{bad_json}"], "config.json: not valid JSON"),
    (["generate", "--model", "{missing}", "--prompt", "x"], "backbone.norm_f.weight: missing (expected shape"),
    (["score", "--model", "{truncated}", "--data", "{tmp}/x.jsonl"], "no such file"),
    (["generate", "--model", "{truncated}", "--prompt", "x"], "model.safetensors"),
    (["score", "--data", "{tmp}/bad.jsonl"], "line 2: not valid JSON"),
    (["score", "--data", "{tmp}/ids.jsonl"], "line 1: ids [300] outside the vocabulary [0, 259)"),
    (["score", "--data", "{tmp}/latin1.jsonl"], "not UTF-8 text"),
    (["score", "--data", "{tmp}/empty.jsonl"], "line 2: needs at least 2 tokens to score, has 1"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "argument --top-p"),
    (["generate"], "one of the arguments --prompt --prompt-ids is required"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_input_is_one_line_exit_2(capsys, broken_dirs, argv, message):
    tmp = broken_dirs["tmp"]
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tmp / "ids.jsonl").write_text('{"ids": [1, 300]}\n')
    (tmp / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    (tmp / "empty.jsonl").write_text('{"text": "a"}\n{"text": ""}\n')
    argv = [a.format(**broken_dirs) for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert err.startswith("metrale-jax: error: ") and err.count("\n") == 1, err
    assert message.format(**broken_dirs) in err, err
    assert "Traceback" not in err and out == ""


def test_console_script_exit_code_and_no_traceback(tmp_path):
    """The real process: python -m metrale_jax.cli with a bad --model."""
    p = subprocess.run([sys.executable, "-m", "metrale_jax.cli", "info", "--model", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr == f"metrale-jax: error: --model {tmp_path / 'nope'}: no such directory\n"


def test_quantize_writes_a_checkpoint_info_reads_and_bad_input_is_one_line(capsys, tmp_path):
    out = tmp_path / "q"
    rc, text, err = run(capsys, "quantize", "--format", "nvfp4", "--out", str(out), "--exclude", "*.q_proj",
                        "--exclude", "*.k_proj", "*.v_proj")
    assert rc == 0, err
    from metrale_jax.weights.safetensors_io import SafetensorsFile
    f = SafetensorsFile(out / "model.safetensors")
    tensors = {n: f.get(n) for n in f.keys()}
    packed = sorted(n for n, t in tensors.items() if n.endswith(".weight") and t.dtype == np.uint8)
    # 19 of the main blocks' 22 linears (q/k/v excluded) + the MTP head's o_proj, up_proj, down_proj
    # (its q/k/v excluded by the same patterns; eh_proj and lm_head stay bf16)
    assert f"{len(packed)} linear modules in nvfp4" in text and len(packed) == 22
    assert not any(p in n for n in packed for p in ("q_proj", "k_proj", "v_proj", "lm_head"))
    assert tensors["backbone.layers.1.mixer.q_proj.weight"].dtype == ml_dtypes.bfloat16
    assert (out / "byte_tokenizer.json").is_file()
    rc, text, err = run(capsys, "info", "--model", str(out), "--json")
    assert rc == 0, err
    s = json.loads(text)
    assert s["weight_formats"]["nvfp4"] == len(packed)
    assert s["quantization"] == {"method": "nvfp4", "exclude": ["lm_head", "*.q_proj", "*.k_proj", "*.v_proj"],
                                 "source": "hf_quant_config.json"}
    rc, text, err = run(capsys, "info", "--model", str(out))
    assert rc == 0 and "quantization: nvfp4 (from hf_quant_config.json; excluded: lm_head, *.q_proj" in text
    for argv, message in [
        (["--format", "int4", "--out", str(tmp_path / "x")], "argument --format: invalid choice: 'int4'"),
        (["--out", str(tmp_path / "x")], "the following arguments are required: --format"),
        (["--format", "fp8", "--out", str(out)], f"{out}: already holds a checkpoint"),
        (["--format", "fp8", "--out", str(tmp_path / "y"), "--model", str(out)], "already quantized"),
        (["--format", "fp8", "--out", str(out), "--model", str(out)], "is the --model directory"),
    ]:
        rc, text, err = run(capsys, "quantize", *argv)
        assert rc == 2 and err.startswith("metrale-jax: error: ") and err.count("\n") == 1, err
        assert message in err and text == "", err


def test_score_context_continuation_per_token_windows_and_progress_lines(capsys, tmp_path, rng):
    """{"context", "continuation"} lines score the continuation only (strings split as lm-eval splits them) and say
    whether it is the greedy one; a long {"ids"} line is scored by windows; --per-token gives each scored token's
    log-prob; with stderr not a terminal, progress comes as lines (--progress-every 0: one per batch)."""
    model = load_builtin(dtype=np.float32)
    tok = model.tokenizer
    context = "And God said unto Moses,"
    greedy = model.generate([context], max_new_tokens=8)[0].text               # the model's own continuation
    other = "xq zv"
    long_ids = rng.integers(3, 259, 300).tolist()
    lines = [{"context": context, "continuation": greedy}, {"context": context, "continuation": other},
             {"context": tok.encode("Jesus")[:3], "continuation": tok.encode("wept", add_bos=False)},
             {"ids": long_ids}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, out, err = run(capsys, "score", "--data", str(data), "--dtype", "float32", "--json", "--per-token",
                       "--max-length", "128", "--stride", "64", "--batch-size", "2", "--progress-every", "0")
    assert rc == 0, err
    rows = [json.loads(x) for x in out.splitlines()][:-1]
    assert [r["greedy"] for r in rows[:2]] == [True, False]
    assert rows[3]["windows"] == 1 + -(-(300 - 128) // 64) and rows[3]["tokens"] == 299
    assert sum("scoring: " in x and " rows (" in x for x in err.splitlines()) >= 2
    pairs = [(context, greedy), (context, other)]
    splits = [(tok.encode(c.rstrip()), tok.encode(c + x)[len(tok.encode(c.rstrip())):]) for c, x in pairs]
    # the references from one forward over the four rows, right-padded (causal: the padding reaches no earlier
    # logit): the two pairs, the ids pair and the last 128 tokens of the windowed line (one compile, not four)
    seqs = [ctx + cont for ctx, cont in splits] + [lines[2]["context"] + lines[2]["continuation"], long_ids[-128:]]
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        padded[i, :len(seq)] = seq
    lps = [ref.log_softmax(z[:len(seq)]) for z, seq in zip(np.asarray(model.forward(padded)), seqs)]
    for r, (ctx, cont), lp in zip(rows, splits, lps):
        ids = ctx + cont
        want = lp[np.arange(len(ctx) - 1, len(ids) - 1), cont]
        assert r["token_ids"] == cont and r["tokens"] == len(cont)
        np.testing.assert_allclose(r["token_logprobs"], want, atol=2e-5)
        assert abs(r["sum_logprob"] - want.sum()) < 1e-4
    ids = seqs[2]
    np.testing.assert_allclose(rows[2]["token_logprobs"], lps[2][np.arange(2, len(ids) - 1), ids[3:]], atol=2e-5)
    # the windowed line: its last 63 tokens come from the row of the last 128 tokens
    tail = seqs[3]
    np.testing.assert_allclose(rows[3]["token_logprobs"][-43:], lps[3][np.arange(84, 127), tail[85:]], atol=2e-5)

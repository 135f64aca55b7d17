"""The CLI's promise under hostile input: one line on stderr and exit code 2, never a traceback. JSONL lines nested
deeply or holding 5000-digit numbers, huge seeds, hostile checkpoints (each built from a copy of the built-in
model), and a model whose logits are not finite."""

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from metrale_jax import cli
from metrale_jax.builtin import builtin_model_dir
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors


def run(capsys, *argv):
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line(rc, out, err, message):
    """Exit 2, one error line (after, for generate and score, the one line describing the model) naming what is
    wrong, no traceback, nothing on stdout."""
    assert rc == 2, (rc, err)
    lines = err.splitlines()
    assert lines[-1].startswith("metrale-jax: error: ") and err.endswith("\n"), err
    assert len(lines) == 1 or (len(lines) == 2 and "pattern 'M*-EM-'" in lines[0]), err
    assert message in lines[-1], err
    assert "Traceback" not in err and out == "" and len(lines[-1]) < 1000, err


# ---- bad arguments and data -----------------------------------------------------------------------------
JSONL = {
    "deep": '{"ids": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "bignum": '{"ids": [1, ' + "7" * 5000 + "]}",
    "long id": '{"ids": [1, ' + "7" * 4000 + "]}",
    "surrogate": '{"text": "\\ud800"}',
    "list": "[1, 2]",
}


@pytest.mark.parametrize("kind, message", [
    ("deep", "line 2: not valid JSON (nested too deeply)"),
    ("bignum", "line 2: not valid JSON"),
    ("long id", "line 2: ids [77777777777777777..."),
    ("surrogate", "line 2: text is not valid Unicode"),
    ("list", "line 2: expected a JSON object at the top level, got list"),
])
def test_hostile_jsonl_lines(capsys, tmp_path, kind, message):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine line"}\n' + JSONL[kind] + "\n")
    assert_one_line(*run(capsys, "score", "--data", data), message)


@pytest.mark.parametrize("seed", ["9" * 30, "9" * 5000, "-1", str(2 ** 63), "1.5"])
def test_seeds_jax_cannot_take_are_usage_errors(capsys, seed):
    assert_one_line(*run(capsys, "generate", "--prompt", "x", "--max-new-tokens", "2", "--seed", seed),
                    "argument --seed: expected an integer in [0, 2**63)")


def test_the_largest_seed_runs(capsys):
    rc, out, err = run(capsys, "generate", "--prompt", "x", "--max-new-tokens", "2", "--temperature", "1",
                       "--seed", 2 ** 63 - 1, "--json")
    assert rc == 0, err
    assert len(json.loads(out)["tokens"]) <= 2


def test_prompt_ids_too_long_to_parse_are_not_echoed_whole(capsys):
    """An id of 5000 digits is past int()'s limit: the message shows the argument's start only."""
    assert_one_line(*run(capsys, "generate", "--prompt-ids", "1," + "9" * 5000, "--max-new-tokens", "2"),
                    "argument --prompt-ids: expected comma-separated token ids, got '1,99999999")


def test_a_prompt_that_is_not_utf8(capsys):
    """argv bytes that are not UTF-8 reach Python as lone surrogates."""
    prompt = os.fsdecode(b"abc\xff")
    assert_one_line(*run(capsys, "generate", "--prompt", prompt, "--max-new-tokens", "2"),
                    "--prompt: not valid UTF-8 text")


# ---- hostile checkpoints -----------------------------------------------------------------------------------
def _copy(tmp_path) -> "os.PathLike":
    return shutil.copytree(builtin_model_dir(), tmp_path / "ckpt")


def _tensors(d):
    f = SafetensorsFile(d / "model.safetensors")
    out = {n: np.array(f.get(n)) for n in f.keys()}
    f.close()
    return out


def _index_outside(d):
    names = list(_tensors(d))
    (d.parent / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names,
                                                                                             "../outside.safetensors")}))
    return "not a plain file name inside the checkpoint directory"


def _overlapping_header(d):
    blob = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header["lm_head.weight"]["data_offsets"] = header["backbone.embeddings.weight"]["data_offsets"]
    head = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + blob[8 + n:])
    return "invalid offset for tensor"


def _fifo_weights(d):
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    return "model.safetensors: not a regular file (a FIFO)"


def _latin1_config(d):
    text = (d / "config.json").read_text().replace('"nemotron_h"', '"nemotr\u00f3n_h"')
    (d / "config.json").write_bytes(text.encode("latin-1"))
    return "config.json: not UTF-8 text"


def _nan_config(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["routed_scaling_factor"] = "nan"
    (d / "config.json").write_text(json.dumps(cfg))
    return "routed_scaling_factor: expected a finite number"


def _nan_weight(d):
    t = _tensors(d)
    t["backbone.layers.3.mixer.gate.weight"][1, 2] = np.nan
    save_safetensors(d / "model.safetensors", t)
    return "backbone.layers.3.mixer.gate.weight: holds NaN or infinite values"


@pytest.mark.parametrize("command", ["info", "generate", "score"])
@pytest.mark.parametrize("breaks", [_index_outside, _overlapping_header, _fifo_weights, _latin1_config, _nan_config,
                                    _nan_weight])
def test_every_hostile_checkpoint_is_one_line(capsys, tmp_path, command, breaks):
    d = _copy(tmp_path)
    message = breaks(d)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "In the beginning"}\n')
    args = {"info": [], "generate": ["--prompt", "x", "--max-new-tokens", "2"], "score": ["--data", data]}[command]
    rc, out, err = run(capsys, command, "--model", d, *args)
    if command == "info" and breaks is _nan_weight:           # info reads headers only: the weights are not read
        assert rc == 0, err
        return
    assert_one_line(rc, out, err, message)


# ---- non-finite logits ---------------------------------------------------------------------------------------
@pytest.fixture
def overflowing(tmp_path):
    """Finite weights whose logits overflow: the final norm's weight scaled to near bfloat16's largest value."""
    d = _copy(tmp_path)
    t = _tensors(d)
    t["backbone.norm_f.weight"] = np.full_like(t["backbone.norm_f.weight"], 3e38, dtype=ml_dtypes.bfloat16)
    save_safetensors(d / "model.safetensors", t)
    return d


def test_non_finite_scores_are_an_error(capsys, tmp_path, overflowing):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "In the beginning"}\n{"ids": [1, 40, 50]}\n')
    # --progress-every: no progress line however slowly a loaded machine scores
    assert_one_line(*run(capsys, "score", "--model", overflowing, "--data", data, "--progress-every", "1000"),
                    "its log-probs hold NaN or infinite values")


def test_non_finite_logits_in_generation_are_an_error(capsys, overflowing):
    assert_one_line(*run(capsys, "generate", "--model", overflowing, "--prompt", "And", "--max-new-tokens", "3"),
                    "the logits of decode step 0 (prompt of 4 tokens) hold NaN or infinite values")


# ---- lengths past what the model supports --------------------------------------------------------------------
@pytest.fixture
def no_allocation(monkeypatch):
    from metrale_jax.state.cache import ModelCache

    def refuse(*args, **kwargs):
        raise AssertionError("a cache was allocated")
    monkeypatch.setattr(ModelCache, "for_config", classmethod(refuse))


def test_generate_with_a_huge_max_new_tokens_is_refused_before_allocating(capsys, no_allocation):
    assert_one_line(*run(capsys, "generate", "--prompt", "And", "--max-new-tokens", 100_000_000),
                    "--max-new-tokens 100000000: a prompt of 4 tokens + 100000000 new tokens exceeds the model's "
                    "max_position_embeddings 4096")


@pytest.mark.parametrize("extra, message", [
    (["--max-length", 100_000], "--max-length 100000: expected an integer in [2, 4096] (the model's "
                                "max_position_embeddings)"),
    (["--max-length", 64, "--stride", 64], "--stride 64: must be below --max-length 64"),
    (["--per-token"], "--per-token: per-token log-probs are written in the --json output; add --json"),
])
def test_score_window_arguments_are_refused_before_allocating(capsys, tmp_path, rng, no_allocation, extra, message):
    """A 20k-token line is no longer refused (it is scored by windows), but windows the model cannot take are."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n' + json.dumps({"ids": rng.integers(3, 259, 20_000).tolist()}) + "\n")
    assert_one_line(*run(capsys, "score", "--data", data, *extra), message)


PAIR = 'expected {"context": "...", "continuation": "..."} (both strings or both lists of token ids)'


@pytest.mark.parametrize("line, message", [
    ({"context": "a", "continuation": 5}, PAIR),
    ({"context": [1, 2], "continuation": "x"}, PAIR),
    ({"context": [], "continuation": [5]}, "needs at least 1 context and 1 continuation token, has 0 and 1"),
    ({"context": [1], "continuation": [7, 300]}, "ids [300] outside the vocabulary"),
    ({"context": "a", "continuation": "\ud800"}, "text is not valid Unicode"),
    ({"continuation": "abc"}, PAIR),
])
def test_hostile_context_continuation_lines(capsys, tmp_path, line, message):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine line"}\n' + json.dumps(line) + "\n")
    assert_one_line(*run(capsys, "score", "--data", data), "line 2: " + message)

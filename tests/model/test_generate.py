"""model.generate runs through the engine (one generation loop, one sampler): the same Generations as an Engine of
other shapes, nothing compiled on a repeated call of the same buckets, stop strings and ids, per-prompt
SamplingParams; and the CLI's generate draws the engine's stream for its seed."""

import json

import numpy as np
import pytest

from metrale_jax import cli
from metrale_jax.builtin import load_builtin
from metrale_jax.runtime import Engine, bucket
from metrale_jax.runtime.engine import _GENERATE_EXECUTABLES
from metrale_jax.runtime.sampling_params import SamplingParams

PROMPTS = ["And God said", "Jesus wept", "Blessed are", "The LORD is"]      # one length bucket


@pytest.fixture(scope="module")
def model():
    return load_builtin()


def test_generate_is_the_engine_and_a_repeated_call_compiles_nothing(model, rng):
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=30, min_p=0.02, seed=int(rng.integers(1 << 40)))
    first = model.generate(PROMPTS[:2], sp)
    exe = _GENERATE_EXECUTABLES[model]
    compiles = exe.total_compiles
    again = model.generate(PROMPTS[2:], sp)                       # the same (slots, length) buckets
    assert exe.total_compiles == compiles, exe.stats()
    assert model.generate(PROMPTS[:2], sp) == first                # seeded: reproducible
    longest = max(len(model.tokenizer.encode(p)) for p in PROMPTS[:2]) + sp.max_new_tokens
    eng = Engine(model, max_slots=2, max_len=bucket(longest, 16))    # generate's engine shapes, built by hand
    assert eng.generate(PROMPTS[:2], sp) == first
    assert all(g.text and g.finish_reason in ("length", "eos") for g in first + again)


def test_generate_stops_on_strings_and_ids_and_takes_one_params_per_prompt(model, rng):
    free = model.generate(PROMPTS, 40)
    text = next(g.text for g in free if len(g.text) >= 12)
    stop = text[5:7]
    got = model.generate(PROMPTS, 40, stop=[stop])
    assert any(g.finish_reason == "stop" for g in got)
    for f, g in zip(free, got):
        if stop in f.text:
            assert g.finish_reason == "stop" and g.text == f.text[:f.text.find(stop)]
            assert f.tokens[:len(g.tokens)] == g.tokens
        else:
            assert g == f
    stop_id = free[0].tokens[3]
    first = free[0].tokens.index(stop_id)
    per = [SamplingParams(max_new_tokens=40, stop=[stop_id]), SamplingParams(max_new_tokens=5),
           SamplingParams(max_new_tokens=40, temperature=1.0, seed=3), SamplingParams(max_new_tokens=2, logprobs=0)]
    out = model.generate(PROMPTS, per)
    assert out[0].tokens == free[0].tokens[:first] and out[0].finish_reason == "stop"
    assert out[1].tokens == free[1].tokens[:5] and out[1].finish_reason == "length"
    # a request's own seed, whatever its neighbours (the same shapes: another bucket or cache length rounds the
    # dense matmuls differently, which can flip a sampled token at a near tie)
    assert out[2] == model.generate(PROMPTS[::-1], per[::-1])[1]
    assert len(out[3].logprobs) == len(out[3].tokens) == 2


def test_cli_generate_draws_the_engine_stream_of_its_seed(capsys, model, rng):
    seed = int(rng.integers(0, 1 << 40))
    rc = cli.main(["generate", "--prompt", "Blessed", "--max-new-tokens", "16", "--temperature", "1.0",
                   "--top-k", "40", "--min-p", "0.01", "--seed", str(seed), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    got = json.loads(out.splitlines()[-1])
    eng = Engine(model, max_slots=2, max_len=64)
    rid = eng.submit(model.tokenizer.encode("Blessed"), SamplingParams(max_new_tokens=16, temperature=1.0, top_k=40,
                                                                        min_p=0.01, seed=seed))
    eng.run()
    r = eng.pop(rid)
    assert got["tokens"] == r.tokens and got["finish_reason"] == r.finish_reason
    assert np.isfinite(got["decode_s"])

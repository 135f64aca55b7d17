"""A real multi-process run on the CPU: two processes on localhost join one jax.distributed run (gloo collectives)
through `metrale-jax score --coordinator ... --num-processes 2 --process-id i`, each holding one device (a replica
of the built-in model, dp = 2), and process 0 writes exactly what one process alone writes (with or without --dp)."""

import json
import os
import socket
import string
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import cli
from metrale_jax.model import NemotronH
from tests.numpy_refs import rel_err
from tests.sharding.test_tensor_parallel import CFG, TOL

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _data(rng, path: Path, n: int = 7) -> None:
    """n JSONL lines of random text (the built-in tokenizer is byte-level), one context / continuation pair and one
    of token ids among them; lengths vary, and the one batch of 7 rows pads to 8 split over the 2 replicas."""
    letters = np.array(list(string.ascii_lowercase + "    "))
    text = lambda k: "".join(rng.choice(letters, k))
    lines = [{"text": text(int(rng.integers(4, 90)))} for _ in range(n - 2)]
    lines.append({"context": text(12), "continuation": text(7)})
    lines.append({"ids": rng.integers(3, 259, 20).tolist()})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _two_processes(args: list[str], cwd: Path) -> list[tuple[str, str]]:
    """(stdout, stderr) of `metrale-jax *args` run by 2 processes joined on a free localhost port, one CPU device
    each; both must succeed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}           # one CPU device per process
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "metrale_jax.cli", *args, "--coordinator", f"localhost:{port}",
                               "--num-processes", "2", "--process-id", str(i)], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=110) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def _without_seconds(out: str) -> list[dict]:
    rows = [json.loads(line) for line in out.splitlines()]
    rows[-1]["total"].pop("seconds")                     # the wall time is the one field that may differ
    return rows


def test_two_processes_write_the_single_process_scores(rng, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    _data(rng, data)
    args = ["score", "--data", str(data), "--json", "--per-token", "--batch-size", "8"]
    assert cli.main(args) == 0                                          # one process, one device, no mesh
    want = _without_seconds(capsys.readouterr().out)
    assert cli.main([*args, "--dp", "2"]) == 0                          # one process, 2 replicas
    assert _without_seconds(capsys.readouterr().out) == want

    (out0, err0), (out1, err1) = _two_processes(args, tmp_path)
    assert out1 == ""                                                   # only process 0 writes
    assert "Gloo" not in out0 and "Gloo" in err0 + err1                # the collectives' own lines go to stderr
    got = _without_seconds(out0)
    assert got == want
    assert len(got) == 8 and got[-1]["total"]["examples"] == 7



def test_an_incomplete_run_description_is_a_usage_error(rng, tmp_path, capsys):
    """--num-processes without a coordinator (or an out-of-range --process-id) ends with one line, exit 2, before
    anything joins or loads."""
    data = tmp_path / "data.jsonl"
    _data(rng, data)
    assert cli.main(["score", "--data", str(data), "--num-processes", "2"]) == 2
    assert "needs the coordinator address" in capsys.readouterr().err
    assert cli.main(["score", "--data", str(data), "--coordinator", "localhost:1", "--num-processes", "2",
                     "--process-id", "2"]) == 2
    assert "process_id: expected an integer in [0, 2), got 2" in capsys.readouterr().err


def _tp2_over_two_processes_scores_as_one(capsys, tmp_path, data, *extra):
    """score of tmp_path/ckpt over `data` with --tp 2 over 2 processes against one process: the same tokens, log-probs
    within the tensor-parallel tolerance."""
    args = ["score", "--model", str(tmp_path / "ckpt"), "--data", str(data), "--json", "--per-token", *extra]
    assert cli.main(args) == 0
    want = _without_seconds(capsys.readouterr().out)[:-1]
    (out, _), _ = _two_processes([*args, "--tp", "2"], tmp_path)
    got = _without_seconds(out)[:-1]
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want] and len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert rel_err(np.array(g["token_logprobs"]), np.array(w["token_logprobs"])) < TOL


@pytest.mark.slow
def test_tensor_parallel_across_two_processes(rng, tmp_path, capsys):
    """--tp 2 over 2 processes (one device each: every block's all-reduce goes over gloo, each process reads half of
    every split tensor) scores as one process does, within the tensor-parallel tolerance."""
    model = NemotronH.from_config(CFG, jax.random.key(int(rng.integers(1 << 30))), dtype=jnp.float32)
    model.save_pretrained(tmp_path / "ckpt")
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"ids": rng.integers(0, CFG.vocab_size, n).tolist()}) + "\n"
                            for n in (5, 17, 9, 30)))
    _tp2_over_two_processes_scores_as_one(capsys, tmp_path, data)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8-block", "nvfp4"])
def test_quantized_checkpoint_across_two_processes(rng, tmp_path, capsys, monkeypatch, fmt):
    """The built-in model's FP8-block / NVFP4 checkpoint with --tp 2 over 2 processes (each reads its device's share
    of every code and scale tensor: sharding_quant.read_on_mesh) scores as one process does, within the
    tensor-parallel tolerance (FP8 prefill weight-only: E4M3 activations are refused on the built-in model's split)."""
    from metrale_jax.builtin import builtin_model_dir
    from metrale_jax.weights.quantize import quantize_checkpoint

    monkeypatch.setenv("METRALE_FP8_ACTIVATIONS", "bf16")
    quantize_checkpoint(builtin_model_dir(), tmp_path / "ckpt", fmt)
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"ids": rng.integers(3, 259, n).tolist()}) + "\n" for n in (5, 17, 30)))
    _tp2_over_two_processes_scores_as_one(capsys, tmp_path, data, "--dtype", "float32")

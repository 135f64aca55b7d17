"""bench_e2e_decode --update: a run of a few rows joins the table without losing the rows it did not measure."""

import json

import pytest

from benchmarks.bench_e2e_decode import merge_runs, read_previous


def _doc(date, device, rows, errors=None, bw=3e12):
    return {"date": date, "device": device, "config": "nemotron_h_8b", "copy_bytes_per_s": bw, "errors": errors or {},
            "rows": [{"weights": w, "state_dtype": s, "batch": b, "device_tok_s": t} for w, s, b, t in rows]}


def test_update_keeps_unmeasured_rows_and_replaces_measured_ones():
    old = _doc("d1", "H", [("nvfp4", "bfloat16", 1, 1.0), ("bf16", "float32", 1, 2.0), ("bf16", "float32", 8, 3.0)],
               errors={"nvfp4": "OOM", "bf16": "x"}, bw=1e12)
    new = _doc("d2", "H", [("nvfp4", "bfloat16", 1, 9.0)], bw=2e12)
    got = merge_runs(old, new)
    keys = [(r["weights"], r["state_dtype"], r["batch"], r["device_tok_s"], r["date"], r["copy_bytes_per_s"])
            for r in got["rows"]]
    assert keys == [("bf16", "float32", 1, 2.0, "d1", 1e12), ("bf16", "float32", 8, 3.0, "d1", 1e12),
                    ("nvfp4", "bfloat16", 1, 9.0, "d2", 2e12)]
    assert got["date"] == "d2" and got["copy_bytes_per_s"] == 2e12
    assert got["errors"] == {"bf16": "x"}                 # nvfp4 was measured again: its old error is gone


def test_update_refuses_rows_of_another_device():
    with pytest.raises(SystemExit, match="cannot join"):
        merge_runs(_doc("d1", "H100", [("bf16", "float32", 1, 1.0)]), _doc("d2", "H200", []))


def test_update_starts_a_new_table_over_another_devices(tmp_path):
    path = tmp_path / "e2e.json"
    assert read_previous(str(path), "H100", "nemotron_h_8b") is None                  # no table yet
    path.write_text(json.dumps(_doc("d1", "H100", [("bf16", "float32", 1, 1.0)])))
    assert read_previous(str(path), "H100", "nemotron_h_8b")["rows"][0]["device_tok_s"] == 1.0
    assert read_previous(str(path), "H200", "nemotron_h_8b") is None
    assert read_previous(str(path), "H100", "tiny") is None


def test_update_starts_a_new_table_over_other_levers(tmp_path):
    """A table of the e4m3 decode (fp8_decode_activations) never joins the default's, and the reverse; a table
    without the field is the default's."""
    path = tmp_path / "e2e.json"
    e4m3 = {"fp8_decode_activations": "e4m3"}
    path.write_text(json.dumps(_doc("d1", "H100", [("fp8-block", "float32", 1, 1.0)])))
    assert read_previous(str(path), "H100", "nemotron_h_8b", {"fp8_decode_activations": "bf16"}) is not None
    assert read_previous(str(path), "H100", "nemotron_h_8b", e4m3) is None
    path.write_text(json.dumps({**_doc("d1", "H100", [("fp8-block", "float32", 1, 1.0)]), "levers": e4m3}))
    assert read_previous(str(path), "H100", "nemotron_h_8b", e4m3)["rows"][0]["device_tok_s"] == 1.0
    assert read_previous(str(path), "H100", "nemotron_h_8b") is None

"""The README's Python snippets run as written, in order, on the built-in model (they define every name they use)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_snippets_run(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)           # noqa: S102  (our own README)
    assert namespace["outs"][0].text and namespace["y1"].shape == (namespace["model"].config.hidden_size,)
    assert len(namespace["gens"]) == 4 and all(g.finish_reason in ("stop", "length", "eos") for g in namespace["gens"])
    assert capsys.readouterr().out.strip()                             # the quick start printed its text

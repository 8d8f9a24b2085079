"""bench/semantic_classifier.py: the share served at a precision, the comparison on separable vectors, and the
script on a tiny stream file."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    path = ROOT / "bench" / "semantic_classifier.py"
    spec = importlib.util.spec_from_file_location("bench_semantic_classifier", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


def test_served_is_the_longest_most_confident_prefix_within_the_precision() -> None:
    confidence = np.array([0.6, 0.9, 0.7, 0.8])
    correct = np.array([True, True, False, True])  # by confidence: right, right, wrong, right
    assert SCRIPT.served(confidence, correct, 0.75) == 1.0  # 3 of 4
    assert SCRIPT.served(confidence, correct, 0.9) == 0.5  # 2 of 2; 2 of 3 and 3 of 4 fall short
    assert SCRIPT.served(confidence, ~correct, 0.5) == 0.0  # the most confident alone is wrong


def test_separable_groups_are_all_served_by_both() -> None:
    rng = np.random.default_rng(0)
    groups = [f"g{i % 4}" for i in range(80)]
    vecs = np.eye(8)[[i % 4 for i in range(80)]] + 0.05 * rng.standard_normal((80, 8))
    vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
    found = SCRIPT.compare(groups, vecs, 0.98)
    assert set(found) == {"train", "queries", "classes", "classifier", "nearest", "shares_median_s"}
    assert (found["train"], found["queries"], found["classes"]) == (40, 40, 4)
    assert (found["classifier"], found["nearest"]) == (1.0, 1.0)
    assert found["shares_median_s"] > 0


@pytest.mark.slow
def test_the_script_on_a_stream_file(tmp_path: Path) -> None:
    topics = {"card": "my card {} is blocked", "refund": "I want my money back for order {}",
              "weather": "will it rain in city {} tomorrow"}
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps({"prompt": text.format(i), "group": group}) + "\n"
                              for i in range(10) for group, text in topics.items()), encoding="utf-8")
    out = tmp_path / "out.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = SCRIPT.main(["--streams", str(stream), "--embed-cache", str(tmp_path / "emb"), "--json", str(out)])
    assert code == 0
    [row] = json.loads(out.read_text(encoding="utf-8"))
    assert set(row) == {"stream", "precision", "train", "queries", "classes", "classifier", "nearest",
                        "shares_median_s"}
    assert (row["stream"], row["precision"], row["train"], row["queries"], row["classes"]) == (
        str(stream), 0.98, 15, 15, 3)
    assert 0 <= row["classifier"] <= 1 and 0 <= row["nearest"] <= 1
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("| stream | train | queries | classes | served at 0.98 precision: classifier |")
    assert lines[2].startswith(f"| {stream} | 15 | 15 | 3 | ")


@pytest.mark.slow
def test_an_unknown_stream_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        SCRIPT.main(["--streams", "nosuch"])
    assert exit_info.value.code == 2
    message = "unknown streams ['nosuch']: neither a known one (banking77, clinc150) nor a file"
    assert message in capsys.readouterr().err

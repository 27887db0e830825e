"""``make-trace sharegpt`` and ``make-trace custom``: what vLLM users have,
as traces with follow-ups. Shared text gives shared hash ids exactly as far
as it is shared, every assistant turn is one request quoting the replies
before it, token counts come from a local tokenizer or 4 characters a
token, and what is written reads back through the simulator's reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vllm_hybrid.tools.simulate.followups import read_followup_trace
from vllm_hybrid.tools.tracegen.cli import main
from vllm_hybrid.tools.tracegen.convert import (
    BLOCK_TOKENS,
    ConvertOptions,
    estimate_tokens,
    from_custom,
    from_sharegpt,
    local_tokenizer,
    text_segments,
)

SYSTEM = "You are a helpful assistant. " * 6  # 174 characters: 44 tokens
CONVERSATIONS = [
    {
        "id": "a",
        "conversations": [
            {"from": "system", "value": SYSTEM},
            {"from": "human", "value": "What is the capital of France?"},
            {"from": "gpt", "value": "Paris."},
            {"from": "human", "value": "And of Italy?"},
            {"from": "gpt", "value": "Rome, since 1871." * 3},
        ],
    },
    {
        "id": "b",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "no reply to this one"},
        ],
    },
]


def _write(tmp_path: Path, data, name: str = "in.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_shared_text_shares_hash_ids_exactly_that_far() -> None:
    a = text_segments(SYSTEM + "first question", estimate_tokens)
    b = text_segments(SYSTEM + "second one", estimate_tokens)
    # 64 characters a block: the first two blocks are the same text
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    assert sum(s["tokens"] for s in a) == math.ceil(len(SYSTEM + "first question") / 4)
    assert all(s["tokens"] <= BLOCK_TOKENS for s in a)


def test_every_assistant_turn_is_a_request_quoting_the_replies_before(
    tmp_path: Path,
) -> None:
    lines = from_sharegpt(
        _write(tmp_path, CONVERSATIONS), estimate_tokens, ConvertOptions()
    )
    assert [x["id"] for x in lines] == ["c0/t0", "c0/t1", "c1/t0"]
    first, second, other = lines
    # system + question: 44 + 8 tokens; the reply "Paris." counts 2
    assert sum(s["tokens"] for s in first["segments"]) == 44 + 8
    assert first["output_length"] == 2 and first["timestamp"] == 0
    assert second["segments"][: len(first["segments"])] == first["segments"]
    assert second["segments"][len(first["segments"])] == {
        "reply_of": "c0/t0",
        "from": 0,
    }
    assert second["after"] == "c0/t0" and second["delay_ms"] == 0
    assert second["output_length"] == math.ceil(len("Rome, since 1871." * 3) / 4)
    # both conversations open with the same system prompt: the same ids
    system_blocks = text_segments(SYSTEM, estimate_tokens)
    assert other["segments"][: len(system_blocks)] == system_blocks
    assert first["segments"][: len(system_blocks)] == system_blocks
    # the trailing user turn has no reply: no request for it
    assert all(x["id"] != "c1/t1" for x in lines)


def test_conversations_start_as_a_poisson_process(tmp_path: Path) -> None:
    path = _write(tmp_path, CONVERSATIONS * 20)
    options = ConvertOptions(request_rate=2.0, think_time_ms=500, seed=3)
    lines = from_sharegpt(path, estimate_tokens, options)
    starts = [x["timestamp"] for x in lines if "timestamp" in x]
    assert len(starts) == 40 and starts[0] == 0
    assert starts == sorted(starts) and starts[-1] > 0
    # a mean gap of 500 ms over 39 gaps: within a factor of two
    assert 0.5 < starts[-1] / (39 * 500) < 2
    assert {x["delay_ms"] for x in lines if "after" in x} == {500}
    assert lines == from_sharegpt(path, estimate_tokens, options)


def test_custom_lines_are_one_request_each(tmp_path: Path, capsys) -> None:
    source = tmp_path / "custom.jsonl"
    source.write_text(
        json.dumps({"prompt": "What is the capital of India?", "output_tokens": 10})
        + "\n"
        + json.dumps({"prompt": "What is the capital of Iran?"})
        + "\n"
    )
    lines = from_custom(source, estimate_tokens, ConvertOptions(output_len=7))
    assert [(x["id"], x["output_length"]) for x in lines] == [("r0", 10), ("r1", 7)]
    assert [sum(s["tokens"] for s in x["segments"]) for x in lines] == [8, 7]
    out = tmp_path / "out.jsonl"
    assert main(["custom", str(out), "--from", str(source)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f'vllm-hybrid make-trace: error: --from {source} line 2: "output_tokens" '
        "must be a whole number >= 1, or give --output-len"
    )
    assert main(["custom", str(out), "--from", str(source), "--output-len", "7"]) == 0
    assert [r.request_id for r in read_followup_trace(out)] == ["r0", "r1"]
    assert "tokens estimated at 4 characters a token" in capsys.readouterr().out


def test_written_conversions_read_back(tmp_path: Path, capsys) -> None:
    out = tmp_path / "chat.jsonl"
    source = _write(tmp_path, CONVERSATIONS)
    assert main(["sharegpt", str(out), "--from", str(source)]) == 0
    records = read_followup_trace(out)
    assert [r.request_id for r in records] == ["c0/t0", "c0/t1", "c1/t0"]
    assert records[1].after == "c0/t0"
    assert "3 requests" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["sharegpt", "{out}"], "sharegpt needs --from FILE"),
        (["agent", "{out}", "--from", "{src}"], "--from is for the converters"),
        (["custom", "{out}", "--from", "{src}", "--shape", '{{"a": 1}}'], "--shape is"),
        (["sharegpt", "/missing/x.jsonl", "--from", "{src}"], "does not exist"),
        (["sharegpt", "{out}", "--from", "{bad}"], "conversation 1: not a"),
    ],
)
def test_bad_converter_input_is_one_line(tmp_path, argv, needle, capsys) -> None:
    src = _write(tmp_path, CONVERSATIONS)
    bad = _write(tmp_path, [{"turns": []}], "bad.json")
    out = tmp_path / "o.jsonl"
    argv = [a.format(out=out, src=src, bad=bad) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_a_local_tokenizer_counts_exactly(tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    directory = tiny_model_dir("qwen3_5")
    tokenize = local_tokenizer(directory)
    exact = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    text = SYSTEM + "What is the capital of France?"
    ids = exact.encode(text, add_special_tokens=False)
    segments = text_segments(text, tokenize)
    assert sum(s["tokens"] for s in segments) == len(ids)
    assert len(segments) == math.ceil(len(ids) / BLOCK_TOKENS)
    with pytest.raises(ValueError, match="--tokenizer"):
        local_tokenizer(tmp_path)

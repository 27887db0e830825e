"""Bad input against a live pooled-mode server, and bad start-up options.

Every bad request gets a 4xx whose error names the field (or the body part)
at fault, and the server keeps answering. Start-up errors end the process
quickly with a message naming the option.

Already covered elsewhere, not repeated here: an unknown ``hybrid_kv`` key
through ``vllm-hybrid serve`` (``tests/plugins/test_first_run.py``, whose
``bogus`` key ends with one line and exit code 2); chat requests with
``messages`` not a list, a negative ``max_tokens`` or a string temperature,
and ``{not json`` on the chat endpoint (status only), in
``tests/entrypoints/test_openai_server.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testing.loopback import serve

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
SERVER_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--kv-cache-memory-bytes",
    str(16 * 2**20),
    "--enforce-eager",
]
#: Bound on a start-up that must fail: no hang (a model load and engine
#: start take 20-60 s on 2 busy cores).
STARTUP_BOUND = 300
CLI = [sys.executable, "-m", "vllm_hybrid.cli"]


# -- start-up errors (before the module's server starts: one server at a time)


def test_wrong_hybrid_kv_value_ends_with_one_line(tiny_model_dir):
    proc = subprocess.run(
        [
            *CLI,
            "serve",
            str(tiny_model_dir("qwen3_5")),
            "--additional-config",
            '{"hybrid_kv": {"pooled": "maybe"}}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "vllm-hybrid: --additional-config hybrid_kv.pooled must be true or false, "
        "got 'maybe'"
    ]


BLOCK_SIZE_MESSAGE = (
    "--mamba-block-size 200 must be a multiple of the attention block size 128 "
    "in vllm-hybrid's pooled mode"
)


@pytest.fixture(scope="module")
def bad_mamba_block_size(tiny_model_dir):
    """``serve --mamba-block-size 200`` in pooled mode (attention block 128 on
    CPU, prefix caching on: align mode), run once."""
    return subprocess.run(
        [
            *CLI,
            "serve",
            str(tiny_model_dir("qwen3_5")),
            "--host",
            "127.0.0.1",
            "--port",
            "1",  # never reached: the engine does not start
            *SERVER_ARGS,
            "--mamba-block-size",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=STARTUP_BOUND,
        env=None,
    )


def test_mamba_block_size_not_a_multiple_stops_start_up(bad_mamba_block_size):
    proc = bad_mamba_block_size
    assert proc.returncode != 0
    assert BLOCK_SIZE_MESSAGE in proc.stdout + proc.stderr


def test_mamba_block_size_not_a_multiple_ends_with_one_line(bad_mamba_block_size):
    """Found where the engine's configuration is made (the block size is
    final there on CPU): no engine process starts."""
    proc = bad_mamba_block_size
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "EngineCore" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-hybrid: " + BLOCK_SIZE_MESSAGE)


# -- bad requests against one live server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("bad-input") / "server.log"
    with serve(tiny_model_dir("qwen3_5"), SERVER_ARGS, log_path=log) as handle:
        yield handle


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]

#: (id, endpoint, body (a dict; bytes are sent as they are), status, what the
#: error text must name). ``MODEL`` in a dict body becomes the served name.
BAD_REQUESTS = [
    (
        "malformed-json",
        COMPLETIONS,
        b'{"model": "m", "prompt": "hi", "max_tokens": ',
        400,
        ["JSON decode error"],
    ),
    (
        "max-tokens-string",
        CHAT,
        {"messages": HI, "max_tokens": "ten"},
        400,
        ["max_tokens"],
    ),
    (
        "max-tokens-negative",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": -1},
        400,
        ["max_tokens"],
    ),
    (
        "max-tokens-zero",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 0},
        400,
        ["max_tokens"],
    ),
    (
        "max-tokens-huge",
        CHAT,
        {"messages": HI, "max_tokens": 10**9},
        400,
        ["max_tokens", f"max_model_len={MAX_MODEL_LEN}"],
    ),
    (
        "max-tokens-beyond-int64",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2**70},
        400,
        ["max_tokens"],
    ),
    (
        "unknown-model",
        CHAT,
        {"model": "no-such-model", "messages": HI},
        404,
        ["no-such-model", '"param": "model"'],
    ),
    (
        "empty-messages",
        CHAT,
        {"messages": [], "max_tokens": 4},
        400,
        ["empty conversation", "message"],
    ),
    (
        "invalid-utf8",
        CHAT,
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}',
        400,
        ["parsing the body"],
    ),
    (
        "prompt-tokens-beyond-max-model-len",
        COMPLETIONS,
        {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 4},
        400,
        [f"maximum context length is {MAX_MODEL_LEN} tokens", "input_tokens"],
    ),
    (
        "prompt-tokens-at-max-model-len",
        COMPLETIONS,
        {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1},
        400,
        [f"maximum context length is {MAX_MODEL_LEN} tokens", "input_tokens"],
    ),
    (
        "chat-text-beyond-max-model-len",
        CHAT,
        {"messages": [{"role": "user", "content": "word " * 4 * MAX_MODEL_LEN}]},
        400,
        [f"maximum context length is {MAX_MODEL_LEN} tokens"],
    ),
    (
        "token-id-out-of-vocabulary",
        COMPLETIONS,
        {"prompt": [5, 100000], "max_tokens": 4},
        400,
        ["Token id 100000 is out of vocabulary"],
    ),
    (
        "token-id-negative",
        COMPLETIONS,
        {"prompt": [5, -3], "max_tokens": 4},
        400,
        ["body.prompt"],
    ),
    (
        "n-zero",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "n": 0},
        400,
        ["n must be at least 1"],
    ),
    (
        "logprobs-huge",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "logprobs": 10**5},
        400,
        ["logprobs"],
    ),
    (
        "stop-empty-string",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "stop": [""]},
        400,
        ["stop"],
    ),
    (
        "temperature-nan",
        COMPLETIONS,
        b'{"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": NaN}',
        400,
        ["temperature"],
    ),
    (
        "seed-beyond-int64",
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 4, "seed": 2**70},
        400,
        ["body.seed"],
    ),
]


#: Cases whose error does not name the field at fault (upstream vLLM 0.32's
#: frontend, the same with VLLM_HYBRID_KV=0).
MISNAMED = {
    "prompt-tokens-at-max-model-len": "a prompt of exactly max_model_len tokens "
    "gets 'max_tokens must be at least 1, got 0. (parameter=max_tokens, "
    "value=0)' although the request asked for max_tokens 1: vLLM lowers "
    "max_tokens to the room the prompt leaves (0) before validating it, so the "
    "400 names max_tokens and a value the client never sent, not the prompt",
}


@pytest.mark.parametrize(
    "endpoint,body,status,names",
    [
        pytest.param(
            *case[1:],
            id=case[0],
            marks=[pytest.mark.xfail(strict=True, reason=MISNAMED[case[0]])]
            if case[0] in MISNAMED
            else [],
        )
        for case in BAD_REQUESTS
    ],
)
def test_bad_request_gets_4xx_naming_the_field(server, endpoint, body, status, names):
    if isinstance(body, bytes):
        data = body.replace(b'"model": "m"', f'"model": "{server.model}"'.encode())
    else:
        data = json.dumps({"model": server.model, **body}).encode()
    got, raw = server.request(endpoint, data)
    assert got == status, raw[:300]
    text = json.dumps(json.loads(raw))
    for name in names:
        assert name in text, (name, text[:400])


def test_server_keeps_answering_after_bad_input(server):
    """After every bad request above (this test runs after them)."""
    status, _ = server.request("/health")
    assert status == 200
    reply = server.chat("Still there?", max_tokens=5, ignore_eos=True)
    assert reply["usage"]["completion_tokens"] == 5
    assert "Traceback" not in server.log_text()


# Keep this test last: in its failing (expected) form it kills the server.
@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.32 on CPU, both modes (also VLLM_HYBRID_KV=0): a sampled "
    "request with a per-request seed whose prefill takes more than one step "
    "(prompt > 128 tokens with prefix caching on) kills the engine: "
    "gpu_model_runner._bookkeeping_sync calls gen.set_offset(gen.get_offset() "
    "- 4) on a CPU torch.Generator ('RuntimeError: CPU Generator does not use "
    "offset'); the request gets a 500, /health 503, the server exits",
)
def test_seeded_sampling_with_a_long_prompt_keeps_the_server_up(server):
    body = {
        "model": server.model,
        "prompt": [5 + i % 900 for i in range(200)],
        "max_tokens": 4,
        "temperature": 0.7,
        "seed": 123,
    }
    status, raw = server.request(COMPLETIONS, body)
    assert status == 200, raw[:300]
    assert server.request("/health")[0] == 200

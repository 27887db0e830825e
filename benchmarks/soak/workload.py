"""The seeded request mix of a soak run.

Every phase draws its jobs from one ``random.Random`` seeded from the run's
seed and the phase name, so the same seed sends the same requests in both
modes. A job is one request or one multi-turn conversation (each turn one
request). Bodies leave out ``model``; the client adds the served name.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

#: Job kinds and their weights in the mix.
MIX = {
    "chat": 18,
    "completion": 18,
    "conversation": 8,
    "n_gt_1": 8,
    "stop": 8,
    "max_tokens_1": 8,
    "max_tokens_large": 4,
    "too_long": 7,
    "at_limit": 3,
    "disconnect": 10,
    "drop": 4,
    "shared_prefix": 4,
}

#: Stop string sets (the OpenAI API allows at most 4): frequent ones end
#: most outputs early, rare ones almost never.
STOP_SETS = (["e"], ["a", "o"], [" s", "\n"], ["zq", "qz"], ["th", "in", "er", "an"])

#: Token ids below this are the tiny models' special tokens (pad, bos, eos).
FIRST_ORDINARY_ID = 3
SHARED_PREFIX_TOKENS = 256


@dataclass
class RequestSpec:
    rid: str
    kind: str
    endpoint: str
    #: Request body without ``model`` (a conversation turn without history).
    body: dict
    #: 200, or 400 for prompts beyond --max-model-len.
    expect: int = 200
    #: Close the connection after this many stream events (0: right after
    #: sending the request, before any response); None: read it all.
    disconnect_after: int | None = None
    #: Prompt tokens when the prompt is given as token ids.
    prompt_len: int | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))

    @property
    def stop(self) -> list[str]:
        return list(self.body.get("stop") or [])


@dataclass
class Job:
    kind: str
    specs: list[RequestSpec] = field(default_factory=list)

    @property
    def conversation(self) -> bool:
        return self.kind == "conversation"


@dataclass(frozen=True)
class WorkloadContext:
    """What the mix needs to know about the model and server."""

    vocab_size: int
    max_model_len: int
    seed: int
    #: Give sampled requests a ``seed``. Off by default: on CPU, vLLM 0.32
    #: kills its engine on a seeded request whose prefill takes more than
    #: one step (``CPU Generator does not use offset``), in both modes.
    request_seeds: bool = False
    #: Upper end of ``max_tokens`` in the "large" kind (None: max_model_len).
    large_max_tokens: int | None = None

    def words(self) -> list[str]:
        rng = random.Random(self.seed * 7919 + 1)
        letters = "etaoinshrdlucmfwypvbgkqjxz"
        weights = [26 - i for i in range(26)]
        return [
            "".join(rng.choices(letters, weights, k=rng.randint(2, 8)))
            for _ in range(300)
        ]

    def system_prompt(self) -> str:
        """The system prompt every chat request shares (about 200 tokens)."""
        rng = random.Random(self.seed * 104729 + 2)
        return "You are a soak test. " + " ".join(rng.choices(self.words(), k=45))

    def shared_prefix(self) -> list[int]:
        rng = random.Random(self.seed * 15485863 + 3)
        return [
            rng.randrange(FIRST_ORDINARY_ID, self.vocab_size)
            for _ in range(SHARED_PREFIX_TOKENS)
        ]


def phase_rng(seed: int, phase: str) -> random.Random:
    return random.Random(seed * 1_000_003 + zlib.crc32(phase.encode()))


class MixBuilder:
    """Draws jobs of the mix; ``rid`` values are ``phase:number``."""

    def __init__(self, ctx: WorkloadContext, phase: str) -> None:
        self.ctx = ctx
        self.phase = phase
        self.rng = phase_rng(ctx.seed, phase)
        self.words = ctx.words()
        self.system = ctx.system_prompt()
        self.prefix = ctx.shared_prefix()
        self.count = 0

    # -- pieces ---------------------------------------------------------
    def _rid(self) -> str:
        self.count += 1
        return f"{self.phase}:{self.count}"

    def _tokens(self, n: int) -> list[int]:
        return [
            self.rng.randrange(FIRST_ORDINARY_ID, self.ctx.vocab_size) for _ in range(n)
        ]

    def _length(self, low: int, high: int) -> int:
        """Log-uniform integer in [low, high]."""
        if high <= low:
            return low
        value = int(round(low * (high / low) ** self.rng.random()))
        return min(high, max(low, value))

    def _text(self, low: int, high: int) -> str:
        return " ".join(self.rng.choices(self.words, k=self.rng.randint(low, high)))

    def _sampling(self, max_tokens: int | None = None) -> dict:
        temperature = self.rng.choice([0.0, 0.0, 0.7, 1.0])
        body = {
            "max_tokens": max_tokens or self.rng.randint(2, 48),
            "temperature": temperature,
            "ignore_eos": self.rng.random() < 0.5,
        }
        seed = self.rng.randrange(2**31)
        if temperature > 0 and self.ctx.request_seeds:
            body["seed"] = seed
        return body

    def _stream(self, body: dict, stream: bool) -> dict:
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _chat(
        self, kind: str, stream: bool, words: int = 60, **sampling
    ) -> RequestSpec:
        """A chat request: the shared system prompt and 1 to ``words`` words
        (about 4.4 tokens each with the tiny models' 960-token vocabulary)."""
        body = {
            "messages": [
                {"role": "system", "content": self.system},
                {"role": "user", "content": self._text(1, words)},
            ],
            **self._sampling(),
            **sampling,
        }
        return RequestSpec(self._rid(), kind, CHAT, self._stream(body, stream))

    def _completion(
        self, kind: str, stream: bool, prompt: list[int], **sampling
    ) -> RequestSpec:
        body = {"prompt": prompt, **self._sampling(), **sampling}
        return RequestSpec(
            self._rid(),
            kind,
            COMPLETIONS,
            self._stream(body, stream),
            prompt_len=len(prompt),
        )

    def _any(self, kind: str, stream: bool | None = None, **sampling) -> RequestSpec:
        """A chat or completion request of ordinary length."""
        stream = self.rng.random() < 0.5 if stream is None else stream
        if self.rng.random() < 0.5:
            return self._chat(kind, stream, **sampling)
        length = self._length(1, self.ctx.max_model_len - 1)
        return self._completion(kind, stream, self._tokens(length), **sampling)

    # -- jobs -------------------------------------------------------------
    def job(self, kind: str) -> Job:
        rng, mml = self.rng, self.ctx.max_model_len
        if kind == "chat":
            return Job(kind, [self._chat(kind, rng.random() < 0.5)])
        if kind == "completion":
            prompt = self._tokens(self._length(1, mml - 1))
            return Job(kind, [self._completion(kind, rng.random() < 0.5, prompt)])
        if kind == "shared_prefix":
            prompt = self.prefix + self._tokens(self._length(1, 200))
            return Job(kind, [self._completion(kind, rng.random() < 0.5, prompt)])
        if kind == "conversation":
            # at most ~200 system + 4 x (90 user + 32 reply) tokens + template:
            # the whole conversation fits in max_model_len 1024
            turns = rng.randint(2, 4)
            specs = [
                self._chat(kind, rng.random() < 0.5, 20, max_tokens=rng.randint(4, 32))
                for _ in range(turns)
            ]
            return Job(kind, specs)
        if kind == "n_gt_1":
            # vLLM refuses n > 1 with greedy sampling
            spec = self._any(kind, n=rng.randint(2, 4), temperature=1.0)
            return Job(kind, [spec])
        if kind == "stop":
            return Job(kind, [self._any(kind, stop=list(rng.choice(STOP_SETS)))])
        if kind == "max_tokens_1":
            return Job(kind, [self._any(kind, max_tokens=1)])
        if kind == "max_tokens_large":
            high = self.ctx.large_max_tokens or mml
            spec = self._any(kind, max_tokens=rng.randint(min(200, high), high))
            return Job(kind, [spec])
        if kind == "too_long":
            if rng.random() < 0.3:
                # far beyond: every word is at least one token
                text = self._text(2 * mml, 2 * mml)
                spec = self._chat(kind, rng.random() < 0.5)
                spec.body["messages"][-1]["content"] = text
            else:
                length = rng.choice([mml, mml + 1, self._length(mml + 1, 3 * mml)])
                spec = self._completion(kind, rng.random() < 0.5, self._tokens(length))
            spec.expect = 400
            return Job(kind, [spec])
        if kind == "at_limit":
            # the longest prompt that fits: one token of room for the output
            prompt = self._tokens(mml - 1)
            return Job(kind, [self._completion(kind, rng.random() < 0.5, prompt)])
        if kind == "disconnect":
            spec = self._any(kind, stream=True, max_tokens=rng.randint(64, 256))
            spec.body["ignore_eos"] = True
            spec.disconnect_after = rng.randint(1, 6)
            return Job(kind, [spec])
        if kind == "drop":
            spec = self._any(kind, stream=False, max_tokens=rng.randint(32, 128))
            spec.disconnect_after = 0
            return Job(kind, [spec])
        raise ValueError(f"unknown job kind {kind!r}")

    def jobs(self, requests: int, burst: bool = False) -> list[Job]:
        """Jobs of the mix holding exactly ``requests`` requests. A burst has
        no conversations: every request is its own job, all sent at once."""
        kinds = [k for k in MIX if not (burst and k == "conversation")]
        weights = [MIX[k] for k in kinds]
        out: list[Job] = []
        left = requests
        while left > 0:
            job = self.job(self.rng.choices(kinds, weights)[0])
            job.specs = job.specs[:left]
            left -= len(job.specs)
            out.append(job)
        return out


def make_jobs(
    ctx: WorkloadContext, phase: str, requests: int, burst: bool = False
) -> list[Job]:
    return MixBuilder(ctx, phase).jobs(requests, burst)


def probe_specs(ctx: WorkloadContext, count: int, max_tokens: int) -> list[RequestSpec]:
    """Greedy probes: prompts shorter than one attention block, so no prefix
    cache hit can change how they are computed between the start and the end.
    """
    rng = random.Random(ctx.seed * 31 + 4)
    specs = []
    for i in range(count):
        length = [5, 40, 100][i % 3]
        prompt = [
            rng.randrange(FIRST_ORDINARY_ID, ctx.vocab_size) for _ in range(length)
        ]
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        specs.append(
            RequestSpec(f"probe:{i}", "probe", COMPLETIONS, body, prompt_len=length)
        )
    return specs

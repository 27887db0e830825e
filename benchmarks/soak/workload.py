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

from testing.loopback import CHAT, COMPLETIONS

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
LETTERS = "etaoinshrdlucmfwypvbgkqjxz"


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
    def n(self) -> int:
        return int(self.body.get("n", 1))


@dataclass
class Job:
    kind: str
    specs: list[RequestSpec] = field(default_factory=list)


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

    def rng(self, name: str) -> random.Random:
        return random.Random(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, self.vocab_size) for _ in range(n)]


class MixBuilder:
    """Draws jobs of the mix; ``rid`` values are ``phase:number``."""

    def __init__(self, ctx: WorkloadContext, phase: str) -> None:
        self.ctx, self.phase, self.count = ctx, phase, 0
        self.rng = ctx.rng(phase)
        words = ctx.rng("words")
        weights = range(26, 0, -1)
        self.words = [
            "".join(words.choices(LETTERS, weights, k=words.randint(2, 8)))
            for _ in range(300)
        ]
        # About 200 tokens every chat request shares, and a token prefix.
        self.system = "You are a soak test. " + " ".join(
            ctx.rng("system").choices(self.words, k=45)
        )
        self.prefix = ctx.tokens(ctx.rng("prefix"), SHARED_PREFIX_TOKENS)

    def _length(self, low: int, high: int) -> int:
        """Log-uniform integer in [low, high]."""
        value = int(round(low * (high / low) ** self.rng.random()))
        return min(high, max(low, value))

    def _text(self, low: int, high: int) -> str:
        return " ".join(self.rng.choices(self.words, k=self.rng.randint(low, high)))

    def _spec(self, kind: str, endpoint: str, body: dict, **extra) -> RequestSpec:
        """Sampling drawn for every request, then ``body``'s own settings."""
        temperature = self.rng.choice([0.0, 0.0, 0.7, 1.0])
        sampling = {
            "max_tokens": self.rng.randint(2, 48),
            "temperature": temperature,
            "ignore_eos": self.rng.random() < 0.5,
        }
        seed = self.rng.randrange(2**31)
        if temperature > 0 and self.ctx.request_seeds:
            sampling["seed"] = seed
        body = {**sampling, **body}
        if body.pop("stream", self.rng.random() < 0.5):
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        self.count += 1
        return RequestSpec(f"{self.phase}:{self.count}", kind, endpoint, body, **extra)

    def chat(self, kind: str, words: int = 60, **body) -> RequestSpec:
        """The shared system prompt and 1 to ``words`` words (about 4.4
        tokens each with the tiny models' 960-token vocabulary)."""
        user = {"role": "user", "content": self._text(1, words)}
        messages = [{"role": "system", "content": self.system}, user]
        return self._spec(kind, CHAT, {"messages": messages, **body})

    def completion(self, kind: str, prompt: list[int], **body) -> RequestSpec:
        body = {"prompt": prompt, **body}
        return self._spec(kind, COMPLETIONS, body, prompt_len=len(prompt))

    def any(self, kind: str, **body) -> RequestSpec:
        """A chat or completion request of ordinary length."""
        if self.rng.random() < 0.5:
            return self.chat(kind, **body)
        length = self._length(1, self.ctx.max_model_len - 1)
        return self.completion(kind, self.ctx.tokens(self.rng, length), **body)

    def job(self, kind: str) -> Job:
        rng, mml, tokens = self.rng, self.ctx.max_model_len, self.ctx.tokens
        if kind == "chat":
            specs = [self.chat(kind)]
        elif kind == "completion":
            specs = [self.completion(kind, tokens(rng, self._length(1, mml - 1)))]
        elif kind == "shared_prefix":
            prompt = self.prefix + tokens(rng, self._length(1, 200))
            specs = [self.completion(kind, prompt)]
        elif kind == "conversation":
            # at most ~200 system + 4 x (90 user + 32 reply) tokens + template:
            # the whole conversation fits in max_model_len 1024
            turns = rng.randint(2, 4)
            specs = [
                self.chat(kind, 20, max_tokens=rng.randint(4, 32)) for _ in range(turns)
            ]
        elif kind == "n_gt_1":
            # vLLM refuses n > 1 with greedy sampling
            specs = [self.any(kind, n=rng.randint(2, 4), temperature=1.0)]
        elif kind == "stop":
            specs = [self.any(kind, stop=list(rng.choice(STOP_SETS)))]
        elif kind == "max_tokens_1":
            specs = [self.any(kind, max_tokens=1)]
        elif kind == "max_tokens_large":
            high = self.ctx.large_max_tokens or mml
            specs = [self.any(kind, max_tokens=rng.randint(min(200, high), high))]
        elif kind == "too_long":
            if rng.random() < 0.3:
                # far beyond: every word is at least one token
                specs = [self.chat(kind)]
                specs[0].body["messages"][-1]["content"] = self._text(2 * mml, 2 * mml)
            else:
                length = rng.choice([mml, mml + 1, self._length(mml + 1, 3 * mml)])
                specs = [self.completion(kind, tokens(rng, length))]
            specs[0].expect = 400
        elif kind == "at_limit":
            # the longest prompt that fits: one token of room for the output
            specs = [self.completion(kind, tokens(rng, mml - 1))]
        elif kind == "disconnect":
            specs = [
                self.any(
                    kind, stream=True, max_tokens=rng.randint(64, 256), ignore_eos=True
                )
            ]
            specs[0].disconnect_after = rng.randint(1, 6)
        elif kind == "drop":
            specs = [self.any(kind, stream=False, max_tokens=rng.randint(32, 128))]
            specs[0].disconnect_after = 0
        else:
            raise ValueError(f"unknown job kind {kind!r}")
        return Job(kind, specs)

    def jobs(self, requests: int, burst: bool = False) -> list[Job]:
        """Jobs of the mix holding exactly ``requests`` requests. A burst has
        no conversations: every request is its own job, all sent at once."""
        kinds = [k for k in MIX if not (burst and k == "conversation")]
        weights = [MIX[k] for k in kinds]
        out: list[Job] = []
        while requests > 0:
            job = self.job(self.rng.choices(kinds, weights)[0])
            job.specs = job.specs[:requests]
            requests -= len(job.specs)
            out.append(job)
        return out


def make_jobs(
    ctx: WorkloadContext, phase: str, requests: int, burst: bool = False
) -> list[Job]:
    return MixBuilder(ctx, phase).jobs(requests, burst)


def probe_specs(ctx: WorkloadContext, count: int, max_tokens: int) -> list[RequestSpec]:
    """Greedy probes: prompts shorter than one attention block, so no prefix
    cache hit can change how they are computed between the start and the end."""
    rng = ctx.rng("probes")
    body = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return [
        RequestSpec(
            f"probe:{i}",
            "probe",
            COMPLETIONS,
            {"prompt": ctx.tokens(rng, n), **body, "return_token_ids": True},
            prompt_len=n,
        )
        for i, n in enumerate([5, 40, 100][i % 3] for i in range(count))
    ]

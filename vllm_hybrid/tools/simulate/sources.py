"""What arrives at a simulated engine, and when.

A workload hands the driver the requests due at the modeled time (``due``),
says when the next one is due when it knows (``next_arrival``), and hears
about every finished request (``finished``), so that closed-loop workloads
can build a conversation's next turn from its reply. Open-loop traces
arrive at their timestamps; the project's own workloads
(:mod:`vllm_hybrid.tools.workloads`) arrive as their benchmark sends them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hybrid.tools import workloads
from vllm_hybrid.tools.simulate.followups import (
    FollowupRecord,
    ReplySegment,
    prompt_of,
)
from vllm_hybrid.tools.simulate.trace import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRecord,
    prompt_tokens,
)
from vllm_hybrid.tools.tracegen.common import require


@dataclass
class SimRequest:
    """One request to add to the engine."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival_s: float


class Workload:
    """Base of the workloads: nothing due, nothing known."""

    name = "workload"
    #: requests in all, when known in advance (for the progress bar)
    total: int | None = None
    #: whether ``finished`` needs the reply tokens
    needs_replies = False
    #: whether the run counts the prompt tokens no cache could have served
    #: (:mod:`.floor`)
    reports_floor = False

    def due(self, now: float) -> list[SimRequest]:
        return []

    def next_arrival(self) -> float | None:
        return None

    def finished(self, request_id: str, reply: Sequence[int], now: float) -> None:
        return None


class TraceWorkload(Workload):
    """Trace records arriving at their timestamps (open loop)."""

    name = "mooncake"

    def __init__(
        self,
        records: list[TraceRecord],
        vocab_size: int,
        block: int = MOONCAKE_BLOCK_TOKENS,
    ) -> None:
        self.records = records
        self.vocab_size = vocab_size
        #: tokens per hash id
        self.block = block
        self.position = 0
        self.total = len(records)

    def due(self, now: float) -> list[SimRequest]:
        out = []
        while (
            self.position < len(self.records)
            and self.records[self.position].arrival_s <= now
        ):
            record = self.records[self.position]
            self.position += 1
            out.append(
                SimRequest(
                    f"trace-{record.index}",
                    prompt_tokens(record, self.vocab_size, self.block),
                    max(1, record.output_length),
                    record.arrival_s,
                )
            )
        return out

    def next_arrival(self) -> float | None:
        if self.position < len(self.records):
            return self.records[self.position].arrival_s
        return None


class FollowupWorkload(Workload):
    """A trace with follow-ups (:mod:`.followups`): a request is sent once
    every request it refers to has finished, at its timestamp or its delay
    after the request it follows, whichever is later; its reply segments
    are the tokens the engine generated."""

    name = "followups"
    needs_replies = True
    reports_floor = True

    def __init__(self, records: list[FollowupRecord], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.total = len(records)
        self.records = {r.request_id: r for r in records}
        #: replies kept only for the requests a reply segment names
        self.quoted = {
            s.reply_of
            for r in records
            for s in r.segments
            if isinstance(s, ReplySegment)
        }
        self.replies: dict[str, list[int]] = {}
        self.finished_at: dict[str, float] = {}
        #: id -> references not finished yet; id -> requests waiting on it
        self.blocked: dict[str, int] = {}
        self.waiters: dict[str, list[str]] = {}
        #: (time it may be sent, line, id) of requests with nothing to wait for
        self.ready: list[tuple[float, int, str]] = []
        for record in records:
            refs = record.references()
            for ref in refs:
                self.waiters.setdefault(ref, []).append(record.request_id)
            if refs:
                self.blocked[record.request_id] = len(refs)
            else:
                self._release(record)

    def _release(self, record: FollowupRecord) -> None:
        if record.after is None:
            when = record.arrival_s or 0.0
            for segment in record.segments:
                if isinstance(segment, ReplySegment):
                    when = max(when, self.finished_at[segment.reply_of])
        else:
            when = self.finished_at[record.after] + record.delay_s
        heapq.heappush(self.ready, (when, record.line, record.request_id))

    def due(self, now: float) -> list[SimRequest]:
        out = []
        while self.ready and self.ready[0][0] <= now:
            when, _, request_id = heapq.heappop(self.ready)
            record = self.records.pop(request_id)
            prompt = prompt_of(record, self.replies, self.vocab_size)
            out.append(SimRequest(request_id, prompt, record.output_length, when))
        return out

    def next_arrival(self) -> float | None:
        return self.ready[0][0] if self.ready else None

    def finished(self, request_id: str, reply: Sequence[int], now: float) -> None:
        self.finished_at[request_id] = now
        if request_id in self.quoted:
            self.replies[request_id] = list(reply)
        for waiter in self.waiters.pop(request_id, []):
            self.blocked[waiter] -= 1
            if self.blocked[waiter] == 0:
                del self.blocked[waiter]
                self._release(self.records[waiter])


@dataclass(frozen=True)
class ChatServerShape:
    """Sizes of the chat_server workload."""

    conversations: int = 32
    turns: int = 6
    system_len: int = 1000
    user_min: int = 40
    user_max: int = 160
    output: int = 32
    concurrency: int = 8
    seed: int = 0

    def check(self) -> None:
        for name in ("conversations", "turns", "output", "concurrency"):
            require(getattr(self, name) >= 1, f"{name} must be at least 1")
        require(self.user_min >= 1, "user_min must be at least 1")
        require(self.user_min <= self.user_max, "user_min must be <= user_max")


class ChatServerWorkload(Workload):
    """Interleaved conversations: turns in a seeded order over all
    conversations, at most ``concurrency`` in flight; the next turn in the
    order goes out as soon as a slot is free and its conversation's previous
    turn has finished (until then it holds the queue). Each prompt is the
    conversation so far (system prompt, earlier user turns and replies) plus
    new user tokens."""

    name = "chat_server"
    needs_replies = True

    def __init__(self, shape: ChatServerShape, vocab: Sequence[int]) -> None:
        self.shape = shape
        self.vocab = vocab
        self.order = workloads.chat_server_order(
            shape.seed, shape.conversations, shape.turns
        )
        system = workloads.chat_server_system(shape.seed, vocab, shape.system_len)
        self.histories = [list(system) for _ in range(shape.conversations)]
        self.sent: dict[str, tuple[int, list[int]]] = {}
        self.busy: set[int] = set()
        self.position = 0
        self.total = len(self.order)

    def due(self, now: float) -> list[SimRequest]:
        shape = self.shape
        out = []
        while self.position < len(self.order) and len(self.busy) < shape.concurrency:
            conv, turn = self.order[self.position]
            if conv in self.busy:
                break
            user = workloads.chat_server_user(
                shape.seed, self.vocab, conv, turn, shape.user_min, shape.user_max
            )
            prompt = self.histories[conv] + user
            request_id = f"chat{conv}-turn{turn}"
            self.sent[request_id] = (conv, prompt)
            self.busy.add(conv)
            self.position += 1
            out.append(SimRequest(request_id, prompt, shape.output, now))
        return out

    def finished(self, request_id: str, reply: Sequence[int], now: float) -> None:
        conv, prompt = self.sent.pop(request_id)
        self.histories[conv] = prompt + list(reply)
        self.busy.discard(conv)


@dataclass(frozen=True)
class MultiTurnShape:
    """Sizes of the multi_turn workload."""

    conversations: int = 6
    turns: int = 5
    system_len: int = 1200
    user_len: int = 100
    output: int = 32
    seed: int = 0

    def check(self) -> None:
        for name in ("conversations", "turns", "user_len", "output"):
            require(getattr(self, name) >= 1, f"{name} must be at least 1")


class MultiTurnWorkload(Workload):
    """Conversations sharing a system prompt, turn by turn: every
    conversation's next turn goes out when all of this turn has finished."""

    name = "multi_turn"
    needs_replies = True

    def __init__(self, shape: MultiTurnShape, vocab: Sequence[int]) -> None:
        self.shape = shape
        self.vocab = vocab
        system = workloads.multi_turn_system(shape.seed, vocab, shape.system_len)
        self.histories = [list(system) for _ in range(shape.conversations)]
        self.turn = 0
        self.open: dict[str, tuple[int, list[int]]] = {}
        self.total = shape.conversations * shape.turns

    def due(self, now: float) -> list[SimRequest]:
        shape = self.shape
        if self.open or self.turn >= shape.turns:
            return []
        out = []
        for conv, history in enumerate(self.histories):
            user = workloads.multi_turn_user(
                shape.seed, self.vocab, conv, self.turn, shape.user_len
            )
            request_id = f"conv{conv}-turn{self.turn}"
            self.open[request_id] = (conv, history + user)
            out.append(SimRequest(request_id, history + user, shape.output, now))
        self.turn += 1
        return out

    def finished(self, request_id: str, reply: Sequence[int], now: float) -> None:
        conv, prompt = self.open.pop(request_id)
        self.histories[conv] = prompt + list(reply)


@dataclass(frozen=True)
class ManyShortShape:
    """Sizes of the many_short workload."""

    requests: int = 64
    min_len: int = 64
    max_len: int = 512
    output: int = 32
    seed: int = 0

    def check(self) -> None:
        for name in ("requests", "min_len", "output"):
            require(getattr(self, name) >= 1, f"{name} must be at least 1")
        require(self.min_len <= self.max_len, "min_len must be <= max_len")


class ManyShortWorkload(Workload):
    """Independent short prompts, all at time 0."""

    name = "many_short"

    def __init__(self, shape: ManyShortShape, vocab: Sequence[int]) -> None:
        self.prompts = workloads.many_short_prompts(
            shape.seed, vocab, shape.requests, shape.min_len, shape.max_len
        )
        self.output = shape.output
        self.sent = False
        self.total = shape.requests

    def due(self, now: float) -> list[SimRequest]:
        if self.sent:
            return []
        self.sent = True
        return [
            SimRequest(f"short{i}", prompt, self.output, now)
            for i, prompt in enumerate(self.prompts)
        ]


#: The project's workloads by name: their shape (``--shape``) and class.
CLOSED_LOOP: dict[str, tuple[type, type[Workload]]] = {
    "chat_server": (ChatServerShape, ChatServerWorkload),
    "multi_turn": (MultiTurnShape, MultiTurnWorkload),
    "many_short": (ManyShortShape, ManyShortWorkload),
}

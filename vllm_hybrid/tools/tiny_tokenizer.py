"""The tokenizer of the tiny models: a small BPE trained on a generated corpus.

Deterministic and offline: the corpus comes from a seeded word generator (no
download), and the tokenizer is trained on it in about a second. ChatML
special tokens and chat template, as Qwen instruct models use them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

#: Long enough for ~4k-token benchmark prompts plus generation.
MAX_POSITION_EMBEDDINGS = 32768
#: Target size of the trained tokenizer, special tokens included.
TOKENIZER_VOCAB_SIZE = 1024
#: The model's embedding rows are padded to a multiple of this.
VOCAB_MULTIPLE = 64

# ChatML, as used by Qwen instruct models: each turn is wrapped in
# <|im_start|>ROLE\n ... <|im_end|>\n and the generation prompt opens an
# assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenIds:
    """Ids of the special tokens, fed into the model and generation configs."""

    endoftext: int
    im_start: int
    im_end: int


def _words(text: str) -> tuple[str, ...]:
    """Split a word list written as one string (keeps the lists readable)."""
    return tuple(text.split())


_NOUNS = _words(
    "cache block layer model token state kernel engine request server queue "
    "memory page buffer river mountain garden window teacher student city "
    "market letter music picture question answer number system program "
    "network signal forest ocean village journey morning evening story "
    "library machine engineer doctor artist friend family history science "
    "weather season planet island bridge road train ship computer language"
)
_VERBS = _words(
    "reads writes stores loads builds moves holds finds keeps sends opens "
    "closes carries follows learns teaches measures watches answers shares "
    "computes allocates frees schedules returns prints checks grows changes"
)
_ADJECTIVES = _words(
    "small large quick slow bright quiet early late simple careful hybrid "
    "linear random modern ancient green blue warm cold heavy light empty "
    "full gentle strong narrow wide young old clever patient busy"
)
_DETERMINERS = _words("the a this that every each some many few one two three")
_PREPOSITIONS = _words("in on under over near after before with without through")
_ADVERBS = _words("often rarely always never quickly slowly again today here")
_SYLLABLES = _words("ka ri to me sa lo vin dra pel mor tu qua zen fi bo len ar ust")
_QUESTIONS = ("What", "Where", "When", "Why", "How", "Who")
_CODE_LINES = (
    "def step(x):\n    return x + 1\n",
    "for i in range(10):\n    print(i * 2)\n",
    'if name == "main":\n    run(config)\n',
    "x = [1, 2, 3]\ny = {'a': 1, 'b': 2}\n",
)


def _noun_phrase(rng: random.Random) -> str:
    """Determiner, optional adjective and noun, e.g. 'the quiet river'."""
    words: list[str] = []
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(_invented_word(rng) if rng.random() < 0.15 else rng.choice(_NOUNS))
    determiner = rng.choice(_DETERMINERS)
    if determiner == "a" and words[0][0] in "aeiou":
        determiner = "an"
    return " ".join([determiner, *words])


def _invented_word(rng: random.Random) -> str:
    """A pseudo-word from syllables, so BPE learns sub-word merges too."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def _sentence(rng: random.Random) -> str:
    """One English-like sentence, statement or question."""
    subject = _noun_phrase(rng)
    body = f"{rng.choice(_VERBS)} {_noun_phrase(rng)}"
    if rng.random() < 0.5:
        body += f" {rng.choice(_PREPOSITIONS)} {_noun_phrase(rng)}"
    if rng.random() < 0.3:
        body += f" {rng.choice(_ADVERBS)}"
    if rng.random() < 0.2:
        return f"{rng.choice(_QUESTIONS)} {subject} {body}?"
    if rng.random() < 0.15:
        body += f", number {rng.randint(0, 9999)}"
    return f"{subject[0].upper()}{subject[1:]} {body}."


def _chat_snippet(rng: random.Random) -> str:
    """A dialogue, so the role names of chat prompts get their own merges.

    The special tokens themselves stay out of the corpus: they are atomic
    added tokens and training on their pieces would only waste merges.
    """
    user = _sentence(rng)
    reply = " ".join(_sentence(rng) for _ in range(2))
    return f"user\n{user}\nassistant\n{reply}\n"


def build_corpus(num_paragraphs: int = 240, seed: int = 1234) -> str:
    """Generate the fixed training corpus for the tokenizer.

    The corpus comes from a private PRNG with a constant seed, so it (and
    therefore the tokenizer) is identical across builds, machines and model
    seeds; only the weights depend on the model seed.
    """
    rng = random.Random(seed)
    parts: list[str] = []
    for index in range(num_paragraphs):
        if index % 12 == 0:
            parts.append(rng.choice(_CODE_LINES))
        elif index % 5 == 0:
            parts.append(_chat_snippet(rng))
        else:
            parts.append(" ".join(_sentence(rng) for _ in range(rng.randint(2, 5))))
    return "\n\n".join(parts) + "\n"


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer on :func:`build_corpus`.

    Byte-level BPE can encode any string, so prompts outside the tiny corpus
    still work; the special tokens come first so their ids are 0, 1, 2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(build_corpus().split("\n\n"), trainer=trainer)
    return tokenizer


def save_tokenizer(out_dir: Path) -> tuple[int, TokenIds]:
    """Write the tokenizer files; return its length and special token ids."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    _portable_tokenizer_class(out_dir / "tokenizer_config.json")
    ids = TokenIds(
        endoftext=fast.convert_tokens_to_ids(ENDOFTEXT),
        im_start=fast.convert_tokens_to_ids(IM_START),
        im_end=fast.convert_tokens_to_ids(IM_END),
    )
    return len(fast), ids


def _portable_tokenizer_class(config_path: Path) -> None:
    """Name the tokenizer class in a way every transformers version knows.

    transformers 5 records its new ``TokenizersBackend`` name, which 4.x
    cannot resolve; ``PreTrainedTokenizerFast`` maps to the same class in 5.x
    and to the fast tokenizer in 4.x.
    """
    data = json.loads(config_path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def padded_vocab_size(tokenizer_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Round the embedding size up, as real checkpoints do for kernel speed."""
    return -(-tokenizer_size // multiple) * multiple


# ---------------------------------------------------------------------------

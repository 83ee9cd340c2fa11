"""Tiny random-weight Hugging Face models and tokenizers, built offline for tests and benchmarks.

`make_random_model(dir, "llama")` writes a directory that `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` both load, so the engine and Hugging Face can be compared
token for token without downloading anything.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
_SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]  # ids 0, 1, 2
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# a minimal chat template for tests of chat(): `<|role|>` headers, each turn ended by eos
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, my name is Alice and I live in a small town by the sea.",
    "The capital of France is Paris, and the capital of Korea is Seoul.",
    "Explain quantum mechanics to me in simple words, please.",
    "Once upon a time, in a land far away, there lived a curious little robot.",
    "Write a short poem about the spring rain and the first flowers of the year.",
    "The future of artificial intelligence depends on careful engineering and honest testing.",
    "A paged key-value cache splits the memory of each sequence into fixed-size blocks.",
    "The scheduler decides which requests run in the next step and which ones wait.",
    "When memory runs out, a running request is preempted: swapped to the CPU or recomputed.",
    "Large language models predict the next token given all the tokens that came before.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "In the beginning the universe was created. This has made a lot of people very angry.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "The weather today is sunny with a light breeze from the west and no chance of rain.",
    "Please summarize the following article in three sentences or fewer.",
    "What is the difference between a list and a tuple in Python?",
    "The mitochondria is the powerhouse of the cell, or so the textbooks tell us.",
    "Numbers like 3.14159, 2.71828, 1024 and 65536 appear often in computer science.",
    "The train leaves at 9:45 in the morning and arrives at 3:30 in the afternoon.",
    "He opened the old wooden door slowly and stepped into the dark, silent library.",
    "Rotary position embeddings rotate each pair of query and key features by an angle.",
    "Grouped-query attention shares one key and value head among several query heads.",
]

_KOREAN = [
    "양자역학 설명해줄래?",
    "재미있는 이야기 들려줘",
    "봄에 관한 시를 써줄래?",
    "안녕하세요, 만나서 반갑습니다. 오늘 날씨가 정말 좋네요.",
    "서울은 대한민국의 수도이며 인구가 가장 많은 도시입니다.",
    "인공지능은 우리의 삶을 빠르게 바꾸고 있습니다.",
    "옛날 옛적에 작은 마을에 호기심 많은 소녀가 살았습니다.",
    "저는 커피보다 차를 더 좋아해요. 특히 녹차를 자주 마셔요.",
    "봄비가 내리면 꽃이 피고, 여름이 오면 바다에 갑니다.",
    "이 문장을 영어로 번역해 주세요.",
    "한국어와 영어를 함께 사용하는 모델을 만들고 있습니다.",
    "내일 아침 아홉 시에 회의가 있으니 늦지 마세요.",
]

_EMOJI = [
    "I love pizza 🍕 and ice cream 🍦!",
    "Good morning ☀️ have a great day 😊",
    "🚀 Launch in 3... 2... 1... 🎉🎉🎉",
    "Cats 🐱 and dogs 🐶 are friends 💕",
    "The weather: 🌧️ then ⛅ then 🌈",
    "축하해요 🎂🥳 생일 축하합니다!",
    "Family: 👨‍👩‍👧‍👦 flags: 🇰🇷 🇫🇷 🇺🇸 thumbs: 👍🏽",
]

_CODE = [
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "for i in range(10):\n    print(i * i)",
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T",
    'if __name__ == "__main__":\n    main()',
    "class Block:\n    def __init__(self, block_id: int) -> None:\n        self.id = block_id",
]

_LONG_ENGLISH = " ".join(
    [
        "Once upon a time, in a land far away, there lived a curious little robot named Pip.",
        "Pip had been built by an old clockmaker who lived at the edge of a quiet village,",
        "where the river bent twice before it reached the sea. Every morning Pip rolled down",
        "the hill to the market, counted the apples, greeted the baker, and listened to the",
        "stories that the fishermen told about storms, whales and islands that moved at night.",
        "One day a stranger arrived with a map that nobody could read. The lines on the map",
        "changed whenever the wind blew, and the names of the towns were written in numbers",
        "instead of letters: 17, 42, 1024, 3.14159. The baker laughed, the fishermen shook their",
        "heads, but Pip looked at the map for a long time and noticed a pattern in the numbers.",
        "Each number was the count of steps from one landmark to the next. Pip set off at dawn,",
        "counting steps, past the mill, over the stone bridge, through the forest of tall pines,",
        "until the count reached the last number on the map and the path ended at a small door",
        "in the side of a hill. Behind the door was a library full of books about the sea.",
    ]
)

_LONG_KOREAN = " ".join(
    [
        "옛날 옛적에 작은 마을에 호기심 많은 소녀가 살았습니다. 소녀는 매일 아침 언덕에",
        "올라 바다를 바라보며 먼 나라에 대한 이야기를 상상했습니다. 어느 봄날, 봄비가",
        "그치고 꽃이 피기 시작했을 때, 소녀는 바닷가에서 오래된 병 하나를 발견했습니다.",
        "병 안에는 아무도 읽을 수 없는 글씨로 쓰인 지도가 들어 있었습니다. 마을 사람들은",
        "모두 고개를 저었지만, 소녀는 지도를 오랫동안 들여다보며 숨겨진 규칙을 찾아냈습니다.",
        "그 규칙을 따라 숲을 지나고 돌다리를 건너자, 언덕 옆에 작은 문이 나타났습니다.",
    ]
)

_LONG_MIXED = " ".join(
    [
        "Question: what is the difference between a list and a tuple in Python? 🤔",
        "Answer: a list is mutable, a tuple is not. 리스트는 바꿀 수 있고 튜플은 바꿀 수 없습니다.",
        "Example:\nfor i in range(10):\n    print(i * i)\n",
        "A paged key-value cache splits the memory of each sequence into fixed-size blocks,",
        "and the scheduler decides which requests run in the next step and which ones wait. 🚀",
        "When memory runs out, a running request is preempted: swapped to the CPU or recomputed.",
        "Grouped-query attention shares one key and value head among several query heads. 👍🏽",
        "인공지능은 우리의 삶을 빠르게 바꾸고 있습니다. The future of artificial intelligence",
        "depends on careful engineering and honest testing. 축하해요 🎂🥳",
    ]
)

# Mixed lengths on purpose: one-token-ish prompts, Korean, emoji, code, and three long prompts
# (a few hundred tokens each) so that prefill spans many KV blocks.
HF_PROMPTS: list[str] = [
    "Hello, my name is",
    "양자역학 설명해줄래?",
    "The capital of France is",
    "재미있는 이야기 들려줘 🐱",
    _LONG_ENGLISH,
    "봄에 관한 시를 써줄래?",
    "I love pizza 🍕 and",
    _LONG_KOREAN,
    "def fibonacci(n: int) -> int:\n",
    _LONG_MIXED,
    "Hi",
]


def default_corpus() -> list[str]:
    """The built-in training text: English, Korean, emoji and code, each line repeated a little."""
    lines = _ENGLISH + _KOREAN + _EMOJI + _CODE + [_LONG_ENGLISH, _LONG_KOREAN, _LONG_MIXED]
    # Repetition gives frequent words enough weight to be merged before rare byte pairs.
    return lines * 3


def train_bpe_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 512,
    corpus: Iterable[str] | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (Llama-3 style, bos added on encode) and save it,
    with `chat_template` (e.g. `CHAT_TEMPLATE`) if given; without one it has none.

    Training is deterministic for a given corpus. If the corpus runs out of merges before
    `vocab_size`, the vocabulary is padded with `<unused_i>` tokens so that every id a model
    with `vocab_size` logits can produce still decodes.
    """
    if vocab_size < 256 + len(_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover 256 bytes and 3 special tokens, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(default_corpus() if corpus is None else corpus), trainer)
    return _save_tokenizer(tokenizer, out_dir, vocab_size, chat_template)


def _save_tokenizer(
    tokenizer: Tokenizer, out_dir: str | Path, vocab_size: int, chat_template: str | None
) -> PreTrainedTokenizerFast:
    # Plain (not special) tokens, so that benchmark output made of them still detokenizes to text.
    num_unused = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_tokens([AddedToken(f"<unused_{i}>") for i in range(num_unused)])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        hf_tokenizer.chat_template = chat_template
    hf_tokenizer.save_pretrained(str(out_dir))
    # transformers 5 writes its own class name, which 4.x cannot resolve; this alias loads in both.
    config_path = Path(out_dir) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return hf_tokenizer


def train_sentencepiece_tokenizer(
    out_dir: str | Path, vocab_size: int = 512, corpus: Iterable[str] | None = None
) -> PreTrainedTokenizerFast:
    """Train a SentencePiece-style BPE tokenizer (Llama-2's as transformers converts it: "▁"
    for spaces, byte-fallback tokens `<0x00>`..`<0xFF>`, a decoder that strips the text's
    leading space, bos added on encode) and save it; special ids as `train_bpe_tokenizer`'s.
    """
    num_fixed = len(_SPECIAL_TOKENS) + 256
    if vocab_size <= num_fixed:
        raise ValueError(f"vocab_size must exceed 3 special and 256 byte tokens, got {vocab_size}")
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = metaspace
    # few characters of their own: the rest (most Korean, emoji) fall back to bytes
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_fixed, limit_alphabet=64, show_progress=False
    )
    trained.train_from_iterator(list(default_corpus() if corpus is None else corpus), trainer)
    model_json = json.loads(trained.to_str())["model"]
    pieces = sorted(model_json["vocab"], key=model_json["vocab"].get)
    fixed = _SPECIAL_TOKENS + [f"<0x{b:02X}>" for b in range(256)]
    vocab = {piece: i for i, piece in enumerate(fixed + pieces)}
    # tokenizers writes each merge as a pair (an "a b" string in older releases)
    pairs = [m.split(" ") if isinstance(m, str) else m for m in model_json["merges"]]
    merges = [(str(left), str(right)) for left, right in pairs]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tokenizer.pre_tokenizer = metaspace
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(_SPECIAL_TOKENS)
    return _save_tokenizer(tokenizer, out_dir, vocab_size, chat_template=None)


def make_random_model(
    out_dir: str | Path,
    family: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 512,
    chat_template: str | None = None,
    tokenizer_kind: str = "byte_level",
    **config_overrides: Any,
) -> Path:
    """Write a small random-weight `*ForCausalLM` of `family` plus its tokenizer (with
    `chat_template`, if given; `tokenizer_kind` "byte_level" or "sentencepiece") to `out_dir`.

    Defaults: hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA). llama uses Llama-3 rope
    scaling (from an original context of 256, so it changes outputs at test lengths); qwen2 has
    qkv bias; qwen3 has an explicit head_dim, q/k norms and tied embeddings. Any config field
    can be overridden by keyword; bos/eos/pad ids follow the tokenizer (ids 0, 1, 2).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_kind == "sentencepiece":
        tokenizer = train_sentencepiece_tokenizer(out, vocab_size=vocab_size)
    elif tokenizer_kind == "byte_level":
        tokenizer = train_bpe_tokenizer(out, vocab_size=vocab_size, chat_template=chat_template)
    else:
        raise ValueError(
            f"tokenizer_kind must be byte_level or sentencepiece, got {tokenizer_kind!r}"
        )
    special_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = _make_config(family, vocab_size, {**special_ids, **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model)
    for name in special_ids:  # from the config, so that overrides of these ids apply here too
        setattr(model.generation_config, name, getattr(config, name))
    model.to(_DTYPES[dtype])
    model.config.dtype = dtype
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def make_sized_llama(out_dir: str | Path, hidden_size: int, num_layers: int) -> Path:
    """A random Llama of the given width and depth, shaped like real ones: an MLP 3x as wide,
    64-wide attention heads, one KV head per 4 query heads (at least one), 2048 tokens."""
    return make_random_model(
        out_dir,
        "llama",
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=max(1, hidden_size // 256),
        vocab_size=2048,
    )


def _make_config(family: str, vocab_size: int, overrides: dict[str, Any]) -> PretrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    per_family: dict[str, dict[str, Any]] = {
        "llama": {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                # far below max_position_embeddings so the scaled frequencies matter in tests
                "original_max_position_embeddings": 256,
            },
        },
        "mistral": {
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "qwen2": {
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "qwen3": {
            "head_dim": 32,  # not hidden_size // num_attention_heads, to catch that assumption
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    }
    if family not in per_family:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return AutoConfig.for_model(family, **{**common, **per_family[family], **overrides})


@torch.no_grad()
def make_random_lora(
    out_dir: str | Path,
    model_dir: str | Path,
    *,
    seed: int = 0,
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Iterable[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write a PEFT LoRA adapter with random A and B for the model at `model_dir`.

    PEFT starts B at zero (the adapter is then a no-op); here both are drawn so that each
    adapter visibly changes greedy outputs. `config_overrides` go to `peft.LoraConfig`.
    """
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        **config_overrides,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" in name:
            # (out, in): a delta about as large as the base layer's output, over all ranks
            fan_in = param.shape[1]
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(noise * (0.5 / math.sqrt(fan_in)))
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@torch.no_grad()
def _init_weights(model: PreTrainedModel) -> None:
    """Re-draw every weight so that greedy outputs are varied, context-dependent and unambiguous.

    HF's default init (std 0.02 everywhere) makes logits nearly flat, so greedy picks would hinge
    on float rounding. Here linear layers are slightly expanding (gain 1.5) and embeddings small,
    so the residual stream is dominated by attention and MLP outputs: outputs depend on the whole
    context, and a tied lm_head does not just repeat the input token. The final norm is scaled up
    to spread the logits. Norm weights and biases are non-trivial so loading them wrongly shows.
    """
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
            if name == "model.norm.weight":
                param.mul_(2.0)
        elif name.endswith("bias"):
            param.normal_(0.0, 0.5)
        elif "embed_tokens" in name:
            param.normal_(0.0, 0.1)
        else:
            # nn.Linear weights are (out_features, in_features)
            param.normal_(0.0, 1.5 / math.sqrt(param.shape[1]))


# -- test hooks for `asyncengine serve` ------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1 for servers a test or benchmark starts.

    They are held open together while chosen: ports picked one at a time can repeat, and two
    listeners with SO_REUSEPORT (HAProxy's frontends) then share one port, the kernel
    splitting connections between them.
    """
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def fake_llm_engine(engine_args: Any) -> Any:
    """An LLMEngine whose runner scripts tokens instantly (benchmarks, balancing tests)."""
    from asyncengine.engine.llm_engine import LLMEngine
    from asyncengine.logging import get_logger
    from asyncengine.worker.fake_runner import FakeModelRunner, count_up

    config = engine_args.create_engine_config()
    vocab_size = int(config.model_config.hf_config.vocab_size)
    get_logger(__name__).warning("fake_runner", note="tokens are scripted; the model does not run")
    return LLMEngine(config, FakeModelRunner(config, count_up(vocab_size)))


def fake_engine(engine_args: Any) -> Any:
    """An in-process AsyncLLMEngine over `fake_llm_engine`."""
    from asyncengine.engine.async_llm_engine import AsyncLLMEngine

    return AsyncLLMEngine(fake_llm_engine(engine_args))


def fail_after_steps(engine: Any, fault_at: int) -> Any:
    """Make the LLMEngine's `fault_at`-th step (and every later one) raise: the engine dies."""
    execute, num_steps = engine.execute, 0

    def failing_execute(plan: Any) -> Any:
        nonlocal num_steps
        num_steps += 1
        if num_steps >= fault_at:
            raise RuntimeError(f"injected fault at step {fault_at}")
        return execute(plan)

    engine.execute = failing_execute
    return engine


def hooked_llm_engine(
    engine_args: Any,
    fake_runner: bool = False,
    fault_at: int | None = None,
    step_delay_s: float = 0.0,
) -> Any:
    """The LLMEngine the test hooks ask for: scripted tokens, a fault at the `fault_at`-th
    step, `step_delay_s` more per step. Module-level, so an engine process can build it."""
    import time

    from asyncengine.engine.llm_engine import LLMEngine

    make = fake_llm_engine if fake_runner else LLMEngine.from_engine_args
    engine: Any = make(engine_args)
    if fault_at is not None:
        fail_after_steps(engine, fault_at)
    if step_delay_s:
        execute = engine.execute

        def slow_execute(plan: Any) -> Any:
            time.sleep(step_delay_s)
            return execute(plan)

        engine.execute = slow_execute
    return engine


def serve_main(argv: list[str] | None = None) -> int:
    """`python -m asyncengine.testing serve ...`: `asyncengine serve` with three test hooks,
    `--fake-runner` (scripted tokens, no model), `--fault-after-steps N` (the Nth step
    raises) and `--step-delay S` (every step takes S seconds more). Never for production:
    the hooks exist to test and measure the server itself."""
    import argparse
    import sys

    from asyncengine.server import cli

    hooks = argparse.ArgumentParser(add_help=False)
    hooks.add_argument("--fake-runner", action="store_true")
    hooks.add_argument("--fault-after-steps", type=int, default=None)
    hooks.add_argument("--step-delay", type=float, default=0.0)
    ns, rest = hooks.parse_known_args(sys.argv[1:] if argv is None else argv)

    # by its module's name: run as `python -m asyncengine.testing`, this module is __main__,
    # which the engine process does not import
    from asyncengine import testing

    factory = functools.partial(
        testing.hooked_llm_engine,
        fake_runner=ns.fake_runner,
        fault_at=ns.fault_after_steps,
        step_delay_s=ns.step_delay,
    )
    return cli.main(rest, factory)


if __name__ == "__main__":
    raise SystemExit(serve_main())


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run the block with `num_threads` intra-op threads, then restore the previous count.

    Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP workers spinning
    against each other make a tiny forward ~50x slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

"""Speculative decoding (issue 29): drafts checked in one forward change no greedy token, keep
the sampled distribution, and give back every draft slot."""

from __future__ import annotations

import random

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.core.ngram import NgramIndex
from asyncengine.core.request import Request
from asyncengine.core.spec_decode import SpecDecodeStats
from asyncengine.sampling_params import StructuredOutputsParams
from asyncengine.server.metrics import _spec_decode_metrics
from asyncengine.worker.rejection_sampler import verify
from asyncengine.worker.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
# prompts that repeat themselves, so that prompt lookup has something to propose
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 4,
    [20, 21, 22, 23] * 6 + [30, 31],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50] * 3,
    list(range(60, 80)) + list(range(60, 70)),
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def make_llm(model_dir, speculative_config=None, **overrides) -> LLM:
    args = {"device": "cpu", "dtype": "float32", "max_num_seqs": 16}
    return LLM(
        model=str(model_dir("llama")), speculative_config=speculative_config,
        **{**args, **overrides},
    )  # fmt: skip


def spec_stats(llm: LLM) -> SpecDecodeStats:
    policy = llm.llm_engine.scheduler.spec
    assert policy is not None
    return policy.stats


def token_ids(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in out.outputs] for out in outs]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    llm.llm_engine.block_manager.check_invariants()


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "drafts"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 2, 1, 3, [4, 1]),  # the longest suffix, [1, 2, 3]
        ([1, 2, 9, 1, 2, 7, 1, 2], 3, 1, 2, [7, 1, 2]),  # its latest earlier occurrence
        ([5, 1, 2, 9, 2], 2, 1, 2, [9, 2]),  # [1, 2] is not found, [2] is
        ([5, 1, 2, 9, 2], 2, 2, 2, []),  # ... unless n must be 2
        ([1, 2, 3], 4, 1, 4, []),  # nothing repeats
        ([7, 7], 4, 1, 4, [7]),  # no more than what followed
    ],
)
def test_ngram_lookup(tokens, k, min_n, max_n, drafts) -> None:
    assert NgramIndex(min_n, max_n).lookup(tokens, k) == drafts


def plain_search(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for end in range(len(tokens) - 2, n - 2, -1):  # the latest first
            if tokens[end - n + 1 : end + 1] == tokens[-n:]:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_ngram_lookup_agrees_with_a_plain_search() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(1, 40))]
        k, min_n = rng.randint(1, 6), rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        want = plain_search(tokens, k, min_n, max_n)
        assert NgramIndex(min_n, max_n).lookup(tokens, k) == want, (tokens, k, min_n)


def test_an_ngram_index_kept_as_its_tokens_grow_agrees_with_a_plain_search() -> None:
    # the scheduler keeps one index per request and looks up after each new token (or after
    # a run of accepted drafts): positions indexed in earlier lookups must stay right
    rng = random.Random(1)
    for _ in range(200):
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        index, vocab = NgramIndex(min_n, max_n), rng.randint(1, 5)
        tokens = [rng.randrange(vocab)]
        while len(tokens) < 60:
            tokens += [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 1, 3, 6)))]
            k = rng.randint(1, 6)
            assert index.lookup(tokens, k) == plain_search(tokens, k, min_n, max_n), tokens


@pytest.fixture(scope="module")
def plain(model_dir) -> LLM:
    return make_llm(model_dir)


def test_ngram_greedy_equals_plain_decoding_and_hf(model_dir, hf_greedy, plain) -> None:
    spec = make_llm(model_dir, NGRAM)
    got = token_ids(spec, PROMPTS, GREEDY)
    assert got == token_ids(plain, PROMPTS, GREEDY)
    for prompt, [tokens] in zip(PROMPTS, got):
        assert tokens == hf_greedy(model_dir("llama"), prompt, GREEDY.max_tokens)
    stats = spec_stats(spec)
    assert stats.num_accepted_tokens > 0, stats  # speculation really ran and paid
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert_all_blocks_free(spec)
    # what operators see: EngineStats and the Prometheus families
    engine_stats = spec.get_stats()
    assert engine_stats.spec_method == "ngram"
    assert engine_stats.num_spec_accepted_tokens == stats.num_accepted_tokens
    assert sum(engine_stats.num_spec_accepted_per_position) == stats.num_accepted_tokens
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in _spec_decode_metrics(engine_stats)
        for s in family.samples
    }
    prefix = "asyncengine_spec_decode_"
    assert samples[(prefix + "num_drafts_total", None)] == stats.num_drafts
    assert samples[(prefix + "num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert samples[(prefix + "num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    assert samples[(prefix + "num_accepted_tokens_per_pos_total", "0")] > 0
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    assert samples[(prefix + "acceptance_rate", None)] == pytest.approx(rate)
    length = 1 + stats.num_accepted_tokens / stats.num_drafts
    assert samples[(prefix + "mean_accepted_length", None)] == pytest.approx(length)
    assert plain.get_stats().spec_method is None


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_greedy_is_unchanged_under_preemption(model_dir, plain, preemption_mode) -> None:
    spec = make_llm(
        model_dir, NGRAM, num_gpu_blocks_override=10, num_cpu_blocks_override=64,
        preemption_mode=preemption_mode, enable_prefix_caching=False,
    )  # fmt: skip
    assert token_ids(spec, PROMPTS, GREEDY) == token_ids(plain, PROMPTS, GREEDY)
    engine_stats = spec.get_stats()
    preempted = engine_stats.num_preemptions_swap + engine_stats.num_preemptions_recompute
    assert preempted > 0 and spec_stats(spec).num_accepted_tokens > 0
    if preemption_mode == "swap":
        assert engine_stats.num_preemptions_swap > 0
    assert_all_blocks_free(spec)


def test_prefix_cache_hashes_only_accepted_tokens(model_dir, plain) -> None:
    spec = make_llm(model_dir, NGRAM, enable_prefix_caching=True)
    first = token_ids(spec, PROMPTS, GREEDY)
    # the outputs, cached block by block as they were accepted, are reused as prompts: a block
    # hashed over a rejected draft would give these prompts wrong K/V
    continued = [prompt + tokens[:40] for prompt, [tokens] in zip(PROMPTS, first)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert token_ids(spec, continued, params) == token_ids(plain, continued, params)
    assert spec.get_stats().num_prefix_cache_hits >= len(PROMPTS) * 16 * 3
    assert_all_blocks_free(spec)


def test_n_samples_speculate_each(model_dir, plain) -> None:
    spec = make_llm(model_dir, NGRAM)
    params = SamplingParams(n=3, temperature=0, max_tokens=32, ignore_eos=True)
    got = token_ids(spec, PROMPTS[:2], params)
    assert got == token_ids(plain, PROMPTS[:2], params)
    assert spec_stats(spec).num_drafts > 0
    assert_all_blocks_free(spec)


@pytest.mark.parametrize(
    "overrides",
    [
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 0.5},
        {"logit_bias": "most"},
    ],
)
def test_greedy_rows_are_processed_before_their_argmax(model_dir, plain, overrides) -> None:
    # penalties and a logit bias change which token a greedy row takes, draft by draft: drafts
    # come from the text as it was, and must be checked against the processed rows
    [[free_run]] = token_ids(plain, PROMPTS[:1], GREEDY)
    most = max(set(free_run), key=free_run.count)
    fields: dict = {"temperature": 0, "max_tokens": 48, "ignore_eos": True, **overrides}
    if overrides.get("logit_bias"):
        fields["logit_bias"] = {most: 2.0}  # more rows take it, drafts of it among them
    params = SamplingParams(**fields)
    want = token_ids(plain, PROMPTS, params)
    assert want[0][0] != free_run  # the processing changes the greedy text
    spec = make_llm(model_dir, NGRAM)
    assert token_ids(spec, PROMPTS, params) == want
    assert spec_stats(spec).num_drafts > 0
    assert_all_blocks_free(spec)


def test_a_greedy_row_under_min_tokens_rejects_a_stop_draft() -> None:
    # rows 0 and 1 prefer token 7, a stop token: banned while min_tokens is not reached (the
    # request has 2 output tokens, row j has 2 + j), so the draft 7 at row 1 is rejected
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=4, stop_token_ids=[7])
    req = Request("r", [1, 2, 3], params)
    req.append_token(4)
    req.append_token(5)
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0
    logits[0, 6] = 1.0
    logits[1, 8] = 1.0
    assert verify(Sampler("cpu", 0), logits.clone(), req, [6, 7]).token_ids == [6, 8]
    params.min_tokens = 3  # row 1 may stop now: the draft 7 is kept, row 2 follows it
    assert verify(Sampler("cpu", 0), logits.clone(), req, [6, 7]).token_ids == [6, 7, 7]


@pytest.mark.parametrize(
    "overrides",
    [{"stop_token_ids": "new"}, {"stop": "repeated"}, {"max_tokens": 17}, {"logprobs": 2}],
)
def test_stops_and_logprobs_inside_an_accepted_run(model_dir, plain, overrides) -> None:
    # the greedy output repeats a token: drafts of it are accepted, a stop string of three of
    # them completes inside such a run, and a new token right after the run comes in the same
    # step as the accepted drafts; either must end the request there, as without drafts
    [[free_run]] = token_ids(plain, PROMPTS[:1], GREEDY)
    first = next(i for i in range(len(free_run) - 1) if free_run[i] == free_run[i + 1])
    repeated = free_run[first]
    seen = set(PROMPTS[0] + free_run[: first + 2])
    new = next(t for t in free_run[first + 2 :] if t != repeated and t not in seen)
    fields: dict = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    if overrides.get("stop_token_ids"):
        fields["stop_token_ids"] = [new]
    elif overrides.get("stop"):
        fields["stop"] = [plain.llm_engine.tokenizer.decode([repeated] * 3)]
    else:
        fields.update(overrides)
    params = SamplingParams(**fields)
    spec = make_llm(model_dir, NGRAM)
    [want] = plain.generate(PROMPTS[:1], params, use_tqdm=False)
    [got] = spec.generate(PROMPTS[:1], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    assert got.outputs[0].stop_reason == want.outputs[0].stop_reason
    if params.logprobs is not None:
        assert [list(e) for e in got.outputs[0].logprobs] == [
            list(e) for e in want.outputs[0].logprobs
        ]
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert [x.logprob for x in a.values()] == pytest.approx(
                [x.logprob for x in b.values()], abs=1e-4
            )
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_all_blocks_free(spec)


def test_no_block_leaks_after_many_requests_with_random_aborts(model_dir) -> None:
    spec = make_llm(
        model_dir, {**NGRAM, "disable_by_batch_size": 16}, num_gpu_blocks_override=40,
        num_cpu_blocks_override=40, max_num_seqs=16, enable_prefix_caching=True,
    )  # fmt: skip
    engine, rng = spec.llm_engine, random.Random(0)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=10, seed=3, stop_token_ids=[44]),
              SamplingParams(temperature=0, n=2, max_tokens=6)]  # fmt: skip
    num_added, in_flight = 0, set()
    while num_added < 1000 or in_flight:
        while num_added < 1000 and len(in_flight) < 24:
            prompt = rng.choice(PROMPTS)[rng.randrange(4) :]
            engine.add_request(f"r{num_added}", prompt, rng.choice(params))
            in_flight.add(f"r{num_added}")
            num_added += 1
        if in_flight and rng.random() < 0.3:
            engine.abort_request(rng.choice(sorted(in_flight)))
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
        in_flight &= set(engine.in_flight_ids())
        bm = engine.block_manager
        bm.check_invariants()
        for req in engine.scheduler.running:  # no draft slot outlives its step
            assert len(bm.block_tables[req.request_id]) <= bm.num_blocks_for(req.num_tokens)
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_all_blocks_free(spec)


@pytest.mark.parametrize("preemption_mode", [None, "swap", "recompute"])
def test_a_draft_model_equal_to_the_target_is_always_right(
    model_dir, hf_greedy, plain, preemption_mode
) -> None:
    # its K/V must follow every block move and every forward of the target's, or its drafts
    # would go wrong after a swap, a recompute or a prefix-cache hit
    overrides = {} if preemption_mode is None else {
        "num_gpu_blocks_override": 10, "num_cpu_blocks_override": 64,
        "preemption_mode": preemption_mode,
    }  # fmt: skip
    draft = {"model": str(model_dir("llama")), "num_speculative_tokens": 3}
    spec = make_llm(model_dir, draft, **overrides)
    got = token_ids(spec, PROMPTS, GREEDY)
    assert got == token_ids(plain, PROMPTS, GREEDY)
    for prompt, [tokens] in zip(PROMPTS, got):
        assert tokens == hf_greedy(model_dir("llama"), prompt, GREEDY.max_tokens)
    if preemption_mode is not None:
        stats = spec.get_stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    stats = spec_stats(spec)
    assert stats.method == "draft_model" and stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, stats
    assert_all_blocks_free(spec)


def test_a_different_draft_model_is_seldom_right_and_changes_nothing(model_dir, plain) -> None:
    other = model_dir("llama", seed=7, num_hidden_layers=1)
    spec = make_llm(model_dir, {"model": str(other), "num_speculative_tokens": 3})
    params = SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True)
    assert token_ids(spec, PROMPTS, params) == token_ids(plain, PROMPTS, params)
    stats = spec_stats(spec)
    assert stats.num_draft_tokens > 50
    assert stats.num_accepted_tokens <= 0.1 * stats.num_draft_tokens, stats
    assert_all_blocks_free(spec)


def test_ngram_greedy_is_unchanged_when_prefills_are_chunked(model_dir, plain) -> None:
    # a 16-token budget splits every prompt (up to 33 tokens) over several steps, and the
    # drafts of the decodes beside them come out of the same budget
    spec = make_llm(model_dir, NGRAM, max_num_batched_tokens=16)
    assert token_ids(spec, PROMPTS, GREEDY) == token_ids(plain, PROMPTS, GREEDY)
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_all_blocks_free(spec)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_a_different_draft_model_changes_nothing_under_preemption(
    model_dir, plain, preemption_mode
) -> None:
    other = model_dir("llama", seed=7, num_hidden_layers=1)
    spec = make_llm(
        model_dir, {"model": str(other), "num_speculative_tokens": 3},
        num_gpu_blocks_override=10, num_cpu_blocks_override=64, preemption_mode=preemption_mode,
    )  # fmt: skip
    assert token_ids(spec, PROMPTS, GREEDY) == token_ids(plain, PROMPTS, GREEDY)
    stats = spec.get_stats()
    num_preempted = getattr(stats, f"num_preemptions_{preemption_mode}")
    assert num_preempted > 0
    assert spec_stats(spec).num_draft_tokens > 50
    assert_all_blocks_free(spec)


def test_a_draft_model_equal_to_the_target_with_n_samples_and_prefix_cache_hits(
    model_dir, plain
) -> None:
    draft = {"model": str(model_dir("llama")), "num_speculative_tokens": 3}
    spec = make_llm(model_dir, draft, enable_prefix_caching=True)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    want = token_ids(plain, PROMPTS, params)
    assert token_ids(spec, PROMPTS, params) == want
    # the same prompts again start from cached blocks: the draft's K/V of those blocks must
    # have been kept beside the target's, or its drafts go wrong and are rejected
    num_hits = spec.get_stats().num_prefix_cache_hits
    before = spec_stats(spec).num_accepted_tokens, spec_stats(spec).num_draft_tokens
    assert token_ids(spec, PROMPTS, params) == want
    assert spec.get_stats().num_prefix_cache_hits > num_hits
    stats = spec_stats(spec)
    num_accepted, num_drafts = (
        stats.num_accepted_tokens - before[0],
        stats.num_draft_tokens - before[1],
    )
    assert num_drafts > 50 and num_accepted >= 0.95 * num_drafts, stats
    assert_all_blocks_free(spec)


def test_constrained_requests_speculate_under_their_grammar(model_dir, plain) -> None:
    # a choice of the prompt's own text (drafts from prompt lookup spell it), a regex and a
    # JSON schema: with speculation each constrained output is token for token the one
    # without, the grammar stepped over the drafts it kept and only those
    tokenizer = plain.llm_engine.tokenizer
    echoes = [tokenizer.decode(p[:12], clean_up_tokenization_spaces=False) for p in PROMPTS]
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12}},
              "required": ["a"]}  # fmt: skip
    constraints = [
        StructuredOutputsParams(choice=[e for e in echoes if e.isprintable()]),
        StructuredOutputsParams(regex="[a-z ]{4,40}"),
        StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    ]
    spec = make_llm(model_dir, NGRAM)
    for constraint in constraints:
        params = SamplingParams(
            temperature=0, max_tokens=48, structured_outputs=constraint, logprobs=2
        )
        got = spec.generate(PROMPTS, params, use_tqdm=False)
        want = plain.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert all(o.outputs[0].finish_reason == "stop" for o in got), constraint
        # logprobs of the constrained distribution, accepted drafts' as the sampled tokens'
        for a, b in zip(got, want):
            assert [list(e) for e in a.outputs[0].logprobs] == [
                list(e) for e in b.outputs[0].logprobs
            ]
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert [v.logprob for v in x.values()] == pytest.approx(
                    [v.logprob for v in y.values()], abs=1e-4
                )
    stats = spec_stats(spec)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert_all_blocks_free(spec)

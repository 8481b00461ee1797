"""Structured output in the engine (engine/structured_output.py, grammar.py, grammar_masks.py): the constraint's
validation and compilation, sampled outputs of the embedded model that always parse and validate, and greedy
constrained output that is the same alone, batched, forked and resumed."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from tandem.engine.core.llm_engine import LLMEngine
from tandem.engine.core.resume import ResumeState
from tandem.engine.decoding.grammar import GrammarBackend
from tandem.engine.decoding.grammar_masks import MaskJob, allocate_bitmask, apply_bitmask
from tandem.engine.engine_config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import MAX_SPEC_CHARS, InvalidStructuredOutput, StructuredOutput
from tests.engine.engine_helpers import run_all
from tests.engine.structured_cases import REGEXES, SCHEMAS, UNBOUNDED, prompt_for_regex, prompt_for_schema

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(embedded_shape):
    return GrammarBackend(embedded_shape.tokenizer, embedded_shape.config.vocab_size)


def _engine(loaded, **overrides) -> LLMEngine:
    config = dict(num_kv_blocks=1024, max_num_seqs=64, compile=False, enable_prefix_caching=False) | overrides
    return LLMEngine(loaded, EngineConfig(**config))


def _chat(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode_chat([{"role": "user", "content": text}])


# The constraint as a value


def test_a_schema_keeps_its_property_order_and_equal_schemas_are_equal():
    a = StructuredOutput.json_schema({"properties": {"b": {}, "a": {}}})
    assert a.value == '{"properties":{"b":{},"a":{}}}'
    assert a == StructuredOutput.json_schema('{"properties": {"b": {}, "a": {}}}')
    assert hash(a) == hash(StructuredOutput.json_schema({"properties": {"b": {}, "a": {}}}))


@pytest.mark.parametrize("build, message", [
    (lambda: StructuredOutput.json_schema("{not json"), "not valid JSON"),
    (lambda: StructuredOutput.json_schema([1, 2]), "must be an object"),
    (lambda: StructuredOutput.regex(""), "regex is empty"),
    (lambda: StructuredOutput.choice([]), "non-empty list"),
    (lambda: StructuredOutput.choice("yes"), "list of strings"),
    (lambda: StructuredOutput.choice(["a", 1]), "non-empty strings"),
    (lambda: StructuredOutput.grammar("x" * (MAX_SPEC_CHARS + 1)), "at most"),
    (lambda: StructuredOutput("xml", "<a/>"), "kind must be one of"),
])
def test_malformed_constraints_are_refused_with_a_message(build, message):
    with pytest.raises(InvalidStructuredOutput, match=message):
        build()


def test_ignore_eos_cannot_be_combined_with_a_constraint():
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput.json_object())


# Compilation


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput.regex("(abc"), "unclosed group"),
    (StructuredOutput.grammar("start: foo\n"), 'unknown name: "foo"'),
    (StructuredOutput.json_schema({"type": "nonsense"}), "nonsense"),
    (StructuredOutput.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutput.json_schema(False), "Expecting object schema"),  # found by the API fuzz: it was a 500
])
def test_what_the_compiler_rejects_is_refused_with_its_message(backend, spec, message):
    with pytest.raises(InvalidStructuredOutput, match=re.escape(message)):
        backend.compile(spec)


def test_every_schema_of_the_suite_compiles_and_compiled_grammars_are_cached(embedded_shape):
    backend = GrammarBackend(embedded_shape.tokenizer, embedded_shape.config.vocab_size)
    specs = [StructuredOutput.json_schema(s) for s in (*SCHEMAS.values(), *UNBOUNDED.values())]
    specs += [StructuredOutput.regex(r) for r in REGEXES.values()]
    grammars = [backend.compile(spec) for spec in specs]
    assert backend.compiles == len(set(specs)) == 42
    assert [backend.compile(spec) for spec in specs] == grammars  # again: the same objects, from the cache
    assert backend.compiles == 42


def _walk(backend: GrammarBackend, spec: StructuredOutput, picks: list[str], tokenizer) -> tuple[str, bool]:
    """Feeds the grammar the tokens of `picks` joined (greedy tokenization), checking each is allowed by the mask."""
    matcher = backend.compile(spec).matcher()
    bitmask = allocate_bitmask(1, backend.vocab_size)
    for token in tokenizer.encode("".join(picks), add_special_tokens=False):
        logits = torch.zeros(1, backend.vocab_size)
        from tandem.engine.decoding.grammar_masks import fill_masks

        fill_masks(backend, [(matcher, 0)], bitmask)
        apply_bitmask(logits, bitmask)
        if logits[0, token] == float("-inf"):
            return tokenizer.decode([token]), False
        assert matcher.accept(token)
    return "", matcher.accepts_end


def test_choices_and_gbnf_grammars_accept_exactly_their_language(backend, embedded_shape):
    tok = embedded_shape.tokenizer
    choice = StructuredOutput.choice(["yes", "no", 'say "maybe"'])
    assert _walk(backend, choice, ['say "maybe"'], tok) == ("", True)
    assert _walk(backend, choice, ["yes"], tok) == ("", True)
    assert _walk(backend, choice, ["nope"], tok)[1] is False
    gbnf = StructuredOutput.grammar('root ::= "id-" [0-9] [0-9]')
    assert _walk(backend, gbnf, ["id-42"], tok) == ("", True)
    assert _walk(backend, gbnf, ["id-4x"], tok)[1] is False


def test_a_mask_job_masks_only_its_rows(backend):
    matcher = backend.compile(StructuredOutput.regex("[0-9]")).matcher()
    logits = torch.zeros(3, backend.vocab_size)
    with ThreadPoolExecutor(1) as pool:
        MaskJob(backend, pool, [(matcher, 1)]).apply(logits)
    allowed = (logits[1] > float("-inf")).nonzero().squeeze(1).tolist()
    assert 10 <= len(allowed) < 100  # the ten digits, however tokenized (and nothing like the whole vocabulary)
    assert bool((logits[0] == 0).all()) and bool((logits[2] == 0).all())


def test_a_bad_constraint_is_refused_at_add_request_and_nothing_is_queued(embedded):
    with _engine(embedded, max_num_seqs=4) as engine:
        with pytest.raises(InvalidStructuredOutput, match="unclosed group"):
            engine.add_request("r", [1, 2, 3], SamplingParams(structured=StructuredOutput.regex("(a")))
        assert not engine.has_unfinished_requests()


# Sampling


@pytest.fixture(scope="module")
def sampled_suite(embedded):
    """Every schema and regex of the suite, two seeds each, at temperature 1, all in one batch."""
    kinds = {}
    with _engine(embedded) as engine:
        for name, schema in SCHEMAS.items():
            for seed in (1, 2):
                kinds[f"json-{name}-{seed}"] = ("json", name)
                engine.add_request(f"json-{name}-{seed}", _chat(embedded, prompt_for_schema(name)),
                                   SamplingParams(max_tokens=256, temperature=1.0, seed=seed,
                                                  structured=StructuredOutput.json_schema(schema)))
        for name, pattern in REGEXES.items():
            for seed in (1, 2):
                kinds[f"regex-{name}-{seed}"] = ("regex", name)
                engine.add_request(f"regex-{name}-{seed}", _chat(embedded, prompt_for_regex(name)),
                                   SamplingParams(max_tokens=128, temperature=1.0, seed=seed,
                                                  structured=StructuredOutput.regex(pattern)))
        done = run_all(engine)
    return {rid: (kinds[rid], embedded.tokenizer.decode(out.token_ids), out.finish_reason)
            for (rid, _), out in done.items()}


def test_sampled_outputs_of_every_schema_parse_and_validate(sampled_suite):
    outputs = {rid: v for rid, v in sampled_suite.items() if v[0][0] == "json"}
    assert len(outputs) == 2 * len(SCHEMAS) == 60
    for rid, ((_, name), text, reason) in outputs.items():
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_sampled_outputs_of_every_regex_match_it_whole(sampled_suite):
    outputs = {rid: v for rid, v in sampled_suite.items() if v[0][0] == "regex"}
    assert len(outputs) == 2 * len(REGEXES) == 20
    for rid, ((_, name), text, reason) in outputs.items():
        assert reason == "stop" and re.fullmatch(REGEXES[name], text), (rid, text)


def _greedy(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], list]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return {key: out.token_ids for key, out in run_all(engine).items()}


def test_greedy_constrained_output_is_the_same_alone_batched_forked_and_resumed(embedded):
    spec = StructuredOutput.json_schema(PERSON)
    prompt = _chat(embedded, "Describe a person as JSON.")
    greedy = SamplingParams(max_tokens=64, temperature=0, structured=spec)
    with _engine(embedded) as engine:
        alone = _greedy(engine, {"a": (prompt, greedy)})[("a", 0)]
        assert json.loads(embedded.tokenizer.decode(alone))["age"] >= 0
        others = {f"o{i}": (_chat(embedded, f"Person number {i}, as JSON."), greedy) for i in range(5)}
        batched = _greedy(engine, {"a": (prompt, greedy), **others})
        assert batched[("a", 0)] == alone
        forked = _greedy(engine, {"f": (prompt, SamplingParams(max_tokens=64, temperature=0, n=3, structured=spec))})
        assert [forked[("f", i)] for i in range(3)] == [alone] * 3
        for cut in (1, 5, len(alone) - 1):  # a migrated request replays what it delivered into its matcher
            engine.add_request(f"m{cut}", prompt, greedy, resume=ResumeState(tuple(alone[:cut])))
            assert run_all(engine)[(f"m{cut}", 0)].token_ids == alone[cut:]


def test_delivered_tokens_outside_the_grammar_are_refused_on_resume(embedded):
    bad = tuple(embedded.tokenizer.encode("hello", add_special_tokens=False))
    params = SamplingParams(max_tokens=16, temperature=0, structured=StructuredOutput.json_schema(PERSON))
    with _engine(embedded, max_num_seqs=4) as engine:
        with pytest.raises(InvalidStructuredOutput, match="do not fit"):
            engine.add_request("m", [1, 2, 3], params, resume=ResumeState(bad))


def test_a_preempted_constrained_request_recomputes_into_the_same_output(embedded):
    """A KV budget too small for all four at once: requests are preempted and recomputed, and their matchers are
    rebuilt from the tokens they kept."""
    spec = StructuredOutput.json_schema(SCHEMAS["array_of_objects"])
    requests = {f"p{i}": (_chat(embedded, f"Order {i} as JSON."), SamplingParams(max_tokens=48, temperature=0,
                                                                                structured=spec))
                for i in range(4)}
    with _engine(embedded, max_num_seqs=8) as roomy:
        expected = _greedy(roomy, requests)
    with _engine(embedded, max_num_seqs=8, num_kv_blocks=14) as tight:
        got = _greedy(tight, requests)
        assert tight.stats().num_preemptions > 0
    assert got == expected


def test_a_matcher_rolls_back_rejected_tokens_and_knows_when_the_grammar_is_done(backend, embedded_shape):
    tok = embedded_shape.tokenizer
    grammar = backend.compile(StructuredOutput.choice(["yes", "no"]))
    matcher = grammar.matcher()
    yes = tok.encode("yes", add_special_tokens=False)
    for t in yes:
        assert matcher.accept(t)
    assert matcher.accepts_end
    matcher.rollback(len(yes))  # as a speculative run whose draft was rejected would
    assert not matcher.accepts_end
    for t in tok.encode("no", add_special_tokens=False):
        assert matcher.accept(t)
    assert matcher.accepts_end and matcher.is_terminated  # nothing can follow "no" but the end
    open_ended = backend.compile(StructuredOutput.regex("[0-9]+")).matcher()
    assert open_ended.accept(tok.encode("7", add_special_tokens=False)[0])
    assert open_ended.accepts_end and not open_ended.is_terminated  # more digits may follow
    copy = grammar.matcher()
    assert not copy.accept(tok.encode("maybe", add_special_tokens=False)[0]) and copy.error
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.matcher().rollback(3)


def test_stop_strings_and_max_tokens_cut_a_constrained_output_as_they_cut_any(embedded):
    spec = StructuredOutput.json_schema(PERSON)
    prompt = _chat(embedded, "Describe a person as JSON.")
    with _engine(embedded, max_num_seqs=4) as engine:
        whole = embedded.tokenizer.decode(_greedy(engine, {"w": (prompt, SamplingParams(
            max_tokens=64, temperature=0, structured=spec))})[("w", 0)])
        engine.add_request("s", prompt, SamplingParams(max_tokens=64, temperature=0, structured=spec, stop=[", "]))
        engine.add_request("m", prompt, SamplingParams(max_tokens=3, temperature=0, structured=spec))
        done = run_all(engine)
    assert done[("s", 0)].finish_reason == "stop" and done[("s", 0)].text == whole.split(", ")[0]
    assert done[("m", 0)].finish_reason == "length" and whole.startswith(done[("m", 0)].text)

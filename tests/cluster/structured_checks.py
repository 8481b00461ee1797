"""Structured output through a running cluster's OpenAI API, shared by the disaggregated and colocated tests: the
greedy constrained reply equals one process's, sampled replies (temperature 1, two seeds) of every schema and regex
of the suite (tests/engine/structured_cases.py) parse and validate, and tool calls round-trip through the openai
client's types."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

from tandem.engine.core.generator import Generator
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutput
from tests.engine.structured_cases import REGEXES, SCHEMAS, prompt_for_regex, prompt_for_schema

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Describe a person as JSON."}]


def greedy_reply_equals_one_process(http_endpoint: str, embedded) -> None:
    client = openai.OpenAI(base_url=f"http://{http_endpoint}/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    with Generator(embedded) as reference:
        want = reference.generate(embedded.tokenizer.encode_chat(QUESTION), SamplingParams(
            max_tokens=48, temperature=0, structured=StructuredOutput.json_schema(PERSON)))
    text = reply.choices[0].message.content
    assert text == want.text and reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def sampled_replies_validate(http_endpoint: str) -> None:
    client = openai.OpenAI(base_url=f"http://{http_endpoint}/v1", api_key="none", max_retries=0, timeout=300)

    def schema_reply(case: tuple[str, int]):
        name, seed = case
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt_for_schema(name)}], max_tokens=256,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}})

    def regex_reply(case: tuple[str, int]):
        name, seed = case
        return client.completions.create(model=MODEL, prompt=prompt_for_regex(name), max_tokens=64, temperature=1.0,
                                         seed=seed, extra_body={"structured_outputs": {"regex": REGEXES[name]}})

    with ThreadPoolExecutor(16) as pool:
        schema_cases = [(n, s) for n in SCHEMAS for s in (11, 12)]
        regex_cases = [(n, s) for n in REGEXES for s in (11, 12)]
        schema_replies = list(pool.map(schema_reply, schema_cases))
        regex_replies = list(pool.map(regex_reply, regex_cases))
    for (name, _), reply in zip(schema_cases, schema_replies):
        assert reply.choices[0].finish_reason == "stop", (name, reply.choices[0].message.content)
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[name])
    for (name, _), reply in zip(regex_cases, regex_replies):
        assert reply.choices[0].finish_reason == "stop" and re.fullmatch(REGEXES[name], reply.choices[0].text), name


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
             "additionalProperties": False}}}]


def tool_calls_round_trip(http_endpoint: str) -> None:
    """tool_choice required and a named function through the openai client's types, streamed and not, then the
    conversation continued with the calls and their results."""
    client = openai.OpenAI(base_url=f"http://{http_endpoint}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=96, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64,
                                            temperature=0.8, seed=3, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    name, arguments, finish = None, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            name = call.function.name or name
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "stop"
    jsonschema.validate(json.loads(arguments), WEATHER)
    follow_up = messages + [choice.message.model_dump(exclude_none=True),
                            *({"role": "tool", "tool_call_id": c.id, "content": "Sunny, 21 degrees"}
                              for c in choice.message.tool_calls)]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, tool_choice="none",
                                            max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls

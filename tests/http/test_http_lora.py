"""Multi-LoRA served (issue 28): an adapter loaded at run time (behind the Control token) streams
through the official `openai` client and through gRPC (stubs generated from protos/) the greedy
tokens transformers + peft make with it in float32; it is listed by /v1/models and ListLoRAs,
refused unloading while a stream uses it (which finishes whole), unloaded, and then unknown:
404 and NOT_FOUND naming it. Plus each route's errors, and a server without run-time updates."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch
from peft import PeftModel
from prometheus_client.parser import text_string_to_metric_families
from serving_http import ServerThread, http_server
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from asyncengine import SamplingParams, testing
from asyncengine.errors import LoRANotFoundError
from asyncengine.server.call import Call
from asyncengine.v1 import control_pb2, control_pb2_grpc, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONTROL_TOKEN = "lora-control-token"
CONTROL = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
CONTROL_METADATA = (("authorization", f"Bearer {CONTROL_TOKEN}"),)
PROMPT = "The capital of France is"
NUM_TOKENS = 12
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def greedy(model: Path, adapter: Path | None, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' (and peft's, with `adapter`) greedy tokens after `prompt_ids`, no eos."""
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if adapter is not None:
        hf = PeftModel.from_pretrained(hf, adapter)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=num_tokens,
        eos_token_id=None,
        pad_token_id=hf.config.pad_token_id,
    )
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.eval().generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def model(chat_model: Path) -> Path:
    """The tests' tiny Llama, with a chat template."""
    return chat_model


@pytest.fixture(scope="module")
def adapters(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`static` (loaded by --lora-modules) and `sql` (loaded at run time): other ranks and
    target modules, attention and MLP."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "static": testing.make_random_lora(
            root / "static", model, seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]
        ),
        "sql": testing.make_random_lora(
            root / "sql", model, seed=2, r=8, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
    }


@pytest.fixture(scope="module")
def prompt_ids(model: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(model).encode(PROMPT)


@pytest.fixture(scope="module")
def server(model: Path, adapters: dict[str, Path], core: tuple[str, ...]) -> Iterator[ServerThread]:
    """LoRA on, run-time updates allowed behind a Control token, `static` loaded at start-up;
    steps slowed a little, so a long stream is still running when a test unloads its adapter."""
    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    flags += ["--allow-runtime-lora-updating", "--control-auth-token", CONTROL_TOKEN]
    flags += ["--lora-modules", f"static={adapters['static']}", "--metrics-port", "0", *core]
    with http_server(model, *flags, step_delay_s=0.01) as served:
        yield served
        served.assert_nothing_left()


def post(server: ServerThread, route: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=60, **kwargs)


def load(server: ServerThread, name: str, path: Path | str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return post(server, "/v1/load_lora_adapter", body, headers=CONTROL)


def unload(server: ServerThread, name: str) -> httpx.Response:
    return post(server, "/v1/unload_lora_adapter", {"lora_name": name}, headers=CONTROL)


def error_of(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


class Grpc:
    """The server's Generation and Control over one channel."""

    def __init__(self, server: ServerThread) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        self.generation = generation_pb2_grpc.GenerationStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)

    def stream(
        self, lora_name: str, prompt_ids: list[int], num_tokens: int
    ) -> tuple[list[int], str]:
        """A greedy GenerateStream's token ids and text."""
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt_ids),
            lora_name=lora_name,
            sampling=generation_pb2.SamplingOptions(temperature=0),
            stopping=generation_pb2.StoppingOptions(max_new_tokens=num_tokens, ignore_eos=True),
            response=generation_pb2.ResponseOptions(return_token_ids=True),
        )
        ids, text = [], ""
        for message in self.generation.GenerateStream(request, timeout=60):
            if message.WhichOneof("event") == "delta":
                ids += message.delta.token_ids
                text += message.delta.text
        return ids, text

    def adapters(self) -> list[tuple[str, int, str, str]]:
        listed = self.control.ListLoRAs(
            control_pb2.ListLoRAsRequest(), metadata=CONTROL_METADATA, timeout=30
        )
        return [(a.lora_name, a.lora_id, a.lora_path, a.base_model_name) for a in listed.adapters]


@pytest.fixture
def rpc(server: ServerThread) -> Iterator[Grpc]:
    stubs = Grpc(server)
    yield stubs
    stubs.channel.close()


def sample(server: ServerThread, name: str, **labels: str) -> float | None:
    """The value of one series of the server's /metrics; None when it has none."""
    text = httpx.get(f"http://127.0.0.1:{server.state.metrics.port}/metrics").text
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return found.value
    return None


def wait_for_sample(server: ServerThread, name: str, **labels: str) -> float | None:
    """`sample`, read until it is non-zero (an engine in its own process reports its stats
    after its steps) or 10 s pass."""
    deadline = time.monotonic() + 10
    while not (value := sample(server, name, **labels)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def streamed_text(client: openai.OpenAI, model: str, prompt_ids: list[int], num_tokens: int) -> str:
    stream = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=num_tokens, stream=True, **GREEDY
    )
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_an_adapter_loaded_at_run_time_serves_peft_tokens_then_unloads(
    server: ServerThread, rpc: Grpc, model: Path, adapters: dict[str, Path], prompt_ids: list[int]
) -> None:
    expected = greedy(model, adapters["sql"], prompt_ids, NUM_TOKENS)
    assert expected != greedy(model, None, prompt_ids, NUM_TOKENS)  # the adapter matters

    loaded = load(server, "sql", adapters["sql"])
    assert loaded.status_code == 200, loaded.text
    assert "sql" in loaded.text

    client = server.client()
    listed = {card.id: card for card in client.models.list().data}
    assert list(listed) == [server.model, "static", "sql"]
    assert (listed["sql"].parent, listed["sql"].root) == (server.model, str(adapters["sql"]))
    assert getattr(listed[server.model], "parent", None) is None
    assert client.models.retrieve("sql").root == str(adapters["sql"])
    assert rpc.adapters() == [
        ("static", 1, str(adapters["static"]), server.model),
        ("sql", 2, str(adapters["sql"]), server.model),
    ]

    ids, grpc_text = rpc.stream("sql", prompt_ids, NUM_TOKENS)
    assert ids == expected
    assert streamed_text(client, "sql", prompt_ids, NUM_TOKENS) == grpc_text
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **GREEDY
    )
    assert chat.model == "sql"

    unloaded = unload(server, "sql")
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="sql", prompt=prompt_ids, max_tokens=1, **GREEDY)
    assert missing.value.code == "model_not_found" and "'sql'" in str(missing.value.message)
    with pytest.raises(grpc.RpcError) as rpc_missing:
        rpc.stream("sql", prompt_ids, 1)
    assert rpc_missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'sql'" in rpc_missing.value.details()
    assert [card.id for card in client.models.list().data] == [server.model, "static"]

    again = load(server, "sql", adapters["sql"])  # a new adapter to the engine: a new id
    assert again.status_code == 200, again.text
    assert [(name, lora_id) for name, lora_id, _, _ in rpc.adapters()] == [
        ("static", 1),
        ("sql", 3),
    ]
    assert rpc.stream("sql", prompt_ids, NUM_TOKENS)[0] == expected
    assert unload(server, "sql").status_code == 200


def test_the_start_up_adapter_and_the_base_model_serve_side_by_side(
    server: ServerThread, rpc: Grpc, model: Path, adapters: dict[str, Path], prompt_ids: list[int]
) -> None:
    client = server.client()
    response = client.completions.create(
        model="static", prompt=prompt_ids, max_tokens=NUM_TOKENS, **GREEDY
    )
    assert response.model == "static"
    assert rpc.stream("static", prompt_ids, NUM_TOKENS)[0] == greedy(
        model, adapters["static"], prompt_ids, NUM_TOKENS
    )
    assert rpc.stream("", prompt_ids, NUM_TOKENS)[0] == greedy(model, None, prompt_ids, NUM_TOKENS)
    base = client.completions.create(
        model=server.model, prompt=prompt_ids, max_tokens=NUM_TOKENS, **GREEDY
    )
    assert base.model == server.model and base.choices[0].text != response.choices[0].text


def test_unloading_an_adapter_in_use_is_refused_and_its_stream_finishes_whole(
    server: ServerThread, rpc: Grpc, adapters: dict[str, Path], prompt_ids: list[int]
) -> None:
    assert load(server, "busy", adapters["sql"]).status_code == 200
    num_tokens = 200
    stream = server.client().completions.create(
        model="busy", prompt=prompt_ids, max_tokens=num_tokens, stream=True, **GREEDY,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # it runs
    running = wait_for_sample(
        server, "asyncengine_lora_requests", lora_name="busy", state="running"
    )
    assert running == 1
    assert sample(server, "asyncengine_lora_requests", lora_name="busy", state="waiting") == 0
    assert sample(server, "asyncengine_lora_adapters", state="registered") == 2
    assert sample(server, "asyncengine_lora_adapters", state="resident") >= 1
    refused = unload(server, "busy")
    assert refused.status_code == 409, refused.text
    assert error_of(refused)["code"] == "lora_in_use"
    with pytest.raises(grpc.RpcError) as rpc_refused:
        rpc.control.UnloadLoRA(
            control_pb2.UnloadLoRARequest(lora_name="busy"), metadata=CONTROL_METADATA
        )
    assert rpc_refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == num_tokens
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    server.wait_idle()
    assert unload(server, "busy").status_code == 200


def test_a_request_for_an_adapter_unloaded_since_it_was_named_is_not_found(
    server: ServerThread, adapters: dict[str, Path], prompt_ids: list[int]
) -> None:
    """The engine loads an adapter a request brings that it does not have; the server must not
    let a request resolved before an unload bring the adapter back."""
    assert load(server, "brief", adapters["sql"]).status_code == 200
    stale = server.run(lambda: server.state.adapters.get("brief"))
    assert unload(server, "brief").status_code == 200

    async def open_stale() -> None:
        call = Call(server.state, "grpc", ["stale"])
        await call.open([prompt_ids], SamplingParams(max_tokens=1), lora_request=stale)

    with pytest.raises(LoRANotFoundError, match="'brief'"):
        server.call(open_stale())
    assert server.run(lambda: server.state.adapters.get("brief")) is None


def test_run_time_updates_need_the_control_token(
    server: ServerThread, rpc: Grpc, adapters: dict[str, Path]
) -> None:
    body = {"lora_name": "sneaky", "lora_path": str(adapters["sql"])}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = post(server, route, body, headers=headers)
            assert response.status_code == 401, response.text
            assert error_of(response)["code"] == "invalid_api_key"
    with pytest.raises(grpc.RpcError) as refused:
        rpc.control.LoadLoRA(control_pb2.LoadLoRARequest(lora_name="sneaky", lora_path="/x"))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "sneaky" not in [name for name, *_ in rpc.adapters()]


def test_a_duplicate_name_is_400_and_already_exists(
    server: ServerThread, rpc: Grpc, adapters: dict[str, Path]
) -> None:
    response = load(server, "static", adapters["sql"])
    assert response.status_code == 400, response.text
    assert (error_of(response)["param"], error_of(response)["code"]) == (
        "lora_name",
        "lora_already_loaded",
    )
    with pytest.raises(grpc.RpcError) as duplicate:
        request = control_pb2.LoadLoRARequest(lora_name="static", lora_path=str(adapters["sql"]))
        rpc.control.LoadLoRA(request, metadata=CONTROL_METADATA)
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert rpc.adapters()[0][2] == str(adapters["static"])  # the loaded one stays


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "", "lora_path": "/x"}, "lora_name"),
        ({"lora_name": "empty", "lora_path": ""}, "lora_path"),
        ({"lora_name": "missing", "lora_path": "/no/such/adapter"}, "lora_path"),
        ({"lora_path": "/x"}, "lora_name"),
    ],
)
def test_a_bad_load_is_400_naming_its_field(
    server: ServerThread, body: dict[str, str], param: str
) -> None:
    response = post(server, "/v1/load_lora_adapter", body, headers=CONTROL)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_a_directory_that_is_no_adapter_is_invalid_argument_naming_lora_path(
    server: ServerThread, rpc: Grpc, tmp_path: Path
) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(grpc.RpcError) as refused:
        request = control_pb2.LoadLoRARequest(lora_name="broken", lora_path=str(tmp_path))
        rpc.control.LoadLoRA(request, metadata=CONTROL_METADATA)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_path" in refused.value.details()
    assert "broken" not in [name for name, *_ in rpc.adapters()]


def test_an_unknown_adapter_is_404_and_not_found_naming_it(
    server: ServerThread, rpc: Grpc, prompt_ids: list[int]
) -> None:
    client = server.client()
    for create in (
        lambda: client.completions.create(model="nope", prompt="Hi", max_tokens=1),
        lambda: client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        ),
        lambda: client.models.retrieve("nope"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            create()
        assert missing.value.code == "model_not_found" and "'nope'" in missing.value.message
    response = unload(server, "nope")
    assert response.status_code == 404, response.text
    assert (
        error_of(response)["code"] == "lora_not_found" and "'nope'" in error_of(response)["message"]
    )
    with pytest.raises(grpc.RpcError) as rpc_missing:
        rpc.stream("nope", prompt_ids, 1)
    assert rpc_missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in rpc_missing.value.details()
    with pytest.raises(grpc.RpcError) as unload_missing:
        request = control_pb2.UnloadLoRARequest(lora_name="nope")
        rpc.control.UnloadLoRA(request, metadata=CONTROL_METADATA)
    assert unload_missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_without_run_time_updates_the_routes_are_absent_and_control_refuses(model: Path) -> None:
    with http_server(model, "--no-engine-process", fake_runner=True) as served:
        body = {"lora_name": "a", "lora_path": "/x"}
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert post(served, route, body).status_code == 404
        with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
            control = control_pb2_grpc.ControlStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                control.LoadLoRA(control_pb2.LoadLoRARequest(lora_name="a", lora_path="/x"))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--allow-runtime-lora-updating" in refused.value.details()
            listed = control.ListLoRAs(control_pb2.ListLoRAsRequest())
            assert list(listed.adapters) == []


def test_an_adapter_that_cannot_load_stops_the_start_naming_it(model: Path, tmp_path: Path) -> None:
    flags = ["--no-engine-process", "--enable-lora", "--lora-modules", f"bad={tmp_path}"]
    expected = re.escape(f"--lora-modules bad={tmp_path}: lora_path")
    with pytest.raises(ValueError, match=expected), http_server(model, *flags):
        pass

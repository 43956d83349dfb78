"""The coordinator's OpenAI-compatible HTTP API with real clients: the official `openai` package and curl.

One coordinator for the module (on the session's target and draft) with the HTTP port, an API
token, metrics, and room for two requests at once (--max-concurrent-requests 2), so that two held
streams make the next request a deterministic 429. (Two, not one: a finished request keeps its
slot until its peers answered its close, so a test's next request could find a limit of one
still taken.)
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from coordinator.client import CoordinatorClient
from tests.cluster import Cluster, metrics_address, scrape, total

TOKEN = "an-http-api-token-for-tests"
PROMPT = "Hello, world"
CHAT = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def cluster(
    tiny_pair: tuple[Path, Path], tiny_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    target, draft = tiny_pair
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    args = [
        *("--http-port", "0", "--api-token-file", str(token_file), "--metrics-port", "0"),
        *("--max-concurrent-requests", "2"),
    ]
    shared = {"borrow_target": tiny_cluster, "borrow_draft": tiny_cluster}
    with Cluster(target, draft, cache_dir=tmp_path_factory.mktemp("cache"), coordinator_args=args, **shared) as c:
        yield c


@pytest.fixture(scope="module")
def base(cluster: Cluster) -> str:
    assert cluster.coordinator is not None and cluster.coordinator.http_address, cluster.logs()
    return f"http://{cluster.coordinator.http_address}"


@pytest.fixture(scope="module")
def client(base: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _grpc(cluster: Cluster) -> CoordinatorClient:
    return CoordinatorClient(cluster.address, token=TOKEN, timeout=60)


def _metrics(cluster: Cluster) -> dict:
    assert cluster.coordinator is not None
    return scrape(metrics_address(cluster.coordinator))


# ---- the API ----------------------------------------------------------------------------------


def test_models_and_health(client: openai.OpenAI, base: str, model: str) -> None:
    assert model == "tiny-target"
    assert client.models.list().data[0].model_extra["max_model_len"] == 512
    health = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", f"{base}/health"],
        text=True,
        capture_output=True,
        timeout=30,
    )
    assert health.stdout == "200", health.stderr  # no token: probes carry none


def test_completion(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    assert reply.object == "text_completion" and reply.model == model and len(reply.choices) == 1
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].text
    usage = reply.usage
    assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens == len(PROMPT.encode())
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra or {}
    assert {"draft_tokens", "accepted_tokens", "acceptance_rate", "acceptance_length"} <= set(extra)
    details = usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens == extra["accepted_tokens"]
    specd = (reply.model_extra or {})["specd"]
    assert specd["completion_tokens"] == 24 and specd["rounds"] >= 1 and "seed" in specd


def test_chat(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and isinstance(reply.choices[0].message.content, str)
    assert reply.usage is not None and reply.usage.completion_tokens == 12


def test_streaming_gives_the_same_text_and_usage(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    events = list(
        client.completions.create(
            model=model, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(e.choices[0].text for e in events if e.choices) == whole.choices[0].text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage is not None
    assert events[-1].usage.completion_tokens == 24
    assert all(e.usage is None for e in events[:-1])

    chat_whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat_whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    text = client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    reply = client.completions.create(model=model, prompt=PROMPT, stop=[stop], **GREEDY)
    assert reply.choices[0].text == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_seed_reproduces_sampled_output(client: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=model, prompt=PROMPT, max_tokens=32, temperature=0.8, seed=seed, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    first = sample(5)
    assert sample(5) == first
    assert sample(6) != first


@pytest.mark.parametrize("speculation", [{}, {"speculation": "off"}, {"draft_length": 3}])
def test_greedy_over_http_equals_grpc_token_for_token(
    client: openai.OpenAI, cluster: Cluster, model: str, speculation: dict
) -> None:
    with _grpc(cluster) as g:
        want = g.generate(PROMPT, max_new_tokens=40, temperature=0, ignore_eos=True)
        want_chat = g.generate(CHAT, max_new_tokens=20, temperature=0, ignore_eos=True)
    extra = {"ignore_eos": True, "return_token_ids": True, **speculation}
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra)
    assert got.choices[0].model_extra["token_ids"] == list(want.token_ids)
    assert got.choices[0].text == want.text
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0, extra_body=extra)
    assert chat.choices[0].model_extra["token_ids"] == list(want_chat.token_ids)
    assert chat.choices[0].message.content == want_chat.text


def test_curl_streams_server_sent_events(base: str, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            f"{base}/v1/completions",
            "-H",
            f"Authorization: Bearer {TOKEN}",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    events = [e for e in out.stdout.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), out.stdout
    assert events[-1] == "data: [DONE]"
    objects = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert objects[-1]["choices"][0]["finish_reason"] == "length" and "specd" in objects[-1]


# ---- errors -----------------------------------------------------------------------------------


def test_a_missing_or_wrong_token_is_401(base: str, model: str) -> None:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=30) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 401 and "token" in err.value.message
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 2}, "n"),
        ({"temperature": -1}, None),
        ({"max_tokens": 100_000}, None),
        ({"logprobs": 3}, "logprobs"),
        ({"extra_body": {"speculation": "sometimes"}}, "speculation"),
    ],
)
def test_bad_parameters_are_400(client: openai.OpenAI, model: str, kwargs: dict, param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, **kwargs)
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["param"] == param
    assert err.value.message


def test_an_unknown_model_is_400_naming_the_served_one(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert model in err.value.message


def test_an_unknown_route_is_404_in_openais_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="x", input="hi")
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "not_found_error"


def test_a_body_over_the_limit_is_413_before_it_is_read(cluster: Cluster) -> None:
    assert cluster.coordinator is not None and cluster.coordinator.http_address
    host, port = cluster.coordinator.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {64 << 20}\r\n\r\n".encode()
        )  # 64 MiB announced, none sent: the answer comes from the header alone
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            part = s.recv(65536)
            if not part:
                break
            reply += part
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply
    assert json.loads(body)["error"]["code"] == "too_large"


def test_full_admission_is_429_and_a_disconnect_cancels_the_request(
    client: openai.OpenAI, cluster: Cluster, model: str
) -> None:
    """Two requests fit (--max-concurrent-requests 2): two held streams make the next one 429; closing
    them cancels them at the coordinator (counted CANCELLED, no longer running), freeing the slots.
    A non-streaming request whose client goes away is cancelled the same way."""
    before = total(_metrics(cluster), "specd:request_failure_total", code="CANCELLED")
    long = {"max_tokens": 480, "temperature": 0, "extra_body": {"ignore_eos": True}}  # ~1 s alone on the tiny pair
    streams = [client.completions.create(model=model, prompt=PROMPT, stream=True, **long) for _ in range(2)]
    for stream in streams:
        next(iter(stream))  # both run now
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert err.value.status_code == 429 and "limit" in err.value.message
    for stream in streams:
        stream.close()  # the client goes away mid-stream
    _wait_cancelled(cluster, before + 2)

    host, port = (cluster.coordinator.http_address or "").rsplit(":", 1)  # type: ignore[union-attr]
    body = json.dumps(
        {"model": model, "prompt": PROMPT, **{k: v for k, v in long.items() if k != "extra_body"}, "ignore_eos": True}
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.2)  # admitted and generating; then the connection closes, unanswered
    _wait_cancelled(cluster, before + 3)

    # Both slots are free again once the peers answered the closes: two requests run at once.
    deadline, cancelled = time.monotonic() + 30, before + 3
    while True:
        streams = []
        try:
            for _ in range(2):
                streams.append(client.completions.create(model=model, prompt=PROMPT, stream=True, **long))
                next(iter(streams[-1]))
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the cancelled requests' slots were not freed"
            time.sleep(0.05)
        finally:
            for stream in streams:
                stream.close()
            cancelled += len(streams)
            _wait_cancelled(cluster, cancelled)


def _wait_cancelled(cluster: Cluster, count: float) -> None:
    deadline = time.monotonic() + 30
    while True:
        samples = _metrics(cluster)
        cancelled = total(samples, "specd:request_failure_total", code="CANCELLED")
        running = total(samples, "specd:num_requests_running")
        if cancelled >= count and running == 0:
            assert cancelled == count
            return
        assert time.monotonic() < deadline, f"cancelled {cancelled} (want {count}), running {running}"
        time.sleep(0.05)

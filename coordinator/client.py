"""Python client for the public Coordinator API.

with CoordinatorClient("127.0.0.1:50051") as client:
    print(client.generate("Once upon a time", max_new_tokens=32).text)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import grpc

from specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

Prompt = str | Sequence[int] | Sequence[dict[str, str]]

_MODES = {
    "auto": common_pb2.SpeculationParams.MODE_AUTO,
    "fixed": common_pb2.SpeculationParams.MODE_FIXED,
    "off": common_pb2.SpeculationParams.MODE_OFF,
    None: common_pb2.SpeculationParams.MODE_UNSPECIFIED,
}
_PIPELINES = {
    True: common_pb2.SpeculationParams.PIPELINE_BONUS_MATCH,
    "bonus-match": common_pb2.SpeculationParams.PIPELINE_BONUS_MATCH,
    "post-verify": common_pb2.SpeculationParams.PIPELINE_POST_VERIFY,
    "spec-cache": common_pb2.SpeculationParams.PIPELINE_SPEC_CACHE,
    "auto": common_pb2.SpeculationParams.PIPELINE_AUTO,
    False: common_pb2.SpeculationParams.PIPELINE_OFF,
    "off": common_pb2.SpeculationParams.PIPELINE_OFF,
    None: common_pb2.SpeculationParams.PIPELINE_UNSPECIFIED,
}


def build_request(
    prompt: Prompt,
    *,
    max_new_tokens: int = 0,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    speculation: str | None = None,
    draft_length: int = 0,
    pipeline: bool | str | None = None,
    ignore_eos: bool = False,
    cache_salt: str = "",
    tree_budget: int = 0,
) -> coordinator_pb2.GenerateRequest:
    """A GenerateRequest; prompt is text, token IDs, or chat messages ({'role', 'content'} dicts).

    cache_salt: narrows the caller's tenant (what the draft learned from the same tenant's
    earlier requests drafts for this one; see GenerateRequest.cache_salt). tree_budget N > 0: tree
    speculation, trees of at most N nodes, draft_length deep (speculation "fixed", pipeline off)."""
    req = coordinator_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        cache_salt=cache_salt,
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        for m in cast(Sequence[dict[str, str]], prompt):  # chat messages: the first one says so
            req.chat.messages.add(role=m["role"], content=m["content"])
    else:
        req.token_ids.ids.extend(int(t) for t in cast(Sequence[int], prompt))
        if not prompt:
            req.token_ids.SetInParent()
    if temperature is not None:
        req.sampling.temperature = temperature
    if top_p is not None:
        req.sampling.top_p = top_p
    req.sampling.top_k = top_k
    req.sampling.min_p = min_p
    if seed is not None:
        req.sampling.seed = seed
    if speculation not in _MODES:
        raise ValueError(f"speculation must be one of auto, fixed, off (got {speculation!r})")
    req.speculation.mode = _MODES[speculation]
    req.speculation.draft_length = draft_length
    if pipeline not in _PIPELINES:
        raise ValueError(
            "pipeline must be True / 'bonus-match', 'post-verify', 'spec-cache', 'auto', False / 'off' or None "
            f"(got {pipeline!r})"
        )
    req.speculation.pipeline = _PIPELINES[pipeline]
    req.speculation.tree_budget = tree_budget
    return req


class CoordinatorClient:
    """Blocking client; one channel, reused for every call.

    tls_ca: CA bundle (PEM path) to verify the coordinator's certificate (turns TLS on);
    token: the API token, sent as `authorization: Bearer <token>`.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        tls_ca: str | None = None,
        token: str | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        if channel is None:
            if tls_ca:
                with open(tls_ca, "rb") as f:
                    channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))
            else:
                channel = grpc.insecure_channel(address)
        self._channel = channel
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.timeout = timeout

    def _call_metadata(self, extra: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...] | None:
        both = (*(self._metadata or ()), *extra)
        return both or None

    def generate(
        self, prompt: Prompt, *, metadata: Sequence[tuple[str, str]] = (), **kwargs: Any
    ) -> coordinator_pb2.GenerateResponse:
        """metadata: extra call metadata, e.g. a W3C ``traceparent`` to join (or opt out of) a trace."""
        return self._stub.Generate(
            build_request(prompt, **kwargs), timeout=self.timeout, metadata=self._call_metadata(metadata)
        )

    def generate_stream(
        self, prompt: Prompt, *, metadata: Sequence[tuple[str, str]] = (), **kwargs: Any
    ) -> Iterator[coordinator_pb2.GenerateStreamResponse]:
        return self._stub.GenerateStream(
            build_request(prompt, **kwargs), timeout=self.timeout, metadata=self._call_metadata(metadata)
        )

    def model_info(self) -> common_pb2.ModelInfo:
        return self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Request parsing and validation shared by the Anthropic and OpenAI routes.

Everything here turns client input into engine input or a 400/404/413 ``ApiError`` in the route's
own format (never a 500): the JSON body (size, UTF-8, lone surrogates; a large one decoded off
the event loop), the pydantic request model, the model name, the stop sequences (how many, how
long), the SFCL headers and fields (``x-sfcl-tag``; snapshot mode: header
``x-sfcl-snapshot`` > body ``snapshot_mode`` > server default; steering: ``resolve_steer``, the one
place that reads ``x-sfcl-steer`` / ``steer``), ``SamplingParams`` and the chat template.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Annotated, Any, Callable, Literal, Optional, Union

import anyio
from fastapi import Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError
from starlette.requests import ClientDisconnect

from sfcl.config import SNAPSHOT_MODES
from sfcl.engine.protocol import EngineClient
from sfcl.engine.request import TAG_RE, SamplingParams, check_stop
from sfcl.engine.token_bound import min_tokens
from sfcl.server.errors import ApiError, ClientGone, format_loc, validation_api_error
from sfcl.snapshot.mechanisms import no_document_messages, parse_steer
from sfcl.text import clip, quote

SNAPSHOT_HEADER = "x-sfcl-snapshot"
TAG_HEADER = "x-sfcl-tag"
STEER_HEADER = "x-sfcl-steer"
MAX_BODY_BYTES = 32 * 1024 * 1024
# A body larger than this is decoded and validated in a worker thread: json.loads, the surrogate
# scan and pydantic take seconds for a body of tens of megabytes, which on the event loop would
# stall every stream and /health meanwhile. Smaller bodies stay on the loop (no thread hop).
OFF_LOOP_BYTES = 64 * 1024


def _steer_shape(value: Any) -> Any:
    """A ``steer`` body value of a JSON type it can never be (a number, an object, a list of
    non-strings) fails with ``parse_steer``'s message, which names the accepted values, instead of
    pydantic's "Input should be a valid boolean". JSON null is the default (no steering)."""
    if value is None:
        return False
    if isinstance(value, (bool, str)) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    return parse_steer(value)  # raises ValueError for anything else


# the request models' ``steer`` field (both APIs); its values are checked by ``resolve_steer``
SteerValue = Annotated[Union[bool, str, list[str]], BeforeValidator(_steer_shape)]

# Scalar request fields take only their JSON type (a 400 naming the field otherwise): pydantic's lax
# mode would read ``"max_tokens": true`` as 1, ``"10"`` and ``2.0`` as 10 and 2, ``"stream": "yes"``
# as true. A JSON integer is still a valid float.
JsonInt = Annotated[int, Strict()]
JsonFloat = Annotated[float, Strict()]
JsonBool = Annotated[bool, Strict()]


class SFCLFields(BaseModel):
    """SFCL's own request fields, the same in both APIs' request models (which extend this one);
    ``resolve_steer`` and the snapshot-mode rule above read them."""

    model_config = ConfigDict(extra="forbid")
    snapshot_mode: Optional[Literal["off", "triggered", "always"]] = None
    steer: SteerValue = Field(
        False, description="grounded correction when a snapshot fires: true (the default mechanism), false, "
        "'source' (source-constrained entities), 'cad' (adaptive context-aware decoding), 'knn' (library-anchor "
        "mixture) or a '+' combination; header x-sfcl-steer wins")
    ignore_eos: JsonBool = Field(False, description="keep generating past end-of-turn tokens up to the token "
                             "limit (benchmarks; as in vLLM)")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


async def read_body(request: Request) -> bytes:
    """The raw body; raises ApiError 413 past ``MAX_BODY_BYTES`` and ``ClientGone`` when the client
    disconnects before it has sent the whole body."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"body: request body exceeds {MAX_BODY_BYTES} bytes", param="body")
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone() from None
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"body: request body exceeds {MAX_BODY_BYTES} bytes", param="body")
    return raw


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_json(raw: bytes) -> Any:
    """Body bytes -> JSON value; raises ApiError 400 naming ``body`` for an empty body, invalid
    UTF-8 or JSON (``NaN`` / ``Infinity`` included), and naming the field for a lone surrogate."""
    if not raw.strip():
        raise ApiError(400, "body: request body is empty; expected a JSON object", param="body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"body: request body is not valid UTF-8 (byte {e.start})",
                       param="body") from None
    try:
        value = json.loads(text, parse_constant=_no_constants)
    except RecursionError:  # e.g. 100k nested arrays: the decoder runs out of stack
        raise ApiError(400, "body: invalid JSON: nested too deeply", param="body") from None
    except ValueError as e:
        raise ApiError(400, f"body: invalid JSON: {e}", param="body") from None
    where = find_lone_surrogate(value) if _SURROGATE_ESCAPE.search(text) else None
    if where is not None:
        raise ApiError(400, f"{where}: string contains a lone UTF-16 surrogate escape "
                            "(\\ud800-\\udfff without its pair), which is not valid Unicode",
                       param=where)
    return value


async def _off_loop_if_large(size: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker thread when ``size`` (body bytes) exceeds ``OFF_LOOP_BYTES``,
    else on the event loop; its exceptions propagate unchanged either way."""
    if size > OFF_LOOP_BYTES:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)


async def body_json(raw: bytes) -> Any:
    """Body bytes (``read_body``) -> JSON value: ``decode_json``, in a worker thread for a large
    body; raises what it raises."""
    return await _off_loop_if_large(len(raw), decode_json, raw)


def check_message_count(value: Any, max_messages: int | None) -> None:
    """Raises ApiError 400 naming ``messages`` when the JSON body ``value`` holds more messages than
    ``max_messages`` (the context window: every message the APIs accept has content, so each is at
    least one prompt token). Checked before pydantic, whose validation of ~600,000 messages held the
    GIL for ~1.5 s, off the event loop or not."""
    msgs = value.get("messages") if isinstance(value, dict) else None
    if max_messages and isinstance(msgs, list) and len(msgs) > max_messages:
        raise ApiError(400, f"messages: {len(msgs)} messages cannot fit the context window of {max_messages} "
                            "tokens (each message takes at least one token)", param="messages")


def _decode_request(model_cls: type[BaseModel], raw: bytes, max_messages: int | None) -> Any:
    value = decode_json(raw)
    check_message_count(value, max_messages)
    return parse_model(model_cls, value)


def check_json_content_type(request: Request, *, allow_missing: bool = True) -> None:
    """Raises ApiError 415 naming ``body`` unless every ``content-type`` header of the request is JSON
    (``application/json`` or ``application/<type>+json``, any case, any parameters) or, with
    ``allow_missing``, there is none. FastAPI's rule for JSON bodies since 0.65.2 (so vLLM's and other
    FastAPI servers'), stricter on an empty media type and on a second header: a browser sends
    ``text/plain``, a form or ``multipart/form-data`` to another origin without a CORS preflight, and
    ``curl -d`` without ``-H 'content-type: application/json'`` sends a form and gets this error. (A
    body with no content type at all needs no preflight either: ``sfcl.server.auth.check_same_origin``
    refuses those from another origin.)"""
    values = request.headers.getlist("content-type")
    if not values and allow_missing:
        return
    for value in values or [""]:
        ctype = value.split(";")[0].strip().lower()
        main, _, sub = ctype.partition("/")
        if main != "application" or not (sub == "json" or (sub.endswith("+json") and len(sub) > len("+json"))):
            got = clip(ctype) if ctype else ("an empty media type" if values else "none")
            raise ApiError(415, f"body: expected content-type application/json, got {got}", param="body")


async def read_request(request: Request, model_cls: type[BaseModel], max_messages: int | None = None) -> Any:
    """The body as a ``model_cls`` (``check_json_content_type``, ``read_body``, ``decode_json``,
    ``check_message_count``, ``parse_model``; decoding and validation in a worker thread for a large
    body); raises what they raise."""
    check_json_content_type(request)
    raw = await read_body(request)
    return await _off_loop_if_large(len(raw), _decode_request, model_cls, raw, max_messages)


_SURROGATE = re.compile(r"[\ud800-\udfff]")
# The only way a JSON text decoded as strict UTF-8 (which refuses encoded surrogates) can hold a
# surrogate: a "\uD800"-"\uDFFF" escape. Also matches an escaped backslash before "uD8.." and valid
# pairs: then the walk runs and finds nothing.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_surrogate(s: str) -> bool:
    return not s.isascii() and _SURROGATE.search(s) is not None


def _children(v: Any) -> Any:
    return iter(v.items()) if isinstance(v, dict) else enumerate(v)


def find_lone_surrogate(value: Any) -> str | None:
    """Dotted path (``messages.0.content``, ``errors.format_loc``: long keys clipped) of the first
    string (value or key) holding a lone surrogate, else None. ``json.loads`` accepts ``"\\ud800"``
    escapes, but such strings cannot be encoded as UTF-8 (tokenizer, logs, JSON responses), so
    they are the client's error.

    Depth-first with one iterator per open container: memory grows with the nesting depth, not
    with the number of values, and nothing is allocated per value (BUG: a path tuple per value made
    a 32 MB body of 16 million array items take 37 s and gigabytes, holding the GIL)."""
    if isinstance(value, str):
        return format_loc(()) if _has_surrogate(value) else None
    if not isinstance(value, (dict, list)):
        return None
    path: list = []  # keys from the root to the container walked now
    open_: list = [_children(value)]  # iterative: the decoder accepts nesting deeper than recursion could
    while open_:
        for k, item in open_[-1]:
            if type(k) is str and _has_surrogate(k):
                return format_loc((*path, k.encode("utf-8", "backslashreplace").decode("ascii", "replace")))
            if isinstance(item, str):
                if _has_surrogate(item):
                    return format_loc((*path, k))
            elif isinstance(item, (dict, list)):
                path.append(k)
                open_.append(_children(item))
                break
        else:  # this container is done
            open_.pop()
            if path:
                path.pop()
    return None


def parse_model(model_cls: type[BaseModel], data: Any) -> Any:
    """``model_cls`` from a parsed JSON body; raises ApiError 400 naming the field (pydantic's message
    for a body that is not an object named our model class: "instance of ChatCompletionRequest")."""
    if not isinstance(data, dict):
        raise ApiError(400, f"body: must be a JSON object, not a JSON {_json_kind(data)}", param="body")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise validation_api_error(e) from None


def check_neutral(req: BaseModel, neutral: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """Fields of an API that SFCL has no feature for are accepted at the value that means "off"
    (clients and frameworks send some with their defaults: ``presence_penalty: 0``, ``tools: []``);
    ``neutral`` maps each field name to (is the value neutral, what the 400 says otherwise). Raises
    ApiError 400 naming the first field set (not None) to another value."""
    for name, (ok, why) in neutral.items():
        value = getattr(req, name)
        if value is not None and not ok(value):
            raise ApiError(400, f"{name}: {why}", param=name)


def stop_list(value: str | list[str] | None, param: str) -> list[str]:
    """A request's stop sequences (a string or a list; None: none) as a list; raises ApiError 400
    naming ``param`` unless ``sfcl.engine.request.check_stop`` accepts them (how many, how long)."""
    stop = [value] if isinstance(value, str) else list(value or [])
    try:
        check_stop(stop)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return stop


def min_prompt_tokens(engine: EngineClient, messages: list[dict], system: str | None) -> int:
    """At least how many tokens the prompt has, without tokenizing it: its characters over the
    most one token stands for (``sfcl.engine.token_bound``; 0 when ``engine`` has no such bound).
    The chat template renders every message's text (``encode_chat`` tokenizes each one) and only
    adds tokens around it."""
    texts = [str(m.get("content", "")) for m in messages] + [system or ""]
    return min_tokens(texts, getattr(engine, "max_token_chars", None))


def check_model(engine: EngineClient, model: str, openai: bool) -> None:
    if model in (engine.model_name, "default"):
        return
    if openai:
        raise ApiError(404, f"The model '{clip(model)}' does not exist; this server serves "
                            f"'{engine.model_name}'.", param="model", code="model_not_found")
    raise ApiError(404, f"model: {clip(model)} (this server serves '{engine.model_name}')",
                   param="model")


def resolve_tag(request: Request) -> str | None:
    """Header ``x-sfcl-tag`` (e.g. ``high-risk``): metrics label and scheduling priority."""
    tag = request.headers.get(TAG_HEADER)
    if tag is None:
        return None
    tag = tag.strip()
    if not TAG_RE.fullmatch(tag):
        raise ApiError(400, f"{TAG_HEADER}: must be 1-64 characters of letters, digits, '_', '-', '.', ':'",
                       param=TAG_HEADER)
    return tag


def resolve_snapshot_mode(request: Request, body_mode: str | None) -> str:
    """Header ``x-sfcl-snapshot`` > body ``snapshot_mode`` > ``app.state.default_snapshot_mode``."""
    engine: EngineClient = request.app.state.engine
    header = request.headers.get(SNAPSHOT_HEADER)
    explicit = True
    if header is not None:
        mode = header.strip().lower()
        if mode not in SNAPSHOT_MODES:
            raise ApiError(400, f"{SNAPSHOT_HEADER}: invalid value {quote(header)}; expected one of "
                                f"{', '.join(SNAPSHOT_MODES)}", param=SNAPSHOT_HEADER)
    elif body_mode is not None:
        mode = body_mode
    else:
        mode, explicit = request.app.state.default_snapshot_mode, False
    if mode != "off" and not getattr(engine, "snapshots_available", True):
        if explicit:
            src = SNAPSHOT_HEADER if header is not None else "snapshot_mode"
            raise ApiError(400, f"{src}: snapshots are not available on this server "
                                "(no anchor library loaded); use 'off'", param=src)
        mode = "off"
    return mode


def resolve_steer(request: Request, body_steer: Any, mode: str) -> tuple[str, ...]:
    """Header ``x-sfcl-steer`` > body ``steer`` (true / false / "source" / "cad" / "knn" / a
    "+" combination / a list; ``sfcl.snapshot.mechanisms.parse_steer``): the mechanisms, or a 400
    naming the field for an unknown value. Steering acts when a snapshot fires, so asking for it
    with snapshot mode ``off`` is a 400 rather than a silent no-op."""
    header = request.headers.get(STEER_HEADER)
    src = STEER_HEADER if header is not None else "steer"
    try:
        steer = parse_steer(header if header is not None else body_steer)
    except ValueError as e:
        raise ApiError(400, f"{src}: {str(e).removeprefix('steer: ')}", param=src) from None
    if steer and mode == "off":
        raise ApiError(400, f"{src}: steering needs snapshots; use snapshot_mode 'triggered' or 'always'",
                       param=src)
    return steer


async def attach_cad_prompt(engine: EngineClient, params: SamplingParams, messages: list[dict],
                            system: str | None) -> None:
    """For a request that steers with ``cad``: the token ids of the request without its document
    (``sfcl.snapshot.mechanisms.no_document_messages``) go into ``params.cad_prompt_ids`` (left None
    when the request has no document; its events then say so)."""
    if "cad" not in params.steer:
        return
    nd = no_document_messages(messages, system)
    if nd is not None:
        params.cad_prompt_ids = await encode_prompt(engine, *nd)


# Below these the sampler's float32 math breaks (logits / T overflows, top_p rounds to 0) and the
# engine step fails for every request in the batch. Both limits are the greedy limit anyway: a
# temperature under MIN_TEMPERATURE is sampled as 0 (argmax), and a top_p of MIN_TOP_P already
# keeps only the most likely token.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed accepts


def make_params(**kwargs: Any) -> SamplingParams:
    """``SamplingParams`` or a 400 naming the field its ValueError mentions."""
    seed = kwargs.get("seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ApiError(400, f"seed: must be an integer in [-2**63, 2**64 - 1], got {clip(str(seed))}",
                       param="seed")
    temperature = kwargs.get("temperature")
    if isinstance(temperature, (int, float)) and 0.0 < temperature < MIN_TEMPERATURE:
        kwargs["temperature"] = 0.0
    top_p = kwargs.get("top_p")
    if isinstance(top_p, (int, float)) and 0.0 < top_p < MIN_TOP_P:
        kwargs["top_p"] = MIN_TOP_P
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        text = str(e)
        param = next((p for p in ("max_tokens", "temperature", "top_p", "stop", "snapshot")
                      if text.startswith(p)), "body")
        raise ApiError(400, f"{param}: {text}", param=param) from None


async def encode_prompt(engine: EngineClient, messages: list[dict],
                        system: str | None) -> list[int]:
    """Chat template + tokenize; template errors (bad role order...) are the client's: 400.

    Runs in a worker thread: tokenizing a body near MAX_BODY_BYTES takes tens of seconds, which
    on the event loop would stall every other stream, keepalive and /health meanwhile.
    """
    try:
        return list(await anyio.to_thread.run_sync(engine.encode_chat, messages, system))
    except ApiError:
        raise
    except Exception as e:
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, ValueError) or "TemplateError" in names:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        raise


def _json_kind(v: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)

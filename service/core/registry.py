"""The handler registry: message ``type`` → (pydantic model, async function)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from pydantic import BaseModel

#: The connection a handler is given (asyncpg's; typed Any: core imports no driver).
Connection = Any
M = TypeVar("M", bound=BaseModel)
#: What the registry keeps: the payload type erased (each spec carries its model).
HandlerFn = Callable[[Any, Connection], Awaitable[dict[str, Any] | None]]
#: A handler of payload model ``M``, as ``@handler`` types it: mypy rejects a function whose
#: payload parameter is not ``M`` (or a base of it).
TypedHandlerFn = Callable[[M, Any], Awaitable[dict[str, Any] | None]]
#: The entry-point group of handler packages (SPEC §7): each value is a module to import.
ENTRY_POINT_GROUP = "sqs_ingest.handlers"
#: Batch form: [(request_id, payload), …] → results in the same order, or None to decline
#: (the attempt is rolled back, then the messages run one by one through the plain function).
BatchFn = Callable[
    [list[tuple[str, Any]], Connection], Awaitable[list[dict[str, Any] | None] | None]
]
#: The reference handlers' row of ``entities`` for a payload: (entity_id, version, deleted,
#: data as JSON text or None). A batch whose handlers all have one, with no entity twice, is
#: applied by the store in one statement (``Store.apply`` given ``entity_rows``) with the
#: same effect.
EntityRow = tuple[str, int, bool, str | None]
EntityRowFn = Callable[[Any], EntityRow]


@dataclass(frozen=True)
class HandlerSpec:
    name: str
    model: type[BaseModel]
    fn: HandlerFn
    batch_fn: BatchFn | None = None
    entity_row: EntityRowFn | None = None  # the reference handlers' only (EntityRow)


class HandlerConflict(ValueError):
    """Two handlers for one message type (two handler packages, or one module twice)."""


class HandlerLoadError(Exception):
    """A handler package or INGEST_HANDLERS module that cannot be imported: one line."""


class Registry:
    def __init__(self) -> None:
        self._specs: dict[str, HandlerSpec] = {}
        #: How bodies map to request_id, type and payload (``service.core.messages.Envelope``;
        #: None: the standard envelope). Set from the settings by ``sqs-ingest run``.
        self.envelope: object | None = None
        #: INGEST_MAX_JSON_VALUES (None: ``service.core.limits.MAX_JSON_VALUES``).
        self.max_json_values: int | None = None

    def register(self, type_: str, model: type[BaseModel], fn: HandlerFn) -> None:
        existing = self._specs.get(type_)
        if existing is not None and existing.fn is not fn:
            raise HandlerConflict(f"handler for {type_!r} registered twice: by "
                                  f"{_origin(existing.fn)} and by {_origin(fn)}")
        self._specs[type_] = HandlerSpec(type_, model, fn)

    def register_batch(self, type_: str, fn: BatchFn) -> None:
        spec = self._specs.get(type_)
        if spec is None:
            raise ValueError(f"register the handler for {type_!r} before its batch form")
        self._specs[type_] = dataclasses.replace(spec, batch_fn=fn)

    def register_entity_row(self, type_: str, fn: EntityRowFn) -> None:
        """For the reference handlers (``service.handlers.entities``) only: the row their
        plain function writes, so the store can apply a batch of them in one statement."""
        spec = self._specs.get(type_)
        if spec is None:
            raise ValueError(f"register the handler for {type_!r} before its entity row")
        self._specs[type_] = dataclasses.replace(spec, entity_row=fn)

    def get(self, type_: str) -> HandlerSpec | None:
        return self._specs.get(type_)

    def types(self) -> list[str]:
        return sorted(self._specs)

    def __contains__(self, type_: str) -> bool:
        return type_ in self._specs


#: The process-wide registry the ``@handler`` decorator writes to.
default_registry = Registry()


@overload
def handler(type_: str) -> Callable[[TypedHandlerFn[M]], TypedHandlerFn[M]]: ...
@overload
def handler(type_: str, model: type[M]) -> Callable[[TypedHandlerFn[M]], TypedHandlerFn[M]]: ...


def handler(type_: str, model: type[BaseModel] | None = None) -> Callable[[Any], Any]:
    """Register ``fn`` as the handler of messages whose ``type`` is ``type_``.

    The payload model is read from the annotation of the function's first parameter
    (``async def f(payload: Invoice, conn)``), or given explicitly (``@handler("t", Invoice)``,
    which must then agree with the annotation). The function runs inside the transaction
    that marks the request COMPLETED; what it returns is stored as ``modifications.result``.
    A payload failing the model is a poison message; an exception from the function is
    transient (retried, then dead-lettered).
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        default_registry.register(type_, payload_model(type_, fn, model), fn)
        return fn

    return register


def payload_model(type_: str, fn: Callable[..., Any],
                  given: type[BaseModel] | None = None) -> type[BaseModel]:
    """The pydantic model of ``fn``'s payload: ``given``, else the annotation of its first
    parameter; a TypeError says what to write when neither names a model, or they differ."""
    params = list(inspect.signature(fn).parameters.values())
    annotated: object = None
    if params:
        try:
            annotated = typing.get_type_hints(fn).get(params[0].name)
        except Exception:  # an annotation that does not resolve: as if there were none
            annotated = None
    is_model = isinstance(annotated, type) and issubclass(annotated, BaseModel)
    if given is None:
        if not is_model:
            raise TypeError(f"@handler({type_!r}) on {fn.__qualname__}: annotate its payload "
                            "parameter with a pydantic model, or pass the model: "
                            f"@handler({type_!r}, Model)")
        return typing.cast(type[BaseModel], annotated)
    if is_model and not issubclass(given, typing.cast(type, annotated)):
        raise TypeError(f"@handler({type_!r}, {given.__name__}) on {fn.__qualname__}: its "
                        f"payload parameter is annotated {typing.cast(type, annotated).__name__}")
    return given


def batch_handler(*types: str) -> Callable[[BatchFn], BatchFn]:
    """Optional batch form of already registered handlers (one call for many messages).

    Messages of all ``types`` given share a batch. It must have exactly the effect of
    calling the plain handlers one by one; returning None declines (say, for a case it
    does not handle): the transaction is rolled back — what it wrote is undone — and
    they run one by one. If it raises, the transaction is rerun one message at a time to
    find the failing one.
    """

    def register(fn: BatchFn) -> BatchFn:
        for t in types:
            default_registry.register_batch(t, fn)
        return fn

    return register


def load_handler_modules(modules: list[str]) -> None:
    """Import every installed handler package (entry points ``sqs_ingest.handlers``), then the
    modules INGEST_HANDLERS names; their decorators register the handlers. A module that
    cannot be imported raises HandlerLoadError naming where it came from; two handlers for
    one type raise HandlerConflict naming both."""
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                     key=lambda e: (e.dist.name if e.dist else "", e.name)):
        dist = ep.dist.name if ep.dist else "?"
        _import(ep.value, f"handler package {dist} (entry point {ENTRY_POINT_GROUP} "
                          f"{ep.name} = {ep.value})")
    for name in modules:
        _import(name, f"INGEST_HANDLERS module {name}")


def _import(module: str, where: str) -> None:
    try:
        importlib.import_module(module)
    except HandlerConflict:
        raise
    except Exception as exc:
        raise HandlerLoadError(f"{where} cannot be imported: {type(exc).__name__}: {exc}") \
            from exc


def _origin(fn: Callable[..., Any]) -> str:
    """``distribution (module.function)`` of a handler, or the module alone."""
    module = getattr(fn, "__module__", "?")
    top = module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    where = f"{module}.{getattr(fn, '__qualname__', '?')}"
    return f"{dists[0]} ({where})" if dists else where

from __future__ import annotations

import sys
import textwrap

import pytest
from pydantic import BaseModel

from service.handlers import Registry, default_registry, load_handler_modules


class P(BaseModel):
    x: int


async def fn(p: P, conn: object) -> dict[str, int]:
    return {"x": p.x}


async def other(p: P, conn: object) -> None:
    return None


def test_register_and_get() -> None:
    r = Registry()
    r.register("a.b", P, fn)
    spec = r.get("a.b")
    assert spec is not None and spec.model is P and spec.fn is fn
    assert "a.b" in r and r.get("nope") is None
    assert r.types() == ["a.b"]


def test_same_type_twice_is_an_error() -> None:
    r = Registry()
    r.register("a.b", P, fn)
    r.register("a.b", P, fn)  # re-import of the same module is harmless
    with pytest.raises(ValueError, match="registered twice"):
        r.register("a.b", P, other)


def test_handlers_module_registers_through_decorator(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_handlers_mod.py").write_text(textwrap.dedent("""
        from pydantic import BaseModel
        from service.handlers import handler

        class Invoice(BaseModel):
            amount: int

        @handler("invoice.created.test", Invoice)
        async def invoice_created(payload, conn):
            return {"amount": payload.amount}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    load_handler_modules(["my_handlers_mod"])
    spec = default_registry.get("invoice.created.test")
    assert spec is not None and spec.model.__name__ == "Invoice"
    sys.modules.pop("my_handlers_mod", None)


class Q(BaseModel):
    y: str


def test_the_model_is_read_from_the_payload_annotation() -> None:
    from service.core.registry import payload_model

    assert payload_model("t", fn) is P
    assert payload_model("t", fn, P) is P


def test_an_unannotated_handler_without_a_model_is_refused() -> None:
    from service.core.registry import payload_model

    async def bare(payload, conn):
        return None

    with pytest.raises(TypeError, match=r"annotate its payload parameter.*@handler\('t', Model\)"):
        payload_model("t", bare)


def test_an_explicit_model_that_contradicts_the_annotation_is_refused() -> None:
    from service.core.registry import payload_model

    with pytest.raises(TypeError, match="annotated P"):
        payload_model("t", fn, Q)


def test_the_decorator_without_a_model(tmp_path, monkeypatch) -> None:
    (tmp_path / "typed_handlers_mod.py").write_text(textwrap.dedent("""
        from pydantic import BaseModel
        from service.handlers import handler

        class Paid(BaseModel):
            amount: int

        @handler("invoice.paid.typed")
        async def paid(payload: Paid, conn) -> dict | None:
            return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    load_handler_modules(["typed_handlers_mod"])
    spec = default_registry.get("invoice.paid.typed")
    assert spec is not None and spec.model.__name__ == "Paid"
    sys.modules.pop("typed_handlers_mod", None)


def test_mypy_catches_a_handler_whose_payload_is_not_the_model(tmp_path) -> None:
    """HandlerFn used to erase the payload type: @handler("t", A) on a function taking B
    type-checked."""
    import os
    import subprocess
    from pathlib import Path

    src = tmp_path / "wrong_model.py"
    src.write_text(textwrap.dedent("""
        from typing import Any
        from pydantic import BaseModel
        from service.handlers import handler

        class A(BaseModel):
            a: int

        class B(BaseModel):
            b: int

        @handler("t.right", A)
        async def right(payload: A, conn: Any) -> dict[str, Any] | None:
            return None

        @handler("t.wrong", A)
        async def wrong(payload: B, conn: Any) -> dict[str, Any] | None:
            return None
    """))
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
         "--ignore-missing-imports", "--config-file=/dev/null", str(src)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "MYPYPATH": str(root)})
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "wrong_model.py:16" in errors[0], done.stdout

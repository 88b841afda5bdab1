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

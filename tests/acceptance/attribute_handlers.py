"""A handler the extended-client tests load into the real daemon (INGEST_HANDLERS): it
stores, as its result, the message attributes the daemon showed it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from service.handlers import current_attributes, handler


class Echo(BaseModel):
    note: str


@handler("attributes.echo", Echo)
async def echo(payload: Echo, conn: Any) -> dict[str, Any]:
    return {"note": payload.note, "attributes": {k: dict(v) for k, v in
                                                 current_attributes().items()}}

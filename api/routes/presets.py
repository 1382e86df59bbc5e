"""Model presets a plan request can name: ``/v1/presets``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api import store
from api.bodies import FiniteJSONRoute
from api.schemas import PresetOut
from planner.errors import AutoparError
from planner.presets import get_preset, list_presets

router = APIRouter(route_class=FiniteJSONRoute, tags=["models"])


@router.get("/v1/presets")
def presets() -> list[PresetOut]:
    """Model presets a plan request can name (``model.preset``)."""
    return [PresetOut(name=n, spec=get_preset(n)) for n in list_presets()]


@router.get("/v1/presets/{name}", responses={404: {"description": "unknown preset"}})
def preset(name: Annotated[str, Path(max_length=200)]) -> PresetOut:
    try:
        return PresetOut(name=name, spec=get_preset(name))
    except AutoparError:
        raise store.NotFound("preset", name) from None

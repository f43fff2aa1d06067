"""The playground: a page at ``/`` (compare adapters, tune their scale, chat,
manage adapters, watch the metrics) calling the server's own API.

    GET /              the page (mola/server/ui/index.html)
    GET /ui/{file}     its stylesheet and scripts

Plain files from the package, no build step and nothing fetched from
elsewhere, so it works offline. The page is open like /health; what it calls
(/v1, /metrics) needs the keys as over REST, and the page keeps them in its
memory only. ``--no-ui`` leaves these routes out (``/`` is then a 404).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parent.parent / "ui"

# Scripts, styles and connections from this origin only; the page is not framed and sends no referrer.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

router = APIRouter()


class UIFiles(StaticFiles):
    """The page's files, checked again at every load (ETag), so an upgraded mola is never
    served half old scripts."""

    async def get_response(self, path: str, scope):
        response = await super().get_response(path, scope)
        response.headers["Cache-Control"] = "no-cache"
        return response


@router.get("/", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=HEADERS)


def install(app: FastAPI) -> None:
    """Serve the playground at ``/`` and its files under ``/ui``."""
    app.include_router(router)
    app.mount("/ui", UIFiles(directory=UI_DIR), name="ui")

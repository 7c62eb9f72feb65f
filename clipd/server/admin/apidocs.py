"""The admin API's documentation page, ``/docs``, served entirely from this server (no CDN).

Swagger UI's files come from the ``swagger-ui-bundle`` package and are mounted
at ``/docs/assets``. That package ships Swagger UI 4, which renders OpenAPI 3.0
only, while FastAPI writes 3.1: the page therefore reads ``/docs/openapi.json``,
the same document expressed in 3.0 (``anyOf [X, null]`` becomes ``nullable``).
``/openapi.json`` stays FastAPI's own 3.1 document. None of these routes hold
data, so none asks for credentials.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

DOCS = "/docs"
ASSETS = "/docs/assets"
SPEC_30 = "/docs/openapi.json"
_NULL = {"type": "null"}


def swagger_ui_dir() -> str:
    """The folder of Swagger UI's dist files (``swagger-ui-bundle.js``, ``swagger-ui.css``...)."""
    import swagger_ui_bundle

    return swagger_ui_bundle.swagger_ui_path


def openapi_30(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` (OpenAPI 3.1) as OpenAPI 3.0.3, for renderers that read 3.0 only.

    Handles what FastAPI's schemas use: null in ``anyOf``/``oneOf`` or in a ``type``
    list becomes ``nullable: true``, and ``const`` becomes a one-value ``enum``.
    """

    def schema(node: Any) -> Any:
        if isinstance(node, list):
            return [schema(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {key: (value if key in ("example", "examples", "default", "enum") else schema(value))
               for key, value in node.items()}
        for key in ("anyOf", "oneOf"):
            options = out.get(key)
            if isinstance(options, list) and _NULL in options:
                rest = [x for x in options if x != _NULL]
                out["nullable"] = True
                if len(rest) == 1 and isinstance(rest[0], dict) and "$ref" not in rest[0]:
                    del out[key]
                    out = {**rest[0], **out}
                else:
                    out[key] = rest
        kinds = out.get("type")
        if isinstance(kinds, list):
            others = [k for k in kinds if k != "null"]
            if len(others) < len(kinds):
                out["nullable"] = True
            if len(others) == 1:
                out["type"] = others[0]
            else:
                del out["type"]
                out["anyOf"] = [{"type": k} for k in others]
        if "const" in out:
            out["enum"] = [out.pop("const")]
        return out

    converted = schema(document)
    converted["openapi"] = "3.0.3"
    return converted


def mount_docs(app: FastAPI, title: str | None = None) -> None:
    """Adds ``/docs`` (Swagger UI), ``/docs/openapi.json`` (3.0) and ``/docs/assets`` to ``app``."""
    page_title = title or f"{app.title} - API documentation"

    @app.get(DOCS, include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + SPEC_30,
            title=page_title,
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},  # the validator badge would call validator.swagger.io
        )

    @app.get(SPEC_30, include_in_schema=False)
    def openapi_for_swagger_ui() -> JSONResponse:
        return JSONResponse(openapi_30(app.openapi()))

    app.mount(ASSETS, StaticFiles(directory=swagger_ui_dir()), name="docs-assets")

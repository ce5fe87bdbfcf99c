"""What the HTTP front serves: its routes by path and method, the error shape of each route,
CORS, and the gateway and drain behind them. Filled by front/http.py's `build`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tokenpipe.errors import GatewayError
from tokenpipe.front.drain import Drain
from tokenpipe.front.wire import Request, Response, StreamResponse
from tokenpipe.pipeline import Gateway

RouteHandler = Callable[[Request], Awaitable[Response | StreamResponse]]
#: An API's JSON body for an error (`Dialect.error_body`).
ErrorBody = Callable[[GatewayError], bytes]


class Front:
    """The front's routes and what they share."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.drain = Drain()
        #: path -> method -> handler (GET routes answer HEAD too).
        self.routes: dict[str, dict[str, RouteHandler]] = {}
        #: Routes with one trailing parameter (`/v1/models/{model}`): template -> (the
        #: prefix before the parameter, method -> handler). Looked at only when no path
        #: matches exactly; the parameter is the rest of the path, slashes included (model
        #: names such as `org/model` have them), and never empty.
        self.templates: dict[str, tuple[str, dict[str, RouteHandler]]] = {}
        #: The routes whose API writes errors in a shape of its own, by path; every other
        #: route answers OpenAI's. Keyed by path, not set by the handler, so that every error
        #: on such a route takes its shape: those raised before the handler runs (405, the
        #: drain's 503) and those raised below it (auth, an unknown model, the limiter's 429).
        self.error_bodies: dict[str, ErrorBody] = {}
        #: Routes that both APIs' clients call (GET /v1/models), by path: (a header, the error
        #: shape of a request that carries it), e.g. Anthropic's for `anthropic-version`.
        self.header_error_bodies: dict[str, tuple[str, ErrorBody]] = {}
        #: Allowed CORS origins (front/cors.py); None: CORS is off.
        self.cors: frozenset[str] | None = None

    def add(self, method: str, path: str, handler: RouteHandler) -> None:
        """`path`: exact, or a template ending in one `{parameter}`."""
        prefix, brace, _ = path.partition("{")
        if brace:
            self.templates.setdefault(path, (prefix, {}))[1][method] = handler
        else:
            self.routes.setdefault(path, {})[method] = handler

    def route(self, path: str) -> tuple[str, dict[str, RouteHandler]] | None:
        """The route serving `path`: (its template, method -> handler), or None."""
        methods = self.routes.get(path)
        if methods is not None:
            return path, methods
        for template, (prefix, methods) in self.templates.items():
            if path.startswith(prefix) and len(path) > len(prefix):
                return template, methods
        return None

    def served(self) -> str:
        """The routes, for a 404 that says what is served."""
        table = {**self.routes, **{t: m for t, (_, m) in self.templates.items()}}
        return ", ".join(
            f"{method} {path}" for path, methods in table.items() for method in methods
        )

    def error_body(self, request: Request) -> ErrorBody | None:
        """The error shape of the request's route, or of its client on a shared route
        (None: OpenAI's)."""
        found = self.route(request.path)
        template = found[0] if found is not None else request.path
        body = self.error_bodies.get(template)
        if body is None:
            entry = self.header_error_bodies.get(template)
            if entry is not None and entry[0] in request.headers:
                body = entry[1]
        return body

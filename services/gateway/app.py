"""The stateless aiohttp gateway: tenant auth, the routes of docs/api.md, problem+json errors.

The tenant comes from the API key alone (never from a body). Bodies are decoded once with typed
msgspec decoders; domain errors become one problem-details body here and nowhere else. The gateway
keeps no session state: every turn goes to the session's actor through a SessionRouter, so two
gateway processes can serve the same sessions.
"""

from __future__ import annotations

from aiohttp import web

from services.gateway.builtin_routes import add_builtin_routes
from services.gateway.common import DEPS, MAX_BODY, GatewayDeps
from services.gateway.config_routes import add_config_routes
from services.gateway.dashboard import add_dashboard_routes
from services.gateway.job_routes import add_job_routes
from services.gateway.live_routes import add_live_routes
from services.gateway.mcp_routes import add_mcp_routes
from services.gateway.middleware import auth_middleware, errors_middleware
from services.gateway.ops_routes import add_ops_routes
from services.gateway.session_routes import add_session_routes
from services.gateway.tool_routes import add_tool_routes


def build_app(deps: GatewayDeps) -> web.Application:
    """The gateway app over `deps`: its middlewares, then every route module's routes, in the
    order they are matched (/v1/tools/contract before /v1/tools/{name})."""
    app = web.Application(middlewares=[errors_middleware, auth_middleware], client_max_size=MAX_BODY)
    app[DEPS] = deps
    add_session_routes(app)
    add_live_routes(app)
    add_tool_routes(app)
    add_job_routes(app)
    add_config_routes(app)
    add_ops_routes(app)
    add_builtin_routes(app)
    add_dashboard_routes(app)
    add_mcp_routes(app)
    return app

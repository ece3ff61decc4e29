"""Runtime admin API for profiles: GET/PUT/DELETE /admin/profiles/{name}, GET /admin/profiles.

Enabled only when an admin token is configured (TOOLQUAKE_ADMIN_TOKEN); every call needs
`Authorization: Bearer <token>`. A PUT is validated like the config file; an invalid one changes nothing. A PUT
adding a profile past `[server] max_profiles` gets 409 `too_many_profiles`.
The token changes profiles, never hosts, paths, environment variables or secrets: a PUT that sets a perturber's
or a remedy's operator-only parameter (`Perturber.operator_only`) is refused with 403, and GET shows URLs without
credentials.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, Response, route

from toolquake import remedies
from toolquake.perturbers import operator_only_set, shown_params
from toolquake.proxy.server.config import ConfigError, ProfileSpec, decode_profile, shown_name
from toolquake.proxy.server.errors import error_body
from toolquake.proxy.server.profiles import TooManyProfiles

if TYPE_CHECKING:
    from toolquake.proxy.server.state import ProxyState

JSON = "application/json"


def _err(status: int, message: str, code: str) -> Response:
    kind = {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")
    return Response(content=error_body(message, kind, code), status_code=status, media_type=JSON)


def _authorized(st: ProxyState, request: Request) -> bool:
    given = request.headers.get("authorization", "")
    expected = f"Bearer {st.admin_token}"
    return hmac.compare_digest(given.encode(), expected.encode())


def _refused(spec: ProfileSpec, current: ProfileSpec | None) -> str | None:
    """Why the admin may not set `spec` (an operator-only parameter of a perturber or a remedy), or None. The
    operator's own values for the same step of the profile being replaced may be sent back unchanged (a GET,
    edited, PUT again)."""
    for key, known in (("perturbers", None), ("remedies", remedies.registry())):
        theirs = getattr(current, key) if current is not None else []
        for i, step in enumerate(getattr(spec, key)):
            mine = theirs[i] if i < len(theirs) else None
            allowed = mine.params if mine is not None and mine.name == step.name else None
            names = operator_only_set(step.name, step.params, allowed, known)
            if names:
                listed = ", ".join(repr(n) for n in names)
                return (f"{key}[{i}] ({step.name}): {listed} may only be set by the operator, in the config file or "
                        "the environment (hosts, paths, environment variables and keys are not the admin API's to "
                        "choose); leave it out to use the operator's default.")
    return None


def routes(st: ProxyState) -> list[Any]:
    def guard(request: Request) -> Response | None:
        if not st.admin_token:
            return _err(404, "The admin API is disabled; set TOOLQUAKE_ADMIN_TOKEN to enable it.", "admin_disabled")
        if not _authorized(st, request):
            return _err(401, "Missing or wrong admin token (Authorization: Bearer <TOOLQUAKE_ADMIN_TOKEN>).",
                        "invalid_admin_token")
        return None

    def profile_json(name: str) -> dict[str, Any]:
        spec = msgspec.to_builtins(st.profiles.get(name).spec)
        for step in [*spec.get("perturbers", []), *spec.get("remedies", [])]:
            if isinstance(step.get("params"), dict):
                step["params"] = shown_params(step["params"])
        return {"name": name, **spec}

    @route("/admin/profiles", http_method=["GET"], name="admin_list")
    async def list_profiles(request: Request) -> Response:
        if (denied := guard(request)) is not None:
            return denied
        body = {"profiles": [profile_json(n) for n in st.profiles.names()]}
        return Response(content=msgspec.json.encode(body), media_type=JSON)

    @route("/admin/profiles/{name:str}", http_method=["GET", "PUT", "DELETE"], name="admin_profile", status_code=200)
    async def one_profile(request: Request, name: str) -> Response:
        if (denied := guard(request)) is not None:
            return denied
        if request.method == "GET":
            if st.profiles.get(name) is None:
                return _err(404, f"Unknown profile {shown_name(name)}.", "unknown_profile")
            return Response(content=msgspec.json.encode(profile_json(name)), media_type=JSON)
        if name == "off":
            return _err(400, "Profile 'off' is built in and cannot be changed.", "reserved_profile")
        if request.method == "DELETE":
            if not st.profiles.delete(name):
                return _err(404, f"Unknown profile {shown_name(name)}.", "unknown_profile")
            return Response(content=b"", status_code=204)
        try:
            spec = decode_profile(await request.body(), name)
            current = st.profiles.get(name)
            if (why := _refused(spec, current.spec if current is not None else None)) is not None:
                return _err(403, why, "operator_only_parameter")
            profile = st.profiles.put(name, spec)
            if st.warm is not None:
                st.warm([profile])
        except TooManyProfiles as exc:
            return _err(409, str(exc), "too_many_profiles")
        except (ConfigError, ValueError) as exc:
            return _err(400, str(exc), "invalid_profile")
        return Response(content=msgspec.json.encode(profile_json(name)), media_type=JSON)

    return [list_profiles, one_profile]

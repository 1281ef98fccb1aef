"""Projects: named containers of conversations per owner, with per-owner agent
configuration overrides.

Overrides are stored in the owner's project record and applied when a run
*renders* its agent (:func:`render_agent_config` returns a new dict); they are
never written into shared agent definitions, so one owner's override cannot
leak into another owner's runs.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import kv

from .codec import dumps, loads
from .errors import NotFound
from .keyspace import SessionsKeyspace
from .owners import OwnerLike, as_tag
from .transcript import check_session_id

__all__ = ["Projects", "ProjectInfo", "render_agent_config", "MAX_PROJECT_NAME", "MAX_OVERRIDE_BYTES"]

MAX_PROJECT_NAME = 256
#: The whole project record (all agents' overrides) must fit one value.
MAX_OVERRIDE_BYTES = 64_000
assert MAX_OVERRIDE_BYTES < kv.limits.VALUE_SIZE_LIMIT


@dataclass(frozen=True, slots=True)
class ProjectInfo:
    id: str
    owner: str
    name: str
    created: float
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)


def render_agent_config(base: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A new config: ``base`` deep-merged with ``overrides`` (dicts merge, other values
    replace). Neither argument is modified."""
    out = copy.deepcopy(dict(base))
    for k, v in (overrides or {}).items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = render_agent_config(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _info(rec: dict[str, Any]) -> ProjectInfo:
    return ProjectInfo(rec["id"], rec["owner"], rec["name"], rec["created"], rec.get("agents") or {})


class Projects:
    def __init__(self, db: Any, root: "kv.Subspace | None" = None, *, clock: Callable[[], float] = time.time,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self.db = db
        self.keys = SessionsKeyspace(root)
        self.clock = clock
        self.new_id = new_id

    async def _get(self, tr: Any, tag: str, pid: str) -> dict[str, Any]:
        raw = await tr.get(self.keys.project(tag, pid))
        rec = loads(raw) if raw is not None else None
        if rec is None or rec.get("owner") != tag:
            raise NotFound(f"project {pid!r} not found")
        return rec

    async def create(self, owner: OwnerLike, name: str, *, project_id: str | None = None,
                     agents: Mapping[str, Mapping[str, Any]] | None = None) -> ProjectInfo:
        """Guarded: an existing project with this id is returned unchanged."""
        tag = as_tag(owner)
        if not isinstance(name, str) or not name or len(name) > MAX_PROJECT_NAME:
            raise ValueError(f"a project name is a non-empty string of at most {MAX_PROJECT_NAME} characters")
        pid = check_session_id(project_id or self.new_id())
        rec = {"owner": tag, "id": pid, "name": name, "created": self.clock(),
               "agents": {k: dict(v) for k, v in (agents or {}).items()}}
        body = dumps(rec)
        if len(body) > MAX_OVERRIDE_BYTES:
            raise ValueError(f"project record of {len(body)} bytes exceeds {MAX_OVERRIDE_BYTES}")

        async def fn(tr: Any) -> ProjectInfo:  # guarded: an existing record is returned unchanged
            try:
                return _info(await self._get(tr, tag, pid))
            except NotFound:
                tr.set(self.keys.project(tag, pid), body)
                return _info(rec)

        return await self.db.transact(fn)

    async def get(self, owner: OwnerLike, project_id: str) -> ProjectInfo:
        tag = as_tag(owner)
        return await self.db.transact(lambda tr: self._info_tr(tr, tag, project_id))  # read-only

    async def _info_tr(self, tr: Any, tag: str, pid: str) -> ProjectInfo:
        return _info(await self._get(tr, tag, pid))

    async def list(self, owner: OwnerLike, *, limit: int = 1_000) -> list[ProjectInfo]:
        tag = as_tag(owner)

        async def fn(tr: Any) -> list[ProjectInfo]:  # read-only
            r = self.keys.projects_range(tag)
            return [_info(loads(row.value)) for row in await tr.get_range(r.start, r.stop, limit=limit)
                    if loads(row.value).get("owner") == tag]

        return await self.db.transact(fn)

    async def rename(self, owner: OwnerLike, project_id: str, name: str) -> ProjectInfo:
        return await self._update(owner, project_id, lambda rec: rec.update(name=name))

    async def set_agent_overrides(self, owner: OwnerLike, project_id: str, agent: str,
                                  overrides: Mapping[str, Any] | None) -> ProjectInfo:
        """Set (or with None, remove) one agent's overrides for this owner's project. Idempotent."""
        def change(rec: dict[str, Any]) -> None:
            agents = rec.setdefault("agents", {})
            if overrides is None:
                agents.pop(agent, None)
            else:
                agents[agent] = dict(overrides)

        return await self._update(owner, project_id, change)

    async def agent_overrides(self, owner: OwnerLike, project_id: str, agent: str) -> dict[str, Any]:
        return (await self.get(owner, project_id)).agents.get(agent, {})

    async def _update(self, owner: OwnerLike, project_id: str, change: Callable[[dict[str, Any]], None]) -> ProjectInfo:
        tag = as_tag(owner)

        async def fn(tr: Any) -> ProjectInfo:  # idempotent: re-reads and rewrites the record
            rec = await self._get(tr, tag, project_id)
            change(rec)
            body = dumps(rec)
            if len(body) > MAX_OVERRIDE_BYTES:
                raise ValueError(f"project record of {len(body)} bytes exceeds {MAX_OVERRIDE_BYTES}")
            tr.set(self.keys.project(tag, project_id), body)
            return _info(rec)

        return await self.db.transact(fn)

    async def add_session(self, owner: OwnerLike, project_id: str, session_id: str) -> None:
        """File a session under the project. Idempotent."""
        tag = as_tag(owner)

        async def fn(tr: Any) -> None:  # idempotent: sets an index key
            await self._get(tr, tag, project_id)
            tr.set(self.keys.project_member(tag, project_id, check_session_id(session_id)), b"")

        await self.db.transact(fn)

    async def sessions(self, owner: OwnerLike, project_id: str, *, limit: int = 1_000) -> list[str]:
        tag = as_tag(owner)

        async def fn(tr: Any) -> list[str]:  # read-only
            await self._get(tr, tag, project_id)
            r = self.keys.project_members_range(tag, project_id)
            rows = await tr.get_range(r.start, r.stop, limit=limit)
            return [kv.tuple.unpack(row.key[len(self.keys.base.key()):])[-1] for row in rows]

        return await self.db.transact(fn)

    async def delete(self, owner: OwnerLike, project_id: str) -> None:
        """Remove the project and its listing (sessions stay). Idempotent for the owner;
        a foreign or missing project is NotFound."""
        tag = as_tag(owner)

        async def fn(tr: Any) -> None:  # idempotent: clears (NotFound once gone)
            await self._get(tr, tag, project_id)
            tr.clear(self.keys.project(tag, project_id))
            r = self.keys.project_members_range(tag, project_id)
            tr.clear_range(r.start, r.stop)

        await self.db.transact(fn)
